// Process groups for 2-D parallelism: tensor-parallel (TP) groups of `tp_degree` ranks and
// data-parallel (DP) groups across them.
//
// Ranks are laid out in `order` (a permutation of the world's ranks; by default 0..size-1, and
// later the placement planner's ring order). Consecutive blocks of tp_degree ranks in that order
// form the TP groups; ranks at the same position of every block form a DP group. For 8 ranks
// at TP=2: TP groups {0,1} {2,3} {4,5} {6,7}; DP groups {0,2,4,6} {1,3,5,7}.
//
//   auto groups = loom::make_parallel_groups(*rt->world_comm(), /*tp_degree=*/2);
//   groups.tensor_parallel->all_reduce(partial_sum);   // within the TP group
//   groups.data_parallel->all_reduce(grad, {loom::ReduceOp::Avg});
#pragma once

#include <memory>
#include <vector>

#include "loom/comm/communicator.h"

namespace loom {

struct ParallelGroups {
  int tp_degree = 1;
  int dp_degree = 1;
  int tp_rank = 0;  // this process's rank in its TP group
  int dp_rank = 0;  // this process's rank in its DP group
  std::vector<int> order;  // world ranks in layout order
  std::shared_ptr<Communicator> tensor_parallel;
  std::shared_ptr<Communicator> data_parallel;
};

// Collective over `world`. Throws loom::InvalidArgumentError (on every rank, before any
// communication) when tp_degree does not divide the world size or order is not a permutation.
// dp_rings (optional, a placement plan's): for each DP group, its world ranks in ring order, which
// becomes the group's rank order (so a ring all-reduce follows the planned links).
ParallelGroups make_parallel_groups(Communicator& world, int tp_degree, const std::vector<int>& order = {},
                                    const std::vector<std::vector<int>>& dp_rings = {});

}  // namespace loom
