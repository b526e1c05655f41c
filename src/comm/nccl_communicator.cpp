// The NCCL backend: CUDA tensors. Each communicator owns one CUDA stream from LibTorch's pool and
// runs its operations on it in submission order. A launch makes that stream wait for the caller's
// current stream (the inputs were produced there), issues the NCCL call(s), and records an end
// event that the Work polls (is_completed, the watchdog) or makes another stream wait on (wait).
//
// Failure handling, as in c10d's ProcessGroupNCCL: the watchdog enforces every operation's
// timeout through the end event and polls ncclCommGetAsyncError; either failure fails the works
// still pending, breaks the communicator and applies LOOM_ON_ERROR. ncclCommAbort runs only as a
// step of the job aborter (its own thread) or in the destructor, never on the watchdog thread.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/abort.h"
#include "comm/op.h"
#include "comm/watchdog.h"
#include "core/env.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom::nccl {
namespace {

using Clock = std::chrono::steady_clock;

// "600.1" for long durations, "0.010" for the short ones tests and explicit waits use.
std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), seconds < 1.0 ? "%.3f" : "%.1f", seconds);
  return text;
}

std::string seconds_text(Timeout duration) {
  return seconds_text(duration.count() / 1000.0);
}

std::string nccl_error_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

void check_nccl(ncclResult_t result, const char* call, ncclComm_t comm) {
  if (result != ncclSuccess) throw CommError(std::string(call) + " failed: " + nccl_error_text(result, comm));
}

void check_cuda(cudaError_t result, const char* call) {
  if (result != cudaSuccess) throw CommError(std::string(call) + " failed: " + cudaGetErrorString(result));
}

// Makes `device` current for a teardown path that must not throw; returns the previous device or -1.
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

ncclDataType_t nccl_type(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Byte:
      return ncclUint8;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Long:
      return ncclInt64;
    case c10::ScalarType::Bool:
      return ncclUint8;  // one byte, 0 or 1
    default:
      throw InvalidArgumentError(std::string("dtype ") + c10::toString(type) + " has no NCCL equivalent");
  }
}

ncclRedOp_t nccl_op(ReduceOp op, c10::ScalarType type) {
  if (type == c10::ScalarType::Bool) {
    // Bytes holding 0 or 1: logical or is max, logical and is min (a byte sum could wrap to 0).
    if (op == ReduceOp::Sum || op == ReduceOp::Max) return ncclMax;
    if (op == ReduceOp::Min || op == ReduceOp::Product) return ncclMin;
    throw InvalidArgumentError("reduce op avg is not defined for bool tensors");
  }
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Product:
      return ncclProd;
  }
  throw InvalidArgumentError("unknown reduce op");
}

