// The MPI backend: CPU tensors, operations run in submission order on one progress thread per
// communicator. Collectives are the blocking MPI calls (Open MPI's tuned algorithms, no copies:
// all_reduce is in place); point-to-point operations are posted non-blocking and polled, so a
// send waiting for its receiver never blocks the collectives queued behind it. The comm core
// owns each operation's life (numbering, watchdog, failure path); this file only runs them.
#include <ATen/ops/empty.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "comm/fingerprint.h"
#include "comm/mpi_check.h"
#include "comm/mpi_counts.h"
#include "comm/mpi_in_band.h"
#include "comm/mpi_state.h"
#include "comm/mpi_types.h"
#include "comm/op.h"
#include "loom/comm/mpi.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom::mpi {
namespace {

class MpiCommunicator;
// Every MPI communicator alive: loom::finalize() stops their progress threads before MPI_Finalize.
std::mutex g_live_mutex;
std::set<MpiCommunicator*> g_live;

using Clock = std::chrono::steady_clock;

using detail::check_mpi;

int element_count(const at::Tensor& t, const detail::Op& op) {
  if (t.numel() > INT_MAX)
    throw InvalidArgumentError(op.info.describe() + ": " + std::to_string(t.numel()) +
                               " elements exceed the MPI backend's limit of " + std::to_string(INT_MAX) +
                               " per operation (split the tensor)");
  return static_cast<int>(t.numel());
}

// The job ranks of a communicator's members, in its rank order.
std::vector<int> members_of(MPI_Comm comm) {
  MPI_Group group, world;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  int size = 0;
  MPI_Group_size(group, &size);
  std::vector<int> ranks(size), in_world(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  MPI_Group_translate_ranks(group, size, ranks.data(), world, in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return in_world;
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, const CommunicatorOptions& options)
      : Communicator(rank_of(comm), members_of(comm), std::move(name), at::Device(at::kCPU), options),
        comm_(comm),
        band_comm_(duplicate(comm)),
        band_(band_comm_, kInBandMaxBytes) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    thread_ = std::thread([this] { progress_loop(); });
    std::lock_guard<std::mutex> lock(g_live_mutex);
    g_live.insert(this);
  }

  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(g_live_mutex);
      g_live.erase(this);
    }
    LOOM_LOG(debug, "communicator " << name() << ": " << ran_by_waiter_.load() << " operations run by their waiter, "
                                    << ran_by_progress_thread_.load() << " by the progress thread");
    if (!stop_progress_thread("communicator destroyed first", /*any_stuck_call=*/false)) {
      LOOM_LOG(warn, "communicator " << name() << " destroyed while an operation is stuck in MPI");
      return;
    }
    if (initialized()) {
      MPI_Comm_free(&band_comm_);
      MPI_Comm_free(&comm_);
    }
  }

  const char* backend() const override { return "mpi"; }

  // MPI_Finalize is next, with this communicator still alive (a Python process group not yet
  // destroyed, a group the program kept): its progress thread must not call MPI from now on (one
  // polling a timed-out receive during MPI_Finalize crashed the process). Its operations not yet
  // run fail, and later ones are refused. False when the thread is stuck inside an MPI call.
  bool stop_for_finalize() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finalized_ = true;
    }
    return stop_progress_thread("loom::finalize() ran first", /*any_stuck_call=*/true);
  }

  ProgressCounters counters() const {
    return {ran_by_waiter_.load(), ran_by_progress_thread_.load(), submission_wakeups_.load()};
  }

  void assist(Work* work, bool run_here) override {
    if (run_here) run_if_next(work);
    else hand_to_progress_thread(work);
  }

 protected:
  void issue(detail::Op& op, const std::shared_ptr<Work>& work) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finalized_)
        throw CommError(op.info.describe() + ": expected MPI still running, found it finalized (loom::finalize() "
                                             "ran; communicators kept past it can no longer communicate)");
    }
    for (const auto& t : op.inputs) element_count(t, op);
    for (const auto& t : op.outputs) element_count(t, op);
    const OpType type = op.info.type;
    const bool collective = type != OpType::Send && type != OpType::Recv && type != OpType::SendRecvBatch;
    // Only with LOOM_ON_ERROR=abort: a caller stuck inside MPI could not raise its timeout, but
    // the abort still ends the job.
    const bool inline_ok = collective && type != OpType::Split && on_error() == OnError::Abort;
    if (inline_ok) accept_assists(*work);
    int64_t bytes = 0;
    for (const auto& t : op.outputs) bytes += static_cast<int64_t>(t.nbytes());
    bool notify;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Waking the progress thread costs the submitter a system call and, on a shared core, a
      // context switch: most of what a small operation adds over raw MPI. When the caller's
      // previous operation was run by its own waiter (submit, then wait), this one probably will
      // be too, and the thread is left asleep, unless it sleeps without a deadline: a poll or a
      // timed wait on the operation (hand_to_progress_thread), a second submission, or the
      // thread's kSafetyTick starts it otherwise. Callers that overlap say so
      // (Work::run_in_background: DDP's buckets, tensor parallelism's backward). Very large
      // operations always wake it: there the wake-up is lost in the transfer, and a late start
      // of an unannounced overlap would cost most.
      // One wake-up at a time: until the woken thread has looked at the queue (on the same core it
      // may not run for a while, as its waiter spins in MPI), another would only cost a system
      // call (seen in CI: 1473 wake-ups in 3000 calls that every waiter ran itself).
      notify = !woken_ &&
               (deep_ || (sleeping_ && (!inline_ok || !waiter_runs_ || !queue_.empty() || bytes >= kAlwaysWakeBytes)));
      woken_ = woken_ || notify;
      queue_.push_back(Task{std::move(op), work, inline_ok, Clock::now()});
      ++submissions_;
    }
    if (notify) {
      submission_wakeups_.fetch_add(1, std::memory_order_relaxed);
      wake_.notify_one();
    }
  }

 private:
  struct Task {
    detail::Op op;
    std::shared_ptr<Work> work;
    bool inline_ok = false;  // a waiter may run it itself
    Clock::time_point submitted{};
  };
  // One send or receive of a point-to-point operation in flight (a batch has several).
  struct Leg {
    bool send = false;
    at::Tensor tensor;
    int peer = 0;
    int tag = 0;
    // A send is posted at once. A receive is posted only once its message has been probed and
    // found to be the tensor's size (see poll_p2p); until then it has no request.
    MPI_Request request = MPI_REQUEST_NULL;
    bool posted = false;
  };
  struct PendingP2P {
    std::vector<Leg> legs;
    std::shared_ptr<Work> work;
    detail::Op op;
  };
  // Submit-then-wait is the common pattern: the progress thread gives the submitter this long to
  // claim the operation itself (run_if_next) before taking it.
  static constexpr std::chrono::microseconds kClaimGrace{20};
  // How often a sleeping progress thread looks at the queue while submissions are left to their
  // waiters (they are not woken for): bounds how late an operation nobody polls or waits on
  // starts when that guess was wrong.
  static constexpr std::chrono::milliseconds kSafetyTick{1};
  // Operations of at least this many bytes always wake the progress thread. The wake-up costs a
  // synchronous caller 8-16 us (allreduce_bench, 2 ranks): 7% of a 1 MB all-reduce, about 1% of
  // a 4 MB one.
  static constexpr int64_t kAlwaysWakeBytes = int64_t{4} << 20;
  // The largest all-reduce that agrees in band (see in_band()); above it an agreement round trip
  // costs under 1% of MPI_Allreduce (2 ranks: 2-4% at 64 KB, about 1% at 128-256 KB, less from
  // 512 KB), and every rank's receive slots are this size (3 of them, allocated at first use).
  static constexpr size_t kInBandMaxBytes = size_t{256} << 10;
  // While point-to-point operations are pending, the progress thread polls them this often.
  static constexpr std::chrono::microseconds kP2PPoll{50};
  // How long a destructor waits for a timed-out operation to complete late before detaching.
  static constexpr int kStuckGraceMs = 1000;

  // The in-band channel's own communicator: its receives probe any tag from a peer, which must
  // not meet the user's point-to-point messages.
  static MPI_Comm duplicate(MPI_Comm comm) {
    MPI_Comm copy = MPI_COMM_NULL;
    MPI_Comm_dup(comm, &copy);
    MPI_Comm_set_errhandler(copy, MPI_ERRORS_RETURN);
    return copy;
  }

  static int rank_of(MPI_Comm comm) {
    int rank = 0;
    MPI_Comm_rank(comm, &rank);
    return rank;
  }

  // The waiting thread runs `work` itself when it is next and nothing is running: saves the
  // hand-off to the progress thread (microseconds) without changing the order of operations.
  void run_if_next(Work* work) {
    std::optional<Task> task;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (running_ || queue_.empty() || queue_.front().work.get() != work) return;
      task.emplace(std::move(queue_.front()));
      queue_.pop_front();
      running_ = true;
    }
    run(*task);
    ran_by_waiter_.fetch_add(1, std::memory_order_relaxed);
    bool more;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;
      waiter_runs_ = true;
      more = !queue_.empty();
    }
    if (more) wake_.notify_one();
  }

  // Someone polls `work` or waits with a timeout: no waiter will run it, so the progress thread
  // takes it now, without leaving it the claim grace.
  void hand_to_progress_thread(Work* work) {
    bool notify = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& task : queue_) {
        if (task.work.get() != work) continue;
        // Says nothing of the next submission (a caller polling this one may wait on that one).
        task.inline_ok = false;
        notify = sleeping_ && !woken_;
        woken_ = woken_ || notify;
        break;
      }
    }
    if (notify) wake_.notify_one();
  }

  // Stops and joins the progress thread; its unfinished operations fail with `why`. False when the
  // thread is inside an MPI call that does not return within kStuckGraceMs (a peer never joined):
  // joining would hang the caller, so thread and communicator are left to the process's end. A
  // healthy communicator's call always returns: only a broken one's is waited for that little,
  // unless `any_stuck_call` (MPI_Finalize is next, and would hang under any call still running).
  bool stop_progress_thread(const char* why, bool any_stuck_call) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      stop_reason_ = why;
    }
    wake_.notify_all();
    if (!thread_.joinable()) return !abandoned_;
    // A timed-out operation may still complete late (the missing peer arrives); give it a moment.
    auto may_be_stuck = [&] { return (any_stuck_call || is_broken()) && busy_.load(); };
    for (int i = 0; i < kStuckGraceMs && may_be_stuck(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (may_be_stuck()) {
      detail::mpi_state::stuck_threads.fetch_add(1);
      detail::mpi_state::end_at_exit_without_teardown();
      thread_.detach();
      abandoned_ = true;
      return false;
    }
    thread_.join();
    return true;
  }

  void progress_loop() {
    for (;;) {
      std::optional<Task> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // Evaluated (under the lock) each time the thread wakes: it has seen the queue.
        auto ready = [this] {
          woken_ = false;
          return stop_ || (!queue_.empty() && !running_);
        };
        if (!ready()) {
          sleeping_ = true;
          if (!pending_.empty() || !draining_.empty()) {
            wake_.wait_for(lock, kP2PPoll, ready);  // poll them, yielding the core in between
          } else if (waiter_runs_ && !quiet_) {
            // A whole tick without submissions: sleep until the next one wakes the thread.
            const uint64_t before = submissions_;
            if (!wake_.wait_for(lock, kSafetyTick, ready)) quiet_ = submissions_ == before;
          } else {
            // Any wake-up ends this sleep, not only one that finds work: when the waiters have
            // already claimed what was submitted (a waiter on the same core runs before this
            // thread does), staying here would make each later submission pay a wake-up (seen:
            // +1-2 us at 64 KB, a futex wake per operation), where the tick above costs nothing.
            deep_ = true;
            wake_.wait(lock);
            deep_ = quiet_ = woken_ = false;
          }
          sleeping_ = false;
        }
        if (stop_ && queue_.empty() && !running_) break;
        if (!queue_.empty() && !running_) {
          const Task& head = queue_.front();
          if (head.inline_ok && Clock::now() - head.submitted < kClaimGrace) {
            lock.unlock();
            std::this_thread::yield();
            continue;
          }
          task.emplace(std::move(queue_.front()));
          queue_.pop_front();
          running_ = true;
          if (task->inline_ok) waiter_runs_ = false;  // left past the grace: nobody was waiting on it
        }
      }
      if (task) {
        ran_by_progress_thread_.fetch_add(1, std::memory_order_relaxed);
        run(*task);
        std::lock_guard<std::mutex> lock(mutex_);
        running_ = false;
      }
      if (!pending_.empty() || !draining_.empty()) poll_p2p();
    }
    for (auto& leg : draining_) {
      MPI_Cancel(&leg.request);
      MPI_Request_free(&leg.request);
    }
    for (auto& p : pending_) {
      // Still unmatched at destruction: their works failed or nobody waits; release the requests.
      for (auto& leg : p.legs) {
        if (leg.request == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&leg.request);
        MPI_Request_free(&leg.request);
      }
      const std::string message = p.op.info.describe() + ": " + stop_reason_;
      fail(p.work, std::make_exception_ptr(CommError(message)), message);
    }
    pending_.clear();
  }

  void run(Task& task) {
    auto& work = task.work;
    if (!start(*work)) return;  // failed while queued (the communicator broke)
    const OpType type = task.op.info.type;
    const bool p2p = type == OpType::Send || type == OpType::Recv || type == OpType::SendRecvBatch;
    busy_.store(!p2p);
    try {
      if (p2p) {
        pending_.push_back(PendingP2P{post_p2p(task.op), work, std::move(task.op)});
        poll_p2p();  // receives whose message is already here start now
      } else {
        if (in_band(task.op)) {
          all_reduce_in_band(task.op);
        } else if (task.op.precheck) {
          band_.agree(task.op, checked_fingerprint(task.op));
          execute_collective(task.op);
        } else {
          execute_collective(task.op);
        }
        finish(*work);
      }
    } catch (const MismatchError& e) {
      fail(work, std::current_exception(), e.what());
    } catch (const CommError& e) {
      // An MPI error in a collective (a truncation: another rank passed another size) is explained
      // by what the peers called.
      const std::string why = p2p ? "" : diagnose(work->info());
      if (why.empty()) {
        fail(work, std::current_exception(), e.what());
      } else {
        const std::string message = std::string(e.what()) + "; " + why;
        fail(work, std::make_exception_ptr(CommError(message)), message);
      }
    } catch (const Error& e) {
      fail(work, std::current_exception(), e.what());
    }
    busy_.store(false);
  }

  // The fingerprint a checked call's agreement compares. The library's own operations compare only
  // themselves: the collective check's all_gather runs inside a user call whose (possibly
  // different) signature is already in the rolling fingerprint, and must get through to report
  // that difference.
  static uint64_t checked_fingerprint(const detail::Op& op) {
    return op.info.internal ? detail::fold_fingerprint(0, op.info) : op.fingerprint;
  }

  // All-reduces up to kInBandMaxBytes agree in band, with their own messages: about as quick as
  // MPI_Allreduce alone (allreduce_bench, "check cost" 0.98-1.02 from 4 B to 4 KB), so they are
  // checked whatever their size, comparing the rolling fingerprint each time, unless the size
  // rule was raised above the in-band range (an explicit "do not check these").
  bool in_band(const detail::Op& op) const {
    return size() > 1 && op.info.type == OpType::AllReduce && op.outputs[0].nbytes() <= kInBandMaxBytes &&
           (op.precheck || size_check_bytes() <= static_cast<int64_t>(kInBandMaxBytes));
  }

  void all_reduce_in_band(detail::Op& op) {
    at::Tensor& t = op.outputs[0];
    band_.all_reduce(op, checked_fingerprint(op), t.data_ptr(), element_count(t, op),
                     detail::mpi_datatype(t.scalar_type()), detail::mpi_reduce_op(op.info.reduce, t.scalar_type()));
    if (op.info.reduce == ReduceOp::Avg) t.div_(size());
  }

  void execute_collective(detail::Op& op) {
    const int n = size();
    switch (op.info.type) {
      case OpType::AllReduce: {
        at::Tensor& t = op.outputs[0];
        check_mpi(MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), element_count(t, op), detail::mpi_datatype(t.scalar_type()),
                                detail::mpi_reduce_op(op.info.reduce, t.scalar_type()), comm_),
                  op, "MPI_Allreduce");
        if (op.info.reduce == ReduceOp::Avg && n > 1) t.div_(n);
        break;
      }
      case OpType::Broadcast: {
        at::Tensor& t = op.outputs[0];
        check_mpi(MPI_Bcast(t.data_ptr(), element_count(t, op), detail::mpi_datatype(t.scalar_type()), op.info.peer,
                            comm_),
                  op, "MPI_Bcast");
        break;
      }
      case OpType::AllGather: {
        const at::Tensor& in = op.inputs[0];
        const int count = element_count(in, op);
        const MPI_Datatype type = detail::mpi_datatype(in.scalar_type());
        if (!op.list_output) {
          at::Tensor& out = op.outputs[0];
          // In place when the input already is this rank's chunk of the output.
          const char* own_chunk = static_cast<const char*>(out.data_ptr()) + rank() * in.nbytes();
          const void* send = in.data_ptr() == own_chunk ? MPI_IN_PLACE : in.data_ptr();
          check_mpi(MPI_Allgather(send, count, type, out.data_ptr(), count, type, comm_), op, "MPI_Allgather");
        } else {
          at::Tensor staging = at::empty({static_cast<int64_t>(n) * in.numel()}, in.options());
          check_mpi(MPI_Allgather(in.data_ptr(), count, type, staging.data_ptr(), count, type, comm_), op,
                    "MPI_Allgather");
          for (int r = 0; r < n; ++r)
            op.outputs[r].view({-1}).copy_(staging.narrow(0, static_cast<int64_t>(r) * in.numel(), in.numel()));
        }
        break;
      }
      case OpType::ReduceScatter: {
        const at::Tensor& in = op.inputs[0];
        at::Tensor& out = op.outputs[0];
        const int count = element_count(out, op);
        const MPI_Datatype type = detail::mpi_datatype(in.scalar_type());
        const MPI_Op reduce = detail::mpi_reduce_op(op.info.reduce, in.scalar_type());
        if (out.data_ptr() == static_cast<const char*>(in.data_ptr()) + rank() * out.nbytes()) {
          // In place: MPI leaves this rank's result at the start of the buffer; it moves to its chunk.
          check_mpi(MPI_Reduce_scatter_block(MPI_IN_PLACE, in.data_ptr(), count, type, reduce, comm_), op,
                    "MPI_Reduce_scatter_block");
          if (rank() != 0) out.copy_(in.narrow(0, 0, out.numel()));
        } else {
          check_mpi(MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), count, type, reduce, comm_), op,
                    "MPI_Reduce_scatter_block");
        }
        if (op.info.reduce == ReduceOp::Avg && n > 1) out.div_(n);
        break;
      }
      case OpType::AllToAll: {
        const at::Tensor& in = op.inputs[0];
        at::Tensor& out = op.outputs[0];
        const int chunk = element_count(in, op) / n;
        const MPI_Datatype type = detail::mpi_datatype(in.scalar_type());
        check_mpi(MPI_Alltoall(in.data_ptr(), chunk, type, out.data_ptr(), chunk, type, comm_), op, "MPI_Alltoall");
        break;
      }
      case OpType::Barrier:
        check_mpi(MPI_Barrier(comm_), op, "MPI_Barrier");
        break;
      case OpType::Split: {
        const auto& request = *op.split;
        MPI_Comm child = MPI_COMM_NULL;
        check_mpi(MPI_Comm_split(comm_, request.color < 0 ? MPI_UNDEFINED : request.color, request.key, &child), op,
                  "MPI_Comm_split");
        if (child != MPI_COMM_NULL) op.split->result = std::make_shared<MpiCommunicator>(child, request.name, request.options);
        break;
      }
      case OpType::Send:
      case OpType::Recv:
      case OpType::SendRecvBatch:
        break;  // posted by post_p2p
    }
  }

  // Posts the sends; receives wait for their message to be probed (poll_p2p).
  std::vector<Leg> post_p2p(detail::Op& op) {
    std::vector<Leg> legs;
    switch (op.info.type) {
      case OpType::Send: legs.push_back({true, op.inputs[0], op.info.peer, op.tag}); break;
      case OpType::Recv: legs.push_back({false, op.outputs[0], op.info.peer, op.tag}); break;
      default:
        for (const auto& p : op.batch) legs.push_back({p.kind == P2POp::Kind::Send, p.tensor, p.peer, p.tag});
    }
    for (auto& leg : legs) {
      if (!leg.send) continue;
      check_mpi(MPI_Isend(leg.tensor.data_ptr(), element_count(leg.tensor, op), detail::mpi_datatype(leg.tensor.scalar_type()),
                          leg.peer, leg.tag, comm_, &leg.request),
                op, "MPI_Isend");
      leg.posted = true;
    }
    return legs;
  }

  // Receives a message only once it is known to be the tensor's size. Open MPI copies a message
  // above the shared-memory eager limit (about 4 KB) whole into a smaller receive buffer
  // (benchmarks/mpi_mismatch_probe.c), so a receive posted before its message is seen would let a
  // peer that sent more write past the tensor. A probed message of another size is drained into
  // scratch memory and the receive raises MismatchError naming both sizes. Returns false while
  // the message has not arrived.
  bool try_post_receive(Leg& leg, const detail::Op& op) {
    int arrived = 0;
    MPI_Message message = MPI_MESSAGE_NULL;
    MPI_Status status;
    check_mpi(MPI_Improbe(leg.peer, leg.tag, comm_, &arrived, &message, &status), op, "MPI_Improbe");
    if (!arrived) return false;
    // 64-bit: MPI_Get_count in bytes is MPI_UNDEFINED above 2 GiB, which made every such receive a
    // "mismatch" whose drain then failed (mpi_counts.h).
    MPI_Count count_x = 0;
    MPI_Get_elements_x(&status, MPI_BYTE, &count_x);
    const auto bytes = static_cast<int64_t>(count_x);
    const auto expected_bytes = static_cast<int64_t>(leg.tensor.nbytes());
    if (bytes != expected_bytes) {
      // Drain the whole message (the sender completes), in units that keep the count within int.
      const detail::ByteUnits units = detail::byte_units(bytes);
      at::Tensor scratch = at::empty({std::max<int64_t>(units.unit * units.count, 1)}, at::kByte);
      MPI_Datatype unit = MPI_BYTE;
      if (units.unit > 1) {
        MPI_Type_contiguous(static_cast<int>(units.unit), MPI_BYTE, &unit);
        MPI_Type_commit(&unit);
      }
      const int rc = MPI_Mrecv(scratch.data_ptr(), units.count, unit, &message, MPI_STATUS_IGNORE);
      if (unit != MPI_BYTE) MPI_Type_free(&unit);
      check_mpi(rc, op, "MPI_Mrecv");
      const auto element = static_cast<int64_t>(leg.tensor.element_size());
      const std::string received = bytes % element == 0 ? std::to_string(bytes / element) + " elements"
                                                        : std::to_string(bytes) + " bytes";
      throw MismatchError(op.info.describe() + ": expected " + std::to_string(leg.tensor.numel()) + " elements, received " +
                          received + " from rank " + std::to_string(leg.peer));
    }
    check_mpi(MPI_Imrecv(leg.tensor.data_ptr(), element_count(leg.tensor, op), detail::mpi_datatype(leg.tensor.scalar_type()),
                         &message, &leg.request),
              op, "MPI_Imrecv");
    leg.posted = true;
    return true;
  }

  void poll_p2p() {
    // Legs of failed operations still in MPI's hands: their tensors stay alive until MPI is done.
    draining_.erase(std::remove_if(draining_.begin(), draining_.end(),
                                   [](Leg& leg) {
                                     int done = 0;
                                     return MPI_Test(&leg.request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done;
                                   }),
                    draining_.end());
    // Receives from one peer with one tag match its messages in order: only the first receive of
    // each (peer, tag) not yet posted may probe, or a later one could take an earlier one's message.
    std::vector<std::pair<int, int>> waiting;
    for (auto it = pending_.begin(); it != pending_.end();) {
      std::exception_ptr error;
      bool all_done = true;
      for (size_t i = 0; i < it->legs.size() && !error; ++i) {
        Leg& leg = it->legs[i];
        try {
          if (!leg.posted) {
            const std::pair<int, int> key{leg.peer, leg.tag};
            if (std::find(waiting.begin(), waiting.end(), key) != waiting.end() || !try_post_receive(leg, it->op)) {
              waiting.push_back(key);
              all_done = false;
              continue;
            }
          }
          if (leg.request == MPI_REQUEST_NULL) continue;
          int done = 0;
          check_mpi(MPI_Test(&leg.request, &done, MPI_STATUS_IGNORE), it->op, "MPI_Test");
          if (!done) all_done = false;
        } catch (const Error&) {
          error = std::current_exception();
        }
      }
      if (error) {
        std::string message;
        try {
          std::rethrow_exception(error);
        } catch (const Error& e) {
          message = e.what();
        }
        fail(it->work, error, message);
        // The operation failed, but a send it posted (or a receive of another leg) may still be
        // reading or writing its tensor: MPI keeps it until done, and so must we.
        for (auto& leg : it->legs)
          if (leg.request != MPI_REQUEST_NULL) draining_.push_back(std::move(leg));
        it = pending_.erase(it);
      } else if (all_done) {
        finish(*it->work);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }

  MPI_Comm comm_;
  MPI_Comm band_comm_;
  detail::InBandChannel band_;  // used by whoever runs the operation (one at a time)
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Task> queue_;
  std::vector<PendingP2P> pending_;  // owned by the progress thread
  std::vector<Leg> draining_;        // legs of failed operations MPI has not finished (same thread)
  bool stop_ = false;
  bool running_ = false;  // an operation is executing (on the progress thread or a waiter)
  const char* stop_reason_ = "";  // why stop_ was set: what the operations it leaves fail with
  bool finalized_ = false;        // MPI_Finalize ran or is next: nothing more is issued
  bool abandoned_ = false;        // the progress thread was left stuck in MPI (detached)
  bool sleeping_ = false;  // the progress thread waits on wake_
  bool deep_ = false;      // ... without a deadline: every submission must wake it
  bool woken_ = false;     // it was woken and has not looked at the queue since
  bool quiet_ = false;     // its last tick saw no submission
  uint64_t submissions_ = 0;
  // The last operation that could have been run by its waiter was: submissions then leave the
  // progress thread asleep.
  bool waiter_runs_ = false;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> ran_by_waiter_{0}, ran_by_progress_thread_{0}, submission_wakeups_{0};
  std::thread thread_;
};

}  // namespace
}  // namespace loom::mpi

