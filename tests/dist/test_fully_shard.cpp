// FullyShardedDataParallel against DDP: the same model and data on each rank, the same optimizer;
// after 20 steps the parameters must agree to 1e-6 (fp32), with accumulation, clipping, a skipped
// scaler step, and with resharding after forward on and off. Odd layer sizes give padded shards.
// Also: memory counted from live storages against 16/N bytes per parameter, and the collectives
// counted (two gathers and one reduce-scatter per unit and step; one gather without resharding).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include "loom/amp/grad_scaler.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fully_shard.h"
#include "loom/parallel/grad_clip.h"
#include "loom/parallel/tensor_parallel.h"
#include "shard_net.h"
#include "test_optimizers.h"
#include "test_util.h"

using namespace loom;

namespace {

using test::Opt;
using test::ShardNet;
using test::sharded_forward;
using test::units_of;
using test::make;
using test::opt_name;

std::pair<at::Tensor, at::Tensor> shard_batch(int step, int m, int rank) {
  at::manual_seed(20000 + 100 * step + 10 * m + rank);
  return {at::randn({6, 12}), at::randn({6, 4})};
}

struct Run {
  int steps = 20;
  int micro_batches = 1;
  double clip = 0;
  bool scaler = false;  // with an overflow on rank 1 at step 7, in the head's bias (the root's shard)
  bool no_sync = false;  // micro-batches before the last under no_sync()
  FullyShardOptions options{};
};

struct Result {
  std::vector<at::Tensor> params;
  std::vector<double> norms;
  double scale = 0;
};

at::Tensor overflow_on_rank_1(const ShardNet& net, int step, int rank, const at::Tensor& loss) {
  if (step != 7 || rank != 1) return loss;
  return loss + net->head->bias.sum() * std::numeric_limits<float>::infinity();
}

Result train_with_ddp(Opt opt, const Run& r) {
  auto comm = test::world();
  at::manual_seed(5);
  ShardNet net;
  DistributedDataParallel<ShardNet> ddp(net, comm);
  auto optimizer = make(opt, ddp->parameters());
  GradScaler scaler({.init_scale = 1024, .growth_interval = 3});
  Result out;
  for (int step = 0; step < r.steps; ++step) {
    ddp.zero_grad();
    for (int m = 0; m < r.micro_batches; ++m) {
      auto guard = m + 1 < r.micro_batches ? std::optional(ddp.no_sync()) : std::nullopt;
      auto [x, y] = shard_batch(step, m, comm->rank());
      at::Tensor loss = torch::mse_loss(ddp(x), y) / r.micro_batches;
      if (r.scaler) loss = scaler.scale(overflow_on_rank_1(net, step, comm->rank(), loss));
      loss.backward();
    }
    if (r.scaler) scaler.unscale_(*optimizer);
    if (r.clip > 0) out.norms.push_back(torch::nn::utils::clip_grad_norm_(ddp->parameters(), r.clip));
    if (r.scaler) {
      scaler.step(*optimizer);
      scaler.update();
    } else {
      optimizer->step();
    }
  }
  for (auto& p : net->parameters()) out.params.push_back(p.detach().clone());
  out.scale = r.scaler ? scaler.get_scale() : 0;
  return out;
}

// Shards over `group` (the world when null); the data still differs on every rank of the world.
Result train_fully_sharded(Opt opt, const Run& r, FullyShardStats* stats = nullptr,
                           std::shared_ptr<Communicator> group = nullptr) {
  auto comm = test::world();
  at::manual_seed(comm->rank() == 0 ? 5 : 70 + comm->rank());  // rank 0's weights must be broadcast
  ShardNet net;
  FullyShardedDataParallel fsdp(*net, units_of(net), group ? group : comm, [opt](std::vector<at::Tensor> s) { return make(opt, s); },
                                r.options);
  GradScaler scaler({.init_scale = 1024, .growth_interval = 3});
  Result out;
  for (int step = 0; step < r.steps; ++step) {
    fsdp.zero_grad();
    for (int m = 0; m < r.micro_batches; ++m) {
      auto guard = r.no_sync && m + 1 < r.micro_batches ? std::optional(fsdp.no_sync()) : std::nullopt;
      auto [x, y] = shard_batch(step, m, comm->rank());
      at::Tensor loss = torch::mse_loss(sharded_forward(fsdp, net, x), y) / r.micro_batches;
      if (r.scaler) loss = scaler.scale(overflow_on_rank_1(net, step, comm->rank(), loss));
      loss.backward();
      EXPECT_EQ(fsdp.units_unsharded(), 0u) << "step " << step << ": a unit still gathered after backward";
    }
    if (r.scaler) scaler.unscale_(fsdp);
    if (r.clip > 0) out.norms.push_back(fsdp.clip_grad_norm(r.clip));
    if (r.scaler) {
      scaler.step(fsdp);
      scaler.update();
    } else {
      fsdp.step();
    }
  }
  if (stats) *stats = fsdp.stats();  // the steps' own, before the unshard() that reads the result
  fsdp.unshard();
  for (auto& p : net->parameters()) out.params.push_back(p.detach().clone());
  fsdp.reshard();
  out.scale = r.scaler ? scaler.get_scale() : 0;
  return out;
}

void expect_same(const Result& got, const Result& ddp, const std::string& what) {
  ASSERT_EQ(got.params.size(), ddp.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    const double diff = (got.params[i] - ddp.params[i]).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << what << ": parameter " << i << " differs from DDP's by " << diff;
  }
  ASSERT_EQ(got.norms.size(), ddp.norms.size());
  for (size_t k = 0; k < got.norms.size(); ++k) {
    if (!std::isfinite(ddp.norms[k])) {
      EXPECT_FALSE(std::isfinite(got.norms[k])) << what << ": gradient norm of step " << k;
      continue;
    }
    EXPECT_NEAR(got.norms[k], ddp.norms[k], 1e-5 * ddp.norms[k]) << what << ": gradient norm of step " << k;
  }
  EXPECT_EQ(got.scale, ddp.scale) << what << ": loss scale";
}

void compare_with_ddp(const Run& r, const std::vector<Opt>& opts = {Opt::SgdMomentum, Opt::Adam, Opt::AdamW}) {
  for (Opt opt : opts) expect_same(train_fully_sharded(opt, r), train_with_ddp(opt, r), opt_name(opt));
}

}  // namespace

