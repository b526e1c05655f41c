// The hosts of a Slurm allocation, for loomrun started inside salloc/sbatch without -H or
// --hostfile: SLURM_JOB_NODELIST (compressed, "node[01-03,07],gpu5") and the slots per node from
// SLURM_TASKS_PER_NODE, else SLURM_JOB_CPUS_PER_NODE ("4(x3),2"), the variables Open MPI's own
// Slurm support reads. Bounded like the other host inputs (docs/limits.md). Internal to the launcher.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "launcher/hosts.h"

namespace loom::launcher {

inline constexpr size_t kMaxSlurmVariableBytes = 1024 * 1024;

// "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5. Several bracket groups in one name
// expand as their product ("r[1-2]n[1-2]": r1n1 r1n2 r2n1 r2n2); a range keeps the width of its
// first bound ("[08-10]": 08 09 10). Throws UsageError naming `variable`, the bad part and the
// limit: at most kMaxHosts names, counted before any is built.
std::vector<std::string> expand_slurm_nodelist(const std::string& text, const std::string& variable);

// "4(x3),2" -> 4 4 4 2. Throws UsageError naming `variable`.
std::vector<int> expand_slurm_counts(const std::string& text, const std::string& variable);

struct SlurmHosts {
  std::vector<Host> hosts;
  std::string note;  // where they came from, for --dry-run and --plan
};

// The allocation's hosts, or nothing when `environment` has no SLURM_JOB_NODELIST (nor the older
// SLURM_NODELIST). A node list without per-node counts, or counts for another number of nodes,
// is a UsageError.
std::optional<SlurmHosts> hosts_from_slurm(const std::map<std::string, std::string>& environment);

}  // namespace loom::launcher
