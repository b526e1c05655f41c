// Where ranks may run: -H host lists, Open MPI hostfiles, and this machine's core count (mpirun's
// default number of slots). Internal to the launcher.
#pragma once

#include <string>
#include <vector>

namespace loom::launcher {

struct Host {
  std::string name;
  int slots = 1;
};

// Limits on what describes the hosts (docs/limits.md): a list or file longer, or with more hosts,
// is refused with a UsageError naming the limit.
inline constexpr size_t kMaxHosts = 100000;
inline constexpr size_t kMaxHostfileBytes = 16u * 1024 * 1024;
inline constexpr size_t kMaxHostfileLine = 4096;

// Letters, digits, '-', '.', '_'; 1 to 253 bytes.
bool valid_host_name(const std::string& name);

// "a:4,b:4" or "a,b" (1 slot each). Throws UsageError naming the bad entry.
std::vector<Host> parse_host_list(const std::string& text);

// Open MPI hostfile: "name [slots=N] [max_slots=M]" per line, '#' comments; a host without
// slots= counts as 1 slot here (write slots=N: mpirun itself would count cores). Throws
// UsageError naming file and line.
std::vector<Host> parse_hostfile(const std::string& path);

// Physical cores of this machine (what mpirun counts as slots when no host is given); hwloc, with
// the online CPU count as a fallback.
int local_core_count();
// This machine's online CPU ids, sorted (/sys/devices/system/cpu/online); empty when unknown.
std::vector<int> local_cpu_ids();

}  // namespace loom::launcher
