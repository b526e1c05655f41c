#include "launcher/hosts.h"

#include <hwloc.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "launcher/launcher_args.h"

namespace loom::launcher {

namespace {

bool valid_host_name(const std::string& name) {
  if (name.empty() || name.size() > 253) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_')) return false;
  return true;
}

int positive(const std::string& text) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < 1 || value > 1000000) return -1;
  return value;
}

void add_unique(std::vector<Host>& hosts, Host h, const std::string& where) {
  for (const auto& existing : hosts)
    if (existing.name == h.name)
      throw UsageError(where + "host '" + h.name + "' is listed twice; give it once with all its slots (" + h.name +
                       ":N)");
  hosts.push_back(std::move(h));
}

}  // namespace

std::vector<Host> parse_host_list(const std::string& text) {
  std::vector<Host> hosts;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t colon = item.find(':');
    Host h{item.substr(0, colon), 1};
    if (!valid_host_name(h.name))
      throw UsageError("-H '" + text + "': '" + item + "' is not host or host:slots (the host name is " +
                       (h.name.empty() ? "empty" : "not a valid name") + ")");
    if (colon != std::string::npos) {
      h.slots = positive(item.substr(colon + 1));
      if (h.slots < 0)
        throw UsageError("-H '" + text + "': '" + item +
                         "' is not host or host:slots (slots must be a positive integer, found '" +
                         item.substr(colon + 1) + "')");
    }
    add_unique(hosts, h, "-H '" + text + "': ");
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return hosts;
}

std::vector<Host> parse_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("--hostfile " + path + ": cannot read it (" + std::strerror(errno) + ")");
  std::vector<Host> hosts;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const std::string where = "--hostfile " + path + ", line " + std::to_string(number) + ": ";
    if (size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string name, word;
    if (!(words >> name)) continue;
    if (!valid_host_name(name)) throw UsageError(where + "'" + name + "' is not a host name");
    Host h{name, 1};
    while (words >> word) {
      size_t eq = word.find('=');
      std::string key = word.substr(0, eq), value = eq == std::string::npos ? "" : word.substr(eq + 1);
      if (key == "slots" || key == "max_slots" || key == "max-slots") {
        int n = positive(value);
        if (n < 0) throw UsageError(where + "'" + word + "': expected a positive integer");
        if (key == "slots") h.slots = n;
      } else {
        throw UsageError(where + "'" + word + "': expected slots=N or max_slots=N");
      }
    }
    add_unique(hosts, h, where);
  }
  if (hosts.empty()) throw UsageError("--hostfile " + path + ": no hosts in it");
  return hosts;
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

}  // namespace loom::launcher
