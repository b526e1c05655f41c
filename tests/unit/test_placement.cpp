// The placement planner on real machines and simulated clusters: TP groups equal the exhaustive
// optimum (found here by brute force over all GPU orders, scored independently), DGX-1 pairs use
// NV2, PCIe machines keep TP groups on one socket, DP rings cross nodes the minimum number of times,
// unused GPUs are the worst connected, the cost model and the outputs agree with each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <tuple>

#include "loom/topology/placement.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;

namespace {

Topology fixture(const std::string& name) {
  return load_topology_file(fixture_path(name));
}

std::vector<std::string> all_machine_fixtures() {
  auto names = topo_matrix_fixtures();
  for (const auto& x : xml_fixtures()) names.push_back(x);
  return names;
}

// --- The test's own scoring of a grouping, written from the rules in placement.h. ---
using Score = std::tuple<long long, long long, long long, long long, long long, long long>;

long long bw(const Node& n, const LinkCosts& c, int a, int b) {
  return std::llround(c.cost(n.gpu_link(a, b)).bandwidth_gbps * 1000.0);
}

Score score_of(const Node& n, const LinkCosts& c, const std::vector<int>& used,
               const std::vector<std::vector<int>>& groups) {
  const long long inf = std::numeric_limits<long long>::max();
  long long min_b = inf, sum_b = 0, pairwise = 0, numa = 0, used_min = inf, used_total = 0;
  for (const auto& g : groups) {
    long long b = inf;
    for (size_t i = 0; i < g.size(); ++i)
      for (size_t j = i + 1; j < g.size(); ++j) {
        b = std::min(b, bw(n, c, g[i], g[j]));
        pairwise += bw(n, c, g[i], g[j]);
      }
    if (g.size() > 1) {
      min_b = std::min(min_b, b);
      sum_b += b;
    }
    std::set<int> nodes;
    for (int x : g) nodes.insert(n.gpus[x].numa);
    numa -= static_cast<long long>(nodes.size()) - 1;
  }
  for (size_t i = 0; i < used.size(); ++i)
    for (size_t j = i + 1; j < used.size(); ++j) {
      used_min = std::min(used_min, bw(n, c, used[i], used[j]));
      used_total += bw(n, c, used[i], used[j]);
    }
  return {min_b, sum_b, pairwise, numa, used_min, used_total};
}

// Brute force: every order of the node's GPUs; the first k are used, cut into groups of t.
Score exhaustive_optimum(const Node& n, const LinkCosts& c, int k, int t) {
  std::vector<int> perm(n.gpus.size());
  std::iota(perm.begin(), perm.end(), 0);
  Score best{};
  bool have = false;
  do {
    std::vector<int> used(perm.begin(), perm.begin() + k);
    std::vector<std::vector<int>> groups;
    for (int g = 0; g < k / t; ++g) groups.emplace_back(perm.begin() + g * t, perm.begin() + (g + 1) * t);
    Score s = score_of(n, c, used, groups);
    if (!have || s > best) best = s, have = true;
  } while (std::next_permutation(perm.begin(), perm.end()));
  return best;
}

// The planner's grouping of node `node`: used GPUs and TP groups as GPU indices.
Score planned_score(const Plan& p, const Topology& topo, int node) {
  std::vector<int> used;
  std::vector<std::vector<int>> groups;
  for (const auto& ring : p.layout.tp_groups) {
    if (p.layout.ranks[ring.ranks[0]].node != node) continue;
    std::vector<int> g;
    for (int r : ring.ranks) {
      EXPECT_EQ(p.layout.ranks[r].node, node) << "TP group spans nodes";
      g.push_back(p.layout.ranks[r].device);
      used.push_back(p.layout.ranks[r].device);
    }
    groups.push_back(g);
  }
  return score_of(topo.nodes[node], topo.costs, used, groups);
}

// Basic invariants of every plan: one GPU per rank, groups are the documented blocks.
void check_invariants(const Plan& p, const Topology& topo) {
  const int world = p.request.world_size, t = p.request.tp_degree;
  ASSERT_EQ(static_cast<int>(p.layout.ranks.size()), world);
  std::set<std::pair<int, int>> gpus;
  for (int r = 0; r < world; ++r) {
    const auto& q = p.layout.ranks[r];
    EXPECT_EQ(q.rank, r);
    EXPECT_TRUE(gpus.insert({q.node, q.device}).second) << "two ranks on one GPU";
    EXPECT_EQ(q.tp_group, r / t);
    EXPECT_EQ(q.tp_index, r % t);
    EXPECT_EQ(q.dp_group, r % t);
  }
  ASSERT_EQ(static_cast<int>(p.layout.tp_groups.size()), world / t);
  for (size_t g = 0; g < p.layout.tp_groups.size(); ++g) {
    std::vector<int> expected(t);
    std::iota(expected.begin(), expected.end(), static_cast<int>(g) * t);
    EXPECT_EQ(p.layout.tp_groups[g].ranks, expected);
    std::set<int> nodes;
    for (int r : p.layout.tp_groups[g].ranks) nodes.insert(p.layout.ranks[r].node);
    EXPECT_EQ(nodes.size(), 1u) << "TP group " << g << " spans nodes";
  }
  ASSERT_EQ(static_cast<int>(p.layout.dp_groups.size()), t);
  for (int j = 0; j < t; ++j) {
    std::vector<int> members = p.layout.dp_groups[j].ranks;
    std::sort(members.begin(), members.end());
    std::vector<int> expected;
    for (int r = j; r < world; r += t) expected.push_back(r);
    EXPECT_EQ(members, expected) << "DP group " << j;
  }
  for (size_t n = 0; n < topo.nodes.size(); ++n) {
    int used = 0;
    for (const auto& q : p.layout.ranks) used += q.node == static_cast<int>(n);
    EXPECT_EQ(used + p.unused_gpus[n].size(), topo.nodes[n].gpus.size());
  }
}

// Inter-node hops around a ring, and the nodes it visits.
std::pair<int, int> crossings(const Plan& p, const Ring& ring) {
  std::set<int> nodes;
  int hops = 0;
  const size_t n = ring.ranks.size();
  for (size_t i = 0; i < n; ++i) {
    nodes.insert(p.layout.ranks[ring.ranks[i]].node);
    if (n > 1 && p.layout.ranks[ring.ranks[i]].node != p.layout.ranks[ring.ranks[(i + 1) % n]].node) ++hops;
  }
  return {hops, static_cast<int>(nodes.size())};
}

// A ring visiting m >= 2 nodes must enter each node at least once: m crossings is the minimum.
int minimum_crossings(int nodes) {
  return nodes >= 2 ? nodes : 0;
}

}  // namespace

