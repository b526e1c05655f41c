// Reads GPUs, PCI bus ids, NVLinks, CPU affinity and PCIe common ancestors from NVML, loaded at run
// time with dlopen (never a link dependency: the same binary runs on machines without a driver).
// The few NVML prototypes needed are declared in nvml_loader.cpp. Internal to detection.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/topology/gpu_gauges.h"
#include "loom/topology/topology.h"

namespace loom::topo::detail {

struct NvmlDevice {
  std::string name;
  std::string bus_id;                  // normalised: "0000:07:00.0"
  CpuList cpus;                        // nvmlDeviceGetCpuAffinity
  std::map<std::string, int> nvlinks;  // remote PCI bus id (GPU or NVSwitch) -> active links to it
};

struct NvmlSnapshot {
  std::vector<NvmlDevice> devices;
  // NVML topology level between devices a and b (nvmlGpuTopologyLevel_t: 0 internal, 10 single
  // switch, 20 multiple switches, 30 host bridge, 40 NUMA node, 50 system), -1 when NVML did not say.
  std::vector<std::vector<int>> common_ancestor;
  std::string driver_notes;  // calls that failed without making the snapshot useless
};

// nullopt, with the reason in `why`, when the library is missing, lacks a symbol or fails to start.
std::optional<NvmlSnapshot> read_nvml(const std::string& library, std::string& why);

// NVML topology level -> link class (INTERNAL and SINGLE: PIX, MULTIPLE: PXB, HOSTBRIDGE: PHB,
// NODE: NODE, SYSTEM: SYS); nullopt for anything else.
std::optional<Link> link_from_nvml_level(int level);

}  // namespace loom::topo::detail
