// Bad input is rejected on the calling rank before anything is sent, with a typed error whose
// message names the rank, the operation, and what was expected against what was found. After
// a rejection the communicator is still usable and every rank's sequence numbers agree.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <regex>
#include <set>

#include "test_util.h"

using namespace loom;
using loom::test::expect_contains;
using loom::test::rejection;

TEST(BadInput, NonContiguousTensor) {
  auto comm = test::world();
  at::Tensor t = at::ones({4, 6}).t();
  auto message = rejection([&] { (void)comm->all_reduce(t); });
  expect_contains(message, "[rank " + std::to_string(comm->rank()) + "] all_reduce group=world");
  expect_contains(message, "expected a contiguous tensor, found shape [6, 4] with strides [1, 6]");
}

TEST(BadInput, UnsupportedDtypeAndUndefinedTensor) {
  auto comm = test::world();
  at::Tensor complex = at::ones({3}, at::kComplexFloat);
  expect_contains(rejection([&] { (void)comm->all_reduce(complex); }), "dtype ComplexFloat is not supported");
  at::Tensor undefined;
  expect_contains(rejection([&] { (void)comm->broadcast(undefined); }), "expected a defined tensor");
}

TEST(BadInput, AvgOnIntegers) {
  auto comm = test::world();
  at::Tensor t = at::ones({3}, at::kInt);
  expect_contains(rejection([&] { (void)comm->all_reduce(t, {ReduceOp::Avg}); }),
                  "op avg needs a floating-point dtype, found Int");
}

TEST(BadInput, RootAndPeerOutOfRange) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor t = at::ones({3});
  expect_contains(rejection([&] { (void)comm->broadcast(t, {n}); }),
                  "root " + std::to_string(n) + " is out of range: expected 0.." + std::to_string(n - 1));
  expect_contains(rejection([&] { (void)comm->broadcast(t, {-1}); }), "root -1 is out of range");
  expect_contains(rejection([&] { (void)comm->send(t, n + 3); }), "destination " + std::to_string(n + 3));
  expect_contains(rejection([&] { (void)comm->recv(t, comm->rank()); }), "is this rank itself");
  if (n > 1) expect_contains(rejection([&] { (void)comm->send(t, (comm->rank() + 1) % n, {40000}); }), "tag 40000");
}

TEST(BadInput, ShapesThatDoNotFitTheGroup) {
  auto comm = test::world();
  const int n = comm->size();
  at::Tensor in = at::ones({4});
  at::Tensor wrong = at::empty({4 * n + 1});
  expect_contains(rejection([&] { (void)comm->all_gather(wrong, in); }),
                  "output has " + std::to_string(4 * n + 1) + " elements, expected " + std::to_string(4 * n));
  std::vector<at::Tensor> too_few(n + 1, at::empty({4}));
  expect_contains(rejection([&] { (void)comm->all_gather(too_few, in); }),
                  "expected " + std::to_string(n) + " output tensors (one per rank), found " + std::to_string(n + 1));
  at::Tensor out = at::empty({3});
  expect_contains(rejection([&] { (void)comm->reduce_scatter(out, in); }),
                  "input has 4 elements, expected " + std::to_string(3 * n));
  at::Tensor doubles = at::empty({4 * n}, at::kDouble);
  expect_contains(rejection([&] { (void)comm->all_gather(doubles, in); }), "expected output dtype Float (as input), found Double");
  if (n > 1) {
    at::Tensor odd = at::ones({n + 1});
    at::Tensor odd_out = at::empty({n + 1});
    expect_contains(rejection([&] { (void)comm->all_to_all(odd_out, odd); }), "expected a multiple of the group size");
  }
}

