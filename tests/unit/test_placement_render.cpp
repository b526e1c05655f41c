// Pictures of a plan: the SVG is well-formed XML with one box per GPU coloured by TP group, one line
// per GPU pair styled by link class, and a legend; the DOT graph has the same content.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>

#include "loom/topology/placement.h"
#include "topology/xml_scan.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;
using loom::topo::detail::XmlElement;

namespace {

void walk(const XmlElement& e, const std::function<void(const XmlElement&)>& f) {
  f(e);
  for (const auto& c : e.children) walk(c, f);
}

std::string attr(const XmlElement& e, const char* key) {
  const std::string* v = e.attribute(key);
  return v ? *v : "";
}

size_t count(const std::string& s, const std::string& part) {
  size_t n = 0;
  for (size_t at = s.find(part); at != std::string::npos; at = s.find(part, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(PlacementRender, SvgShowsGroupsLinksAndLegend) {
  const Topology dgx = load_topology_file(fixture_path("dgx1_v100_1nic_oneflow.txt"));
  Plan p = plan(dgx, {6, 2, 0, 1 << 20});  // 6 of 8 GPUs: two unused
  const std::string svg = to_svg(p, dgx, 0);
  XmlElement root = detail::parse_xml(svg, "plan.svg");
  EXPECT_EQ(root.name, "svg");
  int gpus = 0, unused = 0, dashed = 0, links = 0;
  std::map<std::string, std::string> colour_of_gpu;
  double nv2_width = 0, sys_width = 0;
  walk(root, [&](const XmlElement& e) {
    if (e.name == "g" && attr(e, "class").rfind("gpu", 0) == 0) {
      ++gpus;
      unused += attr(e, "class") == "gpu unused";
    }
    if (e.name == "line" && attr(e, "class").rfind("link", 0) == 0) {
      ++links;
      if (!attr(e, "stroke-dasharray").empty()) ++dashed;
      if (attr(e, "class") == "link SYS") sys_width = std::stod(attr(e, "stroke-width"));
      if (attr(e, "class") == "link NV" && !e.children.empty()) {
        // <title>GPU0-GPU3: NV2</title> has no text in the element model; width tells NV2 from NV1.
        nv2_width = std::max(nv2_width, std::stod(attr(e, "stroke-width")));
      }
    }
  });
  EXPECT_EQ(gpus, 8);
  EXPECT_EQ(unused, 2);
  EXPECT_EQ(links, 28);  // every pair of 8 GPUs
  int sys_pairs = 0;
  for (int a = 0; a < 8; ++a)
    for (int b = a + 1; b < 8; ++b) sys_pairs += dgx.nodes[0].gpu_link(a, b).cls == LinkClass::SYS;
  EXPECT_EQ(dashed, sys_pairs);     // SYS dashed, nothing else
  EXPECT_GT(nv2_width, sys_width);  // NVLink drawn thicker than PCIe/SYS
  EXPECT_NE(svg.find("TP group 0: ranks 0,1 (NV2)"), std::string::npos);
  EXPECT_NE(svg.find("SYS (across sockets)"), std::string::npos);
  EXPECT_NE(svg.find(">unused</text>"), std::string::npos);
  // Boxes of one TP group share a colour; different groups differ.
  std::map<int, std::string> fill_of_group;
  walk(root, [&](const XmlElement& e) {
    if (e.name != "g" || attr(e, "class") != "gpu") return;
    const std::string fill = attr(e.children.at(0), "fill");
    EXPECT_FALSE(fill.empty());
    fill_of_group[static_cast<int>(fill_of_group.size())] = fill;
  });
  EXPECT_EQ(fill_of_group.size(), 6u);
  std::set<std::string> distinct;
  for (auto& [k, v] : fill_of_group) distinct.insert(v);
  EXPECT_EQ(distinct.size(), 3u);  // three TP groups
  EXPECT_THROW(to_svg(p, dgx, 1), std::invalid_argument);
}

TEST(PlacementRender, OnlySysLinksAreDashed) {
  for (const char* name : {"rtx4090_8gpu_pcie_2socket_bondnic.txt", "hopper_8gpu_6nic_topo_mp_pcie_only.txt",
                           "a100_sxm4_8nic_roce_deepep.txt"}) {
    SCOPED_TRACE(name);
    const Topology t = load_topology_file(fixture_path(name));
    Plan p = plan(t, {8, 2, 0, 1 << 20});
    XmlElement root = detail::parse_xml(to_svg(p, t, 0), "plan.svg");
    int dashed = 0, solid = 0;
    walk(root, [&](const XmlElement& e) {
      if (e.name == "line" && attr(e, "class").rfind("link", 0) == 0)
        (attr(e, "stroke-dasharray").empty() ? solid : dashed)++;
    });
    int sys = 0;
    for (int a = 0; a < 8; ++a)
      for (int b = a + 1; b < 8; ++b) sys += t.nodes[0].gpu_link(a, b).cls == LinkClass::SYS;
    EXPECT_EQ(dashed, sys);
    EXPECT_EQ(solid, 28 - sys);
  }
}

TEST(PlacementRender, DotGraph) {
  const Topology dgx = load_topology_file(fixture_path("dgx1_v100_1nic_oneflow.txt"));
  Plan p = plan(dgx, {8, 4, 0, 1 << 20});
  const std::string dot = to_dot(p, dgx, 0);
  EXPECT_EQ(dot.rfind("graph \"node0\" {", 0), 0u);
  EXPECT_EQ(count(dot, " -- "), 28u);
  EXPECT_EQ(count(dot, "style=dashed"), 12u);  // 12 SYS pairs in the cube-mesh
  EXPECT_EQ(count(dot, "label=\"NV2\""), 8u);
  EXPECT_NE(dot.find("rank 0 / TP 0"), std::string::npos);
  EXPECT_EQ(dot.back(), '\n');
}
