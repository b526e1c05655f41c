// The configuration torchloom reads from its LOOM_* environment variables (docs/environment.md).
//
// loom::init() parses every variable once, on every rank, checks it (a malformed value is a
// loom::ConfigError naming the variable, its value and what it accepts) and agrees on the whole
// set across ranks: a variable set on some ranks only (easy with a multi-node mpirun without
// `-x`) is a ConfigError on every rank naming the variable and the ranks, never a deadlock.
//
//   const loom::Config& c = loom::config();
//   if (c.on_error == loom::OnError::Raise) { ... }
//
// Before init() (a program that builds communicators by hand), config() parses the process's
// environment on first use.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "loom/log.h"
#include "loom/world.h"

namespace loom {

using Timeout = std::chrono::milliseconds;

// What a communicator does after an operation times out or fails, once the error is raised.
enum class OnError {
  Abort,  // end the whole job (after LOOM_ABORT_GRACE), so that no rank is left hanging
  Raise,  // break only the communicator: later operations on it raise at once
};

// Whether loom::init() builds the device (NCCL) communicator.
enum class DeviceCommMode { Auto, On, Off };

struct Config {
  log::Level log_level = log::Level::warn;           // LOOM_LOG_LEVEL
  Timeout timeout{600'000};                          // LOOM_TIMEOUT
  OnError on_error = OnError::Abort;                 // LOOM_ON_ERROR
  std::chrono::milliseconds abort_grace{2'000};      // LOOM_ABORT_GRACE
  bool check_collectives = false;                    // LOOM_CHECK_COLLECTIVES
  std::string timeline;                              // LOOM_TIMELINE (empty: off)
  DeviceCommMode nccl = DeviceCommMode::Auto;        // LOOM_NCCL
  std::optional<int> device;                         // LOOM_DEVICE
  double stall_warning = 0.25;                       // LOOM_STALL_WARNING (fraction of the timeout; 0: off)
  int64_t size_check_bytes = 256;                    // LOOM_SIZE_CHECK_BYTES
  int64_t fingerprint_interval = 1024;               // LOOM_FINGERPRINT_INTERVAL (0: off)
  int flight_record = 16;                            // LOOM_FLIGHT_RECORD
  std::string topology;                              // LOOM_TOPOLOGY (empty: detect)
  std::string metrics;                               // LOOM_METRICS (empty: off)
  double metrics_interval = 5;                       // LOOM_METRICS_INTERVAL, seconds
  int tensor_parallel = 1;                           // LOOM_TP
  int pipeline_parallel = 1;                         // LOOM_PP
  int ranks_per_node = 0;                            // LOOM_RANKS_PER_NODE (0: unset)
};

// Parses every LOOM_* variable of `env`; unset ones take their documented defaults. Throws
// loom::ConfigError naming the variable, its value and the accepted values or range.
Config parse_config(const Environment& env);

// The configuration in force: the one loom::init() parsed, or, before init, the process
// environment's (parsed on first use; a malformed value throws).
const Config& config();

namespace detail {
// Installs the configuration init() parsed and agreed on.
void set_config(const Config& config);
}  // namespace detail

}  // namespace loom
