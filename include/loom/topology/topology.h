// What the machines of a job look like: per node its CPUs (sockets, NUMA nodes), GPUs, NICs, and
// the class of the link between every GPU pair and every GPU-NIC pair, with a bandwidth and a
// latency for each class. The placement planner (placement.h) works on this model only, so a
// machine described by `nvidia-smi topo -m` text, an NCCL topology dump, a JSON file or live
// detection (detect.h) is planned the same way.
//
//   auto topo = loom::topo::parse_nvidia_smi_topo(text, "dgx1.txt");
//   topo.nodes[0].gpu_link(0, 3);                      // Link{NV, 2}: "NV2"
//   topo.costs.cost(topo.nodes[0].gpu_link(0, 3));     // {50 GB/s, 1.5 us} from the default table
//   std::string saved = loom::topo::to_json(topo);      // reload with topology_from_json
//
// Every parser either returns a complete, consistent Topology or throws loom::topo::ParseError,
// whose message names the source, the line and column (1-based) and what was expected against
// what was found:
//
//   dgx1.txt:4:23: GPU2 row: expected a link class (X, NV#, PIX, PXB, PHB, NODE, SYS), found 'NVX'
//
// Link classes, best to worst (nvidia-smi's legend): NV# a bonded set of # NVLinks; PIX at most
// one PCIe bridge; PXB several PCIe bridges, no host bridge; PHB a PCIe host bridge (the CPU);
// NODE between host bridges of one NUMA node; SYS across NUMA nodes (QPI/UPI/Infinity Fabric);
// NET between nodes. Default figures are in LinkCosts and docs/topology.md; all are overridable.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace loom::topo {

enum class LinkClass : std::uint8_t { Self, NV, PIX, PXB, PHB, NODE, SYS, NET };

struct Link {
  LinkClass cls = LinkClass::SYS;
  int nvlinks = 0;  // bonded NVLinks when cls == NV (NV12: 12), else 0
  friend bool operator==(const Link&, const Link&) = default;
};

// "X" for Self, "NV12", "PIX", ..., "NET".
std::string to_string(Link link);
std::string to_string(LinkClass cls);  // "NV" for NV
// Reads "X", "NV<n>" (1 <= n <= 64), "PIX", "PXB", "PHB", "NODE", "SYS", "NET", and "SOC" (the
// name older drivers print for SYS). nullopt for anything else.
std::optional<Link> parse_link(std::string_view text);

struct LinkCost {
  double bandwidth_gbps = 0;  // GB/s (1e9 bytes/s) per direction
  double latency_us = 0;
  friend bool operator==(const LinkCost&, const LinkCost&) = default;
};

// Bandwidth and latency of each link class. Defaults (docs/topology.md explains each):
//   NV#  # x 25 GB/s, 1.5 us   (NVLink 2-4: 25 GB/s per link per direction; NV12 300, NV18 450)
//   PIX  24 GB/s, 2.5 us       (PCIe Gen4 x16 through one switch)
//   PXB  24 GB/s, 3 us         (still within a switch tree, more hops)
//   PHB  20 GB/s, 4 us         (through the root complex)
//   NODE 16 GB/s, 5 us         (between root complexes of one socket)
//   SYS  10 GB/s, 7 us         (across the socket interconnect: P2P disabled, staged through host memory)
//   NET  12.5 GB/s, 10 us      (100 Gb/s InfiniBand/RoCE with GPUDirect RDMA)
// Override by assigning fields, or with a "link_costs" section in a JSON topology.
struct LinkCosts {
  LinkCost nv_per_link{25.0, 1.5};  // bandwidth per link; latency per path
  LinkCost pix{24.0, 2.5};
  LinkCost pxb{24.0, 3.0};
  LinkCost phb{20.0, 4.0};
  LinkCost node{16.0, 5.0};
  LinkCost sys{10.0, 7.0};
  LinkCost net{12.5, 10.0};

  // The cost of one link. Self is infinitely fast (bandwidth +inf, latency 0).
  LinkCost cost(Link link) const;
  friend bool operator==(const LinkCosts&, const LinkCosts&) = default;
};

// A sorted list of logical CPU ids (what taskset, sched_setaffinity and nvidia-smi's CPU
// Affinity column use), e.g. {0,1,2,3,64,65,66,67} for "0-3,64-67".
using CpuList = std::vector<int>;
// Reads "0-11,24-35" (ranges and single ids, any order, duplicates merged). nullopt when the text
// is malformed or names a CPU above kMaxCpu.
std::optional<CpuList> parse_cpu_list(std::string_view text);
std::string format_cpu_list(const CpuList& cpus);  // "0-11,24-35"; "" for an empty list
inline constexpr int kMaxCpu = 65535;

struct Gpu {
  int index = 0;           // device index on its node (CUDA / NVML order)
  std::string name;        // "NVIDIA A100-SXM4-80GB" when the source says
  std::string pci_bus_id;  // "0000:07:00.0" when the source says
  int numa = -1;           // nearest NUMA node (-1: unknown)
  CpuList cpus;            // CPU affinity (empty: unknown)
  friend bool operator==(const Gpu&, const Gpu&) = default;
};

