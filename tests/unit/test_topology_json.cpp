// JSON topology files: the documented schema (replicate, shortcuts, cost overrides), a lossless
// round trip of every parsed fixture, and errors that name the JSON pointer, line and column.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "loom/topology/topology.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;

namespace {

std::string json_error_for(const std::string& text) {
  return parse_error_of([&] { topology_from_json(text, "t.json"); });
}

// The example of docs/topology.md: two kinds of node, one of them replicated.
const char* kCluster = R"({
  "loom_topology": 1,
  "link_costs": {"NET": {"bandwidth_gbps": 50, "latency_us": 5}, "NV": {"bandwidth_gbps": 50}},
  "nodes": [
    {
      "hostname": "dgx{i}",
      "replicate": 3,
      "sockets": [{"id": 0, "cpus": "0-19,40-59"}, {"id": 1, "cpus": "20-39,60-79"}],
      "numa_nodes": [{"id": 0, "cpus": "0-19,40-59"}, {"id": 1, "cpus": "20-39,60-79"}],
      "gpus": [
        {"numa": 0, "cpus": "0-19,40-59"}, {"numa": 0, "cpus": "0-19,40-59"},
        {"numa": 1, "cpus": [20, 21, 22]}, {"numa": 1, "cpus": "20-39,60-79"}
      ],
      "links": {"default": "SYS", "pairs": [[0, 1, "NV2"], [2, 3, "NV2"]]},
      "nics": ["mlx5_0", {"name": "mlx5_1", "pci_bus_id": "0000:5e:00.0"}],
      "nic_links": {"default": "SYS", "pairs": [[0, 0, "PIX"], [1, 0, "PIX"], [2, 1, "PIX"], [3, 1, "PIX"]]}
    },
    {
      "hostname": "small",
      "gpus": 2,
      "links": [["X", "PHB"], ["PHB", "X"]],
      "comment": "a workstation"
    }
  ]
})";

}  // namespace

TEST(TopologyJson, DocumentedClusterExample) {
  Topology t = topology_from_json(kCluster, "cluster.json");
  ASSERT_EQ(t.nodes.size(), 4u);
  EXPECT_EQ(t.nodes[0].hostname, "dgx0");
  EXPECT_EQ(t.nodes[2].hostname, "dgx2");
  EXPECT_EQ(t.nodes[3].hostname, "small");
  EXPECT_DOUBLE_EQ(t.costs.net.bandwidth_gbps, 50);
  EXPECT_DOUBLE_EQ(t.costs.nv_per_link.bandwidth_gbps, 50);
  EXPECT_DOUBLE_EQ(t.costs.nv_per_link.latency_us, LinkCosts{}.nv_per_link.latency_us);  // only what is given
  const Node& d = t.nodes[1];
  EXPECT_EQ(d.gpu_link(0, 1), L("NV2"));
  EXPECT_EQ(d.gpu_link(1, 0), L("NV2"));
  EXPECT_EQ(d.gpu_link(0, 2), L("SYS"));
  EXPECT_EQ(d.nic_links[3][1], L("PIX"));
  EXPECT_EQ(d.nic_links[3][0], L("SYS"));
  EXPECT_EQ(d.nics[1].pci_bus_id, "0000:5e:00.0");
  EXPECT_EQ(format_cpu_list(d.gpus[2].cpus), "20-22");
  EXPECT_EQ(d.sockets.size(), 2u);
  EXPECT_EQ(t.nodes[3].gpus.size(), 2u);
  EXPECT_EQ(t.nodes[3].gpu_link(0, 1), L("PHB"));
  EXPECT_EQ(t.gpu_count(), 14);
}

TEST(TopologyJson, ReplicateWithoutPatternNumbersHosts) {
  Topology t = topology_from_json(R"({"nodes": [{"hostname": "n", "replicate": 2, "gpus": 1}]})");
  EXPECT_EQ(t.nodes[0].hostname, "n-0");
  EXPECT_EQ(t.nodes[1].hostname, "n-1");
}

TEST(TopologyJson, EveryFixtureRoundTrips) {
  auto names = topo_matrix_fixtures();
  for (const auto& x : xml_fixtures()) names.push_back(x);
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    Topology t = load_topology_file(fixture_path(name));
    t.nodes[0].hostname = "host-a";
    t.costs.sys.latency_us = 9.25;
    Topology back = topology_from_json(to_json(t), name + ".json");
    EXPECT_EQ(back, t);
  }
  Topology big = topology_from_json(replicated_json("dgx1_v100_1nic_oneflow.txt", 64));
  EXPECT_EQ(topology_from_json(to_json(big, -1)), big);
}

