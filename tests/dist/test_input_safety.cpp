// Hostile values at the communicator: buffers that alias inside one collective are refused before
// anything is sent (MPI forbids them: wrong results or an MPI error otherwise), a wait whose
// deadline does not fit the clock means "wait long", not "time out at once", and (gated: several GB
// of memory) point-to-point messages above 2 GiB are received, or drained and reported.
#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <thread>

#include "loom/comm/mpi.h"
#include "test_util.h"

using namespace loom;
using loom::test::expect_contains;
using loom::test::rejection;

TEST(InputSafety, AllGatherInputOverlappingItsOutputIsRefused) {
  auto comm = test::world();
  const int n = comm->size(), r = comm->rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks (with one, any input inside the output is the whole output)";
  at::Tensor out = at::zeros({n * 4}, at::kFloat);
  // Half of this rank's chunk and half of the next: partly aliased.
  at::Tensor shifted = out.narrow(0, r * 4 + 2 < n * 4 - 4 ? r * 4 + 2 : r * 4 - 2, 4);
  const std::string message = rejection([&] { comm->all_gather(out, shifted)->wait(); });
  expect_contains(message, "all_gather");
  expect_contains(message, "the input overlaps the output other than as this rank's chunk");
  // In place (exactly this rank's chunk) is still accepted and correct.
  at::Tensor own = out.narrow(0, r * 4, 4);
  own.fill_(static_cast<float>(r + 1));
  comm->all_gather(out, own)->wait();
  for (int k = 0; k < n; ++k) EXPECT_EQ(out[k * 4 + 3].item<float>(), static_cast<float>(k + 1)) << "chunk " << k;
  // List outputs that share memory.
  at::Tensor base = at::zeros({4 * n}, at::kFloat);
  std::vector<at::Tensor> outputs;
  for (int k = 0; k < n; ++k) outputs.push_back(base.narrow(0, k == n - 1 ? 0 : 4 * k, 4));  // last = first
  expect_contains(rejection([&] { comm->all_gather(outputs, at::ones({4}))->wait(); }),
                  "outputs 0 and " + std::to_string(n - 1) + " overlap");
}

TEST(InputSafety, ReduceScatterAndAllToAllWithAliasedBuffersAreRefused) {
  auto comm = test::world();
  const int n = comm->size();
  const int r = comm->rank();
  at::Tensor base = at::ones({n * 4 + 2}, at::kFloat);
  at::Tensor in = base.narrow(0, 0, n * 4);
  // Overlapping the input, but not as this rank's chunk (shifted by half a chunk).
  at::Tensor out = base.narrow(0, r * 4 + 2, 4);
  expect_contains(rejection([&] { comm->reduce_scatter(out, in)->wait(); }), "the output overlaps the input");
  at::Tensor both = at::ones({n * 2}, at::kFloat);
  expect_contains(rejection([&] { comm->all_to_all(both, both)->wait(); }), "the output overlaps the input");
  // Separate buffers still work, and every rank's sequence numbers still agree.
  at::Tensor separate = at::empty({4}, at::kFloat);
  comm->reduce_scatter(separate, in)->wait();
  EXPECT_EQ(separate[0].item<float>(), static_cast<float>(n));
}

TEST(InputSafety, ReduceScatterInPlaceReducesIntoThisRanksChunk) {
  // In place (ZeRO's form): the output is exactly this rank's chunk of the input. Element k of chunk
  // j on rank i holds (i + 1) * 100 + j * 10 + k, so chunk r sums to a value each rank can check.
  auto comm = test::world();
  const int n = comm->size(), r = comm->rank();
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    at::Tensor buffer = at::arange(n * 4, at::kDouble).remainder(4) + at::arange(n * 4, at::kDouble).div(4, "floor") * 10;
    buffer = (buffer + (r + 1) * 100).to(dtype);
    at::Tensor own = buffer.narrow(0, r * 4, 4);
    comm->reduce_scatter(own, buffer)->wait();
    for (int k = 0; k < 4; ++k)
      EXPECT_EQ(own[k].item<double>(), 100.0 * n * (n + 1) / 2 + n * (r * 10 + k)) << "element " << k << " of rank " << r;
  }
}