char* bytes_of(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

// One CUDA event, created on its device. LibTorch's own event class moved from at::cuda to
// c10::cuda within the supported LibTorch range, so this uses the (stable) runtime API directly.
class CudaEvent {
 public:
  explicit CudaEvent(c10::DeviceIndex device) : device_(device) {
    c10::cuda::CUDAGuard guard(device_);
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  ~CudaEvent() {
    // The last reference may go on any thread (the watchdog's too): destroy on the event's own
    // device so no context is created on another GPU, and never throw.
    int previous = select_device_nothrow(device_);
    cudaEventDestroy(event_);
    restore_device_nothrow(previous);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(const c10::cuda::CUDAStream& stream) {
    check_cuda(cudaEventRecord(event_, stream.stream()), "cudaEventRecord");
  }
  void block(const c10::cuda::CUDAStream& stream) {
    check_cuda(cudaStreamWaitEvent(stream.stream(), event_, 0), "cudaStreamWaitEvent");
  }
  // cudaSuccess (done), cudaErrorNotReady, or the error the device hit.
  cudaError_t query() const {
    // Queried from the watchdog thread too: on the event's own device, so no context is created
    // on the thread's default device.
    const int previous = select_device_nothrow(device_);
    cudaError_t result = cudaEventQuery(event_);
    // "Not ready" is no error; clear it so it does not surface in an unrelated later check.
    if (result == cudaErrorNotReady) (void)cudaGetLastError();
    restore_device_nothrow(previous);
    return result;
  }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t event_ = nullptr;
};

// The Work of one NCCL operation: complete when its end event has fired on the NCCL stream, or
// failed when the watchdog, an NCCL error or an abort says so (the first outcome wins).
class NcclWork final : public Work {
 public:
  NcclWork(OpInfo info, c10::DeviceIndex device, std::vector<at::Tensor> keep_alive, bool blocks_host)
      : info_(std::move(info)),
        device_(device),
        tensors_(std::move(keep_alive)),
        blocks_host_(blocks_host),
        end_(device),
        launched_at_(Clock::now()) {}

  bool is_completed() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state_ != State::Running) return true;
    }
    const cudaError_t result = end_.query();
    if (result == cudaErrorNotReady) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ == State::Running) {
      if (result == cudaSuccess) {
        state_ = State::Done;
      } else {
        state_ = State::Failed;
        error_ = std::make_exception_ptr(
            CommError(info_.describe() + ": failed on the device: " + cudaGetErrorString(result)));
      }
    }
    return true;
  }

  void wait(Timeout timeout) override {
    if (timeout.count() >= 0) {
      const auto start = Clock::now();
      if (!poll_until(start + timeout))
        throw TimeoutError(info_.describe() + ": wait timed out after " +
                           seconds_text(std::chrono::duration<double>(Clock::now() - start).count()) + " s (timeout " +
                           seconds_text(timeout) + " s); the operation goes on under its own timeout of " +
                           seconds_text(info_.timeout) + " s");
    }
    if (blocks_host_) poll_until(Clock::time_point::max());
    rethrow_if_failed();
    // c10d semantics: the caller's stream, not the host, waits for the operation.
    c10::cuda::CUDAGuard guard(device_);
    end_.block(c10::cuda::getCurrentCUDAStream(device_));
  }

  void synchronize() override {
    poll_until(Clock::time_point::max());
    rethrow_if_failed();
  }

  std::exception_ptr exception() override {
    is_completed();  // picks up a device error
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  const OpInfo& info() const override { return info_; }

  // Fails a work that is still running. False when it already finished (it completed just in time).
  bool fail(std::exception_ptr error) {
    if (is_completed()) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != State::Running) return false;
    state_ = State::Failed;
    error_ = std::move(error);
    return true;
  }

  CudaEvent& end_event() { return end_; }
  Clock::time_point launched_at() const { return launched_at_; }

 private:
  enum class State { Running, Done, Failed };

  // Host-polls with short sleeps rather than cudaEventSynchronize, so a timeout or abort that fails
  // the work (without the event ever firing) still ends the wait.
  bool poll_until(Clock::time_point deadline) {
    auto pause = std::chrono::microseconds(20);
    while (!is_completed()) {
      const auto now = Clock::now();
      if (now >= deadline) return false;
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    return true;
  }

  void rethrow_if_failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) std::rethrow_exception(error_);
  }

  const OpInfo info_;
  const c10::DeviceIndex device_;
  const std::vector<at::Tensor> tensors_;  // kept alive as long as the work
  const bool blocks_host_;
  CudaEvent end_;
  const Clock::time_point launched_at_;
  std::mutex mutex_;
  State state_ = State::Running;
  std::exception_ptr error_;
};

// What outlives the communicator object for the job aborter's sake: the NCCL handle, the lock that
// keeps NCCL calls on it from overlapping, and the works still in flight.
struct CommState {
  CommState(ncclComm_t c, c10::DeviceIndex d) : comm(c), device(d) {}

  std::timed_mutex mutex;
  ncclComm_t comm;           // null once destroyed or aborted; guarded by mutex
  std::string abort_reason;  // guarded by mutex
  const c10::DeviceIndex device;

  std::mutex pending_mutex;
  std::vector<std::weak_ptr<NcclWork>> pending;  // in launch order (= order on the NCCL stream)

