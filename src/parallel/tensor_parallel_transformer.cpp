// ParallelTransformerBlock: a pre-layernorm GPT block built from the tensor-parallel layers.
//
// Attention heads are split across the TP group: qkv is column-parallel with its output rows laid
// out per head ([q | k | v] of head 0, then head 1, ...), so each rank's contiguous slice holds
// complete heads and attention runs locally; proj is row-parallel and all-reduces. The MLP is
// column-then-row. One all-reduce per half-block forward and one backward, as in Megatron-LM.
#include <ATen/ops/dropout.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <limits>

#include "loom/parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_util.h"

namespace loom {

ParallelTransformerBlockImpl::ParallelTransformerBlockImpl(const ParallelTransformerBlockOptions& o,
                                                           TensorParallelGroup g)
    : options(o), group(std::move(g)) {
  const std::string where = detail::tp_where(group, "ParallelTransformerBlock");
  const int t = detail::tp_size(group);
  const int64_t h = options.hidden_size;
  if (options.ffn_hidden_size == 0) options.ffn_hidden_size = 4 * h;
  if (h <= 0 || options.num_heads <= 0 || h % options.num_heads != 0)
    throw InvalidArgumentError(where + ": hidden_size must be a positive multiple of num_heads; found hidden_size " +
                               std::to_string(h) + ", num_heads " + std::to_string(options.num_heads));
  detail::require_divisible(where, "number of attention heads", options.num_heads, t);
  detail::require_divisible(where, "MLP hidden size", options.ffn_hidden_size, t);
  heads_per_rank = options.num_heads / t;
  const bool sp = options.sequence_parallel;

  ln1_weight = register_parameter("ln1_weight", at::ones({h}));
  ln1_bias = register_parameter("ln1_bias", at::zeros({h}));
  ColumnParallelLinearOptions column;
  column.sequence_parallel = sp;
  RowParallelLinearOptions row;
  row.sequence_parallel = sp;
  // Construction order = the plain block's order of random draws: qkv, proj, fc1, fc2.
  qkv = register_module("qkv", ColumnParallelLinear(h, 3 * h, group, column));
  proj = register_module("proj", RowParallelLinear(h, h, group, row));
  ln2_weight = register_parameter("ln2_weight", at::ones({h}));
  ln2_bias = register_parameter("ln2_bias", at::zeros({h}));
  fc1 = register_module("fc1", ColumnParallelLinear(h, options.ffn_hidden_size, group, column));
  fc2 = register_module("fc2", RowParallelLinear(options.ffn_hidden_size, h, group, row));
}

at::Tensor ParallelTransformerBlockImpl::forward(const at::Tensor& x) {
  const std::string where = detail::tp_where(group, "ParallelTransformerBlock");
  const int64_t h = options.hidden_size;
  if (x.dim() != 3 || x.size(2) != h)
    throw InvalidArgumentError(where + ": expected input [sequence, batch, " + std::to_string(h) + "]; found " +
                               c10::str(x.sizes()));
  const bool sp = options.sequence_parallel;
  RngTracker& rng = options.rng ? *options.rng : rng_tracker();

  auto layer_norm = [&](const at::Tensor& in, const at::Tensor& w, const at::Tensor& b) {
    // Under sequence parallelism each rank normalises its own rows, so the weights' gradients are
    // partial sums: copy_to_region adds them up over the group in backward.
    return sp ? at::layer_norm(in, {h}, tp::copy_to_region(w, group), tp::copy_to_region(b, group),
                               options.layernorm_eps)
              : at::layer_norm(in, {h}, w, b, options.layernorm_eps);
  };
  // Replicated activations need the same mask on every TP rank (the default stream, identical
  // across the group); sequence shards are different rows and need different masks.
  auto hidden_dropout = [&](const at::Tensor& in) {
    if (options.hidden_dropout <= 0 || !is_training()) return in;
    if (!sp) return at::dropout(in, options.hidden_dropout, true);
    auto guard = rng.fork(kModelParallelRngStream);
    return at::dropout(in, options.hidden_dropout, true);
  };

  // Attention over this rank's heads, on the whole sequence.
  at::Tensor qkv_out = qkv(layer_norm(x, ln1_weight, ln1_bias));  // [s, b, heads_per_rank * 3 * d]
  const int64_t s = qkv_out.size(0), b = qkv_out.size(1), d = h / options.num_heads;
  auto parts = qkv_out.view({s, b, heads_per_rank, 3 * d}).split(d, -1);
  at::Tensor q = parts[0].permute({1, 2, 0, 3});  // [b, heads, s, d]
  at::Tensor k = parts[1].permute({1, 2, 0, 3});
  at::Tensor v = parts[2].permute({1, 2, 0, 3});
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
  if (options.causal) {
    at::Tensor future = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  at::Tensor probs = at::softmax(scores, -1);
  if (options.attention_dropout > 0 && is_training()) {
    // Each rank holds different heads: their masks must differ (model-parallel stream).
    auto guard = rng.fork(kModelParallelRngStream);
    probs = at::dropout(probs, options.attention_dropout, true);
  }
  at::Tensor context = at::matmul(probs, v).permute({2, 0, 1, 3}).reshape({s, b, heads_per_rank * d});
  at::Tensor out = x + hidden_dropout(proj(context));

  at::Tensor mlp = fc2(at::gelu(fc1(layer_norm(out, ln2_weight, ln2_bias))));
  return out + hidden_dropout(mlp);
}

}  // namespace loom
