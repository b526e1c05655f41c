// Tensor parallelism for LibTorch, Megatron-LM style: layers whose weights are split across the
// ranks of a tensor-parallel (TP) group, the autograd "region" operations that move activations
// between the split and the replicated form, a cross-entropy over vocabulary-split logits, an
// RNG tracker for dropout inside split regions, and ParallelState, which builds the TP and
// data-parallel (DP) groups.
//
//   auto rt = loom::init();
//   loom::ParallelState ps(rt->world_comm(), {.tensor_parallel = 2, .hidden_size = 512, .num_heads = 8});
//   ps.seed(1234);                                   // default stream: same everywhere; "model-parallel": per TP rank
//   auto tp = ps.tp_group();
//   loom::ColumnParallelLinear fc1(512, 2048, tp);   // this rank holds 1024 of the 2048 output rows
//   loom::RowParallelLinear fc2(2048, 512, tp);      // ... and 1024 of the 2048 input columns
//   at::Tensor y = fc2(at::gelu(fc1(x)));           // one all-reduce forward, one backward
//   loom::GradientReducer dp(all_parameters, ps.dp_group());   // DP over the DP group only
//
// Layout: ranks that hold slices of the same weights form a TP group; ranks that hold the same
// slice form a DP group (loom::make_parallel_groups).
//
// Initialisation (ParallelInit). By default each rank draws only its own shard, on the target
// device and in the target dtype, from the RNG tracker's "model-parallel" stream (different per TP
// rank, the same across DP replicas; seed it with ParallelState::seed), with the distribution the
// plain layer's init uses for the whole weight (Megatron's default): nothing is materialised at
// full size, so a 256k x 8k embedding costs each rank its shard only. Replicated parameters (a
// row-parallel bias, layernorms) come from the default generator, identical on every rank.
// ParallelInit::Mode::Master instead draws the full "master" weight exactly as the plain layer
// (torch::nn::Linear / Embedding) would from the same default-generator state and keeps this
// rank's slice: torch::manual_seed(s) followed by the same constructor calls then gives the same
// function at every TP degree (what the tests compare), at the cost of the full weight in host
// memory, transiently, on every rank.
//
// A null group means "no tensor parallelism": every operation is local, with no communication.
// Activations of the transformer block are [sequence, batch, hidden] (sequence first, so that
// sequence parallelism splits dim 0, which is contiguous).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/comm/groups.h"

namespace loom {

// The TP group a layer or operation works over; nullptr is a group of one (no communication).
using TensorParallelGroup = std::shared_ptr<Communicator>;

// ---------------------------------------------------------------------------------------------
// Region operations: autograd functions that are the only places tensor parallelism communicates.
// "Last dim" operations split the hidden/feature dimension; "sequence" ones split dim 0.
namespace tp {

// Identity forward; all-reduce (sum) of the gradient backward. Enters a region where each rank
// computes a part that depends on the whole (replicated) input.
at::Tensor copy_to_region(const at::Tensor& input, const TensorParallelGroup& group);
// All-reduce (sum) forward; identity backward. Leaves a region of partial sums.
at::Tensor reduce_from_region(const at::Tensor& input, const TensorParallelGroup& group);
// This rank's chunk of the last dimension forward; all-gather of the gradient backward.
at::Tensor scatter_to_region(const at::Tensor& input, const TensorParallelGroup& group);
// All-gather along the last dimension forward; this rank's chunk of the gradient backward.
at::Tensor gather_from_region(const at::Tensor& input, const TensorParallelGroup& group);

// Sequence parallelism (dim 0):
// This rank's chunk of dim 0 forward; all-gather along dim 0 backward.
at::Tensor scatter_to_sequence_region(const at::Tensor& input, const TensorParallelGroup& group);
// All-gather along dim 0 forward. Backward: reduce-scatter when each rank's gradient is a partial
// sum (the consumer is a column-parallel layer: the default), else this rank's chunk.
at::Tensor gather_from_sequence_region(const at::Tensor& input, const TensorParallelGroup& group,
                                       bool grad_is_partial = true);
// Reduce-scatter (sum) along dim 0 forward; all-gather along dim 0 backward.
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& input, const TensorParallelGroup& group);

// y = linear(x, weight, bias) where x is replicated over the group and weight is this rank's slice of
// a column-parallel weight: copy_to_region followed by at::linear in one autograd function, whose
// backward starts the all-reduce of the input gradient and computes the weight and bias gradients
// while it runs (Megatron's LinearWithGradAccumulationAndAsyncCommunication). ColumnParallelLinear
// uses it when the input is not sequence-parallel.
at::Tensor linear_with_async_grad_all_reduce(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                             const TensorParallelGroup& group);

// What the region operations communicated in this process since the last reset (both passes).
// Bytes count the full tensor each collective works on: the all-reduced tensor, the gathered
// output, the reduce-scattered input; the minimum for a Column+Row parallel MLP step is two
// all-reduces of the activation (one forward, one backward).
struct CommStats {
  uint64_t all_reduce_calls = 0, all_reduce_bytes = 0;
  uint64_t all_gather_calls = 0, all_gather_bytes = 0;
  uint64_t reduce_scatter_calls = 0, reduce_scatter_bytes = 0;
  uint64_t total_bytes() const { return all_reduce_bytes + all_gather_bytes + reduce_scatter_bytes; }
  uint64_t total_calls() const { return all_reduce_calls + all_gather_calls + reduce_scatter_calls; }
  // Time spent blocked waiting for these collectives: the layers' exposed communication. Only
  // host (MPI) waits are timed: a device (NCCL) wait makes the CUDA stream wait and returns at once,
  // so its host time would read as zero; those are counted in unmeasured_waits instead.
  double wait_seconds = 0;
  uint64_t unmeasured_waits = 0;
};
CommStats comm_stats();
void reset_comm_stats();

}  // namespace tp

