// The Gloo backend: loom's Communicator core in front of LibTorch's c10d::ProcessGroupGloo, and the
// env:// rendezvous through c10d::TCPStore. See include/loom/comm/gloo.h.
//
// Collectives are handed to Gloo at issue (its worker threads run them; operations match across
// ranks by Gloo's own sequence tags, in issue order) and completed from the future's callback, on
// Gloo's thread: no extra thread hop between Gloo finishing and the waiter waking. Gloo's
// point-to-point works have no future, so one waiter thread per communicator waits for them in
// issue order (they progress in Gloo's transport whatever order they are waited in).
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>

#include "comm/abort.h"
#include "comm/durations.h"
#include "comm/fingerprint.h"
#include "comm/op.h"
#include "comm/store_status_channel.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom::gloo {
namespace {

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using GlooPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

// Gloo's own deadline stays behind loom's watchdog, which reports first (naming the operation).
constexpr auto kGlooDeadlineMargin = std::chrono::seconds(30);

struct StoreState {
  std::mutex mutex;
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  StorePtr store;  // under torchloom's prefix
  Rendezvous rendezvous;
};
StoreState& store_state() {
  static StoreState* state = new StoreState;  // outlives static destruction (exit handlers use it)
  return *state;
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:  // a sum, divided on completion
      return c10d::ReduceOp::SUM;
    case ReduceOp::Product:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

std::chrono::milliseconds gloo_timeout(const OpInfo& info) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(info.timeout);
  // "Practically forever" stays forever rather than overflowing Gloo's deadline arithmetic.
  if (ms > std::chrono::hours(24 * 365)) return std::chrono::hours(24 * 365);
  return ms + kGlooDeadlineMargin;
}

// LibTorch's error text without the C++ backtrace it appends (one line for loom's messages).
std::string without_backtrace(const std::string& text) {
  size_t cut = text.size();
  for (const char* marker : {"\nException raised from", "\nframe #"}) cut = std::min(cut, text.find(marker));
  return text.substr(0, cut);
}

std::shared_ptr<::gloo::transport::Device> make_device(const Rendezvous& r) {
  if (!r.interface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(r.interface);
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

GlooPtr make_group(const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(make_device(store_state().rendezvous));
  // One worker: operations run, and complete, in submission order (the Communicator's contract;
  // with two, a later small operation can finish before an earlier large one).
  options->threads = 1;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(GlooPtr group, StorePtr store, int rank, std::vector<int> members, std::string name,
                   const CommunicatorOptions& options)
      : Communicator(rank, std::move(members), std::move(name), at::Device(at::kCPU), options),
        group_(std::move(group)),
        store_(std::move(store)) {
    waiter_ = std::thread([this] { wait_loop(); });
  }

  ~GlooCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    waiter_.join();
    // A broken communicator may have operations stuck in Gloo that never end (a peer died):
    // destroying the group would join its workers and hang. Left to the process's end.
    if (is_broken()) {
      LOOM_LOG(warn, "communicator " << name() << " destroyed after a failure: its Gloo group is left to the exit");
      (void)group_.release();
    }
  }

  const char* backend() const override { return "gloo"; }

 protected:
  // Operations reach Gloo in submission order, the same on every rank. One checked first (its
  // signature gathered before its data moves) holds back the ones submitted after it until the
  // check completes; they are then handed to Gloo in order.
  void issue(detail::Op& op, const std::shared_ptr<Work>& work) override {
    std::lock_guard<std::recursive_mutex> lock(order_mutex_);
    if (holding_ || !held_.empty()) {
      held_.push_back({std::move(op), work});
      return;
    }
    dispatch(op, work);
  }

 private:
  struct Held {
    detail::Op op;
    std::shared_ptr<Work> work;
  };

  // Gloo compares no sizes or reduce operations: the signatures of every rank's call (type,
  // sequence number, dtype, element count, reduce op, root, rolling fingerprint) are gathered
  // before the data of a checked collective moves. Checked: of the collectives the core asks to
  // check, the program's first and every kCheckEvery-th after it. Checking each costs a round
  // trip and the hand-off behind it (measured: 7% of a 16 MiB all-reduce at 2 ranks); a size
  // mismatch between checks still ends the job (Gloo's transport ends the process, and the
  // departure notice names its message), an op or dtype mismatch of equal size is found within
  // kCheckEvery collectives.
  static constexpr int kCheckEvery = 64;

  bool checked(const detail::Op& op) {
    if (!op.precheck || size() < 2) return false;
    if (op.info.internal) return false;  // torchloom's own agreements: alike on every rank by construction
    return prechecks_++ % kCheckEvery == 0;
  }

  // With order_mutex_ held.
  void dispatch(detail::Op& op, const std::shared_ptr<Work>& work) {
    if (is_broken()) return;  // failed with the communicator already
    if (op.info.type != OpType::Send && op.info.type != OpType::Recv && op.info.type != OpType::SendRecvBatch &&
        op.info.type != OpType::Split && checked(op)) {
      check_then_issue(std::move(op), work);
      return;
    }
    issue_now(op, work);
  }

  void check_then_issue(detail::Op op, const std::shared_ptr<Work>& work) {
    holding_ = true;
    const uint64_t fingerprint = op.info.internal ? detail::fold_fingerprint(0, op.info) : op.fingerprint;
    const detail::SignatureWords mine = detail::signature_words(op.info, fingerprint);
    auto own = at::tensor(std::vector<int64_t>(mine.begin(), mine.end()), at::kLong);
    auto all = at::empty({8 * static_cast<int64_t>(size())}, at::kLong);
    c10d::AllgatherOptions o;
    o.timeout = gloo_timeout(op.info);
    c10::intrusive_ptr<c10d::Work> gathered;
    try {
      gathered = group_->all_gather_single(all, own, o);
    } catch (const std::exception& e) {
      const std::string message = op.info.describe() + ": Gloo refused the check: " + without_backtrace(e.what());
      holding_ = false;
      fail(work, std::make_exception_ptr(CommError(message)), message);
      return;
    }
    auto held = std::make_shared<Held>(Held{std::move(op), work});
    std::weak_ptr<Communicator> weak = weak_from_this();
    gathered->getFuture()->addCallback([weak, held, all, fingerprint](c10::ivalue::Future& f) {
      auto self = std::static_pointer_cast<GlooCommunicator>(weak.lock());
      if (!self) return;
      std::lock_guard<std::recursive_mutex> lock(self->order_mutex_);
      self->holding_ = false;
      if (f.hasError()) {
        const std::string message =
            held->op.info.describe() + ": Gloo (check): " + without_backtrace(f.tryRetrieveErrorMessage());
        self->fail(held->work, std::make_exception_ptr(CommError(message)), message);
      } else {
        std::vector<detail::SignatureWords> words(static_cast<size_t>(self->size()));
        const int64_t* w = all.data_ptr<int64_t>();
        for (size_t r = 0; r < words.size(); ++r) std::copy_n(w + 8 * r, 8, words[r].begin());
        const std::string why = detail::mismatch_report(held->op.info, fingerprint, words);
        if (why.empty()) {
          self->issue_now(held->op, held->work);
        } else {
          const std::string message = held->op.info.describe() + ": " + why;
          self->fail(held->work, std::make_exception_ptr(MismatchError(message)), message);
        }
      }
      self->release_held();
    });
  }

  // With order_mutex_ held: hands Gloo what waited behind a check, up to the next checked one.
  void release_held() {
    while (!holding_ && !held_.empty()) {
      Held next = std::move(held_.front());
      held_.pop_front();
      dispatch(next.op, next.work);
    }
  }

  void issue_now(detail::Op& op, const std::shared_ptr<Work>& work) {
    if (!start(*work)) return;
    try {
      if (op.info.type == OpType::Send || op.info.type == OpType::Recv || op.info.type == OpType::SendRecvBatch) {
        issue_p2p(op, work);
      } else if (op.info.type == OpType::Split) {
        issue_split(op, work);
      } else {
        complete_on_future(collective(op), op, work);
      }
    } catch (const std::exception& e) {
      const std::string message = op.info.describe() + ": Gloo refused the operation: " + without_backtrace(e.what());
      fail(work, std::make_exception_ptr(CommError(message)), message);
    }
  }

  c10::intrusive_ptr<c10d::Work> collective(detail::Op& op) {
    const int n = size();
    switch (op.info.type) {
      case OpType::AllReduce: {
        std::vector<at::Tensor> tensors{op.outputs[0]};
        c10d::AllreduceOptions o;
        o.reduceOp = to_c10d(op.info.reduce);
        o.timeout = gloo_timeout(op.info);
        return group_->allreduce(tensors, o);
      }
      case OpType::Broadcast: {
        std::vector<at::Tensor> tensors{op.outputs[0]};
        c10d::BroadcastOptions o;
        o.rootRank = op.info.peer;
        o.timeout = gloo_timeout(op.info);
        return group_->broadcast(tensors, o);
      }
      case OpType::AllGather: {
        c10d::AllgatherOptions o;
        o.timeout = gloo_timeout(op.info);
        // Flat on both sides: Gloo compares each chunk of the output with the input's shape, loom
        // only the elements (both are contiguous, checked by validate).
        at::Tensor input = op.inputs[0].view({-1});
        if (!op.list_output) {
          at::Tensor output = op.outputs[0].view({-1});
          return group_->all_gather_single(output, input, o);
        }
        // One tensor per rank: gathered flat, copied out on completion (Gloo's own list form
        // wants every output shaped exactly like the input; loom's only the same elements).
        op.staging = at::empty({static_cast<int64_t>(n) * input.numel()}, input.options());
        return group_->all_gather_single(op.staging, input, o);
      }
      case OpType::ReduceScatter: {
        c10d::ReduceScatterOptions o;
        o.reduceOp = to_c10d(op.info.reduce);
        o.timeout = gloo_timeout(op.info);
        at::Tensor input = op.inputs[0].view({-1});
        at::Tensor output = op.outputs[0].view({-1});
        // In place (the output is this rank's chunk of the input): Gloo reads from a copy.
        if (output.data_ptr() == static_cast<const char*>(input.data_ptr()) + rank() * output.nbytes())
          op.staging = input = input.clone();
        return group_->reduce_scatter_single(output, input, o);
      }
      case OpType::AllToAll: {
        c10d::AllToAllOptions o;
        o.timeout = gloo_timeout(op.info);
        at::Tensor input = op.inputs[0].view({-1});
        at::Tensor output = op.outputs[0].view({-1});
        std::vector<int64_t> equal, also_equal;  // empty: equal splits
        return group_->all_to_all_single(output, input, equal, also_equal, o);
      }
      case OpType::Barrier: {
        c10d::BarrierOptions o;
        o.timeout = gloo_timeout(op.info);
        return group_->barrier(o);
      }
      default:
        break;
    }
    (void)n;
    throw CommError(op.info.describe() + ": not a collective");
  }

  // Completion from Gloo's thread: Avg divides, a list all-gather is copied out, then the work
  // finishes (or fails with Gloo's error). Gloo works without a future (its reduce-scatter and
  // all-to-all) are waited for by the waiter thread instead.
  void complete_on_future(const c10::intrusive_ptr<c10d::Work>& gloo_work, detail::Op& op,
                          const std::shared_ptr<Work>& work) {
    const bool average = (op.info.type == OpType::AllReduce || op.info.type == OpType::ReduceScatter) &&
                         op.info.reduce == ReduceOp::Avg && size() > 1;
    at::Tensor averaged = average ? op.outputs[0] : at::Tensor();
    const int n = size();
    // The list all-gather's staging is copied out; another operation's (an in-place reduce-scatter's
    // copy of its input) is only kept alive.
    at::Tensor staging = (op.info.type == OpType::AllGather && op.list_output) ? op.staging : at::Tensor();
    std::vector<at::Tensor> outputs = staging.defined() ? op.outputs : std::vector<at::Tensor>();
    // Empty when there is nothing to do on completion (a Sum all-reduce): no allocation per operation.
    std::function<void()> done;
    if (averaged.defined() || staging.defined())
      done = [averaged, n, staging, outputs] {
        if (averaged.defined()) at::Tensor(averaged).div_(n);
        for (size_t r = 0; r < outputs.size(); ++r) {
          const int64_t chunk = staging.numel() / static_cast<int64_t>(outputs.size());
          at::Tensor(outputs[r]).view({-1}).copy_(staging.narrow(0, static_cast<int64_t>(r) * chunk, chunk));
        }
      };
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = gloo_work->getFuture();
    } catch (const c10::Error&) {  // "Work::getFuture not implemented"
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back({{gloo_work}, work, op.info.describe(), gloo_timeout(op.info), nullptr, at::Tensor(), 0,
                          std::move(done)});
      wake_.notify_all();
      return;
    }
    std::weak_ptr<Communicator> weak = weak_from_this();
    // The success path holds no reference to the communicator: the last one dropped here would
    // destroy the Gloo group on its own worker thread. (After fail() it is broken, and a broken
    // communicator's destructor leaves the group alone.) The operation's description is built
    // only on failure, from the work's copy of the OpInfo: a string per operation is a visible
    // part of a small all-reduce's cost.
    future->addCallback([weak, work, done = std::move(done)](c10::ivalue::Future& f) {
      if (f.hasError()) {
        auto self = std::static_pointer_cast<GlooCommunicator>(weak.lock());
        const std::string message = work->info().describe() + ": Gloo: " + without_backtrace(f.tryRetrieveErrorMessage());
        if (self) self->fail(work, std::make_exception_ptr(CommError(message)), message);
        return;
      }
      if (done) done();
      finish(*work);
    });
  }

  void issue_p2p(detail::Op& op, const std::shared_ptr<Work>& work) {
    std::vector<c10::intrusive_ptr<c10d::Work>> legs;
    auto post = [&](P2POp::Kind kind, at::Tensor tensor, int peer, int tag) {
      std::vector<at::Tensor> tensors{std::move(tensor)};
      legs.push_back(kind == P2POp::Kind::Send ? group_->send(tensors, peer, tag) : group_->recv(tensors, peer, tag));
    };
    if (op.info.type == OpType::Send) post(P2POp::Kind::Send, op.inputs[0], op.info.peer, op.tag);
    else if (op.info.type == OpType::Recv) post(P2POp::Kind::Recv, op.outputs[0], op.info.peer, op.tag);
    else
      for (const auto& leg : op.batch) post(leg.kind, leg.tensor, leg.peer, leg.tag);
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back({std::move(legs), work, op.info.describe(), gloo_timeout(op.info), nullptr, at::Tensor(), 0, nullptr});
    wake_.notify_all();
  }

  // Split: the members' (color, key) gathered over this group at issue, in order with every other
  // operation; the child group is made on the waiter's side once the gather completes (its
  // connection set-up blocks).
  void issue_split(detail::Op& op, const std::shared_ptr<Work>& work) {
    auto mine = at::tensor(std::vector<int64_t>{op.split->color, op.split->key}, at::kLong);
    auto all = at::empty({2 * static_cast<int64_t>(size())}, at::kLong);
    c10d::AllgatherOptions o;
    o.timeout = gloo_timeout(op.info);
    auto gathered = group_->all_gather_single(all, mine, o);
    std::lock_guard<std::mutex> lock(mutex_);
    Pending pending{{gathered}, work, op.info.describe(), gloo_timeout(op.info), nullptr, at::Tensor(), 0, nullptr};
    pending.split = op.split;
    pending.split_table = all;
    pending.split_seq = ++splits_;
    pending_.push_back(std::move(pending));
    wake_.notify_all();
  }

  struct Pending {
    std::vector<c10::intrusive_ptr<c10d::Work>> legs;
    std::shared_ptr<Work> work;
    std::string what;
    std::chrono::milliseconds timeout{0};
    std::shared_ptr<detail::SplitRequest> split;
    at::Tensor split_table;
    uint64_t split_seq = 0;
    std::function<void()> done;  // after the legs completed, before the work finishes
  };

  void wait_loop() {
    for (;;) {
      Pending p;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stop_ || !pending_.empty(); });
        if (pending_.empty()) return;  // stopping
        p = std::move(pending_.front());
        pending_.pop_front();
      }
      try {
        for (auto& leg : p.legs) leg->wait(p.timeout);
        if (p.split) make_child(p);
        if (p.done) p.done();
        finish(*p.work);
      } catch (const std::exception& e) {
        const std::string message = p.what + ": Gloo: " + without_backtrace(e.what());
        fail(p.work, std::make_exception_ptr(CommError(message)), message);
      }
    }
  }

  void make_child(Pending& p) {
    const auto& request = *p.split;
    if (request.color < 0) return;  // joins none: result stays nullptr
    const int64_t* table = p.split_table.data_ptr<int64_t>();
    std::vector<int> ranks;  // parent ranks of the child, by (key, rank)
    for (int r = 0; r < size(); ++r)
      if (table[2 * r] == request.color) ranks.push_back(r);
    std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return table[2 * a + 1] < table[2 * b + 1]; });
    const int child_rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
    std::vector<int> members;
    for (int r : ranks) members.push_back(this->members()[r]);
    // Keys of the child's rendezvous: unique per parent, split and color.
    auto child_store = c10::make_intrusive<c10d::PrefixStore>(
        name() + "/split" + std::to_string(p.split_seq) + "/color" + std::to_string(request.color) + "/", store_);
    auto child = make_group(child_store, child_rank, static_cast<int>(ranks.size()), p.timeout);
    p.split->result = std::make_shared<GlooCommunicator>(std::move(child), store_, child_rank, std::move(members),
                                                         request.name, request.options);
  }

  GlooPtr group_;
  StorePtr store_;
  // Submission order to Gloo (recursive: a check's callback may run inline and hand on more).
  std::recursive_mutex order_mutex_;
  std::deque<Held> held_;
  bool holding_ = false;
  uint64_t prechecks_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  uint64_t splits_ = 0;
  std::thread waiter_;
};