TEST(FullyShard, EqualsDdpAfter20Steps) { compare_with_ddp({}); }

TEST(FullyShard, WithPrefetchOrWithoutReshardingAfterForwardEqualsDdp) {
  // The CPU's default is no prefetch: the prefetching path explicitly, both directions.
  compare_with_ddp({.options = {.prefetch = true}}, {Opt::Adam});
  compare_with_ddp({.options = {.reshard_after_forward = false, .prefetch = true}}, {Opt::Adam});
  compare_with_ddp({.options = {.reshard_after_forward = false, .prefetch = false}}, {Opt::Adam});
}

TEST(FullyShard, GradientAccumulationEqualsDdpNoSync) {
  compare_with_ddp({.steps = 10, .micro_batches = 3});                  // reduced every micro-batch
  compare_with_ddp({.steps = 10, .micro_batches = 3, .no_sync = true});  // kept whole, reduced once
}

TEST(FullyShard, UnderNoSyncNothingIsReducedAndGradientsStayWhole) {
  auto comm = test::world();
  ShardNet net;
  FullyShardedDataParallel fsdp(*net, units_of(net), comm, [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); });
  auto [x, y] = shard_batch(0, 0, comm->rank());
  {
    auto guard = fsdp.no_sync();
    torch::mse_loss(sharded_forward(fsdp, net, x), y).backward();
  }
  EXPECT_EQ(fsdp.stats().reduce_scatters, 0u);
  EXPECT_TRUE(fsdp.shard_gradients().empty());
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.grad().defined()) << "a gradient dropped under no_sync";
  test::expect_contains(test::rejection([&] { fsdp.step(); }), "no backward since the last step");
  torch::mse_loss(sharded_forward(fsdp, net, x), y).backward();
  EXPECT_EQ(fsdp.stats().reduce_scatters, comm->size() > 1 ? 4u : 0u);
  EXPECT_EQ(fsdp.shard_gradients().size(), 4u);
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << "a whole gradient kept after reducing";
}

TEST(FullyShard, ClippingByTheGlobalNormOverShardsEqualsDdp) {
  const double max_norm = 0.3;
  compare_with_ddp({.steps = 10, .clip = max_norm}, {Opt::SgdMomentum, Opt::Adam});
  for (double norm : train_with_ddp(Opt::Adam, {.steps = 10, .clip = max_norm}).norms)
    EXPECT_GT(norm, max_norm) << "a step that did not clip";
}

TEST(FullyShard, ScalerSkipsEveryShardWhenOneRankOverflows) {
  if (test::world()->size() < 2) GTEST_SKIP() << "needs two ranks for a one-rank overflow";
  compare_with_ddp({.steps = 12, .clip = 1.0, .scaler = true}, {Opt::Adam});
}

