// Tensor parallelism against its references, under mpirun at 1, 2 and 4 ranks. Every rank builds
// the plain LibTorch layer from the same seed and computes the reference locally; each TP degree
// that divides the world size is tested (TP=1 uses a group of one and communicates nothing).
//
// Tolerances: a TP layer computes the same dot products as the plain one, but a row-parallel
// layer sums t partial products (and gradients through copy_to_region sum t partial input
// gradients) in a different order: float32 rounding of ~1e-7 relative per addition, so outputs
// and gradients are compared with rtol 1e-5, atol 1e-5 (the values are O(1)).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "loom/comm/mpi.h"
#include <torch/nn.h>
#include <torch/optim.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <memory>

#include "loom/parallel/data_parallel.h"
#include "loom/parallel/tensor_parallel.h"
#include "rank_report.h"
#include "test_util.h"

using namespace loom;

namespace {

constexpr double kRtol = 1e-5, kAtol = 1e-5;

// ParallelStates are built once per degree (a collective; every rank asks in the same order) and
// released before MPI is finalized.
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

// Expects a == b (within tolerance), printing the largest difference.
#define EXPECT_CLOSE(a, b, what)                                                                       \
  do {                                                                                                 \
    at::Tensor a_ = (a), b_ = (b);                                                                     \
    ASSERT_EQ(a_.sizes(), b_.sizes()) << what;                                                         \
    EXPECT_TRUE(at::allclose(a_, b_, kRtol, kAtol))                                                    \
        << what << ": max difference " << (a_ - b_).abs().max().item<double>() << " at tp=" << tp;     \
  } while (0)

// The exact master-weight initialisation: layers equal the plain ones built from the same seed.
ParallelInit master_init() {
  ParallelInit init;
  init.mode = ParallelInit::Mode::Master;
  return init;
}

at::Tensor randn_seeded(at::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

}  // namespace

TEST(TensorParallelRegions, ScatterGatherReduceAndTheirGradients) {
  for (int tp : degrees()) {
    const auto& ps = state(tp);
    auto group = ps.tp_group();
    at::Tensor x = randn_seeded({3, 8}, 1).requires_grad_();
    // gather(scatter(x)) is x, and its gradient is the identity.
    at::Tensor y = tp::gather_from_region(tp::scatter_to_region(x, group), group);
    EXPECT_CLOSE(y, x, "gather(scatter(x))");
    // A random upstream gradient: a wrong chunk or order in either backward shows.
    at::Tensor g = randn_seeded({3, 8}, 11);
    (y * g).sum().backward();
    EXPECT_CLOSE(x.grad(), g, "gradient of gather(scatter(x))");
    // reduce_from_region sums the ranks' tensors; its gradient is passed through unchanged.
    at::Tensor mine = at::full({4}, double(ps.tp_rank() + 1)).requires_grad_();
    at::Tensor sum = tp::reduce_from_region(mine, group);
    EXPECT_CLOSE(sum, at::full({4}, tp * (tp + 1) / 2.0), "reduce_from_region");
    (sum * 2).sum().backward();
    EXPECT_CLOSE(mine.grad(), at::full({4}, 2.0), "gradient of reduce_from_region");
    // copy_to_region's gradient is the sum of the ranks' gradients.
    at::Tensor c = at::ones({2}).requires_grad_();
    (tp::copy_to_region(c, group) * (ps.tp_rank() + 1)).sum().backward();
    EXPECT_CLOSE(c.grad(), at::full({2}, tp * (tp + 1) / 2.0), "gradient of copy_to_region");
    // Sequence: gather(scatter(x)) along dim 0; reduce_scatter of replicated x is t * x's rows.
    at::Tensor s = randn_seeded({8, 2, 3}, 2).requires_grad_();
    at::Tensor rows = tp::scatter_to_sequence_region(s, group);
    EXPECT_CLOSE(rows, s.narrow(0, ps.tp_rank() * 8 / tp, 8 / tp), "scatter_to_sequence_region");
    at::Tensor gathered = tp::gather_from_sequence_region(rows, group, false);
    EXPECT_CLOSE(gathered, s, "gather_from_sequence_region");
    // Backward through both: gather's split path takes this rank's rows of g, scatter's
    // all-gather puts them back together.
    at::Tensor gs = randn_seeded({8, 2, 3}, 12);
    (gathered * gs).sum().backward();
    EXPECT_CLOSE(s.grad(), gs, "gradient of gather_from_sequence_region(scatter_to_sequence_region(s))");
    at::Tensor r = randn_seeded({8, 2, 3}, 2).requires_grad_();
    at::Tensor rs = tp::reduce_scatter_to_sequence_region(r, group);
    EXPECT_CLOSE(rs, r.narrow(0, ps.tp_rank() * 8 / tp, 8 / tp) * tp, "reduce_scatter_to_sequence_region");
    // Its backward all-gathers the shards' gradients: rank q's rows get q's upstream gradient.
    at::Tensor gr = randn_seeded({8 / tp, 2, 3}, 20 + ps.tp_rank());
    (rs * gr).sum().backward();
    std::vector<at::Tensor> expected_rows;
    for (int q = 0; q < tp; ++q) expected_rows.push_back(randn_seeded({8 / tp, 2, 3}, 20 + q));
    EXPECT_CLOSE(r.grad(), at::cat(expected_rows, 0), "gradient of reduce_scatter_to_sequence_region");
  }
}

TEST(TensorParallelLayers, ColumnParallelLinearEqualsLinear) {
  const int64_t in = 12, out = 8;
  for (int tp : degrees()) {
    for (bool gather : {false, true}) {
      for (bool bias : {true, false}) {
        SCOPED_TRACE("tp=" + std::to_string(tp) + " gather=" + std::to_string(gather) + " bias=" + std::to_string(bias));
        const auto& ps = state(tp);
        torch::manual_seed(11);
        torch::nn::Linear plain(torch::nn::LinearOptions(in, out).bias(bias));
        torch::manual_seed(11);
        ColumnParallelLinearOptions options;
        options.initialization = master_init();
        options.gather_output = gather;
        options.bias = bias;
        ColumnParallelLinear col(in, out, ps.tp_group(), options);
        const int64_t n = out / tp, start = ps.tp_rank() * n;
        // Master-weight init: exactly the plain layer's rows, bit for bit.
        EXPECT_TRUE(at::equal(col->weight, plain->weight.narrow(0, start, n)));
        if (bias) EXPECT_TRUE(at::equal(col->bias, plain->bias.narrow(0, start, n)));

        at::Tensor x = randn_seeded({5, 3, in}, 2).requires_grad_();
        at::Tensor x_ref = x.detach().clone().requires_grad_();
        at::Tensor g = randn_seeded({5, 3, out}, 3);
        at::Tensor y = col(x), y_ref = plain(x_ref);
        y_ref.backward(g);
        if (gather) {
          EXPECT_CLOSE(y, y_ref, "output");
          y.backward(g);
        } else {
          EXPECT_CLOSE(y, y_ref.narrow(-1, start, n), "output slice");
          y.backward(g.narrow(-1, start, n));
        }
        EXPECT_CLOSE(x.grad(), x_ref.grad(), "input gradient");
        EXPECT_CLOSE(col->weight.grad(), plain->weight.grad().narrow(0, start, n), "weight gradient");
        if (bias) EXPECT_CLOSE(col->bias.grad(), plain->bias.grad().narrow(0, start, n), "bias gradient");
      }
    }
  }
}

TEST(TensorParallelLayers, RowParallelLinearEqualsLinear) {
  const int64_t in = 16, out = 6;
  for (int tp : degrees()) {
    for (bool parallel_input : {true, false}) {
      for (bool bias : {true, false}) {
        SCOPED_TRACE("tp=" + std::to_string(tp) + " input_is_parallel=" + std::to_string(parallel_input));
        const auto& ps = state(tp);
        torch::manual_seed(12);
        torch::nn::Linear plain(torch::nn::LinearOptions(in, out).bias(bias));
        torch::manual_seed(12);
        RowParallelLinearOptions options;
        options.initialization = master_init();
        options.input_is_parallel = parallel_input;
        options.bias = bias;
        RowParallelLinear row(in, out, ps.tp_group(), options);
        const int64_t n = in / tp, start = ps.tp_rank() * n;
        EXPECT_TRUE(at::equal(row->weight, plain->weight.narrow(1, start, n)));

        at::Tensor full = randn_seeded({4, 2, in}, 4);
        at::Tensor x = (parallel_input ? full.narrow(-1, start, n).clone() : full.clone()).requires_grad_();
        at::Tensor x_ref = full.clone().requires_grad_();
        at::Tensor g = randn_seeded({4, 2, out}, 5);
        at::Tensor y = row(x), y_ref = plain(x_ref);
        EXPECT_CLOSE(y, y_ref, "output");
        y.backward(g);
        y_ref.backward(g);
        EXPECT_CLOSE(x.grad(), parallel_input ? x_ref.grad().narrow(-1, start, n) : x_ref.grad(), "input gradient");
        EXPECT_CLOSE(row->weight.grad(), plain->weight.grad().narrow(1, start, n), "weight gradient");
        if (bias) EXPECT_CLOSE(row->bias.grad(), plain->bias.grad(), "bias gradient (added once)");
      }
    }
  }
}

TEST(TensorParallelLayers, SequenceParallelMlpEqualsPlainMlp) {
  const int64_t h = 8, f = 16, s = 8, b = 2;
  for (int tp : degrees()) {
    const auto& ps = state(tp);
    torch::manual_seed(13);
    torch::nn::Linear fc1(h, f), fc2(f, h);
    torch::manual_seed(13);
    ColumnParallelLinearOptions column;
    column.sequence_parallel = true;
    column.initialization = master_init();
    RowParallelLinearOptions row;
    row.sequence_parallel = true;
    row.initialization = master_init();
    ColumnParallelLinear pfc1(h, f, ps.tp_group(), column);
    RowParallelLinear pfc2(f, h, ps.tp_group(), row);
    const int64_t rows = s / tp, r0 = ps.tp_rank() * rows, n = f / tp, c0 = ps.tp_rank() * n;

    at::Tensor full = randn_seeded({s, b, h}, 6);
    at::Tensor x = full.narrow(0, r0, rows).clone().requires_grad_();  // this rank's sequence shard
    at::Tensor x_ref = full.clone().requires_grad_();
    at::Tensor g = randn_seeded({s, b, h}, 7);
    at::Tensor y = pfc2(at::gelu(pfc1(x)));
    at::Tensor y_ref = fc2(at::gelu(fc1(x_ref)));
    EXPECT_CLOSE(y, y_ref.narrow(0, r0, rows), "output shard");
    y.backward(g.narrow(0, r0, rows));
    y_ref.backward(g);
    EXPECT_CLOSE(x.grad(), x_ref.grad().narrow(0, r0, rows), "input gradient shard");
    EXPECT_CLOSE(pfc1->weight.grad(), fc1->weight.grad().narrow(0, c0, n), "fc1 weight gradient");
    EXPECT_CLOSE(pfc1->bias.grad(), fc1->bias.grad().narrow(0, c0, n), "fc1 bias gradient");
    EXPECT_CLOSE(pfc2->weight.grad(), fc2->weight.grad().narrow(1, c0, n), "fc2 weight gradient");
    EXPECT_CLOSE(pfc2->bias.grad(), fc2->bias.grad(), "fc2 bias gradient (summed over the sequence shards)");
  }
}

TEST(TensorParallelLayers, VocabParallelEmbeddingEqualsEmbedding) {
  const int64_t vocab = 12, dim = 5, s = 8, b = 3;
  for (int tp : degrees()) {
    for (bool sp : {false, true}) {
      const auto& ps = state(tp);
      torch::manual_seed(14);
      torch::nn::Embedding plain(vocab, dim);
      torch::manual_seed(14);
      VocabParallelEmbeddingOptions options;
      options.initialization = master_init();
      options.sequence_parallel = sp;
      VocabParallelEmbedding emb(vocab, dim, ps.tp_group(), options);
      const int64_t n = vocab / tp, start = ps.tp_rank() * n;
      EXPECT_TRUE(at::equal(emb->weight, plain->weight.narrow(0, start, n)));
      auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
      at::Tensor ids = at::randint(vocab, {s, b}, gen);
      at::Tensor g = randn_seeded({s, b, dim}, 9);
      at::Tensor y = emb(ids), y_ref = plain(ids);
      y_ref.backward(g);
      const int64_t rows = s / tp, r0 = ps.tp_rank() * rows;
      if (sp) {
        EXPECT_CLOSE(y, y_ref.narrow(0, r0, rows), "sequence-parallel output shard");
        y.backward(g.narrow(0, r0, rows));
      } else {
        EXPECT_CLOSE(y, y_ref, "output");
        y.backward(g);
      }
      EXPECT_CLOSE(emb->weight.grad(), plain->weight.grad().narrow(0, start, n), "weight gradient");
    }
  }
}

TEST(TensorParallelLoss, VocabParallelCrossEntropyEqualsCrossEntropy) {
  const int64_t vocab = 16, s = 6, b = 4;
  namespace F = torch::nn::functional;
  for (int tp : degrees()) {
    const auto& ps = state(tp);
    const int64_t n = vocab / tp, start = ps.tp_rank() * n;
    at::Tensor full = randn_seeded({s, b, vocab}, 10) * 3;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    at::Tensor target = at::randint(vocab, {s, b}, gen);
    for (int64_t ignore_index : {int64_t(-100), int64_t(3)}) {
      at::Tensor t = target.clone();
      t[0].fill_(ignore_index);  // a whole row of ignored targets
      t[2][1].fill_(ignore_index);
      for (double smoothing : {0.0, 0.1, 0.5}) {
        for (auto reduction : {LossReduction::Mean, LossReduction::Sum, LossReduction::None}) {
          SCOPED_TRACE("tp=" + std::to_string(tp) + " ignore_index=" + std::to_string(ignore_index) +
                       " smoothing=" + std::to_string(smoothing) + " reduction=" + std::to_string(int(reduction)));
          at::Tensor local = full.narrow(-1, start, n).clone().requires_grad_();
          at::Tensor ref_in = full.clone().requires_grad_();
          VocabParallelCrossEntropyOptions options;
          options.ignore_index = ignore_index;
          options.label_smoothing = smoothing;
          options.reduction = reduction;
          at::Tensor loss = vocab_parallel_cross_entropy(local, t, ps.tp_group(), options);
          auto ref_options = F::CrossEntropyFuncOptions().ignore_index(ignore_index).label_smoothing(smoothing);
          if (reduction == LossReduction::Mean) ref_options.reduction(torch::kMean);
          if (reduction == LossReduction::Sum) ref_options.reduction(torch::kSum);
          if (reduction == LossReduction::None) ref_options.reduction(torch::kNone);
          at::Tensor ref = F::cross_entropy(ref_in.reshape({-1, vocab}), t.reshape({-1}), ref_options);
          if (reduction == LossReduction::None) ref = ref.reshape({s, b});
          EXPECT_CLOSE(loss, ref, "loss");
          at::Tensor g = reduction == LossReduction::None ? randn_seeded({s, b}, 12) : at::ones({});
          loss.backward(g);
          ref.backward(g);
          EXPECT_CLOSE(local.grad(), ref_in.grad().narrow(-1, start, n), "logits gradient");
        }
      }
    }
  }
}

// Every target ignored with reduction=mean: the loss is NaN in PyTorch too, but the gradient is all
// zeros there; it must not put NaN into the weights here.
TEST(TensorParallelLoss, AllTargetsIgnoredGiveTheZeroGradientOfPyTorch) {
  const int64_t vocab = 16, rows = 5;
  namespace F = torch::nn::functional;
  for (int tp : degrees()) {
    const auto& ps = state(tp);
    const int64_t n = vocab / tp, start = ps.tp_rank() * n;
    for (double smoothing : {0.0, 0.2}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " smoothing=" + std::to_string(smoothing));
      at::Tensor full = randn_seeded({rows, vocab}, 21);
      at::Tensor target = at::full({rows}, -100, at::kLong);
      at::Tensor local = full.narrow(-1, start, n).clone().requires_grad_();
      at::Tensor ref_in = full.clone().requires_grad_();
      VocabParallelCrossEntropyOptions options;
      options.label_smoothing = smoothing;
      at::Tensor loss = vocab_parallel_cross_entropy(local, target, ps.tp_group(), options);
      at::Tensor ref = F::cross_entropy(ref_in, target, F::CrossEntropyFuncOptions().label_smoothing(smoothing));
      EXPECT_TRUE(std::isnan(ref.item<double>()));
      EXPECT_TRUE(std::isnan(loss.item<double>()));
      loss.backward();
      ref.backward();
      EXPECT_TRUE(at::equal(local.grad(), ref_in.grad().narrow(-1, start, n)))
          << local.grad() << "\nPyTorch: " << ref_in.grad();
      EXPECT_TRUE(at::all(local.grad().eq(0)).item<bool>());
    }
  }
}

