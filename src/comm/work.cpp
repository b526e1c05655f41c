// The operation lifecycle every backend shares (see loom/comm/work.h).
#include "loom/comm/work.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "comm/deadline.h"
#include "comm/durations.h"
#include "loom/comm/communicator.h"
#include "loom/error.h"

namespace loom {

Work::Work(OpInfo info, std::vector<at::Tensor> keep_alive) : info_(std::move(info)), tensors_(std::move(keep_alive)) {}

Work::~Work() = default;

Work::State Work::state() {
  if (completion_is_polled()) poll();
  const State s = state_.load(std::memory_order_acquire);
  if (s == State::Queued) nudge();
  return s;
}

bool Work::finished_quietly() {
  if (completion_is_polled()) poll();
  return terminal();
}

void Work::set_assistant(std::weak_ptr<Communicator> assistant) {
  std::lock_guard<std::mutex> lock(assistant_mutex_);
  assistant_ = std::move(assistant);
}

void Work::assist(bool run_here) {
  std::shared_ptr<Communicator> communicator;
  {
    std::lock_guard<std::mutex> lock(assistant_mutex_);
    communicator = assistant_.lock();
  }
  if (communicator) communicator->assist(this, run_here);
}

void Work::nudge() {
  bool assisted = false;
  {
    std::lock_guard<std::mutex> lock(assistant_mutex_);
    assisted = !assistant_.expired();
  }
  if (assisted && !nudged_.exchange(true, std::memory_order_relaxed)) assist(false);
}

// A look at the state hands a queued operation to its backend's thread (nudge).
void Work::run_in_background() { (void)state(); }

bool Work::is_completed() {
  const State s = state();
  return s == State::Done || s == State::Failed;
}

bool Work::is_success() { return state() == State::Done; }

std::exception_ptr Work::exception() {
  if (completion_is_polled()) poll();
  if (state_.load(std::memory_order_acquire) != State::Failed) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

std::optional<Work::Clock::time_point> Work::started_at_time() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::Queued) return std::nullopt;
  return started_at_;
}

std::optional<Work::Clock::time_point> Work::finished_at_time() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::Done) return std::nullopt;
  return finished_at_;
}

bool Work::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::Queued) return false;
  state_ = State::Running;
  started_at_ = Clock::now();
  return true;
}

void Work::finish() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (terminal()) return;
    if (state_ == State::Queued) started_at_ = Clock::now();
    state_ = State::Done;
    finished_at_ = Clock::now();
    tensors_.clear();
  }
  finished_.notify_all();
}

bool Work::fail(std::exception_ptr error, const std::function<void()>& before_seen) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (terminal()) return false;
    if (before_seen) before_seen();
    state_ = State::Failed;
    error_ = std::move(error);
    finished_at_ = Clock::now();
    // Tensors stay referenced: a backend may still be writing into them (a collective stuck in the
    // network); releasing them here could hand their memory to someone else.
  }
  finished_.notify_all();
  return true;
}

bool Work::wait_until(Clock::time_point deadline) {
  if (!completion_is_polled()) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (deadline == Clock::time_point::max()) {
      // The watchdog fails the work when its own timeout expires, so this wait is bounded.
      finished_.wait(lock, [this] { return terminal(); });
      return true;
    }
    return finished_.wait_until(lock, deadline, [this] { return terminal(); });
  }
  // Device works finish without telling anyone: poll, backing off from 20 us to 1 ms. A failure
  // (timeout, abort) is signalled, so it also ends the wait at once.
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    poll();
    std::unique_lock<std::mutex> lock(mutex_);
    if (terminal()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    finished_.wait_for(lock, std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void Work::wait(Timeout timeout) {
  // Only a wait with its own timeout reads the clock (a read is a visible part of a small
  // operation's cost).
  const auto begin = timeout == kDefaultTimeout ? Clock::time_point{} : Clock::now();
  // Not with an explicit timeout: that caller wants control back by then, and a thread inside a
  // blocking call cannot give up.
  if (timeout == kDefaultTimeout) {
    assist(true);
    // Run here, or finished before the wait: nothing to block on, and no error to read.
    if (state_.load(std::memory_order_acquire) == State::Done && !completion_is_polled()) {
      after_wait();
      return;
    }
  } else {
    nudge();
  }
  if (timeout != kDefaultTimeout || wait_blocks_host()) {
    const auto deadline =
        timeout == kDefaultTimeout ? Clock::time_point::max() : detail::deadline_after<Clock>(begin, timeout);
    if (!wait_until(deadline))
      throw TimeoutError(info_.describe() + ": wait(" + detail::seconds_text(timeout) + " s) gave up after " +
                         detail::seconds_text(Clock::now() - begin) +
                         " s; the operation goes on under its own timeout of " + detail::seconds_text(info_.timeout) +
                         " s");
  } else if (completion_is_polled()) {
    poll();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
  }
  after_wait();
}

void Work::synchronize() {
  assist(true);
  wait_until(Clock::time_point::max());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
  }
  after_wait();
}

}  // namespace loom
