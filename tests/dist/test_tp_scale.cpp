// Tensor parallelism at realistic sizes, under mpirun at 1, 2 and 4 ranks: shard-local
// initialisation, the column-parallel linear whose input-gradient all-reduce overlaps the
// weight-gradient GEMM, and activation recomputation. References: the master-weight layers and the
// same block without recomputation, built from the same seeds; the timeline for the overlap.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "loom/parallel/data_parallel.h"
#include "loom/parallel/recompute.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/trace.h"
#include "rank_report.h"
#include "test_util.h"

using namespace loom;

namespace {

std::map<int, std::unique_ptr<ParallelState>>& states() {
  static std::map<int, std::unique_ptr<ParallelState>> cache;
  return cache;
}
const ParallelState& state(int tp) {
  auto& cache = states();
  if (!cache.count(tp)) cache[tp] = std::make_unique<ParallelState>(test::world(), tp);
  return *cache[tp];
}
std::vector<int> degrees() {
  std::vector<int> out;
  for (int tp : {1, 2, 4})
    if (test::world()->size() % tp == 0) out.push_back(tp);
  return out;
}
at::Tensor randn_seeded(at::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}
// Every rank's copy of `t`, stacked: [group size, ...].
at::Tensor gather(const std::shared_ptr<Communicator>& group, const at::Tensor& t) {
  std::vector<int64_t> shape{group->size()};
  shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
  at::Tensor out = at::empty(shape, t.options());
  group->all_gather(out, t.contiguous())->wait();
  return out;
}

}  // namespace

TEST(ShardedInit, EachRankDrawsItsShardFromTheModelParallelStream) {
  const int64_t in = 24, out = 16, vocab = 32, dim = 8;
  for (int tp : degrees()) {
    SCOPED_TRACE("tp=" + std::to_string(tp));
    const auto& ps = state(tp);
    ps.seed(7);
    ColumnParallelLinearOptions column;
    column.initialization.dtype = at::kDouble;
    ColumnParallelLinear col(in, out, ps.tp_group(), column);
    RowParallelLinear row(out, in, ps.tp_group());
    VocabParallelEmbedding emb(vocab, dim, ps.tp_group());
    // Only the shard exists, in the requested dtype, with the plain layer's distribution over the
    // whole weight (bound 1/sqrt(global fan-in)).
    EXPECT_EQ(col->weight.sizes(), (std::vector<int64_t>{out / tp, in}));
    EXPECT_EQ(col->weight.scalar_type(), at::kDouble);
    EXPECT_EQ(row->weight.sizes(), (std::vector<int64_t>{in, out / tp}));
    EXPECT_EQ(emb->weight.sizes(), (std::vector<int64_t>{vocab / tp, dim}));
    EXPECT_LE(col->weight.abs().max().item<double>(), 1 / std::sqrt(double(in)));
    EXPECT_LE(row->weight.abs().max().item<double>(), 1 / std::sqrt(double(out)));
    // Equal across data-parallel replicas (they hold the same slice) ...
    for (const at::Tensor& w : {col->weight.to(at::kFloat), row->weight, row->bias, emb->weight}) {
      at::Tensor over_dp = gather(ps.dp_group(), w);
      for (int r = 1; r < over_dp.size(0); ++r) EXPECT_TRUE(at::equal(over_dp[r], over_dp[0]));
    }
    // ... the row-parallel bias (added once, after the reduction) equal across the TP group too ...
    at::Tensor bias_over_tp = gather(ps.tp_group(), row->bias);
    for (int r = 1; r < bias_over_tp.size(0); ++r) EXPECT_TRUE(at::equal(bias_over_tp[r], bias_over_tp[0]));
    // ... and different slices on different TP ranks.
    at::Tensor over_tp = gather(ps.tp_group(), emb->weight);
    for (int a = 0; a < tp; ++a)
      for (int b = a + 1; b < tp; ++b) EXPECT_FALSE(at::equal(over_tp[a], over_tp[b])) << "ranks " << a << ", " << b;
    // Reproducible from the seed.
    ps.seed(7);
    ColumnParallelLinear again(in, out, ps.tp_group(), column);
    EXPECT_TRUE(at::equal(again->weight, col->weight));
    // At TP 1 the sharded path draws exactly what the plain layer draws.
    if (tp == 1) {
      torch::manual_seed(3);
      torch::nn::Linear plain(in, out);
      torch::manual_seed(3);
      ColumnParallelLinear one(in, out, ps.tp_group());
      EXPECT_TRUE(at::equal(one->weight, plain->weight));
      EXPECT_TRUE(at::equal(one->bias, plain->bias));
    }
  }
}

