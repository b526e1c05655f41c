// ZeRO stages 1 and 2 against DDP: the same model, the same data on each rank, the same optimizer;
// after 20 steps the parameters must agree to 1e-6 (fp32). Small bucket caps give several buckets
// and padded shards. Also: memory counted from live storages against the ZeRO formulas, bytes
// communicated against DDP's, and the refusals.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <random>

#include <torch/nn.h>
#include <torch/optim.h>

#include "../hostile_json.h"
#include "loom/amp/grad_scaler.h"
#include "loom/comm/agreement.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/grad_clip.h"
#include "loom/parallel/optimizer_state.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/parallel/zero.h"
#include "loom/train/checkpoint.h"
#include "test_optimizers.h"
#include "test_util.h"
#include "train/checkpoint_files.h"
#include "train/checkpoint_manifest.h"

using namespace loom;
namespace ckpt = loom::detail::ckpt;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", torch::nn::Linear(12, 33));  // odd sizes: shards split parameters
    l2 = register_module("l2", torch::nn::Linear(33, 29));
    l3 = register_module("l3", torch::nn::Linear(29, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return l3(torch::tanh(l2(torch::tanh(l1(x))))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(Net);

using test::Opt;
using test::make;
using test::opt_name;

// This rank's micro-batch `m` of step `step` (different on every rank).
std::pair<at::Tensor, at::Tensor> batch(int step, int m, int rank) {
  at::manual_seed(10000 + 100 * step + 10 * m + rank);
  return {at::randn({6, 12}), at::randn({6, 4})};
}

struct Schedule {
  int steps = 20;
  int micro_batches = 1;
  double clip = 0;         // > 0: clip the global gradient norm to this
  bool scaler = false;     // loom::GradScaler, with a step whose gradients overflow on one rank
};

// A gradient that overflows on rank 1 at step 7 (l3's bias only), so that a single shard sees it.
at::Tensor maybe_overflow(const Net& net, int step, int rank, const at::Tensor& loss) {
  if (step != 7 || rank != 1) return loss;
  return loss + net->l3->bias.sum() * std::numeric_limits<float>::infinity();
}

struct Trained {
  std::vector<at::Tensor> params;
  std::vector<double> norms;
  double scale = 0;
};

Trained train_ddp(Opt opt, const Schedule& s) {
  auto comm = test::world();
  at::manual_seed(3);
  Net net;
  ReducerOptions options;
  options.bucket_cap_bytes = 2048;
  options.first_bucket_cap_bytes = 512;
  DistributedDataParallel<Net> ddp(net, comm, {options});
  auto optimizer = make(opt, ddp->parameters());
  GradScaler scaler({.init_scale = 1024, .growth_interval = 3});
  Trained out;
  for (int step = 0; step < s.steps; ++step) {
    ddp.zero_grad();
    for (int m = 0; m < s.micro_batches; ++m) {
      auto guard = m + 1 < s.micro_batches ? std::optional(ddp.no_sync()) : std::nullopt;
      auto [x, y] = batch(step, m, comm->rank());
      at::Tensor loss = torch::mse_loss(ddp(x), y) / s.micro_batches;
      if (s.scaler) loss = scaler.scale(maybe_overflow(net, step, comm->rank(), loss));
      loss.backward();
    }
    if (s.scaler) scaler.unscale_(*optimizer);
    if (s.clip > 0) out.norms.push_back(torch::nn::utils::clip_grad_norm_(ddp->parameters(), s.clip));
    if (s.scaler) {
      scaler.step(*optimizer);
      scaler.update();
    } else {
      optimizer->step();
    }
  }
  for (auto& p : net->parameters()) out.params.push_back(p.detach().clone());
  out.scale = s.scaler ? scaler.get_scale() : 0;
  return out;
}

Trained train_zero(Opt opt, int stage, const Schedule& s, ZeroStats* stats = nullptr) {
  auto comm = test::world();
  // Each rank starts from other weights: the ZeRO optimizer must broadcast rank 0's.
  at::manual_seed(comm->rank() == 0 ? 3 : 50 + comm->rank());
  Net net;
  ZeroOptions options;
  options.stage = stage;
  options.bucket_cap_bytes = 2048;
  options.first_bucket_cap_bytes = 512;
  ZeroOptimizer zero(net->parameters(), comm, [opt](std::vector<at::Tensor> shard) { return make(opt, shard); },
                     options);
  EXPECT_GT(zero.shard_parameters().size(), 2u) << "expected several buckets";
  GradScaler scaler({.init_scale = 1024, .growth_interval = 3});
  Trained out;
  for (int step = 0; step < s.steps; ++step) {
    zero.zero_grad();
    for (int m = 0; m < s.micro_batches; ++m) {
      auto guard = m + 1 < s.micro_batches ? std::optional(zero.no_sync()) : std::nullopt;
      auto [x, y] = batch(step, m, comm->rank());
      at::Tensor loss = torch::mse_loss(net(x), y) / s.micro_batches;
      if (s.scaler) loss = scaler.scale(maybe_overflow(net, step, comm->rank(), loss));
      loss.backward();
    }
    if (s.scaler) scaler.unscale_(zero);
    if (s.clip > 0) out.norms.push_back(zero.clip_grad_norm(s.clip));
    if (s.scaler) {
      scaler.step(zero);
      scaler.update();
    } else {
      zero.step();
    }
  }
  for (auto& p : net->parameters()) out.params.push_back(p.detach().clone());
  out.scale = s.scaler ? scaler.get_scale() : 0;
  if (stats) *stats = zero.stats();
  return out;
}

void expect_equal(const Trained& zero, const Trained& ddp, const std::string& what) {
  ASSERT_EQ(zero.params.size(), ddp.params.size());
  for (size_t i = 0; i < zero.params.size(); ++i) {
    const double diff = (zero.params[i] - ddp.params[i]).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << what << ": parameter " << i << " differs from DDP's by " << diff;
  }
  ASSERT_EQ(zero.norms.size(), ddp.norms.size());
  for (size_t k = 0; k < zero.norms.size(); ++k) {
    if (!std::isfinite(ddp.norms[k])) {  // the overflowing step: inf on both sides
      EXPECT_FALSE(std::isfinite(zero.norms[k])) << what << ": gradient norm of step " << k;
      continue;
    }
    EXPECT_NEAR(zero.norms[k], ddp.norms[k], 1e-5 * ddp.norms[k]) << what << ": gradient norm of step " << k;
  }
  EXPECT_EQ(zero.scale, ddp.scale) << what << ": loss scale";
}

void compare(const Schedule& s, const std::vector<Opt>& opts = {Opt::SgdMomentum, Opt::Adam, Opt::AdamW}) {
  for (Opt opt : opts) {
    const Trained ddp = train_ddp(opt, s);
    for (int stage : {1, 2}) expect_equal(train_zero(opt, stage, s), ddp, std::string(opt_name(opt)) + " stage " + std::to_string(stage));
  }
}

}  // namespace

TEST(Zero, Stages1And2EqualDdpAfter20Steps) { compare({}); }

TEST(Zero, GradientAccumulationUnderNoSyncEqualsDdp) { compare({.steps = 10, .micro_batches = 3}); }

TEST(Zero, ClippingByTheGlobalNormAcrossShardsEqualsDdp) {
  // The norm is computed from other partial sums than torch's (shards, not parameters), so the clip
  // factors differ in the last float bit; a max_norm that leaves gradients far above Adam's eps
  // keeps that from being amplified. Every step must really clip.
  const double max_norm = 0.3;
  compare({.steps = 10, .clip = max_norm}, {Opt::SgdMomentum, Opt::Adam});
  const Trained ddp = train_ddp(Opt::Adam, {.steps = 10, .clip = max_norm});
  for (double norm : ddp.norms) EXPECT_GT(norm, max_norm) << "a step that did not clip";
}

TEST(Zero, ScalerSkipsEveryShardWhenOneShardOverflows) {
  // Rank 1's overflow lands in the shard of one rank only; every shard must skip that step, and
  // the scale must back off exactly as DDP's does (growth_interval 3: it also grows).
  if (test::world()->size() < 2) GTEST_SKIP() << "needs two ranks for a one-rank overflow";
  compare({.steps = 12, .clip = 1.0, .scaler = true}, {Opt::Adam});
}

namespace {
struct TpNetImpl : torch::nn::Module {
  explicit TpNetImpl(const TensorParallelGroup& group) {
    col = register_module("col", ColumnParallelLinear(12, 34, group));
    row = register_module("row", RowParallelLinear(34, 4, group));
  }
  at::Tensor forward(const at::Tensor& x) { return row(torch::tanh(col(x))); }
  ColumnParallelLinear col{nullptr};
  RowParallelLinear row{nullptr};
};
TORCH_MODULE(TpNet);
}  // namespace

TEST(Zero, TensorParallel2xDataParallel2EqualsDdpOverTheDataParallelGroup) {
  // ZeRO shards inside each DP group; the TP layers' own all-reduces run over the TP group as before.
  // Clipped too: the global norm sums the TP slices over the TP group and counts replicated
  // parameters once, as loom::clip_grad_norm does for DDP.
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "TP 2 x DP 2 needs 4 ranks";
  ParallelState ps(world, 2);
  auto build = [&] {
    at::manual_seed(3);
    ps.seed(3);
    return TpNet(ps.tp_group());
  };
  auto train = [&](auto&& step_fn, TpNet& net) {
    for (int step = 0; step < 20; ++step) {
      auto [x, y] = batch(step, 0, ps.dp_rank());  // the same on both ranks of a TP group
      step_fn(torch::mse_loss(net(x), y));
    }
  };
  for (double clip : {0.0, 0.05}) {
    std::vector<double> ddp_norms;
    TpNet ddp_net = build();
    ReducerOptions small;
    small.bucket_cap_bytes = 512;
    small.first_bucket_cap_bytes = 256;
    GradientReducer reducer(ddp_net->parameters(), ps.dp_group(), small);
    auto ddp_opt = make(Opt::Adam, ddp_net->parameters());
    train([&](at::Tensor loss) {
            reducer.zero_grad();
            loss.backward();
            if (clip > 0) ddp_norms.push_back(loom::clip_grad_norm(*ddp_net, clip, ps.tp_group(), nullptr));
            ddp_opt->step();
          },
          ddp_net);
    if (clip > 0) EXPECT_GT(*std::max_element(ddp_norms.begin(), ddp_norms.end()), clip) << "no step was clipped";

    for (int stage : {1, 2}) {
      std::vector<double> norms;
      TpNet net = build();
      ZeroOptions options;
      options.stage = stage;
      options.bucket_cap_bytes = 512;
      options.first_bucket_cap_bytes = 256;
      ZeroOptimizer zero(net->parameters(), ps.dp_group(),
                         [](std::vector<at::Tensor> shard) { return make(Opt::Adam, shard); }, options);
      train([&](at::Tensor loss) {
              zero.zero_grad();
              loss.backward();
              if (clip > 0) norms.push_back(zero.clip_grad_norm(clip, *net, ps.tp_group()));
              zero.step();
            },
            net);
      zero.wait_parameters();
      auto a = net->parameters(), b = ddp_net->parameters();
      for (size_t i = 0; i < a.size(); ++i) {
        const double diff = (a[i] - b[i]).abs().max().item<double>();
        EXPECT_LE(diff, 1e-6) << "stage " << stage << ", clip " << clip << ": parameter " << i << " (tp rank "
                              << ps.tp_rank() << ", dp rank " << ps.dp_rank() << ") differs from DDP's by " << diff;
      }
      ASSERT_EQ(norms.size(), ddp_norms.size());
      for (size_t k = 0; k < norms.size(); ++k)
        EXPECT_NEAR(norms[k], ddp_norms[k], 1e-5 * ddp_norms[k]) << "stage " << stage << ", step " << k;
    }
  }
}

TEST(Zero, BytesCommunicatedEqualDdps) {
  // Per step: the reduce-scatter's input and the all-gather's output are each the (padded) buckets,
  // one DDP all-reduce's worth of traffic each; DDP's all-reduce is a reduce-scatter plus an
  // all-gather. So ZeRO's two together equal 2 x DDP's all-reduced bytes (padding aside).
  auto comm = test::world();
  const int n = comm->size();
  at::manual_seed(3);
  Net net;
  int64_t numel = 0;
  for (auto& p : net->parameters()) numel += p.numel();
  for (int stage : {1, 2}) {
    ZeroStats stats;
    train_zero(Opt::Adam, stage, {.steps = 4}, &stats);
    EXPECT_EQ(stats.steps, 4u);
    const double per_step = static_cast<double>(stats.bytes_reduce_scattered + stats.bytes_all_gathered) / 4;
    // Alone in the group there is nothing to send: the bucket is the shard.
    const double ddp_per_step = n == 1 ? 0 : 2.0 * numel * sizeof(float);
    EXPECT_GE(per_step, ddp_per_step) << "stage " << stage;
    // Padding: at most n - 1 elements per bucket, twice.
    EXPECT_LE(per_step, ddp_per_step + 2.0 * sizeof(float) * (n - 1) * 8) << "stage " << stage;
    EXPECT_EQ(stats.bytes_reduce_scattered, stats.bytes_all_gathered) << "stage " << stage;
  }
}

namespace {

// A 256-512-256 MLP's parameters in `dtype`, after two Adam steps of ZeRO at `stage` over the world:
// what the memory tests count.
struct MemoryRun {
  std::vector<at::Tensor> params;
  std::unique_ptr<ZeroOptimizer> zero;
  int64_t numel = 0;
};

MemoryRun two_adam_steps(int stage, at::ScalarType dtype, size_t bucket_cap_bytes) {
  torch::nn::Sequential net(torch::nn::Linear(256, 512), torch::nn::ReLU(), torch::nn::Linear(512, 256));
  net->to(dtype);
  MemoryRun run;
  for (auto& p : net->parameters()) {
    run.params.push_back(p.detach().clone().requires_grad_(true));
    run.numel += p.numel();
  }
  ZeroOptions options;
  options.stage = stage;
  options.bucket_cap_bytes = bucket_cap_bytes;
  run.zero = std::make_unique<ZeroOptimizer>(run.params, test::world(), [](std::vector<at::Tensor> shard) {
    return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
  }, options);
  const auto& params = run.params;
  at::Tensor x = at::randn({4, 256}).to(dtype);
  for (int step = 0; step < 2; ++step) {
    run.zero->zero_grad();
    at::Tensor h = at::relu(at::linear(x, params[0], params[1]));
    at::linear(h, params[2], params[3]).square().mean().backward();
    run.zero->step();
  }
  return run;
}

}  // namespace

TEST(Zero, MemoryCountedFromLiveStoragesMatchesTheFormulas) {
  // fp32 parameters with Adam, counted from the tensors' storages after a step:
  //   stage 1: 4 + 4 + 8/N bytes per parameter; stage 2: 4 + 4/N + 8/N; DDP (counted the same way) 4 + 4 + 8.
  const double n = test::world()->size();
  for (int stage : {1, 2}) {
    MemoryRun run = two_adam_steps(stage, at::kFloat, 256 << 10);
    ZeroOptimizer& zero = *run.zero;
    const auto& params = run.params;
    const double P = static_cast<double>(run.numel);
    const ZeroMemory m = zero.memory();
    const double grads = stage == 1 ? 4.0 * P : 4.0 * P / n;
    EXPECT_NEAR(m.parameters, 4.0 * P, 0.05 * 4.0 * P) << "stage " << stage;
    EXPECT_NEAR(m.gradients, grads, 0.05 * grads) << "stage " << stage;
    EXPECT_NEAR(m.optimizer_state, 8.0 * P / n, 0.05 * 8.0 * P / n) << "stage " << stage;
    // Independently of memory(): the optimizer's state tensors are shard-sized.
    int64_t state_numel = 0;
    for (auto& shard : zero.shard_parameters())
      if (auto* s = find_optimizer_state(zero.optimizer(), shard))
        for (auto& [key, t] : optimizer_state_tensors(OptimizerKind::Adam, *s)) state_numel += t.numel();
    EXPECT_NEAR(static_cast<double>(state_numel), 2.0 * P / n, 0.05 * 2.0 * P / n) << "stage " << stage;
    // The parameters live in the flat buffers (the originals were re-seated), and in stage 2 no
    // parameter keeps a gradient after backward.
    for (auto& p : params) {
      if (stage == 2) EXPECT_FALSE(p.grad().defined());
    }
  }
}

TEST(Zero, RefusalsNameWhatWasExpected) {
  auto comm = test::world();
  Net net;
  auto lbfgs = [](std::vector<at::Tensor> shard) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::LBFGS>(shard);
  };
  test::expect_contains(test::rejection([&] { ZeroOptimizer z(net->parameters(), comm, lbfgs); }), "LBFGS");
  auto adam = [](std::vector<at::Tensor> shard) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(shard);
  };
  test::expect_contains(test::rejection([&] { ZeroOptimizer z(net->parameters(), comm, adam, {.stage = 3}); }),
                        "stage must be 1 (optimizer state sharded) or 2 (gradients too), found 3");
  auto own_params = [&](std::vector<at::Tensor>) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(net->parameters());
  };
  test::expect_contains(test::rejection([&] { ZeroOptimizer z(net->parameters(), comm, own_params); }),
                        "expected the optimizer over exactly the");
  ZeroOptions integer_wire;
  integer_wire.reduce_dtype = at::kInt;
  test::expect_contains(test::rejection([&] { ZeroOptimizer z(net->parameters(), comm, adam, integer_wire); }),
                        "reduce_dtype must be a floating-point dtype (float16, bfloat16, float32), found Int");
  ZeroOptimizer zero(net->parameters(), comm, adam);
  test::expect_contains(test::rejection([&] { zero.step(); }), "no synchronised backward since the last step");
  test::expect_contains(test::rejection([&] { zero.clip_grad_norm(1.0); }), "expected gradients to clip");
}

