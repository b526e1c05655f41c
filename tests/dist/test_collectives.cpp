// Every collective x dtype x reduce op on the world communicator, checked against values each
// rank computes on its own (test_util.h).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "loom/comm/mpi.h"
#include "test_util.h"

using namespace loom;
using loom::test::all_dtypes;
using loom::test::expected_reduction;
using loom::test::rank_input;

namespace {

struct Case {
  at::ScalarType dtype;
  ReduceOp op;
};

std::vector<Case> reduction_cases() {
  std::vector<Case> cases;
  for (auto dtype : all_dtypes())
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product}) {
      if (op == ReduceOp::Avg && !at::isFloatingType(dtype)) continue;  // rejected: see test_bad_input
      cases.push_back({dtype, op});
    }
  return cases;
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return std::string(c10::toString(info.param.dtype)) + "_" + to_string(info.param.op);
}

class Reduction : public testing::TestWithParam<Case> {};

}  // namespace

// Four sizes on the MPI backend: up to 256 KB the in-band all-reduce, whose own messages carry the
// ranks' agreement (src/comm/mpi_in_band.h; 15 elements and 1-8 KB here, by recursive doubling in
// one message or in eager-sized pieces; 32039 elements, 32-256 KB, by recursive halving except in
// bytes, in uneven halves); above it the agreement, then MPI_Allreduce. (MPI_Allreduce alone, with
// LOOM_SIZE_CHECK_BYTES above 256 KB: AllReduceWithTheSizeRuleRaisedAboveTheInBandRange.)
TEST_P(Reduction, AllReduceInPlace) {
  auto comm = test::world();
  const auto [dtype, op] = GetParam();
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{3, 5}, {16, 64}, {161, 199}, {512, 513}}) {
    SCOPED_TRACE("shape [" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + "]");
    at::Tensor t = rank_input(comm->rank(), shape, dtype, op == ReduceOp::Product);
    void* before = t.data_ptr();
    comm->all_reduce(t, {op})->wait();
    EXPECT_EQ(t.data_ptr(), before);
    at::Tensor expected = expected_reduction(comm->size(), shape, dtype, op);
    EXPECT_TRUE(at::equal(t, expected)) << "got\n"
                                        << t.flatten().narrow(0, 0, 8) << "\nexpected\n"
                                        << expected.flatten().narrow(0, 0, 8);
  }
}

// With the size rule raised above the in-band range, small all-reduces are plain MPI_Allreduce.
TEST_P(Reduction, AllReduceWithTheSizeRuleRaisedAboveTheInBandRange) {
  CommunicatorOptions options;
  options.size_check_bytes = int64_t{1} << 40;
  options.fingerprint_interval = 0;
  auto comm = test::fresh_world(options);
  const auto [dtype, op] = GetParam();
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{3, 5}, {16, 64}}) {
    at::Tensor t = rank_input(comm->rank(), shape, dtype, op == ReduceOp::Product);
    comm->all_reduce(t, {op})->wait();
    EXPECT_TRUE(at::equal(t, expected_reduction(comm->size(), shape, dtype, op))) << "shape[1] " << shape[1];
  }
}

TEST_P(Reduction, ReduceScatter) {
  auto comm = test::world();
  const auto [dtype, op] = GetParam();
  const int n = comm->size();
  at::Tensor input = rank_input(comm->rank(), {n * 4}, dtype, op == ReduceOp::Product);
  at::Tensor output = at::empty({4}, input.options());
  comm->reduce_scatter(output, input, {op})->wait();
  at::Tensor expected = expected_reduction(n, {n * 4}, dtype, op).narrow(0, comm->rank() * 4, 4);
  EXPECT_TRUE(at::equal(output, expected)) << "got\n" << output << "\nexpected\n" << expected;
}

INSTANTIATE_TEST_SUITE_P(AllDtypesAndOps, Reduction, testing::ValuesIn(reduction_cases()), case_name);

class PerDtype : public testing::TestWithParam<at::ScalarType> {};

TEST_P(PerDtype, BroadcastFromEveryRoot) {
  auto comm = test::world();
  for (int root = 0; root < comm->size(); ++root) {
    at::Tensor t = comm->rank() == root ? rank_input(root, {7}, GetParam()) : at::zeros({7}, GetParam());
    comm->broadcast(t, {root})->wait();
    EXPECT_TRUE(at::equal(t, rank_input(root, {7}, GetParam()))) << "root " << root << ": " << t;
  }
}

