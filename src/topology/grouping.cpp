#include "topology/grouping.h"

#include <algorithm>
#include <cmath>
#include <set>

namespace loom::topo::detail {

GroupingScore grouping_score(const BwMatrix& bw, const std::vector<int>& numa, const std::vector<int>& used,
                             const std::vector<std::vector<int>>& groups) {
  GroupingScore s;
  s.min_bottleneck = kInfiniteBw;
  for (const auto& g : groups) {
    std::int64_t bottleneck = kInfiniteBw;
    for (size_t a = 0; a < g.size(); ++a)
      for (size_t b = a + 1; b < g.size(); ++b) {
        bottleneck = std::min(bottleneck, bw[g[a]][g[b]]);
        s.sum_pairwise += bw[g[a]][g[b]];
      }
    s.min_bottleneck = std::min(s.min_bottleneck, bottleneck);
    if (g.size() > 1) s.sum_bottleneck += bottleneck;
    std::set<int> nodes;
    for (int gpu : g) nodes.insert(numa[gpu]);
    s.numa_locality -= static_cast<std::int64_t>(nodes.size()) - 1;
  }
  s.used_min = kInfiniteBw;
  for (size_t a = 0; a < used.size(); ++a)
    for (size_t b = a + 1; b < used.size(); ++b) {
      s.used_min = std::min(s.used_min, bw[used[a]][used[b]]);
      s.used_total += bw[used[a]][used[b]];
    }
  return s;
}

namespace {

double candidate_count(int g, int k, int t) {
  // C(g, k) * k! / ((t!)^(k/t) * (k/t)!), in logarithms.
  auto lf = [](int n) { return std::lgamma(n + 1.0); };
  double log_count = lf(g) - lf(k) - lf(g - k) + lf(k) - (k / t) * lf(t) - lf(k / t);
  return std::exp(log_count);
}

class Exhaustive {
 public:
  Exhaustive(const BwMatrix& bw, const std::vector<int>& numa, int ranks, int tp)
      : bw_(bw), numa_(numa), g_(static_cast<int>(bw.size())), k_(ranks), t_(tp) {}

  NodeGrouping run() {
    std::vector<int> subset;
    choose_subset(0, subset);
    return best_;
  }

 private:
  void choose_subset(int from, std::vector<int>& subset) {
    if (static_cast<int>(subset.size()) == k_) {
      std::vector<bool> taken(g_, false);
      std::vector<std::vector<int>> groups;
      partition(subset, taken, groups);
      return;
    }
    for (int i = from; i <= g_ - (k_ - static_cast<int>(subset.size())); ++i) {
      subset.push_back(i);
      choose_subset(i + 1, subset);
      subset.pop_back();
    }
  }

  // Canonical partitions: each group is led by the smallest GPU not yet grouped.
  void partition(const std::vector<int>& used, std::vector<bool>& taken, std::vector<std::vector<int>>& groups) {
    int lead = -1;
    for (int gpu : used)
      if (!taken[gpu]) {
        lead = gpu;
        break;
      }
    if (lead < 0) {
      GroupingScore s = grouping_score(bw_, numa_, used, groups);
      if (!have_ || s > best_score_) {
        have_ = true;
        best_score_ = s;
        best_ = {used, groups, true};
      }
      return;
    }
    taken[lead] = true;
    std::vector<int> group{lead};
    extend(used, taken, groups, group, 0);
    taken[lead] = false;
  }

  void extend(const std::vector<int>& used, std::vector<bool>& taken, std::vector<std::vector<int>>& groups,
              std::vector<int>& group, size_t from) {
    if (static_cast<int>(group.size()) == t_) {
      groups.push_back(group);
      partition(used, taken, groups);
      groups.pop_back();
      return;
    }
    for (size_t i = from; i < used.size(); ++i) {
      int gpu = used[i];
      if (taken[gpu] || gpu < group.front()) continue;
      taken[gpu] = true;
      group.push_back(gpu);
      extend(used, taken, groups, group, i + 1);
      group.pop_back();
      taken[gpu] = false;
    }
  }