TEST(TensorParallelLoss, OutOfRangeTargetIsAnError) {
  auto group = state(1).tp_group();
  try {
    vocab_parallel_cross_entropy(at::zeros({2, 4}), at::tensor({1, 7}, at::kLong), group);
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("target ids must be in [0, 4) or equal ignore_index -100; found min 1, max 7"),
              std::string::npos)
        << e.what();
  }
}

namespace {

// The plain block that ParallelTransformerBlock must equal: torch::nn::Linear layers built in the
// same order, qkv rows laid out per head [q | k | v].
struct PlainBlockImpl : torch::nn::Module {
  PlainBlockImpl(int64_t h, int64_t heads, int64_t f) : h(h), heads(heads) {
    ln1_w = register_parameter("ln1_w", at::ones({h}));
    ln1_b = register_parameter("ln1_b", at::zeros({h}));
    qkv = register_module("qkv", torch::nn::Linear(h, 3 * h));
    proj = register_module("proj", torch::nn::Linear(h, h));
    ln2_w = register_parameter("ln2_w", at::ones({h}));
    ln2_b = register_parameter("ln2_b", at::zeros({h}));
    fc1 = register_module("fc1", torch::nn::Linear(h, f));
    fc2 = register_module("fc2", torch::nn::Linear(f, h));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t s = x.size(0), b = x.size(1), d = h / heads;
    auto parts = qkv(at::layer_norm(x, {h}, ln1_w, ln1_b)).view({s, b, heads, 3 * d}).split(d, -1);
    at::Tensor q = parts[0].permute({1, 2, 0, 3}), k = parts[1].permute({1, 2, 0, 3}), v = parts[2].permute({1, 2, 0, 3});
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(d));
    scores = scores.masked_fill(at::ones({s, s}, at::kBool).triu(1), -INFINITY);
    at::Tensor ctx = at::matmul(at::softmax(scores, -1), v).permute({2, 0, 1, 3}).reshape({s, b, h});
    at::Tensor out = x + proj(ctx);
    return out + fc2(at::gelu(fc1(at::layer_norm(out, {h}, ln2_w, ln2_b))));
  }
  int64_t h, heads;
  at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(PlainBlock);

}  // namespace

