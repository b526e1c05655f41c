// The topology model: link classes, CPU lists, the cost table, validation and merging nodes.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/topology/topology.h"
#include "topology_test_util.h"

using namespace loom::topo;

TEST(TopologyModel, LinkClassesReadAndPrint) {
  for (const char* text : {"X", "NV1", "NV2", "NV12", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS", "NET"}) {
    auto link = parse_link(text);
    ASSERT_TRUE(link) << text;
    EXPECT_EQ(to_string(*link), text);
  }
  EXPECT_EQ(parse_link("NV12")->nvlinks, 12);
  EXPECT_EQ(parse_link("SOC")->cls, LinkClass::SYS);  // older drivers' name for SYS
  for (const char* bad : {"", "NV", "NV0", "NV01", "NVX", "NV65", "NV-1", "nv2", "PIXX", "N/A", "OK"})
    EXPECT_FALSE(parse_link(bad)) << bad;
}

TEST(TopologyModel, CpuLists) {
  EXPECT_EQ(*parse_cpu_list("0-3,8"), (CpuList{0, 1, 2, 3, 8}));
  EXPECT_EQ(*parse_cpu_list("8,0-1,1"), (CpuList{0, 1, 8}));
  EXPECT_EQ(format_cpu_list(*parse_cpu_list("0-11,24-35")), "0-11,24-35");
  EXPECT_EQ(format_cpu_list({0, 2, 3, 4, 7}), "0,2-4,7");
  EXPECT_EQ(format_cpu_list({}), "");
  for (const char* bad : {"", ",", "0,", "3-1", "a", "0-", "-1", "0--2", "0-65536", "99999999", "1 2"})
    EXPECT_FALSE(parse_cpu_list(bad)) << bad;
  // Bounded: a damaged list cannot make the parser allocate without limit.
  std::string huge;
  for (int i = 0; i < 100; ++i) huge += "0-65535,";
  huge += "0";
  EXPECT_FALSE(parse_cpu_list(huge));
}

TEST(TopologyModel, DefaultCostTable) {
  LinkCosts c;
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::NV, 1}).bandwidth_gbps, 25);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::NV, 2}).bandwidth_gbps, 50);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::NV, 12}).bandwidth_gbps, 300);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::NV, 18}).bandwidth_gbps, 450);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::PIX, 0}).bandwidth_gbps, 24);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::PHB, 0}).bandwidth_gbps, 20);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::NODE, 0}).bandwidth_gbps, 16);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::SYS, 0}).bandwidth_gbps, 10);
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::NET, 0}).bandwidth_gbps, 12.5);
  EXPECT_TRUE(std::isinf(c.cost({LinkClass::Self, 0}).bandwidth_gbps));
  // Better classes are never slower or higher-latency than worse ones.
  const Link order[] = {{LinkClass::NV, 1},  {LinkClass::PIX, 0},  {LinkClass::PXB, 0},
                        {LinkClass::PHB, 0}, {LinkClass::NODE, 0}, {LinkClass::SYS, 0}};
  for (size_t i = 1; i < std::size(order); ++i) {
    EXPECT_GE(c.cost(order[i - 1]).bandwidth_gbps, c.cost(order[i]).bandwidth_gbps);
    EXPECT_LE(c.cost(order[i - 1]).latency_us, c.cost(order[i]).latency_us);
  }
  c.nv_per_link.bandwidth_gbps = 50;  // overridable: NVLink 5 figures
  EXPECT_DOUBLE_EQ(c.cost({LinkClass::NV, 18}).bandwidth_gbps, 900);
}

TEST(TopologyModel, ParseErrorNamesSourceLineColumn) {
  ParseError e("file.txt", 4, 23, "expected X, found Y");
  EXPECT_STREQ(e.what(), "file.txt:4:23: expected X, found Y");
  EXPECT_EQ(e.line(), 4);
  EXPECT_EQ(e.column(), 23);
  EXPECT_EQ(e.source(), "file.txt");
}