// ---------------------------------------------------------------------------------------------
// Shard metadata: how each parameter of a tensor-parallel module relates to the full ("master")
// tensor of the plain layer, so that checkpoints can store slices with their global shape and
// load them at another TP degree.
namespace tp {

struct ShardInfo {
  int dim = -1;                       // the dimension split across the TP group; -1: replicated
  std::vector<int64_t> global_shape;  // the full tensor's shape
  int64_t offset = 0;                 // where this rank's slice starts along `dim`
  int tp_rank = 0;                    // this rank's place in the TP group, and the group's size
  int tp_size = 1;
};

// Implemented by modules that hold tensor-parallel slices (the layers below; a user's own TP
// module can implement it too). Describes the module's own parameters (not its children's), by
// their registered names; a parameter not listed is replicated across the TP group. The slice a
// rank holds is the global tensor narrowed to [offset, offset + local size) along dim. Slices are
// in TP-rank order (TP rank r's before rank r + 1's): a checkpoint tells each rank's TP rank by
// them, and a Checkpointer refuses to save one whose slices say otherwise.
//
//   for (auto& [name, info] : fc1->shard_info())   // {"weight": {dim 0, [2048, 512], offset 1024}, "bias": ...}
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  virtual std::map<std::string, ShardInfo> shard_info() const = 0;
};

}  // namespace tp

// ---------------------------------------------------------------------------------------------
// Layers.

class RngTracker;

// How a tensor-parallel layer creates its parameters (see the file comment).
struct ParallelInit {
  enum class Mode { Sharded, Master };
  Mode mode = Mode::Sharded;
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::ScalarType::Float;
  // The tracker whose "model-parallel" stream sharded draws come from; nullptr: loom::rng_tracker().
  RngTracker* rng = nullptr;
};

struct ColumnParallelLinearOptions {
  bool bias = true;
  // All-gather the output so every rank gets all out_features; otherwise each keeps its slice.
  bool gather_output = false;
  // The input is this rank's dim-0 (sequence) shard: all-gather it before the matmul, and
  // reduce-scatter its gradient.
  bool sequence_parallel = false;
  // Draws the weight [out, in] and bias [out] (bias undefined without one) in place: the full master
  // tensors with ParallelInit::Mode::Master, this rank's shards with Sharded (under the
  // model-parallel stream). Empty: torch::nn::Linear's init (kaiming_uniform_(a = sqrt(5)),
  // uniform bias, both from the global fan-in).
  std::function<void(at::Tensor& weight, at::Tensor& bias)> init;
  ParallelInit initialization;
};

// y = x A^T + b with A split by rows (output features): rank r holds A[r*o/t : (r+1)*o/t, :].
class ColumnParallelLinearImpl : public torch::nn::Module, public tp::ShardedModule {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, TensorParallelGroup group,
                           ColumnParallelLinearOptions options = {});
  at::Tensor forward(const at::Tensor& input);
  // Copies this rank's slice of full (master) weights into the parameters.
  void load_master(const at::Tensor& weight, const at::Tensor& bias = {});
  void pretty_print(std::ostream& stream) const override;
  std::map<std::string, tp::ShardInfo> shard_info() const override;

  at::Tensor weight;  // [out/t, in]
  at::Tensor bias;    // [out/t], undefined without bias
  int64_t in_features, out_features, out_per_rank, out_start;
  ColumnParallelLinearOptions options;
  TensorParallelGroup group;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  bool bias = true;
  // The input is already split along its last dimension (the output of a ColumnParallelLinear
  // without gather); otherwise it is replicated and each rank takes its chunk.
  bool input_is_parallel = true;
  // Reduce-scatter the output along dim 0 (sequence) instead of all-reducing it.
  bool sequence_parallel = false;
  std::function<void(at::Tensor& weight, at::Tensor& bias)> init;
  ParallelInit initialization;
};

