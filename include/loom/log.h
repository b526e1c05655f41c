// Logging facade. Every line is tagged with the rank and world size, e.g.
//   [2026-12-02 12:00:00.123] [rank 1/4] [info] communicator world ready
// The level comes from LOOM_LOG_LEVEL (trace, debug, info, warn, error, off; default warn).
// The backend (spdlog) stays inside the library; this header has no dependency.
//
//   LOOM_LOG(info, "bucket " << index << " ready, " << bytes << " bytes");
#pragma once

#include <sstream>
#include <string>
#include <string_view>

namespace loom::log {

enum class Level { trace = 0, debug, info, warn, error, off };

bool enabled(Level level);
void write(Level level, std::string_view message);
void set_level(Level level);
// Parses "trace".."off"; throws loom::ConfigError naming the variable and the accepted values.
Level parse_level(std::string_view text, std::string_view source);
// Called once the rank is known; lines logged before carry "rank ?".
void set_rank(int rank, int size);

}  // namespace loom::log

#define LOOM_LOG(level, stream_expr)                                     \
  do {                                                                   \
    if (::loom::log::enabled(::loom::log::Level::level)) {               \
      std::ostringstream loom_log_stream_;                               \
      loom_log_stream_ << stream_expr;                                   \
      ::loom::log::write(::loom::log::Level::level, loom_log_stream_.str()); \
    }                                                                    \
  } while (false)