TEST(TensorParallelLayers, TransformerBlockEqualsPlainBlock) {
  const int64_t h = 16, heads = 4, f = 32, s = 8, b = 2;
  for (int tp : degrees()) {
    for (bool sp : {false, true}) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " sequence_parallel=" + std::to_string(sp));
      const auto& ps = state(tp);
      torch::manual_seed(15);
      PlainBlock plain(h, heads, f);
      torch::manual_seed(15);
      ParallelTransformerBlockOptions options;
      options.initialization = master_init();
      options.ffn_hidden_size = f;
      options.sequence_parallel = sp;
      ParallelTransformerBlock block(h, heads, ps.tp_group(), options);
      const int rank = ps.tp_rank();
      const int64_t rows = sp ? s / tp : s, r0 = sp ? rank * rows : 0;

      at::Tensor full = randn_seeded({s, b, h}, 16);
      at::Tensor x = full.narrow(0, r0, rows).clone().requires_grad_();
      at::Tensor x_ref = full.clone().requires_grad_();
      at::Tensor g = randn_seeded({s, b, h}, 17);
      at::Tensor y = block(x), y_ref = plain(x_ref);
      EXPECT_CLOSE(y, y_ref.narrow(0, r0, rows), "output");
      y.backward(g.narrow(0, r0, rows));
      y_ref.backward(g);
      EXPECT_CLOSE(x.grad(), x_ref.grad().narrow(0, r0, rows), "input gradient");
      const int64_t q = 3 * h / tp, fo = f / tp, hi = h / tp;
      EXPECT_CLOSE(block->qkv->weight.grad(), plain->qkv->weight.grad().narrow(0, rank * q, q), "qkv weight gradient");
      EXPECT_CLOSE(block->qkv->bias.grad(), plain->qkv->bias.grad().narrow(0, rank * q, q), "qkv bias gradient");
      EXPECT_CLOSE(block->proj->weight.grad(), plain->proj->weight.grad().narrow(1, rank * hi, hi), "proj weight gradient");
      EXPECT_CLOSE(block->proj->bias.grad(), plain->proj->bias.grad(), "proj bias gradient");
      EXPECT_CLOSE(block->fc1->weight.grad(), plain->fc1->weight.grad().narrow(0, rank * fo, fo), "fc1 weight gradient");
      EXPECT_CLOSE(block->fc2->weight.grad(), plain->fc2->weight.grad().narrow(1, rank * fo, fo), "fc2 weight gradient");
      EXPECT_CLOSE(block->fc2->bias.grad(), plain->fc2->bias.grad(), "fc2 bias gradient");
      EXPECT_CLOSE(block->ln1_weight.grad(), plain->ln1_w.grad(), "ln1 weight gradient");
      EXPECT_CLOSE(block->ln2_bias.grad(), plain->ln2_b.grad(), "ln2 bias gradient");
    }
  }
}