// y = x A^T + b with A split by columns (input features): rank r holds A[:, r*i/t : (r+1)*i/t].
// The partial products are all-reduced, then the (replicated) bias is added once.
class RowParallelLinearImpl : public torch::nn::Module, public tp::ShardedModule {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, TensorParallelGroup group,
                        RowParallelLinearOptions options = {});
  at::Tensor forward(const at::Tensor& input);
  void load_master(const at::Tensor& weight, const at::Tensor& bias = {});
  void pretty_print(std::ostream& stream) const override;
  std::map<std::string, tp::ShardInfo> shard_info() const override;

  at::Tensor weight;  // [out, in/t]
  at::Tensor bias;    // [out], replicated
  int64_t in_features, out_features, in_per_rank, in_start;
  RowParallelLinearOptions options;
  TensorParallelGroup group;
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingOptions {
  // Reduce-scatter the output along dim 0 (sequence) instead of all-reducing it.
  bool sequence_parallel = false;
  // Draws the [num_embeddings, dim] master table (Master) or this rank's rows (Sharded) in place;
  // empty: torch::nn::Embedding's init (standard normal).
  std::function<void(at::Tensor& weight)> init;
  ParallelInit initialization;
};

// An embedding table split by rows (vocabulary): rank r holds ids [vocab_start, vocab_end). Ids
// outside this rank's range look up row 0 and are zeroed, then the partial embeddings are
// all-reduced (reduce-scattered along dim 0 under sequence parallelism). Ids outside
// [0, num_embeddings) are an InvalidArgumentError on every rank.
class VocabParallelEmbeddingImpl : public torch::nn::Module, public tp::ShardedModule {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, TensorParallelGroup group,
                             VocabParallelEmbeddingOptions options = {});
  at::Tensor forward(const at::Tensor& ids);
  void load_master(const at::Tensor& weight);
  void pretty_print(std::ostream& stream) const override;
  std::map<std::string, tp::ShardInfo> shard_info() const override;

  at::Tensor weight;  // [num_embeddings/t, embedding_dim]
  int64_t num_embeddings, embedding_dim, vocab_start, vocab_end;
  VocabParallelEmbeddingOptions options;
  TensorParallelGroup group;
};
TORCH_MODULE(VocabParallelEmbedding);

// ---------------------------------------------------------------------------------------------
// Vocabulary-parallel cross-entropy.

enum class LossReduction { Mean, Sum, None };

struct VocabParallelCrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  LossReduction reduction = LossReduction::Mean;
};

// Cross-entropy of logits split along the last (vocabulary) dimension: logits [..., V/t] hold
// this rank's classes [tp_rank*V/t, (tp_rank+1)*V/t), target [...] the global class ids. Equals
// torch::nn::functional::cross_entropy on the gathered logits (same ignore_index, label
// smoothing and reductions; Mean divides by the number of non-ignored targets), without ever
// forming the full logits: one all-reduce of the row maxima and one of [sum exp, target logit]
// per row (plus the sum of logits when label_smoothing > 0). The result is replicated on every rank of the group; its gradient
// needs no communication. Computed in float32 (or float64) whatever the logits' dtype.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const TensorParallelGroup& group,
                                        const VocabParallelCrossEntropyOptions& options = {});

// ---------------------------------------------------------------------------------------------
// RNG tracker.

// The stream used inside tensor-parallel regions (e.g. attention dropout), different per TP rank.
inline constexpr const char* kModelParallelRngStream = "model-parallel";
// Offset of the model-parallel seed from the base seed (Megatron's 2718).
inline constexpr uint64_t kModelParallelSeedOffset = 2718;

// Named random streams, each a saved state of the default generator of one device type. Code
// that must draw from a named stream forks it: the default generator's state is swapped for the
// stream's for the lifetime of the guard, and swapped back afterwards (the stream keeps its
// advanced state). Anything drawing from the default generator (at::dropout, at::rand) thus
// draws from the stream inside the guard.
//
// A tracker holds streams of one device's generator: forking the CPU tracker around a CUDA draw
// changes nothing (every TP rank would draw the same mask), so take the activations' device's:
//
//   auto& rng = loom::rng_tracker(x.device());
//   loom::model_parallel_seed(1234, tp_rank, rng);
//   { auto guard = rng.fork(); x = at::dropout(x, 0.1, true); }  // a different mask per TP rank
class RngTracker {
 public:
  explicit RngTracker(c10::Device device = c10::Device(c10::kCPU));