  void add_pending(const std::shared_ptr<NcclWork>& work) {
    std::lock_guard<std::mutex> lock(pending_mutex);
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const std::weak_ptr<NcclWork>& w) {
                                   auto p = w.lock();
                                   return !p || p->is_completed();
                                 }),
                  pending.end());
    pending.push_back(work);
  }

  // Fails the works launched after `after` (all of them when null) that have not finished.
  void fail_pending(const NcclWork* after, const std::function<std::exception_ptr(const OpInfo&)>& error) {
    std::vector<std::shared_ptr<NcclWork>> victims;
    {
      std::lock_guard<std::mutex> lock(pending_mutex);
      bool reached = after == nullptr;
      for (const auto& w : pending) {
        auto work = w.lock();
        if (!work) continue;
        if (!reached) {
          reached = work.get() == after;
          continue;
        }
        victims.push_back(std::move(work));
      }
    }
    for (auto& work : victims) work->fail(error(work->info()));
  }

  // Blocks until every pending work has finished; true when one of them failed. Bounded by the
  // operations' timeouts: the watchdog fails a work whose deadline passes.
  bool drain_pending() {
    std::vector<std::shared_ptr<NcclWork>> works;
    {
      std::lock_guard<std::mutex> lock(pending_mutex);
      for (const auto& w : pending)
        if (auto work = w.lock()) works.push_back(std::move(work));
      pending.clear();
    }
    bool failed = false;
    for (auto& work : works) {
      while (!work->is_completed()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      failed = failed || work->exception() != nullptr;
    }
    return failed;
  }

  // The job aborter's step (its own thread): fail what is in flight first, so that kernels ending
  // early because of the abort are not taken for completed operations, then abort the communicator.
  void abort(const std::string& reason) {
    fail_pending(nullptr, [&](const OpInfo& info) {
      return std::make_exception_ptr(CommError(info.describe() + ": aborted with the job: " + reason));
    });
    std::unique_lock<std::timed_mutex> lock(mutex, std::defer_lock);
    if (!lock.try_lock_for(std::chrono::seconds(1))) {
      // A thread is inside an NCCL call on this communicator (e.g. a split waiting for a rank that
      // is gone); aborting under it would free the communicator in use. The job's final abort step
      // ends the process, which releases the GPU resources anyway.
      LOOM_LOG(warn, "skipping ncclCommAbort: an NCCL call on this communicator has not returned within 1 s");
      return;
    }
    if (comm == nullptr) return;
    int previous = select_device_nothrow(device);
    ncclCommAbort(comm);
    restore_device_nothrow(previous);
    comm = nullptr;
    abort_reason = reason;
  }
};

void apply_policy(OnError policy, std::chrono::milliseconds grace, const std::string& message) {
  if (policy == OnError::Abort) detail::abort_job_after(grace, message);
}

class NcclCommunicator final : public Communicator {
 public:
  static std::shared_ptr<NcclCommunicator> create(ncclComm_t comm, int rank, int size, int world_rank,
                                                  c10::DeviceIndex device, const std::string& name,
                                                  const CommunicatorOptions& options) {
    std::shared_ptr<NcclCommunicator> self;
    try {
      // The destructor waits for operations and calls ncclCommDestroy/Abort: never on the
      // watchdog thread, whichever reference happens to be the last.
      self.reset(new NcclCommunicator(comm, rank, size, world_rank, device, name, options), [](NcclCommunicator* p) {
        if (detail::Watchdog::instance().on_watchdog_thread())
          std::thread([p] { delete p; }).detach();
        else
          delete p;
      });
    } catch (...) {
      ncclCommAbort(comm);  // local: the other ranks fail the same way (same options, same environment)
      throw;
    }
    self->self_ = self;
    std::weak_ptr<NcclCommunicator> weak = self;
    detail::Watchdog::instance().add_periodic([weak] {
      auto comm = weak.lock();
      if (!comm) return false;
      const bool again = comm->poll_async_error();
      release_off_watchdog(std::move(comm));
      return again;
    });
    return self;
  }

