// make_parallel_groups: one split of the world per dimension of the layout (and one-rank groups
// for the library's own dimensions the layout lacks), every check made before the first split.
#include "loom/comm/groups.h"

#include <algorithm>

#include "loom/error.h"

namespace loom {

namespace {

std::vector<int> checked_order(const std::vector<int>& given, int size, const std::string& where) {
  std::vector<int> order = given;
  if (order.empty())
    for (int r = 0; r < size; ++r) order.push_back(r);
  std::vector<int> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  bool permutation = static_cast<int>(sorted.size()) == size;
  for (int r = 0; permutation && r < size; ++r) permutation = sorted[r] == r;
  if (!permutation)
    throw InvalidArgumentError(where + ": order has " + std::to_string(order.size()) +
                               " entries; expected a permutation of 0.." + std::to_string(size - 1));
  return order;
}

// This rank's key in its group along `name`: its place in the ring when one is given, else its
// coordinate along the dimension.
int key_in_group(const ParallelLayout& layout, const GroupRings& rings, const std::string& name, int position,
                 int world_rank, const std::string& where) {
  auto given = rings.find(name);
  if (given == rings.end()) return layout.rank_in_group(position, {name});
  const int groups = layout.world_size() / layout.size(name);
  if (static_cast<int>(given->second.size()) != groups)
    throw InvalidArgumentError(where + ": " + std::to_string(given->second.size()) + " " + name + " rings for " +
                               std::to_string(groups) + " " + name + " groups");
  const int index = layout.group_index(position, {name});
  const auto& ring = given->second[index];
  auto at = std::find(ring.begin(), ring.end(), world_rank);
  if (at == ring.end() || static_cast<int>(ring.size()) != layout.size(name))
    throw InvalidArgumentError(where + ": " + name + " ring " + std::to_string(index) + " does not hold this rank once among " +
                               std::to_string(layout.size(name)) + " ranks");
  return static_cast<int>(at - ring.begin());
}

}  // namespace

const std::shared_ptr<Communicator>& ParallelGroups::group(std::string_view name) const {
  auto found = by_dimension.find(name);
  if (found == by_dimension.end())
    throw InvalidArgumentError(ErrorContext("ParallelGroups")("no dimension \"" + std::string(name) +
                                                              "\" in the layout " + layout.to_string()));
  return found->second;
}

ParallelGroups make_parallel_groups(Communicator& world, const ParallelLayout& layout, const std::vector<int>& order,
                                    const GroupRings& rings) {
  const int size = world.size();
  const std::string where = ErrorContext("make_parallel_groups").prefix();
  if (layout.world_size() != size)
    throw InvalidArgumentError(where + ": the layout " + layout.to_string() + " holds " +
                               std::to_string(layout.world_size()) + " ranks; the world has " + std::to_string(size));
  ParallelGroups groups;
  groups.layout = layout;
  groups.order = checked_order(order, size, where);
  groups.position = static_cast<int>(std::find(groups.order.begin(), groups.order.end(), world.rank()) -
                                     groups.order.begin());
  for (const auto& [name, unused] : rings)
    if (!layout.has(name))
      throw InvalidArgumentError(where + ": rings are given for \"" + name + "\", which the layout " +
                                 layout.to_string() + " lacks");
  // Every dimension of the layout, then the library's own ones it lacks (as groups of one rank), in
  // the same order on every rank: each split is a collective.
  std::vector<std::string> names;
  for (const auto& d : layout.dimensions()) names.push_back(d.name);
  for (std::string_view own : {kDataParallelDim, kPipelineParallelDim, kTensorParallelDim})
    if (!layout.has(own)) names.emplace_back(own);
  std::vector<std::pair<int, int>> color_key;
  for (const auto& name : names)
    color_key.emplace_back(layout.group_index(groups.position, {name}),
                           key_in_group(layout, rings, name, groups.position, world.rank(), where));
  for (size_t i = 0; i < names.size(); ++i)
    groups.by_dimension[names[i]] =
        world.split(color_key[i].first, color_key[i].second, names[i] + std::to_string(color_key[i].first));

  groups.tp_degree = layout.size(kTensorParallelDim);
  groups.dp_degree = layout.size(kDataParallelDim);
  groups.tp_rank = groups.rank(kTensorParallelDim);
  groups.dp_rank = groups.rank(kDataParallelDim);
  groups.tensor_parallel = groups.group(kTensorParallelDim);
  groups.data_parallel = groups.group(kDataParallelDim);
  return groups;
}

ParallelGroups make_parallel_groups(Communicator& world, int tp_degree, const std::vector<int>& order,
                                    const std::vector<std::vector<int>>& dp_rings) {
  const int size = world.size();
  if (tp_degree < 1 || size % tp_degree != 0)
    throw InvalidArgumentError(ErrorContext("make_parallel_groups")(
        "tensor-parallel degree " + std::to_string(tp_degree) + " must be at least 1 and divide the world size " +
        std::to_string(size)));
  GroupRings rings;
  if (!dp_rings.empty()) rings[std::string(kDataParallelDim)] = dp_rings;
  return make_parallel_groups(world, ParallelLayout::arrange(size, "dp,tp", {{"tp", tp_degree}}), order, rings);
}

}  // namespace loom