TEST(FullyShard, TwoGathersAndOneReduceScatterPerUnitAndStep) {
  const int n = test::world()->size();
  if (n < 2) GTEST_SKIP() << "alone in the group nothing is communicated";
  const int steps = 3;
  FullyShardStats resharding, keeping;
  train_fully_sharded(Opt::Adam, {.steps = steps, .options = {.prefetch = true}}, &resharding);
  train_fully_sharded(Opt::Adam, {.steps = steps, .options = {.reshard_after_forward = false}}, &keeping);
  // 3 blocks and the root. The root is gathered once per step (it never reshards after forward);
  // each block twice with resharding after forward, once without.
  EXPECT_EQ(resharding.all_gathers, static_cast<uint64_t>(steps * (3 * 2 + 1)));
  EXPECT_EQ(keeping.all_gathers, static_cast<uint64_t>(steps * (3 + 1)));
  EXPECT_EQ(resharding.reduce_scatters, static_cast<uint64_t>(steps * 4));
  EXPECT_EQ(keeping.reduce_scatters, resharding.reduce_scatters);
  // Bytes: the padded units, as sent. Block: 17*35+35 + 35*17+17 = 1242 parameters; root: 12*17+17 +
  // 17*4+4 = 293.
  auto padded = [n](int64_t numel) { return (numel + n - 1) / n * n * 4; };
  const uint64_t per_step_rs = 3 * padded(1242) + padded(293);
  EXPECT_EQ(resharding.bytes_reduce_scattered, steps * per_step_rs);
  EXPECT_EQ(resharding.bytes_all_gathered, steps * (6 * padded(1242) + padded(293)));
}

TEST(FullyShard, MemoryIsSixteenBytesPerParameterOverN) {
  auto comm = test::world();
  const int n = comm->size();
  ShardNet net;
  int64_t count = 0;
  for (auto& p : net->parameters()) count += p.numel();
  FullyShardedDataParallel fsdp(*net, units_of(net), comm, [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); });
  for (int step = 0; step < 2; ++step) {
    fsdp.zero_grad();
    auto [x, y] = shard_batch(step, 0, comm->rank());
    torch::mse_loss(sharded_forward(fsdp, net, x), y).backward();
    fsdp.step();
  }
  const ZeroMemory m = fsdp.memory();
  // Between steps nothing is gathered: parameters, gradients and Adam's two moments, each 4 bytes
  // per parameter over N, padding included (at most N - 1 elements per unit).
  const double per_parameter = 16.0 / n;
  const int64_t padding_bytes = 4 * 4 * (n - 1) * 4;
  const int64_t total = m.parameters + m.gradients + m.optimizer_state;
  EXPECT_GE(total, static_cast<int64_t>(per_parameter * count));
  EXPECT_LE(total, static_cast<int64_t>(per_parameter * count) + padding_bytes) << "parameters " << m.parameters
      << ", gradients " << m.gradients << ", optimizer state " << m.optimizer_state << " for " << count << " parameters";
  EXPECT_EQ(fsdp.units_unsharded(), 0u);
  fsdp.unshard();
  EXPECT_EQ(fsdp.units_unsharded(), 4u);
  EXPECT_GE(fsdp.memory().parameters, 4 * count);
  fsdp.reshard();
}

TEST(FullyShard, RefusesModulesThatAreNotUnitsAndOptimizersOverOtherTensors) {
  auto comm = test::world();
  ShardNet net;
  FullyShardedDataParallel fsdp(*net, units_of(net), comm, [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); });
  const std::string not_a_unit = test::rejection([&] { fsdp.forward(*net->head, at::zeros({1, 17}), [](auto& x) { return x; }); });
  test::expect_contains(not_a_unit, "expected the root or one of the 3 units");
  test::expect_contains(not_a_unit, "rank " + std::to_string(comm->rank()));
  test::expect_contains(test::rejection([&] { fsdp.unit_numel(4); }), "expected a unit below 4, found 4");
  test::expect_contains(test::rejection([&] { fsdp.forward(*net, at::zeros({1, 12}), FullyShardedDataParallel::UnitForward()); }),
                        "expected the unit's forward function, found an empty one");
  test::expect_contains(test::rejection([&] { fsdp.step(); }), "no backward since the last step");
  at::manual_seed(9);  // the same values on every rank: the broadcast at construction changes none
  ShardNet other;
  std::vector<at::Tensor> before;
  for (auto& p : other->parameters()) before.push_back(p.detach().clone());
  test::expect_contains(test::rejection([&] {
                          FullyShardedDataParallel bad(*other, units_of(other), comm, [&](std::vector<at::Tensor>) {
                            return make(Opt::Adam, other->parameters());
                          });
                        }),
                        "expected the optimizer over exactly the 4 shard tensors");
  // The refused construction leaves the model whole: every parameter holds its values.
  const auto after = other->parameters();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i])) << "parameter " << i;
}