TEST(ShardedInit, UnseededTrackerIsAnErrorThatSaysWhatToDo) {
  const int tp = degrees().back();
  if (tp == 1) GTEST_SKIP() << "needs a TP group of more than one rank";
  RngTracker unseeded;
  ColumnParallelLinearOptions options;
  options.initialization.rng = &unseeded;
  try {
    ColumnParallelLinear col(8, 4 * tp, state(tp).tp_group(), options);
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("not seeded: call ParallelState::seed"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ColumnParallelLinear"), std::string::npos) << e.what();
  }
}

// Column-parallel backward: the input gradient's all-reduce runs while the weight gradient is
// computed. The timeline's spans show it: the all-reduce starts before the weight-gradient GEMM
// ends. Composed as copy_to_region + linear, the all-reduce would finish before the GEMM starts.
TEST(AsyncColumnLinear, InputGradientAllReduceOverlapsWeightGradient) {
  const int tp = degrees().back();
  if (tp == 1) GTEST_SKIP() << "needs a TP group of more than one rank";
  const auto& ps = state(tp);
  ps.seed(11);
  const int64_t tokens = 2048, in = 512, out = 512 * tp;
  ColumnParallelLinear col(in, out, ps.tp_group());
  const std::string prefix = (std::filesystem::temp_directory_path() /
                              ("loom_overlap_" + std::to_string(::getpid()))).string();
  const int rank = test::world()->rank();
  bool overlapped = false;
  std::string seen;
  // A loaded machine can starve the progress thread through one GEMM; not through five. Every
  // rank must run the same number of attempts (each is a collective), so the ranks agree after
  // each one whether all of them have seen the overlap yet.
  bool all_overlapped = false;
  for (int attempt = 0; attempt < 5 && !all_overlapped; ++attempt) {
    trace::configure(prefix, rank);
    at::Tensor x = randn_seeded({tokens, in}, 12 + attempt).requires_grad_();
    col(x).sum().backward();
    const std::string path = trace::flush();
    trace::configure("", rank);
    std::ifstream file(path);
    nlohmann::json events = nlohmann::json::parse(file);
    std::filesystem::remove(path);
    if (events.is_object()) events = events["traceEvents"];
    double ar_start = -1, ar_end = -1, gemm_start = -1, gemm_end = -1;
    for (const auto& e : events) {
      if (!e.contains("name") || !e.contains("dur")) continue;
      const double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
      if (e["name"] == "tp dgrad all_reduce") ar_start = ts, ar_end = ts + dur;
      if (e["name"] == "tp wgrad (overlapped)") gemm_start = ts, gemm_end = ts + dur;
    }
    ASSERT_GE(ar_start, 0) << "no all-reduce span in the timeline";
    ASSERT_GE(gemm_start, 0) << "no weight-gradient span in the timeline";
    overlapped = overlapped || (ar_start < gemm_end && gemm_start < ar_end);
    at::Tensor flag = at::full({1}, overlapped ? 1 : 0, at::kInt);
    test::world()->all_reduce(flag, {ReduceOp::Min})->wait();
    all_overlapped = flag.item<int>() == 1;
    seen += " [all_reduce " + std::to_string(ar_start) + ".." + std::to_string(ar_end) + ", wgrad " +
            std::to_string(gemm_start) + ".." + std::to_string(gemm_end) + "]";
  }
  EXPECT_TRUE(overlapped) << "the all-reduce never ran during the weight-gradient GEMM:" << seen;
}

// A block with dropout, recomputed in backward, equals the block without recomputation: same
// outputs, input and parameter gradients, and the random streams end where they would.
TEST(Recompute, ParallelBlockEqualsBlockWithoutRecomputation) {
  const int64_t h = 16, heads = 4, s = 8, b = 2;
  for (int tp : degrees()) {
    for (bool sp : {false, true}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " sequence_parallel=" + std::to_string(sp));
      const auto& ps = state(tp);
      auto build = [&](bool recompute) {
        ParallelTransformerBlockOptions o;
        o.attention_dropout = 0.2;
        o.hidden_dropout = 0.3;
        o.sequence_parallel = sp;
        o.recompute = recompute;
        ps.seed(21);
        return ParallelTransformerBlock(h, heads, ps.tp_group(), o);
      };
      ParallelTransformerBlock plain = build(false), recomputed = build(true);
      const int64_t rows = sp ? s / tp : s, r0 = sp ? ps.tp_rank() * rows : 0;
      at::Tensor full = randn_seeded({s, b, h}, 22);
      at::Tensor g = randn_seeded({s, b, h}, 23).narrow(0, r0, rows);

      auto run = [&](ParallelTransformerBlock& block) {
        ps.seed(31);
        at::Tensor x = full.narrow(0, r0, rows).clone().requires_grad_();
        at::Tensor y = block(x);
        y.backward(g);
        // Where the streams stand afterwards: recomputation must not advance them.
        at::Tensor after = at::rand({4});
        at::Tensor after_mp;
        {
          auto guard = rng_tracker().fork();
          after_mp = at::rand({4});
        }
        return std::vector<at::Tensor>{y.detach(), x.grad(), after, after_mp};
      };
      auto expected = run(plain);
      auto got = run(recomputed);
      EXPECT_TRUE(at::equal(got[0], expected[0])) << "output";
      EXPECT_TRUE(at::equal(got[1], expected[1])) << "input gradient";
      EXPECT_TRUE(at::equal(got[2], expected[2])) << "default generator after backward";
      EXPECT_TRUE(at::equal(got[3], expected[3])) << "model-parallel stream after backward";
      auto p_plain = plain->named_parameters(), p_recomputed = recomputed->named_parameters();
      for (const auto& item : p_plain)
        EXPECT_TRUE(at::equal(p_recomputed[item.key()].grad(), item.value().grad())) << item.key() << " gradient";
    }
  }
}

