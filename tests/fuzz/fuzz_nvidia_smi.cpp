// libFuzzer target: `nvidia-smi topo -m` text (scripts/fuzz.sh).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_topology.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto t =
        loom::topo::parse_nvidia_smi_topo(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.txt");
    loom::fuzz::check_accepted(t);
  } catch (const loom::topo::ParseError&) {
  }
  return 0;
}
