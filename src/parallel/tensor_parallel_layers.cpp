// Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.
//
// Two ways to create the weights (ParallelInit). Sharded (the default): each rank draws its own
// shard on the target device, with the plain layer's distribution for the whole weight (the
// global fan-in), from the model-parallel RNG stream, so shards differ across a TP group and agree
// across DP replicas; replicated parameters come from the default generator. Master: the full weight
// is drawn exactly as the plain LibTorch layer would draw it (by constructing that layer, which
// consumes the default generator the same way) and each rank keeps its slice, which costs the full
// weight's memory once and buys the property the tests rely on: from the same generator state,
// every TP degree starts from the same function.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <ostream>

#include "loom/parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_util.h"

namespace loom {
namespace {

using LinearInit = std::function<void(at::Tensor&, at::Tensor&)>;

// A parameter of `shape` drawn by `fill` (on a float32 tensor), then on the layer's device and in
// its dtype. per_rank: from the tracker's model-parallel stream (this rank's shard); otherwise from
// the default generator (replicated parameters, and layers without a TP group).
at::Tensor draw(const std::string& where, const ParallelInit& init, bool per_rank, at::IntArrayRef shape,
                const std::function<void(at::Tensor&)>& fill) {
  at::NoGradGuard no_grad;
  RngTracker& rng = init.rng ? *init.rng : rng_tracker();
  // Drawn where the generator lives: the tracker's device when its streams are for another kind
  // of device than the parameters (then copied: one shard, never the whole weight).
  const c10::Device on = per_rank && rng.device().type() != init.device.type() ? rng.device() : init.device;
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(on));
  if (per_rank) {
    if (!rng.has(kModelParallelRngStream))
      throw InvalidArgumentError(where + ": sharded initialisation draws each rank's shard from the RNG tracker's \"" +
                                 kModelParallelRngStream +
                                 "\" stream, which is not seeded: call ParallelState::seed (or loom::model_parallel_seed) "
                                 "first, or build the layer with ParallelInit::Mode::Master");
    auto guard = rng.fork(kModelParallelRngStream);
    fill(t);
  } else {
    fill(t);
  }
  return t.to(init.device, init.dtype);
}

// torch::nn::Linear's init, from the whole layer's fan-in (kaiming_uniform_ with a = sqrt(5) is
// uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)); so is the bias).
std::function<void(at::Tensor&)> linear_uniform(int64_t fan_in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return [bound](at::Tensor& t) { t.uniform_(-bound, bound); };
}

// The full [out, in] weight and [out] bias of the plain layer, drawn from the default generator.
void master_linear(int64_t in, int64_t out, bool with_bias, const LinearInit& init, at::Tensor& weight,
                   at::Tensor& bias) {
  at::NoGradGuard no_grad;
  if (init) {
    weight = at::empty({out, in});
    bias = with_bias ? at::empty({out}) : at::Tensor();
    init(weight, bias);
    return;
  }
  torch::nn::Linear full(torch::nn::LinearOptions(in, out).bias(with_bias));
  weight = full->weight.detach();
  bias = with_bias ? full->bias.detach() : at::Tensor();
}

void require_positive(const std::string& where, const std::string& what, int64_t value) {
  if (value <= 0)
    throw InvalidArgumentError(where + ": " + what + " must be positive; found " + std::to_string(value));
}

void require_last_dim(const std::string& where, const at::Tensor& input, int64_t expected, const char* why) {
  if (input.dim() == 0 || input.size(-1) != expected)
    throw InvalidArgumentError(where + ": expected an input whose last dimension is " + std::to_string(expected) +
                               " (" + why + "); found shape " + c10::str(input.sizes()));
}

void copy_checked(const std::string& where, const char* what, at::Tensor& dst, const at::Tensor& src) {
  if (!src.defined() || src.sizes() != dst.sizes())
    throw InvalidArgumentError(where + " load_master: " + what + " slice should be " + c10::str(dst.sizes()) +
                               "; found " + (src.defined() ? c10::str(src.sizes()) : std::string("no tensor")));
  at::NoGradGuard no_grad;
  dst.copy_(src);
}

}  // namespace

