// The NCCL communicator class (see loom/comm/nccl.h for the public entry points and semantics).
#pragma once

#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "comm/nccl/cuda_event.h"
#include "comm/nccl/nccl_handle.h"
#include "comm/nccl/nccl_work.h"
#include "loom/comm/communicator.h"

namespace loom::nccl::detail {

class NcclCommunicator final : public Communicator {
 public:
  // Takes over an initialised handle; registers the asynchronous-error poll and the abort step.
  static std::shared_ptr<NcclCommunicator> create(std::shared_ptr<NcclHandle> handle, int rank, std::vector<int> members,
                                                  c10::DeviceIndex device, const std::string& name,
                                                  const CommunicatorOptions& options);
  // Every NCCL communicator of this process still alive.
  static std::vector<std::shared_ptr<NcclCommunicator>> all_live();
  // Waits, up to `limit`, for destructions that the last reference dropped on the watchdog thread
  // handed to a thread of their own; returns whether none is left. Such a communicator has left
  // the live list already, so finalize() must wait here before MPI and the CUDA runtime go.
  static bool wait_for_detached_destructions(std::chrono::milliseconds limit);

  ~NcclCommunicator() override;
  const char* backend() const override { return "nccl"; }

  // Destroys the NCCL communicator on the calling thread: waits for the operations in flight
  // (bounded by their timeouts), then ncclCommFinalize + ncclCommDestroy, or ncclCommAbort when
  // broken. Later calls, and the destructor, do nothing more.
  void shutdown();
  // ncclCommAbort now (local; no peer needed), for exits that skip finalize().
  void abort_local(const std::string& reason);

 protected:
  std::shared_ptr<Work> make_work(const loom::detail::Op& op) override;
  void issue(loom::detail::Op& op, const std::shared_ptr<Work>& work) override;
  std::string unsupported(const OpInfo& info) const override;
  void abort_backend(const std::string& reason) override;

 private:
  NcclCommunicator(std::shared_ptr<NcclHandle> handle, int rank, std::vector<int> members, c10::DeviceIndex device,
                   const std::string& name, const CommunicatorOptions& options);

  at::Tensor scratch_for(const loom::detail::Op& op);
  void enqueue(loom::detail::Op& op, const at::Tensor& scratch, Clock::time_point deadline,
               const std::function<bool()>& give_up);
  // enqueue()'s grouped operations: one NCCL group of sends and receives each.
  void enqueue_all_to_all(loom::detail::Op& op, const at::Tensor& scratch, Clock::time_point deadline,
                          const std::function<bool()>& give_up);
  void enqueue_send_recv_batch(loom::detail::Op& op, Clock::time_point deadline, const std::function<bool()>& give_up);
  void group(Clock::time_point deadline, const std::function<bool()>& give_up, const OpInfo& info,
             const std::function<ncclResult_t()>& calls);
  void issue_split(loom::detail::Op& op, const std::shared_ptr<Work>& work);
  bool poll_async_error();

  const c10::DeviceIndex device_index_;
  const c10::cuda::CUDAStream stream_;
  CudaEvent ready_;  // marks the caller's stream at issue; used under handle_->mutex
  std::shared_ptr<EventPool> events_;
  std::shared_ptr<EventPool> timing_events_;  // only while a timeline is recorded
  std::shared_ptr<const DeviceClock> clock_;
  std::shared_ptr<NcclHandle> handle_;
  std::atomic<bool> shut_down_{false};
  int abort_handle_ = -1;
};

}  // namespace loom::nccl::detail
