// Process groups for every dimension of a parallel layout (loom/parallel/layout.h): one
// communicator per dimension, holding the ranks that differ from this one only along it.
//
// Ranks are laid out in `order` (a permutation of the world's ranks: position p of the layout is
// world rank order[p]; by default 0..size-1, and with a placement plan its order). For 8 ranks at
// "dp=4,tp=2": TP groups {0,1} {2,3} {4,5} {6,7}; DP groups {0,2,4,6} {1,3,5,7}. At
// "dp=2,pp=2,tp=2" the pipelines are {0,2} {1,3} {4,6} {5,7}, stage by stage.
//
//   auto groups = loom::make_parallel_groups(*rt->world_comm(), loom::ParallelLayout::standard(8, 2, 2));
//   groups.group("tp")->all_reduce(partial_sum);              // within the TP group
//   groups.group("dp")->all_reduce(grad, {loom::ReduceOp::Avg});
//   groups.rank("pp");                                        // this rank's pipeline stage
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/parallel/layout.h"

namespace loom {

struct ParallelGroups {
  ParallelLayout layout;
  std::vector<int> order;  // world ranks in layout order
  int position = 0;        // this process's position in the layout
  // One communicator per dimension of the layout, by name.
  std::map<std::string, std::shared_ptr<Communicator>, std::less<>> by_dimension;

  // The communicator of a dimension; for one the layout lacks, a group of this rank alone (built with
  // the others). loom::InvalidArgumentError for a name neither the layout nor the shorthands know.
  const std::shared_ptr<Communicator>& group(std::string_view name) const;
  int rank(std::string_view name) const { return layout.coordinate(position, name); }
  int size(std::string_view name) const { return layout.size(name); }

  // Shorthands for the tensor- and data-parallel dimensions ("tp" and "dp"), filled from the layout.
  int tp_degree = 1;
  int dp_degree = 1;
  int tp_rank = 0;  // this process's rank in its TP group
  int dp_rank = 0;  // this process's rank in its DP group
  std::shared_ptr<Communicator> tensor_parallel;
  std::shared_ptr<Communicator> data_parallel;
};

// Rings for some dimensions: for each group of the dimension (in ParallelLayout::groups order), its
// world ranks in ring order, which becomes the group's rank order (so a ring all-reduce follows the
// planned links). Only dimensions without a meaning of their own in rank order take one: a
// pipeline's ranks are its stages, in order.
using GroupRings = std::map<std::string, std::vector<std::vector<int>>, std::less<>>;

// Collective over `world`: every rank calls it with the same layout, order and rings. Throws
// loom::InvalidArgumentError (on every rank, before any communication) when the layout's size is
// not the world's, order is not a permutation, or a ring does not match its group.
ParallelGroups make_parallel_groups(Communicator& world, const ParallelLayout& layout,
                                    const std::vector<int>& order = {}, const GroupRings& rings = {});

// The two-dimensional layout "dp=<size/tp_degree>,tp=<tp_degree>"; dp_rings are the DP dimension's
// rings (indexed by TP rank).
ParallelGroups make_parallel_groups(Communicator& world, int tp_degree, const std::vector<int>& order = {},
                                    const std::vector<std::vector<int>>& dp_rings = {});

}  // namespace loom
