// The environment variables torchloom reads, declared once, parsed in one place, range-checked.
// docs/environment.md documents the same table (a unit test keeps the two in step).
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace loom::env {

struct Variable {
  const char* name;
  const char* default_value;
  const char* description;
};

// Every variable the library reads.
const std::vector<Variable>& all_variables();

// The raw value, or nullopt when unset or empty. Throws std::logic_error for a name that is not
// in the table (so a new variable cannot be read without being declared and documented).
std::optional<std::string> raw(const char* name);

// Typed readers: the default from the table when unset; a ConfigError naming the variable, its
// value and the accepted range when malformed.
std::chrono::milliseconds seconds_as_duration(const char* name, double min_seconds, double max_seconds);
long long integer(const char* name, long long min_value, long long max_value);
bool flag(const char* name);
std::string choice(const char* name, const std::vector<std::string>& accepted);

}  // namespace loom::env
