// The comm core: the one checked entry every public call goes through (like NCCL's
// ncclEnqueueCheck), and the one lifecycle every operation follows. The public methods only
// describe the operation; enqueue_checked validates it, numbers it, fingerprints it, records it,
// hands it to the watchdog and then to the backend. Failures of any backend come back through
// fail(), which breaks the communicator, fails what was submitted after, logs once and applies
// the error policy.
#include "loom/comm/communicator.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include "comm/abort.h"
#include "comm/departure.h"
#include "comm/durations.h"
#include "comm/fingerprint.h"
#include "comm/flight_recorder.h"
#include "comm/op.h"
#include "comm/peer_status.h"
#include "comm/watchdog.h"
#include "loom/config.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom {

namespace {
thread_local const char* t_internal_purpose = nullptr;

bool is_p2p(OpType type) { return type == OpType::Send || type == OpType::Recv || type == OpType::SendRecvBatch; }
}  // namespace

namespace detail {
InternalOperations::InternalOperations(const char* purpose) : previous_(t_internal_purpose) {
  t_internal_purpose = purpose;
}
InternalOperations::~InternalOperations() { t_internal_purpose = previous_; }
}  // namespace detail

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    case ReduceOp::Product: return "product";
  }
  return "?";
}

const char* to_string(OpType op) {
  switch (op) {
    case OpType::AllReduce: return "all_reduce";
    case OpType::Broadcast: return "broadcast";
    case OpType::AllGather: return "all_gather";
    case OpType::ReduceScatter: return "reduce_scatter";
    case OpType::AllToAll: return "all_to_all";
    case OpType::Send: return "send";
    case OpType::Recv: return "recv";
    case OpType::Barrier: return "barrier";
    case OpType::Split: return "split";
    case OpType::SendRecvBatch: return "batch_isend_irecv";
  }
  return "?";
}

