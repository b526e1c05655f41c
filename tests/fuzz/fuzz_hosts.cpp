// libFuzzer target: -H host lists, hostfiles and Slurm node lists (scripts/fuzz.sh). The input is
// tried as each (and as Slurm's per-node counts); a refusal must be a UsageError, an accepted list
// must hold valid, unique hosts with 1..10^6 slots, a node list at most kMaxHosts valid names.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "launcher/hosts.h"
#include "launcher/launcher_args.h"
#include "launcher/slurm.h"

namespace {

void check(const std::vector<loom::launcher::Host>& hosts) {
  std::set<std::string> names;
  for (const auto& h : hosts)
    if (h.name.empty() || h.slots < 1 || h.slots > 1000000 || !names.insert(h.name).second) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    check(loom::launcher::parse_host_list(text));
  } catch (const loom::launcher::UsageError&) {
  }
  try {
    const auto names = loom::launcher::expand_slurm_nodelist(text, "SLURM_JOB_NODELIST");
    if (names.empty() || names.size() > loom::launcher::kMaxHosts) std::abort();
    for (const auto& n : names)
      if (!loom::launcher::valid_host_name(n)) std::abort();
  } catch (const loom::launcher::UsageError&) {
  }
  try {
    const auto counts = loom::launcher::expand_slurm_counts(text, "SLURM_TASKS_PER_NODE");
    if (counts.empty() || counts.size() > loom::launcher::kMaxHosts) std::abort();
    for (int c : counts)
      if (c < 1 || c > 1000000) std::abort();
  } catch (const loom::launcher::UsageError&) {
  }
  static const std::string path = "/tmp/loom_fuzz_hostfile." + std::to_string(getpid());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  try {
    check(loom::launcher::parse_hostfile(path));
  } catch (const loom::launcher::UsageError&) {
  }
  return 0;
}
