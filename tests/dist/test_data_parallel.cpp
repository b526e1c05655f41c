// Data parallelism against its reference: after N optimizer steps, the weights of a model
// trained data-parallel over R ranks with batch B each must equal those of one process
// training the same model on the concatenated batch R*B (computed on every rank, locally).
#include <gtest/gtest.h>

#include <numeric>
#include <torch/nn.h>
#include <torch/optim.h>

#include "loom/comm/mpi.h"
#include "loom/parallel/data_parallel.h"
#include "loom/train/accumulation.h"
#include "test_util.h"

using namespace loom;

namespace {

constexpr int kBatchPerRank = 8;

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    l1 = register_module("l1", torch::nn::Linear(12, 32));
    l2 = register_module("l2", torch::nn::Linear(32, 32));
    l3 = register_module("l3", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return l3(torch::relu(l2(torch::relu(l1(x))))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(Mlp);

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8 * 8 * 8, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(c2(torch::relu(c1(x))));
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d c1{nullptr}, c2{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvNet);

// A model with a branch that is used only when asked, and a parameter that is never used.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(12, 16));
    extra = register_module("extra", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 4));
    never = register_parameter("never", torch::randn({5}));
  }
  at::Tensor forward(const at::Tensor& x, bool use_extra) {
    auto h = torch::relu(trunk(x));
    if (use_extra) h = h + extra(h);
    return head(h);
  }
  torch::nn::Linear trunk{nullptr}, extra{nullptr}, head{nullptr};
  at::Tensor never;
};
TORCH_MODULE(Branchy);

enum class Task { Regression, Classification, Images };

struct Batch {
  at::Tensor x, y;
};

// The global batch of a step, identical on every rank (drawn from the step's seed).
Batch global_batch(Task task, int step, int ranks) {
  at::manual_seed(1000 + step);
  const int64_t n = static_cast<int64_t>(ranks) * kBatchPerRank;
  if (task == Task::Images) return {at::randn({n, 3, 8, 8}), at::randint(0, 10, {n}, at::kLong)};
  if (task == Task::Classification) return {at::randn({n, 12}), at::randint(0, 4, {n}, at::kLong)};
  return {at::randn({n, 12}), at::randn({n, 4})};
}

at::Tensor loss_of(Task task, const at::Tensor& out, const at::Tensor& y) {
  return task == Task::Regression ? torch::mse_loss(out, y) : torch::nn::functional::cross_entropy(out, y);
}

Batch shard(const Batch& b, int rank) {
  return {b.x.narrow(0, rank * kBatchPerRank, kBatchPerRank), b.y.narrow(0, rank * kBatchPerRank, kBatchPerRank)};
}

enum class Opt { Sgd, Adam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, const std::vector<at::Tensor>& params) {
  if (opt == Opt::Sgd) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

struct Variant {
  ReducerOptions reducer;
  int micro_batches = 1;
  bool optimizer_zero_grad = false;  // optimizer.zero_grad() (drops the views) instead of reducer.zero_grad()
  int steps = 5;
  double rtol = 1e-4, atol = 1e-5;
};

template <typename Model>
void expect_same_weights(Model& a, Model& b, double rtol, double atol) {
  auto pa = a->parameters();
  auto pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    double max_diff = (pa[i] - pb[i]).abs().max().template item<double>();
    EXPECT_TRUE(at::allclose(pa[i], pb[i], rtol, atol)) << "parameter " << i << " differs by " << max_diff;
  }
}

// Trains data-parallel and, on the side, the single-process reference; compares the weights.
template <typename Model>
ReducerStats train_and_compare(Task task, Opt opt, const Variant& v) {
  auto comm = test::world();
  const int R = comm->size();
  const int rank = comm->rank();
  at::manual_seed(7);
  Model reference;
  // Each rank starts from different weights: the reducer's broadcast must make them rank 0's.
  at::manual_seed(rank == 0 ? 7 : 100 + rank);
  Model local;
  DistributedDataParallel<Model> ddp(local, comm, {v.reducer, /*broadcast_buffers=*/true});
  auto ddp_opt = make_optimizer(opt, ddp->parameters());
  auto ref_opt = make_optimizer(opt, reference->parameters());
  GradientAccumulator accumulate(ddp.reducer(), v.micro_batches);

  for (int step = 0; step < v.steps; ++step) {
    Batch full = global_batch(task, step, R);
    Batch mine = shard(full, rank);
    if (v.optimizer_zero_grad) ddp_opt->zero_grad(); else ddp.zero_grad();
    const int64_t micro = kBatchPerRank / v.micro_batches;
    for (int m = 0; m < v.micro_batches; ++m) {
      auto scope = accumulate.next();
      auto out = ddp.forward(mine.x.narrow(0, m * micro, micro));
      auto loss = loss_of(task, out, mine.y.narrow(0, m * micro, micro)) / v.micro_batches;
      loss.backward();
    }
    ddp_opt->step();

    ref_opt->zero_grad();
    loss_of(task, reference->forward(full.x), full.y).backward();
    ref_opt->step();
  }
  expect_same_weights(ddp.module(), reference, v.rtol, v.atol);
  return ddp.reducer().stats();
}

}  // namespace

