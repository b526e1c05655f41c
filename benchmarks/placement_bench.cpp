// What does topology-aware placement buy, and what does planning cost? For every real machine in
// tests/fixtures/topology/ and for simulated clusters of 1, 4, 64 and 1,024 eight-GPU nodes (a DGX-1
// cube-mesh and a dual-socket PCIe box), at TP 2, 4 and 8:
//   - the modelled all-reduce time of the slowest TP group and the slowest DP ring, planned against
//     the naive layout (rank r on the r-th GPU, consecutive TP blocks), and the ratio naive/planned;
//   - the planner's own run time (median of --repeat runs).
// The model is placement.h's: 2(n-1) x slowest link latency + 2(n-1)/n x bytes / bottleneck
// bandwidth, with the default link table (docs/topology.md). Modelled, not measured: no GPU here.
//
//   build/benchmarks/placement_bench --json placement.json [--bytes 67108864] [--repeat 5] [--quick]
#include <dirent.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/topology/placement.h"

namespace {

using Clock = std::chrono::steady_clock;
using loom::topo::Topology;

struct Case {
  std::string name;
  Topology topology;
};

std::vector<std::string> fixture_names(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      const bool text = n.size() > 4 && n.compare(n.size() - 4, 4, ".txt") == 0;
      const bool xml = n.size() > 4 && n.compare(n.size() - 4, 4, ".xml") == 0;
      if ((text && n.find("_p2p") == std::string::npos && n.find("MANGLED") == std::string::npos) || xml)
        names.push_back(n);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

Topology replicate(const Topology& one, int nodes) {
  Topology t;
  t.costs = one.costs;
  for (int i = 0; i < nodes; ++i) {
    t.nodes.push_back(one.nodes[0]);
    t.nodes.back().hostname = "node" + std::to_string(i);
  }
  return t;
}

std::string ratio(double naive, double planned) {
  if (planned <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", naive / planned);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"placement_bench: modelled planned vs naive all-reduce times, and planner run time"};
  std::string json_path, fixtures = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/topology";
  double bytes = 64.0 * (1 << 20);
  int repeat = 5;
  bool quick = false;
  app.add_option("--json", json_path, "write the results here");
  app.add_option("--fixtures", fixtures, "directory of topology fixtures");
  app.add_option("--bytes", bytes, "all-reduce message size (default 64 MiB)");
  app.add_option("--repeat", repeat, "planner runs per case (median reported)");
  app.add_flag("--quick", quick, "one planner run per case (CI smoke test)");
  CLI11_PARSE(app, argc, argv);
  if (quick) repeat = 1;

  std::vector<Case> cases;
  for (const auto& name : fixture_names(fixtures)) {
    try {
      cases.push_back({name, loom::topo::load_topology_file(fixtures + "/" + name)});
    } catch (const std::exception& e) {
      std::fprintf(stderr, "placement_bench: %s\n", e.what());
      return 1;
    }
  }
  if (cases.empty()) {
    std::fprintf(stderr, "placement_bench: no fixtures in %s\n", fixtures.c_str());
    return 1;
  }
  for (const char* kind : {"dgx1_v100_1nic_oneflow.txt", "rtx4090_8gpu_pcie_2socket_bondnic.txt"}) {
    const Topology one = loom::topo::load_topology_file(fixtures + "/" + kind);
    const std::string label = std::string(kind).substr(0, std::string(kind).find('_', 5));
    for (int nodes : {1, 4, 64, 1024})
      cases.push_back({"sim " + std::to_string(nodes) + "x8 " + label, replicate(one, nodes)});
  }

  nlohmann::json rows = nlohmann::json::array();
  std::printf("%-48s %5s %4s %3s %6s | %10s %10s %6s | %10s %10s %6s | %10s\n", "topology", "nodes", "gpus", "tp",
              "ranks", "tp_us", "naive_tp", "ratio", "dp_us", "naive_dp", "ratio", "plan_ms");
  for (const auto& c : cases) {
    const int per_node = static_cast<int>(c.topology.nodes[0].gpus.size());
    for (int tp : {2, 4, 8}) {
      if (tp > per_node) continue;
      const int world = static_cast<int>(c.topology.nodes.size()) * (per_node / tp * tp);
      std::vector<double> seconds;
      loom::topo::Plan plan;
      for (int r = 0; r < repeat; ++r) {
        const auto start = Clock::now();
        plan = loom::topo::plan(c.topology, {world, tp, 0, static_cast<std::uint64_t>(bytes)});
        seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      }
      const double plan_ms = loom::bench::median(seconds) * 1e3;
      const auto m = loom::topo::modelled_times(plan, bytes);
      std::printf("%-48s %5zu %4d %3d %6d | %10.1f %10.1f %6s | %10.1f %10.1f %6s | %10.3f\n", c.name.c_str(),
                  c.topology.nodes.size(), per_node, tp, world, m.tp_allreduce_us, m.naive_tp_allreduce_us,
                  ratio(m.naive_tp_allreduce_us, m.tp_allreduce_us).c_str(), m.dp_allreduce_us, m.naive_dp_allreduce_us,
                  ratio(m.naive_dp_allreduce_us, m.dp_allreduce_us).c_str(), plan_ms);
      rows.push_back({{"topology", c.name},
                      {"nodes", c.topology.nodes.size()},
                      {"gpus_per_node", per_node},
                      {"tp", tp},
                      {"world_size", world},
                      {"tp_allreduce_us", m.tp_allreduce_us},
                      {"naive_tp_allreduce_us", m.naive_tp_allreduce_us},
                      {"dp_allreduce_us", m.dp_allreduce_us},
                      {"naive_dp_allreduce_us", m.naive_dp_allreduce_us},
                      {"planner_ms", plan_ms},
                      {"planner_runs", repeat}});
    }
  }
  std::printf("message %.0f bytes; ratio = naive / planned (modelled); plan_ms = median planner run time\n", bytes);
  if (!json_path.empty()) {
    nlohmann::json doc = {{"benchmark", "placement"}, {"message_bytes", bytes}, {"results", rows}};
    if (!loom::bench::write_json(json_path, doc, "placement_bench")) return 1;
  }
  return 0;
}