  ~NcclCommunicator() override {
    detail::unregister_abort_step(abort_handle_);
    try {
      // ncclCommDestroy would wait for queued operations without a timeout; waiting here, a
      // stuck operation is failed by the watchdog at its deadline and the communicator aborted.
      const bool failed = state_->drain_pending();
      std::lock_guard<std::timed_mutex> lock(state_->mutex);
      if (state_->comm == nullptr) return;
      int previous = select_device_nothrow(device_);
      if (failed || is_broken()) {
        LOOM_LOG(debug, "aborting NCCL communicator " << name() << " (broken)");
        ncclCommAbort(state_->comm);
      } else {
        ncclResult_t result = ncclCommDestroy(state_->comm);
        if (result != ncclSuccess)
          LOOM_LOG(warn, "ncclCommDestroy of " << name() << " failed: " << ncclGetErrorString(result));
      }
      restore_device_nothrow(previous);
      state_->comm = nullptr;
    } catch (const std::exception& e) {
      LOOM_LOG(error, "destroying NCCL communicator " << name() << " failed: " << e.what());
    }
  }

  const char* backend() const override { return "nccl"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }

 protected:
  // Before numbering (see Communicator::check_device): a tensor on another GPU is bad input.
  void check_device(const detail::Op& op) const override {
    for (const auto* list : {&op.inputs, &op.outputs})
      for (const auto& t : *list)
        if (t.device().index() != device_)
          throw InvalidArgumentError("[rank " + std::to_string(op.info.world_rank) + "] " +
                                     loom::to_string(op.info.type) + " group=" + op.info.group +
                                     ": expected tensors on cuda:" + std::to_string(device_) +
                                     " (this communicator's device), found one on " + t.device().str());
  }

  WorkPtr launch(detail::Op& op) override {
    const OpInfo& info = op.info;

    c10::cuda::CUDAGuard guard(device_);
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device_);
    // Allocated before anything is issued: running out of memory here is the caller's error and
    // leaves the communicator usable.
    at::Tensor scratch = scratch_for(op);

    std::vector<at::Tensor> keep_alive = op.inputs;
    keep_alive.insert(keep_alive.end(), op.outputs.begin(), op.outputs.end());
    if (scratch.defined()) keep_alive.push_back(scratch);
    auto work = std::make_shared<NcclWork>(info, device_, std::move(keep_alive), info.type == OpType::Barrier);

    try {
      std::lock_guard<std::timed_mutex> lock(state_->mutex);
      if (state_->comm == nullptr) throw CommError("the communicator was aborted: " + state_->abort_reason);
      // The NCCL stream must not read the inputs before the caller's stream has written them.
      ready_.record(caller);
      ready_.block(stream_);
      issue(op, scratch, state_->comm);
      work->end_event().record(stream_);
      // Registered under the lock, so an abort that follows cannot miss it (and take the early end
      // of its aborted kernels for a completion).
      state_->add_pending(work);
    } catch (const InvalidArgumentError&) {
      throw;
    } catch (const std::exception& e) {
      // An NCCL call that failed to enqueue leaves the communicator (and the peers waiting for this
      // rank) in an unknown state.
      const std::string message = info.describe() + ": launch failed: " + e.what();
      after_failure(message);
      throw CommError(message);
    }

