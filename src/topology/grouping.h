// Which GPUs of one node a job uses and how they form tensor-parallel groups (placement.h, rules 2
// and 3). Internal to the planner; tests re-derive the optimum independently by brute force.
#pragma once

#include <vector>

#include "topology/ordering.h"

namespace loom::topo::detail {

// Lexicographic, larger is better; the field order is the rule order of placement.h.
struct GroupingScore {
  std::int64_t min_bottleneck = 0;  // smallest group bottleneck (min pairwise bandwidth; kInfiniteBw for TP=1)
  std::int64_t sum_bottleneck = 0;  // sum of group bottlenecks (0 for TP=1)
  std::int64_t sum_pairwise = 0;    // sum of pairwise bandwidths within groups
  std::int64_t numa_locality = 0;   // minus the number of extra NUMA nodes groups span
  std::int64_t used_min = 0;        // smallest pairwise bandwidth among the used GPUs
  std::int64_t used_total = 0;      // sum of pairwise bandwidths among the used GPUs
  friend auto operator<=>(const GroupingScore&, const GroupingScore&) = default;
};

GroupingScore grouping_score(const BwMatrix& bw, const std::vector<int>& numa, const std::vector<int>& used,
                             const std::vector<std::vector<int>>& groups);

struct NodeGrouping {
  std::vector<int> used;                 // GPUs the node's ranks use, ascending
  std::vector<std::vector<int>> groups;  // TP groups of GPU indices, each in its best ring order
  bool exhaustive = true;                // false: the greedy + swap heuristic was used
};

// Candidates above which a node is not searched exhaustively.
inline constexpr double kExhaustiveCandidateLimit = 200000;

// `ranks` GPUs out of bw.size(), in groups of `tp` (ranks % tp == 0, ranks <= bw.size()).
NodeGrouping best_grouping(const BwMatrix& bw, const std::vector<int>& numa, int ranks, int tp);

}  // namespace loom::topo::detail