TEST(InputSafety, BatchReceiveSharingMemoryIsRefused) {
  auto comm = test::world();
  const int n = comm->size(), r = comm->rank();
  if (n < 2) GTEST_SKIP() << "needs a peer";
  at::Tensor buffer = at::zeros({8}, at::kFloat);
  std::vector<P2POp> ops = {{P2POp::Kind::Send, buffer.narrow(0, 0, 4), (r + 1) % n, 0},
                            {P2POp::Kind::Recv, buffer.narrow(0, 2, 4), (r + n - 1) % n, 0}};
  expect_contains(rejection([&] { comm->batch_isend_irecv(ops)->wait(); }), "receive 1 overlaps send 0");
  // Two sends of one buffer are fine (both only read it).
  at::Tensor got = at::zeros({4}, at::kFloat);
  std::vector<P2POp> fine = {{P2POp::Kind::Send, buffer.narrow(0, 0, 4), (r + 1) % n, 1},
                             {P2POp::Kind::Recv, got, (r + n - 1) % n, 1}};
  comm->batch_isend_irecv(fine)->wait();
}

TEST(InputSafety, AWaitBeyondTheClockMeansWaitLong) {
  auto comm = test::world();
  const int n = comm->size(), r = comm->rank();
  if (n < 2) GTEST_SKIP() << "needs a peer";
  // 1e10 s (the review's Python case, 317 years) and the largest Timeout: both overflowed the
  // steady clock's nanoseconds and timed out at once.
  for (Timeout huge : {Timeout(10'000'000'000'000LL), Timeout::max()}) {
    at::Tensor t = at::zeros({4}, at::kFloat);
    if (r == 0) {
      const auto start = std::chrono::steady_clock::now();
      EXPECT_NO_THROW(comm->recv(t, 1)->wait(huge));
      EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
      EXPECT_EQ(t[0].item<float>(), 7.0f);
    } else if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm->send(at::full({4}, 7.0f), 0)->wait();
    }
    comm->barrier()->wait();
  }
}

// Gated: about 5 GB of memory at 2 ranks. LOOM_TEST_LARGE_MESSAGES=1 mpirun -np 2 loom_dist_tests
// --gtest_filter=InputSafety.P2PAbove2GiB*
TEST(InputSafety, P2PAbove2GiBIsReceivedOrDrained) {
  auto comm = test::world();
  const char* gate = std::getenv("LOOM_TEST_LARGE_MESSAGES");
  if (gate == nullptr || std::string(gate) != "1" || comm->size() != 2)
    GTEST_SKIP() << "set LOOM_TEST_LARGE_MESSAGES=1 and run at 2 ranks (about 5 GB of memory)";
  const int64_t elements = 560'000'000;  // 2.24 GB of float32: bytes above INT_MAX, elements below
  static_assert(560'000'000LL * 4 > INT_MAX);
  {
    at::Tensor t = comm->rank() == 0 ? at::arange(elements, at::kFloat) : at::zeros({elements}, at::kFloat);
    if (comm->rank() == 0) {
      comm->send(t, 1)->wait();
    } else {
      comm->recv(t, 0)->wait();
      EXPECT_EQ(t[elements - 1].item<float>(), static_cast<float>(elements - 1));
      EXPECT_EQ(t[12345].item<float>(), 12345.0f);
    }
  }
  comm->barrier()->wait();
  // A receive of another size: the message is drained (the sender completes) and reported, on a
  // communicator of its own that raises (a failed receive breaks it).
  CommunicatorOptions options;
  options.on_error = OnError::Raise;
  auto pair = test::fresh_world(options);
  if (comm->rank() == 0) {
    at::Tensor big = at::ones({elements}, at::kFloat);
    EXPECT_NO_THROW(pair->send(big, 1)->wait());
  } else {
    at::Tensor small = at::zeros({10}, at::kFloat);
    try {
      pair->recv(small, 0)->wait();
      ADD_FAILURE() << "a 2.24 GB message was received into 10 elements";
    } catch (const MismatchError& e) {
      expect_contains(e.what(), "expected 10 elements, received 560000000 elements from rank 0");
    }
  }
  comm->barrier()->wait();
}
