// plan(): per node, which GPUs are used and how they form TP groups (grouping.cpp), which way round
// each TP ring is entered so the DP rings through the node are fast, rank numbering, CPU sets; then
// DP rings across nodes, and the naive layout for comparison. Work is per node, so the total is
// linear in the number of nodes.
#include "loom/topology/placement.h"

#include <algorithm>
#include <map>

#include "loom/error.h"
#include "topology/grouping.h"
#include "topology/ordering.h"

namespace loom::topo {

namespace {

using detail::BwMatrix;
using detail::OrderScore;

constexpr long long kOrientationCombinationLimit = 4096;

std::string node_name(const Topology& t, int n) {
  return t.nodes[n].hostname.empty() ? "node" + std::to_string(n) : t.nodes[n].hostname;
}

std::vector<int> choose_ranks_per_node(const Topology& topo, const PlanRequest& req) {
  const int t = req.tp_degree;
  int largest = 0;
  for (const auto& n : topo.nodes) largest = std::max(largest, static_cast<int>(n.gpus.size()));
  if (t > largest)
    throw PlanError("tp_degree=" + std::to_string(t) + " needs " + std::to_string(t) +
                    " GPUs in one node (TP groups never span nodes); the largest node has " + std::to_string(largest));
  if (req.ranks_per_node < 0)
    throw PlanError("ranks_per_node=" + std::to_string(req.ranks_per_node) + ": expected 0 (fill each node) or more");
  if (req.ranks_per_node > 0 && req.ranks_per_node % t != 0)
    throw PlanError("ranks_per_node=" + std::to_string(req.ranks_per_node) +
                    " is not a multiple of tp_degree=" + std::to_string(t) + ": a TP group would span two nodes");
  std::vector<int> counts(topo.nodes.size(), 0);
  int remaining = req.world_size;
  int offered = 0;
  for (size_t n = 0; n < topo.nodes.size() && remaining > 0; ++n) {
    const int g = static_cast<int>(topo.nodes[n].gpus.size());
    int k = 0;
    if (req.ranks_per_node > 0) {
      k = std::min(req.ranks_per_node, remaining);
      if (k > g)
        throw PlanError("node " + std::to_string(n) + " ('" + node_name(topo, static_cast<int>(n)) + "') has " +
                        std::to_string(g) + " GPUs, but ranks_per_node=" + std::to_string(req.ranks_per_node) +
                        " (one GPU per rank)");
    } else {
      k = std::min(g / t * t, remaining);
    }
    counts[n] = k;
    remaining -= k;
    offered += k;
  }
  if (remaining > 0) {
    int capacity = 0;
    for (const auto& n : topo.nodes)
      capacity += req.ranks_per_node > 0 ? std::min(req.ranks_per_node, static_cast<int>(n.gpus.size()))
                                         : static_cast<int>(n.gpus.size()) / t * t;
    throw PlanError("world_size=" + std::to_string(req.world_size) + " at tp_degree=" + std::to_string(t) +
                    " needs one GPU per rank; the topology's " + std::to_string(topo.nodes.size()) + " node(s) offer " +
                    std::to_string(capacity) + " usable GPUs" +
                    (req.ranks_per_node > 0 ? " at ranks_per_node=" + std::to_string(req.ranks_per_node) : ""));
  }
  return counts;
}

// One node's decisions: slots[i][j] is the GPU of the j-th member of the node's i-th TP group (in
// ring order); dp_order[j] lists group indices i in the order DP ring j visits them in this node.
struct NodePlan {
  std::vector<std::vector<int>> slots;
  std::vector<std::vector<int>> dp_order;
  std::vector<int> unused;
};

struct DpScore {
  std::int64_t min_bottleneck = detail::kInfiniteBw;
  std::int64_t sum_bottleneck = 0;
  std::int64_t total = 0;
  friend auto operator<=>(const DpScore&, const DpScore&) = default;
};

NodePlan plan_node(const Node& node, const LinkCosts& costs, int k, int t, bool ring_closes_here,
                   const std::string& name, std::vector<std::string>& notes) {
  const BwMatrix bw = detail::bandwidth_matrix(node, costs);
  std::vector<int> numa(node.gpus.size());
  for (size_t i = 0; i < node.gpus.size(); ++i) numa[i] = node.gpus[i].numa;
  detail::NodeGrouping grouping = detail::best_grouping(bw, numa, k, t);
  if (!grouping.exhaustive)
    notes.push_back(name + ": " + std::to_string(node.gpus.size()) +
                    " GPUs, too many candidates to search exhaustively; greedy grouping improved by swaps");
  const int m = static_cast<int>(grouping.groups.size());

  // Each TP ring may be entered at any member and in either direction; DP ring j takes member j of
  // every group. Try the combinations (the first group fixed: turning all groups alike only renames
  // the DP rings) and keep the one whose DP paths through this node are fastest.
  const int options = t == 1 ? 1 : t == 2 ? 2 : 2 * t;
  long long combinations = 1;
  for (int i = 1; i < m && combinations <= kOrientationCombinationLimit; ++i) combinations *= options;
  if (combinations > kOrientationCombinationLimit) {
    combinations = 1;
    notes.push_back(name + ": too many TP-ring orientations to compare; DP rings use each TP ring as ordered");
  }
  auto oriented = [&](const std::vector<int>& ring, int option) {
    std::vector<int> out(t);
    const int rotation = option % t, reflect = option / t;
    for (int j = 0; j < t; ++j) out[j] = ring[(rotation + (reflect ? t - j : j)) % t];
    return out;
  };
  DpScore best_score;
  bool have = false;
  NodePlan best;
  for (long long combo = 0; combo < combinations; ++combo) {
    std::vector<std::vector<int>> slots(m);
    long long code = combo;
    for (int i = 0; i < m; ++i) {
      int option = i == 0 ? 0 : static_cast<int>(code % options);
      if (i > 0) code /= options;
      slots[i] = oriented(grouping.groups[i], option);
    }
    DpScore score;
    std::vector<std::vector<int>> orders(t);
    for (int j = 0; j < t; ++j) {
      std::vector<int> members(m);
      for (int i = 0; i < m; ++i) members[i] = slots[i][j];
      orders[j] = detail::best_order(bw, members, ring_closes_here);
      OrderScore s = detail::order_score(bw, orders[j], ring_closes_here);
      if (m > 1) {
        score.min_bottleneck = std::min(score.min_bottleneck, s.bottleneck);
        score.sum_bottleneck += s.bottleneck;
      }
      score.total += s.total;
    }
    if (!have || score > best_score) {
      have = true;
      best_score = score;
      best.slots = slots;
      best.dp_order.assign(t, {});
      for (int j = 0; j < t; ++j)
        for (int gpu : orders[j])
          for (int i = 0; i < m; ++i)
            if (slots[i][j] == gpu) best.dp_order[j].push_back(i);
    }
  }
  // Number the groups in the order DP ring 0 visits them, so that ring is ascending ranks.
  std::vector<int> renumber(m);
  for (int pos = 0; pos < m; ++pos) renumber[best.dp_order[0][pos]] = pos;
  std::vector<std::vector<int>> slots(m);
  for (int i = 0; i < m; ++i) slots[renumber[i]] = best.slots[i];
  best.slots = std::move(slots);
  for (auto& order : best.dp_order)
    for (int& i : order) i = renumber[i];
  for (int gpu = 0; gpu < static_cast<int>(node.gpus.size()); ++gpu)
    if (!std::binary_search(grouping.used.begin(), grouping.used.end(), gpu)) best.unused.push_back(gpu);
  return best;
}

Link link_between(const Topology& topo, const RankPlacement& a, const RankPlacement& b) {
  if (a.node != b.node) return {LinkClass::NET, 0};
  return topo.nodes[a.node].gpu_link(a.device, b.device);
}

void fill_links(const Topology& topo, Layout& layout) {
  auto fill = [&](Ring& ring) {
    ring.links.clear();
    const size_t n = ring.ranks.size();
    if (n < 2) return;
    for (size_t i = 0; i < n; ++i)
      ring.links.push_back(link_between(topo, layout.ranks[ring.ranks[i]], layout.ranks[ring.ranks[(i + 1) % n]]));
  };
  for (auto& r : layout.tp_groups) fill(r);
  for (auto& r : layout.dp_groups) fill(r);
  for (auto& r : layout.pp_groups) fill(r);
}

// Each rank's groups and places in them, the TP groups (consecutive blocks) and the pipelines
// (stage by stage), from the parallel layout; positions are ranks.
void fill_group_indices(Layout& layout, const loom::ParallelLayout& parallel) {
  const int world = static_cast<int>(layout.ranks.size());
  const int t = parallel.size("tp");
  layout.tp_groups.assign(world / t, {});
  for (int r = 0; r < world; ++r) {
    auto& p = layout.ranks[r];
    p.rank = r;
    p.tp_group = r / t;
    p.tp_index = r % t;
    p.dp_group = parallel.group_index(r, {"dp"});
    p.dp_index = parallel.coordinate(r, "dp");
    p.pp_group = parallel.group_index(r, {"pp"});
    p.pp_index = parallel.coordinate(r, "pp");
    layout.tp_groups[r / t].ranks.push_back(r);
  }
  layout.pp_groups.clear();
  for (auto& members : parallel.groups({"pp"})) layout.pp_groups.push_back(Ring{std::move(members), {}});
}

// The DP groups as rings: each group's members (which share a TP index j) in the order ring j's
// path visits their TP blocks. paths[j] lists blocks (rank / t) in visiting order; empty paths
// keep the members in rank order.
std::vector<Ring> dp_rings(const loom::ParallelLayout& parallel, const std::vector<std::vector<int>>& paths) {
  const int t = parallel.size("tp");
  std::vector<Ring> rings;
  for (auto& members : parallel.groups({"dp"})) {
    const int j = members.front() % t;
    if (!paths.empty()) {
      std::vector<int> step_of_block(parallel.world_size() / t, 0);
      for (size_t k = 0; k < paths[j].size(); ++k) step_of_block[paths[j][k]] = static_cast<int>(k);
      std::sort(members.begin(), members.end(),
                [&](int a, int b) { return step_of_block[a / t] < step_of_block[b / t]; });
    }
    rings.push_back(Ring{std::move(members), {}});
  }
  return rings;
}

// The CPUs of `base` split among `parts` ranks: every contiguous run of ids is cut into `parts`
// pieces and rank p gets piece p of each run. On the usual Linux numbering ("0-31,64-95": cores,
// then their hyperthread siblings) each rank keeps whole cores with both hyperthreads.
CpuList split_share(const CpuList& base, int parts, int p) {
  CpuList out;
  for (size_t i = 0; i < base.size();) {
    size_t j = i;
    while (j + 1 < base.size() && base[j + 1] == base[j] + 1) ++j;
    const size_t len = j - i + 1;
    const size_t from = i + len * p / parts, to = i + len * (p + 1) / parts;
    for (size_t c = from; c < to; ++c) out.push_back(base[c]);
    i = j + 1;
  }
  if (out.empty() && !base.empty()) out.push_back(base[static_cast<size_t>(p) % base.size()]);  // more ranks than CPUs
  return out;
}

void bind_cpus(const Topology& topo, Layout& layout) {
  // Ranks on one node whose GPUs have the same nearest CPUs share them out without overlap.
  std::map<std::pair<int, CpuList>, std::vector<int>> sharing;
  for (auto& p : layout.ranks) {
    const Node& node = topo.nodes[p.node];
    const Gpu& gpu = node.gpus[p.device];
    const NumaNode* numa = gpu.numa >= 0 ? node.numa_node(gpu.numa) : nullptr;
    CpuList base;
    if (!gpu.cpus.empty() && numa && !numa->cpus.empty())
      std::set_intersection(gpu.cpus.begin(), gpu.cpus.end(), numa->cpus.begin(), numa->cpus.end(),
                            std::back_inserter(base));
    if (base.empty()) base = !gpu.cpus.empty() ? gpu.cpus : numa ? numa->cpus : CpuList{};
    if (base.empty()) base = node.all_cpus();
    sharing[{p.node, base}].push_back(p.rank);
  }
  for (auto& [key, ranks] : sharing) {
    std::sort(ranks.begin(), ranks.end(),
              [&](int a, int b) { return layout.ranks[a].device < layout.ranks[b].device; });
    for (size_t i = 0; i < ranks.size(); ++i)
      layout.ranks[ranks[i]].cpus = split_share(key.second, static_cast<int>(ranks.size()), static_cast<int>(i));
  }
}

}  // namespace

loom::ParallelLayout PlanRequest::layout() const {
  try {
    loom::ParallelLayout parallel = loom::ParallelLayout::standard(world_size, tp_degree, pp_degree, layout_order);
    if (parallel.dimensions().back().name != "tp")
      throw PlanError("layout order \"" + layout_order + "\": the planner needs tp innermost (TP groups are consecutive ranks)");
    return parallel;
  } catch (const loom::Error& e) {
    throw PlanError(e.what());
  }
}

Plan plan(const Topology& topology, const PlanRequest& request) {
  if (request.world_size < 1)
    throw PlanError("world_size=" + std::to_string(request.world_size) + ": expected at least 1");
  if (request.tp_degree < 1)
    throw PlanError("tp_degree=" + std::to_string(request.tp_degree) + ": expected at least 1");
  if (request.world_size % request.tp_degree != 0)
    throw PlanError("world_size=" + std::to_string(request.world_size) +
                    " is not divisible by tp_degree=" + std::to_string(request.tp_degree));
  if (topology.nodes.empty()) throw PlanError("the topology describes no node");
  validate(topology);
  const loom::ParallelLayout parallel = request.layout();
  const int t = request.tp_degree;
  Plan result;
  result.request = request;
  result.costs = topology.costs;
  for (size_t n = 0; n < topology.nodes.size(); ++n)
    result.hostnames.push_back(node_name(topology, static_cast<int>(n)));
  result.ranks_per_node = choose_ranks_per_node(topology, request);
  const int nodes_used = static_cast<int>(
      std::count_if(result.ranks_per_node.begin(), result.ranks_per_node.end(), [](int k) { return k > 0; }));

  Layout& layout = result.layout;
  layout.ranks.resize(request.world_size);
  std::vector<std::vector<int>> paths(t);  // per TP index: the TP blocks in the order its ring visits them
  result.unused_gpus.assign(topology.nodes.size(), {});
  int group_base = 0;
  for (size_t n = 0; n < topology.nodes.size(); ++n) {
    const Node& node = topology.nodes[n];
    const int k = result.ranks_per_node[n];
    if (k == 0) {
      for (int gpu = 0; gpu < static_cast<int>(node.gpus.size()); ++gpu) result.unused_gpus[n].push_back(gpu);
      continue;
    }
    NodePlan np = plan_node(node, topology.costs, k, t, nodes_used == 1, result.hostnames[n], result.notes);
    const int m = k / t;
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < t; ++j) {
        RankPlacement& p = layout.ranks[(group_base + i) * t + j];
        p.node = static_cast<int>(n);
        p.device = np.slots[i][j];
      }
    for (int j = 0; j < t; ++j)
      for (int i : np.dp_order[j]) paths[j].push_back(group_base + i);
    result.unused_gpus[n] = np.unused;
    group_base += m;
  }
  fill_group_indices(layout, parallel);
  layout.dp_groups = dp_rings(parallel, paths);
  bind_cpus(topology, layout);
  fill_links(topology, layout);

  // The naive layout: rank r on the r-th GPU slot, node by node, groups by rank order.
  Layout& naive = result.naive;
  naive.ranks.resize(request.world_size);
  int r = 0;
  for (size_t n = 0; n < topology.nodes.size(); ++n)
    for (int d = 0; d < result.ranks_per_node[n]; ++d, ++r) {
      naive.ranks[r].node = static_cast<int>(n);
      naive.ranks[r].device = d;
    }
  fill_group_indices(naive, parallel);
  naive.dp_groups = dp_rings(parallel, {});
  fill_links(topology, naive);
  return result;
}

}  // namespace loom::topo