TEST(Placement, TpGroupsEqualTheExhaustiveOptimumOnEveryFixture) {
  int cases = 0;
  for (const auto& name : all_machine_fixtures()) {
    const Topology topo = fixture(name);
    const Node& n = topo.nodes[0];
    const int g = static_cast<int>(n.gpus.size());
    ASSERT_LE(g, 8);
    for (int t : {2, 4, 8}) {
      if (t > g) continue;
      // The whole node, and fewer ranks than GPUs (one group; two groups on 8 GPUs).
      std::set<int> worlds{g / t * t, t};
      if (g == 8 && t == 2) worlds.insert(4), worlds.insert(6);
      for (int world : worlds) {
        SCOPED_TRACE(name + " TP=" + std::to_string(t) + " world=" + std::to_string(world));
        Plan p = plan(topo, {world, t, 0, 1 << 20});
        check_invariants(p, topo);
        EXPECT_EQ(planned_score(p, topo, 0), exhaustive_optimum(n, topo.costs, world, t));
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 50);
}

TEST(Placement, Dgx1PairsUseNv2AndStayOnASocket) {
  for (const char* name : {"dgx1_v100_4nic_pytorch.txt", "dgx1_v100_1nic_oneflow.txt"}) {
    SCOPED_TRACE(name);
    const Topology topo = fixture(name);
    Plan p = plan(topo, {8, 2, 0, 64 << 20});
    for (const auto& ring : p.layout.tp_groups) {
      EXPECT_EQ(bottleneck(ring, p.costs), (Link{LinkClass::NV, 2}));
      // Cube-mesh: GPUs 0-3 on one socket, 4-7 on the other; NV2 pairs exist on both.
      int a = p.layout.ranks[ring.ranks[0]].device, b = p.layout.ranks[ring.ranks[1]].device;
      EXPECT_EQ(a / 4, b / 4) << "pair " << a << "-" << b << " crosses sockets";
    }
    // The naive pairs (0,1), (2,3), ... are NV1 and NV2 mixed: the slowest is NV1, half the bandwidth.
    ModelledTimes m = modelled_times(p, 64 << 20);
    EXPECT_GT(m.naive_tp_allreduce_us / m.tp_allreduce_us, 1.9);
    // TP=4: groups are the two sockets' quads (all pairs NVLink; bottleneck NV1).
    Plan p4 = plan(topo, {8, 4, 0, 64 << 20});
    for (const auto& ring : p4.layout.tp_groups) {
      std::set<int> sockets;
      for (int r : ring.ranks) sockets.insert(p4.layout.ranks[r].device / 4);
      EXPECT_EQ(sockets.size(), 1u);
    }
  }
}

TEST(Placement, DualSocketPcieGroupsNeverCrossSockets) {
  for (const char* name : {"rtx4090_8gpu_pcie_2socket_bondnic.txt", "hopper_8gpu_6nic_topo_mp_pcie_only.txt"}) {
    const Topology topo = fixture(name);
    for (int t : {2, 4}) {
      for (int world : {8, 4, t}) {
        SCOPED_TRACE(std::string(name) + " TP=" + std::to_string(t) + " world=" + std::to_string(world));
        Plan p = plan(topo, {world, t, 0, 1 << 20});
        for (const auto& ring : p.layout.tp_groups) {
          std::set<int> numa;
          for (int r : ring.ranks) numa.insert(topo.nodes[0].gpus[p.layout.ranks[r].device].numa);
          EXPECT_EQ(numa.size(), 1u) << "a TP group crosses sockets";
          EXPECT_NE(bottleneck(ring, p.costs).cls, LinkClass::SYS);
        }
      }
    }
  }
  // -mp view: the PXB pairs (0,1), (2,3), (4,5), (6,7) are the TP=2 groups.
  Plan p = plan(fixture("hopper_8gpu_6nic_topo_mp_pcie_only.txt"), {8, 2, 0, 1 << 20});
  for (const auto& ring : p.layout.tp_groups) EXPECT_EQ(bottleneck(ring, p.costs).cls, LinkClass::PXB);
}

TEST(Placement, UnusedGpusAreTheWorstConnected) {
  // Azure NC96ads: NV12 pairs (0,1) and (2,3), SYS across. Two ranks use one NV12 pair.
  const Topology azure = fixture("azure_nc96ads_a100v4_4gpu_nv12_pairs_4numa.txt");
  for (int t : {1, 2}) {
    Plan p = plan(azure, {2, t, 0, 1 << 20});
    EXPECT_EQ(azure.nodes[0].gpu_link(p.layout.ranks[0].device, p.layout.ranks[1].device), (Link{LinkClass::NV, 12}));
    ASSERT_EQ(p.unused_gpus[0].size(), 2u);
    EXPECT_EQ(azure.nodes[0].gpu_link(p.unused_gpus[0][0], p.unused_gpus[0][1]), (Link{LinkClass::NV, 12}));
  }
  // RTX 4090 box, 4 ranks: one socket's PIX quad, the other socket unused.
  const Topology rtx = fixture("rtx4090_8gpu_pcie_2socket_bondnic.txt");
  Plan p = plan(rtx, {4, 1, 0, 1 << 20});
  std::set<int> sockets;
  for (const auto& q : p.layout.ranks) sockets.insert(q.device / 4);
  EXPECT_EQ(sockets.size(), 1u);
  // DGX-1, 6 ranks at TP=1: against brute force (the used set maximises its worst link).
  const Topology dgx = fixture("dgx1_v100_1nic_oneflow.txt");
  Plan d = plan(dgx, {6, 1, 0, 1 << 20});
  EXPECT_EQ(planned_score(d, dgx, 0), exhaustive_optimum(dgx.nodes[0], dgx.costs, 6, 1));
  EXPECT_EQ(d.unused_gpus[0].size(), 2u);
}

TEST(Placement, RulePrioritiesOnSyntheticNodes) {
  // The slowest group first, before the total: {0,2} {1,3} (NV2 + NV2) beats {0,1} {2,3} (NV12 + PIX)
  // although the latter has more bandwidth in all.
  Topology a = topology_from_json(R"({"nodes": [{"gpus": 4, "links": {"default": "SYS",
      "pairs": [[0, 1, "NV12"], [2, 3, "PIX"], [0, 2, "NV2"], [1, 3, "NV2"]]}}]})");
  Plan p = plan(a, {4, 2, 0, 1 << 20});
  for (const auto& ring : p.layout.tp_groups) EXPECT_EQ(bottleneck(ring, p.costs), (Link{LinkClass::NV, 2}));
  // Equal bottlenecks: the larger total wins (TP=4 of 6: the quad with more NVLink inside).
  Topology b = topology_from_json(R"({"nodes": [{"gpus": 6, "links": {"default": "PIX",
      "pairs": [[3, 4, "NV4"], [4, 5, "NV4"], [3, 5, "NV4"], [0, 1, "NV1"]]}}]})");
  Plan q = plan(b, {4, 4, 0, 1 << 20});
  std::set<int> used;
  for (const auto& r : q.layout.ranks) used.insert(r.device);
  EXPECT_TRUE(used.count(3) && used.count(4) && used.count(5)) << "expected the NV4 triangle in the group";
  // Equal links: the group stays on one NUMA node.
  Topology c = topology_from_json(R"({"nodes": [{"numa_nodes": [{"id": 0}, {"id": 1}],
      "gpus": [{"numa": 0}, {"numa": 1}, {"numa": 0}, {"numa": 1}], "links": {"default": "PIX"}}]})");
  Plan r = plan(c, {4, 2, 0, 1 << 20});
  for (const auto& ring : r.layout.tp_groups)
    EXPECT_EQ(r.layout.ranks[ring.ranks[0]].device % 2, r.layout.ranks[ring.ranks[1]].device % 2);
}