TEST_P(PerDtype, AllGatherIntoOneTensor) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor input = rank_input(comm->rank(), {2, 3}, GetParam());
  at::Tensor output = at::empty({n * 2, 3}, input.options());
  comm->all_gather(output, input)->wait();
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(at::equal(output.narrow(0, r * 2, 2), rank_input(r, {2, 3}, GetParam()))) << "chunk " << r;
}

TEST_P(PerDtype, AllGatherInPlaceFromOwnChunk) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor output = at::zeros({n * 5}, GetParam());
  at::Tensor mine = output.narrow(0, comm->rank() * 5, 5);
  mine.copy_(rank_input(comm->rank(), {5}, GetParam()));
  comm->all_gather(output, mine)->wait();
  for (int r = 0; r < n; ++r) EXPECT_TRUE(at::equal(output.narrow(0, r * 5, 5), rank_input(r, {5}, GetParam())));
}

TEST_P(PerDtype, AllGatherIntoAList) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor input = rank_input(comm->rank(), {4}, GetParam());
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < n; ++r) outputs.push_back(at::empty({4}, input.options()));
  comm->all_gather(outputs, input)->wait();
  for (int r = 0; r < n; ++r) EXPECT_TRUE(at::equal(outputs[r], rank_input(r, {4}, GetParam()))) << "rank " << r;
}

TEST_P(PerDtype, AllToAll) {
  auto comm = test::world();
  const int n = comm->size();
  const int me = comm->rank();
  // Chunk j of rank i's input holds the value 10*i + j (bool: whether i == j).
  at::Tensor input = at::empty({n, 3}, at::kLong);
  for (int j = 0; j < n; ++j) input[j].fill_(GetParam() == at::kBool ? (me == j) : 10 * me + j);
  input = input.to(GetParam());
  at::Tensor output = at::empty_like(input);
  comm->all_to_all(output, input)->wait();
  for (int i = 0; i < n; ++i) {
    at::Tensor expected = at::full({3}, GetParam() == at::kBool ? (i == me) : 10 * i + me, at::kLong).to(GetParam());
    EXPECT_TRUE(at::equal(output[i], expected)) << "chunk from rank " << i << ": " << output[i];
  }
}

TEST_P(PerDtype, SendRecvAroundARing) {
  auto comm = test::world();
  const int n = comm->size();
  if (n == 1) GTEST_SKIP() << "needs a peer";
  const int me = comm->rank();
  at::Tensor out = rank_input(me, {6}, GetParam());
  at::Tensor in = at::zeros({6}, GetParam());
  // Post the receive first on every rank and the send after: works only if point-to-point
  // operations do not block the communicator's queue.
  auto recv = comm->recv(in, (me + n - 1) % n, {/*tag=*/7});
  auto send = comm->send(out, (me + 1) % n, {/*tag=*/7});
  send->wait();
  recv->wait();
  EXPECT_TRUE(at::equal(in, rank_input((me + n - 1) % n, {6}, GetParam())));
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, PerDtype, testing::ValuesIn(all_dtypes()),
                         [](const testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(c10::toString(info.param));
                         });

TEST(Collectives, BarrierAndEmptyTensors) {
  auto comm = test::world();
  comm->barrier()->wait();
  at::Tensor empty = at::empty({0}, at::kFloat);
  comm->all_reduce(empty)->wait();
  EXPECT_EQ(empty.numel(), 0);
}

TEST(Collectives, HalfPrecisionSumRoundsLikeTorch) {
  // Values that are not small integers: the result must equal torch's own float16 sum, rank by
  // rank in order (each partial sum rounded to float16), within one float16 ulp.
  auto comm = test::world();
  const int n = comm->size();
  auto input_of = [](int r) { return (at::arange(16, at::kFloat) * 0.37f + r * 1.13f).to(at::kHalf); };
  at::Tensor t = input_of(comm->rank());
  comm->all_reduce(t)->wait();
  at::Tensor reference = input_of(0).to(at::kFloat);
  for (int r = 1; r < n; ++r) reference += input_of(r).to(at::kFloat);
  EXPECT_TRUE(at::allclose(t.to(at::kFloat), reference, /*rtol=*/2e-3, /*atol=*/1e-2)) << t << reference;
}

TEST(Collectives, WorkReportsInfoAndCompletion) {
  auto comm = test::world();
  at::Tensor t = at::ones({10}, at::kFloat);
  auto work = comm->all_reduce(t, {ReduceOp::Max});
  work->wait();
  EXPECT_TRUE(work->is_completed());
  EXPECT_TRUE(work->is_success());
  EXPECT_EQ(work->exception(), nullptr);
  EXPECT_EQ(work->info().type, OpType::AllReduce);
  EXPECT_EQ(work->info().group, "world");
  EXPECT_EQ(work->info().shape, std::vector<int64_t>{10});
  EXPECT_NE(work->info().describe().find("all_reduce seq="), std::string::npos);
}