TEST(DataParallel, MlpSgdEqualsOneProcessOnTheWholeBatch) {
  auto stats = train_and_compare<Mlp>(Task::Regression, Opt::Sgd, {});
  EXPECT_EQ(stats.synchronized_iterations, 5u);
  EXPECT_TRUE(stats.buckets_rebuilt);
}

TEST(DataParallel, MlpAdamClassification) { train_and_compare<Mlp>(Task::Classification, Opt::Adam, {}); }

TEST(DataParallel, ConvNetSgdWithManySmallBuckets) {
  Variant v;
  v.reducer.first_bucket_cap_bytes = 256;
  v.reducer.bucket_cap_bytes = 512;
  auto stats = train_and_compare<ConvNet>(Task::Images, Opt::Sgd, v);
  EXPECT_GE(stats.buckets, 3u);
  // Buckets went to the communicator from the autograd hooks, before backward had finished (at one
  // rank nothing goes anywhere). Whether they overlapped in time is tests/dist/check_timeline.py's.
  if (test::world()->size() > 1) EXPECT_GE(stats.last_buckets_issued_during_backward, 1u);
  else EXPECT_EQ(stats.buckets_reduced, 0u);
}

TEST(DataParallel, ConvNetAdamWithoutGradientViews) {
  Variant v;
  v.reducer.gradient_as_bucket_view = false;
  v.reducer.bucket_cap_bytes = 2048;
  train_and_compare<ConvNet>(Task::Images, Opt::Adam, v);
}

TEST(DataParallel, OptimizerZeroGradDropsViewsAndStillMatches) {
  Variant v;
  v.optimizer_zero_grad = true;
  train_and_compare<Mlp>(Task::Regression, Opt::Sgd, v);
}

TEST(DataParallel, WithoutBucketRebuild) {
  Variant v;
  v.reducer.rebuild_buckets = false;
  v.reducer.bucket_cap_bytes = 1024;
  auto stats = train_and_compare<Mlp>(Task::Regression, Opt::Sgd, v);
  EXPECT_FALSE(stats.buckets_rebuilt);
}

TEST(DataParallel, GradientAccumulationEqualsTheLargerBatch) {
  for (int k : {2, 4}) {
    Variant v;
    v.micro_batches = k;
    auto stats = train_and_compare<Mlp>(Task::Regression, Opt::Sgd, v);
    EXPECT_EQ(stats.iterations, 5u * k);
    EXPECT_EQ(stats.synchronized_iterations, 5u);
  }
}

TEST(DataParallel, AccumulationWithoutViewsAndWithAdam) {
  Variant v;
  v.micro_batches = 2;
  v.reducer.gradient_as_bucket_view = false;
  train_and_compare<ConvNet>(Task::Images, Opt::Adam, v);
}

TEST(DataParallel, Fp16AndBf16CompressionHooks) {
  // The gradients travel rounded to 16 bits: ~1e-3 (fp16) and ~8e-3 (bf16) relative error per
  // step, so the weights after 5 steps agree to about 1e-2 relative.
  for (auto hook : {comm_hooks::fp16_compress(), comm_hooks::bf16_compress()}) {
    Variant v;
    v.reducer.comm_hook = hook;
    v.rtol = 2e-2;
    v.atol = 2e-3;
    train_and_compare<Mlp>(Task::Regression, Opt::Sgd, v);
  }
}