namespace {

// One step of a global batch of 4 micro-batches, split over the `dp` ranks of `group` (each runs
// 4 / dp of them, accumulating locally): the same global step at any data-parallel size.
constexpr int kMicroBatches = 4;

template <typename ZeroGrad, typename Step>
void global_steps(Net& net, GradientReducer& reducer, int from, int to, ZeroGrad&& zero_grad, Step&& step) {
  const int dp = reducer.group().size(), r = reducer.group().rank();
  const int mine = kMicroBatches / dp;
  for (int s = from; s < to; ++s) {
    zero_grad();
    for (int k = 0; k < mine; ++k) {
      auto guard = k + 1 < mine ? std::optional(reducer.no_sync()) : std::nullopt;
      auto [x, y] = batch(s, 0, r * mine + k);
      const auto dtype = net->l1->weight.scalar_type();  // bf16 nets take bf16 batches
      (torch::mse_loss(net(x.to(dtype)), y.to(dtype)) / mine).backward();
    }
    step();
  }
}

std::unique_ptr<ZeroOptimizer> zero_over(Net& net, std::shared_ptr<Communicator> group, int stage,
                                         bool master_weights = true) {
  ZeroOptions options;
  options.master_weights = master_weights;
  options.stage = stage;
  options.bucket_cap_bytes = 2048;
  options.first_bucket_cap_bytes = 512;
  return std::make_unique<ZeroOptimizer>(net->parameters(), std::move(group),
                                         [](std::vector<at::Tensor> shard) { return make(Opt::Adam, shard); }, options);
}

Net fresh_net(int seed, at::ScalarType dtype = at::kFloat) {
  at::manual_seed(seed);
  Net net;
  net->to(dtype);
  return net;
}

// 20 global steps of ZeRO (stage 2) over the world, uninterrupted.
std::vector<at::Tensor> uninterrupted(at::ScalarType dtype = at::kFloat) {
  Net net = fresh_net(3, dtype);
  auto zero = zero_over(net, test::world(), 2);
  global_steps(net, zero->reducer(), 0, 20, [&] { zero->zero_grad(); }, [&] { zero->step(); });
  std::vector<at::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_params(Net& net, const std::vector<at::Tensor>& want, const std::string& what) {
  auto got = net->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = (got[i] - want[i]).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << what << ": parameter " << i << " differs from the uninterrupted run's by " << diff;
  }
}


}  // namespace