TEST(Placement, SingleNodeDpRingIsACycleOnFastLinks) {
  const Topology dgx = fixture("dgx1_v100_1nic_oneflow.txt");
  Plan p = plan(dgx, {8, 1, 0, 64 << 20});
  ASSERT_EQ(p.layout.dp_groups.size(), 1u);
  const Ring& ring = p.layout.dp_groups[0];
  ASSERT_EQ(ring.links.size(), 8u);
  EXPECT_EQ(bottleneck(ring, p.costs).cls, LinkClass::NV);  // the cube-mesh has a Hamiltonian NVLink cycle
  EXPECT_EQ(bottleneck(p.naive.dp_groups[0], p.costs).cls, LinkClass::SYS);  // 3 -> 4 and 7 -> 0 are SYS
  ModelledTimes m = modelled_times(p, 64 << 20);
  EXPECT_GT(m.naive_dp_allreduce_us / m.dp_allreduce_us, 2.0);
}

TEST(Placement, MultiNodeRingsCrossNodesTheMinimumNumberOfTimes) {
  const Topology cluster = topology_from_json(replicated_json("dgx1_v100_1nic_oneflow.txt", 4), "4x8.json");
  for (int t : {1, 2, 4, 8}) {
    SCOPED_TRACE("TP=" + std::to_string(t));
    Plan p = plan(cluster, {32, t, 0, 1 << 20});
    check_invariants(p, cluster);
    for (const auto& ring : p.layout.dp_groups) {
      auto [hops, nodes] = crossings(p, ring);
      EXPECT_EQ(nodes, 4);
      EXPECT_EQ(hops, minimum_crossings(nodes));
      // Each node is one contiguous run: nodes appear in ascending order along the ring.
      for (size_t i = 1; i < ring.ranks.size(); ++i)
        EXPECT_LE(p.layout.ranks[ring.ranks[i - 1]].node, p.layout.ranks[ring.ranks[i]].node);
    }
    for (int node = 0; node < 4; ++node) {
      const Score s = planned_score(p, cluster, node);
      EXPECT_EQ(s, exhaustive_optimum(cluster.nodes[node], cluster.costs, 8, t));
    }
  }
  // Uneven use: 12 ranks fill node 0 and half of node 1.
  Plan p = plan(cluster, {12, 2, 0, 1 << 20});
  EXPECT_EQ(p.ranks_per_node, (std::vector<int>{8, 4, 0, 0}));
  EXPECT_EQ(p.unused_gpus[2].size(), 8u);
  for (const auto& ring : p.layout.dp_groups) {
    auto [hops, nodes] = crossings(p, ring);
    EXPECT_EQ(hops, minimum_crossings(nodes));
  }
  // ranks_per_node spreads the job: 4 ranks on each of the 4 nodes.
  Plan spread = plan(cluster, {16, 2, 4, 1 << 20});
  EXPECT_EQ(spread.ranks_per_node, (std::vector<int>{4, 4, 4, 4}));
  check_invariants(spread, cluster);
  for (const auto& ring : spread.layout.tp_groups) EXPECT_EQ(bottleneck(ring, spread.costs), (Link{LinkClass::NV, 2}));
}