    // The caller may free its tensors as soon as this returns: the caching allocator must not hand
    // their memory out again before the NCCL stream is done with it.
    for (const auto* list : {&op.inputs, &op.outputs})
      for (const auto& t : *list) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);

    detail::Watchdog::instance().watch(
        work, work->launched_at() + info.timeout,
        [weak = self_, work, policy = on_error(), grace = abort_grace_] { on_timeout(weak, work, policy, grace); });
    return work;
  }

  std::shared_ptr<Communicator> launch_split(int color, int key, const std::string& name,
                                             const CommunicatorOptions& options) override {
    const std::string what = "[rank " + std::to_string(world_rank()) + "] split of " + this->name() + " into " + name +
                             " (color " + std::to_string(color) + ", key " + std::to_string(key) + ")";
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    // ncclCommSplit waits for every rank without a timeout. A barrier first, under the watchdog
    // like any operation, turns a rank that never arrives into a TimeoutError rather than a hang.
    detail::Op arrival;
    arrival.info.type = OpType::Barrier;
    arrival.info.group = this->name();
    arrival.info.rank = rank();
    arrival.info.group_size = size();
    arrival.info.world_rank = world_rank();
    arrival.info.timeout = default_timeout();
    arrival.internal = true;
    try {
      launch(arrival)->synchronize();
    } catch (const TimeoutError& e) {
      throw TimeoutError(what + ": not every rank arrived: " + e.what());
    } catch (const CommError& e) {
      throw CommError(what + ": " + e.what());
    }

    ncclComm_t child = nullptr;
    {
      c10::cuda::CUDAGuard guard(device_);
      std::lock_guard<std::timed_mutex> lock(state_->mutex);
      if (state_->comm == nullptr) throw CommError(what + ": the communicator was aborted: " + state_->abort_reason);
      ncclResult_t result = ncclCommSplit(state_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr);
      if (result != ncclSuccess) throw CommError(what + " failed: " + nccl_error_text(result, state_->comm));
    }
    if (color < 0) return nullptr;
    int child_rank = 0, child_size = 0;
    ncclResult_t result = ncclCommUserRank(child, &child_rank);
    if (result == ncclSuccess) result = ncclCommCount(child, &child_size);
    if (result != ncclSuccess) {
      const std::string text = nccl_error_text(result, child);
      ncclCommAbort(child);
      throw CommError(what + ": reading the new communicator's rank failed: " + text);
    }
    LOOM_LOG(debug, what << ": rank " << child_rank << " of " << child_size);
    return create(child, child_rank, child_size, world_rank(), device_, name, options);
#else
    (void)options;
    throw InvalidArgumentError(what + ": ncclCommSplit needs NCCL 2.18 or newer, this build has " +
                               std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR));
