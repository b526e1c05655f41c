#include <map>
#include <stdexcept>

#include "loom/topology/topology.h"

namespace loom::topo {

namespace {

std::string describe(const LinkCosts& c) {
  auto one = [](const char* name, const LinkCost& x) {
    return std::string(name) + " " + std::to_string(x.bandwidth_gbps) + " GB/s " + std::to_string(x.latency_us) + " us";
  };
  return one("NV/link", c.nv_per_link) + ", " + one("PIX", c.pix) + ", " + one("PXB", c.pxb) + ", " +
         one("PHB", c.phb) + ", " + one("NODE", c.node) + ", " + one("SYS", c.sys) + ", " + one("NET", c.net);
}

}  // namespace

Topology merge_nodes(std::vector<Topology> per_node) {
  Topology merged;
  if (per_node.empty()) return merged;
  merged.costs = per_node.front().costs;
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < per_node.size(); ++i) {
    if (!(per_node[i].costs == merged.costs))
      throw std::invalid_argument("merge_nodes: part " + std::to_string(i) + " has link costs {" +
                                  describe(per_node[i].costs) + "}, expected those of part 0 {" +
                                  describe(merged.costs) + "}");
    for (auto& node : per_node[i].nodes) {
      if (!node.hostname.empty()) {
        auto [it, fresh] = seen.emplace(node.hostname, merged.nodes.size());
        if (!fresh)
          throw std::invalid_argument("merge_nodes: node " + std::to_string(merged.nodes.size()) + " has hostname '" +
                                      node.hostname + "', like node " + std::to_string(it->second) +
                                      ": expected one description per node");
      }
      merged.nodes.push_back(std::move(node));
    }
  }
  validate(merged);
  return merged;
}

}  // namespace loom::topo
