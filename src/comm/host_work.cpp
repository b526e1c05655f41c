#include "comm/host_work.h"

#include <cstdio>

#include "loom/error.h"

namespace loom::detail {

HostWork::HostWork(OpInfo info, std::vector<at::Tensor> keep_alive)
    : info_(std::move(info)), tensors_(std::move(keep_alive)) {}

bool HostWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ == State::Done || state_ == State::Failed;
}

std::exception_ptr HostWork::exception() {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

HostWork::Clock::time_point HostWork::started_at() {
  std::lock_guard<std::mutex> lock(mutex_);
  return started_at_;
}

std::optional<HostWork::Clock::time_point> HostWork::started_at_time() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::Queued) return std::nullopt;
  return started_at_;
}

std::optional<HostWork::Clock::time_point> HostWork::finished_at_time() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::Done) return std::nullopt;
  return finished_at_;
}

bool HostWork::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::Queued) return false;
  state_ = State::Running;
  started_at_ = Clock::now();
  return true;
}

void HostWork::finish() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == State::Failed || state_ == State::Done) return;
    state_ = State::Done;
    finished_at_ = Clock::now();
    tensors_.clear();
  }
  finished_.notify_all();
}

bool HostWork::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == State::Failed || state_ == State::Done) return false;
    state_ = State::Failed;
    error_ = std::move(error);
    // Tensors stay referenced: a backend may still be writing into them (a collective stuck in
    // the network); releasing them here could hand their memory to someone else.
  }
  finished_.notify_all();
  return true;
}

void HostWork::wait(Timeout timeout) {
  // Not with an explicit timeout: the caller wants to get control back by then, and a thread
  // inside a blocking MPI call cannot give up.
  if (auto executor = timeout == kDefaultTimeout ? executor_.lock() : nullptr) {
    bool queued;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queued = state_ == State::Queued;
    }
    if (queued) executor->run_if_next(this);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  auto finished = [this] { return state_ == State::Done || state_ == State::Failed; };
  if (timeout == kDefaultTimeout) {
    // The watchdog fails the work when its own timeout expires, so this wait is bounded.
    finished_.wait(lock, finished);
  } else if (!finished_.wait_for(lock, timeout, finished)) {
    char text[160];
    std::snprintf(text, sizeof(text), ": wait() gave up after %.3f s; the operation is still running (its timeout is %.3f s)",
                  timeout.count() / 1000.0, info_.timeout.count() / 1000.0);
    throw TimeoutError(info_.describe() + text);
  }
  if (error_) std::rethrow_exception(error_);
}

}  // namespace loom::detail