#endif
  }

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int world_rank, c10::DeviceIndex device,
                   const std::string& name, const CommunicatorOptions& options)
      : Communicator(rank, size, world_rank, name, options),
        device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)),
        ready_(device),
        // Read now: a malformed value is reported when the communicator is made, not in the middle
        // of handling a failure.
        abort_grace_(env::seconds_as_duration("LOOM_ABORT_GRACE", 0, 600)),
        state_(std::make_shared<CommState>(comm, device)) {
    abort_handle_ = detail::register_abort_step([state = state_](const std::string& reason) { state->abort(reason); });
  }

  // The temporary device memory an operation needs, allocated on the NCCL stream (the caching
  // allocator then reuses it only in that stream's order, so it needs no recordStream).
  at::Tensor scratch_for(const detail::Op& op) {
    c10::cuda::CUDAStreamGuard on_nccl_stream(stream_);
    switch (op.info.type) {
      case OpType::Barrier:
        return at::empty({1}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
      case OpType::AllGather:
        // One NCCL call needs one contiguous receive buffer; the per-rank outputs are filled from it.
        if (op.list_output) {
          const at::Tensor& in = op.inputs[0];
          return at::empty({static_cast<int64_t>(size()) * in.numel()}, in.options());
        }
        return {};
      case OpType::AllToAll: {
        // Sends and receives of one group run concurrently: an output overlapping the input would be
        // overwritten while it is still being sent.
        const at::Tensor& in = op.inputs[0];
        const at::Tensor& out = op.outputs[0];
        const char* in_begin = bytes_of(in);
        const char* out_begin = bytes_of(out);
        const bool overlap =
            in.numel() > 0 && in_begin < out_begin + out.nbytes() && out_begin < in_begin + in.nbytes();
        return overlap ? at::empty({out.numel()}, out.options()) : at::Tensor();
      }
      default:
        return {};
    }
  }

  // Issues the NCCL call(s) of one operation on the NCCL stream. Zero-element operations issue
  // nothing: every rank has the same counts, so all of them skip together.
  void issue(detail::Op& op, const at::Tensor& scratch, ncclComm_t comm) {
    const cudaStream_t stream = stream_.stream();
    const OpInfo& info = op.info;
    switch (info.type) {
      case OpType::AllReduce: {
        at::Tensor& t = op.outputs[0];
        if (t.numel() == 0) return;
        check_nccl(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()),
                                 nccl_op(info.reduce, t.scalar_type()), comm, stream),
                   "ncclAllReduce", comm);
        return;
      }
      case OpType::Broadcast: {
        at::Tensor& t = op.outputs[0];
        if (t.numel() == 0) return;
        check_nccl(
            ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), info.peer, comm, stream),
            "ncclBroadcast", comm);
        return;
      }
      case OpType::AllGather: {
        const at::Tensor& in = op.inputs[0];
        if (in.numel() == 0) return;
        void* received = op.list_output ? scratch.data_ptr() : op.outputs[0].data_ptr();
        check_nccl(ncclAllGather(in.data_ptr(), received, in.numel(), nccl_type(in.scalar_type()), comm, stream),
                   "ncclAllGather", comm);
        if (op.list_output) {
          for (size_t r = 0; r < op.outputs.size(); ++r)
            check_cuda(cudaMemcpyAsync(op.outputs[r].data_ptr(), bytes_of(scratch) + r * in.nbytes(), in.nbytes(),
                                       cudaMemcpyDeviceToDevice, stream),
                       "cudaMemcpyAsync");
        }
        return;
      }
      case OpType::ReduceScatter: {
        const at::Tensor& in = op.inputs[0];
        at::Tensor& out = op.outputs[0];
        if (out.numel() == 0) return;
        check_nccl(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in.scalar_type()),
                                     nccl_op(info.reduce, in.scalar_type()), comm, stream),
                   "ncclReduceScatter", comm);
        return;
      }
      case OpType::AllToAll: {
        const at::Tensor& in = op.inputs[0];
        at::Tensor& out = op.outputs[0];
        const size_t chunk = static_cast<size_t>(in.numel() / size());
        if (chunk == 0) return;
        const size_t chunk_bytes = chunk * in.element_size();
        const ncclDataType_t type = nccl_type(in.scalar_type());
        char* received = scratch.defined() ? bytes_of(scratch) : bytes_of(out);
        check_nccl(ncclGroupStart(), "ncclGroupStart", comm);
        ncclResult_t result = ncclSuccess;
        const char* failed_call = "";
        for (int r = 0; r < size() && result == ncclSuccess; ++r) {
          result = ncclSend(bytes_of(in) + r * chunk_bytes, chunk, type, r, comm, stream);
          if (result != ncclSuccess) {
            failed_call = "ncclSend";
            break;
          }
          result = ncclRecv(received + r * chunk_bytes, chunk, type, r, comm, stream);
          if (result != ncclSuccess) failed_call = "ncclRecv";
        }
        // The group must be closed even when a call in it failed.
        const ncclResult_t end = ncclGroupEnd();
        check_nccl(result, failed_call, comm);
        check_nccl(end, "ncclGroupEnd", comm);
        if (scratch.defined())
          check_cuda(
              cudaMemcpyAsync(out.data_ptr(), scratch.data_ptr(), out.nbytes(), cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync");
        return;
      }
      case OpType::Send: {
        const at::Tensor& t = op.inputs[0];
        if (t.numel() == 0) return;
        check_nccl(ncclSend(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), info.peer, comm, stream), "ncclSend",
                   comm);
        return;
      }
      case OpType::Recv: {
        at::Tensor& t = op.outputs[0];
        if (t.numel() == 0) return;
        check_nccl(ncclRecv(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), info.peer, comm, stream), "ncclRecv",
                   comm);
        return;
      }
      case OpType::Barrier:
        // Any byte will do: max of garbage is still a completed all-reduce on every rank.
        check_nccl(ncclAllReduce(scratch.data_ptr(), scratch.data_ptr(), 1, ncclUint8, ncclMax, comm, stream),
                   "ncclAllReduce (barrier)", comm);
        return;
    }
  }

  // Watchdog thread, no lock held: ncclCommGetAsyncError reports network failures (a peer gone)
  // that leave the NCCL kernels spinning.
  bool poll_async_error() {
    std::string detail;
    {
      std::unique_lock<std::timed_mutex> lock(state_->mutex, std::try_to_lock);
      if (!lock.owns_lock()) return true;  // a launch, split or abort holds it: look again next time
      if (state_->comm == nullptr) return false;
      ncclResult_t async = ncclSuccess;
      ncclResult_t result = ncclCommGetAsyncError(state_->comm, &async);
      if (result == ncclSuccess) result = async;
      if (result == ncclSuccess || result == ncclInProgress) return true;
      detail = nccl_error_text(result, state_->comm);
    }
    const std::string message = "[rank " + std::to_string(world_rank()) + "] NCCL communicator " + name() + " (rank " +
                                std::to_string(rank()) + " of " + std::to_string(size()) +
                                ", cuda:" + std::to_string(device_) + ") failed: NCCL error: " + detail;
    mark_broken(message);
    state_->fail_pending(nullptr, [&](const OpInfo& info) {
      return std::make_exception_ptr(CommError(info.describe() + " failed: NCCL error: " + detail));
    });
    after_failure(message);
    return false;
  }

  static void on_timeout(const std::weak_ptr<NcclCommunicator>& weak, const std::shared_ptr<NcclWork>& work,
                         OnError policy, std::chrono::milliseconds grace) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - work->launched_at()).count();
    const std::string message = work->info().describe() + " timed out after " + seconds_text(elapsed) + " s (timeout " +
                                seconds_text(work->info().timeout) + " s)";
    auto self = weak.lock();
    if (work->is_completed()) return;  // completed just in time
    // Broken before the waiter wakes: a caller that sees the TimeoutError must find the
    // communicator refusing further operations.
    if (self) self->mark_broken(message);
    if (!work->fail(std::make_exception_ptr(TimeoutError(message)))) return;
    if (!self) {
      // Being destroyed: its destructor sees the failure and aborts the NCCL communicator.
      LOOM_LOG(error, message);
      apply_policy(policy, grace, message);
      return;
    }
    // Later operations are queued behind this one on the same stream: they cannot finish either.
    self->state_->fail_pending(work.get(), [&](const OpInfo& info) {
      return std::make_exception_ptr(
          CommError(info.describe() + ": not completed: communicator is broken by an earlier error: " + message));
    });
    self->after_failure(message);
    release_off_watchdog(std::move(self));
  }

  void after_failure(const std::string& message) {
    mark_broken(message);
    LOOM_LOG(error, message);
    apply_policy(on_error(), abort_grace_, message);
  }

  // The watchdog thread must not run a communicator's destructor: it waits for operations and calls
  // ncclCommDestroy/ncclCommAbort, which would stall detection for every other communicator. When
  // the watchdog holds the last reference, the release happens on a thread of its own. (Only the
  // watchdog thread turns the weak references into strong ones, so a count of 1 is exact.)
  static void release_off_watchdog(std::shared_ptr<NcclCommunicator> comm) {
    comm.reset();  // the deleter (see create) moves a last release off the watchdog thread
  }

  const c10::DeviceIndex device_;
  const c10::cuda::CUDAStream stream_;
  CudaEvent ready_;  // marks the caller's stream at launch; used under state_->mutex
  const std::chrono::milliseconds abort_grace_;
  std::shared_ptr<CommState> state_;
  std::weak_ptr<NcclCommunicator> self_;
  int abort_handle_ = -1;
};

}  // namespace

