// The comm core's failure path with a backend whose works are polled (as a device backend's are,
// NCCL's end events): a failure found by a poll that runs with the communicator's in-flight lock
// held (the watchdog's and every submission's prune) must not re-enter that lock. The backend here
// is a test seam in one process, as c10d's ProcessGroupNCCLErrorsTest injects faults through
// virtuals: a device fault cannot be made on a machine without a GPU (benchmarks/gpu_check.sh makes
// a real one).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "comm/op.h"
#include "loom/comm/communicator.h"
#include "loom/error.h"
#include "../time_scale.h"

using namespace loom;
using namespace std::chrono_literals;

namespace {

class FaultyDeviceCommunicator;

// A work that completes only when polled, and fails when its "device" has faulted.
class PolledWork final : public Work, public std::enable_shared_from_this<PolledWork> {
 public:
  PolledWork(OpInfo info, std::weak_ptr<FaultyDeviceCommunicator> comm) : Work(std::move(info), {}), comm_(comm) {}

 protected:
  bool completion_is_polled() const override { return true; }
  bool wait_blocks_host() const override { return true; }
  void poll() override;

 private:
  std::weak_ptr<FaultyDeviceCommunicator> comm_;
};

class FaultyDeviceCommunicator final : public Communicator {
 public:
  static std::shared_ptr<FaultyDeviceCommunicator> make(const std::string& name, Timeout timeout) {
    CommunicatorOptions options;
    options.on_error = OnError::Raise;
    options.timeout = timeout;
    return std::shared_ptr<FaultyDeviceCommunicator>(new FaultyDeviceCommunicator(name, options));
  }
  const char* backend() const override { return "faulty-device"; }
  std::atomic<bool> faulted{false};
  std::atomic<int> polls_with_fault{0};
  void report(const std::shared_ptr<Work>& work, const std::string& message) { defer_failure(work, message); }

 protected:
  std::shared_ptr<Work> make_work(const loom::detail::Op& op) override {
    return std::make_shared<PolledWork>(op.info, std::static_pointer_cast<FaultyDeviceCommunicator>(shared_from_this()));
  }
  void issue(loom::detail::Op& /*op*/, const std::shared_ptr<Work>& work) override { start(*work); }

 private:
  FaultyDeviceCommunicator(const std::string& name, const CommunicatorOptions& options)
      : Communicator(0, {0}, name, at::Device(at::kCPU), options) {}
};

void PolledWork::poll() {
  auto comm = comm_.lock();
  if (!comm || !comm->faulted.load()) return;  // still "running on the device"
  comm->polls_with_fault.fetch_add(1);
  const std::string message = info().describe() + ": failed on the device: an illegal memory access";
  // As NcclWork::poll: the work fails here, the communicator is only handed the failure.
  if (!fail(std::make_exception_ptr(CommError(message)))) return;
  comm->report(shared_from_this(), message);
}

template <typename Predicate>
bool eventually(Predicate done, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

}  // namespace

TEST(CommCore, DeviceFaultFoundUnderTheInflightLockBreaksTheCommunicatorWithoutDeadlock) {
  auto comm = FaultyDeviceCommunicator::make("faulty", Timeout(600'000));
  at::Tensor t = at::ones({4});
  WorkPtr first = comm->all_reduce(t);
  WorkPtr second = comm->all_reduce(t);  // submitted after: must fail with the first
  comm->faulted = true;
  // The watchdog's next poll finds the fault (with the in-flight lock held) and must go on to
  // break the communicator; a deadlock there would stop every timeout in the process.
  ASSERT_TRUE(eventually([&] { return comm->is_broken(); }, 5s)) << "the communicator was never broken";
  EXPECT_GT(comm->polls_with_fault.load(), 0);
  EXPECT_THROW(first->wait(), CommError);
  EXPECT_THROW(second->wait(), CommError);  // failed itself (a sticky error), or by the first
  EXPECT_NE(comm->broken_reason().find("failed on the device: an illegal memory access"), std::string::npos)
      << comm->broken_reason();
  EXPECT_THROW(comm->all_reduce(t), CommError);

  // The watchdog still serves every communicator: another one's timeout fires on time.
  auto other = FaultyDeviceCommunicator::make("other", Timeout(200));
  WorkPtr stuck = other->all_reduce(t);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(stuck->wait(), TimeoutError);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), loom::test::time_bound(3.0))
      << loom::test::time_scale_note();
}

// A submission's own prune may be the first to poll the faulted work (the in-flight lock held
// there too): the next submission goes on, and the communicator breaks.
TEST(CommCore, DeviceFaultFoundBySubmissionPrune) {
  auto comm = FaultyDeviceCommunicator::make("prune", Timeout(600'000));
  at::Tensor t = at::ones({4});
  WorkPtr first = comm->all_reduce(t);
  comm->faulted = true;
  std::atomic<bool> returned{false};
  std::thread submitter([&] {
    try {
      (void)comm->all_reduce(t);
    } catch (const CommError&) {
    }
    returned = true;
  });
  EXPECT_TRUE(eventually([&] { return returned.load(); }, 5s)) << "a submission deadlocked";
  submitter.join();
  EXPECT_TRUE(eventually([&] { return comm->is_broken(); }, 5s));
  EXPECT_THROW(first->wait(), CommError);
}

// A timed-out operation's waiter finds its communicator broken by that timeout the moment the wait
// throws: a program that leaves on the error (no loom::finalize) tells the other ranks this reason
// from its exit handler, which reads it right then. Marked broken only after the waiter woke, the
// departure notice went out without it (seen at 4 ranks: "rank 2 exited with status 1" and no why).
TEST(CommCore, ATimedOutWaiterFindsItsCommunicatorAlreadyBrokenWithTheTimeout) {
  at::Tensor t = at::ones({4});
  int found_unbroken = 0;
  for (int attempt = 0; attempt < 40; ++attempt) {
    auto comm = FaultyDeviceCommunicator::make("timeout-" + std::to_string(attempt), Timeout(5));
    WorkPtr stuck = comm->all_reduce(t);
    try {
      stuck->wait();
      FAIL() << "an operation that never completes did not time out";
    } catch (const TimeoutError&) {
      if (!comm->is_broken() || comm->broken_reason().find("timed out after") == std::string::npos) ++found_unbroken;
    }
  }
  EXPECT_EQ(found_unbroken, 0) << "times a waiter woke by a timeout before its communicator was broken by it";
}