TEST(FullyShard, HybridShardingTwoByTwoEqualsDdpOverAllRanks) {
  // Shards over pairs {0,1} and {2,3}, replicated over {0,2} and {1,3}; DDP over all four.
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "HSDP 2 x 2 needs 4 ranks";
  ParallelState ps(world, 2);  // tp_group: the contiguous pairs, dp_group: across them
  for (Opt opt : {Opt::SgdMomentum, Opt::Adam}) {
    const Result ddp = train_with_ddp(opt, {.clip = 0.3});
    FullyShardStats stats;
    const Result hybrid = train_fully_sharded(
        opt, {.clip = 0.3, .options = {.prefetch = true, .replicate = ps.dp_group()}}, &stats, ps.tp_group());
    expect_same(hybrid, ddp, std::string("HSDP ") + opt_name(opt));
    EXPECT_GT(stats.bytes_all_reduced, 0u);
  }
}

namespace {
struct ShardTpNetImpl : torch::nn::Module {
  explicit ShardTpNetImpl(const TensorParallelGroup& group) {
    col = register_module("col", ColumnParallelLinear(12, 34, group));
    row = register_module("row", RowParallelLinear(34, 4, group));
  }
  ColumnParallelLinear col{nullptr};
  RowParallelLinear row{nullptr};
};
TORCH_MODULE(ShardTpNet);
}  // namespace

TEST(FullyShard, TensorParallel2xFullyShardedDataParallel2EqualsDdpOverTheDataParallelGroup) {
  // FSDP shards each TP rank's slices over the DP group; the TP layers' all-reduces run over the TP
  // group inside the units' forward and backward. Clipped too: the global norm sums the TP slices
  // over the TP group and counts the replicated row bias once, as loom::clip_grad_norm does for DDP.
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "TP 2 x FSDP 2 needs 4 ranks";
  ParallelState ps(world, 2);
  auto build = [&] {
    at::manual_seed(3);
    ps.seed(3);
    return ShardTpNet(ps.tp_group());
  };
  for (double clip : {0.0, 0.05}) {
    std::vector<double> norms, ddp_norms;
    auto train = [&](const std::function<at::Tensor(ShardTpNet&, const at::Tensor&)>& forward,
                     const std::function<void(at::Tensor)>& step_fn, ShardTpNet& net) {
      for (int step = 0; step < 20; ++step) {
        auto [x, y] = shard_batch(step, 0, ps.dp_rank());  // the same on both ranks of a TP group
        step_fn(torch::mse_loss(forward(net, x), y));
      }
    };
    ShardTpNet ddp_net = build();
    GradientReducer reducer(ddp_net->parameters(), ps.dp_group());
    auto ddp_opt = make(Opt::Adam, ddp_net->parameters());
    train([](ShardTpNet& n, const at::Tensor& x) { return n->row(torch::tanh(n->col(x))); },
          [&](at::Tensor loss) {
            reducer.zero_grad();
            loss.backward();
            if (clip > 0) ddp_norms.push_back(loom::clip_grad_norm(*ddp_net, clip, ps.tp_group(), nullptr));
            ddp_opt->step();
          },
          ddp_net);

    ShardTpNet net = build();
    FullyShardedDataParallel fsdp(*net, {net->col.ptr(), net->row.ptr()}, ps.dp_group(),
                                  [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); }, {.prefetch = true});
    auto unit = [&](auto& layer, const at::Tensor& h) {
      return fsdp.forward(*layer, h, [&](const at::Tensor& h) { return layer(h); });
    };
    train([&](ShardTpNet& n, const at::Tensor& x) {
            return fsdp.forward(*n, x, [&](const at::Tensor& x) { return unit(n->row, torch::tanh(unit(n->col, x))); });
          },
          [&](at::Tensor loss) {
            fsdp.zero_grad();
            loss.backward();
            if (clip > 0) norms.push_back(fsdp.clip_grad_norm(clip, *net, ps.tp_group()));
            fsdp.step();
          },
          net);
    fsdp.unshard();
    const auto got = net->parameters(), want = ddp_net->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-6) << "clip " << clip << ": parameter " << i;
    fsdp.reshard();
    if (clip > 0) {
      // Another model says nothing of these parameters' slices: refused, not a wrong norm.
      auto [x, y] = shard_batch(20, 0, ps.dp_rank());
      fsdp.zero_grad();
      torch::mse_loss(fsdp.forward(*net, x, [&](const at::Tensor& x) { return unit(net->row, torch::tanh(unit(net->col, x))); }),
                      y)
          .backward();
      test::expect_contains(test::rejection([&] { fsdp.clip_grad_norm(clip, *ddp_net, ps.tp_group()); }),
                            "expected the model whose parameters are sharded, found one that holds 0 of the 4");
    }
    ASSERT_EQ(norms.size(), ddp_norms.size());
    for (size_t k = 0; k < norms.size(); ++k) EXPECT_NEAR(norms[k], ddp_norms[k], 1e-5 * ddp_norms[k]) << "step " << k;
    if (clip > 0) EXPECT_GT(*std::max_element(ddp_norms.begin(), ddp_norms.end()), clip) << "no step was clipped";
  }
}

