// NCCL topology XML: dumps give GPUs, NVLink counts, NUMA CPUs and NICs; an override file without
// <gpu> elements gives its PCI devices with a note; malformed XML is a ParseError with a position.
#include <gtest/gtest.h>

#include "loom/topology/topology.h"
#include "topology/xml_scan.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;

namespace {

Topology parse_xml_fixture(const std::string& name) {
  return parse_nccl_topology_xml(read_fixture(name), name);
}
std::string xml_error_for(const std::string& xml) {
  return parse_error_of([&] { parse_nccl_topology_xml(xml, "t.xml"); });
}

}  // namespace

TEST(NcclXml, HgxA100Dump) {
  const Node n = parse_xml_fixture("ncclxml_hgx_a100_80gb_8gpu_5bondnic_simai.xml").nodes[0];
  ASSERT_EQ(n.gpus.size(), 8u);
  for (int a = 0; a < 8; ++a) {
    for (int b = 0; b < 8; ++b) {
      if (a != b) {
        EXPECT_EQ(n.gpu_link(a, b), L("NV12")) << a << "-" << b;  // 6 NVSwitches x 2 links
      }
    }
  }
  EXPECT_EQ(n.gpus[1].pci_bus_id, "0000:19:00.0");
  EXPECT_EQ(n.gpus[4].numa, 1);
  EXPECT_EQ(format_cpu_list(n.gpus[0].cpus), "0-31,64-95");
  EXPECT_EQ(format_cpu_list(n.gpus[7].cpus), "32-63,96-127");
  ASSERT_EQ(n.nics.size(), 5u);
  EXPECT_EQ(n.nics[1].name, "mlx5_bond_1");
  EXPECT_EQ(n.nic_links[1][1], L("PXB"));   // GPU1 and mlx5_bond_1 share a PCIe switch
  EXPECT_EQ(n.nic_links[0][0], L("NODE"));  // mlx5_bond_0 hangs off the CPU directly
  EXPECT_EQ(n.nic_links[0][3], L("SYS"));   // the other socket
  EXPECT_NO_THROW(validate(Topology{{n}, {}}));
}

TEST(NcclXml, IbmH100VirtualMachine) {
  const Node n = parse_xml_fixture("ncclxml_ibm_gx3d_8xh100_8nic_roce.xml").nodes[0];
  ASSERT_EQ(n.gpus.size(), 8u);
  EXPECT_EQ(n.gpu_link(0, 7), L("NV18"));  // 5 + 5 + 4 + 4 links to four NVSwitches
  EXPECT_EQ(format_cpu_list(n.gpus[0].cpus), "0-79");
  EXPECT_EQ(format_cpu_list(n.gpus[5].cpus), "80-159");
  EXPECT_EQ(n.nics[0].name, "mlx5_7");
  EXPECT_EQ(n.nic_links[0][0], L("PIX"));  // GPU and NIC under one (virtual) bridge
  EXPECT_EQ(n.nic_links[0][1], L("NODE"));
  EXPECT_EQ(n.nic_links[0][4], L("SYS"));
}

TEST(NcclXml, AzureOverrideWithoutGpuElements) {
  const Node n = parse_xml_fixture("ncclxml_azure_ndv4_a100_topo_file_override.xml").nodes[0];
  ASSERT_EQ(n.gpus.size(), 8u);
  ASSERT_EQ(n.nics.size(), 8u);
  EXPECT_EQ(n.gpus[0].pci_bus_id, "0003:00:00.0");
  EXPECT_EQ(n.nics[0].name, "pci:0103:00:00.0");
  EXPECT_EQ(n.gpu_link(0, 1), L("PIX"));
  EXPECT_EQ(n.gpu_link(0, 2), L("SYS"));
  EXPECT_EQ(n.numa_nodes.size(), 4u);
  EXPECT_EQ(format_cpu_list(n.gpus[0].cpus), "0-23");
  bool noted = false;
  for (const auto& note : n.notes) noted = noted || note.find("NVLink unknown") != std::string::npos;
  EXPECT_TRUE(noted) << "the result must say that NVLink is unknown";
}

TEST(NcclXml, ErrorsHaveLineAndColumn) {
  EXPECT_EQ(xml_error_for("<system>\n  <cpu numaid=\"0\">\n  </cpux>\n</system>"),
            "t.xml:3:3: expected </cpu>, found </cpux>");
  EXPECT_EQ(xml_error_for("<system>\n <cpu numaid=0/>\n</system>"),
            "t.xml:2:14: expected a quoted attribute value, found '0/>'");
  EXPECT_EQ(xml_error_for("<topology/>"),
            "t.xml:1:1: expected the root element <system> of an NCCL topology file, found <topology>");
  EXPECT_EQ(xml_error_for("<system version=\"1\">\n</system>"),
            "t.xml:1:1: expected at least one <cpu> element under <system>, found none");
  EXPECT_EQ(xml_error_for("<system>\n <cpu numaid=\"0\" affinity=\"ff\"/>\n</system>"),
            "t.xml:1:1: expected <gpu> elements (an NCCL topology dump) or <pci class=\"0x0302..\"> GPUs (a topology "
            "override), found neither: this file describes no GPU");
  EXPECT_EQ(xml_error_for("<system>\n <cpu numaid=\"0\" affinity=\"xyz\"/>\n</system>"),
            "t.xml:2:2: <cpu> affinity=\"xyz\": expected comma-separated 32-bit hex words such as 0000ffff,ffffffff");
  EXPECT_EQ(xml_error_for("<system><cpu numaid=\"0\"><pci busid=\"0000:01:00.0\"><gpu dev=\"1\"/></pci></cpu></system>"),
            "t.xml:1:51: <gpu dev=\"1\">: expected the GPUs to be numbered 0..0 without gaps or repeats");
  EXPECT_EQ(
      xml_error_for(
          "<system><cpu><pci busid=\"a\"><gpu dev=\"0\"><nvlink target=\"b\" count=\"0\"/></gpu></pci></cpu></system>"),
      "t.xml:1:42: <nvlink> count=\"0\": expected 1 to 64");
  EXPECT_EQ(xml_error_for("<system><!-- unterminated </system>"),
            "t.xml:1:9: expected '-->' to close this comment, found the end of the text");
  EXPECT_EQ(xml_error_for("<system a=\"1\" a=\"2\"/>"), "t.xml:1:15: attribute 'a' given twice in <system>");
  EXPECT_EQ(xml_error_for("<system a=\"&bogus;\"/>"), "t.xml:1:12: expected an entity such as &amp;, found '&bogus;\"/>'");
  EXPECT_EQ(xml_error_for(""), "t.xml:1:1: expected the root element (<system ...>), found the end of the text");
  // Depth is bounded (no unbounded recursion on hostile input).
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "<pci busid=\"x\">";
  EXPECT_NE(xml_error_for("<system><cpu>" + deep).find("nested deeper than 64"), std::string::npos);
}

TEST(NcclXml, ScannerDecodesEntitiesAndSkipsComments) {
  auto root = detail::parse_xml(
      "<?xml version=\"1.0\"?>\n<!-- c -->\n<a x='1 &amp; 2' y=\"&#65;&#x42;\">text<b/><!--x--></a>", "s");
  EXPECT_EQ(root.name, "a");
  EXPECT_EQ(*root.attribute("x"), "1 & 2");
  EXPECT_EQ(*root.attribute("y"), "AB");
  ASSERT_EQ(root.children.size(), 1u);
  EXPECT_EQ(root.children[0].name, "b");
  EXPECT_EQ(root.children[0].line, 3);
  EXPECT_EQ(root.attribute("z"), nullptr);
}
