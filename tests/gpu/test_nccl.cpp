// GPU tests of the NCCL communicator: every collective and dtype against values computed on the
// CPU, ordering against the caller's stream, c10d stream semantics of Work, split, rejected input,
// the watchdog's timeout, and the paths that must not hang (raise-mode abort, a peer that never
// connects, a symmetric exchange). Every test skips where no GPU is visible.
//
// benchmarks/gpu_check.sh runs them twice: at `mpirun -np 1`, and at `-np 2` on the same GPU (each
// rank its own NCCL_HOSTID, so NCCL takes them for two hosts talking over loopback sockets). At one
// rank NCCL enqueues nothing for an in-place sum/min/max/product all_reduce or a broadcast, so the
// tests that must see a kernel run use Avg (which NCCL computes even at one rank); the dtype and op
// mapping is checked for real at two ranks (and as pure functions by tests/unit/test_nccl_types.cpp).
#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "loom/loom.h"

namespace {

using Clock = std::chrono::steady_clock;
using loom::ReduceOp;

std::shared_ptr<loom::Runtime> g_runtime;
std::shared_ptr<loom::Communicator> g_comm;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar,
                                             at::kByte,  at::kInt,    at::kLong, at::kBool};
const std::vector<ReduceOp> kOps = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product};

// Raise rather than abort: a failing test must report, not end the job. A minute bounds any hang.
loom::CommunicatorOptions test_options() {
  loom::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(60);
  options.on_error = loom::OnError::Raise;
  return options;
}

// The device loom::init() chose (0 when this process sees one GPU, else its local rank).
int device_index() {
  if (auto device = g_runtime->cuda_device()) return *device;
  return c10::cuda::device_count() == 1 ? 0 : g_runtime->world().local_rank % c10::cuda::device_count();
}

std::string label(at::ScalarType dtype, ReduceOp op) {
  return std::string(c10::toString(dtype)) + " " + loom::to_string(op);
}

void expect_contains(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "expected \"" << needle << "\" in: " << text;
}

// Rank r's values: small integers, exact in every dtype and different per rank and position.
at::Tensor contribution(at::ScalarType dtype, int r, int64_t n) {
  at::Tensor i = at::arange(n, at::kLong);
  if (dtype == at::kBool) return (i + r) % 3 == 0;
  return ((i * 3 + r) % 5 + 1).to(dtype);
}

// Factors for products: 1 or 2, so a product over a few ranks stays exact in int8.
at::Tensor factors(at::ScalarType dtype, int r, int64_t n) {
  at::Tensor i = at::arange(n, at::kLong);
  if (dtype == at::kBool) return (i + r) % 4 != 0;
  return ((i + r) % 2 + 1).to(dtype);
}

at::Tensor input_for(ReduceOp op, at::ScalarType dtype, int r, int64_t n) {
  return op == ReduceOp::Product ? factors(dtype, r, n) : contribution(dtype, r, n);
}

// The reduction the communicator must produce, computed on the CPU (in double; bool as logic).
at::Tensor reference_reduce(const std::vector<at::Tensor>& parts, ReduceOp op) {
  if (parts[0].scalar_type() == at::kBool) {
    at::Tensor acc = parts[0].clone();
    for (size_t k = 1; k < parts.size(); ++k)
      acc =
          (op == ReduceOp::Sum || op == ReduceOp::Max) ? at::logical_or(acc, parts[k]) : at::logical_and(acc, parts[k]);
    return acc;
  }
  at::Tensor acc = parts[0].to(at::kDouble);
  for (size_t k = 1; k < parts.size(); ++k) {
    at::Tensor p = parts[k].to(at::kDouble);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        acc = acc + p;
        break;
      case ReduceOp::Min:
        acc = at::minimum(acc, p);
        break;
      case ReduceOp::Max:
        acc = at::maximum(acc, p);
        break;
      case ReduceOp::Product:
        acc = acc * p;
        break;
    }
  }
  if (op == ReduceOp::Avg) acc = acc / static_cast<double>(parts.size());
  return acc;
}