// Open MPI copies a rendezvous-sized message whole into a receive posted for fewer elements (it
// wrote past the buffer in benchmarks/mpi_mismatch_probe.c's point-to-point check): the receive
// must learn the message's size before any byte lands, raise MismatchError naming both sizes,
// and leave the memory behind its tensor alone. Both directions, both below and above the
// shared-memory transport's eager limit.
TEST(PointToPoint, AReceiveOfAnotherSizeRaisesAndWritesNothingPastItsTensor) {
  // Gloo's transport ends the process on a message of another size (gloo::EnforceNotMet on its
  // thread): the job ends rather than hangs, but nothing can be raised to the caller.
  LOOM_SKIP_UNLESS_MPI("a receive of another size raised as an error");
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  const int me = world->rank();
  for (const int64_t expected : {int64_t{100}, int64_t{4096}, int64_t{65536}}) {
    for (const int64_t sent : {expected / 2, expected * 4}) {
      // A communicator for this case only (a failed receive breaks it) that raises rather than
      // ending the job; ranks 0 and 1 use it.
      CommunicatorOptions options;
      options.on_error = OnError::Raise;
      auto pair = test::fresh_world(options);
      if (me > 1) continue;
      if (me == 0) {
        pair->send(at::full({sent}, 3.0f), 1)->wait();
        continue;
      }
      constexpr int64_t kGuard = 1 << 18;
      at::Tensor memory = at::full({expected + kGuard}, -7.0f);
      at::Tensor target = memory.narrow(0, 0, expected);
      std::string message;
      try {
        pair->recv(target, 0)->wait();
      } catch (const MismatchError& e) {
        message = e.what();
      }
      EXPECT_NE(message.find("expected " + std::to_string(expected) + " elements, received " + std::to_string(sent)),
                std::string::npos)
          << "expected " << expected << ", sent " << sent << ": " << message;
      EXPECT_TRUE(at::equal(memory.narrow(0, expected, kGuard), at::full({kGuard}, -7.0f)))
          << "expected " << expected << ", sent " << sent << ": the receive wrote past its tensor";
    }
  }
  world->barrier()->wait();
}

// The size check covers what a collective moves, not only what a rank passes in: an all_gather of
// 160-byte inputs fills a 160 * n byte output, and its algorithm's last round carries half of it,
// well past where Open MPI writes past buffers when sizes differ. Ranks passing different sizes
// get MismatchError naming both before any data moves.
TEST(Collectives, AnAllGatherOfSmallInputsIsSizeCheckedByItsOutput) {
  auto world = test::world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs a peer";
  CommunicatorOptions options;
  options.on_error = OnError::Raise;  // the failed call breaks this communicator only
  options.fingerprint_interval = 0;   // only the size rule may check
  auto comm = test::fresh_world(options);
  const int64_t mine = comm->rank() == n - 1 ? 48 : 40;  // 160 or 192 bytes, below the 256-byte rule
  at::Tensor in = at::ones({mine});
  at::Tensor out = at::empty({mine * n});
  std::string message;
  try {
    comm->all_gather(out, in)->wait();
  } catch (const MismatchError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("collective mismatch: this rank called all_gather"), std::string::npos) << message;
  EXPECT_NE(message.find("numel=" + std::to_string(comm->rank() == n - 1 ? 40 : 48)), std::string::npos) << message;
  world->barrier()->wait();
}