int64_t OpInfo::numel() const {
  if (shape.empty()) return type == OpType::Barrier || type == OpType::Split ? 0 : 1;
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string OpInfo::name() const {
  if (internal) return std::string("internal ") + to_string(type) + " #" + std::to_string(seq) + " (" + purpose + ")";
  return std::string(to_string(type)) + " seq=" + std::to_string(seq);
}

std::string OpInfo::describe() const {
  std::ostringstream s;
  s << "[rank " << job_rank << "] " << name() << " group=" << group << " (rank " << rank << " of " << group_size
    << ")";
  const bool data = type != OpType::Barrier && type != OpType::Split && type != OpType::SendRecvBatch;
  if (data) {
    s << " shape=[";
    for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
    s << "] dtype=" << c10::toString(dtype);
  }
  if (type == OpType::AllReduce || type == OpType::ReduceScatter) s << " op=" << loom::to_string(reduce);
  if (type == OpType::Broadcast) s << " root=" << peer;
  if (type == OpType::Send) s << " dst=" << peer;
  if (type == OpType::Recv) s << " src=" << peer;
  if (type == OpType::Split) s << " color=" << peer;
  if (type == OpType::SendRecvBatch) s << " operations=" << operations;
  return s.str();
}

std::string OpInfo::signature() const {
  std::ostringstream s;
  s << to_string(type) << "(" << (internal ? "#" : "seq=") << seq;
  if (type != OpType::Barrier && type != OpType::Split)
    s << ", dtype=" << c10::toString(dtype) << ", numel=" << numel();
  if (type == OpType::AllReduce || type == OpType::ReduceScatter) s << ", op=" << loom::to_string(reduce);
  if (type == OpType::Broadcast) s << ", root=" << peer;
  s << ")";
  return s.str();
}

Communicator::Communicator(int rank, std::vector<int> members, std::string name, at::Device device,
                           const CommunicatorOptions& options)
    : rank_(rank),
      size_(static_cast<int>(members.size())),
      members_(std::move(members)),
      name_(std::move(name)),
      device_(device),
      timeout_(options.timeout.value_or(config().timeout)),
      on_error_(options.on_error.value_or(config().on_error)),
      check_collectives_(options.check_collectives.value_or(config().check_collectives)),
      size_check_bytes_(options.size_check_bytes.value_or(config().size_check_bytes)),
      fingerprint_interval_(options.fingerprint_interval.value_or(config().fingerprint_interval)),
      recorder_(std::make_shared<detail::FlightRecorder>(static_cast<size_t>(config().flight_record))) {
  if (rank_ < 0 || rank_ >= size_)
    throw InvalidArgumentError(ErrorContext("communicator " + name_)("rank " + std::to_string(rank_) +
                                                                     " is out of range for " + std::to_string(size_) +
                                                                     " members"));
  if (timeout_.count() <= 0)
    throw InvalidArgumentError(context("communicator")("timeout must be positive, found " +
                                                       std::to_string(timeout_.count()) + " ms"));
  peer_key_ = detail::peers::register_communicator(name_, members_, recorder_);
}

Communicator::~Communicator() { detail::peers::unregister_communicator(peer_key_); }

namespace {

detail::Op make_op(OpType type, Timeout timeout, const at::Tensor* described) {
  detail::Op op;
  op.info.type = type;
  op.info.timeout = timeout;
  if (described != nullptr && described->defined()) {
    op.info.shape = described->sizes().vec();
    op.info.dtype = described->scalar_type();
  }
  return op;
}

}  // namespace

WorkPtr Communicator::all_reduce(const at::Tensor& tensor, const AllReduceOptions& options) {
  auto op = make_op(OpType::AllReduce, options.timeout, &tensor);
  op.info.reduce = options.op;
  op.outputs = {tensor};  // in place: read and written, listed once
  return enqueue_checked(op);
}

WorkPtr Communicator::broadcast(const at::Tensor& tensor, const BroadcastOptions& options) {
  auto op = make_op(OpType::Broadcast, options.timeout, &tensor);
  op.info.peer = options.root;
  op.outputs = {tensor};  // in place
  return enqueue_checked(op);
}

WorkPtr Communicator::all_gather(const at::Tensor& output, const at::Tensor& input,
                                 const AllGatherOptions& options) {
  auto op = make_op(OpType::AllGather, options.timeout, &input);
  op.inputs = {input};
  op.outputs = {output};
  return enqueue_checked(op);
}

WorkPtr Communicator::all_gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                 const AllGatherOptions& options) {
  auto op = make_op(OpType::AllGather, options.timeout, &input);
  op.inputs = {input};
  op.outputs = outputs;
  op.list_output = true;
  return enqueue_checked(op);
}

WorkPtr Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                     const ReduceScatterOptions& options) {
  auto op = make_op(OpType::ReduceScatter, options.timeout, &input);
  op.info.reduce = options.op;
  op.inputs = {input};
  op.outputs = {output};
  return enqueue_checked(op);
}

WorkPtr Communicator::all_to_all(const at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options) {
  auto op = make_op(OpType::AllToAll, options.timeout, &input);
  op.inputs = {input};
  op.outputs = {output};
  return enqueue_checked(op);
}

WorkPtr Communicator::send(const at::Tensor& tensor, int dst, const SendRecvOptions& options) {
  auto op = make_op(OpType::Send, options.timeout, &tensor);
  op.info.peer = dst;
  op.tag = options.tag;
  op.inputs = {tensor};
  return enqueue_checked(op);
}

WorkPtr Communicator::recv(const at::Tensor& tensor, int src, const SendRecvOptions& options) {
  auto op = make_op(OpType::Recv, options.timeout, &tensor);
  op.info.peer = src;
  op.tag = options.tag;
  op.outputs = {tensor};
  return enqueue_checked(op);
}

WorkPtr Communicator::batch_isend_irecv(std::vector<P2POp> operations, const SendRecvOptions& options) {
  auto op = make_op(OpType::SendRecvBatch, options.timeout, nullptr);
  op.info.operations = static_cast<int>(operations.size());
  for (const auto& p : operations) (p.kind == P2POp::Kind::Send ? op.inputs : op.outputs).push_back(p.tensor);
  op.batch = std::move(operations);
  return enqueue_checked(op);
}

