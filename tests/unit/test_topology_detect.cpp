// Detection: hwloc on this machine (no GPU here), NVML through dlopen with a stand-in library and
// an hwloc XML machine, and the fall-back order NVML -> file -> CPUs only.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "loom/topology/detect.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;

namespace {

const std::string kSimulatedMachine = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/hwloc/two_socket_4gpu.xml";

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST(Detect, ThisMachineCpusWithoutNvml) {
  DetectOptions o;
  o.nvml_library = "";
  Detection d = detect_host(o);
  ASSERT_EQ(d.topology.nodes.size(), 1u);
  const Node& n = d.topology.nodes[0];
  EXPECT_EQ(d.source, "hwloc");
  EXPECT_TRUE(contains(d.diagnostics, "NVML disabled")) << d.diagnostics;
  EXPECT_TRUE(n.gpus.empty());
  EXPECT_FALSE(n.sockets.empty());
  ASSERT_FALSE(n.numa_nodes.empty());
  EXPECT_EQ(static_cast<long>(n.all_cpus().size()), sysconf(_SC_NPROCESSORS_ONLN));
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  EXPECT_EQ(n.hostname, host);
}

TEST(Detect, DefaultNvmlLibrary) {
  Detection d = detect_host();
  void* real = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (real) {
    dlclose(real);
    EXPECT_FALSE(contains(d.diagnostics, "cannot load")) << d.diagnostics;
  } else {
    // This machine: no driver, so zero GPUs and a sentence saying why.
    EXPECT_TRUE(d.topology.nodes[0].gpus.empty());
    EXPECT_TRUE(contains(d.diagnostics, "No GPUs: cannot load libnvidia-ml.so.1: ")) << d.diagnostics;
    EXPECT_EQ(d.source, "hwloc");
  }
}

TEST(Detect, NvmlThroughDlopenOnASimulatedMachine) {
  DetectOptions o;
  o.nvml_library = LOOM_FAKE_NVML;
  o.hwloc_xml = kSimulatedMachine;
  o.hostname = "sim";
  Detection d = detect_host(o);
  EXPECT_EQ(d.source, "hwloc+nvml");
  EXPECT_EQ(d.diagnostics, "");
  const Node& n = d.topology.nodes[0];
  EXPECT_EQ(n.hostname, "sim");
  ASSERT_EQ(n.gpus.size(), 4u);
  EXPECT_EQ(n.gpus[2].name, "Fake GPU 2");
  EXPECT_EQ(n.gpus[2].pci_bus_id, "0000:87:00.0");
  EXPECT_EQ(format_cpu_list(n.gpus[0].cpus), "0-3");
  EXPECT_EQ(format_cpu_list(n.gpus[3].cpus), "4-7");
  EXPECT_EQ(n.gpus[1].numa, 0);  // from the GPU's place in hwloc's PCI tree
  EXPECT_EQ(n.gpus[2].numa, 1);
  EXPECT_EQ(n.gpu_link(0, 1), L("NV6"));  // 4 direct links + min(2, 2) through the switch
  EXPECT_EQ(n.gpu_link(2, 3), L("NV2"));  // direct links only (GPU3 has no switch link)
  EXPECT_EQ(n.gpu_link(0, 2), L("NV2"));  // through the switch
  EXPECT_EQ(n.gpu_link(1, 3), L("SYS"));  // no NVLink: NVML's common ancestor
  ASSERT_EQ(n.nics.size(), 2u);
  EXPECT_EQ(n.nics[0].name, "mlx5_0");
  EXPECT_EQ(n.nics[1].pci_bus_id, "0000:89:00.0");
  EXPECT_EQ(n.nic_links[0][0], L("PIX"));  // same PCIe switch (hwloc PCI tree)
  EXPECT_EQ(n.nic_links[3][1], L("PIX"));
  EXPECT_EQ(n.nic_links[0][1], L("SYS"));  // other socket
  ASSERT_EQ(n.sockets.size(), 2u);
  EXPECT_EQ(format_cpu_list(n.numa_nodes[1].cpus), "4-7");
  EXPECT_NO_THROW(validate(d.topology));
}

TEST(Detect, FallsBackToTheFileWhenNvmlSeesNoGpu) {
  ScopedEnv fail("FAKE_NVML_FAIL_INIT", "1");
  DetectOptions o;
  o.nvml_library = LOOM_FAKE_NVML;
  o.hwloc_xml = kSimulatedMachine;
  o.hostname = "sim";
  Detection without_file = detect_host(o);
  EXPECT_TRUE(without_file.topology.nodes[0].gpus.empty());
  EXPECT_TRUE(contains(without_file.diagnostics, "No GPUs: nvmlInit failed: NVML error 9 (Driver Not Loaded)."))
      << without_file.diagnostics;
  EXPECT_EQ(without_file.topology.nodes[0].numa_nodes.size(), 2u);  // CPUs still described

  o.topology_file = fixture_path("dgx1_v100_1nic_oneflow.txt");
  Detection with_file = detect_host(o);
  EXPECT_EQ(with_file.source, "file " + o.topology_file);
  EXPECT_EQ(with_file.topology.nodes[0].gpus.size(), 8u);
  EXPECT_EQ(with_file.topology.nodes[0].hostname, "sim");  // the file had none
  EXPECT_TRUE(contains(with_file.diagnostics, "Using the topology file")) << with_file.diagnostics;
}

TEST(Detect, ZeroDevicesAndFileOverride) {
  {
    ScopedEnv none("FAKE_NVML_COUNT", "0");
    DetectOptions o;
    o.nvml_library = LOOM_FAKE_NVML;
    o.hwloc_xml = kSimulatedMachine;
    Detection d = detect_host(o);
    EXPECT_TRUE(contains(d.diagnostics, "No GPUs: NVML reports 0 devices.")) << d.diagnostics;
  }
  DetectOptions o;
  o.nvml_library = LOOM_FAKE_NVML;
  o.hwloc_xml = kSimulatedMachine;
  o.topology_file = fixture_path("gh200_4gpu_nv6_gpu_numa_id.txt");
  EXPECT_EQ(detect_host(o).source, "hwloc+nvml");  // NVML first
  o.file_overrides_detection = true;
  Detection d = detect_host(o);
  EXPECT_EQ(d.source, "file " + o.topology_file);
  EXPECT_EQ(d.topology.nodes[0].gpu_link(0, 1), L("NV6"));
  o.topology_file = "/nonexistent.json";
  EXPECT_NE(parse_error_of([&] { detect_host(o); }).find("cannot open the topology file"), std::string::npos);
}

TEST(Detect, BrokenHwlocXmlIsADiagnosticNotACrash) {
  DetectOptions o;
  o.nvml_library = "";
  o.hwloc_xml = "/nonexistent/machine.xml";
  Detection d = detect_host(o);
  EXPECT_TRUE(contains(d.diagnostics, "hwloc: cannot")) << d.diagnostics;
  EXPECT_TRUE(d.topology.nodes[0].numa_nodes.empty());
}
