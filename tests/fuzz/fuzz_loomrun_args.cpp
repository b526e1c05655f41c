// libFuzzer target: loomrun's command line (scripts/fuzz.sh). The input is split at NUL bytes into
// arguments. A refusal must be a UsageError; an accepted command line must never hand mpirun a
// lone ':' (a second program) or a program starting with '-'.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "launcher/launcher_args.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args(1);
  for (size_t i = 0; i < size && args.size() < 64; ++i) {
    if (data[i] == 0)
      args.emplace_back();
    else
      args.back() += static_cast<char>(data[i]);
  }
  try {
    const auto parsed = loom::launcher::parse_arguments(args, "");
    if (parsed.help) return 0;  // --help stops parsing: nothing is launched
    for (const auto& a : parsed.options.program)
      if (a == ":") std::abort();
    if (!parsed.options.program.empty() && !parsed.options.program[0].empty() && parsed.options.program[0][0] == '-')
      std::abort();
  } catch (const loom::launcher::UsageError&) {
  }
  return 0;
}
