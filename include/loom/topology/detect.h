// Describes the machine this process runs on: sockets, NUMA nodes and their CPUs from hwloc; GPUs,
// their PCI bus ids, NVLinks, CPU affinity and PCIe distances from NVML (loaded at run time with
// dlopen, so a machine without the NVIDIA driver simply has no GPUs); NICs (InfiniBand/RoCE
// devices) and GPU-NIC distances from hwloc's PCI tree.
//
//   loom::topo::DetectOptions options;
//   if (const char* file = std::getenv("LOOM_TOPOLOGY")) options.topology_file = file;
//   loom::topo::Detection d = loom::topo::detect_host(options);
//   if (d.topology.gpu_count() == 0) std::cerr << d.diagnostics << "\n";   // says why
//   std::string mine = loom::topo::to_json(d.topology);   // each node leader sends this; merge_nodes joins them
//
// Sources, in order: NVML + hwloc at run time; when NVML is missing or sees no GPU, the topology
// file (any format load_topology_file reads), if one is given; otherwise hwloc alone (CPUs and NUMA,
// zero GPUs). `file_overrides_detection` makes a given file win over NVML (planning a different
// machine, or correcting what the driver reports).
#pragma once

#include <string>

#include "loom/topology/topology.h"

namespace loom::topo {

struct DetectOptions {
  std::string topology_file;  // "" = none (loom::init passes LOOM_TOPOLOGY)
  bool file_overrides_detection = false;
  std::string nvml_library = "libnvidia-ml.so.1";  // "" disables NVML
  // Read the machine from an hwloc XML export (lstopo --of xml) instead of the live system: for
  // tests, and for describing another machine. "" = this machine.
  std::string hwloc_xml;
  std::string hostname;  // "" = gethostname()
};

struct Detection {
  Topology topology;        // this host (one node), or the file's nodes when a file was used
  std::string source;       // "hwloc+nvml", "hwloc", or "file <path>"
  std::string diagnostics;  // what was not available and why (one sentence per source), "" when all was
};

// Never throws for a missing driver or hwloc failure (that goes to diagnostics); throws ParseError
// when a topology file is needed and cannot be read.
Detection detect_host(const DetectOptions& options = {});

}  // namespace loom::topo
