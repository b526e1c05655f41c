#include "launcher/mpirun_command.h"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <set>
#include <string_view>

#include "launcher/slurm.h"

namespace loom::launcher {

namespace {

// Forwarded whenever set: what a rank on another host needs to find its programs, libraries and
// Python packages (mpirun starts remote ranks with the remote login's environment), and the
// variables torchloom, NCCL and OpenMP read. Not CUDA_VISIBLE_DEVICES: it describes the GPUs of
// the host it was set on, so a login node's value must not override each node's own (ranks on
// loomrun's own host inherit it anyway; `-x CUDA_VISIBLE_DEVICES` forwards it on purpose).
bool forwarded(const std::string& name) {
  return name.rfind("NCCL_", 0) == 0 || name.rfind("LOOM_", 0) == 0 || name == "OMP_NUM_THREADS" ||
         name == "PATH" || name == "LD_LIBRARY_PATH" || name == "PYTHONPATH" || name == "VIRTUAL_ENV";
}

// The first of `options` the user passed through --mpi-arg ("--bind-to" or "--bind-to=core"), or "".
std::string user_option(const Options& o, std::initializer_list<std::string_view> options) {
  for (const auto& arg : o.mpi_args)
    for (auto option : options)
      if (arg == option || (arg.size() > option.size() && arg.compare(0, option.size(), option) == 0 &&
                            arg[option.size()] == '='))
        return std::string(option);
  return "";
}

// The topology the plan runs on: one node per host. A single-node description stands for every
// host (clusters are usually uniform); otherwise it must list as many nodes as there are hosts.
topo::Topology topology_for_hosts(const topo::Topology& described, size_t hosts, const std::string& path,
                                  std::vector<std::string>& notes) {
  if (described.nodes.size() == hosts) return described;
  if (described.nodes.size() == 1) {
    topo::Topology t;
    t.costs = described.costs;
    for (size_t i = 0; i < hosts; ++i) t.nodes.push_back(described.nodes[0]);
    notes.push_back("the topology file describes one node; planned as " + std::to_string(hosts) + " identical hosts");
    return t;
  }
  throw UsageError("--topology " + path + " describes " + std::to_string(described.nodes.size()) +
                   " nodes but the job has " + std::to_string(hosts) + " host(s): give one node, or one per host");
}

// The hosts the ranks run on (-H, --hostfile, a Slurm allocation, else this machine), their
// arguments, and the slot checks. Sets `local` when the job runs on this machine alone.
std::vector<Host> place_on_hosts(const Options& o, const LaunchContext& ctx, Launch& launch, bool& local) {
  std::vector<std::string>& a = launch.argv;
  std::vector<Host> hosts = o.hosts;
  // Inside a Slurm allocation, without -H or --hostfile: the allocation's hosts.
  if (hosts.empty())
    if (auto slurm = hosts_from_slurm(ctx.environment)) {
      hosts = std::move(slurm->hosts);
      launch.notes.push_back(slurm->note);
    }
  local = hosts.empty();
  if (local) hosts = {{ctx.local_hostname, ctx.local_slots}};
  if (!o.hostfile.empty()) {
    a.insert(a.end(), {"--hostfile", o.hostfile});
  } else if (!local) {
    std::string list;
    for (const auto& h : hosts) list += (list.empty() ? "" : ",") + h.name + ":" + std::to_string(h.slots);
    a.insert(a.end(), {"-H", list});
  }
  // 64-bit: up to 100000 hosts of up to 10^6 slots each.
  const long long slots =
      std::accumulate(hosts.begin(), hosts.end(), 0LL, [](long long s, const Host& h) { return s + h.slots; });
  const std::string where = local ? "this machine's " + std::to_string(slots) + " cores"
                                  : "the " + std::to_string(slots) + " slots of the hosts";
  if (o.np > slots) {
    if (!o.allow_oversubscribe)
      throw UsageError("-np " + std::to_string(o.np) + " exceeds " + where +
                       " and --no-oversubscribe was given: add hosts or slots, or drop --no-oversubscribe");
    a.push_back("--oversubscribe");
    launch.notes.push_back("-np " + std::to_string(o.np) + " exceeds " + where + ": --oversubscribe");
  }
  // Ranks fill each host's slots in order, so a TP group (consecutive ranks) must fit in one host.
  if (!local && o.tp > 1)
    for (const auto& h : hosts)
      if (h.slots % o.tp != 0)
        throw UsageError("host '" + h.name + "' has " + std::to_string(h.slots) + " slots, not a multiple of --tp " +
                         std::to_string(o.tp) + ": a tensor-parallel group would span two hosts");
  return hosts;
}

// How ranks map to CPUs: a rankfile from --topology's plan where it gives CPU affinity,
// otherwise --map-by slot --bind-to none (unless --mpi-arg gives its own).
void place_on_cpus(const Options& o, const LaunchContext& ctx, const std::vector<Host>& hosts, bool local,
                   Launch& launch) {
  std::vector<std::string>& a = launch.argv;
  // --mpi-arg --bind-to/--map-by replace loomrun's defaults; against a rankfile they contradict it.
  const std::string user_bind = user_option(o, {"--bind-to", "-bind-to"});
  const std::string user_map = user_option(o, {"--map-by", "-map-by"});
  auto default_mapping = [&] {
    if (user_map.empty()) a.insert(a.end(), {"--map-by", "slot"});
    if (user_bind.empty()) a.insert(a.end(), {"--bind-to", "none"});
    if (!user_map.empty())
      launch.notes.push_back("--mpi-arg " + user_map +
                             " replaces loomrun's --map-by slot: consecutive ranks (a TP group) may not share a host");
  };

  if (!o.topology.empty()) {
    topo::Topology described = topo::load_topology_file(o.topology);
    // --plan alone may plan a described (simulated) cluster as it is; a launch plans its hosts.
    const bool as_described = o.plan && local;
    launch.topology = as_described ? described : topology_for_hosts(described, hosts.size(), o.topology, launch.notes);
    if (!as_described)  // node i runs on host i: name it so in the plan and its printout
      for (size_t i = 0; i < hosts.size(); ++i) launch.topology->nodes[i].hostname = hosts[i].name;
    int ranks_per_node = 0;
    if (!local && std::all_of(hosts.begin(), hosts.end(), [&](const Host& h) { return h.slots == hosts[0].slots; }))
      ranks_per_node = std::min(hosts[0].slots, o.np);
    topo::PlanRequest request{o.np, o.tp, ranks_per_node, o.message_bytes};
    request.pp_degree = o.pp;
    launch.plan = topo::plan(*launch.topology, request);
    const auto& ranks = launch.plan->layout.ranks;
    const bool bindable =
        !as_described && std::all_of(ranks.begin(), ranks.end(), [](const auto& r) { return !r.cpus.empty(); });
    if (bindable) {
      const std::string user = !user_bind.empty() ? user_bind : user_map;
      if (!user.empty())
        throw UsageError("--mpi-arg " + user + " contradicts the rankfile loomrun writes from --topology's plan: "
                         "drop one of them");
      // A rankfile naming CPUs the host lacks makes mpirun fail with nothing said: the CPUs of
      // this machine's ranks are checked here (other hosts' are not known before the launch).
      for (const auto& r : ranks) {
        if (ctx.local_cpus.empty() || hosts[r.node].name != ctx.local_hostname) continue;
        for (int cpu : r.cpus)
          if (!std::binary_search(ctx.local_cpus.begin(), ctx.local_cpus.end(), cpu))
            throw UsageError("--topology " + o.topology + " places rank " + std::to_string(r.rank) + " on CPUs " +
                             topo::format_cpu_list(r.cpus).substr(0, 64) + " of host " + ctx.local_hostname +
                             ", which has CPUs " + topo::format_cpu_list(ctx.local_cpus).substr(0, 64) +
                             ": expected a topology file describing this machine (or drop --topology)");
      }
      for (const auto& r : ranks)
        launch.rankfile += "rank " + std::to_string(r.rank) + "=" + hosts[r.node].name +
                           " slot=" + topo::format_cpu_list(r.cpus) + "\n";
      // Physical (OS) CPU numbers, as in the plan and nvidia-smi's CPU Affinity.
      a.insert(a.end(), {"--rankfile", kRankfilePlaceholder, "--mca", "rmaps_rank_file_physical", "1"});
    } else {
      default_mapping();
      if (!as_described) launch.notes.push_back("the topology gives no CPU affinity: ranks are not bound");
    }
    if (ranks_per_node > 0) a.insert(a.end(), {"-x", "LOOM_RANKS_PER_NODE=" + std::to_string(ranks_per_node)});
  } else {
    default_mapping();
  }
}

// The launch environment the ranks need, as -x arguments.
void pass_environment(const Options& o, const LaunchContext& ctx, std::vector<std::string>& a) {
  // Precedence: loomrun's options, then -x NAME=VALUE, then
  // the variables forwarded from loomrun's environment; an -x value against an option's is an error.
  std::map<std::string, std::string> set;
  if (!o.topology.empty()) set["LOOM_TOPOLOGY"] = o.topology;
  if (!o.timeline.empty()) set["LOOM_TIMELINE"] = o.timeline;
  if (!o.timeout.empty()) set["LOOM_TIMEOUT"] = o.timeout;
  if (o.tp_given) set["LOOM_TP"] = std::to_string(o.tp);
  if (o.pp_given) set["LOOM_PP"] = std::to_string(o.pp);
  if (o.max_restarts > 0) {
    set["LOOM_RESTART_COUNT"] = std::to_string(ctx.attempt);
    set["TORCHELASTIC_RESTART_COUNT"] = std::to_string(ctx.attempt);  // what torchrun's programs read
  }
  const std::map<std::string, std::string> from_options = set;
  std::set<std::string> names;  // forwarded by name: mpirun copies the value from its environment
  std::set<std::string> given;
  for (const auto& v : o.variables) {
    if (!given.insert(v.name).second) throw UsageError("-x " + v.name + " is given twice: give it once");
    if (auto option = from_options.find(v.name); option != from_options.end()) {
      if (v.value && *v.value != option->second)
        throw UsageError("-x " + v.name + "=" + *v.value + " contradicts " + v.name + "=" + option->second +
                         ", which loomrun sets from its options: drop one");
      continue;
    }
    if (v.value) {
      set[v.name] = *v.value;
    } else if (ctx.environment.count(v.name)) {
      names.insert(v.name);
    } else {
      throw UsageError("-x " + v.name + ": " + v.name +
                       " is not set in loomrun's environment, so there is nothing to forward; set it, or give -x " +
                       v.name + "=VALUE");
    }
  }
  for (const auto& [name, value] : ctx.environment)
    if (forwarded(name) && name != "LOOM_RANKS_PER_NODE") names.insert(name);
  for (const auto& name : names)
    if (!set.count(name)) a.insert(a.end(), {"-x", name});
  for (const auto& [name, value] : set) a.insert(a.end(), {"-x", name + "=" + value});
}

}  // namespace

Launch build_launch(const Options& o, const LaunchContext& ctx) {
  Launch launch;
  std::vector<std::string>& a = launch.argv;
  a = {o.mpirun, "-np", std::to_string(o.np)};
  if (ctx.is_root) a.push_back("--allow-run-as-root");
  bool local = false;
  const std::vector<Host> hosts = place_on_hosts(o, ctx, launch, local);
  place_on_cpus(o, ctx, hosts, local, launch);
  // Output: one file per rank and stream (Open MPI 4: DIR/attempt_K/1/rank.N/stdout; a restart
  // would truncate the files of the attempt before, so each attempt has its own directory).
  if (!o.output_dir.empty())
    a.insert(a.end(), {"--output-filename", o.output_dir + "/attempt_" + std::to_string(ctx.attempt)});
  if (o.tag_output) a.push_back("--tag-output");
  for (const auto& [key, value] : o.mca) a.insert(a.end(), {"--mca", key, value});
  a.insert(a.end(), o.mpi_args.begin(), o.mpi_args.end());

  pass_environment(o, ctx, a);
  a.insert(a.end(), o.program.begin(), o.program.end());
  return launch;
}

std::string shell_quote(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& arg : argv) {
    if (!out.empty()) out += ' ';
    const bool plain = !arg.empty() && std::all_of(arg.begin(), arg.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) ||
             std::string_view("_@%+=:,./-").find(c) != std::string_view::npos;
    });
    if (plain) {
      out += arg;
      continue;
    }
    out += '\'';
    for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += '\'';
  }
  return out;
}

}  // namespace loom::launcher
