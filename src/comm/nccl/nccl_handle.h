// One NCCL communicator handle and what guards it: the lock that keeps NCCL calls on it from
// overlapping, waiting out ncclInProgress (communicators are nonblocking, so that no NCCL call can
// hold a thread past its operation's deadline), and the abort. Shared with the job aborter, so it
// can outlive the communicator object.
#pragma once

#include <c10/core/Device.h>
#include <nccl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom::nccl::detail {

using Clock = std::chrono::steady_clock;

// ncclGetErrorString, plus ncclGetLastError's detail when there is one.
std::string nccl_error_text(ncclResult_t result, ncclComm_t comm);

struct NcclHandle {
  NcclHandle(ncclComm_t c, c10::DeviceIndex d) : comm(c), device(d) {}

  std::timed_mutex mutex;
  ncclComm_t comm;           // null once destroyed or aborted; guarded by mutex
  std::string abort_reason;  // guarded by mutex
  const c10::DeviceIndex device;
  // Where NCCL writes the children of splits that timed out: NCCL keeps the address and stores the
  // new communicator when the split's job ends, so it must outlive the call (a stack slot would be
  // gone). Aborted with this communicator. Guarded by mutex.
  std::vector<std::unique_ptr<ncclComm_t>> unfinished_splits;

  // With the mutex held, after a call returned ncclInProgress: polls ncclCommGetAsyncError until
  // the communicator is no longer in progress (returns its state), or until the deadline passes or
  // give_up() says so (returns ncclInProgress).
  ncclResult_t await(ncclResult_t result, Clock::time_point deadline, const std::function<bool()>& give_up = {});

  // ncclCommAbort (the job aborter's step, or the raise policy's helper thread; never the
  // watchdog). Waits at most a second for a thread inside an NCCL call on this communicator.
  void abort(const std::string& reason);
  // ncclCommAbort of this communicator and of the children of its unfinished splits; with the
  // mutex held.
  void abort_locked();
};

}  // namespace loom::nccl::detail
