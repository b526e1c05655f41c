// loom::Communicator: collectives and point-to-point operations over a group of ranks.
//
// One interface, one backend per file behind it: the MPI communicator serves CPU tensors, the
// NCCL communicator the CUDA tensors of one device. Every call is asynchronous and returns a
// Work handle; operations run in submission order, which must be the same on every rank of the
// group.
//
//   auto rt = loom::init();                            // starts MPI, reads the environment
//   std::shared_ptr<loom::Communicator> comm = rt->world_comm();
//   at::Tensor t = at::full({4}, comm->rank(), at::TensorOptions().device(comm->device()));
//   comm->all_reduce(t, {loom::ReduceOp::Sum})->wait();  // t == 0 + 1 + ... + (size-1)
//
// Every public call goes through one checked entry: arguments are validated on the calling rank
// before anything is sent (a contiguous, dense tensor of a supported dtype on the communicator's
// device, matching shapes, roots and peers in range), a bad one raising
// loom::InvalidArgumentError and leaving the communicator usable; the operation then gets its
// sequence number, is recorded in the flight record, registered with the watchdog (its timeout)
// and handed to the backend. Optionally (LOOM_CHECK_COLLECTIVES=1) every collective is first
// compared across ranks; always, a rolling fingerprint of every call is compared before large
// host collectives, every LOOM_FINGERPRINT_INTERVAL collectives, and before a timeout is
// reported, so ranks that diverge get a loom::MismatchError naming both sides.
//
// Supported dtypes: float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool.
// Avg is defined for floating-point dtypes; for bool, Sum/Max are logical or, Min/Product logical and.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/types.h"
#include "loom/comm/work.h"
#include "loom/error.h"

namespace loom {

namespace detail {
struct Op;
class FlightRecorder;
class Watchdog;
}  // namespace detail

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  // This process's rank in the job, and every member's (indexed by rank in this communicator).
  int job_rank() const { return members_[rank_]; }
  const std::vector<int>& members() const { return members_; }
  // The device whose tensors this communicator accepts: CPU (MPI) or one CUDA device (NCCL).
  const at::Device& device() const { return device_; }
  c10::DeviceType device_type() const { return device_.type(); }
  Timeout default_timeout() const { return timeout_; }
  OnError on_error() const { return on_error_; }
  // Collectives that move at least this many bytes are size-checked across ranks (LOOM_SIZE_CHECK_BYTES).
  int64_t size_check_bytes() const { return size_check_bytes_; }
  // "mpi" or "nccl".
  virtual const char* backend() const = 0;
  // "[rank J] what group=NAME (rank r of n)": the prefix of this communicator's messages.
  ErrorContext context(std::string_view what) const { return ErrorContext(what, name_, rank_, size_); }

  // Every call returns its Work ([[nodiscard]]: an operation nobody waits for is a bug, it may
  // still be running when its tensors are read). Tensors are taken by const reference, as handles:
  // the operation writes their data in place (a view such as t.narrow(0, 0, n) works too).