WorkPtr Communicator::barrier(const BarrierOptions& options) {
  auto op = make_op(OpType::Barrier, options.timeout, nullptr);
  return enqueue_checked(op);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name,
                                                  const SplitOptions& options) {
  auto op = make_op(OpType::Split, options.timeout, nullptr);
  op.info.peer = color;
  auto request = std::make_shared<detail::SplitRequest>();
  request->color = color;
  request->key = key;
  request->name = name;
  if (options.group_timeout && options.group_timeout->count() <= 0)
    throw InvalidArgumentError(context("split")("group_timeout must be positive, found " +
                                                std::to_string(options.group_timeout->count()) + " ms"));
  request->options = {options.group_timeout.value_or(timeout_), on_error_, check_collectives_, size_check_bytes_,
                      fingerprint_interval_};
  op.split = request;
  enqueue_checked(op)->synchronize();
  return request->result;
}

void Communicator::mark_broken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  if (!broken_.load()) {
    broken_reason_ = reason;
    broken_.store(true);
  }
}

std::string Communicator::broken_reason() const {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  return broken_reason_;
}

std::shared_ptr<Work> Communicator::make_work(const detail::Op& op) {
  std::vector<at::Tensor> keep_alive;
  keep_alive.reserve(op.inputs.size() + op.outputs.size());
  keep_alive.insert(keep_alive.end(), op.inputs.begin(), op.inputs.end());
  keep_alive.insert(keep_alive.end(), op.outputs.begin(), op.outputs.end());
  return std::make_shared<Work>(op.info, std::move(keep_alive));
}

namespace {
// The larger of what goes in and what comes out bounds every message the backend's algorithm sends
// (an all_gather's last round carries half its output), and so what a peer that passed another
// size could write past a buffer: such collectives have their signatures checked first.
bool largest_message_at_least(const detail::Op& op, int64_t bytes) {
  int64_t in_bytes = 0, out_bytes = 0;
  for (const auto& t : op.inputs) in_bytes += static_cast<int64_t>(t.nbytes());
  for (const auto& t : op.outputs) out_bytes += static_cast<int64_t>(t.nbytes());
  const int64_t largest = std::max(in_bytes, out_bytes);
  return largest > 0 && largest >= bytes;
}
}  // namespace

