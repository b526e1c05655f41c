#include "comm/watchdog.h"

#include <algorithm>

#include "loom/log.h"

namespace loom::detail {

Watchdog& Watchdog::instance() {
  // Never destroyed: works may still be registered while static destructors run at exit.
  static Watchdog* watchdog = new Watchdog();
  return *watchdog;
}

Watchdog::Watchdog() : thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::watch(WorkPtr work, Clock::time_point deadline, std::function<void()> on_expire) {
  // No wake-up: the thread checks every poll interval anyway, and a notify per operation would
  // cost a system call on the hot path. Detection is at most one interval late.
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back({std::move(work), deadline, std::move(on_expire)});
}

void Watchdog::add_periodic(std::function<bool()> check) {
  std::lock_guard<std::mutex> lock(mutex_);
  periodic_.push_back(std::move(check));
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    // Sleep until the earliest deadline (at most one poll interval: device works complete
    // without telling anyone and are found by polling).
    auto wake_at = Clock::now() + poll_interval_;
    for (const auto& e : entries_) wake_at = std::min(wake_at, e.deadline);
    wake_.wait_until(lock, wake_at);
    if (stop_) break;

    std::vector<std::function<void()>> expired;
    auto now = Clock::now();
    // is_completed() may take the work's own lock; it never takes ours, so no cycle.
    auto keep = std::remove_if(entries_.begin(), entries_.end(), [&](Entry& e) {
      if (e.work->is_completed()) return true;
      if (now >= e.deadline) {
        expired.push_back(std::move(e.on_expire));
        return true;
      }
      return false;
    });
    entries_.erase(keep, entries_.end());
    auto periodic = periodic_;

    lock.unlock();
    for (auto& on_expire : expired) {
      try {
        on_expire();
      } catch (const std::exception& e) {
        LOOM_LOG(error, "watchdog: handling a timeout failed: " << e.what());
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
    // Periodic checks are only appended, so indices of the copy are still valid.
    for (auto it = finished_checks.rbegin(); it != finished_checks.rend(); ++it)
      periodic_.erase(periodic_.begin() + static_cast<long>(*it));
  }
}

}  // namespace loom::detail
