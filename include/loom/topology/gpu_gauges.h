// What GPU monitoring reads from one device, through NVML loaded at run time (no link dependency:
// the same binary runs on machines without a driver). The metrics exporter samples it on a thread
// of its own.
//
//   std::string why;
//   if (auto g = loom::topo::read_gpu_gauges(0, why)) std::cout << g->utilization_percent << "%\n";
//   else std::cout << "no reading: " << why << "\n";
#pragma once

#include <optional>
#include <string>

namespace loom::topo {

// Utilisation in percent, memory in bytes, temperature in degrees Celsius, PCIe throughput in bytes
// per second over NVML's last 20 ms sample.
struct GpuGauges {
  double utilization_percent = 0;
  double memory_used_bytes = 0, memory_total_bytes = 0;
  double temperature_celsius = 0;
  double pcie_tx_bytes_per_second = 0, pcie_rx_bytes_per_second = 0;
};

// Reads NVML device `index` (NVML's numbering). NVML is opened once and kept open for later reads;
// nullopt, with the reason in `why`, where there is no NVML or no such device.
std::optional<GpuGauges> read_gpu_gauges(unsigned index, std::string& why);

}  // namespace loom::topo