struct Nic {
  std::string name;  // "mlx5_0"
  std::string pci_bus_id;
  friend bool operator==(const Nic&, const Nic&) = default;
};

struct NumaNode {
  int id = 0;
  CpuList cpus;
  friend bool operator==(const NumaNode&, const NumaNode&) = default;
};

struct Socket {
  int id = 0;
  CpuList cpus;
  friend bool operator==(const Socket&, const Socket&) = default;
};

struct Node {
  std::string hostname;         // may be empty when the source does not say (text, XML)
  std::vector<Socket> sockets;  // empty when the source does not say (nvidia-smi text, NCCL XML)
  std::vector<NumaNode> numa_nodes;
  std::vector<Gpu> gpus;  // gpus[i].index == i
  std::vector<Nic> nics;
  // gpu_links[a][b]: the link between GPU a and GPU b (Self on the diagonal, symmetric).
  std::vector<std::vector<Link>> gpu_links;
  // nic_links[g][n]: the link between GPU g and NIC n.
  std::vector<std::vector<Link>> nic_links;
  std::string source;              // "dgx1.txt (nvidia-smi topo -m)", "hwloc+nvml", ...
  std::vector<std::string> notes;  // what the source left out or what was inferred

  Link gpu_link(int a, int b) const { return gpu_links.at(a).at(b); }
  const NumaNode* numa_node(int id) const;
  CpuList all_cpus() const;  // union of the NUMA nodes' (or sockets', or GPUs') CPUs
  friend bool operator==(const Node&, const Node&) = default;
};

struct Topology {
  std::vector<Node> nodes;
  LinkCosts costs;
  int gpu_count() const;
  friend bool operator==(const Topology&, const Topology&) = default;
};

// A description that cannot be read. what() is "<source>:<line>:<column>: <message>"; line and
// column are 1-based (a tab counts as one column; 0 when the error is about the whole input).
class ParseError : public std::runtime_error {
 public:
  ParseError(std::string source, int line, int column, const std::string& message);
  const std::string& source() const { return source_; }
  int line() const { return line_; }
  int column() const { return column_; }

 private:
  std::string source_;
  int line_;
  int column_;
};

// Checks a model built by hand or by a parser: matrix shapes, Self exactly on the diagonal,
// symmetry, NV only with a link count, GPU indices 0..n-1, NET never inside a node. Throws
// std::invalid_argument naming the node and the entry.
void validate(const Topology& topology);

// The text of `nvidia-smi topo -m` or `topo -mp`: tab- or space-separated, CRLF or LF, NIC rows
// named NICn (with a "NIC Legend") or mlx5_*, CPU Affinity / NUMA Affinity / GPU NUMA ID columns
// present or absent, N/A values. Rejects `nvidia-smi topo -p2p` output with an error that says so.
// NUMA nodes come from the NUMA Affinity column; without it (or N/A) each distinct CPU affinity
// becomes one NUMA node (noted in Node::notes). Sockets are not in this text.
Topology parse_nvidia_smi_topo(std::string_view text, std::string source_name = "nvidia-smi topo -m text");

// An NCCL topology XML (NCCL_TOPO_DUMP_FILE output or an NCCL_TOPO_FILE): <cpu> elements give NUMA
// nodes and their CPUs, <gpu> the GPUs with <nvlink> counts (to NVSwitches or to GPUs), <nic><net>
// the NICs; PCIe classes come from the nesting of <pci> elements. A file without <gpu> elements
// (an override listing bare PCI devices) yields its GPUs and NICs from their PCI class codes, with
// a note that NVLink is unknown.
Topology parse_nccl_topology_xml(std::string_view text, std::string source_name = "NCCL topology XML");

// The JSON schema of docs/topology.md (any machine, many nodes, "replicate" for identical nodes,
// "link_costs" overrides). to_json writes every field out in full, so
// topology_from_json(to_json(t)) == t.
Topology topology_from_json(std::string_view text, std::string source_name = "topology JSON");
std::string to_json(const Topology& topology, int indent = 2);

// Reads a file in any of the three formats (JSON, NCCL XML, nvidia-smi text: told apart by the
// first non-blank character and the header). Throws ParseError, also when the file is unreadable.
Topology load_topology_file(const std::string& path);

// Joins per-node descriptions (each node leader's detect_host(), gathered by loom::init) into one
// job topology, nodes in the given order. Nodes may differ. Link costs are taken from the first
// topology; the others must agree (std::invalid_argument otherwise, naming both values).
Topology merge_nodes(std::vector<Topology> per_node);

// "00000000:3B:00.0" (NVML), "0000:3b:00.0" (NCCL, hwloc) -> "0000:3b:00.0": lower case, a 4-digit
// domain, the form every topology source and the runtime's device check compare. Text that is not
// a bus id comes back lower-cased and otherwise unchanged.
std::string normalize_bus_id(std::string_view bus_id);

}  // namespace loom::topo