TEST(ZeroCheckpoint, ResumedAtAnotherDataParallelSizeEqualsTheUninterruptedRun) {
  // Saved by ZeRO stage 2 over N ranks at step 10; loaded by ZeRO stage 1 over N/2 ranks (whose
  // shards cut the parameters elsewhere) and trained to step 20: equal to 20 uninterrupted steps.
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  auto world = test::world();
  const auto want = uninterrupted();
  const std::string dir = test::shared_dir("zero_resume");
  {
    Net net = fresh_net(3);
    auto zero = zero_over(net, world, 2);
    global_steps(net, zero->reducer(), 0, 10, [&] { zero->zero_grad(); }, [&] { zero->step(); });
    Checkpointer ckpt(world, {.directory = dir, .async = false});
    ckpt.model(net).optimizer(*zero);
    ckpt.save({.step = 10});
  }
  if (auto group = test::first_half_of_the_world()) {
    Net net = fresh_net(99);  // other weights: all must come from the checkpoint
    auto zero = zero_over(net, group, 1);
    Checkpointer ckpt(group, {.directory = dir});
    ckpt.model(net).optimizer(*zero);
    ASSERT_TRUE(ckpt.load_latest().has_value());
    global_steps(net, zero->reducer(), 10, 20, [&] { zero->zero_grad(); }, [&] { zero->step(); });
    expect_params(net, want, "ZeRO at DP " + std::to_string(group->size()));
  }
  test::cleanup(dir);
}