// On any module (here a plain MLP with dropout), through a data-parallel reducer: parameter
// gradients arrive once, through their accumulators, and equal those without recomputation.
TEST(Recompute, PlainModuleUnderGradientReducerEqualsWithout) {
  auto world = test::world();
  auto build = [] {
    torch::manual_seed(41);
    return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::GELU(), torch::nn::Dropout(0.25),
                                 torch::nn::Linear(32, 12));
  };
  torch::nn::Sequential plain = build(), recomputed = build();
  GradientReducer plain_reducer(plain->parameters(), world), recomputed_reducer(recomputed->parameters(), world);
  for (int step = 0; step < 2; ++step) {  // accumulates over two backward passes
    at::Tensor x = randn_seeded({6, 12}, 50 + world->rank() + step);
    torch::manual_seed(60 + step);
    plain->forward(x).pow(2).sum().backward();
    torch::manual_seed(60 + step);
    loom::recompute(recomputed, x).pow(2).sum().backward();
  }
  auto a = plain->parameters(), b = recomputed->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::allclose(b[i].grad(), a[i].grad())) << "parameter " << i;
  EXPECT_EQ(recomputed_reducer.stats().synchronized_iterations, plain_reducer.stats().synchronized_iterations);
  // torch::autograd::grad with respect to the parameters works through the recomputation too.
  at::Tensor x = randn_seeded({6, 12}, 70);
  recomputed->eval();
  auto grads = torch::autograd::grad({loom::recompute(recomputed, x).sum()}, {recomputed->parameters()[0]});
  plain->eval();
  auto reference = torch::autograd::grad({plain->forward(x).sum()}, {plain->parameters()[0]});
  EXPECT_TRUE(at::allclose(grads[0], reference[0]));
}

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  auto rt = loom::init();
  loom::test::report_failures_only_unless_rank0(rt->world().rank);
  int status = RUN_ALL_TESTS();
  states().clear();
  rt.reset();
  loom::finalize();
  return status;
}
