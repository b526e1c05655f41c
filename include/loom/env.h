// The environment variables torchloom reads, declared once, parsed in one place, range-checked.
// docs/environment.md documents the same table: a unit test checks that every row there has
// this table's name, default and description, word for word.
//
//   for (const auto& v : loom::env::all_variables()) std::cout << v.name << " = " << v.default_value << "\n";
//   auto timeout = loom::env::seconds(loom::current_environment(), "LOOM_TIMEOUT", 0.001, 1e9);
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/world.h"

namespace loom::env {

struct Variable {
  const char* name;
  const char* default_value;  // "" when the default is "unset"
  const char* description;
  // Set for each process on its own (a device index): exempt from the agreement that every rank
  // sees the same value.
  bool per_process = false;
};

// Every variable the library reads.
const std::vector<Variable>& all_variables();

// The value in `env`, or nullopt when unset or empty. Throws std::logic_error for a name that is
// not in the table (so a new variable cannot be read without being declared and documented).
std::optional<std::string> raw(const Environment& env, const char* name);

// LOOM_ names set in `env` that torchloom does not read, each with the closest variable it does
// read when one is within two edits ("LOOM_TIMEOUTS" -> "LOOM_TIMEOUT"), else "". A misspelt
// variable is otherwise silently ignored. Not counted: names torchloom's own tools set or read
// outside the library (LOOM_MPIRUN_FLAGS, LOOM_RESTART_COUNT, LOOM_FUZZ_SEED, LOOM_TEST_*).
std::vector<std::pair<std::string, std::string>> unknown_variables(const Environment& env);

// Typed readers: the default from the table when unset; a ConfigError naming the variable, its
// value and the accepted range when malformed.
std::chrono::milliseconds seconds(const Environment& env, const char* name, double min_seconds, double max_seconds);
long long integer(const Environment& env, const char* name, long long min_value, long long max_value);
double real(const Environment& env, const char* name, double min_value, double max_value);
bool flag(const Environment& env, const char* name);
std::string choice(const Environment& env, const char* name, const std::vector<std::string>& accepted);

}  // namespace loom::env