TEST(ZeroCheckpoint, ShardsThatSteppedDifferentlyAreRefusedOnEveryRankAtOnce) {
  // Rank 1's first shard lost its state: the ranks would gather different keys and wait on each
  // other until the group's timeout. They agree first, and every rank refuses at once, naming both.
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  auto world = test::world();
  if (world->size() == 1) GTEST_SKIP() << "needs two ranks";
  const std::string dir = test::shared_dir("zero_mismatch");
  Net net = fresh_net(3);
  auto zero = zero_over(net, world, 2);
  global_steps(net, zero->reducer(), 0, 2, [&] { zero->zero_grad(); }, [&] { zero->step(); });
  if (world->rank() == 1) zero->optimizer().state().erase(zero->shard_parameters()[0].unsafeGetTensorImpl());
  Checkpointer ckpt(world, {.directory = dir, .async = false});
  ckpt.model(net).optimizer(*zero);
  const auto started = std::chrono::steady_clock::now();
  std::string message = "not rejected";
  try {
    ckpt.save({.step = 2});
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), 10.0)
      << "refused at once, not after the group's timeout";
  test::expect_contains(message, "differs between ranks");
  test::expect_contains(message, "rank 0 has every shard: exp_avg exp_avg_sq, step 2; rank 1 has shard 0: (no state); "
                                 "shard 1: exp_avg exp_avg_sq, step 2");
  test::cleanup(dir);
}

TEST(ZeroCheckpoint, ConvertsToAndFromAPlainDataParallelCheckpoint) {
  // The ZeRO checkpoint is the plain optimizer's format: a reducer + Adam over every parameter
  // resumes from it; and ZeRO resumes from one saved by that plain pair. Both equal the
  // uninterrupted run.
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  auto world = test::world();
  const auto want = uninterrupted();
  const std::string from_zero = test::shared_dir("zero_to_ddp"), from_ddp = test::shared_dir("ddp_to_zero");
  {
    Net net = fresh_net(3);
    auto zero = zero_over(net, world, 2);
    global_steps(net, zero->reducer(), 0, 10, [&] { zero->zero_grad(); }, [&] { zero->step(); });
    Checkpointer ckpt(world, {.directory = from_zero, .async = false});
    ckpt.model(net).optimizer(*zero).save({.step = 10});
  }
  {
    Net net = fresh_net(3);
    GradientReducer reducer(net->parameters(), world);
    auto adam = make(Opt::Adam, net->parameters());
    global_steps(net, reducer, 0, 10, [&] { reducer.zero_grad(); }, [&] { adam->step(); });
    Checkpointer ckpt(world, {.directory = from_ddp, .async = false});
    ckpt.model(net).optimizer(*adam).save({.step = 10});
  }
  {
    Net net = fresh_net(99);
    GradientReducer reducer(net->parameters(), world);
    auto adam = make(Opt::Adam, net->parameters());
    Checkpointer ckpt(world, {.directory = from_zero});
    ckpt.model(net).optimizer(*adam);
    ASSERT_TRUE(ckpt.load_latest().has_value());
    global_steps(net, reducer, 10, 20, [&] { reducer.zero_grad(); }, [&] { adam->step(); });
    expect_params(net, want, "plain DDP from a ZeRO checkpoint");
  }
  {
    Net net = fresh_net(99);
    auto zero = zero_over(net, world, 2);
    Checkpointer ckpt(world, {.directory = from_ddp});
    ckpt.model(net).optimizer(*zero);
    ASSERT_TRUE(ckpt.load_latest().has_value());
    global_steps(net, zero->reducer(), 10, 20, [&] { zero->zero_grad(); }, [&] { zero->step(); });
    expect_params(net, want, "ZeRO from a plain DDP checkpoint");
  }
  test::cleanup(from_zero);
  test::cleanup(from_ddp);
}

namespace {
// A model with a branch some ranks skip on some steps, and a frozen parameter.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(12, 16));
    extra = register_module("extra", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 4));
    trunk->bias.requires_grad_(false);
  }
  at::Tensor forward(const at::Tensor& x, bool use_extra) {
    auto h = torch::tanh(trunk(x));
    if (use_extra) h = h + extra(h);
    return head(h);
  }
  torch::nn::Linear trunk{nullptr}, extra{nullptr}, head{nullptr};
};
TORCH_MODULE(Branchy);