void expect_matches(const at::Tensor& actual_on_gpu, const at::Tensor& expected, const std::string& what) {
  at::Tensor actual = actual_on_gpu.cpu();
  ASSERT_EQ(actual.numel(), expected.numel()) << what;
  if (at::isFloatingType(actual.scalar_type())) {
    const bool half = actual.scalar_type() == at::kHalf || actual.scalar_type() == at::kBFloat16;
    EXPECT_TRUE(at::allclose(actual.to(at::kDouble).reshape({-1}), expected.to(at::kDouble).reshape({-1}),
                             half ? 1e-2 : 1e-9, 1e-6))
        << what << "\nactual:\n"
        << actual << "\nexpected:\n"
        << expected;
  } else {
    EXPECT_TRUE(at::equal(actual.reshape({-1}), expected.to(actual.scalar_type()).reshape({-1})))
        << what << "\nactual:\n"
        << actual << "\nexpected:\n"
        << expected;
  }
}

// Cycles per second of at::cuda::sleep's spin loop, measured once on this GPU (the SM clock differs
// between GPUs and under load, so a nominal clock rate would not say how long a sleep lasts).
double spin_cycles_per_second() {
  static const double rate = [] {
    c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
    at::cuda::sleep(1000);  // the first launch loads the kernel
    stream.synchronize();
    const int64_t cycles = 100000000;
    const auto start = Clock::now();
    at::cuda::sleep(cycles);
    stream.synchronize();
    return cycles / std::chrono::duration<double>(Clock::now() - start).count();
  }();
  return rate;
}

// Queues a kernel that keeps the current stream busy for about `seconds`, so that what follows on
// that stream is late.
void busy_current_stream(double seconds) {
  at::cuda::sleep(static_cast<int64_t>(seconds * spin_cycles_per_second()));
}

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!loom::nccl::device_available()) GTEST_SKIP() << "no CUDA device visible";
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index()));
    if (!g_comm) g_comm = loom::nccl::make_communicator(g_runtime->world_comm(), device_index(), "gpu", test_options());
    comm = g_comm;
    device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index()));
  }

  at::TensorOptions on_gpu(at::ScalarType dtype) const { return at::TensorOptions().dtype(dtype).device(device); }
  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }

  std::shared_ptr<loom::Communicator> comm;
  at::Device device{at::kCUDA, 0};
};

TEST_F(Nccl, DescribesItself) {
  EXPECT_TRUE(loom::nccl::compiled());
  // The NCCL loaded is not older than the headers (another libnccl.so.2 first on the library path
  // would be), and the CUDA runtime is the one LibTorch was built with or newer.
  EXPECT_GE(loom::nccl::loaded_version(), loom::nccl::built_version());
  const int runtime = loom::nccl::cuda_runtime_version();
  const int torch_runtime = loom::nccl::torch_cuda_runtime_version();
  std::printf("NCCL loaded %d, built with %d; CUDA runtime %d, LibTorch's %d\n", loom::nccl::loaded_version(),
              loom::nccl::built_version(), runtime, torch_runtime);
  EXPECT_GT(torch_runtime, 0);
  EXPECT_GE(runtime, torch_runtime) << "an older libcudart than LibTorch's is loaded";
  EXPECT_STREQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->device_type(), c10::DeviceType::CUDA);
  EXPECT_EQ(comm->size(), g_runtime->world_comm()->size());
  EXPECT_EQ(comm->rank(), g_runtime->world_comm()->rank());

  at::Tensor t = at::ones({3, 5}, on_gpu(at::kFloat));
  auto first = comm->all_reduce(t);
  auto second = comm->all_reduce(t);
  second->wait();
  EXPECT_EQ(first->info().type, loom::OpType::AllReduce);
  EXPECT_EQ(second->info().seq, first->info().seq + 1);
  EXPECT_EQ(first->info().shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(first->info().dtype, at::kFloat);
  EXPECT_EQ(first->info().group, "gpu");
}

TEST_F(Nccl, AllReduceEveryOpAndDtype) {
  const int64_t n = 1000;
  for (auto dtype : kDtypes) {
    for (auto op : kOps) {
      if (op == ReduceOp::Avg && !at::isFloatingType(dtype)) continue;  // rejected, see RejectsAvgOnIntegers
      std::vector<at::Tensor> parts;
      for (int r = 0; r < size(); ++r) parts.push_back(input_for(op, dtype, r, n));
      at::Tensor t = parts[rank()].to(device);
      comm->all_reduce(t, {op})->wait();
      expect_matches(t, reference_reduce(parts, op), "all_reduce " + label(dtype, op));
    }
  }
}

