// From checked options to the mpirun command line (an argv, never a shell string) and, when the
// machine's topology is known, the placement plan and the Open MPI rankfile that binds each rank to
// the CPUs nearest its GPU. Pure functions of their inputs, so the unit tests check exact argv.
// Internal to the launcher.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "launcher/launcher_args.h"
#include "loom/topology/placement.h"

namespace loom::launcher {

// What the command depends on besides the options.
struct LaunchContext {
  bool is_root = false;                            // mpirun refuses root without --allow-run-as-root
  int local_slots = 1;                             // this machine's cores, when no host is given
  std::string local_hostname;                      // the rankfile names hosts; for a local job, this one
  std::map<std::string, std::string> environment;  // loomrun's: forwarded with -x, Slurm's allocation
  int attempt = 0;                                 // 0, then 1, 2... for each --max-restarts restart
  std::vector<int> local_cpus;                     // this machine's online CPUs (empty: unknown, unchecked)
};

struct Launch {
  std::vector<std::string> argv;           // argv[0] is the mpirun to execute
  std::optional<topo::Topology> topology;  // as planned (one node per host)
  std::optional<topo::Plan> plan;
  std::string rankfile;            // its text, when ranks are bound from the plan ("" otherwise)
  std::vector<std::string> notes;  // decisions worth telling the user (printed by --dry-run)
};

// The placeholder argv carries for the rankfile's path until loomrun has written it.
inline constexpr const char* kRankfilePlaceholder = "<rankfile>";

// Throws UsageError for arguments that cannot make a job (too few slots with --no-oversubscribe, a
// TP group that would span hosts, a topology that does not fit the hosts, -x NAME of a variable
// that is not set, -x NAME=VALUE against an option's value), and topo::ParseError /
// topo::PlanError from reading the topology and planning.
Launch build_launch(const Options& options, const LaunchContext& context);

// For display only: the argv as one line a POSIX shell would split back into the same words.
std::string shell_quote(const std::vector<std::string>& argv);

}  // namespace loom::launcher
