#include "loom/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <mutex>

#include <cstdlib>
#include "loom/error.h"

namespace loom::log {
namespace {

std::atomic<int> g_level{-1};

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::trace: return spdlog::level::trace;
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::warn;
}

spdlog::logger& logger() {
  // stderr, unbuffered per line, shared by all threads; mpirun forwards it with the rank's output.
  // Never destroyed: threads and destructors that run during process exit may still log.
  static spdlog::logger* instance = [] {
    auto* l = new spdlog::logger("loom", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    l->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank ?] [%l] %v");
    l->set_level(spdlog::level::trace);  // filtering is done by enabled()
    return l;
  }();
  return *instance;
}

int current_level() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    // Before loom::init() has checked the configuration: a malformed LOOM_LOG_LEVEL is reported
    // by init() as a ConfigError; logging itself never throws.
    level = static_cast<int>(Level::warn);
    if (const char* text = std::getenv("LOOM_LOG_LEVEL")) {
      try {
        level = static_cast<int>(parse_level(text, "LOOM_LOG_LEVEL"));
      } catch (const Error&) {
      }
    }
    g_level.store(level, std::memory_order_relaxed);
  }
  return level;
}

}  // namespace

Level parse_level(std::string_view text, std::string_view source) {
  static const char* names[] = {"trace", "debug", "info", "warn", "error", "off"};
  for (int i = 0; i < 6; ++i)
    if (text == names[i]) return static_cast<Level>(i);
  throw ConfigError(ErrorContext("environment variable")(std::string(source) + "='" + std::string(text) +
                                                        "': expected one of trace, debug, info, warn, error, off"));
}

bool enabled(Level level) { return static_cast<int>(level) >= current_level() && level != Level::off; }

void write(Level level, std::string_view message) { logger().log(to_spdlog(level), "{}", message); }

void set_level(Level level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

void set_rank(int rank, int size) {
  logger().set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(rank) + "/" + std::to_string(size) +
                        "] [%l] %v");
}

}  // namespace loom::log
