// detect_host(): hwloc for CPUs, NUMA nodes, NICs and the PCI tree; NVML for GPUs and NVLink.
#include "loom/topology/detect.h"

#include <hwloc.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>

#include "topology/nvml_loader.h"
#include "topology/pcie_path.h"

namespace loom::topo {

namespace {

using detail::PciPlace;

CpuList cpus_of(hwloc_const_bitmap_t set) {
  CpuList cpus;
  if (!set) return cpus;
  for (int i = hwloc_bitmap_first(set); i >= 0 && i <= kMaxCpu; i = hwloc_bitmap_next(set, i)) cpus.push_back(i);
  return cpus;
}

std::string this_hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

void add_diagnostic(std::string& diagnostics, const std::string& sentence) {
  diagnostics += (diagnostics.empty() ? "" : " ") + sentence;
}

// The hwloc view of this machine: CPUs, NUMA nodes, NICs, and a place in the PCI tree per bus id.
class HwlocView {
 public:
  HwlocView(const std::string& xml, std::string& diagnostics) {
    if (hwloc_topology_init(&topo_) != 0) {
      add_diagnostic(diagnostics, "hwloc: cannot initialise a topology.");
      topo_ = nullptr;
      return;
    }
    hwloc_topology_set_io_types_filter(topo_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (!xml.empty() && hwloc_topology_set_xml(topo_, xml.c_str()) != 0) {
      add_diagnostic(diagnostics, "hwloc: cannot read the XML export " + xml + ".");
      hwloc_topology_destroy(topo_);
      topo_ = nullptr;
      return;
    }
    if (hwloc_topology_load(topo_) != 0) {
      add_diagnostic(diagnostics, "hwloc: cannot load this machine's topology.");
      hwloc_topology_destroy(topo_);
      topo_ = nullptr;
    }
  }
  ~HwlocView() {
    if (topo_) hwloc_topology_destroy(topo_);
  }
  HwlocView(const HwlocView&) = delete;
  HwlocView& operator=(const HwlocView&) = delete;
  bool ok() const { return topo_ != nullptr; }

  void fill_cpus(Node& node) const {
    for (hwloc_obj_t o = nullptr; (o = hwloc_get_next_obj_by_type(topo_, HWLOC_OBJ_PACKAGE, o));)
      node.sockets.push_back({static_cast<int>(o->os_index), cpus_of(o->cpuset)});
    for (hwloc_obj_t o = nullptr; (o = hwloc_get_next_obj_by_type(topo_, HWLOC_OBJ_NUMANODE, o));)
      node.numa_nodes.push_back({static_cast<int>(o->os_index), cpus_of(o->cpuset)});
    std::sort(node.sockets.begin(), node.sockets.end(), [](auto& a, auto& b) { return a.id < b.id; });
    std::sort(node.numa_nodes.begin(), node.numa_nodes.end(), [](auto& a, auto& b) { return a.id < b.id; });
  }

  // InfiniBand / RoCE devices (what NCCL uses between nodes), with their PCI places.
  std::vector<std::pair<Nic, std::optional<PciPlace>>> nics() const {
    std::vector<std::pair<Nic, std::optional<PciPlace>>> out;
    for (hwloc_obj_t o = nullptr; (o = hwloc_get_next_osdev(topo_, o));) {
      if (o->attr->osdev.type != HWLOC_OBJ_OSDEV_OPENFABRICS || !o->name) continue;
      Nic nic{o->name, ""};
      std::optional<PciPlace> place;
      if (o->parent && o->parent->type == HWLOC_OBJ_PCI_DEVICE) {
        nic.pci_bus_id = bus_id(o->parent);
        place = place_of(o->parent);
      }
      out.emplace_back(std::move(nic), place);
    }
    return out;
  }

  std::optional<PciPlace> place_of_bus_id(const std::string& bus) const {
    hwloc_obj_t o = hwloc_get_pcidev_by_busidstring(topo_, bus.c_str());
    if (!o) return std::nullopt;
    return place_of(o);
  }

 private:
  static std::string bus_id(hwloc_obj_t pci) {
    char text[32];
    snprintf(text, sizeof(text), "%04x:%02x:%02x.%01x", pci->attr->pcidev.domain, pci->attr->pcidev.bus,
             pci->attr->pcidev.dev, pci->attr->pcidev.func);
    return text;
  }

  PciPlace place_of(hwloc_obj_t dev) const {
    PciPlace place;
    place.chain.push_back(static_cast<int>(dev->gp_index));
    for (hwloc_obj_t p = dev->parent; p && (p->type == HWLOC_OBJ_BRIDGE || p->type == HWLOC_OBJ_PCI_DEVICE);
         p = p->parent) {
      if (p->type == HWLOC_OBJ_BRIDGE && p->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST) {
        place.host_bridge = static_cast<int>(p->gp_index);
        break;
      }
      place.chain.insert(place.chain.begin(), static_cast<int>(p->gp_index));
    }
    hwloc_obj_t anchor = hwloc_get_non_io_ancestor_obj(topo_, dev);
    if (anchor && anchor->nodeset) place.numa = hwloc_bitmap_first(anchor->nodeset);
    return place;
  }

  hwloc_topology_t topo_ = nullptr;
};

// The NUMA node sharing most CPUs with `cpus` (-1 when none does).
int nearest_numa(const Node& node, const CpuList& cpus) {
  int best = -1;
  size_t best_overlap = 0;
  for (const auto& n : node.numa_nodes) {
    CpuList common;
    std::set_intersection(n.cpus.begin(), n.cpus.end(), cpus.begin(), cpus.end(), std::back_inserter(common));
    if (common.size() > best_overlap) best = n.id, best_overlap = common.size();
  }
  return best;
}

}  // namespace

namespace {

// NVML's view of the GPUs; nullopt (said in the diagnostics) without the library or devices.
std::optional<detail::NvmlSnapshot> read_gpus_from_nvml(const DetectOptions& options, std::string& diagnostics) {
  std::optional<detail::NvmlSnapshot> nvml;
  if (options.nvml_library.empty()) {
    add_diagnostic(diagnostics, "NVML disabled: no GPU information.");
  } else {
    std::string why;
    nvml = detail::read_nvml(options.nvml_library, why);
    if (!nvml)
      add_diagnostic(diagnostics, "No GPUs: " + why + ".");
    else if (nvml->devices.empty())
      add_diagnostic(diagnostics, "No GPUs: NVML reports 0 devices.");
    if (nvml && !nvml->driver_notes.empty()) add_diagnostic(diagnostics, "NVML: " + nvml->driver_notes + ".");
  }
  return nvml;
}

// The node's GPUs in NVML's order, placed in hwloc's PCI tree where it has them (gpu_places) and
// given a NUMA node and CPUs.
void add_gpus(const detail::NvmlSnapshot& snapshot, HwlocView& hw, Node& node,
              std::vector<std::optional<PciPlace>>& gpu_places, std::map<std::string, int>& gpu_by_bus) {
  const int g = static_cast<int>(snapshot.devices.size());
  gpu_places.assign(g, std::nullopt);
  for (int i = 0; i < g; ++i) {
    const auto& dev = snapshot.devices[i];
    Gpu gpu{i, dev.name, dev.bus_id, -1, dev.cpus};
    if (hw.ok()) gpu_places[i] = hw.place_of_bus_id(dev.bus_id);
    if (gpu_places[i] && gpu_places[i]->numa >= 0)
      gpu.numa = gpu_places[i]->numa;
    else if (!gpu.cpus.empty())
      gpu.numa = nearest_numa(node, gpu.cpus);
    if (gpu.cpus.empty() && gpu.numa >= 0 && node.numa_node(gpu.numa)) gpu.cpus = node.numa_node(gpu.numa)->cpus;
    gpu_by_bus[dev.bus_id] = i;
    node.gpus.push_back(std::move(gpu));
  }
}

// The GPU x GPU link classes: NVLink counts (through NVSwitches too), else NVML's common
// ancestor, else hwloc's PCI tree, else SYS.
void link_gpus(const detail::NvmlSnapshot& snapshot, const std::vector<std::optional<PciPlace>>& gpu_places,
               const std::map<std::string, int>& gpu_by_bus, Node& node) {
  const int g = static_cast<int>(snapshot.devices.size());
  // NVLinks to something other than a GPU of this node go to NVSwitches: a pair of GPUs gets the
  // smaller of their switch-link counts, plus any direct links between them.
  std::vector<int> switch_links(g, 0);
  for (int i = 0; i < g; ++i)
    for (const auto& [remote, count] : snapshot.devices[i].nvlinks)
      if (!gpu_by_bus.count(remote)) switch_links[i] += count;
  node.gpu_links.assign(g, std::vector<Link>(g));
  for (int a = 0; a < g; ++a)
    for (int b = 0; b < g; ++b) {
      if (a == b) {
        node.gpu_links[a][b] = {LinkClass::Self, 0};
        continue;
      }
      int nv = std::min(switch_links[a], switch_links[b]);
      auto direct = snapshot.devices[a].nvlinks.find(node.gpus[b].pci_bus_id);
      if (direct != snapshot.devices[a].nvlinks.end()) nv += direct->second;
      auto back = snapshot.devices[b].nvlinks.find(node.gpus[a].pci_bus_id);
      if (direct == snapshot.devices[a].nvlinks.end() && back != snapshot.devices[b].nvlinks.end()) nv += back->second;
      if (nv > 0) {
        node.gpu_links[a][b] = {LinkClass::NV, std::min(nv, 64)};
      } else if (auto l = detail::link_from_nvml_level(snapshot.common_ancestor[a][b])) {
        node.gpu_links[a][b] = *l;
      } else if (gpu_places[a] && gpu_places[b]) {
        node.gpu_links[a][b] = detail::pcie_link(*gpu_places[a], *gpu_places[b]);
      } else {
        node.gpu_links[a][b] = {LinkClass::SYS, 0};
      }
    }
}

}  // namespace

Detection detect_host(const DetectOptions& options) {
  Detection d;
  if (options.file_overrides_detection && !options.topology_file.empty()) {
    d.topology = load_topology_file(options.topology_file);
    d.source = "file " + options.topology_file;
    return d;
  }
  Node node;
  node.hostname = options.hostname.empty() ? this_hostname() : options.hostname;
  HwlocView hw(options.hwloc_xml, d.diagnostics);
  std::vector<std::optional<PciPlace>> nic_places;
  if (hw.ok()) {
    hw.fill_cpus(node);
    for (auto& [nic, place] : hw.nics()) {
      node.nics.push_back(nic);
      nic_places.push_back(place);
    }
  }
  std::optional<detail::NvmlSnapshot> nvml = read_gpus_from_nvml(options, d.diagnostics);
  if ((!nvml || nvml->devices.empty()) && !options.topology_file.empty()) {
    add_diagnostic(d.diagnostics, "Using the topology file " + options.topology_file + ".");
    d.topology = load_topology_file(options.topology_file);
    if (d.topology.nodes.size() == 1 && d.topology.nodes[0].hostname.empty())
      d.topology.nodes[0].hostname = node.hostname;
    d.source = "file " + options.topology_file;
    return d;
  }
  const int g = nvml ? static_cast<int>(nvml->devices.size()) : 0;
  std::vector<std::optional<PciPlace>> gpu_places;
  std::map<std::string, int> gpu_by_bus;
  if (nvml) {
    add_gpus(*nvml, hw, node, gpu_places, gpu_by_bus);
    link_gpus(*nvml, gpu_places, gpu_by_bus, node);
  }
  node.nic_links.assign(g, std::vector<Link>(node.nics.size(), Link{LinkClass::SYS, 0}));
  for (int a = 0; a < g; ++a)
    for (size_t k = 0; k < node.nics.size(); ++k)
      if (gpu_places[a] && nic_places[k]) node.nic_links[a][k] = detail::pcie_link(*gpu_places[a], *nic_places[k]);
  if (g > 0 && std::any_of(gpu_places.begin(), gpu_places.end(), [](auto& p) { return !p; }))
    node.notes.push_back("some GPUs are not in hwloc's PCI tree: their NIC links are assumed SYS");
  d.source = g > 0 ? "hwloc+nvml" : "hwloc";
  node.source = d.source;
  d.topology.nodes.push_back(std::move(node));
  validate(d.topology);
  return d;
}

}  // namespace loom::topo