// The extra branch is used on step s by rank r when (s + r) is even: never by every rank at once
// (at 2+ ranks), so every parameter has a gradient somewhere each step.
bool uses_extra(int step, int rank, int size) { return size == 1 || (step + rank) % 2 == 0; }
}  // namespace

TEST(Zero, UnusedOnSomeRanksAndFrozenParametersEqualDdp) {
  auto comm = test::world();
  const int rank = comm->rank(), size = comm->size();
  auto build = [&] {
    at::manual_seed(rank == 0 ? 11 : 60 + rank);  // rank 0's values, frozen bias included, must win
    return Branchy();
  };
  auto train = [&](Branchy& net, auto&& zero_grad, auto&& step) {
    for (int s = 0; s < 12; ++s) {
      zero_grad();
      auto [x, y] = batch(s, 0, rank);
      torch::mse_loss(net->forward(x, uses_extra(s, rank, size)), y).backward();
      step();
    }
  };
  Branchy ddp_net = build();
  DataParallelOptions ddp_options;
  ddp_options.reducer.find_unused_parameters = true;
  DistributedDataParallel<Branchy> ddp(ddp_net, comm, ddp_options);
  auto adam = make(Opt::AdamW, ddp->parameters());
  std::vector<at::Tensor> trainable;
  for (auto& p : ddp_net->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  train(ddp_net, [&] { ddp.zero_grad(); }, [&] { adam->step(); });
  for (int stage : {1, 2}) {
    Branchy net = build();
    ZeroOptions options;
    options.stage = stage;
    options.find_unused_parameters = true;
    options.bucket_cap_bytes = 512;
    options.first_bucket_cap_bytes = 256;
    ZeroOptimizer zero(net->parameters(), comm, [](std::vector<at::Tensor> shard) { return make(Opt::AdamW, shard); },
                       options);
    EXPECT_EQ(zero.parameters().size(), trainable.size()) << "the frozen bias stays out of the shards";
    train(net, [&] { zero.zero_grad(); }, [&] { zero.step(); });
    EXPECT_GT(zero.reducer().stats().last_buckets_issued_during_backward, 0u) << "reduce-scatter during backward";
    auto a = net->parameters(), b = ddp_net->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      const double diff = (a[i] - b[i]).abs().max().item<double>();
      EXPECT_LE(diff, 1e-6) << "stage " << stage << ": parameter " << i << " differs from DDP's by " << diff;
    }
  }
}

TEST(Zero, Bf16ReduceScatterEqualsDdpsBf16Hook) {
  // The reduce-scatter in bfloat16 (divided first, as DDP's bf16 hook does): the same rounding as
  // DDP with comm_hooks::bf16_compress() at 2 ranks (one addition per element: order-free).
  auto comm = test::world();
  if (comm->size() != 2) GTEST_SKIP() << "bit-comparable with DDP's bf16 all-reduce at 2 ranks";
  const int rank = comm->rank();
  auto train = [&](Net& net, auto&& zero_grad, auto&& step) {
    for (int s = 0; s < 6; ++s) {
      zero_grad();
      auto [x, y] = batch(s, 0, rank);
      torch::mse_loss(net(x), y).backward();
      step();
    }
  };
  at::manual_seed(3);
  Net ddp_net;
  DataParallelOptions ddp_options;
  ddp_options.reducer.comm_hook = comm_hooks::bf16_compress();
  DistributedDataParallel<Net> ddp(ddp_net, comm, ddp_options);
  auto sgd = make(Opt::SgdMomentum, ddp->parameters());
  train(ddp_net, [&] { ddp.zero_grad(); }, [&] { sgd->step(); });
  at::manual_seed(3);
  Net net;
  ZeroOptions options;
  options.reduce_dtype = at::kBFloat16;
  ZeroOptimizer zero(net->parameters(), comm, [](std::vector<at::Tensor> shard) { return make(Opt::SgdMomentum, shard); },
                     options);
  train(net, [&] { zero.zero_grad(); }, [&] { zero.step(); });
  auto a = net->parameters(), b = ddp_net->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const double diff = (a[i] - b[i]).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << "parameter " << i << " differs from DDP's (bf16 hook) by " << diff;
  }
  // And the bf16 wire is really used: fp32 training differs by more than rounding.
  at::manual_seed(3);
  Net exact;
  ZeroOptimizer fp32(exact->parameters(), comm, [](std::vector<at::Tensor> shard) { return make(Opt::SgdMomentum, shard); });
  train(exact, [&] { fp32.zero_grad(); }, [&] { fp32.step(); });
  EXPECT_GT((exact->l1->weight - net->l1->weight).abs().max().item<double>(), 1e-5);
  EXPECT_EQ(zero.stats().bytes_reduce_scattered * 2, fp32.stats().bytes_reduce_scattered) << "half the bytes";
}

// ---- Mixed precision: fp32 master weights for bf16 parameters ------------------------------------

namespace {

// bf16 parameters stepped by Adam at a learning rate below half a bf16 ulp of most weights: only
// fp32 master weights remember the updates (stepped in bf16, most parameters never move).
constexpr double kSmallLr = 2e-4;

std::unique_ptr<torch::optim::Optimizer> small_adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(kSmallLr));
}

struct MixedRun {
  std::vector<at::Tensor> params;   // bf16, as trained
  std::vector<at::Tensor> masters;  // fp32, per parameter (the reference's), or empty
};

template <typename Forward, typename ZeroGrad, typename Step>
void bf16_steps(int steps, int rank, Forward&& forward, ZeroGrad&& zero_grad, Step&& step) {
  for (int s = 0; s < steps; ++s) {
    zero_grad();
    auto [x, y] = batch(s, 0, rank);
    torch::mse_loss(forward(x.to(at::kBFloat16)), y.to(at::kBFloat16)).backward();
    step();
  }
}

// The reference: DDP over the bf16 model (bf16 gradients averaged over the world), an fp32 copy of
// every parameter stepped by Adam with the bf16 gradients in fp32, cast back into the parameters.
MixedRun train_masters_by_hand(int steps) {
  auto comm = test::world();
  Net net = fresh_net(3, at::kBFloat16);
  ReducerOptions options;
  options.bucket_cap_bytes = 2048;
  options.first_bucket_cap_bytes = 512;
  DistributedDataParallel<Net> ddp(net, comm, {options});
  MixedRun out;
  for (auto& p : net->parameters()) out.masters.push_back(p.detach().to(at::kFloat));
  auto adam = small_adam(out.masters);
  bf16_steps(steps, comm->rank(), [&](const at::Tensor& x) { return ddp(x); }, [&] { ddp.zero_grad(); }, [&] {
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) out.masters[i].mutable_grad() = params[i].grad().to(at::kFloat);
    adam->step();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(out.masters[i]);
  });
  for (auto& p : net->parameters()) out.params.push_back(p.detach().clone());
  return out;
}