TEST(DataParallel, UserCommHookSeesEveryBucket) {
  // A user hook: sum, then divide by the divisor itself; records the parameters of every bucket
  // it is handed, iteration by iteration (a new iteration starts with bucket 0).
  auto seen = std::make_shared<std::vector<std::vector<size_t>>>();
  auto calls = std::make_shared<uint64_t>(0);
  Variant v;
  v.reducer.first_bucket_cap_bytes = 512;
  v.reducer.bucket_cap_bytes = 2048;
  v.reducer.comm_hook = [seen, calls](GradBucket& bucket) -> PendingReduction {
    ++*calls;
    if (bucket.index == 0) seen->emplace_back();
    seen->back().insert(seen->back().end(), bucket.parameters.begin(), bucket.parameters.end());
    at::Tensor buffer = bucket.buffer;
    double divisor = bucket.divisor;
    return {bucket.group->all_reduce(buffer), [buffer, divisor]() mutable { buffer.div_(divisor); }};
  };
  auto stats = train_and_compare<Mlp>(Task::Regression, Opt::Sgd, v);
  EXPECT_GE(stats.buckets, 2u);
  // Every iteration handed the hook every parameter exactly once.
  ASSERT_EQ(seen->size(), static_cast<size_t>(v.steps));
  for (auto& parameters : *seen) {
    std::sort(parameters.begin(), parameters.end());
    std::vector<size_t> all(parameters.size());
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(parameters, all);
    EXPECT_EQ(parameters.size(), 6u);  // Mlp: three linear layers
  }
  // The reducer's own count is of buckets that really reached the hook.
  EXPECT_EQ(stats.buckets_reduced, *calls);
}

namespace {

// Branchy model: rank r uses the extra branch when (r + step) is even; `never` is never used.
void train_branchy_and_compare(ReducerOptions options, int steps) {
  auto comm = test::world();
  const int R = comm->size();
  const int rank = comm->rank();
  at::manual_seed(3);
  Branchy reference;
  at::manual_seed(3);
  Branchy local;
  options.find_unused_parameters = true;
  DistributedDataParallel<Branchy> ddp(local, comm, {options, true});
  torch::optim::SGD ddp_opt(ddp->parameters(), 0.1);
  torch::optim::SGD ref_opt(reference->parameters(), 0.1);
  for (int step = 0; step < steps; ++step) {
    Batch full = global_batch(Task::Regression, step, R);
    Batch mine = shard(full, rank);
    ddp_opt.zero_grad();
    torch::mse_loss(ddp.forward(mine.x, (rank + step) % 2 == 0), mine.y).backward();
    EXPECT_EQ(ddp.module()->never.grad().defined(), false) << "a parameter no rank used keeps no gradient";
    ddp_opt.step();
    // The reference sees every rank's shard with that rank's choice: mean of per-shard losses.
    ref_opt.zero_grad();
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < R; ++r) {
      Batch part = shard(full, r);
      loss = loss + torch::mse_loss(reference->forward(part.x, (r + step) % 2 == 0), part.y);
    }
    (loss / R).backward();
    ref_opt.step();
  }
  expect_same_weights(ddp.module(), reference, 1e-4, 1e-5);
  // The used set is agreed every iteration, or once with a static graph.
  EXPECT_EQ(ddp.reducer().stats().used_set_agreements, options.static_graph ? 1u : static_cast<uint64_t>(steps));
  // Last step: `never` is unused everywhere; at one rank `extra` (weight, bias) too when the rank
  // skipped it.
  const bool last_skipped_extra = (0 + steps - 1) % 2 == 1;
  EXPECT_EQ(ddp.reducer().stats().last_unused_parameters, R == 1 && last_skipped_extra ? 3u : 1u);
}

}  // namespace

TEST(DataParallel, UnusedParametersOnSomeRanksAndOnAll) { train_branchy_and_compare({}, 4); }

TEST(DataParallel, UnusedParametersWithStaticGraph) {
  // Static graph: the used set is agreed once. Here every rank always uses the same branches
  // (extra is used by some rank in every step when R > 1), so the first agreement holds.
  auto comm = test::world();
  if (comm->size() == 1) GTEST_SKIP() << "usage changes per step at one rank";
  ReducerOptions options;
  options.static_graph = true;
  train_branchy_and_compare(options, 4);
}

