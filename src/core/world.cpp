#include "loom/world.h"

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <optional>
#include <vector>

#include "loom/error.h"

extern char** environ;

namespace loom {
namespace {

// Reads one integer variable; nullopt when absent. Malformed text is a ConfigError.
std::optional<int> read_int(const Environment& env, const std::string& name, const std::string& launcher) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  const std::string& text = it->second;
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || end == text.c_str() || *end != '\0' || errno != 0 || value < 0 || value > INT_MAX)
    throw ConfigError("launch environment (" + launcher + "): " + name + "='" + text +
                      "' is not a non-negative integer");
  return static_cast<int>(value);
}

int require_int(const Environment& env, const std::string& name, const std::string& launcher,
                const std::string& because) {
  auto value = read_int(env, name, launcher);
  if (!value)
    throw ConfigError("launch environment (" + launcher + "): " + because + " is set but " + name + " is missing");
  return *value;
}

void check_index(const std::string& launcher, const std::string& index_name, int index, const std::string& count_name,
                 int count) {
  if (count < 1)
    throw ConfigError("launch environment (" + launcher + "): " + count_name + "=" + std::to_string(count) +
                      ", expected at least 1");
  if (index >= count)
    throw ConfigError("launch environment (" + launcher + "): " + index_name + "=" + std::to_string(index) +
                      " is out of range for " + count_name + "=" + std::to_string(count) + " (expected 0.." +
                      std::to_string(count - 1) + ")");
}

// SLURM_TASKS_PER_NODE looks like "4(x2),2": two nodes with 4 tasks, then one with 2.
std::vector<int> parse_slurm_tasks_per_node(const std::string& text) {
  std::vector<int> per_node;
  size_t pos = 0;
  auto fail = [&]() -> ConfigError {
    return ConfigError("launch environment (slurm): SLURM_TASKS_PER_NODE='" + text.substr(0, 80) +
                       (text.size() > 80 ? "..." : "") + "' is not of the form 4(x2),2");
  };
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    std::string item = text.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end == std::string::npos ? text.size() : end + 1;
    // Ranges checked on the long values before narrowing, and nodes counted before the vector grows:
    // "1(x2000000000)" asked for 8 GB.
    long tasks = 0, repeat = 1;
    char* p = nullptr;
    tasks = std::strtol(item.c_str(), &p, 10);
    if (p == item.c_str() || tasks < 1 || tasks > 1000000) throw fail();
    if (*p == '(') {
      if (p[1] != 'x') throw fail();
      char* q = nullptr;
      repeat = std::strtol(p + 2, &q, 10);
      if (q == p + 2 || *q != ')' || q[1] != '\0' || repeat < 1 || repeat > 100000) throw fail();
    } else if (*p != '\0') {
      throw fail();
    }
    if (per_node.size() + static_cast<size_t>(repeat) > 100000)
      throw ConfigError("launch environment (slurm): SLURM_TASKS_PER_NODE describes more than 100000 nodes: exceeds "
                        "the limit (docs/limits.md)");
    per_node.insert(per_node.end(), static_cast<size_t>(repeat), static_cast<int>(tasks));
  }
  if (per_node.empty()) throw fail();
  return per_node;
}

// The rank and size on this node; a value out of range is an error. With only one of the two the
// pair is unknown (init() takes it from MPI), or an error when the launcher always sets both.
void read_local(const Environment& env, const std::string& launcher, const std::string& rank_name,
                const std::string& size_name, World& w, bool both_or_neither = false) {
  auto local_rank = read_int(env, rank_name, launcher);
  auto local_size = read_int(env, size_name, launcher);
  if (local_rank && local_size) {
    w.local_rank = *local_rank;
    w.local_size = *local_size;
    check_index(launcher, rank_name, w.local_rank, size_name, w.local_size);
  } else if (both_or_neither && (local_rank || local_size)) {
    throw ConfigError("launch environment (" + launcher + "): " + (local_rank ? rank_name : size_name) +
                      " is set but " + (local_rank ? size_name : rank_name) + " is missing");
  } else {
    w.local_known = false;
  }
}