std::string required(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0')
    throw ConfigError(ErrorContext("init")(std::string("the env:// rendezvous needs ") + name +
                                           " (torchrun and PyTorchJob set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)"));
  return value;
}

int integer(const char* name, long lo, long hi) {
  const std::string text = required(name);
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || errno != 0 || value < lo || value > hi)
    throw ConfigError(ErrorContext("init")(std::string(name) + "='" + text.substr(0, 40) + "': expected an integer from " +
                                           std::to_string(lo) + " to " + std::to_string(hi)));
  return static_cast<int>(value);
}

// The first line of a library's message, at most 200 bytes (c10d's carry a backtrace).
std::string first_line(const std::string& text) {
  std::string line = text.substr(0, text.find('\n'));
  return line.size() > 200 ? line.substr(0, 200) + "..." : line;
}

// Every rank checks in under its own key; each waits until all have, up to the connect timeout,
// then names the ranks that never came (Gloo's own wait would only list its key names).
void wait_for_every_rank(c10d::Store& store, const Rendezvous& r, const std::string& where) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + r.connect_timeout;
  try {
    store.set("arrived/" + std::to_string(r.rank), std::vector<uint8_t>{1});
    if (store.add("arrivals", 1) >= r.size) return;
    auto pause = std::chrono::milliseconds(1);
    while (std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
      if (store.add("arrivals", 0) >= r.size) return;
    }
  } catch (const std::exception& e) {
    throw CommError(ErrorContext("init")("the env:// rendezvous at " + where + " failed while waiting for the " +
                                         std::to_string(r.size) + " ranks: " + first_line(e.what())));
  }
  // Who is missing: the first few, by rank.
  std::string missing;
  int count = 0;
  for (int rank = 0; rank < r.size; ++rank) {
    if (store.check({"arrived/" + std::to_string(rank)})) continue;
    if (++count <= 16) missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
  }
  if (count > 16) missing += ", ... (" + std::to_string(count) + " in all)";
  const std::string seconds = detail::seconds_text(std::chrono::steady_clock::now() - start);
  throw TimeoutError(ErrorContext("init")(
      "the env:// rendezvous at " + where + " (attempt " + std::to_string(r.generation) + ") timed out after " +
      seconds + " s (LOOM_TIMEOUT): " + (count == 1 ? "rank " : "ranks ") + missing + " of WORLD_SIZE=" +
      std::to_string(r.size) + " never arrived (not started, or started with another MASTER_ADDR, MASTER_PORT or "
      "WORLD_SIZE)"));
}

}  // namespace