TEST(TensorParallelLayers, MlpCommunicatesOneAllReducePerPass) {
  const int64_t h = 16, f = 64, tokens = 24;
  for (int tp : degrees()) {
    const auto& ps = state(tp);
    ps.seed(18);  // sharded initialisation draws from the model-parallel stream
    ColumnParallelLinear fc1(h, f, ps.tp_group());
    RowParallelLinear fc2(f, h, ps.tp_group());
    at::Tensor x = randn_seeded({tokens, h}, 18).requires_grad_();
    tp::reset_comm_stats();
    fc2(at::gelu(fc1(x))).sum().backward();
    tp::CommStats stats = tp::comm_stats();
    const uint64_t expected = tp > 1 ? 2 : 0;
    EXPECT_EQ(stats.all_reduce_calls, expected) << "tp=" << tp;
    EXPECT_EQ(stats.total_calls(), expected) << "tp=" << tp;
    EXPECT_EQ(stats.total_bytes(), expected * tokens * h * sizeof(float)) << "tp=" << tp;
  }
}

namespace {

struct GptConfig {
  int64_t vocab = 16, hidden = 16, heads = 4, layers = 2, seq = 8;
};

// A tiny GPT: vocab-parallel embedding, replicated positions, blocks, final layernorm, and a
// column-parallel output layer whose split logits go straight into the vocab-parallel loss.
struct TinyGptImpl : torch::nn::Module {
  TinyGptImpl(const GptConfig& c, TensorParallelGroup group) : config(c) {
    // Master initialisation: the same function at every TP degree, as the one-process reference.
    VocabParallelEmbeddingOptions tok_options;
    tok_options.initialization = master_init();
    tok = register_module("tok", VocabParallelEmbedding(c.vocab, c.hidden, group, tok_options));
    pos = register_module("pos", torch::nn::Embedding(c.seq, c.hidden));
    for (int64_t l = 0; l < c.layers; ++l) {
      ParallelTransformerBlockOptions o;
      o.initialization = master_init();
      blocks.push_back(register_module("block" + std::to_string(l), ParallelTransformerBlock(c.hidden, c.heads, group, o)));
    }
    lnf_w = register_parameter("lnf_w", at::ones({c.hidden}));
    lnf_b = register_parameter("lnf_b", at::zeros({c.hidden}));
    ColumnParallelLinearOptions head_options;
    head_options.bias = false;
    head_options.initialization = master_init();
    head = register_module("head", ColumnParallelLinear(c.hidden, c.vocab, group, head_options));
  }
  at::Tensor forward(const at::Tensor& ids) {  // [s, b] -> this rank's logits [s, b, V/t]
    at::Tensor x = tok(ids) + pos->weight.narrow(0, 0, ids.size(0)).unsqueeze(1);
    for (auto& block : blocks) x = block(x);
    return head(at::layer_norm(x, {config.hidden}, lnf_w, lnf_b));
  }
  GptConfig config;
  VocabParallelEmbedding tok{nullptr};
  torch::nn::Embedding pos{nullptr};
  std::vector<ParallelTransformerBlock> blocks;
  at::Tensor lnf_w, lnf_b;
  ColumnParallelLinear head{nullptr};
};
TORCH_MODULE(TinyGpt);

// Step `step`'s global batch [seq + 1, batch]: sequences x_{i+1} = (3 x_i + 1) mod V from a random
// start, so there is something to learn; inputs are rows 0..seq-1, targets rows 1..seq.
at::Tensor global_tokens(const GptConfig& c, int64_t batch, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  at::Tensor x = at::randint(c.vocab, {1, batch}, gen);
  std::vector<at::Tensor> rows{x};
  for (int64_t i = 0; i < c.seq; ++i) rows.push_back((rows.back() * 3 + 1).remainder(c.vocab));
  return at::cat(rows, 0);
}

}  // namespace

