// `nvidia-smi topo -m` text: every real fixture parses to what the machine has; damaged text is
// rejected with the line and column of the damage.
#include <gtest/gtest.h>

#include <map>

#include "loom/topology/topology.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;

namespace {

Topology parse_smi_fixture(const std::string& name) {
  return parse_nvidia_smi_topo(read_fixture(name), name);
}

struct Expected {
  int gpus;
  int nics;
};

// Every `topo -m` / `-mp` fixture, with its GPU and NIC count as the source shows them.
const std::map<std::string, Expected> kExpected = {
    {"a100_8gpu_17nic_single_numa.txt", {8, 17}},
    {"a100_sxm4_3nic_bond_k8s.txt", {8, 3}},
    {"a100_sxm4_8nic_roce_deepep.txt", {8, 8}},
    {"a100_sxm64gb_4gpu_nv4_4nic.txt", {4, 4}},
    {"a10_4gpu_sys_2nic_single_numa.txt", {4, 2}},
    {"a800_8gpu_nv8_4nic_asym.txt", {8, 4}},
    {"azure_nc96ads_a100v4_4gpu_nv12_pairs_4numa.txt", {4, 0}},
    {"dgx1_v100_1nic_oneflow.txt", {8, 1}},
    {"dgx1_v100_4nic_pytorch.txt", {8, 4}},
    {"gh200_4gpu_nv6_gpu_numa_id.txt", {4, 0}},
    {"gtx1080ti_2gpu_phb_numa_na.txt", {2, 0}},
    {"hgx_h100class_8gpu_13nic_ib_eth.txt", {8, 13}},
    {"hopper_8gpu_6nic_topo_mp_pcie_only.txt", {8, 6}},
    {"rtx3090_2gpu_nvlink_bridge_nv4.txt", {2, 0}},
    {"rtx4090_8gpu_pcie_2socket_bondnic.txt", {8, 1}},
    {"rtx5090_2gpu_phb_workstation.txt", {2, 0}},
};

}  // namespace

TEST(NvidiaSmiTopo, EveryMatrixFixtureParses) {
  auto names = topo_matrix_fixtures();
  ASSERT_EQ(names.size(), kExpected.size()) << "a fixture was added or removed: update kExpected";
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    auto it = kExpected.find(name);
    ASSERT_NE(it, kExpected.end());
    Topology t;
    ASSERT_NO_THROW(t = parse_smi_fixture(name));
    ASSERT_EQ(t.nodes.size(), 1u);
    const Node& n = t.nodes[0];
    EXPECT_EQ(static_cast<int>(n.gpus.size()), it->second.gpus);
    EXPECT_EQ(static_cast<int>(n.nics.size()), it->second.nics);
    EXPECT_NO_THROW(validate(t));
    for (const auto& gpu : n.gpus) {
      EXPECT_FALSE(gpu.cpus.empty()) << "GPU" << gpu.index << " has no CPU affinity";
      EXPECT_GE(gpu.numa, 0) << "GPU" << gpu.index << " has no NUMA node";
      ASSERT_NE(n.numa_node(gpu.numa), nullptr);
    }
    EXPECT_NE(n.source.find(name), std::string::npos);
  }
}

TEST(NvidiaSmiTopo, Dgx1CubeMesh) {
  for (const char* name : {"dgx1_v100_4nic_pytorch.txt", "dgx1_v100_1nic_oneflow.txt"}) {
    SCOPED_TRACE(name);
    const Node n = parse_smi_fixture(name).nodes[0];
    EXPECT_EQ(n.gpu_link(0, 3), L("NV2"));
    EXPECT_EQ(n.gpu_link(0, 1), L("NV1"));
    EXPECT_EQ(n.gpu_link(0, 5), L("SYS"));
    EXPECT_EQ(n.gpu_link(0, 0), L("X"));
    EXPECT_EQ(n.gpu_link(6, 7), L("NV2"));
    EXPECT_EQ(n.gpu_link(7, 3), L("NV1"));
  }
  // Old-style NIC columns named mlx5_* (no NIC Legend), in the order printed.
  const Node p = parse_smi_fixture("dgx1_v100_4nic_pytorch.txt").nodes[0];
  ASSERT_EQ(p.nics.size(), 4u);
  EXPECT_EQ(p.nics[0].name, "mlx5_2");
  EXPECT_EQ(p.nics[1].name, "mlx5_0");
  EXPECT_EQ(p.nic_links[0][1], L("PIX"));  // GPU0 - mlx5_0
  EXPECT_EQ(p.nic_links[0][3], L("PHB"));  // GPU0 - mlx5_1
  EXPECT_EQ(p.nic_links[4][0], L("PIX"));  // GPU4 - mlx5_2
  // One CPU affinity for all GPUs and no NUMA column: one inferred NUMA node.
  ASSERT_EQ(p.numa_nodes.size(), 1u);
  EXPECT_EQ(format_cpu_list(p.numa_nodes[0].cpus), "0-19,40-59");
}