bool compiled() { return true; }

Rendezvous rendezvous_from_environment() {
  Rendezvous r;
  r.master_addr = required("MASTER_ADDR");
  r.master_port = integer("MASTER_PORT", 1, 65535);
  r.size = integer("WORLD_SIZE", 1, 1 << 24);
  r.rank = integer("RANK", 0, r.size - 1);
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  r.agent_store = agent != nullptr && std::string(agent) == "True";
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr) r.interface = ifname;
  // torchrun numbers its attempts; loomrun's restarts set both.
  for (const char* name : {"TORCHELASTIC_RESTART_COUNT", "LOOM_RESTART_COUNT"})
    if (std::getenv(name) != nullptr) {
      r.generation = integer(name, 0, 1 << 20);
      break;
    }
  // A name that does not resolve never will: say so now rather than after the connect timeout.
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = ::getaddrinfo(r.master_addr.c_str(), nullptr, &hints, &found);
  if (found != nullptr) ::freeaddrinfo(found);
  if (error == EAI_NONAME || error == EAI_FAIL)
    throw ConfigError(ErrorContext("init")("MASTER_ADDR='" + r.master_addr.substr(0, 64) +
                                           "' does not resolve to an address (" + ::gai_strerror(error) +
                                           "): expected the host name or address of rank 0's machine"));
  return r;
}

