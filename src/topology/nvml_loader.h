// Reads GPUs, PCI bus ids, NVLinks, CPU affinity and PCIe common ancestors from NVML, loaded at run
// time with dlopen (never a link dependency: the same binary runs on machines without a driver).
// The few NVML prototypes needed are declared in nvml_loader.cpp. Internal to detection.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

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

// What GPU monitoring reads from one device (Prometheus metrics): utilisation in percent, memory
// in bytes, temperature in degrees Celsius, PCIe throughput in bytes per second over NVML's last
// 20 ms sample.
struct NvmlGauges {
  double utilization_percent = 0;
  double memory_used_bytes = 0, memory_total_bytes = 0;
  double temperature_celsius = 0;
  double pcie_tx_bytes_per_second = 0, pcie_rx_bytes_per_second = 0;
};
// Reads NVML device `index` (NVML's numbering). NVML is opened once and kept open for later reads;
// nullopt, with the reason in `why`, where there is no NVML or no such device.
std::optional<NvmlGauges> read_nvml_gauges(unsigned index, std::string& why);

// NVML topology level -> link class (INTERNAL and SINGLE: PIX, MULTIPLE: PXB, HOSTBRIDGE: PHB,
// NODE: NODE, SYSTEM: SYS); nullopt for anything else.
std::optional<Link> link_from_nvml_level(int level);

}  // namespace loom::topo::detail
