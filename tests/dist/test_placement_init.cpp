// loom::init() with a topology file on a machine without GPUs: the ranks stand in for the described
// GPUs, init() plans the placement, and ParallelState at the plan's TP degree builds the planned
// groups (TP blocks on the best-connected GPU pairs, DP groups in the planned ring order), and a
// collective on each of them works. Run by CTest at 8 ranks with
//   LOOM_TOPOLOGY=tests/fixtures/topology/sim_2x4_nv2_pairs.json LOOM_TP=2
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "loom/parallel/tensor_parallel.h"
#include "loom/runtime.h"
#include "rank_report.h"

using namespace loom;

namespace {
std::shared_ptr<Runtime> g_runtime;
}

TEST(PlacementInit, InitPlansFromTheTopologyFile) {
  const topo::Plan* plan = g_runtime->plan();
  ASSERT_NE(plan, nullptr) << "no plan: is LOOM_TOPOLOGY set?";
  EXPECT_EQ(plan, placement_plan());
  EXPECT_EQ(plan->request.world_size, g_runtime->world().size);
  EXPECT_EQ(plan->request.tp_degree, 2);
  // Every TP group lies on one node, on an NV2 pair (never the PHB pairs of the naive layout).
  const auto& topology = g_runtime->topology();
  for (const auto& group : plan->layout.tp_groups) {
    const auto& a = plan->layout.ranks[group.ranks[0]];
    const auto& b = plan->layout.ranks[group.ranks[1]];
    EXPECT_EQ(a.node, b.node);
    const topo::Link link = topology.nodes[a.node].gpu_link(a.device, b.device);
    EXPECT_EQ(link.cls, topo::LinkClass::NV) << "TP group of ranks " << group.ranks[0] << ", " << group.ranks[1];
    EXPECT_EQ(link.nvlinks, 2);
  }
}

TEST(PlacementInit, ParallelStateBuildsThePlannedGroups) {
  const topo::Plan* plan = g_runtime->plan();
  ASSERT_NE(plan, nullptr);
  auto world = g_runtime->world_comm();
  const int rank = world->rank();
  ParallelConfig config;
  config.tensor_parallel = 2;
  config.dp_rings = planned_dp_rings(2);
  ParallelState ps(world, config);
  const auto& me = plan->layout.ranks[rank];
  // TP: the planned block, in order.
  EXPECT_EQ(ps.tp_group()->members(), plan->layout.tp_groups[me.tp_group].ranks);
  // DP: the planned ring, as the group's rank order.
  EXPECT_EQ(ps.dp_group()->members(), plan->layout.dp_groups[me.dp_group].ranks);
  // And both work.
  for (const auto& group : {ps.tp_group(), ps.dp_group()}) {
    at::Tensor t = at::full({300}, static_cast<double>(rank));
    group->all_reduce(t)->wait();
    double expected = 0;
    for (int member : group->members()) expected += member;
    EXPECT_TRUE(at::all(t.eq(expected)).item<bool>()) << group->name();
  }
}

TEST(PlacementInit, RingsComeOnlyFromThePlanMadeForThatDegree) {
  const topo::Plan* plan = g_runtime->plan();
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(planned_dp_rings(2).size(), plan->layout.dp_groups.size());
  EXPECT_TRUE(planned_dp_rings(4).empty());  // the plan was made for TP 2
}

TEST(PlacementInit, ParallelStateFollowsTheRingsItIsGiven) {
  // ParallelState takes no plan of its own (the build keeps the parallel layer from reading the
  // runtime's): rings in another order than the plan's make DP groups in that order.
  const topo::Plan* plan = g_runtime->plan();
  ASSERT_NE(plan, nullptr);
  auto world = g_runtime->world_comm();
  ParallelConfig config;
  config.tensor_parallel = 2;
  config.dp_rings = planned_dp_rings(2);
  for (auto& ring : config.dp_rings) std::reverse(ring.begin(), ring.end());
  ParallelState ps(world, config);
  const auto& me = plan->layout.ranks[world->rank()];
  std::vector<int> reversed = plan->layout.dp_groups[me.dp_group].ranks;
  std::reverse(reversed.begin(), reversed.end());
  EXPECT_EQ(ps.dp_group()->members(), reversed);
}

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  g_runtime = init();
  test::report_failures_only_unless_rank0(g_runtime->world().rank);
  if (g_runtime->world().rank == 0 && g_runtime->plan()) std::cout << topo::explain(*g_runtime->plan(), 64 << 20);
  const int status = RUN_ALL_TESTS();
  g_runtime.reset();
  finalize();
  return status;
}
