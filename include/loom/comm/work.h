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
#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <optional>

#include "loom/comm/types.h"

namespace loom {

class Work {
 public:
  virtual ~Work() = default;

  // True once the operation has finished, successfully or not. Never blocks.
  virtual bool is_completed() = 0;
  // True once the operation has finished without error.
  bool is_success() { return is_completed() && exception() == nullptr; }
  // Waits for the operation; rethrows its error. With an explicit timeout, throws
  // loom::TimeoutError when the operation has not finished by then (the operation itself goes on
  // under its own timeout).
  virtual void wait(Timeout timeout = kDefaultTimeout) = 0;
  // Blocks the host until the operation has finished (same as wait() for host communicators).
  virtual void synchronize() { wait(); }
  // The operation's error, or nullptr while it is running or when it succeeded.
  virtual std::exception_ptr exception() = 0;
  // What was submitted: type, sequence number, group, shape, dtype.
  virtual const OpInfo& info() const = 0;
  // When the operation started and finished, where the backend knows (timelines use them).
  virtual std::optional<std::chrono::steady_clock::time_point> started_at_time() { return std::nullopt; }
  virtual std::optional<std::chrono::steady_clock::time_point> finished_at_time() { return std::nullopt; }
};

using WorkPtr = std::shared_ptr<Work>;

}  // namespace loom
