// The NCCL backend: CUDA tensors of one device. Each communicator owns one CUDA stream from
// LibTorch's pool and issues its operations on it in submission order. An issue makes that stream
// wait for the caller's current stream (the inputs were produced there), makes the NCCL call(s)
// and records an end event that the Work polls (the watchdog, is_completed) or makes another
// stream wait on (wait).
//
// The comm core owns each operation's life: it registers the deadline with the watchdog before
// this file makes any NCCL call, and its failure path applies the error policy (the job aborter
// runs ncclCommAbort as one of its steps; the raise policy calls abort_backend on a helper
// thread). Communicators are nonblocking: a call that returns ncclInProgress (connecting to a
// peer, a split, a group) is polled against the operation's deadline, never waited for blindly.
#include "comm/nccl/nccl_communicator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "comm/abort.h"
#include "comm/deadline.h"
#include "comm/durations.h"
#include "comm/nccl/nccl_types.h"
#include "comm/op.h"
#include "comm/watchdog.h"
#include "loom/log.h"
#include "loom/trace.h"

namespace loom::nccl::detail {
namespace {

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// Thrown inside an issue when NCCL is still setting an operation up at its deadline.
struct StillInProgress {
  const char* call;
};

// Destructions running on detached threads (see create()): counted so that shutdown waits for them.
struct DetachedDestructions {
  std::mutex mutex;
  std::condition_variable done;
  int running = 0;
};
DetachedDestructions& detached() {
  static auto* state = new DetachedDestructions();  // never destroyed: a detached thread may outlive main
  return *state;
}

std::mutex g_live_mutex;
std::vector<std::weak_ptr<NcclCommunicator>>& live() {
  static auto* communicators = new std::vector<std::weak_ptr<NcclCommunicator>>();
  return *communicators;
}

}  // namespace

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(std::shared_ptr<NcclHandle> handle, int rank,
                                                           std::vector<int> members, c10::DeviceIndex device,
                                                           const std::string& name,
                                                           const CommunicatorOptions& options) {
  std::shared_ptr<NcclCommunicator> self;
  try {
    // The destructor waits for operations and calls ncclCommDestroy/Abort: never on the watchdog
    // thread, whichever reference happens to be the last.
    self.reset(new NcclCommunicator(handle, rank, std::move(members), device, name, options), [](NcclCommunicator* p) {
      if (loom::detail::Watchdog::instance().on_watchdog_thread()) {
        auto& state = detached();
        {
          std::lock_guard<std::mutex> lock(state.mutex);
          ++state.running;
        }
        std::thread([p, &state] {
          delete p;
          std::lock_guard<std::mutex> lock(state.mutex);
          --state.running;
          state.done.notify_all();
        }).detach();
      } else
        delete p;
    });
  } catch (...) {
    ncclCommAbort(handle->comm);  // local: the other ranks fail the same way (same options, same environment)
    handle->comm = nullptr;
    throw;
  }
  std::weak_ptr<NcclCommunicator> weak = self;
  loom::detail::Watchdog::instance().add_periodic([weak] {
    auto comm = weak.lock();
    if (!comm) return false;
    return comm->poll_async_error();
  });
  std::lock_guard<std::mutex> lock(g_live_mutex);
  auto& all = live();
  all.erase(std::remove_if(all.begin(), all.end(), [](const auto& w) { return w.expired(); }), all.end());
  all.push_back(self);
  return self;
}

std::vector<std::shared_ptr<NcclCommunicator>> NcclCommunicator::all_live() {
  std::lock_guard<std::mutex> lock(g_live_mutex);
  std::vector<std::shared_ptr<NcclCommunicator>> result;
  for (const auto& w : live())
    if (auto p = w.lock()) result.push_back(std::move(p));
  return result;
}

bool NcclCommunicator::wait_for_detached_destructions(std::chrono::milliseconds limit) {
  auto& state = detached();
  std::unique_lock<std::mutex> lock(state.mutex);
  return state.done.wait_for(lock, limit, [&] { return state.running == 0; });
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclHandle> handle, int rank, std::vector<int> members,
                                   c10::DeviceIndex device, const std::string& name,
                                   const CommunicatorOptions& options)
    : Communicator(rank, std::move(members), name, at::Device(at::kCUDA, device), options),
      device_index_(device),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)),
      ready_(device, /*timing=*/false),
      events_(std::make_shared<EventPool>(device, /*timing=*/false)),
      handle_(std::move(handle)) {
  if (trace::enabled()) {
    // Device times of operations, mapped onto the host clock through one anchor event.
    timing_events_ = std::make_shared<EventPool>(device, /*timing=*/true);
    auto clock = std::make_shared<DeviceClock>();
    clock->anchor = timing_events_->get();
    c10::cuda::CUDAGuard guard(device_index_);
    clock->anchor->record(stream_);
    clock->anchor->synchronize();
    clock->anchor_time = Clock::now();
    clock_ = clock;
  }
  abort_handle_ = loom::detail::register_abort_step([h = handle_](const std::string& reason) { h->abort(reason); });
}

