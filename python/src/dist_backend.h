// torchloom as a torch.distributed backend: a c10d::Backend over loom's communicators, so that
// torch.distributed.init_process_group(backend="loom") gives unmodified PyTorch programs (DDP,
// FSDP2, DCP) torchloom's checks, timeouts, culprit naming and flight recorder.
//
// Tensors are routed by device: CPU tensors to the host communicator (MPI under mpirun, Gloo
// under torchrun), CUDA tensors to the device communicator (NCCL). Every call goes through loom's
// one checked entry. Operations loom has no collective for are built from ones it has (gather from
// all_gather, scatter and uneven all_to_all from point-to-point batches); operations that cannot
// be served raise loom::InvalidArgumentError naming the operation. python/torchloom/distributed.py
// registers the creator and explains the choices.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>
#include <string>
#include <vector>

#include "dist_work.h"
#include "loom/comm/communicator.h"

namespace torchloom_py {

class DistBackend : public c10d::Backend {
 public:
  // host: required (its ranks are the group's); device: may be null (no CUDA tensors then).
  // timeout: the default of every operation (loom::kDefaultTimeout: the communicators' own).
  DistBackend(std::shared_ptr<loom::Communicator> host, std::shared_ptr<loom::Communicator> device,
              loom::Timeout timeout, c10::intrusive_ptr<Options> options);
  ~DistBackend() override;

  const std::string getBackendName() const override { return "loom"; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  bool supportsSplitting() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override;

  const std::shared_ptr<loom::Communicator>& host_comm() const { return host_; }
  const std::shared_ptr<loom::Communicator>& device_comm() const { return device_; }

  // Collective over this group (every rank calls it, in the same order): the ranks listed (ranks
  // of this group, in the new group's order) form a new backend; a rank not listed joins none and
  // gets nullptr. Different calls may list disjoint sets of ranks (torch's split_group).
  c10::intrusive_ptr<DistBackend> split_ranks(const std::vector<int>& ranks, loom::Timeout timeout,
                                               c10::intrusive_ptr<Options> options);

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> all_gather_single(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> all_gather_single_coalesced(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& output, at::Tensor& input,
                                               const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather_into_tensor(at::Tensor& output, at::Tensor& input,
                                                    const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                       const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_single_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> all_to_all_single(at::Tensor& output, at::Tensor& input,
                                                   std::vector<int64_t>& output_splits,
                                                   std::vector<int64_t>& input_splits,
                                                   const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

 private:
  // The communicator for tensors on `device`; InvalidArgumentError naming `op` when there is none.
  loom::Communicator& comm_for(const at::Device& device, const char* op);
  loom::Timeout timeout_of(std::chrono::milliseconds requested) const;
  c10::intrusive_ptr<c10d::Work> make_work(c10d::OpType type, std::vector<loom::WorkPtr> works,
                                           std::vector<at::Tensor> outputs);
  c10::intrusive_ptr<c10d::Work> all_to_all_uneven(at::Tensor& output, at::Tensor& input,
                                                   const std::vector<int64_t>& output_splits,
                                                   const std::vector<int64_t>& input_splits, loom::Timeout timeout);

  std::shared_ptr<loom::Communicator> host_;
  std::shared_ptr<loom::Communicator> device_;
  std::atomic<int64_t> timeout_ms_;
  c10::intrusive_ptr<Options> options_;
  std::shared_ptr<FutureCompleter> completer_;
};

}  // namespace torchloom_py