World from_openmpi(const Environment& env) {
  const std::string L = "openmpi";
  World w;
  w.launcher = L;
  w.rank = *read_int(env, "OMPI_COMM_WORLD_RANK", L);
  w.size = require_int(env, "OMPI_COMM_WORLD_SIZE", L, "OMPI_COMM_WORLD_RANK");
  check_index(L, "OMPI_COMM_WORLD_RANK", w.rank, "OMPI_COMM_WORLD_SIZE", w.size);
  read_local(env, L, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", w);
  w.node_known = false;  // Open MPI does not export the node index; init() derives it
  return w;
}

World from_pmix(const Environment& env) {
  const std::string L = "pmix";
  World w;
  w.launcher = L;
  w.rank = *read_int(env, "PMIX_RANK", L);
  auto size = read_int(env, "PMIX_SIZE", L);
  if (!size) size = read_int(env, "PMI_SIZE", L);
  if (size) {
    w.size = *size;
    check_index(L, "PMIX_RANK", w.rank, "PMIX_SIZE", w.size);
  } else {
    w.size_known = false;
  }
  w.local_known = false;
  w.node_known = false;
  return w;
}

World from_pmi(const Environment& env) {
  const std::string L = "pmi";
  World w;
  w.launcher = L;
  w.rank = *read_int(env, "PMI_RANK", L);
  w.size = require_int(env, "PMI_SIZE", L, "PMI_RANK");
  check_index(L, "PMI_RANK", w.rank, "PMI_SIZE", w.size);
  read_local(env, L, "MPI_LOCALRANKID", "MPI_LOCALNRANKS", w);
  w.node_known = false;
  return w;
}

World from_slurm(const Environment& env) {
  const std::string L = "slurm";
  World w;
  w.launcher = L;
  w.rank = *read_int(env, "SLURM_PROCID", L);
  auto ntasks = read_int(env, "SLURM_NTASKS", L);
  if (!ntasks) ntasks = read_int(env, "SLURM_NPROCS", L);
  if (!ntasks) throw ConfigError("launch environment (slurm): SLURM_PROCID is set but SLURM_NTASKS is missing");
  w.size = *ntasks;
  check_index(L, "SLURM_PROCID", w.rank, "SLURM_NTASKS", w.size);
  auto local_id = read_int(env, "SLURM_LOCALID", L);
  auto node_id = read_int(env, "SLURM_NODEID", L);
  auto nnodes = read_int(env, "SLURM_NNODES", L);
  if (node_id && nnodes) {
    w.node_index = *node_id;
    w.num_nodes = *nnodes;
    check_index(L, "SLURM_NODEID", w.node_index, "SLURM_NNODES", w.num_nodes);
  } else {
    w.node_known = false;
  }
  auto tasks_per_node = env.find("SLURM_TASKS_PER_NODE");
  if (local_id && node_id && tasks_per_node != env.end()) {
    std::vector<int> per_node = parse_slurm_tasks_per_node(tasks_per_node->second);
    if (static_cast<int>(per_node.size()) <= *node_id)
      throw ConfigError("launch environment (slurm): SLURM_TASKS_PER_NODE='" + tasks_per_node->second +
                        "' describes " + std::to_string(per_node.size()) + " nodes but SLURM_NODEID=" +
                        std::to_string(*node_id));
    w.local_rank = *local_id;
    w.local_size = per_node[*node_id];
    check_index(L, "SLURM_LOCALID", w.local_rank, "tasks on this node (SLURM_TASKS_PER_NODE)", w.local_size);
  } else {
    w.local_known = false;
  }
  return w;
}

World from_torchrun(const Environment& env) {
  const std::string L = "torchrun";
  World w;
  w.launcher = L;
  w.rank = *read_int(env, "RANK", L);
  w.size = require_int(env, "WORLD_SIZE", L, "RANK");
  check_index(L, "RANK", w.rank, "WORLD_SIZE", w.size);
  read_local(env, L, "LOCAL_RANK", "LOCAL_WORLD_SIZE", w, /*both_or_neither=*/true);
  // A Kubeflow PyTorchJob pod with nprocPerNode above 1 started the program itself instead of
  // through torchrun: WORLD_SIZE counts the processes torchrun would have started in every pod,
  // RANK is the pod's index, and the rendezvous would wait for ranks nobody starts.
  const auto nproc = env.find("PET_NPROC_PER_NODE");
  if (!w.local_known && nproc != env.end() && nproc->second.find_first_not_of("0123456789") == std::string::npos &&
      nproc->second.size() < 10 && !nproc->second.empty() && std::stoi(nproc->second) > 1)
    throw ConfigError("launch environment (torchrun): this is a PyTorchJob pod with PET_NPROC_PER_NODE=" +
                      nproc->second + " (WORLD_SIZE=" + std::to_string(w.size) + " counts " + nproc->second +
                      " processes per pod) but no LOCAL_RANK: the program was started directly, not by torchrun. "
                      "Start it as `torchrun --no-python PROGRAM ARGS` (torchrun reads the PET_ variables), or set "
                      "nprocPerNode to 1 to run one process per pod");
  if (w.local_known && w.size % w.local_size == 0) w.num_nodes = w.size / w.local_size;
  auto group_rank = read_int(env, "GROUP_RANK", L);
  if (group_rank && w.local_known) {
    w.node_index = *group_rank;
    if (w.node_index >= w.num_nodes)
      throw ConfigError("launch environment (torchrun): GROUP_RANK=" + std::to_string(w.node_index) +
                        " is out of range for WORLD_SIZE/LOCAL_WORLD_SIZE=" + std::to_string(w.num_nodes) + " nodes");
  } else {
    w.node_known = false;
  }
  return w;
}

}  // namespace

World world_from_environment(const Environment& env, const std::string& hostname) {
  World w;
  if (env.count("OMPI_COMM_WORLD_RANK")) {
    w = from_openmpi(env);
  } else if (env.count("PMIX_RANK")) {
    w = from_pmix(env);
  } else if (env.count("PMI_RANK")) {
    w = from_pmi(env);
  } else if (env.count("SLURM_PROCID") && (env.count("SLURM_STEP_ID") || env.count("SLURM_STEPID"))) {
    // SLURM_PROCID alone is also set in a batch script's shell; only a job step (srun) starts ranks.
    w = from_slurm(env);
  } else if (env.count("RANK") || env.count("WORLD_SIZE")) {
    if (!env.count("RANK")) throw ConfigError("launch environment (torchrun): WORLD_SIZE is set but RANK is missing");
    w = from_torchrun(env);
  }
  w.hostname = hostname;
  if (w.local_known && w.local_size > w.size)
    throw ConfigError("launch environment (" + w.launcher + "): " + std::to_string(w.local_size) +
                      " processes on this node but only " + std::to_string(w.size) + " in the job");
  return w;
}

Environment current_environment() {
  Environment env;
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

std::string current_hostname() {
  char buffer[256] = {0};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "unknown";
  return buffer;
}

}  // namespace loom
