#include "comm/watchdog.h"

#include <algorithm>

#include "loom/comm/communicator.h"
#include "loom/config.h"
#include "loom/log.h"

namespace loom::detail {

Watchdog& Watchdog::instance() {
  // Never destroyed: works may still be registered while static destructors run at exit.
  static Watchdog* watchdog = new Watchdog();
  return *watchdog;
}

Watchdog::Watchdog() : thread_([this] { run(); }) {}

void Watchdog::watch(std::weak_ptr<Communicator> comm, std::shared_ptr<Work> work) {
  // No wake-up: the thread checks every poll interval anyway, and a notify per operation would
  // cost a system call on the hot path. Detection is at most one interval late.
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back({std::move(comm), std::move(work), 0});
}

void Watchdog::add_periodic(std::function<bool()> check) {
  std::lock_guard<std::mutex> lock(mutex_);
  periodic_.push_back(std::move(check));
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
    struct Due {
      std::weak_ptr<Communicator> comm;
      std::shared_ptr<Work> work;
      double elapsed;
      bool expired;
    };
    std::vector<Due> due;
    std::vector<Entry> watching;
    watching.swap(entries_);
    auto periodic = periodic_;
    lock.unlock();

    // is_completed() may poll a device event or take the work's own lock; never ours.
    std::vector<Entry> keep;
    const auto now = Clock::now();
    for (auto& e : watching) {
      if (e.work->is_completed()) continue;
      const auto started = e.work->started_at_time();
      if (!started) {
        keep.push_back(std::move(e));
        continue;
      }
      const double elapsed = std::chrono::duration<double>(now - *started).count();
      const double timeout = std::chrono::duration<double>(e.work->info().timeout).count();
      if (elapsed >= timeout) {
        due.push_back({e.comm, e.work, elapsed, true});
        continue;
      }
      if (stall_fraction > 0 && e.warnings < 3 && elapsed >= stall_fraction * timeout * (e.warnings + 1)) {
        ++e.warnings;
        due.push_back({e.comm, e.work, elapsed, false});
      }
      keep.push_back(std::move(e));
    }
    for (auto& d : due) {
      auto comm = d.comm.lock();
      if (!comm) continue;
      try {
        if (d.expired) comm->on_timeout(d.work);
        else comm->on_stall(d.work, d.elapsed);
      } catch (const std::exception& e) {
        LOOM_LOG(error, "watchdog: handling " << d.work->info().describe() << " failed: " << e.what());
      }
    }
    std::vector<size_t> finished_checks;
    for (size_t i = 0; i < periodic.size(); ++i) {
      bool again = false;
      try {
        again = periodic[i]();
      } catch (const std::exception& e) {
        LOOM_LOG(error, "watchdog: periodic check failed: " << e.what());
      }
      if (!again) finished_checks.push_back(i);
    }
    lock.lock();
    // Entries added while unlocked went to entries_; keep both.
    keep.insert(keep.end(), std::make_move_iterator(entries_.begin()), std::make_move_iterator(entries_.end()));
    entries_.swap(keep);
    // Periodic checks are only appended, so indices of the copy are still valid.
    for (auto it = finished_checks.rbegin(); it != finished_checks.rend(); ++it)
      periodic_.erase(periodic_.begin() + static_cast<long>(*it));
  }
}

}  // namespace loom::detail