// With pipelines (layout "dp,pp,tp"): rank r is stage (r / T) % P of replica r / (T P); each
// pipeline is P consecutive TP blocks along the best ring through a node, so on 8-GPU nodes it never
// leaves its node; DP rings hold one stage of every replica and still cross nodes the minimum number
// of times; TP groups stay the exhaustive optimum.
TEST(Placement, PipelinesStayInsideANodeAndDpRingsTakeOneStageOfEveryReplica) {
  const Topology cluster = topology_from_json(replicated_json("dgx1_v100_1nic_oneflow.txt", 4), "4x8.json");
  for (auto [t, pp] : std::vector<std::pair<int, int>>{{1, 2}, {2, 2}, {2, 4}, {1, 8}, {4, 2}}) {
    SCOPED_TRACE("TP=" + std::to_string(t) + " PP=" + std::to_string(pp));
    PlanRequest request{32, t, 0, 1 << 20};
    request.pp_degree = pp;
    const Plan p = plan(cluster, request);
    const int replicas = 32 / t / pp;
    ASSERT_EQ(static_cast<int>(p.layout.pp_groups.size()), replicas * t);
    for (int r = 0; r < 32; ++r) {
      EXPECT_EQ(p.layout.ranks[r].pp_index, r / t % pp);
      EXPECT_EQ(p.layout.ranks[r].dp_index, r / (t * pp));
      EXPECT_EQ(p.layout.ranks[r].tp_group, r / t);
    }
    for (int d = 0; d < replicas; ++d)
      for (int j = 0; j < t; ++j) {
        std::vector<int> expected;
        for (int s = 0; s < pp; ++s) expected.push_back((d * pp + s) * t + j);
        const Ring& pipeline = p.layout.pp_groups[p.layout.ranks[expected[0]].pp_group];
        EXPECT_EQ(pipeline.ranks, expected);
        std::set<int> nodes;
        for (int r : pipeline.ranks) nodes.insert(p.layout.ranks[r].node);
        EXPECT_EQ(nodes.size(), 1u) << "pipeline of replica " << d << " leaves its node";
      }
    ASSERT_EQ(static_cast<int>(p.layout.dp_groups.size()), pp * t);
    for (const auto& ring : p.layout.dp_groups) {
      std::vector<int> members = ring.ranks;
      std::sort(members.begin(), members.end());
      std::vector<int> expected;
      for (int d = 0; d < replicas; ++d) expected.push_back(d * t * pp + members[0] % (t * pp));
      EXPECT_EQ(members, expected);
      auto [hops, nodes] = crossings(p, ring);
      EXPECT_EQ(hops, minimum_crossings(nodes));
      for (size_t i = 1; i < ring.ranks.size(); ++i)
        EXPECT_LE(p.layout.ranks[ring.ranks[i - 1]].node, p.layout.ranks[ring.ranks[i]].node);
    }
    for (int node = 0; node < 4; ++node)
      EXPECT_EQ(planned_score(p, cluster, node), exhaustive_optimum(cluster.nodes[node], cluster.costs, 8, t));
    auto j = nlohmann::json::parse(plan_to_json(p));
    EXPECT_EQ(j["layout"], "dp=" + std::to_string(replicas) + ",pp=" + std::to_string(pp) + ",tp=" + std::to_string(t));
    EXPECT_EQ(j["pp_groups"].size(), p.layout.pp_groups.size());
    EXPECT_NE(explain(p, 1 << 20).find("Pipelines, ranks stage by stage"), std::string::npos);
  }
  PlanRequest odd{32, 2, 0, 1 << 20};
  odd.pp_degree = 3;
  EXPECT_THROW(plan(cluster, odd), PlanError);
  PlanRequest tp_outside{32, 2, 0, 1 << 20};
  tp_outside.layout_order = "tp,pp,dp";
  try {
    plan(cluster, tp_outside);
    ADD_FAILURE() << "expected PlanError";
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("the planner needs tp innermost"), std::string::npos) << e.what();
  }
}