TEST_F(Nccl, BroadcastEveryDtypeAndRoot) {
  const int64_t n = 777;
  for (auto dtype : kDtypes) {
    for (int root = 0; root < size(); ++root) {
      at::Tensor t = contribution(dtype, rank(), n).to(device);
      comm->broadcast(t, {root})->wait();
      expect_matches(t, contribution(dtype, root, n), std::string("broadcast ") + c10::toString(dtype));
    }
  }
}

TEST_F(Nccl, AllGatherFlatInPlaceAndList) {
  const int64_t rows = 4, cols = 25, n = rows * cols;
  for (auto dtype : kDtypes) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < size(); ++r) parts.push_back(contribution(dtype, r, n));
    const at::Tensor expected = at::cat(parts);
    const std::string what = std::string("all_gather ") + c10::toString(dtype);

    at::Tensor in = parts[rank()].reshape({rows, cols}).to(device);
    at::Tensor out = at::empty({size() * rows, cols}, on_gpu(dtype));
    comm->all_gather(out, in)->wait();
    expect_matches(out, expected, what + " (flat)");

    // The input is this rank's slice of the output: NCCL's in-place form.
    at::Tensor whole = at::empty({size() * n}, on_gpu(dtype));
    at::Tensor own = whole.narrow(0, rank() * n, n);
    own.copy_(parts[rank()]);
    comm->all_gather(whole, own)->wait();
    expect_matches(whole, expected, what + " (in place)");

    std::vector<at::Tensor> outs;
    for (int r = 0; r < size(); ++r) outs.push_back(at::full({rows, cols}, 0, on_gpu(dtype)));
    comm->all_gather(outs, in)->wait();
    for (int r = 0; r < size(); ++r) expect_matches(outs[r], parts[r], what + " (list) from rank " + std::to_string(r));
  }
}

TEST_F(Nccl, ReduceScatterEveryOpAndDtype) {
  const int64_t n = 300;
  for (auto dtype : kDtypes) {
    for (auto op : kOps) {
      if (op == ReduceOp::Avg && !at::isFloatingType(dtype)) continue;
      std::vector<at::Tensor> parts;
      for (int r = 0; r < size(); ++r) parts.push_back(input_for(op, dtype, r, size() * n));
      at::Tensor in = parts[rank()].to(device);
      at::Tensor out = at::empty({n}, on_gpu(dtype));
      comm->reduce_scatter(out, in, {op})->wait();
      expect_matches(out, reference_reduce(parts, op).narrow(0, rank() * n, n), "reduce_scatter " + label(dtype, op));
    }
  }
}

TEST_F(Nccl, AllToAllSeparateAndInPlace) {
  const int64_t n = 64;  // elements per chunk
  for (auto dtype : kDtypes) {
    std::vector<at::Tensor> parts;  // rank r's whole input: size() chunks of n
    for (int r = 0; r < size(); ++r) parts.push_back(contribution(dtype, r, size() * n));
    std::vector<at::Tensor> chunks;  // chunk i of the output comes from rank i's chunk rank()
    for (int r = 0; r < size(); ++r) chunks.push_back(parts[r].narrow(0, rank() * n, n));
    const at::Tensor expected = at::cat(chunks);
    const std::string what = std::string("all_to_all ") + c10::toString(dtype);

    at::Tensor in = parts[rank()].to(device);
    at::Tensor out = at::empty({size() * n}, on_gpu(dtype));
    comm->all_to_all(out, in)->wait();
    expect_matches(out, expected, what);

    at::Tensor same = parts[rank()].to(device);
    comm->all_to_all(same, same)->wait();
    expect_matches(same, expected, what + " (in place)");
  }
}

TEST_F(Nccl, SendRecvBetweenPairs) {
  if (size() < 2) GTEST_SKIP() << "needs two ranks (one GPU each)";
  const int partner = rank() ^ 1;
  if (partner >= size()) return;  // the odd rank out has no partner
  const int64_t n = 513;
  for (auto dtype : kDtypes) {
    at::Tensor mine = contribution(dtype, rank(), n).to(device);
    at::Tensor theirs = at::empty({n}, on_gpu(dtype));
    // Each pair issues its halves in opposite orders: NCCL matches send and recv in issue order.
    if (rank() % 2 == 0) {
      comm->send(mine, partner)->wait();
      comm->recv(theirs, partner)->wait();
    } else {
      comm->recv(theirs, partner)->wait();
      comm->send(mine, partner)->wait();
    }
    expect_matches(theirs, contribution(dtype, partner, n), std::string("recv ") + c10::toString(dtype));
  }
}