WorkPtr Communicator::enqueue_checked(detail::Op& op) {
  op.info.group = name_;
  op.info.rank = rank_;
  op.info.group_size = size_;
  op.info.job_rank = job_rank();
  if (t_internal_purpose != nullptr) {
    op.info.internal = true;
    op.info.purpose = t_internal_purpose;
  }
  if (op.info.timeout == kDefaultTimeout) op.info.timeout = timeout_;
  if (op.info.timeout.count() <= 0)
    throw InvalidArgumentError(context(to_string(op.info.type))("timeout must be positive, found " +
                                                                std::to_string(op.info.timeout.count()) + " ms"));
  // Validation comes before numbering: a rejected call must not shift this rank's sequence.
  detail::validate(op, device_);
  if (const std::string why = unsupported(op.info); !why.empty())
    throw UnsupportedError(context(to_string(op.info.type))(std::string("the ") + backend() + " backend cannot run it: " + why));
  // The communicator's threads and work keep only the data: a tensor with autograd history is held
  // as a detached alias (same storage). Otherwise the last reference to a graph -- and through an
  // autograd function's saved group, to a communicator -- could be dropped on that communicator's
  // own progress thread, whose destructor would then join itself (seen: std::terminate at exit).
  for (auto* tensors : {&op.inputs, &op.outputs})
    for (auto& t : *tensors)
      if (t.defined() && t.requires_grad()) t = t.detach();
  // Refused on a broken communicator: named by the sequence number the call would have had, as the
  // same failure is when it comes while the call is pending ("all_reduce seq=5").
  const auto refused = [&](const std::string& why) {
    std::lock_guard<std::recursive_mutex> lock(submit_mutex_);
    const uint64_t next = op.info.internal ? internal_seq_ : is_p2p(op.info.type) ? p2p_seq_ : collective_seq_;
    return CommError(context(std::string(to_string(op.info.type)) + " seq=" + std::to_string(next))(why));
  };
  if (is_broken()) throw refused("communicator is broken by an earlier error: " + broken_reason());
  if (auto gone = detail::departures::find(members_)) {
    // A member left before this communicator's watchdog pass could fail it (or it was never used).
    const std::string text = detail::departures::describe(*gone);
    mark_broken(text);
    apply_policy(text);
    throw refused(text);
  }

  std::lock_guard<std::recursive_mutex> lock(submit_mutex_);
  const bool p2p = is_p2p(op.info.type);
  op.info.seq = op.info.internal ? internal_seq_++ : p2p ? p2p_seq_++ : collective_seq_++;
  if (!p2p) {
    rolling_fingerprint_ = detail::fold_fingerprint(rolling_fingerprint_, op.info);
    op.fingerprint = rolling_fingerprint_;
    ++collectives_total_;
    op.precheck = size_ > 1 && op.info.type != OpType::Split &&
                  (largest_message_at_least(op, size_check_bytes_) ||
                   (fingerprint_interval_ > 0 && collectives_total_ % static_cast<uint64_t>(fingerprint_interval_) == 0));
    if (check_collectives_ && !op.info.internal && size_ > 1) check_fingerprint(op);
  }

  auto work = make_work(op);
  recorder_->record(work, op.fingerprint);
  // Watched (through inflight_) before the backend is called: an issue that blocks (a device
  // backend connecting to a peer that never comes) still ends at the deadline.
  {
    std::lock_guard<std::mutex> inflight_lock(inflight_mutex_);
    prune_finished_locked();
    inflight_.push_back(work);
  }
  run_deferred_failures();
  if (!watched_) {
    detail::Watchdog::instance().watch(weak_from_this());
    watched_ = true;
  }
  LOOM_LOG(trace, "enqueue " << op.info.describe());
  try {
    issue(op, work);
  } catch (const InvalidArgumentError& e) {
    // Nothing was sent (e.g. a size a backend cannot express): the communicator stays usable.
    work->fail(std::current_exception());
    throw;
  } catch (const Error& e) {
    fail(work, std::current_exception(), e.what());
    throw;
  }
  return work;
}

// LOOM_CHECK_COLLECTIVES=1: every rank contributes what it is about to call; a difference means
// the ranks would otherwise exchange mismatched buffers or hang.
void Communicator::check_fingerprint(detail::Op& op) {
  const detail::SignatureWords mine = detail::signature_words(op.info, op.fingerprint);
  const auto options = at::TensorOptions().dtype(at::kLong);
  at::Tensor local = at::empty({static_cast<int64_t>(mine.size())}, options);
  std::copy(mine.begin(), mine.end(), local.data_ptr<int64_t>());
  at::Tensor all = at::empty({size_ * static_cast<int64_t>(mine.size())}, options.device(device_));
  at::Tensor on_device = local.to(device_);
  {
    detail::InternalOperations internal("collective check");
    all_gather(all, on_device)->synchronize();
  }
  all = all.cpu();
  std::vector<detail::SignatureWords> words(size_);
  for (int r = 0; r < size_; ++r)
    std::copy_n(all.data_ptr<int64_t>() + r * mine.size(), mine.size(), words[r].begin());
  const std::string report = detail::mismatch_report(op.info, op.fingerprint, words);
  if (!report.empty()) throw MismatchError(op.info.describe() + ": " + report);
}

