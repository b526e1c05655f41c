// How a process leaves the job, as the runtime's exit path sees it: whether a fatal communication
// error already started ending the job (comm/abort), and the notice a failing rank sends every
// other rank before it goes (comm/departure). Declared here, under detail, for loom::init's exit
// handlers and the Python module's excepthook; programs use loom::announce_departure (runtime.h).
#pragma once

#include <chrono>
#include <string>

namespace loom::detail {

// True once a fatal error started ending the job (its own notice and MPI_Abort are on the way).
bool abort_started();

namespace departures {

// The status a rank reports when std::terminate ended it.
inline constexpr int kUncaughtException = -1;

// The reason this process is about to leave, when something knows it before the exit path runs
// (the std::terminate handler, Python's excepthook). The last one set wins.
void set_exit_reason(std::string reason);
std::string exit_reason();

// Tells every other job rank that this one leaves, and waits until each has taken note (failed its
// communicators), at most until `bound` has passed; ranks that left already are not asked. Never
// throws. Once per process (later calls do nothing); no effect without a side channel (before
// init, after finalize).
void announce(int status, const std::string& reason, std::chrono::milliseconds bound);

}  // namespace departures
}  // namespace loom::detail
