// A backend built from docs/contributing.md's recipe ("Adding a backend"), in this file only: a
// Communicator subclass, one register_backend line, and Runtime::comm to get it. The toy runs
// all_reduce, broadcast, all_gather and barrier on its own progress thread, relaying each to a host
// communicator of its own; every other operation is refused by name before it is numbered. The
// checks: its collectives give what a one-process reference computes, and its refusals are
// loom::UnsupportedError naming the backend that leave the sequence as it was.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "comm/op.h"
#include "loom/comm/backends.h"
#include "loom/error.h"
#include "loom/runtime.h"

namespace {

class ToyCommunicator final : public loom::Communicator {
 public:
  ToyCommunicator(std::shared_ptr<loom::Communicator> host, const std::string& name,
                  const loom::CommunicatorOptions& options)
      : Communicator(host->rank(), host->members(), name, at::Device(c10::DeviceType::CPU), options),
        host_(std::move(host)), progress_([this] { run(); }) {}
  ~ToyCommunicator() override {
    drain();  // every operation submitted has finished or failed
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    progress_.join();
  }

  const char* backend() const override { return "toy"; }

 protected:
  std::string unsupported(const loom::OpInfo& info) const override {
    switch (info.type) {
      case loom::OpType::AllReduce:
      case loom::OpType::Broadcast:
      case loom::OpType::AllGather:
      case loom::OpType::Barrier:
        return {};
      default:
        return "the toy backend runs all_reduce, broadcast, all_gather and barrier only";
    }
  }

  // Never blocks: the progress thread runs the operation.
  void issue(loom::detail::Op& op, const std::shared_ptr<loom::Work>& work) override {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({op, work});
    ready_.notify_one();
  }

 private:
  struct Queued {
    loom::detail::Op op;
    std::shared_ptr<loom::Work> work;
  };

  void run() {
    for (;;) {
      Queued next;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!start(*next.work)) continue;  // failed meanwhile (a timeout)
      try {
        relay(next.op);
        finish(*next.work);
      } catch (const std::exception& e) {
        fail(next.work, std::current_exception(), next.op.info.describe() + ": " + e.what());
      }
    }
  }

  void relay(const loom::detail::Op& op) {
    switch (op.info.type) {
      case loom::OpType::AllReduce:
        return host_->all_reduce(op.outputs.at(0), {.op = op.info.reduce})->wait();
      case loom::OpType::Broadcast:
        return host_->broadcast(op.outputs.at(0), {.root = op.info.peer})->wait();
      case loom::OpType::AllGather:
        if (op.list_output) return host_->all_gather(op.outputs, op.inputs.at(0))->wait();
        return host_->all_gather(op.outputs.at(0), op.inputs.at(0))->wait();
      default:
        return host_->barrier()->wait();
    }
  }

  std::shared_ptr<loom::Communicator> host_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Queued> queue_;
  bool stopping_ = false;
  std::thread progress_;  // last: started once the rest is built
};

std::shared_ptr<loom::Runtime> g_rt;

// The one registration line of the recipe (here in a function, so that it runs once, after init).
void register_toy() {
  static const bool registered = (loom::register_backend("toy", {c10::DeviceType::CPU},
                                                         [](const loom::BackendContext& c) {
                                                           auto own = c.host->split(0, c.host->rank(), c.name + "-host");
                                                           return std::make_shared<ToyCommunicator>(own, c.name, c.options);
                                                         }),
                                  true);
  (void)registered;
}

