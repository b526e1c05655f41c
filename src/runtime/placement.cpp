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

namespace loom::detail {
namespace {

// Every rank's string (empty for most), in rank order: two internal all-gathers.
std::vector<std::string> gather_strings(Communicator& world, const std::string& mine) {
  const int n = world.size();
  InternalOperations internal("topology gather");
  at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lengths = at::empty({n}, at::kLong);
  world.all_gather(lengths, length)->wait();
  int64_t longest = 1;
  for (int r = 0; r < n; ++r) longest = std::max(longest, lengths.data_ptr<int64_t>()[r]);
  at::Tensor text = at::zeros({longest}, at::kByte);
  std::memcpy(text.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({n * longest}, at::kByte);
  world.all_gather(all, text)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest,
                     static_cast<size_t>(lengths.data_ptr<int64_t>()[r]));
  return out;
}

}  // namespace

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
  const std::vector<std::string> described = gather_strings(world, problem.empty() ? mine : "!" + problem);
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
  if (config.ranks_per_node > 0)
    request.ranks_per_node = config.ranks_per_node;
  else if (static_cast<int>(p.topology.nodes.size()) == w.num_nodes && w.size == w.num_nodes * w.local_size)
    request.ranks_per_node = w.local_size;  // the ranks MPI put on each node
  try {
    p.plan = topo::plan(p.topology, request);  // deterministic: the same on every rank
  } catch (const std::exception& e) {
    throw ConfigError(ErrorContext("init")(std::string("no placement for this job: ") + e.what()));
  }
  return p;
}

std::string bind_to_planned_cpus(const topo::RankPlacement& rank) {
  if (rank.cpus.empty()) return "no CPUs planned: not bound";
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return "cannot read this process's CPUs: not bound";
  for (int cpu : rank.cpus)
    if (cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed))
      return "planned CPUs " + topo::format_cpu_list(rank.cpus) +
             " are not all available here (the topology describes another machine, or a launcher bound the rank "
             "already): not bound";
  if (CPU_COUNT(&allowed) == static_cast<int>(rank.cpus.size())) return "already bound to the planned CPUs";
  cpu_set_t planned;
  CPU_ZERO(&planned);
  for (int cpu : rank.cpus) CPU_SET(cpu, &planned);
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
  if (failures > 0) return "binding to CPUs " + topo::format_cpu_list(rank.cpus) + " was refused (" +
                           std::strerror(errno) + "): not bound";
  return "bound to CPUs " + topo::format_cpu_list(rank.cpus);
}

}  // namespace loom::detail
