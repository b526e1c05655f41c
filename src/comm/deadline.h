// Deadlines that saturate: begin + timeout, or the clock's largest time point when the sum would
// not fit. A timeout converts milliseconds to steady-clock nanoseconds, which overflows beyond
// about 292 years: without saturation, a caller's "wait practically forever" (wait(1e10 s), a
// Python float('inf')) wrapped to a deadline in the past and timed out at once.
#pragma once

#include <chrono>

namespace loom::detail {

template <typename Clock, typename Rep, typename Period>
typename Clock::time_point deadline_after(typename Clock::time_point begin, std::chrono::duration<Rep, Period> timeout) {
  using Point = typename Clock::time_point;
  if (timeout <= std::chrono::duration<Rep, Period>::zero()) return begin;
  // The room left before the clock's end, in the timeout's own unit (rounded down, so a timeout
  // below it converts and adds without overflow).
  const auto room = std::chrono::duration_cast<std::chrono::duration<Rep, Period>>(Point::max() - begin);
  if (timeout >= room) return Point::max();
  return begin + std::chrono::duration_cast<typename Clock::duration>(timeout);
}

}  // namespace loom::detail
