#include "topology/ordering.h"

#include <algorithm>
#include <cmath>

namespace loom::topo::detail {

BwMatrix bandwidth_matrix(const Node& node, const LinkCosts& costs) {
  const size_t g = node.gpus.size();
  BwMatrix bw(g, std::vector<std::int64_t>(g, kInfiniteBw));
  for (size_t a = 0; a < g; ++a)
    for (size_t b = 0; b < g; ++b)
      if (a != b) bw[a][b] = std::llround(costs.cost(node.gpu_links[a][b]).bandwidth_gbps * 1000.0);
  return bw;
}

OrderScore order_score(const BwMatrix& bw, const std::vector<int>& order, bool cycle) {
  OrderScore s;
  const size_t n = order.size();
  if (n < 2) return s;
  const size_t edges = cycle ? n : n - 1;
  for (size_t i = 0; i < edges; ++i) {
    std::int64_t b = bw[order[i]][order[(i + 1) % n]];
    s.bottleneck = std::min(s.bottleneck, b);
    s.total += b;
  }
  return s;
}

namespace {

// Dynamic programming over subsets, in two passes for the lexicographic objective: the widest
// achievable bottleneck B first, then the largest sum over orders using only links >= B (the sum
// alone has optimal substructure, the pair does not).
std::vector<int> exact_order(const BwMatrix& bw, const std::vector<int>& m, bool cycle) {
  const int n = static_cast<int>(m.size());
  const int full = (1 << n) - 1;
  auto w = [&](int i, int j) { return bw[m[i]][m[j]]; };
  constexpr std::int64_t kNone = -1;
  // Pass 1: best bottleneck of a path covering `mask` and ending at `last`.
  std::vector<std::int64_t> bott((size_t(1) << n) * n, kNone);
  auto at = [n](int mask, int last) { return static_cast<size_t>(mask) * n + last; };
  for (int s = 0; s < (cycle ? 1 : n); ++s) bott[at(1 << s, s)] = kInfiniteBw;
  for (int mask = 1; mask <= full; ++mask)
    for (int last = 0; last < n; ++last) {
      std::int64_t cur = bott[at(mask, last)];
      if (cur == kNone) continue;
      for (int next = 0; next < n; ++next) {
        if (mask & (1 << next)) continue;
        std::int64_t v = std::min(cur, w(last, next));
        auto& slot = bott[at(mask | (1 << next), next)];
        slot = std::max(slot, v);
      }
    }
  std::int64_t best_b = kNone;
  for (int last = 0; last < n; ++last) {
    std::int64_t v = bott[at(full, last)];
    if (v == kNone) continue;
    if (cycle) v = std::min(v, w(last, 0));
    best_b = std::max(best_b, v);
  }
  // Pass 2: the largest sum over links >= best_b, with parents to rebuild the order.
  std::vector<std::int64_t> sum((size_t(1) << n) * n, kNone);
  std::vector<int> parent((size_t(1) << n) * n, -1);
  for (int s = 0; s < (cycle ? 1 : n); ++s) sum[at(1 << s, s)] = 0;
  for (int mask = 1; mask <= full; ++mask)
    for (int last = 0; last < n; ++last) {
      std::int64_t cur = sum[at(mask, last)];
      if (cur == kNone) continue;
      for (int next = 0; next < n; ++next) {
        if ((mask & (1 << next)) || w(last, next) < best_b) continue;
        std::int64_t v = cur + w(last, next);
        size_t slot = at(mask | (1 << next), next);
        if (v > sum[slot]) sum[slot] = v, parent[slot] = last;
      }
    }
  int best_last = -1;
  std::int64_t best_sum = kNone;
  for (int last = 0; last < n; ++last) {
    std::int64_t v = sum[at(full, last)];
    if (v == kNone) continue;
    if (cycle) {
      if (n > 1 && w(last, 0) < best_b) continue;
      v += n > 1 ? w(last, 0) : 0;
    }
    if (v > best_sum) best_sum = v, best_last = last;
  }
  std::vector<int> order;
  for (int mask = full, last = best_last; last >= 0;) {
    order.push_back(m[last]);
    int prev = parent[at(mask, last)];
    mask &= ~(1 << last);
    last = prev;
  }
  std::reverse(order.begin(), order.end());
  return order;
}

std::vector<int> heuristic_order(const BwMatrix& bw, const std::vector<int>& m, bool cycle) {
  const size_t n = m.size();
  auto greedy_from = [&](size_t start) {
    std::vector<int> order{m[start]};
    std::vector<bool> used(n, false);
    used[start] = true;
    for (size_t step = 1; step < n; ++step) {
      size_t best = n;
      for (size_t j = 0; j < n; ++j)
        if (!used[j] && (best == n || bw[order.back()][m[j]] > bw[order.back()][m[best]])) best = j;
      used[best] = true;
      order.push_back(m[best]);
    }
    return order;
  };
  std::vector<int> best = greedy_from(0);
  if (!cycle)
    for (size_t s = 1; s < n; ++s) {
      auto o = greedy_from(s);
      if (order_score(bw, o, false) > order_score(bw, best, false)) best = o;
    }
  // 2-opt: reverse a segment while that improves the score (bounded passes keep it polynomial).
  for (int pass = 0; pass < 50; ++pass) {
    bool improved = false;
    for (size_t i = cycle ? 1 : 0; i + 1 < n; ++i)
      for (size_t j = i + 1; j < n; ++j) {
        std::vector<int> o = best;
        std::reverse(o.begin() + i, o.begin() + j + 1);
        if (order_score(bw, o, cycle) > order_score(bw, best, cycle)) best = std::move(o), improved = true;
      }
    if (!improved) break;
  }
  return best;
}

}  // namespace

std::vector<int> best_order(const BwMatrix& bw, const std::vector<int>& members, bool cycle) {
  if (members.size() <= 2) return members;
  if (members.size() <= static_cast<size_t>(kExactOrderLimit)) return exact_order(bw, members, cycle);
  return heuristic_order(bw, members, cycle);
}

}  // namespace loom::topo::detail