TEST(TopologyJson, LoadFileTellsFormatsApart) {
  const std::string path = ::testing::TempDir() + "/loom_topology_test.json";
  {
    std::ofstream f(path);
    f << "\n  " << kCluster;
  }
  EXPECT_EQ(load_topology_file(path).nodes.size(), 4u);
  std::remove(path.c_str());
  EXPECT_EQ(load_topology_file(fixture_path("gh200_4gpu_nv6_gpu_numa_id.txt")).nodes[0].gpus.size(), 4u);
  EXPECT_EQ(load_topology_file(fixture_path("ncclxml_ibm_gx3d_8xh100_8nic_roce.xml")).nodes[0].gpus.size(), 8u);
  std::string missing = parse_error_of([] { load_topology_file("/nonexistent/topo.json"); });
  EXPECT_EQ(missing.rfind("/nonexistent/topo.json:0:0: cannot open the topology file: No such file or directory", 0),
            0u)
      << missing;
}

TEST(TopologyJson, ErrorsNamePointerLineAndColumn) {
  // A bad class inside a matrix: the position of that very string.
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"gpus\": 2,\n \"links\": [[\"X\", \"NVX\"], [\"NVX\", \"X\"]]}]}"),
            "t.json:2:18: /nodes/0/links/0/1: expected a link class (X, NV#, PIX, PXB, PHB, NODE, SYS), found \"NVX\"");
  // Asymmetric matrix.
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"gpus\": 2,\n \"links\": [[\"X\", \"NV2\"],\n  [\"NV1\", \"X\"]]}]}"),
            "t.json:3:4: /nodes/0/links/1/0: expected NV2 (the matrix is symmetric: entry [0][1] says so), found NV1");
  // Unknown key (a typo) at its value.
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"gpus\": 1, \"hostnme\": \"a\"}]}"),
            "t.json:1:35: /nodes/0/hostnme: unknown key 'hostnme' (expected one of: hostname, replicate, sockets, "
            "numa_nodes, gpus, nics, links, nic_links, source, notes, comment)");
  // Wrong type, with a number as the value.
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"gpus\": 1, \"replicate\": -2}]}"),
            "t.json:1:37: /nodes/0/replicate: expected an integer from 1 to 100000, found -2");
  // Syntax error.
  EXPECT_EQ(json_error_for("{\"nodes\": [\n  {\"gpus\": 1,}\n]}").substr(0, 40), "t.json:2:14: expected valid JSON: syntax");
  // Missing member: reported at the enclosing object.
  EXPECT_EQ(json_error_for("{\"nodes\": [\n  {\"gpus\": 2}]}"),
            "t.json:2:3: /nodes/0: expected \"links\" (a matrix, or {\"default\": \"NV12\"}) for a node with 2 GPUs");
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"hostname\": \"a\", \"gpus\": 1}, {\"hostname\": \"a\", \"gpus\": 1}]}"),
            "t.json:1:55: /nodes/1/hostname: hostname 'a' is used by two nodes");
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"numa_nodes\": [{\"id\": 0}], \"gpus\": [{\"numa\": 1}]}]}"),
            "t.json:1:58: /nodes/0/gpus/0/numa: NUMA node 1 is not in this node's \"numa_nodes\"");
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"gpus\": 1, \"nics\": [\"m\"]}]}"),
            "t.json:1:12: /nodes/0: expected \"nic_links\" (a GPU x NIC matrix, or {\"default\": \"SYS\"}) for a node "
            "with NICs");
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"gpus\": 2, \"links\": {\"default\": \"X\"}}]}"),
            "t.json:1:45: /nodes/0/links/default: expected a link class other than X as the default");
  EXPECT_EQ(json_error_for("{\"nodes\": [{\"gpus\": 2, \"links\": {\"default\": \"NET\"}}]}"),
            "t.json:1:45: /nodes/0/links/default: NET joins different nodes; inside a node expected X, NV#, PIX, PXB, "
            "PHB, NODE or SYS");
  EXPECT_EQ(json_error_for("{\"nodes\": []}"), "t.json:1:11: /nodes: expected a non-empty array of node objects, found []");
  EXPECT_EQ(json_error_for("{\"link_costs\": {\"PIX\": {\"bandwidth_gbps\": 0}}, \"nodes\": [{\"gpus\": 1}]}"),
            "t.json:1:43: /link_costs/PIX/bandwidth_gbps: expected a bandwidth above 0 GB/s, found 0");
  // Size limits: no node count or matrix that would exhaust memory.
  EXPECT_NE(json_error_for("{\"nodes\": [{\"gpus\": 512, \"links\": {\"default\": \"SYS\"}, \"replicate\": 100000}]}")
                .find("link entries in all (too large)"),
            std::string::npos);
}
