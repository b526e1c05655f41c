// libFuzzer target: NCCL topology XML (scripts/fuzz.sh).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_topology.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto t =
        loom::topo::parse_nccl_topology_xml(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.xml");
    loom::fuzz::check_accepted(t);
  } catch (const loom::topo::ParseError&) {
  }
  return 0;
}
