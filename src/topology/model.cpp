#include <algorithm>
#include <charconv>
#include <set>
#include <stdexcept>

#include "loom/topology/topology.h"
#include "topology/limits.h"

namespace loom::topo {

std::string to_string(LinkClass cls) {
  switch (cls) {
    case LinkClass::Self:
      return "X";
    case LinkClass::NV:
      return "NV";
    case LinkClass::PIX:
      return "PIX";
    case LinkClass::PXB:
      return "PXB";
    case LinkClass::PHB:
      return "PHB";
    case LinkClass::NODE:
      return "NODE";
    case LinkClass::SYS:
      return "SYS";
    case LinkClass::NET:
      return "NET";
  }
  return "?";
}

std::string to_string(Link link) {
  if (link.cls == LinkClass::NV) return "NV" + std::to_string(link.nvlinks);
  return to_string(link.cls);
}

std::optional<Link> parse_link(std::string_view text) {
  if (text == "X") return Link{LinkClass::Self, 0};
  if (text == "PIX") return Link{LinkClass::PIX, 0};
  if (text == "PXB") return Link{LinkClass::PXB, 0};
  if (text == "PHB") return Link{LinkClass::PHB, 0};
  if (text == "NODE") return Link{LinkClass::NODE, 0};
  if (text == "SYS" || text == "SOC") return Link{LinkClass::SYS, 0};
  if (text == "NET") return Link{LinkClass::NET, 0};
  if (text.size() > 2 && text.size() <= 4 && text.substr(0, 2) == "NV") {
    int count = 0;
    auto digits = text.substr(2);
    if (digits[0] == '0') return std::nullopt;  // "NV0", "NV01": not something nvidia-smi prints
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), count);
    if (ec != std::errc() || end != digits.data() + digits.size() || count < 1 || count > 64) return std::nullopt;
    return Link{LinkClass::NV, count};
  }
  return std::nullopt;
}

ParseError::ParseError(std::string source, int line, int column, const std::string& message)
    : std::runtime_error(limits::quoted(source, 256) + ":" + std::to_string(line) + ":" + std::to_string(column) +
                         ": " +
                         (message.size() <= limits::kMessageBytes
                              ? message
                              : message.substr(0, limits::kMessageBytes) + "... (message cut at " +
                                    std::to_string(limits::kMessageBytes) + " of its " +
                                    std::to_string(message.size()) + " bytes)")),
      source_(std::move(source)),
      line_(line),
      column_(column) {}

const NumaNode* Node::numa_node(int id) const {
  for (const auto& n : numa_nodes)
    if (n.id == id) return &n;
  return nullptr;
}

CpuList Node::all_cpus() const {
  std::set<int> all;
  for (const auto& n : numa_nodes) all.insert(n.cpus.begin(), n.cpus.end());
  if (all.empty())
    for (const auto& s : sockets) all.insert(s.cpus.begin(), s.cpus.end());
  if (all.empty())
    for (const auto& g : gpus) all.insert(g.cpus.begin(), g.cpus.end());
  return CpuList(all.begin(), all.end());
}

int Topology::gpu_count() const {
  int count = 0;
  for (const auto& n : nodes) count += static_cast<int>(n.gpus.size());
  return count;
}

namespace {

std::string where(size_t node_index, const Node& node) {
  return "node " + std::to_string(node_index) + (node.hostname.empty() ? "" : " ('" + node.hostname + "')");
}

void check_link(const std::string& at, Link link, bool diagonal) {
  if (diagonal != (link.cls == LinkClass::Self))
    throw std::invalid_argument(at + " is " + to_string(link) + ", expected " +
                                (diagonal ? "X (Self) on the diagonal" : "a link class other than X off the diagonal"));
  if ((link.cls == LinkClass::NV) != (link.nvlinks > 0))
    throw std::invalid_argument(at + ": NVLink count " + std::to_string(link.nvlinks) + " does not fit class " +
                                to_string(link.cls));
  if (link.cls == LinkClass::NV && link.nvlinks > 64)
    throw std::invalid_argument(at + ": " + std::to_string(link.nvlinks) + " NVLinks, expected at most 64");
  if (link.cls == LinkClass::NET) throw std::invalid_argument(at + " is NET, which only joins different nodes");
}

}  // namespace

void validate(const Topology& topology) {
  for (size_t n = 0; n < topology.nodes.size(); ++n) {
    const Node& node = topology.nodes[n];
    const std::string at = where(n, node);
    const size_t g = node.gpus.size();
    for (size_t i = 0; i < g; ++i)
      if (node.gpus[i].index != static_cast<int>(i))
        throw std::invalid_argument(at + ": gpus[" + std::to_string(i) + "] has index " +
                                    std::to_string(node.gpus[i].index) + ", expected " + std::to_string(i));
    if (node.gpu_links.size() != g)
      throw std::invalid_argument(at + ": gpu_links has " + std::to_string(node.gpu_links.size()) + " rows, expected " +
                                  std::to_string(g) + " (one per GPU)");
    for (size_t a = 0; a < g; ++a) {
      if (node.gpu_links[a].size() != g)
        throw std::invalid_argument(at + ": gpu_links[" + std::to_string(a) + "] has " +
                                    std::to_string(node.gpu_links[a].size()) + " entries, expected " +
                                    std::to_string(g));
    }
    for (size_t a = 0; a < g; ++a)
      for (size_t b = 0; b < g; ++b) {
        const std::string cell = at + ": GPU" + std::to_string(a) + "-GPU" + std::to_string(b);
        check_link(cell, node.gpu_links[a][b], a == b);
        if (!(node.gpu_links[a][b] == node.gpu_links[b][a]))
          throw std::invalid_argument(cell + " is " + to_string(node.gpu_links[a][b]) + " but GPU" + std::to_string(b) +
                                      "-GPU" + std::to_string(a) + " is " + to_string(node.gpu_links[b][a]) +
                                      ", expected a symmetric matrix");
      }
    if (!node.nics.empty() || !node.nic_links.empty()) {
      if (node.nic_links.size() != g)
        throw std::invalid_argument(at + ": nic_links has " + std::to_string(node.nic_links.size()) +
                                    " rows, expected " + std::to_string(g) + " (one per GPU)");
      for (size_t a = 0; a < g; ++a) {
        if (node.nic_links[a].size() != node.nics.size())
          throw std::invalid_argument(at + ": nic_links[" + std::to_string(a) + "] has " +
                                      std::to_string(node.nic_links[a].size()) + " entries, expected " +
                                      std::to_string(node.nics.size()) + " (one per NIC)");
        for (size_t k = 0; k < node.nics.size(); ++k)
          check_link(at + ": GPU" + std::to_string(a) + "-" + node.nics[k].name, node.nic_links[a][k], false);
      }
    }
    for (const auto& gpu : node.gpus)
      if (gpu.numa >= 0 && !node.numa_nodes.empty() && node.numa_node(gpu.numa) == nullptr)
        throw std::invalid_argument(at + ": GPU" + std::to_string(gpu.index) + " is on NUMA node " +
                                    std::to_string(gpu.numa) + ", which the node does not list");
  }
}

}  // namespace loom::topo
