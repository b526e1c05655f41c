#include "comm/nccl/cuda_event.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>

#include "loom/error.h"

namespace loom::nccl::detail {

int select_device_nothrow(c10::DeviceIndex device) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) return -1;
  if (previous == device || cudaSetDevice(device) != cudaSuccess) return -1;
  return previous;
}

void restore_device_nothrow(int previous) {
  // MaybeSetDevice does not create a context on a device that has none (cudaSetDevice would,
  // since CUDA 12: a watchdog thread would otherwise leave one on GPU 0 in every rank).
  if (previous < 0) return;
  try {
    (void)c10::cuda::MaybeSetDevice(static_cast<c10::DeviceIndex>(previous));
  } catch (...) {
  }
}

void check_cuda(cudaError_t result, const char* call) {
  if (result != cudaSuccess) throw CommError(std::string(call) + " failed: " + cudaGetErrorString(result));
}

CudaEvent::CudaEvent(c10::DeviceIndex device, bool timing) : device_(device), timing_(timing) {
  c10::cuda::CUDAGuard guard(device_);
  check_cuda(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming),
             "cudaEventCreateWithFlags");
}

CudaEvent::~CudaEvent() {
  const int previous = select_device_nothrow(device_);
  cudaEventDestroy(event_);
  restore_device_nothrow(previous);
}

void CudaEvent::record(const c10::cuda::CUDAStream& stream) {
  check_cuda(cudaEventRecord(event_, stream.stream()), "cudaEventRecord");
}

void CudaEvent::block(const c10::cuda::CUDAStream& stream) {
  check_cuda(cudaStreamWaitEvent(stream.stream(), event_, 0), "cudaStreamWaitEvent");
}

cudaError_t CudaEvent::query() const {
  const int previous = select_device_nothrow(device_);
  cudaError_t result = cudaEventQuery(event_);
  // "Not ready" is no error; clear it so it does not surface in an unrelated later check.
  if (result == cudaErrorNotReady) (void)cudaGetLastError();
  restore_device_nothrow(previous);
  return result;
}

float CudaEvent::elapsed_since(const CudaEvent& earlier) const {
  float ms = 0;
  const int previous = select_device_nothrow(device_);
  const cudaError_t result = cudaEventElapsedTime(&ms, earlier.event_, event_);
  restore_device_nothrow(previous);
  return result == cudaSuccess ? ms : 0.0f;
}

void CudaEvent::synchronize() { check_cuda(cudaEventSynchronize(event_), "cudaEventSynchronize"); }

std::shared_ptr<CudaEvent> EventPool::get() {
  std::unique_ptr<CudaEvent> event;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      event = std::move(free_.back());
      free_.pop_back();
    }
  }
  if (!event) event = std::make_unique<CudaEvent>(device_, timing_);
  std::weak_ptr<EventPool> pool = weak_from_this();
  return std::shared_ptr<CudaEvent>(event.release(), [pool](CudaEvent* e) {
    if (auto p = pool.lock()) {
      std::lock_guard<std::mutex> lock(p->mutex_);
      p->free_.emplace_back(e);
    } else {
      delete e;
    }
  });
}

}  // namespace loom::nccl::detail
