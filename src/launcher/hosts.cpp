#include "launcher/hosts.h"

#include <hwloc.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "launcher/launcher_args.h"
#include "loom/topology/topology.h"

namespace loom::launcher {

bool valid_host_name(const std::string& name) {
  if (name.empty() || name.size() > 253) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_')) return false;
  return true;
}

namespace {

int positive(const std::string& text) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < 1 || value > 1000000) return -1;
  return value;
}

// Hosts in order, duplicates found through a set (a scan of the list per host was quadratic).
struct HostList {
  std::vector<Host> hosts;
  std::set<std::string> names;
  void add(Host h, const std::string& where) {
    if (!names.insert(h.name).second)
      throw UsageError(where + "host '" + h.name + "' is listed twice; give it once with all its slots (" + h.name +
                       ":N)");
    if (hosts.size() >= kMaxHosts)
      throw UsageError(where + "more than " + std::to_string(kMaxHosts) +
                       " hosts: exceeds the limit (docs/limits.md)");
    hosts.push_back(std::move(h));
  }
};

}  // namespace

std::vector<Host> parse_host_list(const std::string& text) {
  HostList hosts;
  const std::string list = shown(text);
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t colon = item.find(':');
    Host h{item.substr(0, colon), 1};
    if (!valid_host_name(h.name))
      throw UsageError("-H '" + list + "': '" + shown(item) + "' is not host or host:slots (the host name is " +
                       (h.name.empty() ? "empty" : "not a valid name") + ")");
    if (colon != std::string::npos) {
      h.slots = positive(item.substr(colon + 1));
      if (h.slots < 0)
        throw UsageError("-H '" + list + "': '" + shown(item) +
                         "' is not host or host:slots (slots must be a positive integer, found '" +
                         shown(item.substr(colon + 1)) + "')");
    }
    hosts.add(h, "-H '" + list + "': ");
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return std::move(hosts.hosts);
}

std::vector<Host> parse_hostfile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("--hostfile " + path + ": cannot read it (" + std::strerror(errno) + ")");
  // Read at most the limit and one byte more, whatever the file is (/dev/zero has no end and no
  // newline: getline would grow one line until memory ran out).
  std::string content;
  char chunk[65536];
  while (content.size() <= kMaxHostfileBytes && in.read(chunk, sizeof(chunk)).gcount() > 0)
    content.append(chunk, static_cast<size_t>(in.gcount()));
  if (in.bad()) throw UsageError("--hostfile " + path + ": cannot read it (" + std::strerror(errno) + ")");
  if (content.size() > kMaxHostfileBytes)
    throw UsageError("--hostfile " + path + ": more than " + std::to_string(kMaxHostfileBytes) +
                     " bytes: exceeds the limit (docs/limits.md)");
  HostList hosts;
  std::istringstream lines(content);
  std::string line;
  int number = 0;
  while (std::getline(lines, line)) {
    ++number;
    const std::string where = "--hostfile " + path + ", line " + std::to_string(number) + ": ";
    if (line.size() > kMaxHostfileLine)
      throw UsageError(where + "longer than " + std::to_string(kMaxHostfileLine) +
                       " bytes: exceeds the limit (docs/limits.md)");
    if (size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string name, word;
    if (!(words >> name)) continue;
    if (!valid_host_name(name)) throw UsageError(where + "'" + shown(name) + "' is not a host name");
    Host h{name, 1};
    while (words >> word) {
      size_t eq = word.find('=');
      std::string key = word.substr(0, eq), value = eq == std::string::npos ? "" : word.substr(eq + 1);
      if (key == "slots" || key == "max_slots" || key == "max-slots") {
        int n = positive(value);
        if (n < 0) throw UsageError(where + "'" + shown(word) + "': expected a positive integer");
        if (key == "slots") h.slots = n;
      } else {
        throw UsageError(where + "'" + shown(word) + "': expected slots=N or max_slots=N");
      }
    }
    hosts.add(h, where);
  }
  if (hosts.hosts.empty()) throw UsageError("--hostfile " + path + ": no hosts in it");
  return std::move(hosts.hosts);
}

int local_core_count() {
  int cores = 0;
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) == 0) {
    if (hwloc_topology_load(topo) == 0) cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    hwloc_topology_destroy(topo);
  }
  if (cores <= 0) cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  return cores > 0 ? cores : 1;
}

std::vector<int> local_cpu_ids() {
  std::ifstream online("/sys/devices/system/cpu/online");
  std::string text;
  if (!std::getline(online, text)) return {};
  auto cpus = topo::parse_cpu_list(text);
  if (!cpus) return {};
  std::sort(cpus->begin(), cpus->end());
  return *cpus;
}

}  // namespace loom::launcher
