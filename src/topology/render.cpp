// Pictures of one node's plan: SVG written directly (no dependency), and Graphviz DOT for those
// who have `dot`. GPUs sit on a circle so every pairwise link is visible.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "loom/topology/placement.h"

namespace loom::topo {

namespace {

// Colour-blind-safe qualitative palette (Okabe-Ito, then lighter tints), cycled for many groups.
const char* const kGroupColours[] = {"#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00",
                                     "#CC79A7", "#999933", "#88CCEE", "#44AA99", "#DDCC77", "#AA4499"};
constexpr int kColours = sizeof(kGroupColours) / sizeof(kGroupColours[0]);
const char* const kUnusedColour = "#E0E0E0";

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '"')
      out += "&quot;";
    else if (static_cast<unsigned char>(c) >= 0x20)
      out += c;
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

struct LinkStyle {
  const char* colour;
  double width;
  bool dashed;
};

LinkStyle style_of(Link l) {
  switch (l.cls) {
    case LinkClass::NV:
      return {"#2E7D32", std::min(10.0, 1.5 + 0.5 * l.nvlinks), false};
    case LinkClass::PIX:
    case LinkClass::PXB:
      return {"#1565C0", 1.2, false};
    case LinkClass::PHB:
    case LinkClass::NODE:
      return {"#6A1B9A", 1.0, false};
    default:
      return {"#C62828", 1.0, true};
  }
}

// Per GPU of the node: the rank using it (-1: unused) and its TP group.
struct GpuUse {
  int rank = -1;
  int tp_group = -1;
};

std::vector<GpuUse> uses(const Plan& plan, const Topology& topology, int node) {
  if (node < 0 || node >= static_cast<int>(topology.nodes.size()))
    throw std::invalid_argument("node " + std::to_string(node) + " is not in the topology (it has " +
                                std::to_string(topology.nodes.size()) + " nodes)");
  std::vector<GpuUse> out(topology.nodes[node].gpus.size());
  for (const auto& p : plan.layout.ranks)
    if (p.node == node && p.device >= 0 && p.device < static_cast<int>(out.size()))
      out[p.device] = {p.rank, p.tp_group};
  return out;
}

}  // namespace