// TP x DP training follows TP=1 on the whole batch. With dropout off, the two runs differ only by
// float32 summation order (row-parallel partial sums, the DP average of per-shard mean gradients
// against one mean over the whole batch, the vocab-parallel loss against torch's): ~1e-7 relative
// per operation. Over 10 SGD steps (lr 0.5) of this small, well-conditioned model the loss curves
// agreed to <= 1.4e-7 relative at every TP x DP layout of 1, 2 and 4 ranks; we allow 1e-5, which
// leaves room for other BLAS blockings, yet is ~1000x below the loss's change per step, so a
// wrong gradient (a missing all-reduce, a double-counted bias, a mis-sliced weight) fails.
TEST(TensorParallelTraining, TpTimesDpFollowsOneProcessOnTheWholeBatch) {
  const GptConfig c;
  const int64_t global_batch = 8;
  const int steps = 10;
  const double lr = 0.5;
  namespace F = torch::nn::functional;
  auto world = test::world();

  // The reference: TP=1, DP=1, the whole batch, computed on every rank alone.
  torch::manual_seed(21);
  TinyGpt reference(c, nullptr);
  torch::optim::SGD ref_opt(reference->parameters(), lr);
  std::vector<double> ref_losses;
  for (int step = 0; step < steps; ++step) {
    at::Tensor tokens = global_tokens(c, global_batch, step);
    ref_opt.zero_grad();
    at::Tensor logits = reference(tokens.narrow(0, 0, c.seq));
    at::Tensor loss = F::cross_entropy(logits.reshape({-1, c.vocab}), tokens.narrow(0, 1, c.seq).reshape({-1}));
    loss.backward();
    ref_opt.step();
    ref_losses.push_back(loss.item<double>());
  }
  EXPECT_LT(ref_losses.back(), ref_losses.front()) << "the reference should learn";

  for (int tp : degrees()) {
    const auto& ps = state(tp);
    const int dp = ps.dp_degree();
    torch::manual_seed(21);
    TinyGpt model(c, ps.tp_group());
    GradientReducer reducer(model->parameters(), ps.dp_group());
    torch::optim::SGD opt(model->parameters(), lr);
    const int64_t per_replica = global_batch / dp;
    double max_rel = 0;
    for (int step = 0; step < steps; ++step) {
      at::Tensor tokens = global_tokens(c, global_batch, step).narrow(1, ps.dp_rank() * per_replica, per_replica);
      reducer.zero_grad();
      at::Tensor loss = vocab_parallel_cross_entropy(model(tokens.narrow(0, 0, c.seq)), tokens.narrow(0, 1, c.seq),
                                                     ps.tp_group());
      loss.backward();  // the reducer averages over the DP group before backward returns
      opt.step();
      at::Tensor mean = loss.detach().clone();
      ps.dp_group()->all_reduce(mean, {ReduceOp::Avg})->wait();
      const double rel = std::abs(mean.item<double>() - ref_losses[step]) / ref_losses[step];
      max_rel = std::max(max_rel, rel);
      EXPECT_LT(rel, 1e-5) << "tp=" << tp << " dp=" << dp << " step " << step << ": loss " << mean.item<double>()
                           << " against " << ref_losses[step];
    }
    if (test::world()->rank() == 0)
      std::cout << "[ tp=" << tp << " dp=" << dp << " ] largest relative loss difference over " << steps
                << " steps: " << max_rel << std::endl;
  }
}

