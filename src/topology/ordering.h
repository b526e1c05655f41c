// Orders of GPUs along rings and paths: the widest bottleneck link first, then the largest sum of
// link bandwidths. Bandwidths are integers (MB/s) so that equal orders compare equal exactly.
// Internal to the planner.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/topology/topology.h"

namespace loom::topo::detail {

using BwMatrix = std::vector<std::vector<std::int64_t>>;
inline constexpr std::int64_t kInfiniteBw = INT64_MAX / 4;

// Bandwidth of every GPU pair of a node in MB/s (Self: kInfiniteBw).
BwMatrix bandwidth_matrix(const Node& node, const LinkCosts& costs);

struct OrderScore {
  std::int64_t bottleneck = kInfiniteBw;  // slowest link along the order (kInfiniteBw for < 2 members)
  std::int64_t total = 0;                 // sum of the links' bandwidths
  friend auto operator<=>(const OrderScore&, const OrderScore&) = default;
};

// The score of visiting `order` (GPU indices) as a path, or as a cycle (closing link included).
OrderScore order_score(const BwMatrix& bw, const std::vector<int>& order, bool cycle);

// The best order of `members`: exact (dynamic programming over subsets) up to kExactOrderLimit
// members, otherwise nearest-neighbour improved by 2-opt. A cycle starts at members[0].
inline constexpr int kExactOrderLimit = 12;
std::vector<int> best_order(const BwMatrix& bw, const std::vector<int>& members, bool cycle);

}  // namespace loom::topo::detail