std::string to_svg(const Plan& plan, const Topology& topology, int node) {
  const std::vector<GpuUse> use = uses(plan, topology, node);
  const Node& n = topology.nodes[node];
  const int g = static_cast<int>(n.gpus.size());
  const double cx = 300, cy = 300, radius = g > 1 ? 210 : 0, box_w = 96, box_h = 54;
  std::vector<std::pair<double, double>> at(g);
  for (int i = 0; i < g; ++i) {
    double angle = -M_PI / 2 + 2 * M_PI * i / std::max(g, 1);
    at[i] = {cx + radius * std::cos(angle), cy + radius * std::sin(angle)};
  }
  const std::string host = node < static_cast<int>(plan.hostnames.size()) ? plan.hostnames[node] : n.hostname;
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"900\" height=\"620\" viewBox=\"0 0 900 620\" "
       "font-family=\"sans-serif\" font-size=\"13\">\n";
  s << "<title>" << escape(host) << ": placement, TP " << plan.request.tp_degree << "</title>\n";
  s << "<rect x=\"0\" y=\"0\" width=\"900\" height=\"620\" fill=\"white\"/>\n";
  s << "<text x=\"20\" y=\"30\" font-size=\"18\">" << escape(host) << " - " << g << " GPUs, TP "
    << plan.request.tp_degree << "</text>\n";
  s << "<g id=\"links\">\n";
  for (int a = 0; a < g; ++a)
    for (int b = a + 1; b < g; ++b) {
      const Link l = n.gpu_link(a, b);
      const LinkStyle st = style_of(l);
      s << "<line class=\"link " << to_string(l.cls) << "\" x1=\"" << num(at[a].first) << "\" y1=\""
        << num(at[a].second) << "\" x2=\"" << num(at[b].first) << "\" y2=\"" << num(at[b].second) << "\" stroke=\""
        << st.colour << "\" stroke-width=\"" << num(st.width) << "\"" << (st.dashed ? " stroke-dasharray=\"6,4\"" : "")
        << " stroke-opacity=\"0.8\"><title>GPU" << a << "-GPU" << b << ": " << to_string(l) << "</title></line>\n";
    }
  s << "</g>\n<g id=\"gpus\">\n";
  for (int i = 0; i < g; ++i) {
    const bool used = use[i].rank >= 0;
    const char* fill = used ? kGroupColours[use[i].tp_group % kColours] : kUnusedColour;
    s << "<g class=\"gpu" << (used ? "" : " unused") << "\">";
    s << "<rect x=\"" << num(at[i].first - box_w / 2) << "\" y=\"" << num(at[i].second - box_h / 2) << "\" width=\""
      << num(box_w) << "\" height=\"" << num(box_h) << "\" rx=\"6\" fill=\"" << fill << "\" stroke=\"#333\""
      << (used ? "" : " stroke-dasharray=\"4,3\"") << "/>";
    s << "<text x=\"" << num(at[i].first) << "\" y=\"" << num(at[i].second - 6) << "\" text-anchor=\"middle\" "
      << "font-weight=\"bold\">GPU" << i << "</text>";
    s << "<text x=\"" << num(at[i].first) << "\" y=\"" << num(at[i].second + 13) << "\" text-anchor=\"middle\">"
      << (used ? "rank " + std::to_string(use[i].rank) + " / TP " + std::to_string(use[i].tp_group) : "unused")
      << "</text></g>\n";
  }
  s << "</g>\n<g id=\"legend\">\n";
  double y = 70;
  const std::pair<Link, const char*> samples[] = {{{LinkClass::NV, 12}, "NV# (width grows with # links)"},
                                                  {{LinkClass::PIX, 0}, "PIX / PXB (PCIe switch)"},
                                                  {{LinkClass::PHB, 0}, "PHB / NODE (through the CPU)"},
                                                  {{LinkClass::SYS, 0}, "SYS (across sockets)"}};
  for (const auto& [l, label] : samples) {
    const LinkStyle st = style_of(l);
    s << "<line x1=\"640\" y1=\"" << num(y) << "\" x2=\"690\" y2=\"" << num(y) << "\" stroke=\"" << st.colour
      << "\" stroke-width=\"" << num(l.cls == LinkClass::NV ? 4.0 : st.width) << "\""
      << (st.dashed ? " stroke-dasharray=\"6,4\"" : "") << "/><text x=\"700\" y=\"" << num(y + 4) << "\">" << label
      << "</text>\n";
    y += 24;
  }
  y += 10;
  std::vector<int> groups;
  for (const auto& u : use)
    if (u.rank >= 0 && std::find(groups.begin(), groups.end(), u.tp_group) == groups.end())
      groups.push_back(u.tp_group);
  std::sort(groups.begin(), groups.end());
  for (size_t k = 0; k < groups.size() && k < 16; ++k) {
    const Ring& ring = plan.layout.tp_groups[groups[k]];
    std::string ranks;
    for (int r : ring.ranks) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    s << "<rect x=\"640\" y=\"" << num(y - 11) << "\" width=\"50\" height=\"16\" fill=\""
      << kGroupColours[groups[k] % kColours] << "\" stroke=\"#333\"/><text x=\"700\" y=\"" << num(y + 2)
      << "\">TP group " << groups[k] << ": ranks " << ranks << " (" << to_string(bottleneck(ring, plan.costs))
      << ")</text>\n";
    y += 22;
  }
  if (std::any_of(use.begin(), use.end(), [](const GpuUse& u) { return u.rank < 0; })) {
    s << "<rect x=\"640\" y=\"" << num(y - 11) << "\" width=\"50\" height=\"16\" fill=\"" << kUnusedColour
      << "\" stroke=\"#333\" stroke-dasharray=\"4,3\"/><text x=\"700\" y=\"" << num(y + 2) << "\">unused</text>\n";
  }
  s << "</g>\n</svg>\n";
  return s.str();
}

std::string to_dot(const Plan& plan, const Topology& topology, int node) {
  const std::vector<GpuUse> use = uses(plan, topology, node);
  const Node& n = topology.nodes[node];
  const int g = static_cast<int>(n.gpus.size());
  const std::string host = node < static_cast<int>(plan.hostnames.size()) ? plan.hostnames[node] : n.hostname;
  auto quote = [](const std::string& s) {
    std::string out = "\"";
    for (char c : s) out += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    return out + "\"";
  };
  std::ostringstream s;
  s << "graph " << quote(host)
    << " {\n  layout=circo;\n  label=" << quote(host + ": TP " + std::to_string(plan.request.tp_degree))
    << ";\n  node [shape=box, style=\"rounded,filled\", fontname=\"sans-serif\"];\n";
  for (int i = 0; i < g; ++i) {
    const bool used = use[i].rank >= 0;
    s << "  gpu" << i << " [label="
      << quote("GPU" + std::to_string(i) + "\\n" +
               (used ? "rank " + std::to_string(use[i].rank) + " / TP " + std::to_string(use[i].tp_group) : "unused"))
      << ", fillcolor=" << quote(used ? kGroupColours[use[i].tp_group % kColours] : kUnusedColour)
      << (used ? "" : ", style=\"rounded,filled,dashed\"") << "];\n";
  }
  for (int a = 0; a < g; ++a)
    for (int b = a + 1; b < g; ++b) {
      const Link l = n.gpu_link(a, b);
      const LinkStyle st = style_of(l);
      s << "  gpu" << a << " -- gpu" << b << " [label=" << quote(to_string(l)) << ", color=" << quote(st.colour)
        << ", penwidth=" << num(st.width) << (st.dashed ? ", style=dashed" : "") << "];\n";
    }
  s << "}\n";
  return s.str();
}

}  // namespace loom::topo