  // Adds a stream started from `seed`. loom::InvalidArgumentError when the name or the seed is
  // already taken (two streams from one seed would draw the same numbers).
  void add(const std::string& name, uint64_t seed);
  bool has(const std::string& name) const;
  // Drops every stream.
  void reset();

  class ForkGuard {
   public:
    ForkGuard(RngTracker& tracker, std::string name);
    ~ForkGuard();
    ForkGuard(ForkGuard&& other) noexcept;
    ForkGuard(const ForkGuard&) = delete;
    ForkGuard& operator=(const ForkGuard&) = delete;
    ForkGuard& operator=(ForkGuard&&) = delete;

   private:
    RngTracker* tracker_;
    std::string name_;
    at::Tensor saved_default_;
  };
  // loom::InvalidArgumentError when the stream does not exist. Forks do not nest for one stream.
  [[nodiscard]] ForkGuard fork(const std::string& name = kModelParallelRngStream);

  // Copies of every stream's generator state (uint8 tensors, as at::Generator::get_state), for
  // checkpoints and recomputation; set_states replaces the streams with the given ones (streams
  // that stay keep their seeds on record for the duplicate-seed check; new ones have none).
  std::map<std::string, at::Tensor> get_states() const;
  void set_states(const std::map<std::string, at::Tensor>& states);
  c10::Device device() const { return device_; }

 private:
  at::Generator default_generator() const;
  c10::Device device_;
  mutable std::mutex mutex_;
  std::map<std::string, at::Tensor> states_;
  std::map<std::string, uint64_t> seeds_;
  std::map<std::string, bool> forked_;
};

// The process's tracker for `device`'s default generator (one per device, made on first use; a
// CUDA device without an index is the current device's generator, as at::cuda::detail does). The
// layers use the CPU tracker unless given another (ParallelInit::rng, the blocks' options.rng).
RngTracker& rng_tracker(c10::Device device = c10::Device(c10::kCPU));

// Seeds the default generators (at::manual_seed(seed): identical on every rank, so replicated
// computations such as dropout outside TP regions agree across TP ranks and DP replicas) and
// resets `tracker` to one stream, "model-parallel", seeded with seed + 2718 + tp_rank: different
// across the ranks of a TP group, identical across DP replicas.
void model_parallel_seed(uint64_t seed, int tp_rank, RngTracker& tracker = rng_tracker());

// ---------------------------------------------------------------------------------------------
// Parallel state.

struct ParallelConfig {
  int tensor_parallel = 1;
  int pipeline_parallel = 1;
  // The dimensions outermost first (loom::ParallelLayout::arrange): data-parallel replicas take the
  // rest of the world. The standard order keeps TP ranks consecutive and pipeline neighbours next.
  std::string layout_order = std::string(ParallelLayout::kStandardOrder);
  // Layout order of the world's ranks (a permutation: position p is world rank order[p]); empty: 0..n-1.
  std::vector<int> order;
  // Each DP group's world ranks in ring order (a placement plan's DP groups:
  // loom::planned_dp_rings(tensor_parallel)). Empty: ascending ranks.
  std::vector<std::vector<int>> dp_rings;
  // Model dimensions checked against the TP degree at construction; 0 = not checked.
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t ffn_hidden_size = 0;
  int64_t vocab_size = 0;
};

// The groups of this process for every dimension of its layout (data, pipeline and tensor
// parallel), built from the world communicator (a collective: every rank constructs it with the
// same configuration). Wrong divisibility is a loom::InvalidArgumentError raised on every rank
// before any communication, e.g.
//   [rank 3] ParallelState: hidden size must be a positive multiple of the tensor-parallel degree 4; found 10 (10 % 4 = 2)
//
//   loom::ParallelState ps(rt->world_comm(), {.tensor_parallel = 2, .pipeline_parallel = 2});
//   ps.layout().to_string();   // "dp=2,pp=2,tp=2" on 8 ranks
//   ps.pp_rank();              // this rank's pipeline stage
class ParallelState {
 public:
  ParallelState(std::shared_ptr<Communicator> world, const ParallelConfig& config);
  ParallelState(std::shared_ptr<Communicator> world, int tensor_parallel);