// Parameters and buffers go from rank 0 in one broadcast per dtype (coalesced, as c10d does), not
// one per tensor: 60 tensors of three dtypes, some non-contiguous, are three operations, and every
// rank ends with rank 0's values.
TEST(DataParallel, BroadcastOfManyTensorsIsOneCollectivePerDtype) {
  LOOM_SKIP_UNLESS_MPI("counts operations with mpi::progress_counters");
  auto comm = test::world();
  const int rank = comm->rank();
  std::vector<at::Tensor> tensors, expected;
  for (int i = 0; i < 60; ++i) {
    const at::ScalarType dtype = i % 3 == 0 ? at::kFloat : i % 3 == 1 ? at::kDouble : at::kLong;
    at::Tensor root = at::arange(i * 7, i * 7 + 6 + i % 5, at::kLong).to(dtype);
    at::Tensor mine = root * (rank + 1) + rank;  // differs on every rank but 0
    if (i % 4 == 0 && mine.numel() % 2 == 0) mine = mine.reshape({2, -1}).t();  // a non-contiguous view
    if (i % 4 == 0 && root.numel() % 2 == 0) root = root.reshape({2, -1}).t();
    tensors.push_back(mine);
    expected.push_back(root);
  }
  const auto before = mpi::progress_counters(*comm);
  loom::detail::broadcast_tensors(*comm, tensors, "test broadcast");
  const auto after = mpi::progress_counters(*comm);
  const uint64_t operations = after.run_by_waiter + after.run_by_progress_thread - before.run_by_waiter -
                              before.run_by_progress_thread;
  if (comm->size() > 1) EXPECT_EQ(operations, 3u) << "one broadcast per dtype";
  for (size_t i = 0; i < tensors.size(); ++i)
    EXPECT_TRUE(at::equal(tensors[i], expected[i])) << "tensor " << i << " (" << tensors[i].scalar_type() << ")";
}

TEST(DataParallel, MissingGradientWithoutFindUnusedIsAClearError) {
  auto comm = test::world();
  at::manual_seed(3);
  Branchy model;
  DistributedDataParallel<Branchy> ddp(model, comm);
  Batch b = shard(global_batch(Task::Regression, 0, comm->size()), comm->rank());
  try {
    torch::mse_loss(ddp.forward(b.x, false), b.y).backward();
    FAIL() << "expected InvalidArgumentError";
  } catch (const std::exception& e) {
    std::string message = e.what();
    EXPECT_NE(message.find("received no gradient in this backward pass; build the reducer with "
                           "find_unused_parameters = true"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("[rank " + std::to_string(comm->rank()) + "] GradientReducer group=world (rank " + std::to_string(comm->rank()) + " of " + std::to_string(comm->size()) + "): parameters"),
              std::string::npos)
        << message;
  }
  EXPECT_FALSE(comm->is_broken());  // every rank still completed the bucket reductions
}

TEST(DataParallel, MismatchedModelsAcrossRanksAreNamed) {
  auto comm = test::world();
  if (comm->size() == 1) GTEST_SKIP() << "needs a peer";
  const int rank = comm->rank();
  // Rank 1's second layer is wider.
  std::vector<at::Tensor> params = {at::zeros({4, 4}).requires_grad_(), at::zeros({rank == 1 ? 6 : 5}).requires_grad_()};
  try {
    GradientReducer reducer(params, comm);
    FAIL() << "expected MismatchError";
  } catch (const MismatchError& e) {
    std::string expected = rank == 1 ? "parameter 1 is Float [6] on this rank but Float [5] on rank 0"
                                     : "parameter 1 is Float [5] on this rank but Float [6] on rank 1";
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  std::vector<at::Tensor> fewer = {at::zeros({4}).requires_grad_()};
  if (rank == 1) fewer.push_back(at::zeros({4}).requires_grad_());
  EXPECT_THROW(GradientReducer(fewer, comm), MismatchError);
}

TEST(DataParallel, ParameterAddedAfterConstructionIsAnError) {
  auto comm = test::world();
  Mlp model;
  DistributedDataParallel<Mlp> ddp(model, comm);
  model->register_parameter("late", torch::zeros({3}));
  try {
    ddp.forward(torch::zeros({2, 12}));
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("the module has 7 parameters but had 6 when it was wrapped"),
              std::string::npos)
        << e.what();
  }
}

// The wrapper is a torch::nn module holder: ddp(x) and ddp->forward(x) run its checks (before,
// ddp->forward reached the wrapped model's forward and skipped them), it registers as a submodule
// whose parameters are the model's under "module.", and the model stays reachable.
TEST(DataParallel, IsAModuleHolderWhoseEveryForwardIsChecked) {
  auto comm = test::world();
  for (int call = 0; call < 2; ++call) {
    Mlp model;
    DistributedDataParallel<Mlp> ddp(model, comm);
    model->register_parameter("late", torch::zeros({3}));
    try {
      if (call == 0)
        ddp(torch::zeros({2, 12}));
      else
        ddp->forward(torch::zeros({2, 12}));
      ADD_FAILURE() << (call == 0 ? "ddp(x)" : "ddp->forward(x)") << " skipped the check";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("has 7 parameters but had 6"), std::string::npos) << e.what();
    }
  }
  Mlp model;
  DistributedDataParallel<Mlp> ddp(model, comm);
  torch::nn::Module outer;
  outer.register_module("ddp", ddp.ptr());
  const auto named = outer.named_parameters();
  EXPECT_EQ(named.size(), 6u);
  EXPECT_TRUE(named.contains("ddp.module.l1.weight"));
  EXPECT_EQ(named["ddp.module.l1.weight"].data_ptr(), model->l1->weight.data_ptr());
  EXPECT_EQ(ddp.module()->l1->weight.data_ptr(), model->l1->weight.data_ptr());
  at::Tensor y = ddp(torch::ones({2, 12}));
  EXPECT_TRUE(at::equal(y, model->forward(torch::ones({2, 12}))));
}