  const BwMatrix& bw_;
  const std::vector<int>& numa_;
  int g_, k_, t_;
  bool have_ = false;
  GroupingScore best_score_;
  NodeGrouping best_;
};

// The k GPUs kept: the worst-connected dropped one at a time.
std::vector<int> drop_worst_connected(const BwMatrix& bw, const std::vector<int>& numa, int k) {
  const int g = static_cast<int>(bw.size());
  std::vector<int> used(g);
  for (int i = 0; i < g; ++i) used[i] = i;
  while (static_cast<int>(used.size()) > k) {
    size_t worst = 0;
    GroupingScore best_rest;
    for (size_t i = 0; i < used.size(); ++i) {
      std::vector<int> rest = used;
      rest.erase(rest.begin() + i);
      GroupingScore s = grouping_score(bw, numa, rest, {});
      if (i == 0 || s > best_rest) best_rest = s, worst = i;
    }
    used.erase(used.begin() + worst);
  }
  return used;
}

// Groups of t grown greedily from the widest remaining pair, each adding the GPU best connected
// to all its members.
std::vector<std::vector<int>> grow_groups(const BwMatrix& bw, const std::vector<int>& used, int t) {
  std::vector<std::vector<int>> groups;
  std::vector<int> left = used;
  while (!left.empty()) {
    std::vector<int> group;
    if (t == 1) {
      group = {left.front()};
    } else {
      size_t bi = 0, bj = 1;
      for (size_t i = 0; i < left.size(); ++i)
        for (size_t j = i + 1; j < left.size(); ++j)
          if (bw[left[i]][left[j]] > bw[left[bi]][left[bj]]) bi = i, bj = j;
      group = {left[bi], left[bj]};
      while (static_cast<int>(group.size()) < t) {
        int best = -1;
        std::pair<std::int64_t, std::int64_t> best_key{-1, -1};
        for (int c : left) {
          if (std::find(group.begin(), group.end(), c) != group.end()) continue;
          std::int64_t mn = kInfiniteBw, sum = 0;
          for (int m : group) mn = std::min(mn, bw[c][m]), sum += bw[c][m];
          if (std::pair(mn, sum) > best_key) best_key = {mn, sum}, best = c;
        }
        group.push_back(best);
      }
    }
    for (int m : group) left.erase(std::find(left.begin(), left.end(), m));
    std::sort(group.begin(), group.end());
    groups.push_back(group);
  }
  return groups;
}

// Swaps between groups, and of used GPUs for unused ones, while the score improves (50 passes at most).
void improve_by_swaps(const BwMatrix& bw, const std::vector<int>& numa, std::vector<int>& used,
                      std::vector<std::vector<int>>& groups) {
  const int g = static_cast<int>(bw.size());
  auto score = [&](const std::vector<int>& u, const std::vector<std::vector<int>>& gs) {
    return grouping_score(bw, numa, u, gs);
  };
  GroupingScore current = score(used, groups);
  for (int pass = 0; pass < 50; ++pass) {
    bool improved = false;
    // Swap two GPUs of different groups.
    for (size_t a = 0; a < groups.size(); ++a)
      for (size_t b = a + 1; b < groups.size(); ++b)
        for (size_t i = 0; i < groups[a].size(); ++i)
          for (size_t j = 0; j < groups[b].size(); ++j) {
            std::swap(groups[a][i], groups[b][j]);
            GroupingScore s = score(used, groups);
            if (s > current)
              current = s, improved = true;
            else
              std::swap(groups[a][i], groups[b][j]);
          }
    // Swap a used GPU for an unused one.
    for (int spare = 0; spare < g; ++spare) {
      if (std::find(used.begin(), used.end(), spare) != used.end()) continue;
      bool swapped = false;
      for (auto& group : groups) {
        for (auto& member : group) {
          const int old = member;
          std::vector<int> u = used;
          *std::find(u.begin(), u.end(), old) = spare;
          member = spare;
          GroupingScore s = score(u, groups);
          if (s > current) {
            current = s, improved = true, used = u, swapped = true;
            break;
          }
          member = old;
        }
        if (swapped) break;
      }
    }
    if (!improved) break;
  }
}

// Greedy start (drop the worst-connected GPUs, grow groups from the widest pair), then swaps
// between groups and with unused GPUs while the score improves. O(passes * g^4) at worst.
NodeGrouping heuristic(const BwMatrix& bw, const std::vector<int>& numa, int k, int t) {
  std::vector<int> used = drop_worst_connected(bw, numa, k);
  std::vector<std::vector<int>> groups = grow_groups(bw, used, t);
  improve_by_swaps(bw, numa, used, groups);
  std::sort(used.begin(), used.end());
  for (auto& group : groups) std::sort(group.begin(), group.end());
  return {used, groups, false};
}

}  // namespace

NodeGrouping best_grouping(const BwMatrix& bw, const std::vector<int>& numa, int ranks, int tp) {
  const int g = static_cast<int>(bw.size());
  NodeGrouping result = candidate_count(g, ranks, tp) <= kExhaustiveCandidateLimit
                            ? Exhaustive(bw, numa, ranks, tp).run()
                            : heuristic(bw, numa, ranks, tp);
  for (auto& group : result.groups) group = best_order(bw, group, /*cycle=*/true);
  return result;
}

}  // namespace loom::topo::detail