namespace {

Topology two_gpus() {
  Topology t;
  Node n;
  n.hostname = "a";
  n.gpus = {{0, "", "", -1, {}}, {1, "", "", -1, {}}};
  n.gpu_links = {{{LinkClass::Self, 0}, {LinkClass::NV, 4}}, {{LinkClass::NV, 4}, {LinkClass::Self, 0}}};
  n.nic_links = {{}, {}};
  t.nodes.push_back(n);
  return t;
}

std::string invalid_because(const Topology& t) {
  try {
    validate(t);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TopologyModel, ValidateCatchesInconsistentModels) {
  EXPECT_EQ(invalid_because(two_gpus()), "");
  auto t = two_gpus();
  t.nodes[0].gpu_links[0][1] = {LinkClass::PIX, 0};
  EXPECT_NE(invalid_because(t).find("GPU0-GPU1 is PIX but GPU1-GPU0 is NV4, expected a symmetric matrix"),
            std::string::npos)
      << invalid_because(t);
  t = two_gpus();
  t.nodes[0].gpu_links[1][1] = {LinkClass::SYS, 0};
  EXPECT_NE(invalid_because(t).find("X (Self) on the diagonal"), std::string::npos);
  t = two_gpus();
  t.nodes[0].gpu_links[0][1] = t.nodes[0].gpu_links[1][0] = {LinkClass::NV, 0};
  EXPECT_NE(invalid_because(t).find("NVLink count 0"), std::string::npos);
  t = two_gpus();
  t.nodes[0].gpu_links[0][1] = t.nodes[0].gpu_links[1][0] = {LinkClass::NET, 0};
  EXPECT_NE(invalid_because(t).find("NET"), std::string::npos);
  t = two_gpus();
  t.nodes[0].gpus[1].index = 3;
  EXPECT_NE(invalid_because(t).find("gpus[1] has index 3, expected 1"), std::string::npos);
  t = two_gpus();
  t.nodes[0].gpu_links.pop_back();
  EXPECT_NE(invalid_because(t).find("gpu_links has 1 rows, expected 2"), std::string::npos);
}

TEST(TopologyModel, MergeNodesKeepsOrderAndChecksCosts) {
  auto a = two_gpus();
  auto b = two_gpus();
  b.nodes[0].hostname = "b";
  b.nodes[0].gpus.push_back({2, "", "", -1, {}});
  b.nodes[0].gpu_links = {{{LinkClass::Self, 0}, {LinkClass::PIX, 0}, {LinkClass::SYS, 0}},
                          {{LinkClass::PIX, 0}, {LinkClass::Self, 0}, {LinkClass::SYS, 0}},
                          {{LinkClass::SYS, 0}, {LinkClass::SYS, 0}, {LinkClass::Self, 0}}};
  b.nodes[0].nic_links = {{}, {}, {}};
  Topology m = merge_nodes({a, b});
  ASSERT_EQ(m.nodes.size(), 2u);
  EXPECT_EQ(m.nodes[0].hostname, "a");
  EXPECT_EQ(m.nodes[1].gpus.size(), 3u);  // nodes may differ
  EXPECT_EQ(m.gpu_count(), 5);
  // Round trip through JSON, as loom::init gathers each node leader's description.
  Topology back = merge_nodes({topology_from_json(to_json(a)), topology_from_json(to_json(b))});
  EXPECT_EQ(back, m);

  auto c = two_gpus();
  c.nodes[0].hostname = "c";
  c.costs.net.bandwidth_gbps = 25;
  try {
    merge_nodes({a, c});
    FAIL() << "expected differing link costs to be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("part 1 has link costs"), std::string::npos) << e.what();
  }
  try {
    merge_nodes({a, a});
    FAIL() << "expected a repeated hostname to be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hostname 'a', like node 0"), std::string::npos) << e.what();
  }
}
