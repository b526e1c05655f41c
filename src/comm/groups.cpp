#include "loom/comm/groups.h"

#include <algorithm>

#include "loom/error.h"

namespace loom {

ParallelGroups make_parallel_groups(Communicator& world, int tp_degree, const std::vector<int>& order,
                                    const std::vector<std::vector<int>>& dp_rings) {
  const int size = world.size();
  const std::string where = ErrorContext("make_parallel_groups").prefix();
  if (tp_degree < 1 || size % tp_degree != 0)
    throw InvalidArgumentError(where + ": tensor-parallel degree " + std::to_string(tp_degree) +
                               " must be at least 1 and divide the world size " + std::to_string(size));
  ParallelGroups groups;
  groups.tp_degree = tp_degree;
  groups.dp_degree = size / tp_degree;
  groups.order = order;
  if (groups.order.empty()) {
    for (int r = 0; r < size; ++r) groups.order.push_back(r);
  }
  std::vector<int> sorted = groups.order;
  std::sort(sorted.begin(), sorted.end());
  bool permutation = static_cast<int>(sorted.size()) == size;
  for (int r = 0; permutation && r < size; ++r) permutation = sorted[r] == r;
  if (!permutation)
    throw InvalidArgumentError(where + ": order has " + std::to_string(groups.order.size()) +
                               " entries; expected a permutation of 0.." + std::to_string(size - 1));

  const int position = static_cast<int>(std::find(groups.order.begin(), groups.order.end(), world.rank()) -
                                         groups.order.begin());
  const int block = position / tp_degree;   // which TP group
  const int offset = position % tp_degree;  // position inside it
  groups.tp_rank = offset;
  groups.dp_rank = block;
  // The DP group's rank order: the ring's, when a plan gives one for this group.
  int dp_key = block;
  if (!dp_rings.empty()) {
    if (static_cast<int>(dp_rings.size()) != tp_degree)
      throw InvalidArgumentError(where + ": " + std::to_string(dp_rings.size()) + " DP rings for " +
                                 std::to_string(tp_degree) + " DP groups");
    const auto& ring = dp_rings[offset];
    auto at = std::find(ring.begin(), ring.end(), world.rank());
    if (at == ring.end() || static_cast<int>(ring.size()) != groups.dp_degree)
      throw InvalidArgumentError(where + ": DP ring " + std::to_string(offset) + " does not hold this rank once among " +
                                 std::to_string(groups.dp_degree) + " ranks");
    dp_key = static_cast<int>(at - ring.begin());
  }
  groups.tensor_parallel = world.split(block, offset, "tp" + std::to_string(block));
  groups.data_parallel = world.split(offset, dp_key, "dp" + std::to_string(offset));
  return groups;
}

}  // namespace loom
