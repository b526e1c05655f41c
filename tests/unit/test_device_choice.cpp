// Which CUDA device each rank drives (src/runtime/device_choice.h), on a simulated 4-GPU machine:
// the fake NVML library describes the GPUs (index and PCI bus id, as the placement plan sees
// them), and CUDA_VISIBLE_DEVICES decides which of them a process sees and in which order, as the
// CUDA runtime would number them (by bus id: the plan's GPU must be found whatever the numbering).
#include <gtest/gtest.h>

#include <set>
#include <sstream>

#include "loom/topology/detect.h"
#include "loom/topology/placement.h"
#include "runtime/device_choice.h"

using namespace loom;
using loom::detail::choose_device;
using loom::detail::DeviceRequest;
using loom::detail::RankDevice;
using loom::detail::shared_gpu_problems;

namespace {

topo::Topology simulated_machine() {
  topo::DetectOptions o;
  o.nvml_library = LOOM_FAKE_NVML;
  o.hwloc_xml = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/hwloc/two_socket_4gpu.xml";
  o.hostname = "sim";
  return topo::detect_host(o).topology;
}

// What CUDA reports for CUDA_VISIBLE_DEVICES=`list` (indices into the machine's GPUs): the bus ids
// of the listed GPUs, in the listed order.
std::vector<std::string> visible_bus_ids(const topo::Node& node, const std::string& list) {
  std::vector<std::string> ids;
  std::stringstream in(list);
  for (std::string index; std::getline(in, index, ',');) ids.push_back(node.gpus.at(std::stoi(index)).pci_bus_id);
  return ids;
}

DeviceRequest request_for(const topo::Topology& machine, const topo::Plan& plan, int rank,
                          const std::string& cuda_visible_devices) {
  DeviceRequest in;
  in.local_rank = rank;
  in.visible_bus_ids = visible_bus_ids(machine.nodes[0], cuda_visible_devices);
  const auto& placed = plan.layout.ranks[rank];
  in.planned_bus_id = machine.nodes[0].gpus[placed.device].pci_bus_id;
  in.planned_index = placed.device;
  return in;
}

}  // namespace

// Whatever the order CUDA numbers the GPUs in, each rank drives the GPU the plan gave it.
TEST(DeviceChoice, PlannedGpuFoundByBusIdUnderPermutedVisibleDevices) {
  const topo::Topology machine = simulated_machine();
  ASSERT_EQ(machine.nodes[0].gpus.size(), 4u);
  const topo::Plan plan = topo::plan(machine, {.world_size = 4, .tp_degree = 2});
  for (const std::string order : {"0,1,2,3", "3,2,1,0", "2,0,3,1", "1,3,0,2"}) {
    std::set<std::string> driven;
    for (int rank = 0; rank < 4; ++rank) {
      const DeviceRequest in = request_for(machine, plan, rank, order);
      const auto choice = choose_device(in);
      ASSERT_TRUE(choice.device) << order << " rank " << rank << ": " << choice.problem;
      EXPECT_EQ(in.visible_bus_ids[*choice.device], *in.planned_bus_id) << "CUDA_VISIBLE_DEVICES=" << order;
      EXPECT_NE(choice.why.find("the placement plan (GPU " + std::to_string(in.planned_index)), std::string::npos)
          << choice.why;
      driven.insert(in.visible_bus_ids[*choice.device]);
    }
    EXPECT_EQ(driven.size(), 4u) << "two ranks on one GPU under CUDA_VISIBLE_DEVICES=" << order;
  }
}

// A process that sees only some GPUs (a scheduler's "2,3"): the plan's GPU 0 is not among them, so
// the rank falls back to its local rank, and says why.
TEST(DeviceChoice, PlannedGpuNotVisibleFallsBackAndSaysSo) {
  const topo::Topology machine = simulated_machine();
  const topo::Plan plan = topo::plan(machine, {.world_size = 4, .tp_degree = 2});
  int rank = 0;
  while (plan.layout.ranks[rank].device != 0) ++rank;
  DeviceRequest in = request_for(machine, plan, rank, "2,3");
  in.local_rank = 1;
  const auto choice = choose_device(in);
  ASSERT_TRUE(choice.device);
  EXPECT_EQ(*choice.device, 1);
  EXPECT_NE(choice.why.find("the local rank (the plan's GPU 0, 0000:07:00.0 is not visible to this process)"),
            std::string::npos)
      << choice.why;
}

