// ZeRO: optimizer state (stage 1) and gradients (stage 2) sharded over the data-parallel group.
//
// Plain data parallelism keeps every byte of optimizer state on every replica. ZeroOptimizer
// keeps, on each of the N ranks of its group, the optimizer state of 1/N of the parameters only
// (ZeRO, arXiv 1910.02054; Megatron-Core's distributed optimizer), at DDP's communication volume:
//   - the gradient reducer (loom/parallel/data_parallel.h) buckets gradients as for DDP, but each
//     bucket is padded to a multiple of N elements and reduce-scattered, not all-reduced, while
//     backward runs: rank r receives the averaged gradients of the r-th 1/N of every bucket;
//   - the parameters are re-seated as views of one flat buffer per bucket (same layout), so
//     rank r's shard of a bucket is one contiguous tensor; the unmodified torch::optim optimizer
//     steps those shard tensors in place (its state exists for them only);
//   - the updated shards are all-gathered in place, so every rank holds every parameter again.
// Stage 1 keeps the full gradient buckets (parameters' .grad are views into them, and the
// reduce-scatter is in place); stage 2 frees each bucket once its reduce-scatter is done and keeps
// only this rank's shard of the gradients. Bytes per parameter, fp32 parameters with Adam:
//   DDP 4 + 4 + 8;  stage 1: 4 + 4 + 8/N;  stage 2: 4 + 4/N + 8/N   (parameters + gradients + state)
//
//   auto dp = loom::init()->world_comm();
//   Net net;                                               // the same model on every rank
//   loom::ZeroOptimizer zero(net->parameters(), dp,
//       [](std::vector<at::Tensor> shard) {
//         return std::make_unique<torch::optim::AdamW>(shard, torch::optim::AdamWOptions(1e-3));
//       },
//       {.stage = 2});
//   for (auto& [x, y] : my_shard) {
//     zero.zero_grad();
//     torch::mse_loss(net->forward(x), y).backward();     // reduce-scatter overlaps backward
//     zero.clip_grad_norm(1.0);                           // optional: the global norm over all shards
//     zero.step();                                        // steps this rank's shard, all-gathers
//   }
//
// Element-wise optimizers only (the update of one element depends on that element alone): SGD
// (momentum, Nesterov, weight decay), Adam, AdamW, RMSprop and Adagrad; others (LBFGS) are refused
// by name. One parameter group (every shard tensor gets the same hyper-parameters). Frozen
// parameters (requires_grad false) stay out of the shards and take rank 0's values. Parameters
// unused on some ranks need find_unused_parameters, as in DDP; one unused on every rank gets a
// zero gradient (as in DeepSpeed and Megatron), so momentum still moves it, where DDP would skip it.
// Gradient accumulation: inside `auto guard = zero.no_sync();` gradients accumulate locally in
// each parameter's .grad (stage 2 too, for those micro-batches); the next backward reduces the sum.
// After backward, a parameter's .grad (stage 1) holds the reduced average only where it lies in
// this rank's shard (the reduce-scatter is in place; stage 2 keeps no .grad): read gradients
// through shard_gradients(), and call zero_grad() before each step's first backward (gradients
// are not carried over from one step to the next).
//
// Mixed precision: bf16/fp16 parameters get fp32 master weights (ZeroOptions::master_weights, on by
// default, as Megatron's distributed optimizer and DeepSpeed keep them): the optimizer steps an fp32
// copy of this rank's shard, whose values are cast back into the parameters before the all-gather.
// Gradients are reduced in the parameters' dtype and converted to fp32 for the step (and for
// loom::GradScaler's unscale_ and clip_grad_norm, which see shard_gradients() in fp32). Bytes per
// parameter with Adam (2-byte parameters, fp32 master and state):
//   DDP 2 + 2 + 12 (master weights kept by the caller);  stage 1: 2 + 2 + 12/N;  stage 2: 2 + 14/N
//
// Overlapping the parameter all-gather with the next forward (ZeroOptions::overlap_param_gather):
// step() starts each bucket's all-gather, the first layers' first, and returns. A parameter may be
// read only after wait_parameters() for it, which is what a forward pre-hook does in Python (give
// torchloom.ZeroRedundancyOptimizer the module). C++ modules have no pre-hooks, so the model calls it:
//   at::Tensor Block::forward(at::Tensor x) { zero->wait_parameters(*this); ... }
// Everything of the optimizer's that needs the parameters waits for all of them first. A backward
// through a parameter nobody waited for is refused by name (its forward may have read old values);
// it counts for nothing, and the caller may wait, zero_grad() and redo the forward and backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/parallel/data_parallel.h"

namespace torch::optim {
class Optimizer;
}
namespace torch::nn {
class Module;
}

