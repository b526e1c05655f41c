// libFuzzer target: -H host lists and hostfiles (scripts/fuzz.sh). The input is tried as both; a
// refusal must be a UsageError, an accepted list must hold valid, unique hosts with 1..10^6 slots.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "launcher/hosts.h"
#include "launcher/launcher_args.h"

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
  static const std::string path = "/tmp/loom_fuzz_hostfile." + std::to_string(getpid());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  try {
    check(loom::launcher::parse_hostfile(path));
  } catch (const loom::launcher::UsageError&) {
  }
  return 0;
}