// Ranks passing one all_reduce different sizes, whichever checked path each takes (in band up to
// 256 KB: recursive doubling up to 32 KB, halving above; agreement then MPI_Allreduce above 256
// KB): every rank gets MismatchError naming the other call, and nothing lands behind the smaller
// buffer. The culprit is the last rank; at 3 ranks it is folded into rank 0 first (the exchange's
// non-power-of-two path).
TEST(Collectives, AllReduceOfDifferentSizesIsAMismatchOnEveryRankWhicheverPathEachTakes) {
  auto world = test::world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs a peer";
  struct Sizes {
    int64_t others, culprit;
  };
  // Elements of float. Doubling vs doubling: 1 KB vs 2 KB in one message; 8 KB in eager-sized
  // pieces vs 32 KB in one; 4 KB vs 12 KB, both in pieces. Halving vs doubling: 64 KB vs 16 KB,
  // 128 KB vs 32000 B. Halving vs halving: 64 KB vs 4 bytes more (at 2 ranks rank 0's halves are
  // the same size: only the signature differs), 128 KB vs 64 KB. Halving vs agreement: 256 KB vs
  // 4 bytes more. Doubling vs agreement: 1 KB vs 1 MB. Agreement vs agreement: 1 MB vs 512 KB.
  for (const Sizes sizes :
       {Sizes{256, 512}, Sizes{2048, 8192}, Sizes{1024, 3000}, Sizes{16384, 4096}, Sizes{32768, 8000},
        Sizes{16384, 16385}, Sizes{32768, 16384}, Sizes{65536, 65537}, Sizes{256, 262144}, Sizes{262144, 131072}}) {
    CommunicatorOptions options;
    options.on_error = OnError::Raise;  // the failed call breaks this communicator only
    options.fingerprint_interval = 0;   // only the size rule may check
    auto comm = test::fresh_world(options);
    const bool culprit = comm->rank() == n - 1;
    const int64_t mine = culprit ? sizes.culprit : sizes.others;
    const int64_t theirs = culprit ? sizes.others : sizes.culprit;
    constexpr int64_t kGuard = 1 << 19;
    at::Tensor memory = at::full({mine + kGuard}, -7.0f);
    at::Tensor t = memory.narrow(0, 0, mine);
    t.fill_(1.0f);
    std::string message;
    try {
      comm->all_reduce(t)->wait();
    } catch (const MismatchError& e) {
      message = e.what();
    }
    SCOPED_TRACE(std::to_string(sizes.others) + " vs " + std::to_string(sizes.culprit) + " elements");
    EXPECT_NE(message.find("collective mismatch: this rank called all_reduce(seq=0, dtype=Float, numel=" +
                           std::to_string(mine)),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("called all_reduce(seq=0, dtype=Float, numel=" + std::to_string(theirs)), std::string::npos)
        << message;
    EXPECT_TRUE(at::equal(memory.narrow(0, mine, kGuard), at::full({kGuard}, -7.0f))) << "written past the tensor";
    world->barrier()->wait();
  }
}

// A batch that fails on one receive may already have posted a large send, which MPI reads from the
// tensor until the peer takes it. The send must still deliver the tensor's bytes when the caller
// kept no reference to it (the batch held the only one) and the memory was wanted again meanwhile.
TEST(PointToPoint, ASendOfAFailedBatchStillDeliversItsTensor) {
  LOOM_SKIP_UNLESS_MPI("a receive of another size raised as an error (Gloo ends the process)");
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "needs a peer";
  const int me = world->rank();
  constexpr int64_t kLarge = int64_t{1} << 22;  // 16 MB: a rendezvous message, a mapping of its own
  CommunicatorOptions options;
  options.on_error = OnError::Raise;  // the failed batch breaks this communicator only
  auto pair = test::fresh_world(options);
  if (me == 0) {
    std::string message;
    try {
      pair->batch_isend_irecv(
              {{P2POp::Kind::Send, at::full({kLarge}, 5.0f), 1}, {P2POp::Kind::Recv, at::empty({10}), 1}})
          ->wait();
    } catch (const MismatchError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("expected 10 elements, received 20"), std::string::npos) << message;
    at::Tensor reuse = at::full({kLarge}, 7.0f);  // what a freed send buffer would now hold
    world->barrier()->wait();
    EXPECT_EQ(reuse[0].item<float>(), 7.0f);
  } else if (me == 1) {
    pair->send(at::ones({20}), 0)->wait();
    // Take the large message only after rank 0's batch has failed.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    at::Tensor large = at::zeros({kLarge});
    pair->recv(large, 0)->wait();
    EXPECT_TRUE(at::all(large.eq(5.0f)).item<bool>()) << "the failed batch's send delivered other bytes";
    world->barrier()->wait();
  } else {
    world->barrier()->wait();
  }
  world->barrier()->wait();
}

// Tensors are taken by const reference: a view made in the call itself (before, a non-const
// reference refused it at compile time) is reduced in place into the tensor it views.
TEST(Collectives, ReduceIntoAViewMadeInTheCall) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor t = at::full({8}, static_cast<double>(comm->rank() + 1));
  comm->all_reduce(t.narrow(0, 2, 4))->wait();
  const double sum = n * (n + 1) / 2.0;
  EXPECT_TRUE(at::equal(t.narrow(0, 2, 4), at::full({4}, sum)));
  EXPECT_EQ(t[0].item<double>(), comm->rank() + 1);  // outside the view: untouched
  EXPECT_EQ(t[7].item<double>(), comm->rank() + 1);
}