// ---- ColumnParallelLinear ----------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, TensorParallelGroup g,
                                                   ColumnParallelLinearOptions o)
    : in_features(in), out_features(out), options(std::move(o)), group(std::move(g)) {
  const int t = detail::tp_size(group);
  const std::string where = detail::tp_where(group, "ColumnParallelLinear");
  require_positive(where, "in_features", in);
  detail::require_divisible(where, "out_features", out, t);
  out_per_rank = out / t;
  out_start = detail::tp_rank(group) * out_per_rank;
  const ParallelInit& init = options.initialization;
  at::Tensor w, b;
  if (init.mode == ParallelInit::Mode::Master) {
    master_linear(in, out, options.bias, options.init, w, b);
    w = w.narrow(0, out_start, out_per_rank).clone().to(init.device, init.dtype);
    if (options.bias) b = b.narrow(0, out_start, out_per_rank).clone().to(init.device, init.dtype);
  } else {
    const bool per_rank = t > 1;
    w = draw(where, init, per_rank, {out_per_rank, in}, linear_uniform(in));
    if (options.bias) b = draw(where, init, per_rank, {out_per_rank}, linear_uniform(in));
    if (options.init) options.init(w, b);
  }
  weight = register_parameter("weight", w);
  if (options.bias) bias = register_parameter("bias", b);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  require_last_dim(detail::tp_where(group, "ColumnParallelLinear"), input, in_features, "in_features");
  // Every rank needs the whole input; backward sums the ranks' partial input gradients.
  // Sequence-parallel: all-gather the shards (backward reduce-scatters). Otherwise the all-reduce of
  // the input gradient overlaps the weight-gradient GEMM in backward.
  at::Tensor y = options.sequence_parallel
                     ? at::linear(tp::gather_from_sequence_region(input, group, /*grad_is_partial=*/true), weight, bias)
                     : (detail::tp_size(group) > 1 ? tp::linear_with_async_grad_all_reduce(input, weight, bias, group)
                                                   : at::linear(input, weight, bias));
  return options.gather_output ? tp::gather_from_region(y, group) : y;
}

void ColumnParallelLinearImpl::load_master(const at::Tensor& w, const at::Tensor& b) {
  const std::string where = detail::tp_where(group, "ColumnParallelLinear");
  copy_checked(where, "weight", weight, w.defined() && w.dim() == 2 && w.size(0) == out_features
                                            ? w.narrow(0, out_start, out_per_rank) : w);
  if (bias.defined())
    copy_checked(where, "bias", bias, b.defined() && b.dim() == 1 && b.size(0) == out_features
                                          ? b.narrow(0, out_start, out_per_rank) : b);
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "loom::ColumnParallelLinear(in_features=" << in_features << ", out_features=" << out_features
         << ", rows=[" << out_start << ", " << out_start + out_per_rank << "), bias=" << options.bias
         << ", gather_output=" << options.gather_output << ", sequence_parallel=" << options.sequence_parallel << ")";
}

// ---- RowParallelLinear -------------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, TensorParallelGroup g, RowParallelLinearOptions o)
    : in_features(in), out_features(out), options(std::move(o)), group(std::move(g)) {
  const int t = detail::tp_size(group);
  const std::string where = detail::tp_where(group, "RowParallelLinear");
  require_positive(where, "out_features", out);
  detail::require_divisible(where, "in_features", in, t);
  if (options.sequence_parallel && !options.input_is_parallel)
    throw InvalidArgumentError(where + ": sequence_parallel needs input_is_parallel (the input of a sequence-parallel "
                               "row layer is the split output of a column-parallel one)");
  in_per_rank = in / t;
  in_start = detail::tp_rank(group) * in_per_rank;
  const ParallelInit& init = options.initialization;
  at::Tensor w, b;
  if (init.mode == ParallelInit::Mode::Master) {
    master_linear(in, out, options.bias, options.init, w, b);
    w = w.narrow(1, in_start, in_per_rank).clone().to(init.device, init.dtype);
    if (options.bias) b = b.to(init.device, init.dtype);
  } else {
    w = draw(where, init, /*per_rank=*/t > 1, {out, in_per_rank}, linear_uniform(in));
    // The bias is added once, after the reduction: replicated, so the same on every rank.
    if (options.bias) b = draw(where, init, /*per_rank=*/false, {out}, linear_uniform(in));
    if (options.init) options.init(w, b);
  }
  weight = register_parameter("weight", w);
  if (options.bias) bias = register_parameter("bias", b);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const std::string where = detail::tp_where(group, "RowParallelLinear");
  at::Tensor x = input;
  if (options.input_is_parallel) {
    require_last_dim(where, input, in_per_rank, "this rank's slice of in_features");
  } else {
    require_last_dim(where, input, in_features, "in_features");
    x = tp::scatter_to_region(input, group);
  }
  at::Tensor partial = at::linear(x, weight);
  at::Tensor y = options.sequence_parallel ? tp::reduce_scatter_to_sequence_region(partial, group)
                                           : tp::reduce_from_region(partial, group);
  if (!bias.defined()) return y;
  // Added once, after the reduction. Under sequence parallelism each rank adds it to its own rows
  // only, so its gradient is partial: copy_to_region sums it over the group in backward.
  return y + (options.sequence_parallel ? tp::copy_to_region(bias, group) : bias);
}

void RowParallelLinearImpl::load_master(const at::Tensor& w, const at::Tensor& b) {
  const std::string where = detail::tp_where(group, "RowParallelLinear");
  copy_checked(where, "weight", weight, w.defined() && w.dim() == 2 && w.size(1) == in_features
                                            ? w.narrow(1, in_start, in_per_rank) : w);
  if (bias.defined()) copy_checked(where, "bias", bias, b);
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "loom::RowParallelLinear(in_features=" << in_features << ", out_features=" << out_features
         << ", columns=[" << in_start << ", " << in_start + in_per_rank << "), bias=" << options.bias
         << ", input_is_parallel=" << options.input_is_parallel << ", sequence_parallel=" << options.sequence_parallel
         << ")";
}

