// CUDA events for the NCCL backend, and a pool that recycles them (creating and destroying an
// event per operation costs two driver calls on the launch path).
//
// LibTorch's own event class moved from at::cuda to c10::cuda within the supported LibTorch
// range, so this uses the (stable) runtime API directly. Every call runs on the event's own
// device: events are queried and destroyed from the watchdog thread too, and touching another
// device there would create a CUDA context on it.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <vector>

namespace loom::nccl::detail {

// Makes `device` current for a path that must not throw; returns the previous device or -1.
int select_device_nothrow(c10::DeviceIndex device);
void restore_device_nothrow(int previous);
// Throws loom::CommError naming the call.
void check_cuda(cudaError_t result, const char* call);

class CudaEvent {
 public:
  CudaEvent(c10::DeviceIndex device, bool timing);
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(const c10::cuda::CUDAStream& stream);
  // Makes `stream` wait for the event.
  void block(const c10::cuda::CUDAStream& stream);
  // cudaSuccess (done), cudaErrorNotReady, or the error the device hit.
  cudaError_t query() const;
  // Milliseconds from `earlier` to this event (both recorded with timing, both done).
  float elapsed_since(const CudaEvent& earlier) const;
  void synchronize();
  bool timing() const { return timing_; }

 private:
  c10::DeviceIndex device_;
  bool timing_;
  cudaEvent_t event_ = nullptr;
};

// Events of one device, recycled. Thread-safe; outlives the works that borrow from it.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  EventPool(c10::DeviceIndex device, bool timing) : device_(device), timing_(timing) {}
  // An event that goes back to the pool when released.
  std::shared_ptr<CudaEvent> get();

 private:
  c10::DeviceIndex device_;
  bool timing_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<CudaEvent>> free_;
};

}  // namespace loom::nccl::detail
