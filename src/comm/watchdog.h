// The watchdog: one thread per process that enforces every operation's timeout, whether or not
// anyone waits on it. The comm core registers each operation at submission; its deadline runs
// from when it starts (an operation queued behind a slow one is not charged for the wait). On
// expiry the watchdog hands the operation back to its communicator (which reports and applies
// the error policy); at fractions of the timeout (LOOM_STALL_WARNING) it asks for a warning; and
// 0.5 s after the start, then at 1, 2, 4, ... s, it has the communicator ask the other members what
// they called at that sequence number, so that ranks whose code paths diverged (one in all_reduce,
// another in barrier) fail at once with the mismatch instead of waiting for the timeout.
// The watchdog only detects; ending the job is the job aborter's (abort.h), on its own thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/peer_status.h"
#include "loom/comm/work.h"

namespace loom {
class Communicator;
}

namespace loom::detail {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;

  static Watchdog& instance();

  // Watches every operation of `comm` (its unfinished works, read at each poll) while it lives:
  // Communicator::on_timeout once an operation's timeout has passed since it started,
  // Communicator::on_stall at each stall-warning fraction. Called once per communicator, so
  // submitting an operation costs the watchdog nothing.
  void watch(std::weak_ptr<Communicator> comm);
  // Runs check() every poll interval until it returns false (the status channel's server,
  // device communicators' asynchronous-error polls).
  void add_periodic(std::function<bool()> check);
  // Fails at once every watched communicator that has `job_rank` as a member and is not broken
  // yet, with `message`: that rank has left the job (departure.h). The operations it had completed
  // by `reached` (its notice's) are left to complete first (Communicator::fail_departed).
  void fail_members_of(int job_rank, const std::string& message, const std::vector<peers::Reached>& reached);

  std::chrono::milliseconds poll_interval() const { return poll_interval_; }
  bool on_watchdog_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  using WorkKey = std::pair<const Work*, uint64_t>;
  // What an unfinished work is due for at this poll.
  struct Due {
    std::weak_ptr<Communicator> comm;
    std::shared_ptr<Work> work;
    double elapsed;
    enum { kExpired, kStalled, kEarlyCheck } what;
  };

  Watchdog();
  void run();
  // The works whose timeout passed, or that are due a stall warning or an early mismatch check
  // (watchdog thread; updates warnings_ and early_checks_).
  std::vector<Due> due_now(const std::vector<std::weak_ptr<Communicator>>& comms, double stall_fraction);
  // Runs each periodic check once; the indices of those that asked not to run again.
  static std::vector<size_t> run_periodic(const std::vector<std::function<bool()>>& periodic);

  std::chrono::milliseconds poll_interval_{50};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::weak_ptr<Communicator>> watched_;
  std::map<WorkKey, int> warnings_;      // stall warnings given (watchdog thread only)
  std::map<WorkKey, int> early_checks_;  // mismatch checks made (watchdog thread only)
  std::vector<std::function<bool()>> periodic_;
  std::thread thread_;
};

}  // namespace loom::detail