TEST_F(Nccl, BarrierBlocksTheHostUntilDone) {
  for (int i = 0; i < 5; ++i) {
    auto work = comm->barrier();
    work->wait();
    EXPECT_TRUE(work->is_completed());
    EXPECT_TRUE(work->is_success());
    EXPECT_EQ(work->info().type, loom::OpType::Barrier);
  }
}

TEST_F(Nccl, ZeroElementTensors) {
  at::Tensor empty = at::empty({0}, on_gpu(at::kFloat));
  at::Tensor gathered = at::empty({0}, on_gpu(at::kFloat));
  comm->all_reduce(empty)->wait();
  comm->broadcast(empty, {0})->wait();
  comm->all_gather(gathered, empty)->wait();
  comm->reduce_scatter(gathered, empty)->wait();
  auto work = comm->all_to_all(gathered, empty);
  work->synchronize();
  EXPECT_TRUE(work->is_success());
}

// Each in-place all_reduce reads what the caller's stream wrote just before and is read by the next
// add_: a launch that did not wait for the caller's stream (or a wait() that did not order it) loses
// increments.
TEST_F(Nccl, ManyOpsInOrderWithTheCallersStream) {
  at::Tensor t = at::zeros({1 << 22}, on_gpu(at::kFloat));
  for (int i = 0; i < 50; ++i) {
    t.add_(1);
    comm->all_reduce(t, {ReduceOp::Avg})->wait();  // a kernel that reads and writes t, even at one rank
  }
  EXPECT_EQ(t.min().item<float>(), 50.0f);
  EXPECT_EQ(t.max().item<float>(), 50.0f);
}

// The inputs are written on the caller's stream behind a long kernel; operations issued without
// waiting in between must still read them, and all complete in order.
TEST_F(Nccl, QueuedOpsWaitForInputsFromTheCallersStream) {
  busy_current_stream(0.2);
  std::vector<at::Tensor> outs;
  std::vector<loom::WorkPtr> works;
  for (int i = 0; i < 20; ++i) {
    at::Tensor x = at::full({1 << 20}, static_cast<double>(i), on_gpu(at::kFloat));
    outs.push_back(at::empty({size() << 20}, on_gpu(at::kFloat)));
    works.push_back(comm->all_gather(outs.back(), x));
  }
  for (auto& w : works) w->wait();
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(outs[i].min().item<float>(), static_cast<float>(i)) << "op " << i;
    EXPECT_EQ(outs[i].max().item<float>(), static_cast<float>(i)) << "op " << i;
  }
}

// Inputs freed right after the call: the caching allocator must not hand their memory to the
// caller's stream while the (busy) NCCL stream has yet to read it.
TEST_F(Nccl, FreedInputsAreNotReusedWhileInUse) {
  // Keep the NCCL stream busy: a long kernel on a side stream the NCCL stream waits for (the first
  // operation is issued while the side stream is current), so everything after it is late.
  loom::WorkPtr busy;
  {
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
    c10::cuda::CUDAStreamGuard guard(side);
    busy_current_stream(0.5);
    at::Tensor one = at::ones({1}, on_gpu(at::kFloat));
    busy = comm->all_reduce(one, {ReduceOp::Avg});
  }
  // The Works are dropped at once too (a Work keeps its tensors alive until the operation ends):
  // only the caching allocator's record of the NCCL stream's use protects the inputs.
  std::vector<at::Tensor> outs, junk;
  for (int i = 0; i < 20; ++i) {
    {
      at::Tensor x = at::full({1 << 20}, static_cast<double>(i), on_gpu(at::kFloat));
      outs.push_back(at::empty({size() << 20}, on_gpu(at::kFloat)));
      (void)comm->all_gather(outs.back(), x);
    }
    junk.push_back(at::full({1 << 20}, -1.0, on_gpu(at::kFloat)));
  }
  busy->wait();
  comm->barrier()->wait();  // after every all_gather on the NCCL stream; blocks the host
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(outs[i].min().item<float>(), static_cast<float>(i)) << "op " << i;
    EXPECT_EQ(outs[i].max().item<float>(), static_cast<float>(i)) << "op " << i;
  }
}