TEST(FullyShard, PeakHoldsTheRootAndOneUnitTwoWithPrefetchAllWithoutResharding) {
  const int n = test::world()->size();
  auto bytes = [n](int64_t numel) { return static_cast<uint64_t>((numel + n - 1) / n * n * 4); };
  const uint64_t root = bytes(293), block = bytes(1242);  // padded units, as in the count above
  FullyShardStats plain, prefetching, keeping;
  train_fully_sharded(Opt::Adam, {.steps = 2, .options = {.prefetch = false}}, &plain);
  train_fully_sharded(Opt::Adam, {.steps = 2, .options = {.prefetch = true}}, &prefetching);
  train_fully_sharded(Opt::Adam, {.steps = 2, .options = {.reshard_after_forward = false, .prefetch = false}}, &keeping);
  // The root stays gathered through forward and backward; a block is freed after its forward and
  // after its gradients are reduced, before the next one's gathers (AccumulateGrad runs first).
  EXPECT_EQ(plain.peak_unsharded_bytes, root + block);
  EXPECT_EQ(prefetching.peak_unsharded_bytes, root + 2 * block);  // the next block's gather started
  EXPECT_EQ(keeping.peak_unsharded_bytes, root + 3 * block);      // every block kept for backward
  {
    // A unit without parameters before each block (an activation, say) moves no prefetch: the
    // recorded order holds units with parameters only. Inside each block's forward of the second
    // step the root, the block and the next block (prefetched) are gathered; the last has no next.
    auto comm = test::world();
    ShardNet net;
    torch::nn::Identity activation;
    auto units = units_of(net);
    units.push_back(activation.ptr());
    FullyShardedDataParallel fsdp(*net, units, comm, [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); },
                                  {.prefetch = true});
    std::vector<size_t> gathered_inside;
    for (int step = 0; step < 2; ++step) {
      fsdp.zero_grad();
      gathered_inside.clear();
      auto [x, y] = shard_batch(step, 0, comm->rank());
      at::Tensor out = fsdp.forward(*net, x, [&](const at::Tensor& x) {
        at::Tensor h = net->in(x);
        for (auto& b : net->blocks) {
          h = fsdp.forward(*activation, h, [&](const at::Tensor& h) { return activation(h); });
          h = fsdp.forward(*b, h, [&](const at::Tensor& h) {
            gathered_inside.push_back(fsdp.units_unsharded());
            return b(h);
          });
        }
        return net->head(h);
      });
      torch::mse_loss(out, y).backward();
      fsdp.step();
    }
    EXPECT_EQ(gathered_inside, (std::vector<size_t>{3, 3, 2})) << "units gathered inside each block's forward";
  }
  // Under no_sync a unit is freed as soon as its gradients are in, though nothing is reduced.
  FullyShardStats accumulating;
  train_fully_sharded(Opt::Adam, {.steps = 2, .micro_batches = 2, .no_sync = true, .options = {.prefetch = false}},
                      &accumulating);
  EXPECT_EQ(accumulating.peak_unsharded_bytes, root + block);
}

