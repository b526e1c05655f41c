#include "topology/pcie_path.h"

#include <cctype>

namespace loom::topo::detail {

Link pcie_link(const PciPlace& a, const PciPlace& b) {
  if (a.numa >= 0 && b.numa >= 0 && a.numa != b.numa) return {LinkClass::SYS, 0};
  if (a.numa < 0 || b.numa < 0) return {LinkClass::SYS, 0};  // nothing known: assume the worst
  size_t common = 0;
  while (common + 1 < a.chain.size() && common + 1 < b.chain.size() && a.chain[common] == b.chain[common]) ++common;
  if (common == 0) {
    if (a.host_bridge >= 0 && a.host_bridge == b.host_bridge) return {LinkClass::PHB, 0};
    return {LinkClass::NODE, 0};
  }
  // Bridges on the path: a's ancestors below the common one, the common one, b's ancestors below it.
  size_t bridges = (a.chain.size() - 1 - common) + (b.chain.size() - 1 - common) + 1;
  return {bridges <= 1 ? LinkClass::PIX : LinkClass::PXB, 0};
}

}  // namespace loom::topo::detail

namespace loom::topo {

std::string normalize_bus_id(std::string_view bus_id) {
  std::string s(bus_id);
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  size_t colon = s.find(':');
  // A domain longer than 4 digits is zero-padded by NVML: keep its last 4 when the rest are zeros.
  if (colon != std::string::npos && colon > 4 && s.find_first_not_of('0') >= colon - 4) s.erase(0, colon - 4);
  return s;
}

}  // namespace loom::topo