TEST(Placement, NodesThatDiffer) {
  // merge_nodes output as loom::init builds it: an 8-GPU DGX-1, a 4-GPU Azure box, a 2-GPU workstation.
  Topology t =
      merge_nodes({fixture("dgx1_v100_1nic_oneflow.txt"), fixture("azure_nc96ads_a100v4_4gpu_nv12_pairs_4numa.txt"),
                   fixture("gtx1080ti_2gpu_phb_numa_na.txt")});
  Plan p = plan(t, {14, 2, 0, 1 << 20});
  check_invariants(p, t);
  EXPECT_EQ(p.ranks_per_node, (std::vector<int>{8, 4, 2}));
  for (int node = 0; node < 3; ++node)
    EXPECT_EQ(planned_score(p, t, node), exhaustive_optimum(t.nodes[node], t.costs, p.ranks_per_node[node], 2));
  for (const auto& ring : p.layout.dp_groups) {
    auto [hops, nodes] = crossings(p, ring);
    EXPECT_EQ(nodes, 3);
    EXPECT_EQ(hops, minimum_crossings(nodes));
  }
  // Azure's TP pairs are its NV12 pairs.
  for (const auto& ring : p.layout.tp_groups) {
    if (p.layout.ranks[ring.ranks[0]].node == 1) {
      EXPECT_EQ(bottleneck(ring, p.costs), (Link{LinkClass::NV, 12}));
    }
  }
}

