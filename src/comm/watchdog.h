// The watchdog: one thread per process that enforces every operation's timeout, whether or not
// anyone waits on it. A backend registers a work when it starts running, with the deadline and
// what to do on expiry (fail the work, break the communicator, apply the error policy). The
// watchdog only detects and reports; ending the job is the job aborter's (abort.h), on its own
// thread, so a blocking abort never stalls detection for other communicators.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "loom/comm/work.h"

namespace loom::detail {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;

  static Watchdog& instance();

  // Calls on_expire (on the watchdog thread) if work has not completed by deadline. A work that
  // completes is dropped at the next check; is_completed() is how device works are polled.
  // poll_interval bounds how late a detection can be.
  void watch(WorkPtr work, Clock::time_point deadline, std::function<void()> on_expire);
  // Runs check() every poll interval until it returns false (device communicators poll
  // asynchronous errors this way).
  void add_periodic(std::function<bool()> check);

  std::chrono::milliseconds poll_interval() const { return poll_interval_; }
  bool on_watchdog_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  ~Watchdog();

 private:
  Watchdog();
  void run();

  struct Entry {
    WorkPtr work;
    Clock::time_point deadline;
    std::function<void()> on_expire;
  };

  std::chrono::milliseconds poll_interval_{50};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> entries_;
  std::vector<std::function<bool()>> periodic_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace loom::detail