TEST(DeviceChoice, WithoutAPlan) {
  DeviceRequest in;
  in.visible_bus_ids = {"0000:07:00.0"};
  in.local_rank = 1;
  auto one = choose_device(in);  // one visible GPU: that one, whatever the local rank
  ASSERT_TRUE(one.device);
  EXPECT_EQ(*one.device, 0);
  EXPECT_EQ(one.why, "the one GPU this process sees");
  in.visible_bus_ids = {"0000:07:00.0", "0000:08:00.0"};
  in.local_rank = 2;  // three ranks on a two-GPU node
  auto none = choose_device(in);
  EXPECT_FALSE(none.device);
  EXPECT_EQ(none.problem, "local rank 2 has no GPU of its own: 2 visible CUDA devices");
  in.visible_bus_ids.clear();
  EXPECT_EQ(choose_device(in).problem, "no CUDA device is visible");
}

TEST(DeviceChoice, RequestedDeviceWinsAndIsChecked) {
  DeviceRequest in;
  in.visible_bus_ids = {"0000:07:00.0", "0000:08:00.0"};
  in.planned_bus_id = "0000:08:00.0";
  in.requested = 0;
  auto chosen = choose_device(in);
  ASSERT_TRUE(chosen.device);
  EXPECT_EQ(*chosen.device, 0);
  EXPECT_TRUE(chosen.requested);
  EXPECT_EQ(chosen.why, "LOOM_DEVICE");
  in.requested = 2;
  EXPECT_EQ(choose_device(in).problem, "LOOM_DEVICE=2 is not among the 2 visible CUDA devices");
}

// Two ranks of one node on one GPU: only when each asked for it.
TEST(DeviceChoice, SharingAGpuOnlyWhenAsked) {
  // A one-GPU workstation, two ranks, each seeing the one GPU.
  const std::vector<RankDevice> accidental = {{0, "0000:07:00.0", false}, {0, "0000:07:00.0", false}};
  const auto problems = shared_gpu_problems(accidental);
  EXPECT_EQ(problems[0], "shares GPU 0000:07:00.0 with rank 1 on its node (one GPU per rank, or LOOM_DEVICE on each "
                         "rank to share it)");
  EXPECT_NE(problems[1].find("with rank 0 on its node"), std::string::npos);
  // LOOM_DEVICE=0 on both: shared on purpose.
  const std::vector<RankDevice> asked = {{0, "0000:07:00.0", true}, {0, "0000:07:00.0", true}};
  EXPECT_EQ(shared_gpu_problems(asked), std::vector<std::string>(2));
  // The same bus id on two nodes is two GPUs.
  const std::vector<RankDevice> two_nodes = {{0, "0000:07:00.0", false}, {1, "0000:07:00.0", false}};
  EXPECT_EQ(shared_gpu_problems(two_nodes), std::vector<std::string>(2));
  // Ranks without a GPU share nothing.
  const std::vector<RankDevice> cpu = {{0, "", false}, {0, "", false}};
  EXPECT_EQ(shared_gpu_problems(cpu), std::vector<std::string>(2));
}

// Ranks without a planned GPU keep their memory on one NUMA node: the two sockets are shared out.
TEST(CpuShare, NumaNodesSharedOutAmongLocalRanks) {
  const topo::Node node = simulated_machine().nodes[0];
  ASSERT_EQ(node.numa_nodes.size(), 2u);
  EXPECT_EQ(topo::format_cpu_list(topo::cpu_only_share(node, 0, 4)), "0-3");
  EXPECT_EQ(topo::format_cpu_list(topo::cpu_only_share(node, 1, 4)), "0-3");
  EXPECT_EQ(topo::format_cpu_list(topo::cpu_only_share(node, 2, 4)), "4-7");
  EXPECT_EQ(topo::format_cpu_list(topo::cpu_only_share(node, 3, 4)), "4-7");
  EXPECT_EQ(topo::format_cpu_list(topo::cpu_only_share(node, 0, 3)), "0-3");
  EXPECT_EQ(topo::format_cpu_list(topo::cpu_only_share(node, 2, 3)), "4-7");
  EXPECT_EQ(topo::format_cpu_list(topo::cpu_only_share(node, 0, 1)), "0-7");  // one rank: both sockets
  topo::Node one_numa = node;
  one_numa.numa_nodes.resize(1);
  EXPECT_TRUE(topo::cpu_only_share(one_numa, 0, 2).empty());  // nothing to choose between
}