TEST(Placement, ManyNodesPlanInUnderASecond) {
  const Topology cluster = topology_from_json(replicated_json("dgx1_v100_1nic_oneflow.txt", 1024), "1024x8.json");
  const auto start = std::chrono::steady_clock::now();
  Plan p = plan(cluster, {8192, 2, 0, 64 << 20});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("planned 8192 ranks on 1024 nodes in %.3f s\n", seconds);
  EXPECT_LT(seconds, time_bound(1.0));
  ASSERT_EQ(p.layout.ranks.size(), 8192u);
  for (const auto& ring : p.layout.tp_groups) {
    ASSERT_EQ(p.layout.ranks[ring.ranks[0]].node, p.layout.ranks[ring.ranks[1]].node);
    EXPECT_EQ(bottleneck(ring, p.costs), (Link{LinkClass::NV, 2}));
  }
  for (const auto& ring : p.layout.dp_groups) {
    auto [hops, nodes] = crossings(p, ring);
    EXPECT_EQ(nodes, 1024);
    EXPECT_EQ(hops, 1024);
  }
}

TEST(Placement, LargeNodesUseThePolynomialHeuristic) {
  // 16 GPUs: two NV12 islands of 8, SYS between. Too many candidates at TP=2 and 4 to enumerate.
  Topology t;
  Node n;
  for (int i = 0; i < 16; ++i) n.gpus.push_back({i, "", "", i / 8, {}});
  n.numa_nodes = {{0, {}}, {1, {}}};
  n.gpu_links.assign(16, std::vector<Link>(16));
  for (int a = 0; a < 16; ++a)
    for (int b = 0; b < 16; ++b)
      n.gpu_links[a][b] = a == b           ? Link{LinkClass::Self, 0}
                          : a / 8 == b / 8 ? Link{LinkClass::NV, 12}
                                           : Link{LinkClass::SYS, 0};
  n.nic_links.assign(16, {});
  t.nodes.push_back(n);
  for (int tp : {2, 4, 8}) {
    SCOPED_TRACE("TP=" + std::to_string(tp));
    Plan p = plan(t, {16, tp, 0, 1 << 20});
    check_invariants(p, t);
    for (const auto& ring : p.layout.tp_groups) EXPECT_EQ(bottleneck(ring, p.costs), (Link{LinkClass::NV, 12}));
    const bool heuristic =
        !p.notes.empty() && p.notes[0].find("greedy grouping improved by swaps") != std::string::npos;
    EXPECT_EQ(heuristic, tp != 8);  // TP=8 has 6,435 candidates: still exhaustive
  }
  // 12 of the 16 GPUs at TP=4: one island whole plus half of the other, never a group across.
  Plan p = plan(t, {12, 4, 0, 1 << 20});
  for (const auto& ring : p.layout.tp_groups) EXPECT_EQ(bottleneck(ring, p.costs), (Link{LinkClass::NV, 12}));
  EXPECT_EQ(p.unused_gpus[0].size(), 4u);
}