  int tp_degree() const { return groups_.tp_degree; }
  int tp_rank() const { return groups_.tp_rank; }
  int dp_degree() const { return groups_.dp_degree; }
  int dp_rank() const { return groups_.dp_rank; }
  int pp_degree() const { return groups_.size(kPipelineParallelDim); }
  int pp_rank() const { return groups_.rank(kPipelineParallelDim); }
  const std::shared_ptr<Communicator>& world() const { return world_; }
  // The group to hand every tensor-parallel layer.
  const TensorParallelGroup& tp_group() const { return groups_.tensor_parallel; }
  // The group to hand the GradientReducer / DistributedDataParallel.
  const std::shared_ptr<Communicator>& dp_group() const { return groups_.data_parallel; }
  // The pipeline this rank is a stage of, stage by stage (its rank in the group is its stage).
  const std::shared_ptr<Communicator>& pp_group() const { return groups_.group(kPipelineParallelDim); }
  const ParallelLayout& layout() const { return groups_.layout; }
  const ParallelGroups& groups() const { return groups_; }

  // model_parallel_seed(seed, tp_rank(), tracker).
  void seed(uint64_t seed, RngTracker& tracker = rng_tracker()) const;
  // Throws loom::InvalidArgumentError unless the TP degree divides value ("what" names it).
  void require_divisible(const std::string& what, int64_t value) const;

 private:
  void agree_on_config(const ParallelConfig& config) const;
  std::shared_ptr<Communicator> world_;
  ParallelGroups groups_;
};

// The smallest vocabulary size >= vocab that is a multiple of tp_degree * multiple (pad the
// embedding and the output layer to it; padding classes are never targets).
int64_t padded_vocab_size(int64_t vocab, int tp_degree, int64_t multiple = 1);

// ---------------------------------------------------------------------------------------------
// Transformer block.

// What a block may change from its defaults; its sizes are the constructor's arguments, in the
// order every tensor-parallel layer takes: sizes, group, options.
struct ParallelTransformerBlockOptions {
  int64_t ffn_hidden_size = 0;     // 0: 4 * hidden_size
  double attention_dropout = 0.0;  // on the attention probabilities, per TP rank's heads
  double hidden_dropout = 0.0;     // after the attention and MLP outputs: the default stream (same mask on
                                   // every TP rank), or the model-parallel one under sequence parallelism
  bool causal = true;
  double layernorm_eps = 1e-5;
  // Activations are [s/t, b, h] shards of the sequence between the tensor-parallel regions.
  bool sequence_parallel = false;
  // The tracker whose "model-parallel" stream dropout inside split regions draws from;
  // nullptr: loom::rng_tracker().
  RngTracker* rng = nullptr;
  // How the block's layers create their parameters (its RNG tracker is `rng` when that is set).
  ParallelInit initialization;
  // Keep only the block's input in forward and recompute the block in backward (activation
  // recomputation, loom::recompute): less activation memory for one more forward.
  bool recompute = false;
};

// A pre-layernorm GPT block over [s, b, h] activations:
//   x = x + dropout(proj(attention(qkv(ln1(x)))));  x = x + dropout(fc2(gelu(fc1(ln2(x)))))
// qkv and fc1 are column-parallel, proj and fc2 row-parallel; each TP rank computes
// num_heads / t heads; the layernorms are replicated. The plain equivalent is the same block with
// torch::nn::Linear layers qkv(h, 3h), proj(h, h), fc1(h, f), fc2(f, h) built in that order,
// where qkv's output features are laid out per head as [q_head | k_head | v_head] (so a
// contiguous slice of heads is a contiguous slice of rows).
class ParallelTransformerBlockImpl : public torch::nn::Module {
 public:
  //   loom::ParallelTransformerBlock block(/*hidden_size=*/512, /*num_heads=*/8, ps.tp_group(),
  //                                        loom::ParallelTransformerBlockOptions{.attention_dropout = 0.1});
  ParallelTransformerBlockImpl(int64_t hidden_size, int64_t num_heads, TensorParallelGroup group,
                               const ParallelTransformerBlockOptions& options = {});
  at::Tensor forward(const at::Tensor& x);

  at::Tensor ln1_weight, ln1_bias, ln2_weight, ln2_bias;
  ColumnParallelLinear qkv{nullptr};
  RowParallelLinear proj{nullptr};
  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  ParallelTransformerBlockOptions options;  // ffn_hidden_size filled in (4 * hidden_size when 0)
  TensorParallelGroup group;
  int64_t heads_per_rank = 0;

 private:
  at::Tensor forward_block(const at::Tensor& x);
};
TORCH_MODULE(ParallelTransformerBlock);

}  // namespace loom
