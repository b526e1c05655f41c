// Clipping by the global gradient norm of a model spread over ranks, as
// torch.nn.utils.clip_grad_norm_ does for one process (and Megatron-Core's clip_grad_norm_fp32 for
// its parallel layers): pipeline stages hold different layers and tensor-parallel ranks different
// slices, so the norm sums every rank's share. A slice (a parameter a tp::ShardedModule describes
// as split) counts on every rank of the TP group; a parameter the TP group replicates (a
// layernorm, a row-parallel bias) counts once. Data-parallel replicas hold the same reduced
// gradients and are not summed over.
//
//   pipeline.step(micro_batches, loss);                  // (with a scaler: scaler.unscale_(optimizer) first)
//   const double norm = loom::clip_grad_norm(*model, 1.0, ps.tp_group(), ps.pp_group());
//   optimizer.step();
#pragma once

#include <memory>

namespace torch::nn {
class Module;
}

namespace loom {

class Communicator;

// The L2 norm of every gradient of `model` (this rank's part: its stages' layers, its TP slices),
// summed over the ranks of `tensor_parallel` and of `pipeline` (either may be null: a group of one),
// and, when it exceeds `max_norm`, every gradient of `model` scaled by max_norm / (norm + 1e-6).
// Returns the norm before clipping. A non-finite norm is returned with nothing scaled.
// InvalidArgumentError when max_norm is not positive. A collective over both groups.
double clip_grad_norm(const torch::nn::Module& model, double max_norm,
                      const std::shared_ptr<Communicator>& tensor_parallel,
                      const std::shared_ptr<Communicator>& pipeline);

}  // namespace loom
