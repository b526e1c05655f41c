#include "comm/nccl/nccl_handle.h"

#include <algorithm>
#include <thread>

#include "comm/nccl/cuda_event.h"
#include "loom/log.h"

namespace loom::nccl::detail {

std::string nccl_error_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

ncclResult_t NcclHandle::await(ncclResult_t result, Clock::time_point deadline,
                               const std::function<bool()>& give_up) {
  // A collective's launch on a nonblocking communicator finishes in microseconds: poll without
  // sleeping for the first 100 us (a sleep costs >= 50 us with the default timer slack), then back
  // off from 20 us to 1 ms for what takes longer (connecting to a peer, init, split).
  const auto spin_until = Clock::now() + std::chrono::microseconds(100);
  auto pause = std::chrono::microseconds(20);
  while (result == ncclInProgress) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    result = rc != ncclSuccess ? rc : state;
    if (result != ncclInProgress) break;
    const auto now = Clock::now();
    if (now >= deadline || (give_up && give_up())) return ncclInProgress;
    if (now < spin_until) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  return result;
}

void NcclHandle::abort(const std::string& reason) {
  std::unique_lock<std::timed_mutex> lock(mutex, std::defer_lock);
  if (!lock.try_lock_for(std::chrono::seconds(1))) {
    // Nonblocking communicators return from every call, so a holder is polling and gives up at its
    // deadline; if it has not by now, ending the process (the job aborter's final step) releases
    // the GPU resources anyway.
    LOOM_LOG(warn, "skipping ncclCommAbort: an NCCL call on this communicator has not returned within 1 s");
    return;
  }
  const int previous = select_device_nothrow(device);
  abort_locked();
  restore_device_nothrow(previous);
  abort_reason = reason;
}

void NcclHandle::abort_locked() {
  if (comm != nullptr) ncclCommAbort(comm);  // joins the jobs of unfinished splits of this communicator
  comm = nullptr;
  // Those jobs have written their child by now, if they made one.
  for (auto& slot : unfinished_splits)
    if (*slot != nullptr) ncclCommAbort(*slot);
  unfinished_splits.clear();
}

}  // namespace loom::nccl::detail