TEST(Placement, CpuSetsFollowTheGpuAndDoNotOverlap) {
  const Topology dgx = fixture("dgx1_v100_1nic_oneflow.txt");
  Plan p = plan(dgx, {8, 2, 0, 1 << 20});
  for (const auto& q : p.layout.ranks) {
    const Gpu& gpu = dgx.nodes[0].gpus[q.device];
    ASSERT_FALSE(q.cpus.empty());
    EXPECT_TRUE(std::includes(gpu.cpus.begin(), gpu.cpus.end(), q.cpus.begin(), q.cpus.end()))
        << "rank " << q.rank << " bound outside its GPU's affinity";
    EXPECT_EQ(q.cpus.size(), 6u);  // 24 CPUs per socket shared by 4 ranks
  }
  for (size_t a = 0; a < p.layout.ranks.size(); ++a)
    for (size_t b = a + 1; b < p.layout.ranks.size(); ++b) {
      CpuList common;
      std::set_intersection(p.layout.ranks[a].cpus.begin(), p.layout.ranks[a].cpus.end(),
                            p.layout.ranks[b].cpus.begin(), p.layout.ranks[b].cpus.end(), std::back_inserter(common));
      EXPECT_TRUE(common.empty()) << "ranks " << a << " and " << b << " share CPUs " << format_cpu_list(common);
    }
  // Each rank keeps hyperthread siblings (i, i + 24) together: "0-11,24-35" in 4 gives e.g. "0-2,24-26".
  for (const auto& q : p.layout.ranks) EXPECT_EQ(q.cpus[3] - q.cpus[0], 24) << format_cpu_list(q.cpus);
  // More ranks than CPUs: every rank still gets one.
  Topology tiny = topology_from_json(R"({"nodes": [{"numa_nodes": [{"id": 0, "cpus": "0"}],
      "gpus": [{"numa": 0, "cpus": "0"}, {"numa": 0, "cpus": "0"}], "links": {"default": "PIX"}}]})");
  Plan q = plan(tiny, {2, 1, 0, 1 << 20});
  EXPECT_EQ(format_cpu_list(q.layout.ranks[0].cpus), "0");
  EXPECT_EQ(format_cpu_list(q.layout.ranks[1].cpus), "0");
}

