#include "core/env.h"

#include <cstdlib>
#include <stdexcept>

#include "loom/error.h"

namespace loom::env {

const std::vector<Variable>& all_variables() {
  static const std::vector<Variable> table = {
      {"LOOM_LOG_LEVEL", "warn", "Log level: trace, debug, info, warn, error or off."},
      {"LOOM_TIMEOUT", "600", "Default timeout of every communication operation, in seconds (0.001 to 86400)."},
      {"LOOM_ON_ERROR", "abort",
       "What a timed-out or failed collective does after raising its error: `abort` ends the whole job "
       "(MPI_Abort / ncclCommAbort) so no rank hangs; `raise` only marks the communicator broken."},
      {"LOOM_ABORT_GRACE", "2",
       "Seconds between reporting a fatal communication error and aborting the job (0 to 600), so the "
       "waiting thread can raise and log it first."},
      {"LOOM_CHECK_COLLECTIVES", "0",
       "1: before every collective, ranks exchange a fingerprint (operation, sequence number, dtype, "
       "element count, root) and raise loom::MismatchError showing both sides when they differ. Costs "
       "one small all-gather per collective; for debugging."},
      {"LOOM_TIMELINE", "",
       "Path prefix of a Chrome-trace timeline (bucket ready / issued / completed); each rank writes "
       "<path>.rank<r>.json at loom::finalize(). Unset: no timeline."},
      {"LOOM_NCCL", "auto",
       "The device communicator loom::init() builds (NCCL over all ranks, device = local rank): auto (when a "
       "GPU is visible), on (required), off."},
  };
  return table;
}

static const Variable& lookup(const char* name) {
  for (const auto& v : all_variables())
    if (std::string(v.name) == name) return v;
  throw std::logic_error(std::string("torchloom reads undeclared environment variable ") + name);
}

std::optional<std::string> raw(const char* name) {
  lookup(name);
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

static std::string value_or_default(const char* name) {
  auto value = raw(name);
  return value ? *value : lookup(name).default_value;
}

std::chrono::milliseconds seconds_as_duration(const char* name, double min_seconds, double max_seconds) {
  std::string text = value_or_default(name);
  char* end = nullptr;
  double seconds = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(seconds >= min_seconds && seconds <= max_seconds))
    throw ConfigError(std::string("environment variable ") + name + "='" + text + "': expected seconds between " +
                      std::to_string(min_seconds) + " and " + std::to_string(max_seconds));
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
}

long long integer(const char* name, long long min_value, long long max_value) {
  std::string text = value_or_default(name);
  char* end = nullptr;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || value < min_value || value > max_value)
    throw ConfigError(std::string("environment variable ") + name + "='" + text + "': expected an integer in [" +
                      std::to_string(min_value) + ", " + std::to_string(max_value) + "]");
  return value;
}

bool flag(const char* name) { return choice(name, {"0", "1"}) == "1"; }

std::string choice(const char* name, const std::vector<std::string>& accepted) {
  std::string text = value_or_default(name);
  for (const auto& a : accepted)
    if (a == text) return text;
  std::string list;
  for (const auto& a : accepted) list += (list.empty() ? "" : ", ") + a;
  throw ConfigError(std::string("environment variable ") + name + "='" + text + "': expected one of " + list);
}

}  // namespace loom::env
