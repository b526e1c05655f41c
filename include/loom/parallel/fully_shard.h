// Fully sharded data parallelism (ZeRO stage 3, PyTorch's FSDP): the parameters are sharded too.
//
// ZeRO stages 1 and 2 (loom/parallel/zero.h) shard the optimizer state and the gradients, but every
// rank still holds every parameter. FullyShardedDataParallel splits the model into units (the
// blocks you name, a transformer layer each, and the root: every parameter outside them) and keeps,
// on each of the N ranks of its group, 1/N of each unit's parameters as one flat shard:
//   - a unit's forward all-gathers its parameters into one flat buffer first (the model's own
//     parameter tensors are views of it), and on a GPU the next unit's gather starts while this one
//     computes (FullyShardOptions::prefetch);
//   - after its forward the buffer's memory is freed (reshard_after_forward; the root keeps its
//     parameters, as FSDP2 does, since backward needs them at once); a unit's backward gathers them
//     again (prefetching the previous unit's, as in forward);
//   - as soon as a unit's gradients are all computed they are reduce-scattered: rank r keeps the
//     averaged gradients of its shard only, and the unit's buffer is freed again;
//   - the unmodified torch::optim optimizer steps the shards.
// Bytes per parameter, fp32 with Adam: 16 / N (parameters 4, gradients 4, state 8, each over N),
// plus the units held whole at a time (the root, and one unit, two with prefetch).
//
// C++ modules have no forward hooks, so each unit's forward runs through forward(unit, ...), the
// root's outermost (the model's embedding and head are the root's):
//   auto group = loom::init()->world_comm();
//   Gpt model;                                             // the same model on every rank
//   std::vector<std::shared_ptr<torch::nn::Module>> units;
//   for (auto& block : model->blocks) units.push_back(block.ptr());
//   loom::FullyShardedDataParallel fsdp(*model, units, group, [](std::vector<at::Tensor> shards) {
//     return std::make_unique<torch::optim::AdamW>(shards, torch::optim::AdamWOptions(1e-3));
//   });
//   at::Tensor logits = fsdp.forward(*model, tokens, [&](const at::Tensor& tokens) {
//     at::Tensor h = model->embed(tokens);
//     for (auto& block : model->blocks)
//       h = fsdp.forward(*block, h, [&](const at::Tensor& h) { return block->forward(h); });
//     return model->head(h);
//   });
//   loss(logits).backward();                                // gathers again, reduce-scatters per unit
//   fsdp.clip_grad_norm(1.0);                               // optional: the global norm over all shards
//   fsdp.step();                                            // steps this rank's shards
//   fsdp.zero_grad();
//
// A unit's parameters may be read only inside its forward(), or between unshard() and reshard()
// (evaluation, export: unshard() gathers every unit). Every rank runs the same units in the same
// order, as FSDP requires (the gathers and reduce-scatters are collectives). The forward order of
// the first iteration drives the prefetch after it. Gradient accumulation: call backward once per
// micro-batch; each backward reduce-scatters and adds into the gradient shards (the sum of the
// micro-batches' averages, as DDP's no_sync gives it), or, under no_sync(), keeps the gradients
// whole until the last micro-batch's backward reduces them once. A backward that raises is
// abandoned by the next forward(), zero_grad(), step(), clip_grad_norm() or unshard(): the reduce-scatters it started are waited
// for and dropped with every gradient not yet added into the shards. Element-wise optimizers only, as for ZeRO
// (SGD, Adam, AdamW, RMSprop, Adagrad); one parameter group. Frozen parameters (requires_grad
// false) stay whole on every rank with rank 0's values. Hybrid sharding: FullyShardOptions::replicate
// (shard within a node, replicate across nodes); tensor parallelism inside: pass the DP group, the
// TP layers' parameters are this rank's slices. All trainable parameters of a unit share a
// dtype and the group's device.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/parallel/zero.h"

namespace torch::optim {
class Optimizer;
}
namespace torch::nn {
class Module;
}