namespace {

// Every rank's tensor, gathered over `group`: [size, n].
at::Tensor gather(const std::shared_ptr<Communicator>& group, const at::Tensor& t) {
  at::Tensor out = at::empty({group->size(), t.numel()}, t.options());
  group->all_gather(out, t.contiguous())->wait();
  return out;
}

}  // namespace

TEST(TensorParallelRng, DropoutStreamsAcrossTpAndDp) {
  for (int tp : degrees()) {
    const auto& ps = state(tp);
    auto draw = [&]() {
      at::Tensor before = at::rand({32});
      at::Tensor mask;
      {
        auto guard = rng_tracker().fork();
        mask = at::dropout(at::ones({64}), 0.5, true);
      }
      at::Tensor after = at::rand({32});
      return std::vector<at::Tensor>{before, mask, after};
    };
    ps.seed(1234);
    auto first = draw();
    // Default stream: the same on every rank of the job.
    at::Tensor everywhere = gather(ps.world(), first[0]);
    for (int r = 1; r < everywhere.size(0); ++r) EXPECT_TRUE(at::equal(everywhere[r], everywhere[0])) << "tp=" << tp;
    // Model-parallel stream: equal across DP replicas, different across TP ranks.
    at::Tensor over_dp = gather(ps.dp_group(), first[1]);
    for (int r = 1; r < over_dp.size(0); ++r) EXPECT_TRUE(at::equal(over_dp[r], over_dp[0])) << "tp=" << tp;
    at::Tensor over_tp = gather(ps.tp_group(), first[1]);
    for (int a = 0; a < over_tp.size(0); ++a)
      for (int b = a + 1; b < over_tp.size(0); ++b)
        EXPECT_FALSE(at::equal(over_tp[a], over_tp[b])) << "tp ranks " << a << " and " << b << " drew the same mask";
    // The fork does not disturb the default stream: what follows is what would follow without it.
    ps.seed(1234);
    at::Tensor plain_before = at::rand({32}), plain_after = at::rand({32});
    EXPECT_TRUE(at::equal(plain_before, first[0]));
    EXPECT_TRUE(at::equal(plain_after, first[2]));
    // Reproducible from the seed.
    ps.seed(1234);
    auto again = draw();
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(again[i], first[i])) << "draw " << i;
    // Saved states restore the streams.
    auto saved = rng_tracker().get_states();
    ASSERT_EQ(saved.count(kModelParallelRngStream), 1u);
    at::Tensor m1, m2;
    {
      auto guard = rng_tracker().fork();
      m1 = at::rand({16});
    }
    rng_tracker().set_states(saved);
    {
      auto guard = rng_tracker().fork();
      m2 = at::rand({16});
    }
    EXPECT_TRUE(at::equal(m1, m2));
  }
}

