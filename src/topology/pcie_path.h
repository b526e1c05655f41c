// The nvidia-smi link class between two PCI devices from their places in the PCI tree. Shared by
// the NCCL XML parser (nesting of <pci> elements) and hwloc detection (PCI objects), so both
// classify paths the same way.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "loom/topology/topology.h"

namespace loom::topo::detail {

struct PciPlace {
  int numa = -1;         // the CPU-side domain the device hangs off (-1: unknown)
  int host_bridge = -1;  // which host bridge (root complex) of that domain (-1: unknown)
  // Ids of the PCI elements from just below the host bridge down to the device itself (last).
  std::vector<int> chain;
};

// SYS across domains; NODE between host bridges of one domain (or when the host bridge is unknown
// and the chains share nothing); PHB through one host bridge; PIX when the path crosses one PCIe
// bridge, PXB when it crosses more.
Link pcie_link(const PciPlace& a, const PciPlace& b);

using topo::normalize_bus_id;  // declared with the public topology model

}  // namespace loom::topo::detail