namespace {
// The reference, by hand on every rank: a bf16 copy of fp32 master weights computes; its gradients
// are summed over the micro-batches in fp32, all-reduced and averaged; Adam steps the masters; the
// copy takes them. Against FullyShardedDataParallel with param_dtype bf16, reduce_dtype fp32 and
// the micro-batches before the last under no_sync(): the same bits.
void expect_mixed_precision_as_by_hand(int micro_batches) {
  auto comm = test::world();
  const int steps = 10;
  at::manual_seed(5);
  ShardNet ref;
  std::vector<at::Tensor> masters;
  for (auto& p : ref->parameters()) masters.push_back(p.detach().clone());
  ref->to(at::kBFloat16);
  auto ref_opt = make(Opt::Adam, masters);
  const auto ref_params = ref->parameters();
  for (int step = 0; step < steps; ++step) {
    std::vector<at::Tensor> sums(masters.size());
    for (int m = 0; m < micro_batches; ++m) {
      for (auto& p : ref_params) p.mutable_grad().reset();
      auto [x, y] = shard_batch(step, m, comm->rank());
      (torch::mse_loss(ref(x.to(at::kBFloat16)).to(at::kFloat), y) / micro_batches).backward();
      for (size_t i = 0; i < masters.size(); ++i) {
        at::Tensor g = ref_params[i].grad().to(at::kFloat);
        sums[i] = sums[i].defined() ? sums[i].add_(g) : g;
      }
    }
    for (size_t i = 0; i < masters.size(); ++i) {
      comm->all_reduce(sums[i], {ReduceOp::Sum})->wait();
      masters[i].mutable_grad() = sums[i].div_(comm->size());
    }
    ref_opt->step();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < masters.size(); ++i) ref_params[i].copy_(masters[i]);
  }

  at::manual_seed(comm->rank() == 0 ? 5 : 70 + comm->rank());
  ShardNet net;
  FullyShardedDataParallel fsdp(*net, units_of(net), comm, [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); },
                                {.prefetch = true, .param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat});
  for (const auto& shard : fsdp.shard_parameters()) EXPECT_EQ(shard.scalar_type(), at::kFloat) << "the masters";
  for (int step = 0; step < steps; ++step) {
    fsdp.zero_grad();
    for (int m = 0; m < micro_batches; ++m) {
      auto guard = m + 1 < micro_batches ? std::optional(fsdp.no_sync()) : std::nullopt;
      auto [x, y] = shard_batch(step, m, comm->rank());
      (torch::mse_loss(sharded_forward(fsdp, net, x.to(at::kBFloat16)).to(at::kFloat), y) / micro_batches).backward();
    }
    for (const auto& g : fsdp.shard_gradients()) EXPECT_EQ(g.scalar_type(), at::kFloat);
    fsdp.step();
  }
  fsdp.unshard();
  const auto got = net->parameters();
  ASSERT_EQ(got.size(), ref_params.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), at::kBFloat16);
    const double diff = (got[i].to(at::kFloat) - ref_params[i].to(at::kFloat)).abs().max().item<double>();
    EXPECT_EQ(diff, 0.0) << micro_batches << " micro-batches: parameter " << i << " differs from the reference by "
                         << diff;
  }
  fsdp.reshard();
}
}  // namespace

TEST(FullyShard, MixedPrecisionComputesInBf16AndStepsFp32MastersAsTheManualReference) {
  expect_mixed_precision_as_by_hand(1);
  auto comm = test::world();
  test::expect_contains(test::rejection([&] {
                          ShardNet other;
                          FullyShardedDataParallel bad(*other, units_of(other), comm,
                                                       [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); },
                                                       {.param_dtype = at::kInt});
                        }),
                        "param_dtype must be a floating-point dtype, found Int");
}

TEST(FullyShard, MixedPrecisionAccumulatesMicroBatchesInTheReduceDtypeUnderNoSync) {
  // Three micro-batches, the first two under no_sync: their bf16 gradients add up in fp32, as
  // the reference's do (in bf16 they would lose bits at every addition).
  expect_mixed_precision_as_by_hand(3);
}

namespace {
// Block 1's first layer frozen; block 2 holds a layer its forward never calls.
void freeze_one_and_add_an_unused_layer(ShardNet& net) {
  for (auto& p : net->blocks[1]->up->parameters()) p.requires_grad_(false);
  net->blocks[2]->register_module("spare", torch::nn::Linear(17, 3));
}
}  // namespace