NcclCommunicator::~NcclCommunicator() {
  loom::detail::unregister_abort_step(abort_handle_);
  shutdown();
}

void NcclCommunicator::shutdown() {
  if (shut_down_.exchange(true)) return;
  try {
    // ncclCommDestroy would wait for queued operations without a timeout; waiting here, a stuck
    // operation is failed by the watchdog at its deadline first.
    drain();
    std::lock_guard<std::timed_mutex> lock(handle_->mutex);
    if (handle_->comm == nullptr) return;
    const int previous = select_device_nothrow(device_index_);
    if (is_broken()) {
      LOOM_LOG(debug, "aborting NCCL communicator " << name() << " (broken)");
      handle_->abort_locked();
    } else {
      // Finalize flushes what NCCL still holds (nonblocking: poll it, bounded by the timeout).
      ncclResult_t result = handle_->await(ncclCommFinalize(handle_->comm),
                                           loom::detail::deadline_after<Clock>(Clock::now(), default_timeout()));
      if (result == ncclSuccess) {
        result = ncclCommDestroy(handle_->comm);
      } else {
        LOOM_LOG(warn, "ncclCommFinalize of " << name() << " did not finish ("
                                              << (result == ncclInProgress ? "timed out" : nccl_error_text(result, handle_->comm))
                                              << "); aborting it");
        ncclCommAbort(handle_->comm);
      }
      if (result != ncclSuccess)
        LOOM_LOG(warn, "ncclCommDestroy of " << name() << " failed: " << ncclGetErrorString(result));
    }
    restore_device_nothrow(previous);
    handle_->comm = nullptr;
  } catch (const std::exception& e) {
    LOOM_LOG(error, "destroying NCCL communicator " << name() << " failed: " << e.what());
  }
}

void NcclCommunicator::abort_local(const std::string& reason) {
  shut_down_.store(true);
  handle_->abort(reason);
}

void NcclCommunicator::abort_backend(const std::string& reason) { handle_->abort(reason); }

// The temporary device memory an operation needs, allocated on the NCCL stream (the caching
// allocator then reuses it only in that stream's order, so it needs no recordStream).
at::Tensor NcclCommunicator::scratch_for(const loom::detail::Op& op) {
  c10::cuda::CUDAStreamGuard on_nccl_stream(stream_);
  switch (op.info.type) {
    case OpType::Barrier:
      return at::empty({1}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_index_));
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
      const bool overlap = in.numel() > 0 && in_begin < out_begin + out.nbytes() && out_begin < in_begin + in.nbytes();
      return overlap ? at::empty({out.numel()}, out.options()) : at::Tensor();
    }
    default:
      return {};
  }
}

std::shared_ptr<Work> NcclCommunicator::make_work(const loom::detail::Op& op) {
  if (op.info.type == OpType::Split) return Communicator::make_work(op);
  std::vector<at::Tensor> keep_alive = op.inputs;
  keep_alive.insert(keep_alive.end(), op.outputs.begin(), op.outputs.end());
  at::Tensor scratch;
  {
    c10::cuda::CUDAGuard guard(device_index_);
    try {
      scratch = scratch_for(op);
    } catch (const c10::Error& e) {
      // Before anything is issued: the caller's error (out of memory), the communicator stays usable.
      throw InvalidArgumentError(op.info.describe() + ": allocating its scratch buffer failed: " + e.what_without_backtrace());
    }
  }
  return std::make_shared<NcclWork>(op.info, std::move(keep_alive), std::move(scratch), device_index_, events_->get(),
                                    timing_events_ ? timing_events_->get() : nullptr, clock_);
}

// A collective captured into a CUDA graph would be replayed without this communicator knowing of
// it, and its watchdog and waiters query the operation's CUDA events, which a capture forbids (the
// query invalidates the capture, or reads as a device error that breaks the communicator).
// PyTorch's ProcessGroupNCCL keeps captured works away from its watchdog; here they are refused by
// name before they are numbered, and the capture can still end cleanly.
std::string NcclCommunicator::unsupported(const OpInfo& info) const {
  if (info.type == OpType::Split) return {};
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index_).stream();
  if (cudaStreamIsCapturing(caller, &capture) != cudaSuccess || capture == cudaStreamCaptureStatusNone) return {};
  return "the caller's CUDA stream is capturing a CUDA graph, and torchloom's NCCL operations cannot be captured "
         "(the watchdog and waiters query their CUDA events, which a capture forbids; torch.compile's "
         "mode='reduce-overhead' captures too): issue the collective outside the captured region";
}

