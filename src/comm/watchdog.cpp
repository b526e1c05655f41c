#include "comm/watchdog.h"

#include <algorithm>
#include <map>

#include "loom/comm/communicator.h"
#include "loom/config.h"
#include "loom/log.h"

namespace loom::detail {
namespace {

// The first check for a mismatch, after an operation started: long enough that a collective whose
// ranks merely arrive at different times costs no question, short enough that diverged ranks
// fail within a second or two.
constexpr double kFirstEarlyCheckSeconds = 0.5;

}  // namespace

Watchdog& Watchdog::instance() {
  // Never destroyed: works may still be registered while static destructors run at exit.
  static Watchdog* watchdog = new Watchdog();
  return *watchdog;
}

Watchdog::Watchdog() : thread_([this] { run(); }) {}

void Watchdog::watch(std::weak_ptr<Communicator> comm) {
  std::lock_guard<std::mutex> lock(mutex_);
  watched_.push_back(std::move(comm));
}

void Watchdog::add_periodic(std::function<bool()> check) {
  std::lock_guard<std::mutex> lock(mutex_);
  periodic_.push_back(std::move(check));
}

void Watchdog::fail_members_of(int job_rank, const std::string& message,
                               const std::vector<peers::Reached>& reached) {
  std::vector<std::weak_ptr<Communicator>> comms;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    comms = watched_;
  }
  for (const auto& weak : comms) {
    auto comm = weak.lock();
    if (!comm || comm->is_broken()) continue;
    const auto& members = comm->members();
    if (std::find(members.begin(), members.end(), job_rank) == members.end()) continue;
    const auto ended = std::find_if(reached.begin(), reached.end(),
                                    [&](const peers::Reached& r) { return r.key == comm->peer_key_; });
    try {
      if (ended == reached.end()) comm->fail_all(message);
      else comm->fail_departed(message, ended->collective, ended->internal);
    } catch (const std::exception& e) {
      LOOM_LOG(error, "watchdog: failing group " << comm->name() << " failed: " << e.what());
    }
  }
}

std::vector<Watchdog::Due> Watchdog::due_now(const std::vector<std::weak_ptr<Communicator>>& comms,
                                            double stall_fraction) {
  std::vector<Due> due;
  // is_completed() may poll a device event or take the work's own lock; never ours.
  std::map<WorkKey, int> warned;   // stall warnings of works still unfinished
  std::map<WorkKey, int> checked;  // early mismatch checks of works still unfinished
  const auto now = Clock::now();
  for (const auto& weak : comms) {
    std::vector<std::shared_ptr<Work>> unfinished;
    if (auto comm = weak.lock()) unfinished = comm->unfinished_works();  // not held longer: its
    else continue;                                                      // owner may be dropping it
    for (auto& work : unfinished) {
      const auto started = work->started_at_time();
      if (!started) continue;  // the deadline runs from the start
      const double elapsed = std::chrono::duration<double>(now - *started).count();
      const double timeout = std::chrono::duration<double>(work->info().timeout).count();
      if (elapsed >= timeout) {
        due.push_back({weak, work, elapsed, Due::kExpired});
        continue;
      }
      // The key has the sequence number too: a finished work's address may be reused.
      const WorkKey key{work.get(), work->info().seq};
      auto it = warnings_.find(key);
      int warnings = it == warnings_.end() ? 0 : it->second;
      if (stall_fraction > 0 && warnings < 3 && elapsed >= stall_fraction * timeout * (warnings + 1)) {
        ++warnings;
        due.push_back({weak, work, elapsed, Due::kStalled});
      }
      if (warnings > 0) warned[key] = warnings;
      // Mismatch checks at 0.5 s, 1, 2, 4, ... s: a handful per long wait, none for a quick one.
      auto c = early_checks_.find(key);
      int checks = c == early_checks_.end() ? 0 : c->second;
      if (checks < 16 && elapsed >= kFirstEarlyCheckSeconds * static_cast<double>(1 << checks)) {
        ++checks;
        due.push_back({weak, work, elapsed, Due::kEarlyCheck});
      }
      if (checks > 0) checked[key] = checks;
    }
  }
  warnings_.swap(warned);
  early_checks_.swap(checked);
  return due;
}

std::vector<size_t> Watchdog::run_periodic(const std::vector<std::function<bool()>>& periodic) {
  std::vector<size_t> finished;
  for (size_t i = 0; i < periodic.size(); ++i) {
    bool again = false;
    try {
      again = periodic[i]();
    } catch (const std::exception& e) {
      LOOM_LOG(error, "watchdog: periodic check failed: " << e.what());
    }
    if (!again) finished.push_back(i);
  }
  return finished;
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait_for(lock, poll_interval_);
    double stall_fraction = 0;
    try {
      stall_fraction = config().stall_warning;
    } catch (const std::exception&) {  // malformed before init(): init() reports it
    }
    // Drop the communicators that are gone; the others' unfinished works are read unlocked.
    watched_.erase(std::remove_if(watched_.begin(), watched_.end(), [](const auto& c) { return c.expired(); }),
                   watched_.end());
    std::vector<std::weak_ptr<Communicator>> comms = watched_;
    auto periodic = periodic_;
    lock.unlock();

    for (auto& d : due_now(comms, stall_fraction)) {
      auto comm = d.comm.lock();
      if (!comm) continue;
      try {
        if (d.what == Due::kExpired) comm->on_timeout(d.work);
        else if (d.what == Due::kStalled) comm->on_stall(d.work, d.elapsed);
        else comm->on_early_check(d.work, d.elapsed);
      } catch (const std::exception& e) {
        LOOM_LOG(error, "watchdog: handling " << d.work->info().describe() << " failed: " << e.what());
      }
    }
    const std::vector<size_t> finished_checks = run_periodic(periodic);
    lock.lock();
    // Periodic checks are only appended, so indices of the copy are still valid.
    for (auto it = finished_checks.rbegin(); it != finished_checks.rend(); ++it)
      periodic_.erase(periodic_.begin() + static_cast<long>(*it));
  }
}

}  // namespace loom::detail