TEST(NvidiaSmiTopo, OneflowPerSocketAffinity) {
  const Node n = parse_smi_fixture("dgx1_v100_1nic_oneflow.txt").nodes[0];
  EXPECT_EQ(format_cpu_list(n.gpus[0].cpus), "0-11,24-35");
  EXPECT_EQ(format_cpu_list(n.gpus[3].cpus), "0-11,24-35");
  EXPECT_EQ(format_cpu_list(n.gpus[4].cpus), "12-23,36-47");
  // No NUMA column: the two distinct affinities become NUMA nodes 0 and 1, noted as inferred.
  ASSERT_EQ(n.numa_nodes.size(), 2u);
  EXPECT_EQ(n.gpus[0].numa, 0);
  EXPECT_EQ(n.gpus[7].numa, 1);
  EXPECT_EQ(format_cpu_list(n.numa_node(1)->cpus), "12-23,36-47");
  bool noted = false;
  for (const auto& note : n.notes) noted = noted || note.find("inferred from the CPU Affinity") != std::string::npos;
  EXPECT_TRUE(noted);
  EXPECT_EQ(n.nics[0].name, "mlx5_0");
  EXPECT_EQ(n.nic_links[2][0], L("PIX"));
  EXPECT_EQ(n.nic_links[0][0], L("NODE"));
}

TEST(NvidiaSmiTopo, NicLegendNamesAndNuma) {
  const Node h = parse_smi_fixture("hgx_h100class_8gpu_13nic_ib_eth.txt").nodes[0];
  EXPECT_EQ(h.gpu_link(2, 5), L("NV18"));
  EXPECT_EQ(h.nics[0].name, "mlx5_ib0");
  EXPECT_EQ(h.nics[12].name, "mlx5_eth4");
  EXPECT_EQ(h.nic_links[0][0], L("PIX"));
  EXPECT_EQ(h.nic_links[0][1], L("PXB"));
  EXPECT_EQ(h.nic_links[4][8], L("NODE"));
  EXPECT_EQ(h.gpus[4].numa, 1);  // GPU NUMA ID is N/A; NUMA Affinity says 1
  EXPECT_EQ(format_cpu_list(h.gpus[4].cpus), "56-111,168-223");

  const Node k = parse_smi_fixture("a100_sxm4_3nic_bond_k8s.txt").nodes[0];
  EXPECT_EQ(k.nics[2].name, "mlx5_bond_0");
  EXPECT_EQ(k.nic_links[6][1], L("NODE"));  // GPU6 has no PXB NIC
  EXPECT_EQ(k.numa_nodes.size(), 2u);

  const Node a = parse_smi_fixture("a100_8gpu_17nic_single_numa.txt").nodes[0];
  EXPECT_EQ(a.nics[16].name, "mlx5_bond_0");
  EXPECT_EQ(a.nic_links[0][4], L("SYS"));
  ASSERT_EQ(a.numa_nodes.size(), 1u);  // SYS paths although there is one NUMA node (as printed)
  EXPECT_EQ(format_cpu_list(a.numa_nodes[0].cpus), "0-103");
}

TEST(NvidiaSmiTopo, CrlfTabsAndAsymmetricNics) {
  const Node a = parse_smi_fixture("a800_8gpu_nv8_4nic_asym.txt").nodes[0];  // CRLF line endings
  EXPECT_EQ(a.gpu_link(0, 7), L("NV8"));
  EXPECT_EQ(a.nic_links[1][0], L("PIX"));
  EXPECT_EQ(a.nic_links[7][3], L("PIX"));
  EXPECT_EQ(a.nics[3].name, "mlx5_3");  // no '\r' left in names
  EXPECT_EQ(format_cpu_list(a.gpus[7].cpus), "32-63,96-127");

  const Node r = parse_smi_fixture("rtx4090_8gpu_pcie_2socket_bondnic.txt").nodes[0];  // tab-separated
  EXPECT_EQ(r.gpu_link(0, 3), L("PIX"));
  EXPECT_EQ(r.gpu_link(3, 4), L("SYS"));
  EXPECT_EQ(r.gpus[4].numa, 1);
  EXPECT_EQ(r.nics[0].name, "mlx5_bond_0");
  EXPECT_EQ(format_cpu_list(r.gpus[0].cpus), "0-35,72-107");

  const Node w = parse_smi_fixture("rtx5090_2gpu_phb_workstation.txt").nodes[0];
  EXPECT_EQ(w.gpu_link(0, 1), L("PHB"));
}