void NcclCommunicator::issue(loom::detail::Op& op, const std::shared_ptr<Work>& base) {
  if (op.info.type == OpType::Split) {
    issue_split(op, base);
    return;
  }
  auto work = std::static_pointer_cast<NcclWork>(base);
  const at::Tensor& scratch = work->scratch();
  const OpInfo& info = op.info;

  c10::cuda::CUDAGuard guard(device_index_);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device_index_);
  start(*work);
  const auto deadline = loom::detail::deadline_after<Clock>(Clock::now(), info.timeout);
  {
    std::unique_lock<std::timed_mutex> lock(handle_->mutex);
    if (handle_->comm == nullptr) throw CommError(info.describe() + ": the communicator was aborted: " + handle_->abort_reason);
    // The NCCL stream must not read the inputs before the caller's stream has written them.
    ready_.record(caller);
    ready_.block(stream_);
    // The caller may free its tensors as soon as this returns: the caching allocator must not hand
    // their memory out again before the NCCL stream is done with it. Told before the NCCL call: a
    // launch still in progress at the deadline may yet happen on NCCL's own thread.
    for (const auto* list : {&op.inputs, &op.outputs})
      for (const auto& t : *list) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    if (work->start_event() != nullptr) work->start_event()->record(stream_);
    try {
      enqueue(op, scratch, deadline, [&] { return work->is_completed(); });
    } catch (const StillInProgress& pending) {
      lock.unlock();
      const std::string message = info.describe() + " timed out after " +
                                  loom::detail::seconds_text(info.timeout) + " s (timeout " +
                                  loom::detail::seconds_text(info.timeout) + " s) while " + pending.call +
                                  " was still in progress (NCCL connecting to a peer that has not called it)";
      fail(work, std::make_exception_ptr(TimeoutError(message)), message);
      return;
    }
    // A device fault (a sticky CUDA error) fails the work; it must break the communicator too.
    // Set before the work can be polled as launched.
    std::weak_ptr<Communicator> weak_self = weak_from_this();
    std::weak_ptr<Work> weak_work = work;
    work->on_device_error([weak_self, weak_work](const std::string& message) {
      auto self = std::static_pointer_cast<NcclCommunicator>(weak_self.lock());
      auto w = weak_work.lock();
      if (self && w) self->defer_failure(w, message);
    });
    work->end_event().record(stream_);
    work->mark_launched();
  }
}

// Issues the NCCL call(s) of one operation on the NCCL stream, with the handle's mutex held.
// Zero-element operations issue nothing: every rank has the same counts, so all skip together.
void NcclCommunicator::enqueue(loom::detail::Op& op, const at::Tensor& scratch, Clock::time_point deadline,
                               const std::function<bool()>& give_up) {
  const cudaStream_t stream = stream_.stream();
  const ncclComm_t comm = handle_->comm;
  const OpInfo& info = op.info;
  // Each call is awaited before anything else goes on the stream: with a nonblocking communicator
  // ncclInProgress means the kernel is not on the stream yet.
  auto nccl = [&](ncclResult_t result, const char* call) {
    result = handle_->await(result, deadline, give_up);
    if (result == ncclInProgress) throw StillInProgress{call};
    if (result != ncclSuccess) throw CommError(info.describe() + ": " + call + " failed: " + nccl_error_text(result, comm));
  };
  switch (info.type) {
    case OpType::AllReduce: {
      at::Tensor& t = op.outputs[0];
      if (t.numel() == 0) return;
      nccl(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_datatype(t.scalar_type()),
                         nccl_reduce_op(info.reduce, t.scalar_type()), comm, stream),
           "ncclAllReduce");
      return;
    }
    case OpType::Broadcast: {
      at::Tensor& t = op.outputs[0];
      if (t.numel() == 0) return;
      nccl(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_datatype(t.scalar_type()), info.peer, comm, stream),
           "ncclBroadcast");
      return;
    }
    case OpType::AllGather: {
      const at::Tensor& in = op.inputs[0];
      if (in.numel() == 0) return;
      void* received = op.list_output ? scratch.data_ptr() : op.outputs[0].data_ptr();
      nccl(ncclAllGather(in.data_ptr(), received, in.numel(), nccl_datatype(in.scalar_type()), comm, stream),
           "ncclAllGather");
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
      nccl(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_datatype(in.scalar_type()),
                             nccl_reduce_op(info.reduce, in.scalar_type()), comm, stream),
           "ncclReduceScatter");
      return;
    }
    case OpType::AllToAll:
      return enqueue_all_to_all(op, scratch, deadline, give_up);
    case OpType::Send: {
      const at::Tensor& t = op.inputs[0];
      if (t.numel() == 0) return;
      nccl(ncclSend(t.data_ptr(), t.numel(), nccl_datatype(t.scalar_type()), info.peer, comm, stream), "ncclSend");
      return;
    }
    case OpType::Recv: {
      at::Tensor& t = op.outputs[0];
      if (t.numel() == 0) return;
      nccl(ncclRecv(t.data_ptr(), t.numel(), nccl_datatype(t.scalar_type()), info.peer, comm, stream), "ncclRecv");
      return;
    }
    case OpType::SendRecvBatch:
      return enqueue_send_recv_batch(op, deadline, give_up);
    case OpType::Barrier:
      // Any byte will do: max of garbage is still a completed all-reduce on every rank.
      nccl(ncclAllReduce(scratch.data_ptr(), scratch.data_ptr(), 1, ncclUint8, ncclMax, comm, stream),
           "ncclAllReduce (barrier)");
      return;
    case OpType::Split:
      return;  // issue_split
  }
}

