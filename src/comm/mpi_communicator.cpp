// The MPI backend: CPU tensors, operations run in submission order on one progress thread per
// communicator. Collectives are the blocking MPI calls (Open MPI's tuned algorithms, no copies:
// all_reduce is in place); point-to-point operations are posted non-blocking and polled, so a
// send waiting for its receiver never blocks the collectives queued behind it.
#include <ATen/ops/empty.h>
#include <mpi.h>

#include <climits>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <optional>
#include <mutex>
#include <thread>

#include "comm/abort.h"
#include "comm/host_work.h"
#include "comm/mpi_types.h"
#include "comm/op.h"
#include "comm/watchdog.h"
#include "core/env.h"
#include "loom/comm/mpi.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom::mpi {
namespace detail_state {
extern std::atomic<int> stuck_threads;
}

namespace {

using loom::detail::HostWork;
using Clock = std::chrono::steady_clock;

void check_mpi(int rc, const detail::Op& op, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(op.info.describe() + ": " + call + " failed: " + std::string(text, len));
}

int element_count(const at::Tensor& t, const detail::Op& op) {
  if (t.numel() > INT_MAX)
    throw InvalidArgumentError(op.info.describe() + ": " + std::to_string(t.numel()) +
                               " elements exceed the MPI backend's limit of " + std::to_string(INT_MAX) +
                               " per operation (split the tensor)");
  return static_cast<int>(t.numel());
}

class MpiCommunicator final : public Communicator, public detail::InlineExecutor {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size, int world_rank, std::string name,
                  const CommunicatorOptions& options)
      : Communicator(rank, size, world_rank, std::move(name), options), comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    thread_ = std::thread([this] { progress_loop(); });
  }

  ~MpiCommunicator() override {
    LOOM_LOG(debug, "communicator " << name() << ": " << ran_by_waiter_.load() << " operations run by their waiter, "
                                    << ran_by_progress_thread_.load() << " by the progress thread");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    // A timed-out operation may still complete late (the missing peer arrives); give it a moment.
    for (int i = 0; i < 1000 && is_broken() && busy_.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (is_broken() && busy_.load()) {
      // The progress thread is inside an MPI call that timed out and may never return (a peer
      // never joined): joining would hang the caller. Leave thread and communicator to the
      // process's end. (A healthy communicator's thread always finishes its operation: join.)
      LOOM_LOG(warn, "communicator " << name() << " destroyed while an operation is stuck in MPI");
      detail_state::stuck_threads.fetch_add(1);
      thread_.detach();
      return;
    }
    thread_.join();
    if (initialized()) MPI_Comm_free(&comm_);
  }

  const char* backend() const override { return "mpi"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }

 protected:
  WorkPtr launch(detail::Op& op) override {
    for (const auto& t : op.inputs) element_count(t, op);
    for (const auto& t : op.outputs) element_count(t, op);
    std::vector<at::Tensor> keep_alive = op.inputs;
    keep_alive.insert(keep_alive.end(), op.outputs.begin(), op.outputs.end());
    auto work = std::make_shared<HostWork>(op.info, std::move(keep_alive));
    const bool collective = op.info.type != OpType::Send && op.info.type != OpType::Recv;
    // Only with LOOM_ON_ERROR=abort: a caller stuck inside MPI could not raise its timeout, but
    // the abort still ends the job.
    const bool inline_ok = collective && on_error() == OnError::Abort;
    if (inline_ok) work->set_inline_executor(std::shared_ptr<detail::InlineExecutor>(shared_from_this(), this));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Task{std::move(op), work, nullptr, inline_ok, Clock::now()});
    }
    wake_.notify_one();
    return work;
  }

  bool run_if_next(HostWork* work) override {
    std::optional<Task> task;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (running_ || queue_.empty() || queue_.front().work.get() != work) return false;
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
      more = !queue_.empty();
    }
    if (more) wake_.notify_one();
    return true;
  }

  std::shared_ptr<Communicator> launch_split(int color, int key, const std::string& name,
                                             const CommunicatorOptions& options) override {
    // MPI_Comm_split is a collective on comm_: it must run on the progress thread, in order
    // with the operations already queued.
    auto result = std::make_shared<std::promise<MPI_Comm>>();
    auto future = result->get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Task{{}, nullptr, [this, color, key, result] {
                              MPI_Comm child = MPI_COMM_NULL;
                              int rc = MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child);
                              if (rc != MPI_SUCCESS) {
                                result->set_exception(std::make_exception_ptr(
                                    CommError("[rank " + std::to_string(world_rank()) + "] split of " +
                                              this->name() + " failed with MPI error " + std::to_string(rc))));
                              } else {
                                result->set_value(child);
                              }
                            }});
    }
    wake_.notify_one();
    if (future.wait_for(default_timeout()) != std::future_status::ready)
      throw TimeoutError("[rank " + std::to_string(world_rank()) + "] split of " + this->name() + " into " + name +
                         " timed out after " + std::to_string(default_timeout().count() / 1000.0) + " s");
    MPI_Comm child = future.get();
    if (child == MPI_COMM_NULL) return nullptr;
    int rank = 0, size = 0;
    MPI_Comm_rank(child, &rank);
    MPI_Comm_size(child, &size);
    return std::make_shared<MpiCommunicator>(child, rank, size, world_rank(), name, options);
  }

 private:
  struct Task {
    detail::Op op;
    std::shared_ptr<HostWork> work;
    std::function<void()> control;  // set for internal steps (split) instead of an operation
    bool inline_ok = false;         // a waiter may run it itself
    Clock::time_point submitted{};
  };
  static constexpr std::chrono::microseconds kClaimGrace{20};
  struct PendingP2P {
    MPI_Request request;
    std::shared_ptr<HostWork> work;
    detail::Op op;
  };

  void progress_loop() {
    for (;;) {
      std::optional<Task> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // A waiting caller may be running the head operation itself (run_if_next).
        auto ready = [this] { return stop_ || (!queue_.empty() && !running_); };
        if (!ready()) {
          if (pending_.empty()) {
            wake_.wait(lock, ready);
          } else {
            // Point-to-point operations in flight: poll them, but yield the core in between.
            wake_.wait_for(lock, std::chrono::microseconds(50), ready);
          }
        }
        if (stop_ && queue_.empty() && !running_) break;
        if (!queue_.empty() && !running_) {
          // Submit-then-wait is the common pattern: give the submitter a moment to claim the
          // operation itself (run_if_next) before taking it here. Costs an asynchronous
          // operation at most kClaimGrace of delay; saves a synchronous one two thread switches.
          const Task& head = queue_.front();
          if (head.inline_ok && Clock::now() - head.submitted < kClaimGrace) {
            lock.unlock();
            std::this_thread::yield();
            continue;
          }
          task.emplace(std::move(queue_.front()));
          queue_.pop_front();
          running_ = true;
        }
      }
      if (task) {
        if (!task->control) ran_by_progress_thread_.fetch_add(1, std::memory_order_relaxed);
        run(*task);
        std::lock_guard<std::mutex> lock(mutex_);
        running_ = false;
      }
      if (!pending_.empty()) poll_p2p();
    }
    for (auto& p : pending_) {
      // Still unmatched at destruction: their works failed or nobody waits; release the requests.
      MPI_Cancel(&p.request);
      MPI_Request_free(&p.request);
      p.work->fail(std::make_exception_ptr(CommError(p.op.info.describe() + ": communicator destroyed first")));
    }
    pending_.clear();
  }

  void run(Task& task) {
    if (task.control) {
      task.control();
      return;
    }
    auto& work = task.work;
    if (is_broken()) {
      work->fail(std::make_exception_ptr(
          CommError(task.op.info.describe() + ": not run: communicator is broken by an earlier error: " +
                    broken_reason())));
      return;
    }
    if (!work->start()) return;
    std::weak_ptr<Communicator> self = weak_from_this();
    detail::Watchdog::instance().watch(work, Clock::now() + task.op.info.timeout, [self, work] {
      if (auto comm = self.lock()) static_cast<MpiCommunicator*>(comm.get())->on_timeout(work);
    });
    const bool p2p = task.op.info.type == OpType::Send || task.op.info.type == OpType::Recv;
    busy_.store(!p2p);
    try {
      if (p2p) {
        pending_.push_back(PendingP2P{post_p2p(task.op), work, std::move(task.op)});
      } else {
        execute_collective(task.op);
        work->finish();
      }
    } catch (const Error& e) {
      on_failure(work, std::current_exception(), e.what());
    }
    busy_.store(false);
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
        check_mpi(MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), element_count(out, op),
                                           detail::mpi_datatype(in.scalar_type()),
                                           detail::mpi_reduce_op(op.info.reduce, in.scalar_type()), comm_),
                  op, "MPI_Reduce_scatter_block");
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
      case OpType::Send:
      case OpType::Recv:
        break;  // posted by post_p2p
    }
  }

  MPI_Request post_p2p(detail::Op& op) {
    MPI_Request request = MPI_REQUEST_NULL;
    if (op.info.type == OpType::Send) {
      const at::Tensor& t = op.inputs[0];
      check_mpi(MPI_Isend(t.data_ptr(), element_count(t, op), detail::mpi_datatype(t.scalar_type()), op.info.peer,
                          tag_of(op), comm_, &request),
                op, "MPI_Isend");
    } else {
      at::Tensor& t = op.outputs[0];
      check_mpi(MPI_Irecv(t.data_ptr(), element_count(t, op), detail::mpi_datatype(t.scalar_type()), op.info.peer,
                          tag_of(op), comm_, &request),
                op, "MPI_Irecv");
    }
    return request;
  }

  static int tag_of(const detail::Op& op) { return op.tag; }

  void poll_p2p() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      int done = 0;
      MPI_Status status;
      int rc = MPI_Test(&it->request, &done, &status);
      if (rc != MPI_SUCCESS) {
        try {
          check_mpi(rc, it->op, "MPI_Test");
        } catch (const Error& e) {
          on_failure(it->work, std::current_exception(), e.what());
        }
        it = pending_.erase(it);
      } else if (done) {
        if (it->op.info.type == OpType::Recv) {
          int received = 0;
          MPI_Get_count(&status, detail::mpi_datatype(it->op.outputs[0].scalar_type()), &received);
          if (received != it->op.outputs[0].numel()) {
            on_failure(it->work,
                       std::make_exception_ptr(MismatchError(
                           it->op.info.describe() + ": expected " + std::to_string(it->op.outputs[0].numel()) +
                           " elements, received " + std::to_string(received))),
                       "recv size mismatch");
            it = pending_.erase(it);
            continue;
          }
        }
        it->work->finish();
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void on_timeout(const std::shared_ptr<HostWork>& work) {
    const double elapsed = std::chrono::duration<double>(Clock::now() - work->started_at()).count();
    char text[128];
    std::snprintf(text, sizeof(text), " timed out after %.1f s (timeout %.1f s)", elapsed,
                  work->info().timeout.count() / 1000.0);
    std::string message = work->info().describe() + text;
    on_failure(work, std::make_exception_ptr(TimeoutError(message)), message);
  }

  // A failed or timed-out operation leaves the communicator in an unknown state: break it, fail
  // what is queued, and apply the error policy.
  void on_failure(const std::shared_ptr<HostWork>& work, std::exception_ptr error, const std::string& message) {
    if (!work->fail(std::move(error))) return;  // it completed just in time
    mark_broken(message);
    LOOM_LOG(error, message);
    std::deque<Task> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.swap(queue_);
    }
    for (auto& task : dropped) {
      if (task.control) {
        task.control = nullptr;  // a split waiting on this communicator times out on its own
        continue;
      }
      task.work->fail(std::make_exception_ptr(
          CommError(task.op.info.describe() + ": not run: communicator is broken by an earlier error: " + message)));
    }
    if (on_error() == OnError::Abort)
      detail::abort_job_after(env::seconds_as_duration("LOOM_ABORT_GRACE", 0, 600), message);
  }

  MPI_Comm comm_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Task> queue_;
  std::vector<PendingP2P> pending_;  // owned by the progress thread
  bool stop_ = false;
  bool running_ = false;  // an operation is executing (on the progress thread or a waiter)
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> ran_by_waiter_{0}, ran_by_progress_thread_{0};
  std::thread thread_;
};

}  // namespace

std::shared_ptr<Communicator> world_communicator(const CommunicatorOptions& options) {
  initialize();
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::make_shared<MpiCommunicator>(comm, rank, size, rank, "world", options);
}

}  // namespace loom::mpi