ZeroOptions small_buckets(int stage) {
  ZeroOptions options;
  options.stage = stage;
  options.bucket_cap_bytes = 1024;
  options.first_bucket_cap_bytes = 256;
  return options;
}

// This rank's master shard of bucket b as the reference holds it (its masters laid out as ZeRO lays
// out the parameters).
at::Tensor reference_shard(const ZeroOptimizer& zero, const std::vector<at::Tensor>& masters, size_t b) {
  const int64_t S = zero.shard_numel(b);
  const int n = zero.group().size(), r = zero.group().rank();
  at::Tensor flat = at::zeros({S * n});
  for (size_t i = 0; i < masters.size(); ++i) {
    const auto& p = zero.placements()[i];
    if (p.bucket == b) flat.narrow(0, p.offset, p.numel).copy_(masters[i].reshape({-1}));
  }
  return flat.narrow(0, r * S, S);
}

double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, (a[i].to(at::kFloat) - b[i].to(at::kFloat)).abs().max().item<double>());
  return worst;
}

}  // namespace

TEST(Zero, Bf16ParametersSteppedOnFp32MasterWeightsEqualMasterWeightsKeptByHand) {
  // 20 steps: ZeRO stages 1 and 2 keep fp32 masters of their shards and equal the reference that
  // keeps fp32 masters of everything beside DDP (at 1 and 2 ranks the masters to 1e-6 and the bf16
  // parameters exactly); without masters (stepped in bf16) the small updates are lost.
  auto comm = test::world();
  const MixedRun want = train_masters_by_hand(20);
  const double moved = max_diff(want.params, fresh_net(3, at::kBFloat16)->parameters());
  ASSERT_GT(moved, 1e-3) << "the reference must move the parameters";
  // At 4 ranks MPI adds the four bf16 gradients in another order in the reduce-scatter than in the
  // all-reduce: a gradient may differ by a bf16 ulp, and Adam's update by up to its learning rate.
  const double master_tolerance = comm->size() <= 2 ? 1e-6 : 5 * kSmallLr;
  for (int stage : {1, 2}) {
    Net net = fresh_net(comm->rank() == 0 ? 3 : 40 + comm->rank(), at::kBFloat16);
    ZeroOptimizer zero(net->parameters(), comm, small_adam, small_buckets(stage));
    ASSERT_GT(zero.shard_parameters().size(), 2u) << "expected several buckets";
    for (size_t b = 0; b < zero.shard_parameters().size(); ++b) {
      EXPECT_TRUE(zero.has_master_weights(b));
      EXPECT_EQ(zero.shard_parameters()[b].scalar_type(), at::kFloat) << "the optimizer steps fp32 masters";
    }
    bf16_steps(20, comm->rank(), [&](const at::Tensor& x) { return net(x); }, [&] { zero.zero_grad(); },
               [&] { zero.step(); });
    for (size_t b = 0; b < zero.shard_parameters().size(); ++b) {
      const double diff = (zero.shard_parameters()[b] - reference_shard(zero, want.masters, b)).abs().max().item<double>();
      EXPECT_LE(diff, master_tolerance) << "stage " << stage << ": master shard " << b << " differs from the reference's by " << diff;
    }
    const double params_diff = max_diff(net->parameters(), want.params);
    EXPECT_LE(params_diff, comm->size() <= 2 ? 0.0 : 1e-2) << "stage " << stage << ": bf16 parameters";
  }
  Net bf16_only = fresh_net(3, at::kBFloat16);
  ZeroOptions no_masters = small_buckets(2);
  no_masters.master_weights = false;
  ZeroOptimizer plain(bf16_only->parameters(), comm, small_adam, no_masters);
  EXPECT_EQ(plain.shard_parameters()[0].scalar_type(), at::kBFloat16);
  bf16_steps(20, comm->rank(), [&](const at::Tensor& x) { return bf16_only(x); }, [&] { plain.zero_grad(); },
             [&] { plain.step(); });
  EXPECT_GT(max_diff(bf16_only->parameters(), want.params), 0.25 * moved) << "stepped in bf16, updates are lost";
}

TEST(Zero, ScalerUnscalesTheFp32MasterGradientsOfBf16Parameters) {
  // loom::GradScaler with bf16 parameters and masters: it unscales the fp32 master gradients,
  // skips the step that overflows on one rank on every shard, and otherwise steps what an unscaled
  // run steps (a power-of-two scale: exact), so both runs end equal.
  auto comm = test::world();
  const bool overflows = comm->size() > 1;  // step 7 overflows on rank 1
  auto run = [&](bool scaled) {
    Net net = fresh_net(3, at::kBFloat16);
    ZeroOptimizer zero(net->parameters(), comm, small_adam, small_buckets(2));
    GradScaler scaler({.init_scale = 256, .growth_interval = 1000});
    int skipped = 0;
    for (int s = 0; s < 10; ++s) {
      zero.zero_grad();
      auto [x, y] = batch(s, 0, comm->rank());
      at::Tensor loss = torch::mse_loss(net(x.to(at::kBFloat16)), y.to(at::kBFloat16));
      if (!scaled) {
        loss.backward();
        if (!(overflows && s == 7)) zero.step();
        continue;
      }
      scaler.scale(maybe_overflow(net, s, comm->rank(), loss)).backward();
      scaler.unscale_(zero);
      for (const auto& g : zero.shard_gradients()) EXPECT_EQ(g.scalar_type(), at::kFloat) << "fp32 master gradients";
      if (!scaler.step(zero)) ++skipped;
      scaler.update();
    }
    return std::make_pair(net->parameters(), skipped);
  };
  auto [scaled, skipped] = run(true);
  auto [plain, none] = run(false);
  EXPECT_EQ(skipped, overflows ? 1 : 0) << "the step overflowing on rank 1 only is skipped by every shard";
  EXPECT_LE(max_diff(scaled, plain), 0.0) << "scaled and unscaled runs";
}