// c10d semantics: wait() makes the current stream wait and returns at once; synchronize() blocks.
TEST_F(Nccl, WaitOrdersTheStreamNotTheHost) {
  busy_current_stream(1.0);
  at::Tensor t = at::ones({1024}, on_gpu(at::kFloat));
  auto work = comm->all_reduce(t, {ReduceOp::Avg});
  const auto start = Clock::now();
  work->wait();
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(300)) << "wait() blocked the host";
  EXPECT_FALSE(work->is_completed()) << "the operation cannot have run: the caller's stream is still busy";
  EXPECT_EQ(work->exception(), nullptr);
  work->synchronize();
  EXPECT_TRUE(work->is_completed());
  EXPECT_TRUE(work->is_success());
  EXPECT_EQ(t.sum().item<float>(), 1024.0f);
}

// Issued under a busy stream, waited for on another, idle one: wait() must order the stream that
// is current at the wait (not the one current at the issue), or the idle stream reads the output
// before the all_gather has written it (zeros).
TEST_F(Nccl, ResultVisibleOnASideStreamAfterWait) {
  c10::cuda::CUDAStream busy = c10::cuda::getStreamFromPool(false, device.index());
  c10::cuda::CUDAStream idle = c10::cuda::getStreamFromPool(false, device.index());
  ASSERT_NE(busy, idle);
  at::Tensor out;
  loom::WorkPtr work;
  {
    c10::cuda::CUDAStreamGuard guard(busy);
    out = at::zeros({size() << 20}, on_gpu(at::kFloat));
    busy_current_stream(0.5);
    at::Tensor in = at::full({1 << 20}, static_cast<double>(rank() + 1), on_gpu(at::kFloat));
    work = comm->all_gather(out, in);
  }
  c10::cuda::CUDAStreamGuard guard(idle);
  work->wait();
  at::Tensor copy = out.clone();  // on the idle stream
  for (int r = 0; r < size(); ++r) {
    at::Tensor part = copy.narrow(0, static_cast<int64_t>(r) << 20, 1 << 20);
    EXPECT_EQ(part.min().item<float>(), static_cast<float>(r + 1)) << "rank " << r << "'s part";
    EXPECT_EQ(part.max().item<float>(), static_cast<float>(r + 1)) << "rank " << r << "'s part";
  }
}

TEST_F(Nccl, WaitWithTimeoutGivesUpButTheOperationGoesOn) {
  busy_current_stream(1.0);
  at::Tensor t = at::ones({1024}, on_gpu(at::kFloat));
  auto work = comm->all_reduce(t, {ReduceOp::Max});
  try {
    work->wait(std::chrono::milliseconds(20));
    ADD_FAILURE() << "wait(20 ms) returned while the caller's stream was busy for a second";
  } catch (const loom::TimeoutError& e) {
    expect_contains(e.what(), "all_reduce");
    expect_contains(e.what(), "wait(0.020 s) gave up after");
  }
  work->synchronize();
  EXPECT_TRUE(work->is_success());
  EXPECT_FALSE(comm->is_broken());
}

TEST_F(Nccl, RejectsCpuTensors) {
  at::Tensor t = at::ones({4});
  try {
    (void)comm->all_reduce(t);
    ADD_FAILURE() << "a CPU tensor was accepted";
  } catch (const loom::InvalidArgumentError& e) {
    expect_contains(e.what(), "all_reduce");
    expect_contains(e.what(), "cpu");
  }
  EXPECT_FALSE(comm->is_broken());
}

TEST_F(Nccl, RejectsAvgOnIntegers) {
  at::Tensor t = at::ones({4}, on_gpu(at::kInt));
  try {
    (void)comm->all_reduce(t, {ReduceOp::Avg});
    ADD_FAILURE() << "avg on int32 was accepted";
  } catch (const loom::InvalidArgumentError& e) {
    expect_contains(e.what(), "avg");
  }
}

TEST_F(Nccl, RejectsNonContiguousTensors) {
  at::Tensor t = at::ones({4, 8}, on_gpu(at::kFloat)).t();
  EXPECT_THROW(comm->all_reduce(t), loom::InvalidArgumentError);
  // Rejected calls leave the communicator usable.
  at::Tensor ok = at::ones({4}, on_gpu(at::kFloat));
  comm->all_reduce(ok, {ReduceOp::Max})->wait();
  EXPECT_EQ(ok.sum().item<float>(), 4.0f);
}