std::shared_ptr<Communicator> world_communicator(const Rendezvous& r, const CommunicatorOptions& options) {
  auto& state = store_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (!state.store) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(r.master_port);
    o.isServer = !r.agent_store && r.rank == 0;
    o.numWorkers = static_cast<size_t>(r.size);
    o.waitWorkers = false;
    o.timeout = r.connect_timeout;
    o.multiTenant = !r.agent_store;
    const std::string where = r.master_addr + ":" + std::to_string(r.master_port);
    try {
      state.tcp = c10::make_intrusive<c10d::TCPStore>(r.master_addr, o);
    } catch (const std::exception& e) {
      const std::string who = r.agent_store ? "torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True)" : "rank 0";
      throw CommError(ErrorContext("init")(
          "the env:// rendezvous at " + where + " failed (" + (o.isServer ? "serving" : "connecting") + ", timeout " +
          detail::seconds_text(r.connect_timeout) + " s): no store answered; expected " +
          who + " to serve it there (" + first_line(e.what()) + ")"));
    }
    // torchrun's agent store also holds its own keys, and keeps them across restarts: a prefix
    // keeps torchloom's apart, and the attempt in it keeps each attempt's apart.
    const std::string prefix = "torchloom/" + std::to_string(r.generation) + "/";
    state.store = c10::make_intrusive<c10d::PrefixStore>(prefix, state.tcp);
    wait_for_every_rank(*state.store, r, where);
    state.rendezvous = r;
    // The side channel (peer questions, departure notices) on a connection of its own whose
    // requests give up after 2 s, so a stopped store server cannot hold a watchdog poll for long.
    try {
      c10d::TCPStoreOptions channel;
      channel.port = o.port;
      channel.isServer = false;
      channel.timeout = std::chrono::seconds(2);
      auto channel_store = c10::make_intrusive<c10d::TCPStore>(r.master_addr, channel);
      detail::store_status::start(c10::make_intrusive<c10d::PrefixStore>(prefix + "status/", channel_store), r.rank,
                                  r.size);
    } catch (const std::exception& e) {
      LOOM_LOG(warn, "no side channel (timeouts will not name the ranks not arrived): " << e.what());
    }
    // The abort's last step without MPI: end this process; torchrun (or the pod's restart policy)
    // ends the others when one rank exits with an error.
    detail::set_final_abort_step([](const std::string& reason) {
      LOOM_LOG(error, "ending this rank: " << reason);
      std::_Exit(1);
    });
  }
  // Every operation passes its own deadline (gloo_timeout); the group's applies to connecting.
  const auto timeout = r.connect_timeout;
  // Each world communicator (init's, and any made later) rendezvouses under its own keys; every
  // rank makes them in the same order.
  static uint64_t worlds = 0;
  auto world_store = c10::make_intrusive<c10d::PrefixStore>("world" + std::to_string(worlds++) + "/", state.store);
  GlooPtr group;
  try {
    group = make_group(world_store, r.rank, r.size, timeout);
  } catch (const std::exception& e) {
    throw CommError(ErrorContext("init")("Gloo could not connect the " + std::to_string(r.size) + " ranks: " + e.what()));
  }
  std::vector<int> members(static_cast<size_t>(r.size));
  std::iota(members.begin(), members.end(), 0);
  return std::make_shared<GlooCommunicator>(std::move(group), state.store, r.rank, std::move(members), "world", options);
}

void store_set(const std::string& key, const std::string& value) {
  auto& state = store_state();
  StorePtr store;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    store = state.store;
  }
  if (!store) throw CommError("gloo::store_set(" + key + "): no rendezvous store yet");
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::optional<std::string> store_get_if_set(const std::string& key) {
  auto& state = store_state();
  StorePtr store;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    store = state.store;
  }
  if (!store || !store->check({key})) return std::nullopt;
  const auto bytes = store->get(key);
  return std::string(bytes.begin(), bytes.end());
}

bool initialized() {
  auto& state = store_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.store != nullptr;
}

void finalize(std::chrono::milliseconds bound) {
  auto& state = store_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (!state.store) return;
  detail::store_status::stop();
  try {
    // The server's process must outlive every client's last request.
    state.store->add("finalized", 1);
    if (!state.rendezvous.agent_store && state.rendezvous.rank == 0) {
      const auto deadline = std::chrono::steady_clock::now() + bound;
      while (state.store->add("finalized", 0) < state.rendezvous.size && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (const std::exception& e) {
    LOOM_LOG(warn, "gloo::finalize: " << e.what());
  }
  state.store.reset();
  state.tcp.reset();
}

}  // namespace loom::gloo