TEST(Zero, MemoryOfBf16ParametersWithMastersMatchesTheMixedPrecisionFormulas) {
  // bf16 parameters, fp32 masters and Adam state, counted from live storages after a step:
  //   stage 1: 2 + 2 + 12/N bytes per parameter;  stage 2: 2 + 14/N  (ZeRO's K = 12).
  const double n = test::world()->size();
  for (int stage : {1, 2}) {
    MemoryRun run = two_adam_steps(stage, at::kBFloat16, 128 << 10);
    ZeroOptimizer& zero = *run.zero;
    const double P = static_cast<double>(run.numel);
    const ZeroMemory m = zero.memory();
    const double total = static_cast<double>(m.parameters + m.gradients + m.master_weights + m.optimizer_state);
    const double formula = stage == 1 ? (4 + 12 / n) * P : (2 + 14 / n) * P;
    EXPECT_NEAR(m.master_weights, 4.0 * P / n, 0.05 * 4.0 * P / n) << "stage " << stage;
    EXPECT_NEAR(m.optimizer_state, 8.0 * P / n, 0.05 * 8.0 * P / n) << "stage " << stage;
    EXPECT_NEAR(total, formula, 0.05 * formula) << "stage " << stage << ": " << total / P << " bytes per parameter";
  }
}

TEST(ZeroCheckpoint, Bf16MasterWeightsResumeAsTheUninterruptedRun) {
  // bf16 parameters with fp32 masters: the masters are saved (master/<param>), so a run resumed by
  // stage 1 from stage 2's checkpoint steps from the same fp32 values and equals the uninterrupted
  // run exactly. (At the same DP size: at another one, bf16 gradient accumulation rounds
  // differently, as it would without a checkpoint.) Without the saved masters the resumed run
  // would step from the bf16 values and drift.
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  auto world = test::world();
  const auto want = uninterrupted(at::kBFloat16);
  const std::string dir = test::shared_dir("zero_resume_bf16");
  {
    Net net = fresh_net(3, at::kBFloat16);
    auto zero = zero_over(net, world, 2);
    global_steps(net, zero->reducer(), 0, 10, [&] { zero->zero_grad(); }, [&] { zero->step(); });
    Checkpointer ckpt(world, {.directory = dir, .async = false});
    ckpt.model(net).optimizer(*zero);
    ckpt.save({.step = 10});
  }
  Net net = fresh_net(99, at::kBFloat16);
  auto zero = zero_over(net, world, 1);
  Checkpointer ckpt(world, {.directory = dir});
  ckpt.model(net).optimizer(*zero);
  ASSERT_TRUE(ckpt.load_latest().has_value());
  global_steps(net, zero->reducer(), 10, 20, [&] { zero->zero_grad(); }, [&] { zero->step(); });
  expect_params(net, want, "bf16 ZeRO with masters, resumed");
  test::cleanup(dir);
}

// Everything a ZeRO load may change on this rank: the parameters, the fp32 master shards and the
// optimizer's state.
std::vector<at::Tensor> zero_state(Net& net, ZeroOptimizer& zero) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  for (const auto& t : zero.shard_parameters()) out.push_back(t.detach().clone());
  auto& optimizer = zero.optimizer();
  for (const auto& shard : zero.shard_parameters())
    if (auto* state = find_optimizer_state(optimizer, shard)) {
      std::optional<int64_t> steps;
      for (const auto& [key, t] : optimizer_state_tensors(*optimizer_kind(optimizer), *state, &steps))
        out.push_back(t.clone());
      out.push_back(at::tensor(steps.value_or(-1)));
    }
  return out;
}

// The fp32 master records (master/<param>) of a bf16 stage-2 checkpoint, forged from a fresh seed
// each run (printed; LOOM_FUZZ_SEED replays one; rank 0's, broadcast) for at most 10 s, the
// manifest resealed so the checks behind its checksum are reached: a record removed, renamed to
// a parameter that does not exist, retyped, its slices duplicated, or one of its values replaced
// by a hostile one. Every load succeeds or is refused with a CheckpointError on every rank, and a
// refused load changed nothing: parameters, masters and Adam state (which differ from the
// checkpoint's, so a partial load would show).
TEST(ZeroCheckpoint, ForgedMasterRecordsAreRefusedChangingNothing) {
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  auto world = test::world();
  const std::string dir = test::shared_dir("zero_master_forgery");
  Net net = fresh_net(3, at::kBFloat16);
  auto zero = zero_over(net, world, 2);
  auto zero_grad = [&] { zero->zero_grad(); };
  auto step = [&] { zero->step(); };
  global_steps(net, zero->reducer(), 0, 2, zero_grad, step);
  Checkpointer ckpt(world, {.directory = dir, .async = false});
  ckpt.model(net).optimizer(*zero);
  ckpt.save({.step = 2});
  test::SharedFile manifest_file(*world, dir + "/step_000002/manifest.json");
  const std::string& original = manifest_file.original();
  std::vector<std::string> masters;
  const auto saved = nlohmann::ordered_json::parse(original);
  for (const auto& [name, record] : saved["tensors"].items())
    if (name.rfind("master/", 0) == 0) masters.push_back(name);
  ASSERT_EQ(masters.size(), net->parameters().size()) << "one fp32 master record per bf16 parameter";

  const uint64_t seed = test::fuzz_seed(*world, "master forgery");
  SCOPED_TRACE("LOOM_FUZZ_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int refused = 0, loaded = 0, iterations = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (bool go = true; go && iterations < 200; ++iterations) {
    global_steps(net, zero->reducer(), 2, 3, zero_grad, step);  // the live state leaves the checkpoint's
    const auto before = zero_state(net, *zero);
    nlohmann::ordered_json doc = nlohmann::ordered_json::parse(original);
    auto& tensors = doc["tensors"];
    const std::string victim = masters[rng() % masters.size()];
    switch (rng() % 5) {
      case 0: tensors.erase(victim); break;
      case 1: tensors["master/no.such.parameter"] = tensors[victim]; tensors.erase(victim); break;
      case 2: tensors[victim]["dtype"] = "BF16"; break;
      case 3: tensors[victim]["slices"].push_back(tensors[victim]["slices"][0]); break;
      default: test::replace_random_leaf(tensors[victim], rng);
    }
    manifest_file.rewrite(ckpt::reseal_manifest(doc.dump(1)));
    try {
      ckpt.load(dir + "/step_000002");
      ++loaded;
    } catch (const CheckpointError& e) {
      ++refused;
      const auto after = zero_state(net, *zero);
      ASSERT_EQ(after.size(), before.size());
      for (size_t i = 0; i < after.size(); ++i)
        ASSERT_TRUE(at::equal(after[i], before[i])) << "iteration " << iterations << ", state tensor " << i
                                                    << ": a refused load changed it (" << e.what() << ")";
    }
    // At least 20 forgeries however slow the machine; then every rank stops at the same
    // iteration: rank 0's clock decides.
    go = iterations + 1 < 20 ||
         broadcast_values(*world, std::vector<int64_t>{std::chrono::steady_clock::now() < deadline}, 0,
                          {"fuzz deadline"})[0] != 0;
  }
  if (world->rank() == 0)
    std::printf("master forgery: %d forgeries, %d refused, %d loaded\n", iterations, refused, loaded);
  EXPECT_GT(refused, iterations / 2);
  test::cleanup(dir);
}

