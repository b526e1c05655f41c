// The Work of one NCCL operation: done when its end event has fired on the communicator's stream.
// The comm core fails it (timeout, abort, NCCL error); this class only observes the device.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <memory>
#include <string>

#include "comm/nccl/cuda_event.h"
#include "loom/comm/work.h"

namespace loom::nccl::detail {

// Maps device event times onto the host clock: an event recorded at a known host time.
struct DeviceClock {
  std::shared_ptr<CudaEvent> anchor;
  Work::Clock::time_point anchor_time;
};

class NcclWork final : public Work {
 public:
  NcclWork(OpInfo info, std::vector<at::Tensor> keep_alive, at::Tensor scratch, c10::DeviceIndex device,
           std::shared_ptr<CudaEvent> end, std::shared_ptr<CudaEvent> start_timing,
           std::shared_ptr<const DeviceClock> clock);

  // Temporary device memory the operation needs (kept alive with the work).
  const at::Tensor& scratch() const { return scratch_; }
  // Called (once) when the device reports an error for this operation, with the message.
  void on_device_error(std::function<void(const std::string&)> handler) {
    std::lock_guard<std::mutex> lock(device_error_mutex_);
    device_error_ = std::move(handler);
  }

  // Called by the communicator once the operation is on the stream (its end event recorded).
  void mark_launched() { launched_.store(true); }
  CudaEvent& end_event() { return *end_; }
  CudaEvent* start_event() { return start_.get(); }
  // Device times when timing events were recorded (the timeline), else the host's observations.
  std::optional<Clock::time_point> started_at_time() override;
  std::optional<Clock::time_point> finished_at_time() override;

 protected:
  void poll() override;
  bool completion_is_polled() const override { return true; }
  bool wait_blocks_host() const override { return info().type == OpType::Barrier; }
  void after_wait() override;

 private:
  const c10::DeviceIndex device_;
  const at::Tensor scratch_;
  std::mutex device_error_mutex_;  // poll() runs on any thread that looks at the work
  std::function<void(const std::string&)> device_error_;
  std::shared_ptr<CudaEvent> end_;
  std::shared_ptr<CudaEvent> start_;  // with timing, only when a timeline is recorded
  std::shared_ptr<const DeviceClock> clock_;
  std::atomic<bool> launched_{false};
};

}  // namespace loom::nccl::detail