// ---- VocabParallelEmbedding --------------------------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t n, int64_t dim, TensorParallelGroup g,
                                                       VocabParallelEmbeddingOptions o)
    : num_embeddings(n), embedding_dim(dim), options(std::move(o)), group(std::move(g)) {
  const int t = detail::tp_size(group);
  const std::string where = detail::tp_where(group, "VocabParallelEmbedding");
  require_positive(where, "embedding_dim", dim);
  detail::require_divisible(where, "num_embeddings (vocabulary size)", n, t);
  const int64_t per_rank = n / t;
  vocab_start = detail::tp_rank(group) * per_rank;
  vocab_end = vocab_start + per_rank;
  const ParallelInit& init = options.initialization;
  at::Tensor w;
  if (init.mode == ParallelInit::Mode::Master) {
    at::NoGradGuard no_grad;
    at::Tensor full;
    if (options.init) {
      full = at::empty({n, dim});
      options.init(full);
    } else {
      full = torch::nn::Embedding(n, dim)->weight.detach();
    }
    w = full.narrow(0, vocab_start, per_rank).clone().to(init.device, init.dtype);
  } else {
    w = draw(where, init, /*per_rank=*/t > 1, {per_rank, dim}, [](at::Tensor& x) { x.normal_(); });
    if (options.init) options.init(w);
  }
  weight = register_parameter("weight", w);
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  if (!at::isIntegralType(ids.scalar_type(), /*includeBool=*/false))
    throw InvalidArgumentError(detail::tp_where(group, "VocabParallelEmbedding") +
                               ": expected integer token ids; found dtype " + std::string(c10::toString(ids.scalar_type())));
  // Every rank sees the same ids, so every rank raises together: an id out of range would
  // otherwise be zeroed silently at TP > 1 (no rank owns it). On a GPU only in the debug mode:
  // reading the range would stall the stream every call.
  if (ids.numel() > 0 && detail::host_checks_enabled(ids)) {
    const int64_t low = ids.min().item<int64_t>(), high = ids.max().item<int64_t>();
    if (low < 0 || high >= num_embeddings)
      throw InvalidArgumentError(detail::tp_where(group, "VocabParallelEmbedding") + ": expected token ids in [0, " +
                                 std::to_string(num_embeddings) + "); found min " + std::to_string(low) + ", max " +
                                 std::to_string(high));
  }
  if (detail::tp_size(group) == 1) return at::embedding(weight, ids);
  // Ids owned by another rank look up row 0 here and are zeroed: the all-reduce then adds exactly
  // one non-zero row (the owner's) per id.
  at::Tensor foreign = ids.lt(vocab_start).logical_or_(ids.ge(vocab_end));
  at::Tensor local_ids = (ids - vocab_start).masked_fill_(foreign, 0);
  at::Tensor partial = at::embedding(weight, local_ids).masked_fill(foreign.unsqueeze(-1), 0.0);
  return options.sequence_parallel ? tp::reduce_scatter_to_sequence_region(partial, group)
                                   : tp::reduce_from_region(partial, group);
}

void VocabParallelEmbeddingImpl::load_master(const at::Tensor& w) {
  copy_checked(detail::tp_where(group, "VocabParallelEmbedding"), "weight", weight,
               w.defined() && w.dim() == 2 && w.size(0) == num_embeddings
                   ? w.narrow(0, vocab_start, vocab_end - vocab_start) : w);
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "loom::VocabParallelEmbedding(num_embeddings=" << num_embeddings << ", embedding_dim=" << embedding_dim
         << ", ids=[" << vocab_start << ", " << vocab_end << "), sequence_parallel=" << options.sequence_parallel << ")";
}

// ---- Shard metadata (checkpoints) ----------------------------------------------------------------

std::map<std::string, tp::ShardInfo> ColumnParallelLinearImpl::shard_info() const {
  const int rank = detail::tp_rank(group), size = detail::tp_size(group);
  std::map<std::string, tp::ShardInfo> info{{"weight", {0, {out_features, in_features}, out_start, rank, size}}};
  if (bias.defined()) info["bias"] = {0, {out_features}, out_start, rank, size};
  return info;
}

std::map<std::string, tp::ShardInfo> RowParallelLinearImpl::shard_info() const {
  // The bias is added after the reduction, so every rank holds all of it: replicated, not listed.
  return {{"weight", {1, {out_features, in_features}, in_start, detail::tp_rank(group), detail::tp_size(group)}}};
}

std::map<std::string, tp::ShardInfo> VocabParallelEmbeddingImpl::shard_info() const {
  return {{"weight", {0, {num_embeddings, embedding_dim}, vocab_start, detail::tp_rank(group), detail::tp_size(group)}}};
}

}  // namespace loom