TEST(BadInput, NonPositiveTimeout) {
  auto comm = test::world();
  at::Tensor t = at::ones({2});
  expect_contains(rejection([&] { (void)comm->all_reduce(t, {ReduceOp::Sum, std::chrono::milliseconds(0)}); }),
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

namespace {

// One bad call per way each public entry point can be misused, with what its message must say.
struct BadCall {
  std::string method;
  std::string expected;
  std::function<void(Communicator&)> call;
};

std::vector<BadCall> bad_calls(int n, int rank) {
  const int other = (rank + 1) % n;
  auto f = [](at::IntArrayRef shape) { return at::ones(shape); };
  std::vector<BadCall> calls = {
      {"all_reduce", "expected a contiguous tensor", [=](Communicator& c) { at::Tensor t = f({4, 6}).t(); (void)c.all_reduce(t); }},
      {"all_reduce", "op avg needs a floating-point dtype", [=](Communicator& c) { at::Tensor t = at::ones({3}, at::kInt); (void)c.all_reduce(t, {ReduceOp::Avg}); }},
      {"all_reduce", "timeout must be positive", [=](Communicator& c) { at::Tensor t = f({2}); (void)c.all_reduce(t, {ReduceOp::Sum, Timeout(0)}); }},
      {"broadcast", "root " + std::to_string(n) + " is out of range", [=](Communicator& c) { at::Tensor t = f({2}); (void)c.broadcast(t, {n}); }},
      {"broadcast", "expected a defined tensor", [=](Communicator& c) { at::Tensor t; (void)c.broadcast(t); }},
      {"all_gather", "output has " + std::to_string(2 * n + 1) + " elements", [=](Communicator& c) { at::Tensor out = at::empty({2 * n + 1}); (void)c.all_gather(out, f({2})); }},
      {"all_gather", "output tensors (one per rank)", [=](Communicator& c) { std::vector<at::Tensor> outs(n + 1, at::empty({2})); (void)c.all_gather(outs, f({2})); }},
      {"reduce_scatter", "input has 4 elements, expected " + std::to_string(3 * n), [=](Communicator& c) { at::Tensor out = at::empty({3}); (void)c.reduce_scatter(out, f({4})); }},
      {"all_to_all", "output has 3 elements", [=](Communicator& c) { at::Tensor out = at::empty({3}); (void)c.all_to_all(out, f({2 * n})); }},
      {"send", "destination " + std::to_string(n + 3), [=](Communicator& c) { (void)c.send(f({2}), n + 3); }},
      {"send", "is this rank itself", [=](Communicator& c) { (void)c.send(f({2}), rank); }},
      {"recv", "tag 40000 is out of range", [=](Communicator& c) { at::Tensor t = f({2}); (void)c.recv(t, other, {40000}); }},
      {"recv", "dtype ComplexFloat is not supported", [=](Communicator& c) { at::Tensor t = at::ones({2}, at::kComplexFloat); (void)c.recv(t, other); }},
      {"batch_isend_irecv", "expected at least one send or receive", [=](Communicator& c) { (void)c.batch_isend_irecv({}); }},
      {"batch_isend_irecv", "source -1 is out of range", [=](Communicator& c) { (void)c.batch_isend_irecv({{P2POp::Kind::Recv, f({2}), -1}}); }},
      {"barrier", "timeout must be positive", [=](Communicator& c) { (void)c.barrier({Timeout(-5)}); }},
      {"split", "expected a name for the new communicator", [=](Communicator& c) { (void)c.split(0, 0, ""); }},
  };
  return calls;
}

}  // namespace

TEST(BadInput, EveryPublicCallRejectsBadArgumentsAndTheCommunicatorStaysUsable) {
  auto comm = test::world();
  for (const auto& bad : bad_calls(comm->size(), comm->rank())) {
    const std::string message = rejection([&] { bad.call(*comm); });
    expect_contains(message, "[rank " + std::to_string(comm->rank()) + "] " + bad.method + " group=world");
    expect_contains(message, bad.expected);
    // Nothing was sent and nothing numbered: the next collective works and agrees on every rank.
    at::Tensor probe = at::ones({3});
    comm->all_reduce(probe)->wait();
    EXPECT_TRUE(at::all(probe.eq(comm->size())).item<bool>()) << "after the bad " << bad.method;
    ASSERT_FALSE(comm->is_broken()) << "a rejected " << bad.method << " broke the communicator";
  }
}

// The matrix above is generated from the public header's list of calls: a call added to
// Communicator without a bad-input case fails here.
TEST(BadInput, TheMatrixCoversEveryPublicCallOfTheHeader) {
  std::ifstream header(std::string(LOOM_SOURCE_DIR) + "/include/loom/comm/communicator.h");
  ASSERT_TRUE(header.good());
  std::string text((std::istreambuf_iterator<char>(header)), std::istreambuf_iterator<char>());
  // The public section: from "public:" to the first "protected:".
  text = text.substr(text.find(" public:"), text.find(" protected:") - text.find(" public:"));
  const std::regex call(R"((?:WorkPtr|std::shared_ptr<Communicator>) (\w+)\()");
  std::set<std::string> covered;
  for (const auto& bad : bad_calls(2, 0)) covered.insert(bad.method);
  int found = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), call); it != std::sregex_iterator(); ++it) {
    ++found;
    EXPECT_TRUE(covered.count((*it)[1])) << "public call " << (*it)[1] << " has no bad-input case";
  }
  EXPECT_GE(found, 10) << "the header's calls were not found: did its layout change?";
}