// As PyTorch requires: freezing or unfreezing a parameter after wrapping is an error naming it.
TEST(DataParallel, FreezingOrUnfreezingAfterConstructionIsAnError) {
  auto comm = test::world();
  for (bool freeze : {true, false}) {
    Mlp model;
    if (!freeze) model->l2->bias.set_requires_grad(false);
    DistributedDataParallel<Mlp> ddp(model, comm);
    model->l2->bias.set_requires_grad(!freeze);
    try {
      ddp.forward(torch::zeros({2, 12}));
      ADD_FAILURE() << "expected InvalidArgumentError";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("parameter l2.bias was ") + (freeze ? "frozen" : "unfrozen") +
                                           " after construction"),
                std::string::npos)
          << e.what();
    }
  }
}

// A parameter that gets no gradient without find_unused_parameters: the error names it (as
// PyTorch's DDP does), where it once gave indices.
TEST(DataParallel, MissingGradientsAreNamed) {
  auto comm = test::world();
  Mlp model;
  DistributedDataParallel<Mlp> ddp(model, comm);
  std::string message;
  try {
    // Backward through l1 and l2 only: l3 gets no gradient on any rank.
    model->l2(torch::relu(model->l1(torch::randn({2, 12})))).sum().backward();
  } catch (const InvalidArgumentError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("parameters l3.weight [4, 32], l3.bias [4] received no gradient"), std::string::npos)
      << message;
}

TEST(DataParallel, StepWhileBucketsArePendingIsAnError) {
  // A tensor hook in the middle of backward stands in for an optimizer step taken too early.
  auto comm = test::world();
  at::manual_seed(5);
  Mlp model;
  ReducerOptions options;
  options.first_bucket_cap_bytes = 256;
  options.bucket_cap_bytes = 256;
  DistributedDataParallel<Mlp> ddp(model, comm, {options, true});
  std::string message;
  auto x = torch::randn({4, 12});
  auto h = torch::relu(ddp.module()->l1(x));  // l1's gradient arrives last, after l3's and l2's buckets
  h.register_hook([&](at::Tensor grad) {
    try {
      ddp.reducer().require_synchronized("optimizer step");
    } catch (const InvalidArgumentError& e) {
      message = e.what();
    }
    return grad;
  });
  ddp.module()->l3(torch::relu(ddp.module()->l2(h))).sum().backward();
  EXPECT_NE(message.find("optimizer step while this iteration's gradients are still being reduced"), std::string::npos)
      << "message: " << message;
  EXPECT_NO_THROW(ddp.reducer().require_synchronized("optimizer step"));  // after backward: all done
}

TEST(DataParallel, NoSyncAccumulatesLocallyThenReducesTheSum) {
  auto comm = test::world();
  const int R = comm->size();
  std::vector<at::Tensor> params = {at::zeros({3}).requires_grad_()};
  GradientReducer reducer(params, comm);
  reducer.zero_grad();
  {
    auto guard = reducer.no_sync();
    (params[0] * (comm->rank() + 1)).sum().backward();  // local grad: rank+1
    EXPECT_TRUE(at::all(params[0].grad().eq(comm->rank() + 1)).item<bool>());
  }
  (params[0] * 10).sum().backward();  // + 10, then averaged over ranks
  const double expected = (R * (R + 1) / 2.0 + 10.0 * R) / R;
  EXPECT_TRUE(at::allclose(params[0].grad(), at::full({3}, expected))) << params[0].grad();
  EXPECT_EQ(reducer.stats().synchronized_iterations, 1u);
}
