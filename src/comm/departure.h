// Ranks that leave the job: a process that exits after an error (an uncaught exception, a non-zero
// exit status, an error that broke a communicator) tells every other rank why, before it goes; a
// rank told so fails at once every communicator that has the leaver as a member, instead of
// waiting for it until the timeout. The notice travels on the host backend's side channel (the
// one peer_status.h uses), served by the watchdog thread, so a rank busy computing or blocked in
// a collective still takes note of it within one watchdog poll.
//
// The notice also says how far the leaver's operations had ended, per communicator: an operation
// it completed has delivered its part to every other member, so there it completes too (a
// survivor still finishing the reduction of the collective the leaver finished last must not be
// told that collective failed). Only the operations after those fail.
//
//   // in the exit path of a process that failed (runtime.cpp):
//   detail::departures::announce(status, "RuntimeError: boom", std::chrono::seconds(2));
//   // on every other rank, pending and later operations of a communicator with that rank:
//   //   CommError "[rank 0] all_reduce seq=5 group=world ...: rank 1 exited with status 1 (RuntimeError: boom)"
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/peer_status.h"
#include "loom/comm/leaving.h"  // kUncaughtException, set_exit_reason, exit_reason, announce

namespace loom::detail::departures {

using Clock = std::chrono::steady_clock;

// Why a rank left. status: its exit status, or kUncaughtException when std::terminate ended it.
struct Departure {
  int rank = -1;
  int status = 0;
  std::string reason;  // the exception's text when known; may be empty
  // How far its operations had ended, by communicator key; a communicator not listed spares none.
  std::vector<peers::Reached> reached;
};
// Longest reason carried to the other ranks (longer ones are cut).
inline constexpr size_t kMaxReasonBytes = 480;
// Most communicators whose progress a notice carries (a job has a handful: world, device, TP, DP,
// their splits); past it the rest spare nothing, as before progress was sent at all.
inline constexpr size_t kMaxReached = 32;

// "rank 1 exited with status 1 (RuntimeError: boom)", "rank 1 ended by an uncaught exception (...)".
std::string describe(const Departure& departure);



// Another rank's notice, as the side channel received it: remembered, and every watched
// communicator with that rank as a member fails (Watchdog::fail_members_of).
void record(const Departure& departure);
// The first of `job_ranks` known to have left; nullopt when none has (one relaxed load when no
// rank has left).
std::optional<Departure> find(const std::vector<int>& job_ranks);

// The side channel, installed by side_channel::install: sends the notice to `ranks` and
// returns once each has acknowledged it or `deadline` has passed.
using Announcer =
    std::function<void(const std::vector<int>& ranks, const Departure& notice, Clock::time_point deadline)>;
void set_announcer(Announcer announcer, int job_rank, int job_size);
void clear_announcer();

}  // namespace loom::detail::departures
