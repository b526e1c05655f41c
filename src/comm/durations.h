// Durations as every message prints them: "600.1" for long ones, "0.010" for the short ones that
// tests and explicit waits use.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace loom::detail {

inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), seconds < 1.0 ? "%.3f" : "%.1f", seconds);
  return text;
}

template <typename Rep, typename Period>
std::string seconds_text(std::chrono::duration<Rep, Period> d) {
  return seconds_text(std::chrono::duration<double>(d).count());
}

}  // namespace loom::detail