TEST_F(Nccl, RejectsTensorsOnAnotherDevice) {
  if (c10::cuda::device_count() < 2) GTEST_SKIP() << "needs two visible GPUs";
  const int other = (device_index() + 1) % c10::cuda::device_count();
  at::Tensor t = at::ones({4}, at::TensorOptions().device(at::kCUDA, other));
  try {
    (void)comm->all_reduce(t);
    ADD_FAILURE() << "a tensor on cuda:" << other << " was accepted";
  } catch (const loom::InvalidArgumentError& e) {
    expect_contains(e.what(), "cuda:" + std::to_string(other));
  }
}

// A collective inside a CUDA graph capture is refused by name before it is numbered (its events
// may not be queried while captured): the capture still ends cleanly, the communicator is not
// broken, and the next collective runs on every rank at the same sequence number.
TEST_F(Nccl, CudaGraphCaptureIsRefusedByName) {
  at::Tensor t = at::ones({4}, on_gpu(at::kFloat));
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device_index());
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    ASSERT_EQ(cudaStreamBeginCapture(side.stream(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
    try {
      (void)comm->all_reduce(t);
      ADD_FAILURE() << "a collective inside a CUDA graph capture was accepted";
    } catch (const loom::UnsupportedError& e) {
      expect_contains(e.what(), "the nccl backend cannot run it");
      expect_contains(e.what(), "capturing a CUDA graph");
    }
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(side.stream(), &graph), cudaSuccess);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  EXPECT_FALSE(comm->is_broken());
  comm->all_reduce(t)->wait();
  EXPECT_EQ(t.sum().item<float>(), 4.0f * static_cast<float>(comm->size()));
}

TEST_F(Nccl, RejectsADeviceIndexOutOfRange) {
  try {
    loom::nccl::make_communicator(g_runtime->world_comm(), 1000, "gpu-bad", test_options());
    ADD_FAILURE() << "device 1000 was accepted";
  } catch (const loom::InvalidArgumentError& e) {
    expect_contains(e.what(), "gpu-bad");
    expect_contains(e.what(), "out of range");
  }
}

// The operation cannot start before a second-long kernel on the caller's stream ends; its 200 ms
// timeout expires first: TimeoutError from the watchdog, and the communicator is broken.
TEST_F(Nccl, TimeoutFailsTheOperationAndBreaksTheCommunicator) {
  auto timed = loom::nccl::make_communicator(g_runtime->world_comm(), device_index(), "gpu-timeout", test_options());
  busy_current_stream(3.0);  // well past the 0.2 s timeout even if the clock ramps up after calibration
  at::Tensor t = at::ones({1024}, on_gpu(at::kFloat));
  auto work = timed->all_reduce(t, {ReduceOp::Sum, std::chrono::milliseconds(200)});
  const auto start = Clock::now();
  try {
    work->synchronize();
    ADD_FAILURE() << "the operation did not time out";
  } catch (const loom::TimeoutError& e) {
    expect_contains(e.what(), "all_reduce");
    expect_contains(e.what(), "group=gpu-timeout");
    expect_contains(e.what(), "timed out after");
    expect_contains(e.what(), "(timeout 0.200 s)");
  }
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(900)) << "the timeout was detected late";
  EXPECT_TRUE(work->is_completed());
  EXPECT_NE(work->exception(), nullptr);
  EXPECT_TRUE(timed->is_broken());
  try {
    (void)timed->all_reduce(t);
    ADD_FAILURE() << "a broken communicator accepted an operation";
  } catch (const loom::CommError& e) {
    expect_contains(e.what(), "broken");
  }
  // Let the queued kernels run out before the destructor aborts the broken communicator.
  c10::cuda::device_synchronize();
  timed.reset();
  // The test's main communicator is unaffected.
  at::Tensor ok = at::ones({4}, on_gpu(at::kFloat));
  comm->all_reduce(ok, {ReduceOp::Max})->wait();
  EXPECT_EQ(ok.sum().item<float>(), 4.0f);
}

