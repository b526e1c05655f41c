// explain() and plan_to_json(): the plan as text for people and as JSON for programs.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loom/topology/placement.h"

namespace loom::topo {

namespace {

constexpr size_t kMaxRows = 64;  // explain() prints at most this many ranks / groups per table

std::string fixed(double v, int digits = 1) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string bytes_text(double bytes) {
  if (bytes >= (1 << 30)) return fixed(bytes / (1 << 30), 1) + " GiB";
  if (bytes >= (1 << 20)) return fixed(bytes / (1 << 20), 1) + " MiB";
  if (bytes >= (1 << 10)) return fixed(bytes / (1 << 10), 1) + " KiB";
  return fixed(bytes, 0) + " B";
}

std::string pad(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

std::string shorten(std::string s, size_t width) {
  if (s.size() > width) s = s.substr(0, width - 3) + "...";
  return s;
}

// "0,1,4,5" with runs collapsed: "0-3,8".
std::string rank_list(std::vector<int> ranks, bool sorted) {
  if (sorted) std::sort(ranks.begin(), ranks.end());
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? "," : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

// "dgx-0:0,3" when one node, else "dgx-0:0,dgx-1:0,...".
std::string devices(const Plan& plan, const Layout& layout, const Ring& ring) {
  std::set<int> nodes;
  for (int r : ring.ranks) nodes.insert(layout.ranks[r].node);
  std::string out;
  if (nodes.size() == 1) {
    out = plan.hostnames[*nodes.begin()] + ":";
    for (size_t i = 0; i < ring.ranks.size(); ++i)
      out += (i ? "," : "") + std::to_string(layout.ranks[ring.ranks[i]].device);
    return out;
  }
  for (size_t i = 0; i < ring.ranks.size(); ++i) {
    const auto& p = layout.ranks[ring.ranks[i]];
    out += (i ? "," : "") + plan.hostnames[p.node] + ":" + std::to_string(p.device);
  }
  return out;
}

void group_table(std::ostringstream& out, const Plan& plan, const std::vector<Ring>& planned,
                 const std::vector<Ring>& naive, double bytes, const char* title, bool ring_order) {
  out << title << " (all-reduce of " << bytes_text(bytes) << ")\n";
  out << "  " << pad("group", 6) << pad("ranks", 14) << pad("planned devices", 26) << pad("link", 6)
      << pad("time_us", 11) << pad("naive devices", 26) << pad("link", 6) << pad("time_us", 11) << "naive/planned\n";
  double worst_p = 0, worst_n = 0;
  for (size_t g = 0; g < planned.size(); ++g) {
    const double tp = allreduce_time_us(planned[g], bytes, plan.costs);
    const double tn = allreduce_time_us(naive[g], bytes, plan.costs);
    worst_p = std::max(worst_p, tp);
    worst_n = std::max(worst_n, tn);
    if (g < kMaxRows) {
      out << "  " << pad(std::to_string(g), 6) << pad(shorten(rank_list(planned[g].ranks, !ring_order), 13), 14)
          << pad(shorten(devices(plan, plan.layout, planned[g]), 25), 26)
          << pad(to_string(bottleneck(planned[g], plan.costs)), 6) << pad(fixed(tp), 11)
          << pad(shorten(devices(plan, plan.naive, naive[g]), 25), 26)
          << pad(to_string(bottleneck(naive[g], plan.costs)), 6) << pad(fixed(tn), 11)
          << (tp > 0 ? fixed(tn / tp, 2) : "-") << "\n";
    } else if (g == kMaxRows) {
      out << "  ... " << planned.size() - kMaxRows << " more\n";
    }
  }
  out << "  " << pad("slowest", 46) << pad("", 6) << pad(fixed(worst_p), 11) << pad("", 26) << pad("", 6)
      << pad(fixed(worst_n), 11) << (worst_p > 0 ? fixed(worst_n / worst_p, 2) : "-") << "\n";
}

// A pipeline's slowest hop between consecutive stages (the ring's closing link, last stage back to
// the first, carries nothing).
Link slowest_hop(const Ring& pipeline, const LinkCosts& costs) {
  Ring path = pipeline;
  if (!path.links.empty()) path.links.pop_back();
  return bottleneck(path, costs);
}

void pipeline_table(std::ostringstream& out, const Plan& plan) {
  out << "Pipelines, ranks stage by stage (activations cross the slowest hop)\n";
  out << "  " << pad("group", 6) << pad("ranks", 14) << pad("planned devices", 26) << pad("hop", 6)
      << pad("naive devices", 26) << "hop\n";
  const auto& planned = plan.layout.pp_groups;
  for (size_t g = 0; g < planned.size() && g <= kMaxRows; ++g) {
    if (g == kMaxRows) {
      out << "  ... " << planned.size() - kMaxRows << " more\n";
      break;
    }
    const Ring& naive = plan.naive.pp_groups[g];
    out << "  " << pad(std::to_string(g), 6) << pad(shorten(rank_list(planned[g].ranks, false), 13), 14)
        << pad(shorten(devices(plan, plan.layout, planned[g]), 25), 26)
        << pad(to_string(slowest_hop(planned[g], plan.costs)), 6) << pad(shorten(devices(plan, plan.naive, naive), 25), 26)
        << to_string(slowest_hop(naive, plan.costs)) << "\n";
  }
}

}  // namespace

std::string explain(const Plan& plan, double bytes) {
  std::ostringstream out;
  const Layout& L = plan.layout;
  const int t = plan.request.tp_degree;
  const int nodes_used = static_cast<int>(
      std::count_if(plan.ranks_per_node.begin(), plan.ranks_per_node.end(), [](int k) { return k > 0; }));
  const int stages = plan.request.pp_degree;
  const int replicas = static_cast<int>(L.ranks.size()) / t / stages;
  out << "Placement: " << L.ranks.size() << " ranks, TP " << t << (stages > 1 ? " x PP " + std::to_string(stages) : "")
      << " x DP " << replicas << " on " << nodes_used << " node" << (nodes_used == 1 ? "" : "s") << "\n";
  out << "Layout: " << plan.request.layout().to_string() << " (outermost first; TP ranks are consecutive)\n";
  out << "  " << pad("rank", 6) << pad("host", 16) << pad("GPU", 5) << pad("CPUs", 22) << pad("TP group", 10)
      << (stages > 1 ? pad("stage", 7) : "") << "DP group\n";
  for (size_t r = 0; r < L.ranks.size() && r < kMaxRows; ++r) {
    const auto& p = L.ranks[r];
    out << "  " << pad(std::to_string(r), 6) << pad(shorten(plan.hostnames[p.node], 15), 16)
        << pad(std::to_string(p.device), 5) << pad(shorten(p.cpus.empty() ? "-" : format_cpu_list(p.cpus), 21), 22)
        << pad(std::to_string(p.tp_group), 10) << (stages > 1 ? pad(std::to_string(p.pp_index), 7) : "") << p.dp_group
        << "\n";
  }
  if (L.ranks.size() > kMaxRows) out << "  ... " << L.ranks.size() - kMaxRows << " more ranks\n";
  std::string unused;
  for (size_t n = 0; n < plan.unused_gpus.size(); ++n)
    if (!plan.unused_gpus[n].empty() && plan.ranks_per_node[n] > 0)
      unused += (unused.empty() ? "" : "; ") + plan.hostnames[n] + ": GPU " + rank_list(plan.unused_gpus[n], true);
  if (!unused.empty()) out << "Unused GPUs (the worst connected): " << unused << "\n";
  for (const auto& note : plan.notes) out << "Note: " << note << "\n";
  out << "\n";
  group_table(out, plan, L.tp_groups, plan.naive.tp_groups, bytes, "TP groups", false);
  out << "\n";
  group_table(out, plan, L.dp_groups, plan.naive.dp_groups, bytes, "DP rings, ranks in ring order", true);
  if (stages > 1) {
    out << "\n";
    pipeline_table(out, plan);
  }
  out << "\nModel: time = 2(n-1) x slowest link latency + 2(n-1)/n x bytes / bottleneck bandwidth; link figures "
         "from the topology's link costs (docs/topology.md).\n";
  return out.str();
}

std::string plan_to_json(const Plan& plan, int indent) {
  using json = nlohmann::json;
  json j;
  j["world_size"] = plan.request.world_size;
  j["tp_degree"] = plan.request.tp_degree;
  j["pp_degree"] = plan.request.pp_degree;
  j["layout"] = plan.request.layout().to_string();
  j["ranks"] = json::array();
  for (const auto& p : plan.layout.ranks)
    j["ranks"].push_back({{"rank", p.rank},
                          {"node", p.node},
                          {"hostname", plan.hostnames[p.node]},
                          {"device", p.device},
                          {"cpus", format_cpu_list(p.cpus)}});
  j["tp_groups"] = json::array();
  j["tp_bottlenecks"] = json::array();
  for (const auto& g : plan.layout.tp_groups) {
    j["tp_groups"].push_back(g.ranks);
    j["tp_bottlenecks"].push_back(to_string(bottleneck(g, plan.costs)));
  }
  j["dp_groups"] = json::array();
  j["dp_rings"] = json::array();
  j["dp_bottlenecks"] = json::array();
  for (const auto& g : plan.layout.dp_groups) {
    std::vector<int> sorted = g.ranks;
    std::sort(sorted.begin(), sorted.end());
    j["dp_groups"].push_back(sorted);
    j["dp_rings"].push_back(g.ranks);
    j["dp_bottlenecks"].push_back(to_string(bottleneck(g, plan.costs)));
  }
  j["pp_groups"] = json::array();
  j["pp_hops"] = json::array();
  for (const auto& g : plan.layout.pp_groups) {
    j["pp_groups"].push_back(g.ranks);
    j["pp_hops"].push_back(to_string(slowest_hop(g, plan.costs)));
  }
  j["unused_gpus"] = json::array();
  for (size_t n = 0; n < plan.unused_gpus.size(); ++n)
    j["unused_gpus"].push_back({{"node", n}, {"hostname", plan.hostnames[n]}, {"gpus", plan.unused_gpus[n]}});
  j["notes"] = plan.notes;
  const ModelledTimes m = modelled_times(plan, static_cast<double>(plan.request.message_bytes));
  j["modelled"] = {{"tp_allreduce_us", m.tp_allreduce_us},
                   {"dp_allreduce_us", m.dp_allreduce_us},
                   {"naive_tp_allreduce_us", m.naive_tp_allreduce_us},
                   {"naive_dp_allreduce_us", m.naive_dp_allreduce_us},
                   {"message_bytes", plan.request.message_bytes}};
  return j.dump(indent);
}

}  // namespace loom::topo