// One tracker per device: forking the CPU tracker around a CUDA draw would change nothing, so a
// CUDA program asks for its device's own (made without touching the device until a stream is added).
TEST(TensorParallelRng, OneTrackerPerDevice) {
  RngTracker& cpu = rng_tracker();
  EXPECT_EQ(&cpu, &rng_tracker(c10::Device(c10::kCPU)));
  RngTracker& cuda0 = rng_tracker(c10::Device(c10::kCUDA, 0));
  RngTracker& cuda1 = rng_tracker(c10::Device(c10::kCUDA, 1));
  EXPECT_NE(&cuda0, &cpu);
  EXPECT_NE(&cuda0, &cuda1);
  EXPECT_EQ(&cuda0, &rng_tracker(c10::Device(c10::kCUDA, 0)));
  EXPECT_EQ(cuda0.device(), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(cuda1.device(), c10::Device(c10::kCUDA, 1));
  model_parallel_seed(99, 0);  // the CPU tracker
  EXPECT_TRUE(cpu.has(kModelParallelRngStream));
  EXPECT_FALSE(cuda0.has(kModelParallelRngStream));
}

TEST(TensorParallelRng, AttentionDropoutIsReproducibleAndDiffersFromEval) {
  const auto& ps = state(degrees().back());
  ParallelTransformerBlockOptions o;
  o.initialization = master_init();
  o.attention_dropout = 0.3;
  o.hidden_dropout = 0.2;
  torch::manual_seed(3);
  ParallelTransformerBlock block(/*hidden_size=*/16, /*num_heads=*/4, ps.tp_group(), o);
  at::Tensor x = randn_seeded({4, 2, 16}, 30);
  ps.seed(99);
  at::Tensor a = block(x);
  ps.seed(99);
  at::Tensor b = block(x);
  EXPECT_TRUE(at::equal(a, b));
  block->eval();
  EXPECT_FALSE(at::allclose(block(x), a));
  // Replicated outputs stay replicated across the TP group even with dropout (masks agree where they must).
  at::Tensor over_tp = gather(ps.tp_group(), a.detach().reshape({-1}));
  for (int r = 1; r < over_tp.size(0); ++r) EXPECT_TRUE(at::allclose(over_tp[r], over_tp[0], kRtol, kAtol));
}

TEST(TensorParallelState, GroupsAndDegrees) {
  auto world = test::world();
  for (int tp : degrees()) {
    const auto& ps = state(tp);
    EXPECT_EQ(ps.tp_degree(), tp);
    EXPECT_EQ(ps.dp_degree(), world->size() / tp);
    EXPECT_EQ(ps.tp_group()->size(), tp);
    EXPECT_EQ(ps.dp_group()->size(), world->size() / tp);
    EXPECT_EQ(ps.tp_rank(), world->rank() % tp);
    EXPECT_EQ(ps.dp_rank(), world->rank() / tp);
  }
  EXPECT_EQ(padded_vocab_size(50257, 4, 128), 50688);
  EXPECT_EQ(padded_vocab_size(16, 2), 16);
}

namespace {

void expect_invalid(const std::function<void()>& f, const std::string& expected) {
  try {
    f();
    ADD_FAILURE() << "expected InvalidArgumentError containing: " << expected;
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(TensorParallelState, DivisibilityErrorsNameRankExpectedAndFound) {
  auto world = test::world();
  const std::string rank = "[rank " + std::to_string(world->rank()) + "] ParallelState: ";
  const int n = world->size();
  expect_invalid([&] { ParallelState(world, 3); },
                 rank + "world size must be divisible by the tensor-parallel degree 3; found " + std::to_string(n) +
                     " ranks (" + std::to_string(n) + " % 3 = " + std::to_string(n % 3) + ")");
  expect_invalid([&] { ParallelState(world, 0); }, rank + "the tensor-parallel degree must be at least 1; found 0");
  if (n % 2 == 0) {
    ParallelConfig c;
    c.tensor_parallel = 2;
    c.hidden_size = 9;
    expect_invalid([&] { ParallelState(world, c); },
                   rank + "hidden size must be a positive multiple of the tensor-parallel degree 2; found 9 (9 % 2 = 1)");
    c.hidden_size = 12;
    c.num_heads = 3;
    expect_invalid([&] { ParallelState(world, c); },
                   rank + "number of attention heads must be a positive multiple of the tensor-parallel degree 2; "
                          "found 3 (3 % 2 = 1)");
    c.num_heads = 4;
    c.vocab_size = 101;
    expect_invalid([&] { ParallelState(world, c); }, "vocabulary size (pad it with loom::padded_vocab_size) must be a "
                                                     "positive multiple of the tensor-parallel degree 2; found 101");
    c.vocab_size = 102;
    ParallelState ok(world, c);  // everything divides: groups are built
    EXPECT_EQ(ok.tp_degree(), 2);
  }
  const int tp = degrees().back();
  if (tp > 1) {
    auto group = state(tp).tp_group();
    // The job rank, then the layer and its place in the TP group.
    const std::string in_group = " group=" + group->name() + " (rank " + std::to_string(group->rank()) + " of " +
                                 std::to_string(tp) + "): ";
    const std::string job = "[rank " + std::to_string(world->rank()) + "] ";
    expect_invalid([&] { ColumnParallelLinear(8, tp + 1, group); },
                   job + "ColumnParallelLinear" + in_group +
                       "out_features must be a positive multiple of the tensor-parallel degree");
    expect_invalid([&] { RowParallelLinear(tp + 1, 8, group); },
                   job + "RowParallelLinear" + in_group + "in_features must be a positive multiple");
    expect_invalid([&] { VocabParallelEmbedding(tp * 3 + 1, 4, group); },
                   job + "VocabParallelEmbedding" + in_group +
                       "num_embeddings (vocabulary size) must be a positive multiple");
    state(tp).seed(5);  // sharded initialisation draws from the model-parallel stream
    // A token id no rank owns is an error on every rank, not a silent zero vector.
    VocabParallelEmbedding emb(tp * 3, 4, group);
    expect_invalid([&] { emb(at::tensor({0, tp * 3}, at::kLong)); },
                   job + "VocabParallelEmbedding" + in_group + "expected token ids in [0, " + std::to_string(tp * 3) +
                       "); found min 0, max " + std::to_string(tp * 3));
    const int64_t heads = tp + 1;  // never a multiple of tp > 1
    expect_invalid([&] { ParallelTransformerBlock(4 * heads, heads, group); },
                   "number of attention heads must be a positive multiple");
    RowParallelLinear row(8, 4, group);
    expect_invalid([&] { row(at::zeros({2, 8})); }, "expected an input whose last dimension is " +
                                                        std::to_string(8 / tp) + " (this rank's slice of in_features)");
  }
}

namespace {

// A world of its own whose failures only break it (LOOM_ON_ERROR=raise), for tests that make the
// ranks disagree on purpose.
std::shared_ptr<Communicator> raising_world() {
  CommunicatorOptions options;
  options.on_error = OnError::Raise;
  return loom::mpi::world_communicator(options);
}

template <typename Call>
std::string mismatch_of(Call call) {
  try {
    call();
  } catch (const MismatchError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no error";
}

}  // namespace

// Bad input that only showed up as a timeout before: caught by a cheap cross-rank check.
TEST(TensorParallelChecks, LogitsOfDifferentWidthsAreAMismatch) {
  auto world = raising_world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs a tensor-parallel group";
  ParallelState ps(world, n);
  const int64_t width = 4 + (world->rank() == n - 1 ? 1 : 0);
  at::Tensor logits = at::randn({3, width});
  at::Tensor target = at::zeros({3}, at::kLong);
  const std::string message = mismatch_of([&] { vocab_parallel_cross_entropy(logits, target, ps.tp_group()); });
  EXPECT_NE(message.find("ranks pass logits of different widths: this rank's last dimension is " +
                         std::to_string(width) + ", the group's ranges from 4 to 5"),
            std::string::npos)
      << message;
}

TEST(TensorParallelChecks, UnevenSequenceShardsAreAMismatch) {
  auto world = raising_world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs a tensor-parallel group";
  ParallelState ps(world, n);
  // 8 or 9 rows of 16 floats: above the size check's 256 bytes.
  at::Tensor shard = at::randn({world->rank() == n - 1 ? 9 : 8, 1, 16});
  const std::string message = mismatch_of([&] { tp::gather_from_sequence_region(shard, ps.tp_group()); });
  EXPECT_NE(message.find("collective mismatch: this rank called all_gather"), std::string::npos) << message;
  EXPECT_NE(message.find(world->rank() == n - 1 ? "numel=128" : "numel=144"), std::string::npos) << message;
}

TEST(TensorParallelChecks, RanksBuiltWithDifferentConfigurationsAreNamed) {
  auto world = raising_world();
  const int n = world->size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  ParallelConfig config;
  config.tensor_parallel = 1;
  config.hidden_size = world->rank() == n - 1 ? 64 : 32;
  const std::string message = mismatch_of([&] { ParallelState ps(world, config); });
  const std::string theirs = world->rank() == n - 1 ? "32 on rank 0" : "64 on rank " + std::to_string(n - 1);
  EXPECT_NE(message.find("ranks were built with different configurations: hidden_size is " +
                         std::to_string(config.hidden_size) + " on this rank but " + theirs),
            std::string::npos)
      << message;
  EXPECT_FALSE(world->is_broken());  // found before any group was split
}

TEST(TensorParallelRng, UnseededForkIsAnError) {
  RngTracker tracker;
  expect_invalid([&] { auto guard = tracker.fork(); }, "RngTracker::fork: no stream named \"model-parallel\"");
  tracker.add("a", 5);
  expect_invalid([&] { tracker.add("b", 5); }, "seed 5 for stream \"b\" is already the seed of stream \"a\"");
}

// Entry point, as tests/dist/main.cpp: every rank runs every test; only rank 0 prints the report.
int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  auto rt = loom::init();
  loom::test::report_failures_only_unless_rank0(rt->world().rank);
  int status = RUN_ALL_TESTS();
  states().clear();  // the cached groups' communicators go before MPI does
  rt.reset();
  loom::finalize();
  return status;
}
