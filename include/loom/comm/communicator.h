// loom::Communicator: collectives and point-to-point operations over a group of ranks.
//
// One interface, one backend per file behind it: the MPI communicator serves CPU tensors, the
// NCCL communicator CUDA tensors. Every call is asynchronous and returns a Work handle;
// operations run in submission order, which must be the same on every rank of the group.
//
//   auto rt = loom::init();                            // starts MPI, reads the environment
//   std::shared_ptr<loom::Communicator> comm = rt->world_comm();
//   at::Tensor t = at::full({4}, comm->rank(), at::kFloat);
//   comm->all_reduce(t, {loom::ReduceOp::Sum})->wait();  // t == 0 + 1 + ... + (size-1)
//
// Every public call goes through one checked entry: arguments are validated on the calling
// rank before anything is sent (a contiguous, dense tensor of a supported dtype on the
// communicator's device, matching shapes, roots and peers in range), a bad one raising
// loom::InvalidArgumentError; the operation gets its sequence number, optionally a cross-rank
// fingerprint check (LOOM_CHECK_COLLECTIVES=1), a trace entry, and then goes to the backend.
//
// Supported dtypes: float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool.
// Avg is defined for floating-point dtypes; for bool, Sum/Max are logical or, Min/Product logical and.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/types.h"
#include "loom/comm/work.h"

namespace loom {

namespace detail {
struct Op;
}

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  Timeout default_timeout() const { return timeout_; }
  OnError on_error() const { return on_error_; }
  // "mpi" or "nccl".
  virtual const char* backend() const = 0;
  // The device type of the tensors this communicator accepts (CPU for MPI, CUDA for NCCL).
  virtual c10::DeviceType device_type() const = 0;

  // In place: every rank's tensor becomes the reduction over the group.
  WorkPtr all_reduce(at::Tensor& tensor, const AllReduceOptions& options = {});
  // The root's tensor is copied into every rank's tensor.
  WorkPtr broadcast(at::Tensor& tensor, const BroadcastOptions& options = {});
  // output holds size() * input.numel() elements: rank r's input lands at offset r * input.numel().
  WorkPtr all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options = {});
  // outputs[r] receives rank r's input; size() tensors shaped like input.
  WorkPtr all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, const AllGatherOptions& options = {});
  // input holds size() * output.numel() elements; rank r receives the reduction of every rank's
  // r-th chunk.
  WorkPtr reduce_scatter(at::Tensor& output, const at::Tensor& input, const ReduceScatterOptions& options = {});
  // input and output hold size() equal chunks; chunk j of rank i's input lands in chunk i of rank j's output.
  WorkPtr all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options = {});
  WorkPtr send(const at::Tensor& tensor, int dst, const SendRecvOptions& options = {});
  WorkPtr recv(at::Tensor& tensor, int src, const SendRecvOptions& options = {});
  WorkPtr barrier(const BarrierOptions& options = {});

  // Collective over this communicator: ranks that pass the same color form a new communicator,
  // ordered by key (ties by rank). A rank passing color < 0 joins none and gets nullptr.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name);

  // True once an operation timed out or failed; every later call raises loom::CommError.
  bool is_broken() const { return broken_.load(); }

 protected:
  Communicator(int rank, int size, int world_rank, std::string name, const CommunicatorOptions& options);

  // Backends implement these. The op is validated and numbered; launch must not block on the
  // network (the progress thread or device stream does), and returns the op's Work.
  virtual WorkPtr launch(detail::Op& op) = 0;
  virtual std::shared_ptr<Communicator> launch_split(int color, int key, const std::string& name,
                                                     const CommunicatorOptions& options) = 0;
  // Backend-specific argument checks (e.g. the device index), run with validation before the
  // operation is numbered; throws loom::InvalidArgumentError.
  virtual void check_device(const detail::Op& op) const {}

  // Records the first fatal error; later calls to the communicator raise CommError naming it.
  void mark_broken(const std::string& reason);
  std::string broken_reason();
  const CommunicatorOptions& options() const { return options_; }
  int world_rank() const { return world_rank_; }

 private:
  WorkPtr enqueue_checked(detail::Op& op);
  void check_fingerprint(const detail::Op& op);

  int rank_;
  int size_;
  int world_rank_;
  std::string name_;
  CommunicatorOptions options_;
  Timeout timeout_;
  OnError on_error_;
  bool check_collectives_;
  std::atomic<uint64_t> collective_seq_{0};
  std::atomic<uint64_t> p2p_seq_{0};
  std::atomic<bool> broken_{false};
  std::mutex broken_mutex_;
  std::string broken_reason_;
};

}  // namespace loom
