// Timeline of what the runtime did, in Chrome trace JSON (open it in Perfetto or chrome://tracing).
//
// Enabled by LOOM_TIMELINE=path: loom::init() checks that `path.rank<r>.json` can be written,
// and each rank writes it when loom::finalize() runs (or trace::flush() is called). Timestamps are wall-clock microseconds, so the files of
// all ranks line up when loaded together. Recording is a mutex-protected append; disabled, each
// call is one branch.
//
//   auto start = loom::trace::now();
//   ...
//   loom::trace::span("bucket 3 all_reduce", "reducer", start, loom::trace::now(), /*lane=*/"comm");
#pragma once

#include <chrono>
#include <string>

namespace loom::trace {

using Clock = std::chrono::steady_clock;
inline Clock::time_point now() { return Clock::now(); }

bool enabled();
// A span [start, end] drawn in the named lane (one row per lane and rank).
void span(const std::string& name, const std::string& category, Clock::time_point start, Clock::time_point end,
          const std::string& lane);
// A point in time.
void instant(const std::string& name, const std::string& category, Clock::time_point at, const std::string& lane);
// Called by loom::init(): starts recording into `path_prefix`.rank<rank>.json (empty: off). The
// rank is the process id in the trace. Throws loom::Error when the file cannot be created.
void configure(const std::string& path_prefix, int rank);
// Writes this rank's file (again, with everything so far). Returns the path, or "" when disabled.
// Throws loom::Error naming the file and the system's reason when writing fails (e.g. disk full).
std::string flush();

}  // namespace loom::trace
