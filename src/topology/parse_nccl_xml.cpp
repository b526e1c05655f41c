// NCCL topology XML -> Topology (one node).
//
// The XML nests <pci> elements under <cpu numaid affinity> (one per NUMA node); a GPU is a <gpu dev>
// inside the <pci busid> of its device, with <nvlink target count tclass> children pointing at
// NVSwitches (tclass 0x0680xx) or other GPUs; a NIC is <nic><net name/></nic> inside its <pci>.
// GPU pairs joined through NVSwitches get NV<min of their switch-link counts> (12 on HGX A100,
// 18 on H100), which is what `nvidia-smi topo -m` prints for the same machines.
#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "loom/topology/topology.h"
#include "topology/limits.h"
#include "topology/pcie_path.h"
#include "topology/xml_scan.h"

namespace loom::topo {

namespace {

using detail::PciPlace;
using detail::XmlElement;

struct FoundGpu {
  int dev = -1;
  std::string bus_id;
  int numa = -1;  // the enclosing <cpu>: its CPU list is numa_[numa] (not copied per GPU)
  PciPlace place;
  std::map<std::string, int> nvlinks_to_gpu;  // target bus id -> count
  int nvlinks_to_switch = 0;
  const XmlElement* where = nullptr;
};

struct FoundNic {
  std::string name;
  std::string bus_id;
  PciPlace place;
};

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

class NcclXmlParser {
 public:
  NcclXmlParser(std::string_view text, std::string source) : text_(text), source_(std::move(source)) {}

  Topology parse() {
    XmlElement root = detail::parse_xml(text_, source_);
    if (root.name != "system")
      fail(root, "expected the root element <system> of an NCCL topology file, found <" + root.name + ">");
    int cpu_index = 0;
    for (const auto& child : root.children) {
      if (child.name != "cpu") continue;  // NCCL also writes <nvs>/<net> tops in some versions: not needed
      read_cpu(child, cpu_index++);
    }
    if (numa_.empty()) fail(root, "expected at least one <cpu> element under <system>, found none");
    return build(root);
  }

 private:
  [[noreturn]] void fail(const XmlElement& e, const std::string& message) const {
    throw ParseError(source_, e.line, e.column, message);
  }

  int int_attribute(const XmlElement& e, std::string_view key, int base) const {
    const std::string* v = e.attribute(key);
    if (!v) fail(e, "<" + limits::quoted(e.name) + "> has no '" + std::string(key) + "' attribute");
    try {
      size_t used = 0;
      long value = std::stol(*v, &used, base);
      if (used != v->size() || value < 0 || value > 1000000) throw std::invalid_argument("range");
      return static_cast<int>(value);
    } catch (const std::exception&) {
      fail(e, "<" + limits::quoted(e.name) + "> " + std::string(key) + "=\"" + limits::quoted(*v) +
                 "\": expected a non-negative integer");
    }
  }