TEST_F(Nccl, SplitByColorAndKey) {
  auto same = comm->split(0, rank(), "gpu-all");
  ASSERT_NE(same, nullptr);
  EXPECT_STREQ(same->backend(), "nccl");
  EXPECT_EQ(same->size(), size());
  EXPECT_EQ(same->rank(), rank());
  at::Tensor t = at::full({16}, static_cast<double>(rank() + 1), on_gpu(at::kFloat));
  same->all_reduce(t)->wait();
  EXPECT_EQ(t.min().item<float>(), static_cast<float>(size() * (size() + 1) / 2));

  auto reversed = comm->split(0, size() - rank(), "gpu-reversed");
  ASSERT_NE(reversed, nullptr);
  EXPECT_EQ(reversed->rank(), size() - 1 - rank());

  auto parity = comm->split(rank() % 2, rank(), "gpu-parity");
  ASSERT_NE(parity, nullptr);
  EXPECT_EQ(parity->size(), (size() - rank() % 2 + 1) / 2);
  at::Tensor one = at::ones({8}, on_gpu(at::kInt));
  parity->all_reduce(one)->wait();
  EXPECT_EQ(one.min().item<int>(), parity->size());

  EXPECT_EQ(comm->split(-1, 0, "gpu-none"), nullptr);
}

// A communicator of its own, with a short timeout, for tests that leave it broken.
std::shared_ptr<loom::Communicator> fresh_communicator(const std::string& name, std::chrono::milliseconds timeout) {
  auto options = test_options();
  options.timeout = timeout;
  return loom::nccl::make_communicator(g_runtime->world_comm(), device_index(), name, options);
}

// Raise mode: a rank missing from a collective makes the others time out; their communicator is
// aborted, which releases the stream, so the host sync that follows returns (it hung before).
TEST_F(Nccl, RaiseModeTimeoutReleasesTheStream) {
  if (size() < 2) GTEST_SKIP() << "needs a peer that can be missing";
  auto timed = fresh_communicator("gpu-raise", std::chrono::milliseconds(2000));
  at::Tensor t = at::ones({1 << 16}, on_gpu(at::kFloat));
  // Connected on both ranks first (NCCL connects lazily): the lone call below is then a kernel
  // spinning on the device for a peer that never comes, which only the abort releases; before it
  // connected, it would fail inside the call instead, taking another path.
  EXPECT_NO_THROW(timed->all_reduce(t, {ReduceOp::Avg})->synchronize());
  const auto start = Clock::now();
  if (rank() == 0) {
    auto work = timed->all_reduce(t, {ReduceOp::Avg, std::chrono::milliseconds(500)});
    EXPECT_NO_THROW(work->wait());                // the stream waits, the host does not
    EXPECT_NO_THROW((void)t.sum().item<float>());  // a host sync: returns once the aborted kernel ended
    EXPECT_THROW(work->synchronize(), loom::TimeoutError);
    EXPECT_TRUE(timed->is_broken());
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
  }
  EXPECT_NO_THROW(g_runtime->world_comm()->barrier()->wait());
}

// A peer that never makes its matching call while NCCL connects lazily (the first send): the
// deadline is registered before the NCCL call, and the call is polled against it.
TEST_F(Nccl, APeerThatNeverConnectsTimesOut) {
  if (size() < 2) GTEST_SKIP() << "needs a peer";
  auto timed = fresh_communicator("gpu-connect", std::chrono::milliseconds(2000));
  if (rank() == 0) {
    at::Tensor t = at::ones({1 << 20}, on_gpu(at::kFloat));
    const auto start = Clock::now();
    try {
      timed->send(t, 1, {0, std::chrono::milliseconds(2000)})->synchronize();
      ADD_FAILURE() << "a send to a rank that never receives completed";
    } catch (const loom::TimeoutError& e) {
      expect_contains(e.what(), "send seq=0");
    }
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  }
  g_runtime->world_comm()->barrier()->wait();
}

// Both ranks send 64 MiB and receive 64 MiB: single send/recv calls would deadlock past NCCL's
// buffering; one batch cannot.
TEST_F(Nccl, BatchedExchangeCannotDeadlock) {
  if (size() < 2) GTEST_SKIP() << "needs a peer";
  const int partner = rank() ^ 1;
  if (partner >= size()) return;
  const int64_t n = 16 << 20;
  at::Tensor mine = at::full({n}, static_cast<double>(rank() + 1), on_gpu(at::kFloat));
  at::Tensor theirs = at::zeros({n}, on_gpu(at::kFloat));
  auto work = comm->batch_isend_irecv({{loom::P2POp::Kind::Send, mine, partner}, {loom::P2POp::Kind::Recv, theirs, partner}},
                                      {0, std::chrono::seconds(30)});
  work->synchronize();
  EXPECT_EQ(theirs.min().item<float>(), static_cast<float>(partner + 1));
  EXPECT_EQ(theirs.max().item<float>(), static_cast<float>(partner + 1));
}