namespace loom {

struct FullyShardOptions {
  // Free a unit's gathered parameters after its forward (gather again in backward). Off: keep them
  // until the unit's backward is done (one gather per step instead of two, ZeRO stage 2's memory
  // for parameters). The root never reshards after forward.
  bool reshard_after_forward = true;
  // Start the next unit's gather while this one runs, in forward and in backward. Unset: on for
  // device groups (NCCL runs the gather on a stream of its own), off for host groups: there a
  // rank's one core drives the gather's progress and the computation both, and prefetching made
  // zero_bench's fully sharded step slower, not faster (1.19-1.29 of ZeRO stage 2's step with it,
  // 1.05-1.21 without, 2 ranks, 4.2 M parameters).
  std::optional<bool> prefetch;
  // Broadcast parameters from rank 0 of the group at construction (and of `replicate` first).
  bool broadcast_parameters = true;
  // Mixed precision (FSDP2's MixedPrecisionPolicy): gather and compute the parameters in
  // param_dtype (bf16, fp16; the module's parameters take that dtype) while the shards keep the
  // parameters' own (fp32 masters: what the optimizer steps); gradients are reduced in
  // reduce_dtype (default: the shards' dtype) and added into the shards' gradients in theirs.
  // Under no_sync() the micro-batches' gradients add up in reduce_dtype too (not in bf16). An fp16
  // reduce_dtype divides by about sqrt(N) before the sum and by the rest after (FSDP2's factors),
  // so that a sum over the ranks does not overflow where the average would not.
  std::optional<at::ScalarType> param_dtype;
  std::optional<at::ScalarType> reduce_dtype;
  // Hybrid sharding (HSDP): shard over the group (a node), replicate over this one (the ranks
  // holding the same shard in the other groups). After each unit's reduce-scatter its gradient
  // shard is all-reduced over `replicate`; the average is over both. Null: shard over all ranks.
  std::shared_ptr<Communicator> replicate;
};

// Collectives issued, counted on this rank since construction.
struct FullyShardStats {
  uint64_t steps = 0;
  uint64_t all_gathers = 0;             // unit parameter gathers
  uint64_t bytes_all_gathered = 0;      // their outputs (whole padded units)
  uint64_t reduce_scatters = 0;         // unit gradient reductions
  uint64_t bytes_reduce_scattered = 0;  // their inputs (whole padded units)
  uint64_t bytes_all_reduced = 0;       // gradient shards all-reduced over the replicate group (HSDP)
  // The most bytes of gathered units held at once (the root, the unit computing, the one prefetched).
  uint64_t peak_unsharded_bytes = 0;
};

class FullyShardedDataParallel {
 public:
  using OptimizerFactory = ZeroOptimizer::OptimizerFactory;
  using UnitForward = std::function<at::Tensor(const at::Tensor&)>;
  using UnitForwardMany = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

  // `root` is the whole model; `units` are submodules of it (blocks), each one unit; the root unit
  // holds every parameter of `root` in none of them. A parameter in two named units belongs to the
  // innermost. `make_optimizer` is called once with the shard tensors, one per unit holding
  // trainable parameters (the root's last).
  FullyShardedDataParallel(torch::nn::Module& root, std::vector<std::shared_ptr<torch::nn::Module>> units,
                           std::shared_ptr<Communicator> group, const OptimizerFactory& make_optimizer,
                           FullyShardOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Runs `body` as the forward of `unit` (the root or one of the units): gathers its parameters
  // first, frees them after (as the options say), and arranges their gathering again and their
  // gradients' reduce-scatter in backward. InvalidArgumentError for a module that is not a unit.
  at::Tensor forward(const torch::nn::Module& unit, const at::Tensor& input, const UnitForward& body);
  std::vector<at::Tensor> forward(const torch::nn::Module& unit, const std::vector<at::Tensor>& inputs,
                                  const UnitForwardMany& body);

  // Gradient accumulation without communication (FSDP2's set_requires_gradient_sync(false)): a
  // backward inside the guard reduces nothing and leaves each unit's gradients whole in the
  // parameters' .grad (their memory, as DDP's); the next backward outside reduces the sum.
  //   { auto guard = fsdp.no_sync(); loss_of(micro[0]).backward(); }  loss_of(micro[1]).backward();
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(FullyShardedDataParallel& fsdp);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;

   private:
    FullyShardedDataParallel* fsdp_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // Drops the gradient shards (and gradients kept whole under no_sync): the next backward starts
  // from zero.
  void zero_grad();
  // The global L2 norm of the gradients (all shards, agreed over the group), and when it exceeds
  // max_norm every shard scaled by max_norm / (norm + 1e-6). Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // The same with tensor parallelism inside (the group is the data-parallel one): `model`'s
  // tp::ShardedModules say which parameters are this rank's slices (their squares are summed over
  // `tensor_parallel` too) and which are replicated over it (counted once), as loom::clip_grad_norm
  // does for a model that is not sharded. Every rank of both groups scales by the same coefficient.
  // InvalidArgumentError when `model` does not hold every sharded parameter (it would say nothing of
  // their slices).
  //   fsdp.clip_grad_norm(1.0, *model, ps.tp_group());
  double clip_grad_norm(double max_norm, const torch::nn::Module& model,
                        const std::shared_ptr<Communicator>& tensor_parallel);
  // Steps this rank's shards. InvalidArgumentError when no backward ran since the last step.
  void step();

  // Gathers every unit's parameters (the model reads as a whole one: evaluation outside forward(),
  // export) until reshard() or the next step. Collective.
  void unshard();
  void reshard();

  // This rank's gradient shard and parameter shard of each unit (the tensors the optimizer steps).
  std::vector<at::Tensor> shard_gradients() const;
  std::vector<at::Tensor> shard_parameters() const;
  // The trainable parameters it shards, in the root's named_parameters() order, and where each
  // lies: its unit (as `bucket`) and offset in the unit's flat layout; rank r's shard of unit u
  // holds elements [r * shard_numel(u), (r + 1) * shard_numel(u)). What a checkpoint reads.
  const std::vector<at::Tensor>& parameters() const;
  const std::vector<ZeroOptimizer::Placement>& placements() const;
  int64_t shard_numel(size_t unit) const;
  torch::optim::Optimizer& optimizer();
  Communicator& group() const;
  // Units holding trainable parameters, the root last; and each one's parameter count (unpadded).
  size_t units() const;
  int64_t unit_numel(size_t unit) const;
  // Units whose parameters are gathered now.
  size_t units_unsharded() const;

  // Bytes held, counted from the live tensors' storages: the shards and the gathered units
  // (parameters), the gradient shards and any gradient not yet reduced, the optimizer's state.
  ZeroMemory memory() const;
  FullyShardStats stats() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace loom
