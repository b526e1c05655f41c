// What the optimizers over shards (ZeroOptimizer, FullyShardedDataParallel) share: the check that a
// user's optimizer steps exactly the shard tensors it was given, and clipping by the norm of
// gradients sharded over a group.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace loom {
class Communicator;
}

namespace loom::detail {

// `made` when it is an element-wise optimizer (optimizer_state.h's kinds) over exactly `shards`, in
// one parameter group; else InvalidArgumentError, prefixed by `where`. `sharded_by` completes
// "cannot be sharded by ...".
std::unique_ptr<torch::optim::Optimizer> adopt_shard_optimizer(std::unique_ptr<torch::optim::Optimizer> made,
                                                               const std::vector<at::Tensor>& shards,
                                                               const std::string& where, const std::string& sharded_by);

// The L2 norm of every rank's gradient shards (summed in double over `group`), and when it exceeds
// max_norm every shard scaled by max_norm / (norm + 1e-6), as torch::nn::utils::clip_grad_norm_
// does. Returns the norm before clipping. A collective over `group`.
double clip_sharded_gradients(const std::vector<at::Tensor>& shard_gradients, Communicator& group, double max_norm);

}  // namespace loom::detail