bool compiled() {
  return true;
}

bool device_available() {
  return c10::cuda::device_count() > 0;
}

int device_count() {
  return c10::cuda::device_count();
}

std::shared_ptr<Communicator> make_communicator(std::shared_ptr<Communicator> bootstrap, int device_index,
                                                const std::string& name, const CommunicatorOptions& options) {
  if (!bootstrap)
    throw InvalidArgumentError("NCCL communicator " + name + " not created: the bootstrap communicator is null");
  if (bootstrap->device_type() != c10::DeviceType::CPU)
    throw InvalidArgumentError("NCCL communicator " + name + " not created: the bootstrap communicator must be a " +
                               "CPU (MPI) one, found backend " + bootstrap->backend());
  const int rank = bootstrap->rank();
  const int size = bootstrap->size();
  const auto cpu = at::TensorOptions().device(at::kCPU);

  // Every rank learns whether every rank can use its device, so that all fail together rather than
  // some waiting in ncclCommInitRank for ranks that gave up.
  const int visible = c10::cuda::device_count();
  std::string problem;
  if (device_index < 0 || device_index >= visible)
    problem = "device index " + std::to_string(device_index) + " is out of range: " + std::to_string(visible) +
              " CUDA device(s) visible";
  at::Tensor mine = at::empty({1}, cpu.dtype(at::kInt));
  mine.data_ptr<int32_t>()[0] = problem.empty() ? 1 : 0;
  at::Tensor usable = at::empty({size}, cpu.dtype(at::kInt));
  auto gathered = bootstrap->all_gather(usable, mine);
  gathered->wait();
  // The bootstrap's operations carry this process's rank in the job, which messages name.
  const int world_rank = gathered->info().world_rank;
  const std::string who = "[rank " + std::to_string(world_rank) + "] NCCL communicator " + name;
  std::string unusable;
  for (int r = 0; r < size; ++r)
    if (usable.data_ptr<int32_t>()[r] == 0) unusable += (unusable.empty() ? "" : ",") + std::to_string(r);
  if (!unusable.empty())
    throw InvalidArgumentError(who + " not created: " + (problem.empty() ? "" : problem + "; ") + "bootstrap rank(s) " +
                               unusable + " cannot use their CUDA device");

  // Rank 0's unique id, plus a byte saying whether it could make one (so the others do not wait
  // in ncclCommInitRank for a rank that failed).
  at::Tensor id = at::empty({NCCL_UNIQUE_ID_BYTES + 1}, cpu.dtype(at::kByte));
  std::memset(id.data_ptr(), 0, id.nbytes());
  std::string id_error;
  if (rank == 0) {
    ncclUniqueId unique;
    ncclResult_t result = ncclGetUniqueId(&unique);
    if (result == ncclSuccess) {
      std::memcpy(id.data_ptr(), &unique, NCCL_UNIQUE_ID_BYTES);
      id.data_ptr<uint8_t>()[NCCL_UNIQUE_ID_BYTES] = 1;
    } else {
      id_error = nccl_error_text(result, nullptr);
    }
  }
  bootstrap->broadcast(id, {/*root=*/0})->wait();
  if (id.data_ptr<uint8_t>()[NCCL_UNIQUE_ID_BYTES] != 1)
    throw CommError(who + " not created: ncclGetUniqueId failed on bootstrap rank 0" +
                    (id_error.empty() ? std::string() : ": " + id_error));
  ncclUniqueId unique;
  std::memcpy(&unique, id.data_ptr(), NCCL_UNIQUE_ID_BYTES);

  ncclComm_t comm = nullptr;
  {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
    ncclResult_t result = ncclCommInitRank(&comm, size, unique, rank);
    if (result != ncclSuccess)
      throw CommError(who + " not created: ncclCommInitRank (rank " + std::to_string(rank) + " of " +
                      std::to_string(size) + ", cuda:" + std::to_string(device_index) +
                      ") failed: " + nccl_error_text(result, nullptr));
  }
  int version = 0;
  ncclGetVersion(&version);
  LOOM_LOG(info, "NCCL communicator " << name << " ready: rank " << rank << " of " << size
                                      << " on cuda:" << device_index << ", NCCL " << version / 10000 << "."
                                      << version % 10000 / 100 << "." << version % 100);
  return NcclCommunicator::create(comm, rank, size, world_rank, static_cast<c10::DeviceIndex>(device_index), name,
                                  options);
}

}  // namespace loom::nccl