TEST(Zero, ParametersWrittenInPlaceBetweenStepsPassTheirValuesToTheMasters) {
  // A write into a bf16 parameter between steps (as a model-only checkpoint load does) reaches its
  // master: a step that changes nothing (learning rate 0) keeps the written values, where masters
  // that missed the write would put the old ones back.
  auto comm = test::world();
  Net net = fresh_net(3, at::kBFloat16);
  auto frozen_adam = [](std::vector<at::Tensor> shard) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(0.0));
  };
  ZeroOptimizer zero(net->parameters(), comm, frozen_adam, small_buckets(2));
  auto one_step = [&] {
    zero.zero_grad();
    auto [x, y] = batch(0, 0, comm->rank());
    torch::mse_loss(net(x.to(at::kBFloat16)), y.to(at::kBFloat16)).backward();
    zero.step();
  };
  one_step();
  {
    at::NoGradGuard no_grad;
    net->l2->weight.fill_(0.375);
  }
  one_step();
  EXPECT_TRUE(net->l2->weight.eq(0.375).all().item<bool>()) << "the written values survive a step";
  // Written where the version counter cannot see it: refresh_master_weights() passes it on.
  net->l1->bias.data().fill_(-0.25);
  zero.refresh_master_weights();
  one_step();
  EXPECT_TRUE(net->l1->bias.eq(-0.25).all().item<bool>()) << "after refresh_master_weights()";
}

// ---- The parameter all-gather overlapping the next forward --------------------------------------

namespace {

// The bucket layout train_ddp uses (several buckets), with the parameter all-gather overlapping
// the next forward.
ZeroOptions overlapped(int stage) {
  ZeroOptions options;
  options.stage = stage;
  options.bucket_cap_bytes = 2048;
  options.first_bucket_cap_bytes = 512;
  options.overlap_param_gather = true;
  return options;
}

}  // namespace

TEST(Zero, OverlappedParameterGatherWaitedPerLayerEqualsDdp) {
  // overlap_param_gather: step() returns with every bucket's all-gather unwaited; the forward waits
  // for each layer's parameters just before the layer; 20 steps equal DDP.
  auto comm = test::world();
  const Trained ddp = train_ddp(Opt::Adam, {});
  for (int stage : {1, 2}) {
    at::manual_seed(3);
    Net net;
    const ZeroOptions options = overlapped(stage);
    ZeroOptimizer zero(net->parameters(), comm, [](std::vector<at::Tensor> shard) { return make(Opt::Adam, shard); },
                       options);
    const size_t buckets = zero.shard_parameters().size();
    for (int step = 0; step < 20; ++step) {
      zero.zero_grad();
      auto [x, y] = batch(step, 0, comm->rank());
      if (step > 0 && comm->size() > 1) EXPECT_EQ(zero.unwaited_buckets(), buckets) << "step() waited for nothing";
      zero.wait_parameters(*net->l1);
      at::Tensor h = torch::tanh(net->l1(x));
      if (step > 0 && comm->size() > 1) EXPECT_LT(zero.unwaited_buckets(), buckets);
      if (step > 0 && comm->size() > 1) EXPECT_GT(zero.unwaited_buckets(), 0u) << "l3's bucket still in flight";
      zero.wait_parameters(*net->l2);
      h = torch::tanh(net->l2(h));
      zero.wait_parameters(*net->l3);
      torch::mse_loss(net->l3(h), y).backward();
      zero.step();
    }
    zero.wait_parameters();
    EXPECT_EQ(zero.unwaited_buckets(), 0u);
    Trained got;
    for (auto& p : net->parameters()) got.params.push_back(p.detach().clone());
    expect_equal(got, ddp, "overlapped gather, stage " + std::to_string(stage));
  }
}

TEST(Zero, BackwardThroughParametersNobodyWaitedForIsRefusedByNameAndCanBeRedone) {
  // Overlap on. At step 1 the forward waits for l3's parameters only and reads l1's and l2's
  // unwaited: the backward is refused when their bucket fills (the forward may have read values the
  // all-gather had not yet written), naming them, after l3's bucket was already reduce-scattered.
  // That backward counts for nothing: step() refuses to step on it; the caller waits and redoes
  // it, and 20 steps equal DDP's.
  auto comm = test::world();
  if (comm->size() == 1) GTEST_SKIP() << "alone, the shards are the parameters: nothing to gather";
  const Trained ddp = train_ddp(Opt::Adam, {});
  for (int stage : {1, 2}) {
    at::manual_seed(3);
    Net net;
    ZeroOptions options = overlapped(stage);
    for (const auto& item : net->named_parameters()) options.parameter_names.push_back(item.key());
    ZeroOptimizer zero(net->parameters(), comm, [](std::vector<at::Tensor> shard) { return make(Opt::Adam, shard); },
                       options);
    for (int step = 0; step < 20; ++step) {
      zero.zero_grad();
      auto [x, y] = batch(step, 0, comm->rank());
      if (step == 1) {
        zero.wait_parameters(*net->l3);
        const uint64_t reduced_before = zero.stats().bytes_reduce_scattered;
        const std::string message = test::rejection([&] { torch::mse_loss(net(x), y).backward(); });
        test::expect_contains(message, "nobody waited for");
        test::expect_contains(message, "l2.");
        EXPECT_EQ(message.find("l3."), std::string::npos) << "l3 was waited for: " << message;
        EXPECT_GT(zero.stats().bytes_reduce_scattered, reduced_before) << "no bucket went out before the refusal";
        test::expect_contains(test::rejection([&] { zero.step(); }), "no synchronised backward since the last step");
        zero.wait_parameters();
        zero.zero_grad();
      }
      zero.wait_parameters();
      torch::mse_loss(net(x), y).backward();
      zero.step();
    }
    zero.wait_parameters();
    Trained got;
    for (auto& p : net->parameters()) got.params.push_back(p.detach().clone());
    expect_equal(got, ddp, "refused at step 1 and redone, stage " + std::to_string(stage));
  }
}
