// The c10d::Work that torchloom's torch.distributed backend returns: a handle over one or more
// loom::Work (several for the coalesced calls and for operations run as a batch), and the
// thread that completes the c10::ivalue::Future of those whose future was asked for (DDP's reducer
// waits on the future of its bucket all-reduces, not on the Work).
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "loom/comm/work.h"

namespace torchloom_py {

// Completes futures in the order they were asked for, on a thread of its own: loom's Work has no
// completion callback, so someone has to wait. One per backend (operations of one group finish
// in submission order, so waiting in order costs nothing). Stops and joins when destroyed.
class FutureCompleter {
 public:
  FutureCompleter();
  ~FutureCompleter();
  FutureCompleter(const FutureCompleter&) = delete;
  FutureCompleter& operator=(const FutureCompleter&) = delete;

  // Marks `future` completed with `value` once every work of `works` has finished, or with the
  // first error among them.
  void add(std::vector<loom::WorkPtr> works, c10::intrusive_ptr<c10::ivalue::Future> future, c10::IValue value);

 private:
  struct Entry {
    std::vector<loom::WorkPtr> works;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    c10::IValue value;
  };
  // Shared with the thread, which may outlive this object: a future's callback run by the thread
  // can drop the last reference to the completer, whose destructor then cannot join its own thread.
  struct State {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<Entry> queue;
    bool stopping = false;
  };
  static void run(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::thread thread_;
};

class DistWork : public c10d::Work {
 public:
  // outputs: what result() and the future's value are (the tensors the operation writes).
  DistWork(int rank, c10d::OpType type, std::vector<loom::WorkPtr> works, std::vector<at::Tensor> outputs,
           std::shared_ptr<FutureCompleter> completer);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  // CUDA: makes the caller's current stream wait for the operations (as loom's wait does); host:
  // waits for them.
  void synchronize() override;
  // timeout 0 (c10d's kNoTimeout): each operation's own timeout, which the watchdog enforces;
  // otherwise loom::TimeoutError when the operations are not done by then (they go on).
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;

 private:
  std::vector<loom::WorkPtr> works_;
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<FutureCompleter> completer_;
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace torchloom_py