namespace loom::detail::mpi_state {
int stop_live_communicators() {
  // Held while stopping (not the registry's lock: an operation failing on the way may run a
  // callback that releases a communicator, whose destructor takes that lock).
  std::vector<std::shared_ptr<Communicator>> live;
  {
    std::lock_guard<std::mutex> lock(loom::mpi::g_live_mutex);
    for (auto* communicator : loom::mpi::g_live)
      if (auto held = communicator->weak_from_this().lock()) live.push_back(std::move(held));
  }
  int stuck = 0;
  for (const auto& communicator : live)
    if (!static_cast<loom::mpi::MpiCommunicator&>(*communicator).stop_for_finalize()) ++stuck;
  return stuck;
}
}  // namespace loom::detail::mpi_state

namespace loom::mpi {

std::shared_ptr<Communicator> world_communicator(const CommunicatorOptions& options) {
  initialize();
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return std::make_shared<MpiCommunicator>(comm, "world", options);
}

ProgressCounters progress_counters(const Communicator& communicator) {
  const auto* mpi = dynamic_cast<const MpiCommunicator*>(&communicator);
  if (mpi == nullptr)
    throw InvalidArgumentError(communicator.context("progress_counters")(
        std::string("expected a communicator of the mpi backend, found ") + communicator.backend()));
  return mpi->counters();
}

}  // namespace loom::mpi
