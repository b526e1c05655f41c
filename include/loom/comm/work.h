// An asynchronous operation's handle, like c10d's Work.
//
//   auto work = comm->all_reduce(grad);   // returns at once; the communicator runs it in order
//   compute_something_else();
//   work->wait();                         // blocks until done; throws its error if it failed
//
// For host (MPI) communicators wait() blocks the calling thread. For device (NCCL) communicators
// wait() makes the caller's current CUDA stream wait for the operation, and synchronize() blocks
// the host as well. Every operation has a timeout enforced by the watchdog whether or not anyone
// waits; when it expires the operation fails with loom::TimeoutError.
//
// The life of an operation is the same for every backend and lives here: Queued -> Running ->
// Done, or Failed from any state (the first outcome wins). A backend only says when an operation
// starts and ends (device backends also poll for the end and order streams).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "loom/comm/types.h"

namespace loom {

class Communicator;

class Work {
 public:
  using Clock = std::chrono::steady_clock;
  enum class State { Queued, Running, Done, Failed };

  Work(OpInfo info, std::vector<at::Tensor> keep_alive);
  virtual ~Work();
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // True once the operation has finished, successfully or not. Never blocks.
  bool is_completed();
  // True once the operation has finished without error.
  bool is_success();
  // Waits for the operation; rethrows its error. With an explicit timeout, throws
  // loom::TimeoutError when the operation has not finished by then (the operation itself goes on
  // under its own timeout).
  void wait(Timeout timeout = kDefaultTimeout);
  // Blocks the host until the operation has finished (same as wait() for host communicators).
  void synchronize();
  // Says that the caller will compute before it waits (overlap): a host communicator then starts
  // the operation on its own thread now instead of guessing from how the previous one ran (it may
  // leave a submission to a waiter that comes right after). DDP's buckets and tensor parallelism's
  // overlapped all-reduces call it; polling with is_completed() has the same effect. Never blocks.
  //
  //   auto work = comm->all_reduce(grad);
  //   work->run_in_background();
  //   compute_something_else();
  //   work->wait();
  void run_in_background();
  // The operation's error, or nullptr while it is running or when it succeeded.
  std::exception_ptr exception();
  State state();
  // True when wait() blocks the calling thread until the operation is done (host communicators,
  // device barriers); false when it only makes the caller's CUDA stream wait, so that the time a
  // wait() takes on the host says nothing about how long the operation held anyone up.
  bool wait_blocks_the_host() const { return wait_blocks_host(); }
  // What was submitted: type, sequence number, group, shape, dtype.
  const OpInfo& info() const { return info_; }
  // When the operation started and finished; nullopt until then.
  virtual std::optional<Clock::time_point> started_at_time();
  virtual std::optional<Clock::time_point> finished_at_time();

 protected:
  friend class Communicator;

  // Queued -> Running; false when the work already failed (e.g. its communicator broke).
  bool start();
  // Running -> Done (releases the tensors). No effect once failed (a late completion).
  void finish();
  // Any state -> Failed with this error; false when it had already finished. `before_seen` runs
  // once the failure is decided and before any waiter can see it (under the work's lock): a
  // communicator marks itself broken there, so a program that leaves on this error finds the
  // reason when its exit handler asks (it was seen empty when marked after the waiter woke).
  bool fail(std::exception_ptr error, const std::function<void()>& before_seen = nullptr);

  // Device backends: look whether the device has finished (and call finish() or fail()).
  virtual void poll() {}
  // True when completion must be polled rather than signalled (device works).
  virtual bool completion_is_polled() const { return false; }
  // True when wait() without a timeout must block the host (host works, barriers).
  virtual bool wait_blocks_host() const { return true; }
  // After a successful wait: device works make the caller's current stream wait.
  virtual void after_wait() {}
  // Set by backends that run operations on a thread of their own but let a waiter run a queued
  // one itself: the communicator's assist() is called with run_here = true by wait() without a
  // timeout (the waiter may run it), and once with run_here = false when someone polls or waits
  // with a timeout on a queued operation (nobody will run it inline: the backend's thread should
  // start it now). Held weakly: a work may outlive its communicator. Set under a lock of its own:
  // the watchdog may already poll the work while its backend sets it.
  void set_assistant(std::weak_ptr<Communicator> assistant);

 private:
  // Read without the mutex (the state only moves forward; it is written under the mutex so that
  // waiters on `finished_` see the change).
  bool terminal() const {
    const State s = state_.load(std::memory_order_acquire);
    return s == State::Done || s == State::Failed;
  }
  // For the communicator's in-flight bookkeeping: finished or failed, polling a device work, but
  // never nudging a queued one as state() does.
  bool finished_quietly();
  void assist(bool run_here);
  // Blocks until the work is terminal or the deadline passes; true when terminal.
  bool wait_until(Clock::time_point deadline);
  // Tells the backend (once) that this queued operation will not be run by a waiter.
  void nudge();

  const OpInfo info_;
  std::vector<at::Tensor> tensors_;  // kept alive until the operation has finished
  std::mutex mutex_;
  std::condition_variable finished_;
  std::atomic<State> state_{State::Queued};
  std::exception_ptr error_;  // set before the state becomes Failed
  Clock::time_point started_at_{};
  Clock::time_point finished_at_{};
  std::mutex assistant_mutex_;
  std::weak_ptr<Communicator> assistant_;  // under assistant_mutex_
  std::atomic<bool> nudged_{false};
};

using WorkPtr = std::shared_ptr<Work>;

}  // namespace loom
