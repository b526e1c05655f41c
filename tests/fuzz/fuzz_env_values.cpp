// libFuzzer target: LOOM_* values (scripts/fuzz.sh). The first byte picks a variable of the
// table, the rest is its value. Every typed reader either returns a value within its range or
// throws ConfigError.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "loom/env.h"
#include "loom/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& table = loom::env::all_variables();
  const char* name = table[data[0] % table.size()].name;
  const loom::Environment env{{name, std::string(reinterpret_cast<const char*>(data) + 1, size - 1)}};
  try {
    const auto ms = loom::env::seconds(env, name, 0.001, 86400);
    if (ms.count() < 1 || ms.count() > 86400000) std::abort();
  } catch (const loom::ConfigError&) {
  }
  try {
    const long long v = loom::env::integer(env, name, -5, 1LL << 40);
    if (v < -5 || v > (1LL << 40)) std::abort();
  } catch (const loom::ConfigError&) {
  }
  try {
    const double v = loom::env::real(env, name, 0, 1);
    if (!(v >= 0 && v <= 1)) std::abort();
  } catch (const loom::ConfigError&) {
  }
  try {
    loom::env::choice(env, name, {"auto", "on", "off"});
  } catch (const loom::ConfigError&) {
  }
  return 0;
}