TEST(NvidiaSmiTopo, NumaVariants) {
  const Node g = parse_smi_fixture("gh200_4gpu_nv6_gpu_numa_id.txt").nodes[0];
  EXPECT_EQ(g.gpu_link(0, 3), L("NV6"));
  EXPECT_EQ(g.gpus[1].numa, 1);  // NUMA Affinity "1,13-19": the CPU-side node comes first
  EXPECT_EQ(format_cpu_list(g.gpus[1].cpus), "72-143");
  EXPECT_EQ(g.numa_nodes.size(), 4u);

  const Node z = parse_smi_fixture("azure_nc96ads_a100v4_4gpu_nv12_pairs_4numa.txt").nodes[0];
  EXPECT_EQ(z.gpu_link(0, 1), L("NV12"));
  EXPECT_EQ(z.gpu_link(1, 2), L("SYS"));
  EXPECT_EQ(z.gpus[3].numa, 3);

  const Node t = parse_smi_fixture("gtx1080ti_2gpu_phb_numa_na.txt").nodes[0];  // NUMA Affinity N/A
  EXPECT_EQ(t.gpus[0].numa, 0);                                             // inferred from the shared CPU affinity
  EXPECT_EQ(format_cpu_list(t.gpus[1].cpus), "0-11");

  const Node m = parse_smi_fixture("hopper_8gpu_6nic_topo_mp_pcie_only.txt").nodes[0];  // topo -mp
  EXPECT_EQ(m.gpu_link(0, 1), L("PXB"));
  EXPECT_EQ(m.gpu_link(0, 2), L("NODE"));
  EXPECT_EQ(m.gpu_link(0, 4), L("SYS"));
}

TEST(NvidiaSmiTopo, MangledAffinityIsRejectedAtItsLineAndColumn) {
  const std::string text = read_fixture(kMangledFixture);
  const std::string error = parse_error_of([&] { parse_nvidia_smi_topo(text, kMangledFixture); });
  ASSERT_FALSE(error.empty()) << "the damaged file was accepted";
  // Line 2 is GPU0's row; the error points at its run-together affinity field.
  const size_t line2 = text.find('\n') + 1;
  const size_t column = text.find("0-45,92-1370", line2) - line2 + 1;
  EXPECT_EQ(error.rfind(std::string(kMangledFixture) + ":2:" + std::to_string(column) + ": ", 0), 0u) << error;
  EXPECT_NE(error.find("GPU0 row: expected 3 affinity fields (CPU Affinity, NUMA Affinity, GPU NUMA ID) after the "
                       "18 link cells, found 2 ('0-45,92-1370' 'N/A')"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("do not line up with the header on line 1"), std::string::npos) << error;
}

TEST(NvidiaSmiTopo, P2pMatricesAreRejectedAsSuch) {
  auto names = p2p_fixtures();
  ASSERT_EQ(names.size(), 4u);
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    std::string error = parse_error_of([&] { parse_smi_fixture(name); });
    EXPECT_NE(error.find("this is an `nvidia-smi topo -p2p` matrix, not `nvidia-smi topo -m`"), std::string::npos)
        << error;
    EXPECT_EQ(error.rfind(name + ":2:", 0), 0u) << error;  // the first status cell, on GPU0's row
  }
  // The same through the file loader.
  EXPECT_NE(parse_error_of([] { load_topology_file(fixture_path("l4_2gpu_p2p_read_cns.txt")); }).find("-p2p"),
            std::string::npos);
}

namespace {

const std::string kSmall =
    "        GPU0    GPU1    GPU2    NIC0    CPU Affinity    NUMA Affinity\n"
    "GPU0     X      NV2     SYS     PIX     0-7     0\n"
    "GPU1    NV2      X      SYS     PIX     0-7     0\n"
    "GPU2    SYS     SYS      X      SYS     8-15    1\n"
    "NIC0    PIX     PIX     SYS      X\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "\n"
    "NIC Legend:\n"
    "\n"
    "  NIC0: mlx5_0\n";

std::string replace_once(std::string s, const std::string& from, const std::string& to) {
  size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return s.replace(at, from.size(), to);
}

std::string smi_error_for(const std::string& text) {
  return parse_error_of([&] { parse_nvidia_smi_topo(text, "t.txt"); });
}

}  // namespace

