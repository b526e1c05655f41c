// See dist_work.h.
#include "dist_work.h"

#include <ATen/core/ivalue.h>

#include "loom/error.h"

namespace torchloom_py {

FutureCompleter::FutureCompleter()
    : state_(std::make_shared<State>()), thread_([state = state_] { run(state); }) {}

FutureCompleter::~FutureCompleter() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
  }
  state_->wake.notify_one();
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // destroyed from a callback on the thread itself: it ends on its own
  } else {
    thread_.join();
  }
}

void FutureCompleter::add(std::vector<loom::WorkPtr> works, c10::intrusive_ptr<c10::ivalue::Future> future,
                          c10::IValue value) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->queue.push_back(Entry{std::move(works), std::move(future), std::move(value)});
  }
  state_->wake.notify_one();
}

void FutureCompleter::run(const std::shared_ptr<State>& state) {
  for (;;) {
    Entry entry;
    {
      std::unique_lock<std::mutex> lock(state->mutex);
      // Drains what is queued before stopping: every future handed out gets an outcome (each
      // wait below is bounded by its operation's timeout).
      state->wake.wait(lock, [&] { return state->stopping || !state->queue.empty(); });
      if (state->queue.empty()) return;
      entry = std::move(state->queue.front());
      state->queue.pop_front();
    }
    std::exception_ptr error;
    try {
      // synchronize(): a device operation must have finished on the device before the future
      // says so (the future's own events then cost nothing); for host operations it is wait().
      for (auto& w : entry.works) w->synchronize();
    } catch (...) {
      error = std::current_exception();
    }
    try {
      if (error) {
        entry.future->setError(error);
      } else {
        entry.future->markCompleted(std::move(entry.value));
      }
    } catch (...) {
      // markCompleted throws only for a value on a device the future was not made for: a bug
      // here, but the waiter must still get an outcome rather than hang.
      if (!entry.future->completed()) entry.future->setError(std::current_exception());
    }
  }
}

DistWork::DistWork(int rank, c10d::OpType type, std::vector<loom::WorkPtr> works, std::vector<at::Tensor> outputs,
                   std::shared_ptr<FutureCompleter> completer)
    : c10d::Work(rank, type),
      works_(std::move(works)),
      outputs_(std::move(outputs)),
      completer_(std::move(completer)) {}

bool DistWork::isCompleted() {
  for (auto& w : works_) {
    if (!w->is_completed()) return false;
  }
  return true;
}

bool DistWork::isSuccess() const {
  for (auto& w : works_) {
    if (!w->is_success()) return false;
  }
  return true;
}

std::exception_ptr DistWork::exception() const {
  for (auto& w : works_) {
    if (auto e = w->exception()) return e;
  }
  return nullptr;
}

std::vector<at::Tensor> DistWork::result() { return outputs_; }

void DistWork::synchronize() {
  for (auto& w : works_) w->wait();
}

bool DistWork::wait(std::chrono::milliseconds timeout) {
  const loom::Timeout t = timeout == kNoTimeout ? loom::kDefaultTimeout : loom::Timeout(timeout.count());
  // One deadline for the whole handle when the caller gave one.
  const auto start = std::chrono::steady_clock::now();
  for (auto& w : works_) {
    if (t == loom::kDefaultTimeout) {
      w->wait();
    } else {
      const auto spent = std::chrono::duration_cast<loom::Timeout>(std::chrono::steady_clock::now() - start);
      w->wait(std::max(loom::Timeout(0), t - spent));
    }
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> DistWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (future_) return future_;
  std::vector<c10::Device> devices;
  for (const auto& t : outputs_) {
    if (t.defined() && !t.device().is_cpu()) devices.push_back(t.device());
  }
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices);
  // Whoever asks for the future computes before waiting on it (DDP's buckets): the communicator
  // should run the operation on its own thread now.
  for (auto& w : works_) w->run_in_background();
  completer_->add(works_, future_, c10::IValue(outputs_));
  return future_;
}

uint64_t DistWork::getSequencenumber() const { return works_.empty() ? 0 : works_.back()->info().seq; }

}  // namespace torchloom_py