TEST(ToyBackend, IsRegisteredAndBuiltOnceByRuntimeComm) {
  register_toy();
  auto toy = g_rt->comm(c10::DeviceType::CPU, "toy");
  ASSERT_TRUE(toy);
  EXPECT_STREQ(toy->backend(), "toy");
  EXPECT_EQ(toy->name(), "world-toy");
  EXPECT_EQ(toy->size(), g_rt->world().size);
  EXPECT_EQ(g_rt->comm(c10::DeviceType::CPU, "toy"), toy);  // kept
  EXPECT_EQ(g_rt->comm(c10::DeviceType::CPU), g_rt->world_comm());
  bool listed = false;
  for (const auto& info : loom::registered_backends()) listed = listed || info.name == "toy";
  EXPECT_TRUE(listed);
  try {
    (void)g_rt->comm(c10::DeviceType::CUDA, "toy");
    ADD_FAILURE() << "the toy backend was built for CUDA tensors";
  } catch (const loom::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("backend \"toy\" serves cpu tensors; expected one for cuda"), std::string::npos)
        << e.what();
  }
  try {
    loom::register_backend("toy", {c10::DeviceType::CPU}, [](const loom::BackendContext&) { return nullptr; });
    ADD_FAILURE() << "a second backend named toy was registered";
  } catch (const loom::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("a backend named \"toy\" is registered already"), std::string::npos);
  }
}

TEST(ToyBackend, CollectivesMatchAOneProcessReference) {
  register_toy();
  auto toy = g_rt->comm(c10::DeviceType::CPU, "toy");
  const int n = toy->size(), r = toy->rank();
  auto of_rank = [](int rank) { return at::arange(6, at::kFloat) * (rank + 1) + rank; };
  at::Tensor sum = of_rank(r), max = of_rank(r);
  toy->all_reduce(sum)->wait();
  toy->all_reduce(max, {.op = loom::ReduceOp::Max})->wait();
  at::Tensor expected_sum = at::zeros({6}), expected_max = of_rank(0);
  for (int i = 0; i < n; ++i) {
    expected_sum += of_rank(i);
    expected_max = at::maximum(expected_max, of_rank(i));
  }
  EXPECT_TRUE(at::equal(sum, expected_sum));
  EXPECT_TRUE(at::equal(max, expected_max));

  const int root = n - 1;
  at::Tensor b = r == root ? of_rank(root) : at::zeros({6});
  toy->broadcast(b, {.root = root})->wait();
  EXPECT_TRUE(at::equal(b, of_rank(root)));

  at::Tensor gathered = at::empty({n * 6});
  toy->all_gather(gathered, of_rank(r))->wait();
  for (int i = 0; i < n; ++i) EXPECT_TRUE(at::equal(gathered.narrow(0, i * 6, 6), of_rank(i))) << "rank " << i;
  toy->barrier()->wait();
}

TEST(ToyBackend, OtherOperationsAreRefusedByNameBeforeTheyAreNumbered) {
  register_toy();
  auto toy = g_rt->comm(c10::DeviceType::CPU, "toy");
  const int n = toy->size();
  at::Tensor t = at::ones({4});
  auto before = toy->all_reduce(t);
  before->wait();
  t.fill_(1);
  for (int i = 0; i < 2; ++i) {  // twice: a refusal consumes no sequence number
    try {
      (void)toy->reduce_scatter(at::empty({4}), at::ones({4 * n}));
      ADD_FAILURE() << "reduce_scatter ran on the toy backend";
    } catch (const loom::UnsupportedError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("reduce_scatter"), std::string::npos) << message;
      EXPECT_NE(message.find("toy"), std::string::npos) << message;
      EXPECT_NE(message.find("runs all_reduce, broadcast, all_gather and barrier only"), std::string::npos) << message;
    }
  }
  EXPECT_THROW((void)toy->split(0, toy->rank(), "toy-part"), loom::UnsupportedError);
  // The sequence goes on where it was: the next collective is numbered right after the one before
  // the refusals, and pairs up on every rank.
  auto after = toy->all_reduce(t);
  after->wait();
  EXPECT_EQ(after->info().seq, before->info().seq + 1);
  EXPECT_TRUE(at::equal(t, at::full({4}, static_cast<float>(n))));
  EXPECT_FALSE(toy->is_broken());
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  g_rt = loom::init();
  const int status = RUN_ALL_TESTS();
  g_rt.reset();
  loom::finalize();
  return status;
}