TEST(NvidiaSmiTopo, SmallHandWrittenMatrix) {
  Topology t = parse_nvidia_smi_topo(kSmall);
  const Node& n = t.nodes[0];
  EXPECT_EQ(n.gpus.size(), 3u);
  EXPECT_EQ(n.nics[0].name, "mlx5_0");
  EXPECT_EQ(n.gpu_link(0, 1), L("NV2"));
  EXPECT_EQ(n.gpus[2].numa, 1);
  // The default source name, in errors.
  EXPECT_EQ(
      parse_error_of([] { parse_nvidia_smi_topo("hello\n"); })
          .rfind("nvidia-smi topo -m text:1:1: expected the header row of `nvidia-smi topo -m` to start with 'GPU0', "
                 "found 'hello'",
                 0),
      0u);
}

TEST(NvidiaSmiTopo, DamagedTextGivesLineAndColumn) {
  // Unknown class.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "GPU1    NV2 ", "GPU1    NVX ")),
            "t.txt:3:9: GPU1 row, column GPU0: expected a link class (X, NV#, PIX, PXB, PHB, NODE, SYS), found 'NVX'");
  // A row missing a cell: the affinity slides into the link columns.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "GPU2    SYS     SYS      X      SYS     8-15",
                                   "GPU2    SYS     SYS      X      8-15")),
            "t.txt:4:33: GPU2 row, column NIC0: expected a link class (X, NV#, PIX, PXB, PHB, NODE, SYS), found '8-15' "
            "(the row has fewer link cells than the header has device columns)");
  // A truncated row (cut mid-line).
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "NIC0    PIX     PIX     SYS      X\n", "NIC0    PIX     PIX\n")),
            "t.txt:5:20: NIC0 row: expected 4 link cells (one per column of the header on line 1), found 2");
  // Truncated text: rows missing at the end.
  EXPECT_EQ(
      smi_error_for(kSmall.substr(0, kSmall.find("GPU2    SYS"))),
      "t.txt:4:1: expected the row of 'GPU2' (the header on line 1 has 4 device columns), found the end of the text");
  // One affinity field too many.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "8-15    1\n", "8-15    1    7\n")).substr(0, 60),
            "t.txt:4:41: GPU2 row: expected 2 affinity fields (CPU Affini");
  // Wrong column count in the header (a column with no row).
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "NIC0    CPU", "NIC0    NIC1    CPU")),
            "t.txt:2:41: GPU0 row, column NIC1: expected a link class (X, NV#, PIX, PXB, PHB, NODE, SYS), found '0-7' "
            "(the row has fewer link cells than the header has device columns)");
  // Asymmetric matrix.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "GPU2    SYS     SYS ", "GPU2    SYS     PIX ")),
            "t.txt:4:17: GPU2 row, column GPU1: expected SYS (as GPU1 row, column GPU2 on line 3 says: the matrix is "
            "symmetric), found PIX");
  // Rows out of order (swapped lines).
  EXPECT_EQ(
      smi_error_for(replace_once(replace_once(kSmall, "GPU0     X ", "@@@"), "GPU1    NV2 ", "GPU0     X ")).substr(0, 30),
      "t.txt:2:1: expected the row of");
  // X off the diagonal, and a missing X.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "GPU0     X      NV2", "GPU0     X      X  ")),
            "t.txt:2:17: GPU0 row, column GPU1: expected a link class other than 'X' off the diagonal, found 'X'");
  // A bad CPU list and a bad NUMA id.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "8-15    1", "15-8    1")),
            "t.txt:4:41: GPU2 CPU Affinity: expected a CPU list such as 0-11,24-35 or N/A, found '15-8'");
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "8-15    1", "8-15    one")),
            "t.txt:4:49: GPU2 NUMA Affinity: expected NUMA node ids such as 0 or 0,5-11, or N/A, found 'one'");
  // Junk after the matrix, a NIC legend naming a NIC that does not exist.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "\nLegend:", "\nGPU3 X\nLegend:")),
            "t.txt:7:1: expected a blank line or 'Legend:' after the last matrix row ('NIC0'), found 'GPU3'");
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "NIC0: mlx5_0", "NIC7: mlx5_0")),
            "t.txt:13:3: the NIC legend names 'NIC7', which is not a column of the header on line 1");
  // Header problems.
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "GPU1    GPU2", "GPU2    GPU1")),
            "t.txt:1:17: expected 'GPU1', found 'GPU2'");
  EXPECT_EQ(smi_error_for(replace_once(kSmall, "NUMA Affinity", "NUMA Affinity  Bogus")),
            "t.txt:1:72: expected an affinity column title (CPU Affinity, NUMA Affinity, GPU NUMA ID) after 'NUMA "
            "Affinity', found 'Bogus'");
  EXPECT_EQ(
      smi_error_for(""),
      "t.txt:1:1: expected the header row of `nvidia-smi topo -m` (GPU0 GPU1 ... CPU Affinity ...), found no text");
}
