// --drop-dead-hosts: before a restart, which hosts still answer, and the job that fits on them.
// A host answers when mpirun can start a daemon there and run `true` (the same mpirun, MCA
// parameters and rsh agent as the job's, so "answers" means "can take ranks"); a host whose probe
// fails or does not finish within the bound (ssh to a powered-off machine hangs) is left out.
// Internal to the launcher.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "launcher/launcher_args.h"
#include "launcher/mpirun_command.h"

namespace loom::launcher {

// One probe per host, all at once; true where the host answered within `bound`.
std::vector<bool> probe_hosts(const Options& o, const LaunchContext& ctx, const std::vector<Host>& hosts,
                              std::chrono::milliseconds bound);

// The options for the next attempt without the hosts that did not answer: -H the live hosts (a
// --hostfile is replaced by them), -np the ranks they hold (at most the original -np), a multiple
// of --tp. nullopt, with `why`, when no such job is left (no live host, fewer slots than --tp).
std::optional<Options> without_dead_hosts(const Options& o, const std::vector<bool>& alive, std::string& why);

}  // namespace loom::launcher
