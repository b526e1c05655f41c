// Wall-clock bounds in tests, scaled to the machine and the moment they run on.
//
// A test that asserts "this took less than N seconds" bets on the machine's speed: N is right on
// the idle development machine and wrong on a slower CPU, with another process on one of the two
// cores, or in a sanitizer build. Every such bound goes through time_bound(N), which multiplies N
// by time_scale():
//   - a calibration measured in this process the first time it is asked: a fixed amount of integer
//     work (no memory traffic), its median time of three runs against the reference machine's
//     (kReferenceSeconds, an idle 2-core AMD EPYC), at least 1 and at most 20;
//   - times 3 in an AddressSanitizer or ThreadSanitizer build (their instrumented code runs several
//     times slower than the calibration loop, which has no memory access to instrument);
//   - or LOOM_TEST_TIME_SCALE, when set, instead of both (a positive number).
// Bounds that keep a failure from waiting for a timeout (an error "within 2 s, not 600") stay
// meaningful: scaled, they are still far below the timeout they guard against.
//
//   EXPECT_LT(elapsed, loom::test::time_bound(1.0)) << "(time scale " << loom::test::time_scale() << ")";
//
// tests/time_scale.py is the same for the Python checks (its own loop, its own reference).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace loom::test {

// The calibration loop's time on the reference machine, idle (median of 3 runs there).
inline constexpr double kReferenceSeconds = 0.056;

// One run of the calibration's fixed work, in seconds.
inline double calibration_run() {
  uint64_t x = 88172645463325252ull;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 30'000'000; ++i) {  // xorshift64: no closed form, nothing for the optimiser to fold
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
  }
  volatile uint64_t sink = x;
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline double time_scale() {
  static const double scale = [] {
    if (const char* forced = std::getenv("LOOM_TEST_TIME_SCALE")) {
      char* end = nullptr;
      const double value = std::strtod(forced, &end);
      if (end != forced && *end == '\0' && value > 0) return value;
    }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    const double build = 3;
#else
    const double build = 1;
#endif
    double runs[3] = {calibration_run(), calibration_run(), calibration_run()};
    std::sort(runs, runs + 3);
    return build * std::clamp(runs[1] / kReferenceSeconds, 1.0, 20.0);
  }();
  return scale;
}

// `seconds` on the reference machine, scaled to this one now.
inline double time_bound(double seconds) { return seconds * time_scale(); }

// For messages: " (time scale 2.3)".
inline std::string time_scale_note() {
  return " (time scale " + std::to_string(time_scale()).substr(0, 4) + ")";
}

}  // namespace loom::test