TEST(FullyShard, FrozenParametersStayWholeAndAnUnusedOneGetsAZeroGradient) {
  auto comm = test::world();
  auto trained = [&](bool sharded) {
    at::manual_seed(sharded && comm->rank() != 0 ? 70 + comm->rank() : 5);
    ShardNet net;
    freeze_one_and_add_an_unused_layer(net);
    std::vector<at::Tensor> frozen_before;
    for (auto& p : net->blocks[1]->up->parameters()) frozen_before.push_back(p.detach().clone());
    std::vector<at::Tensor> out;
    if (sharded) {
      // SGD without momentum or decay: a zero gradient leaves the unused layer where it was, as
      // DDP's missing one does.
      FullyShardedDataParallel fsdp(*net, units_of(net), comm, [](std::vector<at::Tensor> s) {
        return std::make_unique<torch::optim::SGD>(s, torch::optim::SGDOptions(0.05));
      });
      for (int step = 0; step < 5; ++step) {
        fsdp.zero_grad();
        auto [x, y] = shard_batch(step, 0, comm->rank());
        torch::mse_loss(sharded_forward(fsdp, net, x), y).backward();
        fsdp.step();
      }
      fsdp.unshard();
      for (auto& p : net->parameters()) out.push_back(p.detach().clone());
      fsdp.reshard();
    } else {
      DataParallelOptions options;
      options.reducer.find_unused_parameters = true;
      DistributedDataParallel<ShardNet> ddp(net, comm, options);
      std::vector<at::Tensor> trainable;
      for (auto& p : net->parameters())
        if (p.requires_grad()) trainable.push_back(p);
      torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.05));
      for (int step = 0; step < 5; ++step) {
        ddp.zero_grad();
        auto [x, y] = shard_batch(step, 0, comm->rank());
        torch::mse_loss(ddp(x), y).backward();
        sgd.step();
      }
      for (auto& p : net->parameters()) out.push_back(p.detach().clone());
    }
    // (Other ranks' frozen parameters took rank 0's values: compared with DDP's below.)
    const auto frozen_after = net->blocks[1]->up->parameters();
    for (size_t i = 0; i < frozen_before.size() && (!sharded || comm->rank() == 0); ++i)
      EXPECT_TRUE(frozen_after[i].equal(frozen_before[i])) << (sharded ? "fully sharded" : "DDP") << ": a frozen parameter moved";
    return out;
  };
  const auto ddp = trained(false), fsdp = trained(true);
  ASSERT_EQ(fsdp.size(), ddp.size());
  for (size_t i = 0; i < fsdp.size(); ++i)
    EXPECT_LE((fsdp[i] - ddp[i]).abs().max().item<double>(), 1e-6) << "parameter " << i;
}

TEST(FullyShard, TwoBackwardsThroughOneForwardReduceBothAsDdp) {
  // backward(retain_graph) then backward again: the second reduces as the first (the units are
  // gathered again), and the gradients add up, as DDP's do.
  auto comm = test::world();
  auto sgd = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05)); };
  at::manual_seed(5);
  ShardNet reference;
  DistributedDataParallel<ShardNet> ddp(reference, comm);
  auto ddp_opt = sgd(ddp->parameters());
  at::manual_seed(5);
  ShardNet net;
  FullyShardedDataParallel fsdp(*net, units_of(net), comm, sgd, {.prefetch = true});
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = shard_batch(step, 0, comm->rank());
    ddp.zero_grad();
    at::Tensor ddp_loss = torch::mse_loss(ddp(x), y);
    ddp_loss.backward({}, /*retain_graph=*/true);
    ddp_loss.backward();
    ddp_opt->step();
    fsdp.zero_grad();
    at::Tensor loss = torch::mse_loss(sharded_forward(fsdp, net, x), y);
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    fsdp.step();
  }
  fsdp.unshard();
  const auto got = net->parameters(), want = reference->parameters();
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-6) << "parameter " << i;
  fsdp.reshard();
}

TEST(FullyShard, FrozenParametersComputeInTheParamDtypeToo) {
  auto comm = test::world();
  ShardNet net;
  for (auto& p : net->blocks[1]->up->parameters()) p.requires_grad_(false);
  FullyShardedDataParallel fsdp(*net, units_of(net), comm, [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); },
                                {.param_dtype = at::kBFloat16});
  for (auto& p : net->blocks[1]->up->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
  auto [x, y] = shard_batch(0, 0, comm->rank());
  torch::mse_loss(sharded_forward(fsdp, net, x.to(at::kBFloat16)).to(at::kFloat), y).backward();
  fsdp.step();
}

namespace {
// The identity forward; its backward raises while `fail` is set.
struct RaiseInBackward : torch::autograd::Function<RaiseInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, bool fail) {
    ctx->saved_data["fail"] = fail;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (ctx->saved_data["fail"].toBool()) throw std::runtime_error("a backward that raises, on purpose");
    return {grads[0], at::Tensor()};
  }
};
}  // namespace

