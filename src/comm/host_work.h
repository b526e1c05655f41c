// Work whose completion a host thread reports (the MPI progress thread, the watchdog).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "loom/comm/work.h"

namespace loom::detail {

class HostWork;

// A backend that can run a queued operation on the waiting thread itself, when it is next in
// line and nothing else is running: saves the hand-off to the progress thread (microseconds)
// for the common submit-then-wait pattern, without changing the order of operations.
class InlineExecutor {
 public:
  virtual ~InlineExecutor() = default;
  // Runs `work` now if it is next and nothing is running; false otherwise.
  virtual bool run_if_next(HostWork* work) = 0;
};

class HostWork final : public Work {
 public:
  using Clock = std::chrono::steady_clock;

  HostWork(OpInfo info, std::vector<at::Tensor> keep_alive);

  bool is_completed() override;
  void wait(Timeout timeout = kDefaultTimeout) override;
  std::exception_ptr exception() override;
  const OpInfo& info() const override { return info_; }

  // Queued -> running; false when the work already failed (e.g. its communicator broke).
  bool start();
  // Running -> done. No effect when it already failed (a late completion after a timeout).
  void finish();
  // Any state -> failed with this error; the first error wins. Returns false if already finished.
  bool fail(std::exception_ptr error);
  Clock::time_point started_at();
  std::optional<Clock::time_point> started_at_time() override;
  std::optional<Clock::time_point> finished_at_time() override;
  void set_inline_executor(std::weak_ptr<InlineExecutor> executor) { executor_ = std::move(executor); }

 private:
  enum class State { Queued, Running, Done, Failed };

  OpInfo info_;
  std::vector<at::Tensor> tensors_;  // kept alive until the operation has finished
  std::mutex mutex_;
  std::condition_variable finished_;
  State state_ = State::Queued;
  std::exception_ptr error_;
  Clock::time_point started_at_{};
  Clock::time_point finished_at_{};
  std::weak_ptr<InlineExecutor> executor_;
};

}  // namespace loom::detail