void Communicator::apply_policy(const std::string& message) {
  if (on_error_ == OnError::Abort) {
    detail::abort_job_after(config().abort_grace, message);
    return;
  }
  // Raise: only this communicator goes. Its backend releases what is in flight (a device stream
  // would otherwise stay blocked on a kernel that never ends), off the calling thread, which may
  // be the watchdog's.
  auto self = weak_from_this().lock();
  if (!self) return;  // being destroyed (its waiter already has the error): nothing left to release
  if (backend_aborted_.exchange(true)) return;
  // The helper takes the only reference this thread holds: were it kept here until return, and
  // the owner and the helper dropped theirs meanwhile, the communicator would be destroyed on this
  // thread, which may be its own progress thread (seen: std::system_error joining itself when a
  // failed receive's owner dropped the communicator at once).
  std::thread([self = std::move(self), message] { self->abort_backend(message); }).detach();
}

void Communicator::prune_finished_locked() {
  // Operations complete in order: the completed ones gather at the front.
  size_t done = 0;
  while (done < inflight_.size()) {
    // Not is_completed(): a look at a queued operation would hand it to the backend's thread.
    auto w = inflight_[done].lock();
    if (w && !w->finished_quietly()) break;
    ++done;
  }
  inflight_.erase(inflight_.begin(), inflight_.begin() + static_cast<long>(done));
}

std::vector<std::shared_ptr<Work>> Communicator::unfinished_works() {
  std::vector<std::shared_ptr<Work>> unfinished;
  {
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    prune_finished_locked();
    for (const auto& w : inflight_)
      if (auto p = w.lock(); p && !p->is_completed()) unfinished.push_back(std::move(p));
  }
  run_deferred_failures();
  return unfinished;
}

void Communicator::fail(const std::shared_ptr<Work>& work, std::exception_ptr error, const std::string& message) {
  // Broken before the waiter wakes: a program leaving on this error tells the others its reason.
  if (!work->fail(std::move(error), [&] { mark_broken(message); })) return;  // it completed just in time
  break_after(work, message);
}

void Communicator::defer_failure(const std::shared_ptr<Work>& work, const std::string& message) {
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  deferred_.emplace_back(work, message);
  has_deferred_.store(true, std::memory_order_release);
}

void Communicator::run_deferred_failures() {
  if (!has_deferred_.load(std::memory_order_acquire)) return;
  std::vector<std::pair<std::shared_ptr<Work>, std::string>> due;
  {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    due.swap(deferred_);
    has_deferred_.store(false, std::memory_order_release);
  }
  // A sticky device error fails every pending work of the device: the first breaks the
  // communicator (failing the rest, which have failed themselves already), the others add nothing.
  for (auto& [work, message] : due)
    if (!is_broken()) break_after(work, message);
}

void Communicator::break_after(const std::shared_ptr<Work>& work, const std::string& message) {
  mark_broken(message);
  std::vector<std::shared_ptr<Work>> later;
  {
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    bool reached = false;
    for (const auto& w : inflight_) {
      auto p = w.lock();
      if (!p) continue;
      if (reached) later.push_back(std::move(p));
      else reached = p == work;
    }
  }
  for (auto& w : later)
    w->fail(std::make_exception_ptr(
        CommError(w->info().describe() + ": not run: communicator is broken by an earlier error: " + message)));
  LOOM_LOG(error, message << "\n  flight record of group " << name_ << " (oldest first):" << recorder_->dump());
  apply_policy(message);
}

void Communicator::fail_all(const std::string& message) { fail_departed(message, -1, -1); }

// How long a survivor waits for the operations a leaver had completed: their data from it has
// arrived, so what is left is this rank's own share of the work (a reduction, a copy), which takes
// milliseconds. Bounded because the watchdog's thread waits: past it they fail like the rest.
constexpr auto kEndedByLeaverBound = std::chrono::seconds(2);