TEST(FullyShard, ABackwardThatRaisesIsAbandonedAndTrainingGoesOnAsIfItNeverRan) {
  // Step 2's backward raises after the last two blocks' gradients went to their reduce-scatters
  // (the first block's output raises); its step is skipped. The next forward abandons it: the
  // training then equals DDP's without step 2.
  auto comm = test::world();
  const int steps = 5, failing = 2;
  for (bool prefetch : {false, true}) {
    at::manual_seed(5);
    ShardNet reference;
    DistributedDataParallel<ShardNet> ddp(reference, comm);
    auto ddp_opt = make(Opt::Adam, ddp->parameters());
    for (int step = 0; step < steps; ++step) {
      if (step == failing) continue;
      ddp.zero_grad();
      auto [x, y] = shard_batch(step, 0, comm->rank());
      torch::mse_loss(ddp(x), y).backward();
      ddp_opt->step();
    }
    at::manual_seed(5);
    ShardNet net;
    FullyShardedDataParallel fsdp(*net, units_of(net), comm, [](std::vector<at::Tensor> s) { return make(Opt::Adam, s); },
                                  {.prefetch = prefetch});
    for (int step = 0; step < steps; ++step) {
      fsdp.zero_grad();
      auto [x, y] = shard_batch(step, 0, comm->rank());
      at::Tensor out = fsdp.forward(*net, x, [&](const at::Tensor& x) {
        at::Tensor h = net->in(x);
        for (size_t b = 0; b < net->blocks.size(); ++b) {
          h = fsdp.forward(*net->blocks[b], h, [&](const at::Tensor& h) { return net->blocks[b](h); });
          if (b == 0) h = RaiseInBackward::apply(h, step == failing);
        }
        return net->head(h);
      });
      at::Tensor loss = torch::mse_loss(out, y);
      if (step == failing) {
        const uint64_t issued = fsdp.stats().reduce_scatters;
        test::expect_contains(test::rejection([&] { loss.backward(); }), "on purpose");
        // What the abandon must wait for: the last two blocks' reduce-scatters, still in flight.
        if (comm->size() > 1) EXPECT_EQ(fsdp.stats().reduce_scatters - issued, 2u) << "prefetch " << prefetch;
        continue;
      }
      loss.backward();
      EXPECT_EQ(fsdp.units_unsharded(), 0u) << "step " << step;
      fsdp.step();
    }
    fsdp.unshard();
    const auto got = net->parameters(), want = reference->parameters();
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-6) << "prefetch " << prefetch << ": parameter " << i;
    fsdp.reshard();
  }
}

namespace {
struct BiasOnlyImpl : torch::nn::Module {
  BiasOnlyImpl() { bias = register_parameter("bias", torch::zeros({8})); }
  at::Tensor bias;
};
TORCH_MODULE(BiasOnly);
}  // namespace

TEST(FullyShard, AnFp16ReductionDoesNotOverflowWhereTheAverageFits) {
  // Every rank's gradient is g, 3/4 of fp16's largest value times the pre-divide factor over N:
  // its average, g, fits in fp16; a sum over N ranks before dividing would not (N * g > 65504).
  auto comm = test::world();
  const int n = comm->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "the factors below are worked out for 2 and 4 ranks";
  const double pre = 2;  // FSDP2's pre-divide factor at 2 and at 4 ranks (a power of two near sqrt(N))
  const double g = std::floor(0.75 * 65504 * pre / n / 32) * 32;  // a multiple of fp16's spacing there
  ASSERT_GT(g * n, 65504.0) << "the sum must overflow fp16";
  BiasOnly model;
  FullyShardedDataParallel fsdp(*model, {}, comm,
                                [](std::vector<at::Tensor> s) {
                                  return std::make_unique<torch::optim::SGD>(s, torch::optim::SGDOptions(0.1));
                                },
                                {.reduce_dtype = at::kHalf});
  at::Tensor out = fsdp.forward(*model, at::zeros({1, 8}), [&](const at::Tensor& x) { return x + model->bias; });
  (out * g).sum().backward();
  const auto grads = fsdp.shard_gradients();
  ASSERT_EQ(grads.size(), 1u);
  const at::Tensor shard = grads[0];
  const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(shard.numel(), 8 - comm->rank() * shard.numel()));
  EXPECT_TRUE(shard.isfinite().all().item<bool>()) << "the fp16 reduction overflowed: " << shard;
  EXPECT_TRUE(shard.narrow(0, 0, valid).eq(g).all().item<bool>()) << "expected every gradient " << g << ", found " << shard;
}
