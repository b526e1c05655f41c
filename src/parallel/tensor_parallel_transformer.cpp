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
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <optional>
#include <limits>

#include "loom/parallel/recompute.h"
#include "loom/parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_util.h"

namespace loom {

ParallelTransformerBlockImpl::ParallelTransformerBlockImpl(int64_t hidden, int64_t heads, TensorParallelGroup g,
                                                           const ParallelTransformerBlockOptions& o)
    : hidden_size(hidden), num_heads(heads), options(o), group(std::move(g)) {
  const std::string where = detail::tp_where(group, "ParallelTransformerBlock");
  const int t = detail::tp_size(group);
  const int64_t h = hidden_size;
  if (options.ffn_hidden_size == 0) options.ffn_hidden_size = 4 * h;
  if (h <= 0 || num_heads <= 0 || h % num_heads != 0)
    throw InvalidArgumentError(where + ": hidden_size must be a positive multiple of num_heads; found hidden_size " +
                               std::to_string(h) + ", num_heads " + std::to_string(num_heads));
  detail::require_divisible(where, "number of attention heads", num_heads, t);
  detail::require_divisible(where, "MLP hidden size", options.ffn_hidden_size, t);
  heads_per_rank = num_heads / t;
  const bool sp = options.sequence_parallel;

  ParallelInit init = options.initialization;
  if (init.rng == nullptr) init.rng = options.rng;
  const auto replicated = at::TensorOptions().device(init.device).dtype(init.dtype);
  ln1_weight = register_parameter("ln1_weight", at::ones({h}, replicated));
  ln1_bias = register_parameter("ln1_bias", at::zeros({h}, replicated));
  ColumnParallelLinearOptions column;
  column.sequence_parallel = sp;
  column.initialization = init;
  RowParallelLinearOptions row;
  row.sequence_parallel = sp;
  row.initialization = init;
  // Construction order = the plain block's order of random draws: qkv, proj, fc1, fc2.
  qkv = register_module("qkv", ColumnParallelLinear(h, 3 * h, group, column));
  proj = register_module("proj", RowParallelLinear(h, h, group, row));
  ln2_weight = register_parameter("ln2_weight", at::ones({h}, replicated));
  ln2_bias = register_parameter("ln2_bias", at::zeros({h}, replicated));
  fc1 = register_module("fc1", ColumnParallelLinear(h, options.ffn_hidden_size, group, column));
  fc2 = register_module("fc2", RowParallelLinear(options.ffn_hidden_size, h, group, row));
}

at::Tensor ParallelTransformerBlockImpl::forward(const at::Tensor& x) {
  const std::string where = detail::tp_where(group, "ParallelTransformerBlock");
  const int64_t h = hidden_size;
  if (x.dim() != 3 || x.size(2) != h)
    throw InvalidArgumentError(where + ": expected input [sequence, batch, " + std::to_string(h) + "]; found " +
                               c10::str(x.sizes()));
  RngTracker& rng = options.rng ? *options.rng : rng_tracker();
  const bool dropout = is_training() && (options.hidden_dropout > 0 || options.attention_dropout > 0);
  if (dropout && rng.device().type() != x.device().type())
    throw InvalidArgumentError(where + ": dropout on " + x.device().str() + " activations needs an RngTracker for " +
                               c10::DeviceTypeName(x.device().type(), true) + ", found one for " + rng.device().str() +
                               " (its streams would not reach the " + x.device().str() + " generator)");

  if (options.recompute) {
    // The backward node holds the block (shared), so the graph may outlive the caller's handle.
    std::shared_ptr<ParallelTransformerBlockImpl> self;
    try {
      self = std::static_pointer_cast<ParallelTransformerBlockImpl>(shared_from_this());
    } catch (const std::bad_weak_ptr&) {  // a block not owned by a ModuleHolder: the caller keeps it alive
      self = std::shared_ptr<ParallelTransformerBlockImpl>(std::shared_ptr<ParallelTransformerBlockImpl>(), this);
    }
    return recompute([self](const at::Tensor& in) { return self->forward_block(in); }, x, parameters(),
                     {.rng = &rng});
  }
  return forward_block(x);
}

at::Tensor ParallelTransformerBlockImpl::forward_block(const at::Tensor& x) {
  const int64_t h = hidden_size;
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
  const int64_t s = qkv_out.size(0), b = qkv_out.size(1), d = h / num_heads;
  auto parts = qkv_out.view({s, b, heads_per_rank, 3 * d}).split(d, -1);
  at::Tensor q = parts[0].permute({1, 2, 0, 3});  // [b, heads, s, d]
  at::Tensor k = parts[1].permute({1, 2, 0, 3});
  at::Tensor v = parts[2].permute({1, 2, 0, 3});
  // LibTorch's fused attention (flash / memory-efficient kernels on GPU). Its dropout draws from
  // the default generator: forked to the model-parallel stream, since each rank holds other heads.
  const double attention_p = is_training() ? options.attention_dropout : 0.0;
  at::Tensor attended;
  {
    std::optional<RngTracker::ForkGuard> guard;
    if (attention_p > 0) guard.emplace(rng.fork(kModelParallelRngStream));
    attended = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, attention_p, options.causal);
  }
  at::Tensor context = attended.permute({2, 0, 1, 3}).reshape({s, b, heads_per_rank * d});
  at::Tensor out = x + hidden_dropout(proj(context));

  at::Tensor mlp = fc2(at::gelu(fc1(layer_norm(out, ln2_weight, ln2_bias))));
  return out + hidden_dropout(mlp);
}

}  // namespace loom