// Host time of issuing one small collective (launch plus the poll of a nonblocking communicator),
// synchronizing between calls: printed for benchmarks/gpu_check.sh, which runs it with and without
// NCCL_COMM_BLOCKING=1. At one rank NCCL takes a path without its launch thread: run it at two.
TEST_F(Nccl, IssueCost) {
  at::Tensor t = at::ones({1}, on_gpu(at::kFloat));
  for (int i = 0; i < 20; ++i) comm->all_reduce(t, {ReduceOp::Avg})->synchronize();  // warm, connected
  std::vector<double> us;
  for (int i = 0; i < 200; ++i) {
    const auto start = Clock::now();
    auto work = comm->all_reduce(t, {ReduceOp::Avg});
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    work->synchronize();
  }
  std::sort(us.begin(), us.end());
  std::printf("issue cost: median %.1f us, p90 %.1f us over %zu all_reduce calls at %d ranks (NCCL_COMM_BLOCKING=%s)\n",
              us[us.size() / 2], us[us.size() * 9 / 10], us.size(), size(),
              std::getenv("NCCL_COMM_BLOCKING") ? std::getenv("NCCL_COMM_BLOCKING") : "unset");
  EXPECT_FALSE(comm->is_broken());
}

// A device fault (a kernel reading far out of bounds, which asserts on the device) while a
// collective is in flight: the operation fails with CommError and the communicator breaks, within
// seconds; nothing hangs (the watchdog found the fault while holding the in-flight lock and once
// deadlocked there). Run alone in a process of its own: a device assert poisons the CUDA context.
TEST(NcclDeviceFault, FaultFailsWithoutHanging) {
  if (!loom::nccl::device_available()) GTEST_SKIP() << "no CUDA device visible";
  if (!std::getenv("LOOM_TEST_DEVICE_FAULT")) GTEST_SKIP() << "set LOOM_TEST_DEVICE_FAULT=1 (gpu_check.sh does)";
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index()));
  auto faulty = loom::nccl::make_communicator(g_runtime->world_comm(), device_index(), "gpu-fault", test_options());
  const at::TensorOptions on_gpu = at::TensorOptions().device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index()));
  at::Tensor t = at::ones({1 << 16}, on_gpu);
  faulty->all_reduce(t, {ReduceOp::Avg})->synchronize();
  busy_current_stream(0.3);
  at::Tensor bad = at::full({1}, int64_t{1} << 40, on_gpu.dtype(at::kLong));
  at::Tensor read = t.index_select(0, bad);  // asserts on the device, later
  auto work = faulty->all_reduce(t, {ReduceOp::Avg});
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  const auto start = Clock::now();
  EXPECT_THROW(work->synchronize(), loom::CommError);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  const auto broken_by = Clock::now() + std::chrono::seconds(10);
  while (!faulty->is_broken() && Clock::now() < broken_by) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(faulty->is_broken());
  EXPECT_THROW(faulty->all_reduce(t), loom::CommError);
  faulty.reset();  // aborted (broken): must not hang either
  std::printf("device fault: failed and broke the communicator in %.2f s\n",
              std::chrono::duration<double>(Clock::now() - start).count());
}

// Where no GPU is visible (CI machines) the NCCL path must fail cleanly and together on every rank,
// saying why, rather than hang in NCCL's setup.
TEST(NcclWithoutGpu, MakeCommunicatorExplainsThatNoDeviceIsVisible) {
  if (loom::nccl::device_available()) GTEST_SKIP() << "a GPU is visible: the Nccl tests cover this machine";
  try {
    loom::nccl::make_communicator(g_runtime->world_comm(), 0, "gpu", test_options());
    ADD_FAILURE() << "an NCCL communicator was made without a GPU";
  } catch (const loom::InvalidArgumentError& e) {
    expect_contains(e.what(), "NCCL communicator gpu");
    expect_contains(e.what(), loom::nccl::compiled() ? "0 CUDA device(s) visible" : "built without NCCL");
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_runtime = loom::init();
  const int result = RUN_ALL_TESTS();
  g_comm.reset();  // NCCL communicators go before MPI does
  g_runtime.reset();
  loom::finalize();
  return result;
}