void NcclCommunicator::enqueue_all_to_all(loom::detail::Op& op, const at::Tensor& scratch, Clock::time_point deadline,
                                          const std::function<bool()>& give_up) {
  const cudaStream_t stream = stream_.stream();
  const ncclComm_t comm = handle_->comm;
  const at::Tensor& in = op.inputs[0];
  at::Tensor& out = op.outputs[0];
  const size_t chunk = static_cast<size_t>(in.numel() / size());
  if (chunk == 0) return;
  const size_t chunk_bytes = chunk * in.element_size();
  const ncclDataType_t type = nccl_datatype(in.scalar_type());
  char* received = scratch.defined() ? bytes_of(scratch) : bytes_of(out);
  group(deadline, give_up, op.info, [&] {
    for (int r = 0; r < size(); ++r) {
      ncclResult_t result = ncclSend(bytes_of(in) + r * chunk_bytes, chunk, type, r, comm, stream);
      if (result == ncclSuccess) result = ncclRecv(received + r * chunk_bytes, chunk, type, r, comm, stream);
      if (result != ncclSuccess && result != ncclInProgress) return result;
    }
    return ncclSuccess;
  });
  if (scratch.defined())
    check_cuda(cudaMemcpyAsync(out.data_ptr(), scratch.data_ptr(), out.nbytes(), cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpyAsync");
}

void NcclCommunicator::enqueue_send_recv_batch(loom::detail::Op& op, Clock::time_point deadline,
                                               const std::function<bool()>& give_up) {
  const cudaStream_t stream = stream_.stream();
  const ncclComm_t comm = handle_->comm;
  // One group: NCCL starts every send and receive together, so no order of them can deadlock.
  group(deadline, give_up, op.info, [&] {
    for (const auto& p : op.batch) {
      if (p.tensor.numel() == 0) continue;
      const ncclDataType_t type = nccl_datatype(p.tensor.scalar_type());
      const ncclResult_t result = p.kind == P2POp::Kind::Send
                                      ? ncclSend(p.tensor.data_ptr(), p.tensor.numel(), type, p.peer, comm, stream)
                                      : ncclRecv(p.tensor.data_ptr(), p.tensor.numel(), type, p.peer, comm, stream);
      if (result != ncclSuccess && result != ncclInProgress) return result;
    }
    return ncclSuccess;
  });
}

void NcclCommunicator::group(Clock::time_point deadline, const std::function<bool()>& give_up, const OpInfo& info,
                             const std::function<ncclResult_t()>& calls) {
  const ncclComm_t comm = handle_->comm;
  ncclResult_t result = ncclGroupStart();
  if (result != ncclSuccess) throw CommError(info.describe() + ": ncclGroupStart failed: " + nccl_error_text(result, comm));
  const ncclResult_t inside = calls();
  // The group must be closed even when a call in it failed.
  const ncclResult_t end = handle_->await(ncclGroupEnd(), deadline, give_up);
  if (inside != ncclSuccess) throw CommError(info.describe() + ": a call in the group failed: " + nccl_error_text(inside, comm));
  if (end == ncclInProgress) throw StillInProgress{"ncclGroupEnd"};
  if (end != ncclSuccess) throw CommError(info.describe() + ": ncclGroupEnd failed: " + nccl_error_text(end, comm));
}

// A split: ranks first exchange (color, key, job rank) on this communicator, which is also the
// arrival barrier (a rank that never comes makes it time out, rather than ncclCommSplit wait), and
// tells every rank the new communicator's members; then ncclCommSplit, polled to its deadline.
void NcclCommunicator::issue_split(loom::detail::Op& op, const std::shared_ptr<Work>& work) {
  start(*work);
  const auto deadline = loom::detail::deadline_after<Clock>(Clock::now(), op.info.timeout);
  const auto& request = *op.split;
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(at::kCUDA, device_index_);
  at::Tensor mine = at::tensor({static_cast<int64_t>(request.color), static_cast<int64_t>(request.key),
                                static_cast<int64_t>(job_rank())},
                               at::kLong)
                        .to(on_device.device());
  at::Tensor all = at::empty({3 * size()}, on_device);
  {
    loom::detail::InternalOperations internal("split membership");
    all_gather(all, mine)->synchronize();
  }
  all = all.cpu();
  const int64_t* words = all.data_ptr<int64_t>();
  std::vector<std::tuple<int64_t, int, int>> same_color;  // (key, parent rank, job rank)
  for (int r = 0; r < size(); ++r)
    if (words[3 * r] == request.color) same_color.emplace_back(words[3 * r + 1], r, static_cast<int>(words[3 * r + 2]));
  std::sort(same_color.begin(), same_color.end());
  std::vector<int> members;
  int child_rank = -1;
  for (size_t i = 0; i < same_color.size(); ++i) {
    members.push_back(std::get<2>(same_color[i]));
    if (std::get<1>(same_color[i]) == rank()) child_rank = static_cast<int>(i);
  }

  // NCCL keeps the child's address and writes it when the split's job ends (NCCL 2.30 sets it only
  // then): heap storage, left with the parent's handle when the split times out.
  auto slot = std::make_unique<ncclComm_t>(nullptr);
  ncclResult_t result;
  {
    c10::cuda::CUDAGuard guard(device_index_);
    std::lock_guard<std::timed_mutex> lock(handle_->mutex);
    if (handle_->comm == nullptr)
      throw CommError(op.info.describe() + ": the communicator was aborted: " + handle_->abort_reason);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    result = ncclCommSplit(handle_->comm, request.color < 0 ? NCCL_SPLIT_NOCOLOR : request.color, request.key,
                           slot.get(), &config);
    if (result == ncclInProgress) {
      // The new communicator (or, before NCCL has made one, the parent) reports the split's progress.
      if (*slot != nullptr) {
        NcclHandle pending(*slot, device_index_);
        result = pending.await(result, deadline);
      } else {
        result = handle_->await(result, deadline);
      }
    }
    if (result == ncclInProgress) {
      // Aborting the parent (the error policy's abort, or its destruction) joins the split's job and
      // then aborts the child it wrote.
      handle_->unfinished_splits.push_back(std::move(slot));
    }
  }
  if (result == ncclInProgress)
    throw TimeoutError(op.info.describe() + " timed out after " + loom::detail::seconds_text(op.info.timeout) +
                       " s in ncclCommSplit");
  ncclComm_t child = *slot;
  if (result != ncclSuccess) {
    if (child != nullptr) ncclCommAbort(child);
    throw CommError(op.info.describe() + ": ncclCommSplit failed: " + nccl_error_text(result, handle_->comm));
  }
  if (request.color >= 0) {
    LOOM_LOG(debug, op.info.describe() << ": rank " << child_rank << " of " << members.size());
    op.split->result = create(std::make_shared<NcclHandle>(child, device_index_), child_rank, std::move(members),
                              device_index_, request.name, request.options);
  }
  finish(*work);
}

// Watchdog thread, no lock held: ncclCommGetAsyncError reports network failures (a peer gone) that
// leave the NCCL kernels spinning.
bool NcclCommunicator::poll_async_error() {
  std::string detail;
  {
    std::unique_lock<std::timed_mutex> lock(handle_->mutex, std::try_to_lock);
    if (!lock.owns_lock()) return true;  // an issue, split or abort holds it: look again next time
    if (handle_->comm == nullptr) return false;
    ncclResult_t state = ncclSuccess;
    ncclResult_t result = ncclCommGetAsyncError(handle_->comm, &state);
    if (result == ncclSuccess) result = state;
    if (result == ncclSuccess || result == ncclInProgress) return true;
    detail = nccl_error_text(result, handle_->comm);
  }
  fail_all(context("NCCL communicator")("failed on cuda:" + std::to_string(device_index_) + ": NCCL error: " + detail));
  return false;
}

}  // namespace loom::nccl::detail
