#include <algorithm>
#include <charconv>

#include "loom/topology/topology.h"

namespace loom::topo {

namespace {

std::optional<int> read_cpu(std::string_view text) {
  if (text.empty() || text.size() > 6) return std::nullopt;
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0 || value > kMaxCpu) return std::nullopt;
  return value;
}

}  // namespace

std::optional<CpuList> parse_cpu_list(std::string_view text) {
  CpuList cpus;
  if (text.empty()) return std::nullopt;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string_view item = text.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    size_t dash = item.find('-');
    auto first = read_cpu(item.substr(0, dash));
    if (!first) return std::nullopt;
    int last = *first;
    if (dash != std::string_view::npos) {
      auto end = read_cpu(item.substr(dash + 1));
      if (!end || *end < *first) return std::nullopt;
      last = *end;
    }
    for (int c = *first; c <= last; ++c) cpus.push_back(c);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
    // Bounded work: a list naming more ids than exist is damaged, not a machine.
    if (cpus.size() > static_cast<size_t>(kMaxCpu) + 1) return std::nullopt;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpu_list(const CpuList& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace loom::topo