void Communicator::fail_departed(const std::string& message, int64_t collectives_ended, int64_t internal_ended) {
  mark_broken(message);
  std::vector<std::shared_ptr<Work>> pending;
  {
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    for (const auto& w : inflight_)
      if (auto p = w.lock()) pending.push_back(std::move(p));
  }
  const auto give_up = Work::Clock::now() + kEndedByLeaverBound;
  for (auto& w : pending) {
    const OpInfo& info = w->info();
    if (is_p2p(info.type)) continue;
    const int64_t ended = info.internal ? internal_ended : collectives_ended;
    if (static_cast<int64_t>(info.seq) > ended) continue;
    while (!w->finished_quietly() && Work::Clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::string first_failed;
  for (auto& w : pending)
    if (w->fail(std::make_exception_ptr(CommError(w->info().describe() + ": " + message))) && first_failed.empty())
      first_failed = w->info().describe();
  // Named by the operation it ended, when one was pending; else by the group.
  LOOM_LOG(error, (first_failed.empty() ? "group " + name_ : first_failed)
                      << ": " << message << "\n  flight record of group " << name_ << " (oldest first):" << recorder_->dump());
  apply_policy(message);
}

void Communicator::drain() {
  std::vector<std::shared_ptr<Work>> pending;
  {
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    for (const auto& w : inflight_)
      if (auto p = w.lock()) pending.push_back(std::move(p));
  }
  for (auto& w : pending)
    while (!w->is_completed()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

std::string Communicator::diagnose(const OpInfo& info) {
  if (size_ == 1 || is_p2p(info.type)) return "";
  const auto words = recorder_->find(info.internal, info.seq);
  const uint64_t fingerprint = words ? static_cast<uint64_t>((*words)[7]) : 0;
  const auto bound = std::clamp<Timeout>(info.timeout / 4, Timeout(100), Timeout(1000));
  auto answers = detail::peers::ask(members_, {peer_key_, info.internal, info.seq}, Work::Clock::now() + bound);
  if (!answers) return "";
  return detail::peers::describe_laggards(members_, rank_, info, fingerprint, *answers);
}

void Communicator::on_timeout(const std::shared_ptr<Work>& work) {
  if (work->is_completed()) return;
  const auto started = work->started_at_time().value_or(Work::Clock::now());
  std::string message = work->info().describe() + " timed out after " +
                        detail::seconds_text(Work::Clock::now() - started) + " s (timeout " +
                        detail::seconds_text(work->info().timeout) + " s)";
  const std::string why = diagnose(work->info());
  if (!why.empty()) message += "; " + why;
  fail(work, std::make_exception_ptr(TimeoutError(message)), message);
}

void Communicator::on_early_check(const std::shared_ptr<Work>& work, double elapsed_seconds) {
  const OpInfo& info = work->info();
  if (work->is_completed() || size_ == 1 || is_p2p(info.type)) return;
  const auto words = recorder_->find(info.internal, info.seq);
  const uint64_t fingerprint = words ? static_cast<uint64_t>((*words)[7]) : 0;
  const auto bound = std::clamp<Timeout>(info.timeout / 4, Timeout(100), Timeout(1000));
  auto answers = detail::peers::ask(members_, {peer_key_, info.internal, info.seq}, Work::Clock::now() + bound);
  if (!answers) return;
  const std::string conflicts = detail::peers::conflicting_calls(members_, rank_, info, fingerprint, *answers);
  if (conflicts.empty() || work->is_completed()) return;
  const std::string message = info.describe() + ": collective mismatch: this rank called " + info.signature() +
                              " but " + conflicts + " (found by asking the other ranks after " +
                              detail::seconds_text(elapsed_seconds) + " s; the timeout of " +
                              detail::seconds_text(info.timeout) + " s cannot resolve it)";
  fail(work, std::make_exception_ptr(MismatchError(message)), message);
}

void Communicator::on_stall(const std::shared_ptr<Work>& work, double elapsed_seconds) {
  if (work->is_completed()) return;
  const std::string why = diagnose(work->info());
  LOOM_LOG(warn, work->info().describe() << " still pending after " << detail::seconds_text(elapsed_seconds)
                                         << " s (timeout " << detail::seconds_text(work->info().timeout) << " s)"
                                         << (why.empty() ? "" : ": ") << why);
}

}  // namespace loom