  // In place: every rank's tensor becomes the reduction over the group.
  [[nodiscard]] WorkPtr all_reduce(const at::Tensor& tensor, const AllReduceOptions& options = {});
  // The root's tensor is copied into every rank's tensor.
  [[nodiscard]] WorkPtr broadcast(const at::Tensor& tensor, const BroadcastOptions& options = {});
  // output holds size() * input.numel() elements: rank r's input lands at offset r * input.numel().
  [[nodiscard]] WorkPtr all_gather(const at::Tensor& output, const at::Tensor& input,
                                   const AllGatherOptions& options = {});
  // outputs[r] receives rank r's input; size() tensors shaped like input.
  [[nodiscard]] WorkPtr all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                   const AllGatherOptions& options = {});
  // input holds size() * output.numel() elements; rank r receives the reduction of every rank's
  // r-th chunk.
  [[nodiscard]] WorkPtr reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                       const ReduceScatterOptions& options = {});
  // input and output hold size() equal chunks; chunk j of rank i's input lands in chunk i of rank j's output.
  [[nodiscard]] WorkPtr all_to_all(const at::Tensor& output, const at::Tensor& input,
                                   const AllToAllOptions& options = {});
  // Point-to-point. A send and its receive match in issue order (and by tag on MPI). Two ranks
  // that both send and then both receive can deadlock on NCCL once the message exceeds its
  // buffering: exchange with batch_isend_irecv instead.
  [[nodiscard]] WorkPtr send(const at::Tensor& tensor, int dst, const SendRecvOptions& options = {});
  [[nodiscard]] WorkPtr recv(const at::Tensor& tensor, int src, const SendRecvOptions& options = {});
  // Sends and receives issued together (one NCCL group; MPI non-blocking): any order of sends and
  // receives between the ranks completes. One Work for the whole batch; options.tag is unused.
  [[nodiscard]] WorkPtr batch_isend_irecv(std::vector<P2POp> operations, const SendRecvOptions& options = {});
  [[nodiscard]] WorkPtr barrier(const BarrierOptions& options = {});

  // Collective over this communicator: ranks that pass the same color form a new communicator,
  // ordered by key (ties by rank). A rank passing color < 0 joins none and gets nullptr.
  [[nodiscard]] std::shared_ptr<Communicator> split(int color, int key, const std::string& name,
                                                    const SplitOptions& options = {});

  // True once an operation timed out or failed; every later call raises loom::CommError.
  bool is_broken() const { return broken_.load(); }
  std::string broken_reason() const;

 protected:
  // members: the job rank of every rank of the new communicator.
  Communicator(int rank, std::vector<int> members, std::string name, at::Device device,
               const CommunicatorOptions& options);

  // ---- What a backend implements -------------------------------------------------------------
  // The Work of an operation (device backends return their own kind, which polls an event).
  virtual std::shared_ptr<Work> make_work(const detail::Op& op);
  // Starts the validated, numbered, watched operation. Must not block on the network (a progress
  // thread or the device stream runs it): calls start() when it begins, finish() when done, and
  // fail() on an error. Split operations fill op.split->result.
  virtual void issue(detail::Op& op, const std::shared_ptr<Work>& work) = 0;
  // Why this backend cannot run the operation `info` describes (now), or "" when it can. Asked
  // after validation and before numbering: a refusal is a loom::UnsupportedError naming the
  // backend, and leaves the sequence as if the call had not been made.
  virtual std::string unsupported(const OpInfo& info) const { return {}; }
  // Releases what is in flight after a failure (ncclCommAbort), so waiters and streams are freed.
  // Never called on the watchdog thread, and at most once.
  virtual void abort_backend(const std::string& reason) {}

  // ---- What the core gives backends ----------------------------------------------------------
  static bool start(Work& work) { return work.start(); }
  static void finish(Work& work) { work.finish(); }
  // Lets waiters of `work` run it themselves or hand it on: see assist().
  void accept_assists(Work& work) { work.set_assistant(weak_from_this()); }
  // Backends that let a waiter run a queued operation itself (see Work::set_assistant): with
  // run_here, the waiting thread may run `work` now; without, nobody will, so the backend's own
  // thread should start it.
  virtual void assist(Work* work, bool run_here) {}
  // The one failure path: fails `work` (unless it finished just in time) and every operation
  // submitted after it, breaks the communicator, logs the error once with the flight record, and
  // applies the error policy (abort the job, or abort only this communicator's backend).
  void fail(const std::shared_ptr<Work>& work, std::exception_ptr error, const std::string& message);
  // A failure of the communicator as a whole (e.g. an asynchronous NCCL error): fails every
  // operation in flight with `message`.
  void fail_all(const std::string& message);
  // For a backend that finds `work` failed where the in-flight lock may be held (a device work's
  // poll, reached from the watchdog's or a submission's prune): the work has failed already; the
  // rest of fail() (break, fail what follows, log, policy) runs once that lock is free, at the
  // next submission or watchdog poll.
  void defer_failure(const std::shared_ptr<Work>& work, const std::string& message);
  // Blocks until every submitted operation has finished or failed (each is bounded by its
  // timeout, which the watchdog enforces).
  void drain();
  const detail::FlightRecorder& flight_record() const { return *recorder_; }
  // What the other ranks say about an operation this rank is stuck in or failed at, asked over
  // the side channel: "ranks not arrived: 1 (last called seq=76)", "mismatch: ... rank 2 called
  // broadcast(...)". Empty alone in the group, for point-to-point, or without a side channel.
  std::string diagnose(const OpInfo& info);

 private:
  friend class detail::Watchdog;
  friend class Work;  // calls assist()
  WorkPtr enqueue_checked(detail::Op& op);
  void check_fingerprint(detail::Op& op);
  void mark_broken(const std::string& reason);
  void apply_policy(const std::string& message);
  // fail_all() for a member that left the job: its collectives up to `collectives_ended` and
  // internal ones up to `internal_ended` (sequence numbers) had completed there, so they complete
  // here too and are waited for (briefly) before the rest fail.
  void fail_departed(const std::string& message, int64_t collectives_ended, int64_t internal_ended);
  // fail() once `work` has failed: break, fail what was submitted after it, log, policy.
  void break_after(const std::shared_ptr<Work>& work, const std::string& message);
  void run_deferred_failures();  // never with inflight_mutex_ held
  void prune_finished_locked();  // drops completed works from inflight_'s front (inflight_mutex_ held)
  // Called by the watchdog.
  std::vector<std::shared_ptr<Work>> unfinished_works();
  void on_timeout(const std::shared_ptr<Work>& work);
  void on_stall(const std::shared_ptr<Work>& work, double elapsed_seconds);
  // Soon after an operation starts waiting, and at doubling intervals: when a member has called
  // another operation at its sequence number, no wait can resolve it; fail it now (MismatchError).
  void on_early_check(const std::shared_ptr<Work>& work, double elapsed_seconds);

  int rank_;
  int size_;
  std::vector<int> members_;
  std::string name_;
  at::Device device_;
  Timeout timeout_;
  OnError on_error_;
  bool check_collectives_;
  int64_t size_check_bytes_;
  int64_t fingerprint_interval_;
  // Numbering, fingerprinting, recording and issuing happen under one lock, so that operations
  // reach the backend in the order of their sequence numbers even with several submitting threads
  // (recursive: the LOOM_CHECK_COLLECTIVES exchange is itself submitted from inside).
  std::recursive_mutex submit_mutex_;
  uint64_t collective_seq_ = 0;
  uint64_t p2p_seq_ = 0;
  uint64_t internal_seq_ = 0;
  uint64_t collectives_total_ = 0;
  uint64_t rolling_fingerprint_ = 0;
  std::atomic<bool> broken_{false};
  std::atomic<bool> backend_aborted_{false};
  mutable std::mutex broken_mutex_;
  std::string broken_reason_;
  std::mutex inflight_mutex_;
  // In submission order; completed ones pruned from the front. The watchdog reads it (every
  // operation is watched from here, with no per-operation registration on the hot path).
  std::vector<std::weak_ptr<Work>> inflight_;
  std::mutex deferred_mutex_;
  std::vector<std::pair<std::shared_ptr<Work>, std::string>> deferred_;  // see defer_failure
  std::atomic<bool> has_deferred_{false};
  bool watched_ = false;  // registered with the watchdog (at the first submission; under submit_mutex_)
  std::shared_ptr<detail::FlightRecorder> recorder_;
  uint64_t peer_key_ = 0;  // this communicator's name in peer queries (detail::peers)
};

namespace detail {
// While an InternalOperations guard is alive on a thread, the collectives that thread submits are
// the library's own (agreements, checks): numbered apart, named by `purpose` in messages, and
// never shifting the sequence numbers users see.
class InternalOperations {
 public:
  explicit InternalOperations(const char* purpose);
  ~InternalOperations();
  InternalOperations(const InternalOperations&) = delete;
  InternalOperations& operator=(const InternalOperations&) = delete;

 private:
  const char* previous_;
};
}  // namespace detail

}  // namespace loom