  // "00000000,ffffffff,00000000,ffffffff": 32-bit words, most significant first (Linux cpumask).
  CpuList mask_to_cpus(const XmlElement& e, const std::string& mask) const {
    std::vector<std::string> words;
    size_t pos = 0;
    while (true) {
      size_t comma = mask.find(',', pos);
      words.push_back(mask.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
    if (words.size() * 32 > static_cast<size_t>(kMaxCpu) + 1)
      fail(e, "<cpu> affinity names more than " + std::to_string(kMaxCpu + 1) + " CPUs");
    CpuList cpus;
    for (size_t w = 0; w < words.size(); ++w) {
      const std::string& word = words[words.size() - 1 - w];
      if (word.empty() || word.size() > 8 || word.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
        fail(e, "<cpu> affinity=\"" + limits::quoted(mask) + "\": expected comma-separated 32-bit hex words such as 0000ffff,ffffffff");
      unsigned long bits = std::stoul(word, nullptr, 16);
      for (int b = 0; b < 32; ++b)
        if (bits & (1ul << b)) cpus.push_back(static_cast<int>(w * 32 + b));
    }
    return cpus;
  }

  void read_cpu(const XmlElement& cpu, int cpu_index) {
    int numa = cpu.attribute("numaid") ? int_attribute(cpu, "numaid", 10) : cpu_index;
    CpuList cpus;
    if (const std::string* mask = cpu.attribute("affinity")) cpus = mask_to_cpus(cpu, *mask);
    cpu_ids_ += static_cast<long long>(cpus.size());
    if (cpu_ids_ > limits::kNodeCpuIds)
      fail(cpu, "the <cpu> affinity masks " + limits::exceeded(limits::kNodeCpuIds, "CPU ids in all"));
    if (!numa_.emplace(numa, std::move(cpus)).second)
      fail(cpu, "<cpu numaid=\"" + std::to_string(numa) + "\"> appears twice");
    std::vector<int> chain;
    for (const auto& child : cpu.children) walk(child, numa, chain);
  }

  // Depth-first over <pci>; `chain` holds the ids of the enclosing <pci> elements.
  void walk(const XmlElement& e, int numa, std::vector<int>& chain) {
    if (e.name == "nic") {
      // A <nic> directly under <cpu> (no <pci>): a NIC without a PCI place.
      for (const auto& net : e.children)
        if (net.name == "net") add_nic(net, numa, chain);
      return;
    }
    if (e.name != "pci") return;
    const std::string* bus = e.attribute("busid");
    if (!bus) fail(e, "<pci> has no 'busid' attribute");
    const int id = next_pci_id_++;
    chain.push_back(id);
    pci_class_[id] = e.attribute("class") ? lower(*e.attribute("class")) : "";
    bool is_device = false;
    for (const auto& child : e.children) {
      if (child.name == "gpu") {
        add_gpu(child, lower(*bus), numa, chain);
        is_device = true;
      } else if (child.name == "nic") {
        for (const auto& net : child.children)
          if (net.name == "net") add_nic(net, numa, chain, lower(*bus));
        is_device = true;
      } else if (child.name == "pci") {
        walk(child, numa, chain);
      }
    }
    // Leaves without <gpu>/<nic> (an NCCL_TOPO_FILE override) are kept by PCI class for later.
    if (!is_device && e.children.empty()) bare_leaves_.push_back({&e, lower(*bus), numa, chain});
    chain.pop_back();
  }

  void add_gpu(const XmlElement& g, const std::string& bus, int numa, const std::vector<int>& chain) {
    if (gpus_.size() >= static_cast<size_t>(limits::kGpusPerNode))
      fail(g, "the <gpu> elements " + limits::exceeded(limits::kGpusPerNode, "GPUs per node"));
    FoundGpu gpu;
    gpu.dev = g.attribute("dev") ? int_attribute(g, "dev", 10) : static_cast<int>(gpus_.size());
    gpu.bus_id = bus;
    gpu.numa = numa;
    gpu.place = {numa, -1, chain};
    gpu.where = &g;
    for (const auto& link : g.children) {
      if (link.name != "nvlink") continue;
      const std::string* target = link.attribute("target");
      if (!target) fail(link, "<nvlink> has no 'target' attribute");
      int count = link.attribute("count") ? int_attribute(link, "count", 10) : 1;
      if (count < 1 || count > 64) fail(link, "<nvlink> count=\"" + std::to_string(count) + "\": expected 1 to 64");
      std::string tclass = link.attribute("tclass") ? lower(*link.attribute("tclass")) : "";
      if (tclass.rfind("0x0680", 0) == 0)
        gpu.nvlinks_to_switch += count;  // NVSwitch (PCI bridge class "other")
      else
        gpu.nvlinks_to_gpu[lower(*target)] += count;
    }
    gpus_.push_back(std::move(gpu));
  }

  void add_nic(const XmlElement& net, int numa, const std::vector<int>& chain, std::string bus = "") {
    const std::string* name = net.attribute("name");
    if (!name || name->empty()) fail(net, "<net> has no 'name' attribute");
    if (nics_.size() >= static_cast<size_t>(limits::kNicsPerNode))
      fail(net, "the <net> elements " + limits::exceeded(limits::kNicsPerNode, "NICs per node"));
    nics_.push_back({*name, std::move(bus), {numa, -1, chain}});
  }

  Topology build(const XmlElement& root) {
    Node node;
    node.source = source_ + " (NCCL topology XML)";
    node.notes.push_back("sockets not described by NCCL topology XML");
    for (const auto& [id, cpus] : numa_) node.numa_nodes.push_back({id, cpus});
    if (gpus_.empty()) {
      // An override file: bare PCI devices. 0x0302xx is a 3D controller (data-centre GPU),
      // 0x0300xx VGA, 0x0200xx Ethernet, 0x0207xx InfiniBand.
      for (const auto& leaf : bare_leaves_) {
        const std::string& cls = pci_class_[leaf.chain.back()];
        if (cls.rfind("0x0302", 0) == 0 || cls.rfind("0x0300", 0) == 0) {
          if (gpus_.size() >= static_cast<size_t>(limits::kGpusPerNode))
            fail(*leaf.element, "the GPU <pci> elements " + limits::exceeded(limits::kGpusPerNode, "GPUs per node"));
          FoundGpu gpu;
          gpu.dev = static_cast<int>(gpus_.size());
          gpu.bus_id = leaf.bus;
          gpu.numa = leaf.numa;
          gpu.place = {leaf.numa, -1, leaf.chain};
          gpu.where = leaf.element;
          gpus_.push_back(std::move(gpu));
        } else if (cls.rfind("0x0207", 0) == 0 || cls.rfind("0x0200", 0) == 0) {
          if (nics_.size() >= static_cast<size_t>(limits::kNicsPerNode))
            fail(*leaf.element, "the NIC <pci> elements " + limits::exceeded(limits::kNicsPerNode, "NICs per node"));
          nics_.push_back({"pci:" + leaf.bus, leaf.bus, {leaf.numa, -1, leaf.chain}});
        }
      }
      if (gpus_.empty())
        fail(root,
             "expected <gpu> elements (an NCCL topology dump) or <pci class=\"0x0302..\"> GPUs (a topology "
             "override), found neither: this file describes no GPU");
      node.notes.push_back(
          "no <gpu> elements (an NCCL_TOPO_FILE override, not a dump): " + std::to_string(gpus_.size()) +
          " GPUs taken from their PCI class; NVLink unknown, links are PCIe only");
    }
    // Devices in `dev` order; each dev once and 0..n-1.
    std::sort(gpus_.begin(), gpus_.end(), [](const FoundGpu& a, const FoundGpu& b) { return a.dev < b.dev; });
    for (size_t i = 0; i < gpus_.size(); ++i)
      if (gpus_[i].dev != static_cast<int>(i))
        fail(*gpus_[i].where, "<gpu dev=\"" + std::to_string(gpus_[i].dev) + "\">: expected the GPUs to be numbered " +
                                  "0.." + std::to_string(gpus_.size() - 1) + " without gaps or repeats");
    const int g = static_cast<int>(gpus_.size());
    // Each GPU of the model keeps its own copy of its <cpu>'s list: bound the copies too.
    long long gpu_cpu_ids = 0;
    for (const auto& f : gpus_)
      if ((gpu_cpu_ids += static_cast<long long>(numa_.at(f.numa).size())) > limits::kNodeCpuIds)
        fail(*f.where, "the GPUs' CPU lists (each GPU's <cpu> affinity) " +
                           limits::exceeded(limits::kNodeCpuIds, "CPU ids in all"));
    for (const auto& f : gpus_) node.gpus.push_back({f.dev, "", f.bus_id, f.numa, numa_.at(f.numa)});
    for (const auto& n : nics_) node.nics.push_back({n.name, n.bus_id});
    node.gpu_links.assign(g, std::vector<Link>(g));
    for (int a = 0; a < g; ++a)
      for (int b = 0; b < g; ++b) {
        if (a == b) {
          node.gpu_links[a][b] = {LinkClass::Self, 0};
          continue;
        }
        int nv = 0;
        auto direct = gpus_[a].nvlinks_to_gpu.find(gpus_[b].bus_id);
        if (direct != gpus_[a].nvlinks_to_gpu.end()) nv += direct->second;
        nv += std::min(gpus_[a].nvlinks_to_switch, gpus_[b].nvlinks_to_switch);
        node.gpu_links[a][b] =
            nv > 0 ? Link{LinkClass::NV, std::min(nv, 64)} : detail::pcie_link(gpus_[a].place, gpus_[b].place);
      }
    // A direct link listed on one side only still joins both (keep the matrix symmetric).
    for (int a = 0; a < g; ++a)
      for (int b = a + 1; b < g; ++b) {
        Link x = node.gpu_links[a][b], y = node.gpu_links[b][a];
        Link best = (x.cls == LinkClass::NV && (y.cls != LinkClass::NV || x.nvlinks >= y.nvlinks)) ? x : y;
        node.gpu_links[a][b] = node.gpu_links[b][a] = best;
      }
    node.nic_links.assign(g, std::vector<Link>(nics_.size()));
    for (int a = 0; a < g; ++a)
      for (size_t k = 0; k < nics_.size(); ++k)
        node.nic_links[a][k] = detail::pcie_link(gpus_[a].place, nics_[k].place);
    Topology topo;
    topo.nodes.push_back(std::move(node));
    return topo;
  }

  struct BareLeaf {
    const XmlElement* element;
    std::string bus;
    int numa;
    std::vector<int> chain;
  };

  std::string_view text_;
  std::string source_;
  std::map<int, CpuList> numa_;
  std::vector<FoundGpu> gpus_;
  std::vector<FoundNic> nics_;
  std::vector<BareLeaf> bare_leaves_;
  std::map<int, std::string> pci_class_;
  int next_pci_id_ = 0;
  long long cpu_ids_ = 0;
};

}  // namespace

Topology parse_nccl_topology_xml(std::string_view text, std::string source_name) {
  return NcclXmlParser(text, std::move(source_name)).parse();
}

}  // namespace loom::topo
