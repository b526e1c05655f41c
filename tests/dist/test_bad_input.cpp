// Bad input is rejected on the calling rank before anything is sent, with a typed error whose
// message names the rank, the operation, and what was expected against what was found. After
// a rejection the communicator is still usable and every rank's sequence numbers agree.
#include <gtest/gtest.h>

#include "test_util.h"

using namespace loom;

namespace {

template <typename Call>
std::string rejection(Call call) {
  try {
    call();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "not rejected";
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "message: " << text << "\nexpected to contain: " << part;
}

}  // namespace

TEST(BadInput, NonContiguousTensor) {
  auto comm = test::world();
  at::Tensor t = at::ones({4, 6}).t();
  auto message = rejection([&] { comm->all_reduce(t); });
  expect_contains(message, "[rank " + std::to_string(comm->rank()) + "] all_reduce group=world");
  expect_contains(message, "expected a contiguous tensor, found shape [6, 4] with strides [1, 6]");
}

TEST(BadInput, UnsupportedDtypeAndUndefinedTensor) {
  auto comm = test::world();
  at::Tensor complex = at::ones({3}, at::kComplexFloat);
  expect_contains(rejection([&] { comm->all_reduce(complex); }), "dtype ComplexFloat is not supported");
  at::Tensor undefined;
  expect_contains(rejection([&] { comm->broadcast(undefined); }), "expected a defined tensor");
}

TEST(BadInput, AvgOnIntegers) {
  auto comm = test::world();
  at::Tensor t = at::ones({3}, at::kInt);
  expect_contains(rejection([&] { comm->all_reduce(t, {ReduceOp::Avg}); }),
                  "op avg needs a floating-point dtype, found Int");
}

TEST(BadInput, RootAndPeerOutOfRange) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor t = at::ones({3});
  expect_contains(rejection([&] { comm->broadcast(t, {n}); }),
                  "root " + std::to_string(n) + " is out of range: expected 0.." + std::to_string(n - 1));
  expect_contains(rejection([&] { comm->broadcast(t, {-1}); }), "root -1 is out of range");
  expect_contains(rejection([&] { comm->send(t, n + 3); }), "destination " + std::to_string(n + 3));
  expect_contains(rejection([&] { comm->recv(t, comm->rank()); }), "is this rank itself");
  if (n > 1) expect_contains(rejection([&] { comm->send(t, (comm->rank() + 1) % n, {40000}); }), "tag 40000");
}

TEST(BadInput, ShapesThatDoNotFitTheGroup) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor in = at::ones({4});
  at::Tensor wrong = at::empty({4 * n + 1});
  expect_contains(rejection([&] { comm->all_gather(wrong, in); }),
                  "output has " + std::to_string(4 * n + 1) + " elements, expected " + std::to_string(4 * n));
  std::vector<at::Tensor> too_few(n + 1, at::empty({4}));
  expect_contains(rejection([&] { comm->all_gather(too_few, in); }),
                  "expected " + std::to_string(n) + " output tensors (one per rank), found " + std::to_string(n + 1));
  at::Tensor out = at::empty({3});
  expect_contains(rejection([&] { comm->reduce_scatter(out, in); }),
                  "input has 4 elements, expected " + std::to_string(3 * n));
  at::Tensor doubles = at::empty({4 * n}, at::kDouble);
  expect_contains(rejection([&] { comm->all_gather(doubles, in); }), "expected output dtype Float (as input), found Double");
  if (n > 1) {
    at::Tensor odd = at::ones({n + 1});
    at::Tensor odd_out = at::empty({n + 1});
    expect_contains(rejection([&] { comm->all_to_all(odd_out, odd); }), "expected a multiple of the group size");
  }
}

TEST(BadInput, NonPositiveTimeout) {
  auto comm = test::world();
  at::Tensor t = at::ones({2});
  expect_contains(rejection([&] { comm->all_reduce(t, {ReduceOp::Sum, std::chrono::milliseconds(0)}); }),
                  "timeout must be positive");
}

TEST(BadInput, RejectionsDoNotShiftSequenceNumbers) {
  // Only rank 0 makes a bad call; afterwards every rank's next collective carries the same seq.
  auto comm = test::world();
  if (comm->rank() == 0) {
    at::Tensor t = at::ones({4, 6}).t();
    EXPECT_THROW(comm->all_reduce(t), InvalidArgumentError);
  }
  at::Tensor probe = at::zeros({1}, at::kLong);
  auto work = comm->all_reduce(probe);
  work->wait();
  at::Tensor seq = at::full({1}, static_cast<int64_t>(work->info().seq), at::kLong);
  at::Tensor all = at::empty({comm->size()}, at::kLong);
  comm->all_gather(all, seq)->wait();
  EXPECT_TRUE(at::all(all.eq(seq)).item<bool>()) << all;
  EXPECT_FALSE(comm->is_broken());
}
