#include "loom/config.h"

#include <mutex>

#include "loom/env.h"
#include "loom/error.h"

namespace loom {
namespace {

std::mutex g_mutex;
// Never destroyed: the watchdog and exit handlers read it while static destructors run.
Config* g_config = nullptr;

}  // namespace

Config parse_config(const Environment& e) {
  Config c;
  c.log_level = log::parse_level(env::choice(e, "LOOM_LOG_LEVEL", {"trace", "debug", "info", "warn", "error", "off"}),
                                 "LOOM_LOG_LEVEL");
  c.timeout = env::seconds(e, "LOOM_TIMEOUT", 0.001, 86400);
  c.on_error = env::choice(e, "LOOM_ON_ERROR", {"abort", "raise"}) == "abort" ? OnError::Abort : OnError::Raise;
  c.abort_grace = env::seconds(e, "LOOM_ABORT_GRACE", 0, 600);
  c.check_collectives = env::flag(e, "LOOM_CHECK_COLLECTIVES");
  c.size_check_bytes = env::integer(e, "LOOM_SIZE_CHECK_BYTES", 0, 1LL << 40);
  c.fingerprint_interval = env::integer(e, "LOOM_FINGERPRINT_INTERVAL", 0, 1LL << 31);
  c.stall_warning = env::real(e, "LOOM_STALL_WARNING", 0, 1);
  c.flight_record = static_cast<int>(env::integer(e, "LOOM_FLIGHT_RECORD", 1, 4096));
  c.timeline = env::raw(e, "LOOM_TIMELINE").value_or("");
  const std::string nccl = env::choice(e, "LOOM_NCCL", {"auto", "on", "off"});
  c.nccl = nccl == "auto" ? DeviceCommMode::Auto : nccl == "on" ? DeviceCommMode::On : DeviceCommMode::Off;
  if (env::raw(e, "LOOM_DEVICE")) c.device = static_cast<int>(env::integer(e, "LOOM_DEVICE", 0, 1023));
  c.topology = env::raw(e, "LOOM_TOPOLOGY").value_or("");
  c.metrics = env::raw(e, "LOOM_METRICS").value_or("");
  c.metrics_interval = env::real(e, "LOOM_METRICS_INTERVAL", 0, 3600);
  c.tensor_parallel = static_cast<int>(env::integer(e, "LOOM_TP", 1, 4096));
  c.pipeline_parallel = static_cast<int>(env::integer(e, "LOOM_PP", 1, 4096));
  if (env::raw(e, "LOOM_RANKS_PER_NODE")) c.ranks_per_node = static_cast<int>(env::integer(e, "LOOM_RANKS_PER_NODE", 1, 4096));
  return c;
}

const Config& config() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_config == nullptr) g_config = new Config(parse_config(current_environment()));
  return *g_config;
}

namespace detail {
void set_config(const Config& config) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_config == nullptr) g_config = new Config(config);
  else *g_config = config;
  log::set_level(config.log_level);
}
}  // namespace detail

}  // namespace loom