TEST(Placement, RequestsTheTopologyCannotServe) {
  const Topology dgx = fixture("dgx1_v100_1nic_oneflow.txt");
  auto error = [&](PlanRequest r) -> std::string {
    try {
      plan(dgx, r);
    } catch (const PlanError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(error({6, 4, 0, 1}), "world_size=6 is not divisible by tp_degree=4");
  EXPECT_EQ(error({0, 1, 0, 1}), "world_size=0: expected at least 1");
  EXPECT_EQ(error({16, 16, 0, 1}),
            "tp_degree=16 needs 16 GPUs in one node (TP groups never span nodes); the largest node has 8");
  EXPECT_EQ(error({16, 2, 0, 1}),
            "world_size=16 at tp_degree=2 needs one GPU per rank; the topology's 1 node(s) offer 8 usable GPUs");
  EXPECT_EQ(error({6, 2, 3, 1}), "ranks_per_node=3 is not a multiple of tp_degree=2: a TP group would span two nodes");
  EXPECT_EQ(error({16, 2, 16, 1}), "node 0 ('node0') has 8 GPUs, but ranks_per_node=16 (one GPU per rank)");
  Topology six = topology_from_json(R"({"nodes": [{"hostname": "h", "gpus": 6, "links": {"default": "NV4"}}]})");
  EXPECT_EQ(plan(six, {4, 4, 0, 1}).unused_gpus[0].size(), 2u);  // 6 GPUs hold one TP=4 group
  EXPECT_THROW(plan(six, {8, 4, 0, 1}), PlanError);
}

TEST(Placement, CostModelFormula) {
  LinkCosts c;
  Ring two{{0, 1}, {{LinkClass::NV, 2}, {LinkClass::NV, 2}}};
  const double bytes = 64.0 * (1 << 20);
  // 2(n-1) steps x 1.5 us + 2(n-1)/n x bytes / 50 GB/s
  EXPECT_NEAR(allreduce_time_us(two, bytes, c), 2 * 1.5 + bytes / 50e3, 1e-6);
  Ring four{{0, 1, 2, 3}, {{LinkClass::NV, 2}, {LinkClass::SYS, 0}, {LinkClass::NV, 1}, {LinkClass::PIX, 0}}};
  EXPECT_EQ(bottleneck(four, c), (Link{LinkClass::SYS, 0}));
  EXPECT_NEAR(allreduce_time_us(four, bytes, c), 6 * 7.0 + 1.5 * bytes / 10e3, 1e-6);
  EXPECT_EQ(allreduce_time_us(Ring{{3}, {}}, bytes, c), 0.0);
  // Overridden costs change the model.
  c.sys.bandwidth_gbps = 20;
  EXPECT_NEAR(allreduce_time_us(four, bytes, c), 6 * 7.0 + 1.5 * bytes / 20e3, 1e-6);
}

TEST(Placement, ExplainAndJsonAgreeWithThePlan) {
  const Topology dgx = fixture("dgx1_v100_1nic_oneflow.txt");
  Plan p = plan(dgx, {8, 2, 0, 64 << 20});
  const std::string text = explain(p, 64 << 20);
  EXPECT_NE(text.find("Placement: 8 ranks, TP 2 x DP 4 on 1 node"), std::string::npos) << text;
  EXPECT_NE(text.find("TP groups (all-reduce of 64.0 MiB)"), std::string::npos) << text;
  EXPECT_NE(text.find("NV2"), std::string::npos);
  EXPECT_NE(text.find("naive/planned"), std::string::npos);
  const ModelledTimes m = modelled_times(p, 64 << 20);
  char ratio[32];
  std::snprintf(ratio, sizeof(ratio), "%.2f", m.naive_tp_allreduce_us / m.tp_allreduce_us);
  EXPECT_NE(text.find(ratio), std::string::npos) << "explain must show the TP ratio " << ratio << "\n" << text;

  auto j = nlohmann::json::parse(plan_to_json(p));
  EXPECT_EQ(j["world_size"], 8);
  ASSERT_EQ(j["ranks"].size(), 8u);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(j["ranks"][r]["rank"], r);
    EXPECT_EQ(j["ranks"][r]["device"], p.layout.ranks[r].device);
    EXPECT_EQ(j["ranks"][r]["hostname"], "node0");
    EXPECT_EQ(j["ranks"][r]["cpus"], format_cpu_list(p.layout.ranks[r].cpus));
  }
  EXPECT_EQ(j["tp_groups"][1], (std::vector<int>{2, 3}));
  EXPECT_EQ(j["dp_groups"][0], (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(j["dp_rings"][0].size(), 4u);
  EXPECT_DOUBLE_EQ(j["modelled"]["tp_allreduce_us"].get<double>(), m.tp_allreduce_us);
  EXPECT_DOUBLE_EQ(j["modelled"]["naive_dp_allreduce_us"].get<double>(), m.naive_dp_allreduce_us);
  EXPECT_EQ(j["modelled"]["message_bytes"], 64 << 20);
  EXPECT_EQ(j["tp_bottlenecks"][0], "NV2");
}
