#include "comm/nccl/nccl_work.h"

#include <c10/cuda/CUDAGuard.h>

#include <utility>

#include "loom/error.h"

namespace loom::nccl::detail {

NcclWork::NcclWork(OpInfo info, std::vector<at::Tensor> keep_alive, at::Tensor scratch, c10::DeviceIndex device,
                   std::shared_ptr<CudaEvent> end, std::shared_ptr<CudaEvent> start_timing,
                   std::shared_ptr<const DeviceClock> clock)
    : Work(std::move(info), std::move(keep_alive)),
      device_(device),
      scratch_(std::move(scratch)),
      end_(std::move(end)),
      start_(std::move(start_timing)),
      clock_(std::move(clock)) {}

void NcclWork::poll() {
  if (!launched_.load()) return;
  const cudaError_t result = end_->query();
  if (result == cudaErrorNotReady) return;
  if (result == cudaSuccess) {
    finish();
    return;
  }
  const std::string message = info().describe() + ": failed on the device: " + cudaGetErrorString(result);
  // This work fails here; the communicator's failure path (break it, fail what follows, apply the
  // policy) is only handed the failure: poll() may run with the communicator's in-flight lock held.
  if (!fail(std::make_exception_ptr(CommError(message)))) return;  // another poll was first
  std::function<void(const std::string&)> handler;
  {
    std::lock_guard<std::mutex> lock(device_error_mutex_);
    handler = std::move(device_error_);
    device_error_ = nullptr;
  }
  if (handler) handler(message);
}

void NcclWork::after_wait() {
  // c10d semantics: the caller's stream, not the host, waits for the operation.
  c10::cuda::CUDAGuard guard(device_);
  end_->block(c10::cuda::getCurrentCUDAStream(device_));
}

std::optional<Work::Clock::time_point> NcclWork::started_at_time() {
  auto host = Work::started_at_time();
  if (!host || !start_ || !clock_ || state() != State::Done) return host;
  const float ms = start_->elapsed_since(*clock_->anchor);
  return clock_->anchor_time + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
}

std::optional<Work::Clock::time_point> NcclWork::finished_at_time() {
  auto host = Work::finished_at_time();
  if (!host || !start_ || !clock_ || !end_->timing()) return host;
  const float ms = end_->elapsed_since(*clock_->anchor);
  return clock_->anchor_time + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
}

}  // namespace loom::nccl::detail