namespace loom {

struct ZeroOptions {
  int stage = 1;  // 1: optimizer state sharded; 2: gradients too
  size_t bucket_cap_bytes = 25u << 20;
  size_t first_bucket_cap_bytes = 1u << 20;
  // As ReducerOptions: parameters some ranks do not use in an iteration.
  bool find_unused_parameters = false;
  // Reduce-scatter in this dtype (e.g. at::kBFloat16: half the bytes on the wire); empty: the
  // gradients' own. Gradients are divided by the group size before the cast, as DDP's hooks do.
  std::optional<at::ScalarType> reduce_dtype;
  // Broadcast parameters from rank 0 of the group at construction.
  bool broadcast_parameters = true;
  // The parameters' names (as named_parameters() gives them), for error messages.
  std::vector<std::string> parameter_names;
  // bf16/fp16 parameters: the optimizer steps fp32 copies of this rank's shards (see above). Off:
  // it steps the parameters in their own dtype.
  bool master_weights = true;
  // step() returns with the all-gathers running; wait_parameters() before reading parameters.
  bool overlap_param_gather = false;
};

// Bytes held, counted from the live tensors' storages (each storage once).
struct ZeroMemory {
  int64_t parameters = 0;       // the flat parameter buffers (every parameter, every rank)
  int64_t gradients = 0;        // gradient buckets still held (stage 1) and this rank's gradient shards
  int64_t optimizer_state = 0;  // the shard optimizer's state tensors (0 without an optimizer of its own)
  int64_t master_weights = 0;   // fp32 copies of this rank's shards of bf16/fp16 parameters
};

// The count behind ZeroOptimizer::memory(), for any training state: `parameters` (and their .grad),
// `gradient_buffers` (a reducer's bucket_buffers(), which gradients may view) and the optimizer's
// state for every tensor of its parameter groups. Plain data parallelism, measured as ZeRO is:
//   count_training_memory(model->parameters(), reducer.bucket_buffers(), &optimizer)
// No optimizer, or one that is not of optimizer_state.h's kinds, counts as holding no state.
ZeroMemory count_training_memory(const std::vector<at::Tensor>& parameters,
                                 const std::vector<at::Tensor>& gradient_buffers, torch::optim::Optimizer* optimizer);

struct ZeroStats {
  uint64_t steps = 0;            // step() calls that stepped the optimizer
  uint64_t bytes_reduce_scattered = 0;  // reduce-scatter inputs (whole buckets, as sent), all iterations
  uint64_t bytes_all_gathered = 0;      // all-gather outputs (whole buckets), all steps
};

class ZeroOptimizer {
 public:
  // Builds the shard optimizer: called once with this rank's shard tensors (one per bucket).
  using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> shard)>;

  ZeroOptimizer(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group,
                const OptimizerFactory& make_optimizer, ZeroOptions options = {});
  // Without an optimizer of its own: the caller steps shard_parameters() with one it holds (a
  // Python torch.optim optimizer), between begin_step() and gather_parameters():
  //   zero.begin_step(); my_optimizer.step(); zero.gather_parameters();
  ZeroOptimizer(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group, ZeroOptions options = {});
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Drops the gradients (every parameter's .grad): the next backward starts from zero.
  void zero_grad();
  // The global L2 norm of the gradients (all shards, agreed over the group), and when it exceeds
  // max_norm every shard's gradients are scaled by max_norm / (norm + 1e-6), as
  // torch::nn::utils::clip_grad_norm_ does. Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // The same with tensor parallelism inside (the group is the data-parallel one): `model`'s
  // tp::ShardedModules say which parameters are this rank's slices (their squares are summed over
  // `tensor_parallel` too) and which are replicated over it (counted once), as loom::clip_grad_norm
  // does for a model that is not sharded. Every rank of both groups scales by the same coefficient.
  // InvalidArgumentError when `model` does not hold every sharded parameter (it would say nothing of
  // their slices).
  //   zero.clip_grad_norm(1.0, *model, ps.tp_group());
  double clip_grad_norm(double max_norm, const torch::nn::Module& model,
                        const std::shared_ptr<Communicator>& tensor_parallel);
  // Steps this rank's shard with the optimizer, then all-gathers the updated parameters.
  // loom::InvalidArgumentError when no synchronised backward ran since the last step.
  void step();
  // step() in parts, for an optimizer held elsewhere: begin_step() checks that a synchronised
  // backward ran and sets each shard tensor's .grad to its gradient shard; gather_parameters()
  // all-gathers the shards (after the optimizer updated them) into every rank's parameters.
  void begin_step();
  void gather_parameters();

  // With overlap_param_gather: waits for the all-gathers that bring these parameters (those of
  // `module` and its children; every parameter without an argument). Returns at once for
  // parameters already waited for, and without overlap.
  void wait_parameters();
  void wait_parameters(const std::vector<at::Tensor>& parameters);
  void wait_parameters(const torch::nn::Module& module);
  // Buckets whose all-gather nobody has waited for yet.
  size_t unwaited_buckets() const;

  // The fp32 master shards take the parameters' current values (the masters' extra precision is
  // lost). begin_step() does this by itself for every parameter written in place since the last
  // step (its version counter moved: a checkpoint load, an assignment under NoGradGuard); call it
  // after writing parameters in a way that does not count (through .data(), or the flat buffers).
  void refresh_master_weights();
  // Whether the optimizer steps an fp32 master copy of this bucket's shard.
  bool has_master_weights(size_t bucket) const;

  [[nodiscard]] GradientReducer::NoSyncGuard no_sync() { return reducer().no_sync(); }

  // This rank's gradient shard of each bucket (reduced and averaged after a synchronised
  // backward; fp32 where master weights are kept), the tensors the optimizer steps (the fp32 master
  // shards where kept, else views of the parameters), and where each lies: for checkpoints and
  // scalers.
  std::vector<at::Tensor> shard_gradients() const;
  std::vector<at::Tensor> shard_parameters() const;
  // loom::InvalidArgumentError when built without an optimizer.
  torch::optim::Optimizer& optimizer();
  bool has_optimizer() const;
  GradientReducer& reducer();
  Communicator& group() const;
  const std::vector<at::Tensor>& parameters() const;

  // Where a parameter's elements lie in the bucket layout (identical on every rank): bucket,
  // offset in the bucket's flat buffer, and the padded size of the bucket's shard.
  struct Placement {
    size_t bucket = 0;
    int64_t offset = 0;
    int64_t numel = 0;
  };
  const std::vector<Placement>& placements() const;
  int64_t shard_numel(size_t bucket) const;
  int stage() const;

  ZeroMemory memory() const;
  ZeroStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom
