#include "runtime/placement.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <dirent.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "loom/error.h"
#include "loom/topology/detect.h"
#include "loom/comm/agreement.h"

namespace loom::detail {

Placement plan_placement(Communicator& world, const World& w, const Config& config) {
  Placement p;
  // Node leaders describe their node; a leader that cannot read the file says so on every rank.
  std::string mine, problem;
  if (w.local_rank == 0) {
    try {
      topo::DetectOptions options;
      options.topology_file = config.topology;
      options.hostname = w.hostname;
      topo::Detection d = topo::detect_host(options);
      mine = d.source + "\n" + topo::to_json(d.topology, 0);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  const std::vector<std::string> described = all_gather_strings(world, problem.empty() ? mine : "!" + problem, {"topology gather"});
  std::vector<topo::Topology> nodes;
  for (const auto& text : described) {
    if (text.empty()) continue;
    if (text[0] == '!') throw ConfigError(ErrorContext("init")("reading the topology (LOOM_TOPOLOGY) failed: " + text.substr(1)));
    const size_t newline = text.find('\n');
    if (p.source.empty()) p.source = text.substr(0, newline);
    nodes.push_back(topo::topology_from_json(text.substr(newline + 1), "topology of a node"));
  }
  // A file describing a whole cluster is read by every leader alike: take it once. Else one node
  // per leader, merged in node order.
  if (!nodes.empty() && nodes.front().nodes.size() > 1) {
    p.topology = nodes.front();
  } else {
    p.topology = topo::merge_nodes(std::move(nodes));
  }
  if (p.topology.gpu_count() == 0) {
    p.skipped = "no GPU described (" + p.source + "; give LOOM_TOPOLOGY to plan for a machine)";
    return p;
  }
  topo::PlanRequest request;
  request.world_size = w.size;
  request.tp_degree = config.tensor_parallel;
  request.pp_degree = config.pipeline_parallel;
  if (config.ranks_per_node > 0)
    request.ranks_per_node = config.ranks_per_node;
  else if (static_cast<int>(p.topology.nodes.size()) == w.num_nodes && w.size == w.num_nodes * w.local_size)
    request.ranks_per_node = w.local_size;  // the ranks MPI put on each node
  // A machine the user described (a topology file, ranks per node) must serve the job; the GPUs
  // found on the machine need not: a job with more ranks than GPUs runs on the CPU.
  const bool described_by_user = !config.topology.empty() || config.ranks_per_node > 0;
  try {
    p.plan = topo::plan(p.topology, request);  // deterministic: the same on every rank
  } catch (const std::exception& e) {
    if (described_by_user) throw ConfigError(ErrorContext("init")(std::string("no placement for this job: ") + e.what()));
    p.skipped = std::string("the GPUs found do not fit the job: ") + e.what();
    return p;
  }
  // The plan numbers ranks node by node. Found on the machines (not read from a file standing in
  // for them), it holds only where every rank runs on the node it gives the rank: ranks placed
  // round-robin (mpirun --map-by node) would drive another node's GPU and form TP groups across nodes.
  if (p.source.rfind("file ", 0) != 0) {
    const topo::RankPlacement& mine = p.plan->layout.ranks[w.rank];
    const bool here = mine.node == w.node_index &&
                      (p.topology.nodes[mine.node].hostname.empty() || w.hostname.empty() ||
                       p.topology.nodes[mine.node].hostname == w.hostname);
    std::vector<int> elsewhere;
    const auto answers = all_gather_strings(world, here ? "" : "x", {"placement check"});
    for (int r = 0; r < w.size; ++r)
      if (!answers[r].empty()) elsewhere.push_back(r);
    if (!elsewhere.empty()) {
      std::string ranks;
      for (int r : elsewhere) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      p.plan.reset();
      p.skipped = "the plan numbers ranks node by node, but rank(s) " + ranks +
                  " run on another node than it gives them (ranks placed round-robin?)";
    }
  }
  return p;
}

std::optional<topo::CpuList> cpu_share_without_plan(const topo::Topology& topology, const World& w) {
  if (w.node_index < 0 || w.node_index >= static_cast<int>(topology.nodes.size())) return std::nullopt;
  topo::CpuList cpus = topo::cpu_only_share(topology.nodes[w.node_index], w.local_rank, w.local_size);
  if (cpus.empty()) return std::nullopt;
  return cpus;
}

std::string bind_to_planned_cpus(const topo::CpuList& cpus) {
  if (cpus.empty()) return "no CPUs planned: not bound";
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return "cannot read this process's CPUs: not bound";
  for (int cpu : cpus)
    if (cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed))
      return "planned CPUs " + topo::format_cpu_list(cpus) +
             " are not all available here (the topology describes another machine, or a launcher bound the rank "
             "already): not bound";
  if (CPU_COUNT(&allowed) == static_cast<int>(cpus.size())) return "already bound to the planned CPUs";
  cpu_set_t planned;
  CPU_ZERO(&planned);
  for (int cpu : cpus) CPU_SET(cpu, &planned);
  // Every thread: MPI's and the library's were started before the plan existed.
  int failures = 0;
  if (DIR* tasks = opendir("/proc/self/task")) {
    while (dirent* entry = readdir(tasks)) {
      if (entry->d_name[0] == '.') continue;
      const pid_t tid = static_cast<pid_t>(std::atoi(entry->d_name));
      if (sched_setaffinity(tid, sizeof(planned), &planned) != 0) ++failures;
    }
    closedir(tasks);
  }
  if (failures > 0) return "binding to CPUs " + topo::format_cpu_list(cpus) + " was refused (" +
                           std::strerror(errno) + "): not bound";
  return "bound to CPUs " + topo::format_cpu_list(cpus);
}

}  // namespace loom::detail
