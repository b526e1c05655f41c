// What the optimizers over shards (ZeroOptimizer, FullyShardedDataParallel) share: the check that a
// user's optimizer steps exactly the shard tensors it was given, and clipping by the norm of
// gradients sharded over a group.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/parallel/zero.h"

namespace torch::optim {
class Optimizer;
}
namespace torch::nn {
class Module;
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

// With tensor parallelism inside a sharded model, which elements of this rank's shards count toward
// the global norm: a parameter that is a TP slice counts on every TP rank, one replicated over the
// TP group (a layernorm's weight, the bias after a row-parallel layer) on TP rank 0 only, so that
// the sum over the TP group counts it once.
struct TensorParallelNorm {
  Communicator* tensor_parallel = nullptr;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> counted;  // per bucket: [begin, end) of the shard
};
// From `model`'s tp::ShardedModules and the shards' layout: `params` and where each lies (bucket or
// unit, offset), each bucket's shard size, this rank's place in the sharding group.
// InvalidArgumentError (prefixed by `where`) when `model` does not hold every one of `params`.
TensorParallelNorm tensor_parallel_norm(const torch::nn::Module& model, Communicator& tensor_parallel,
                                        const std::vector<at::Tensor>& params,
                                        const std::vector<ZeroOptimizer::Placement>& placements,
                                        const std::vector<int64_t>& shard_numel, int shard_rank,
                                        const std::string& where);

// The L2 norm of every rank's gradient shards (summed in double over `group`, and over the TP group
// where `tp` says), and when it exceeds max_norm every shard scaled by max_norm / (norm + 1e-6), as
// torch::nn::utils::clip_grad_norm_ does. Undefined gradients (a bucket without one) are skipped.
// Returns the norm before clipping. A collective over `group` (and the TP group).
double clip_sharded_gradients(const std::vector<at::Tensor>& shard_gradients, Communicator& group, double max_norm,
                              const TensorParallelNorm* tp = nullptr);

}  // namespace loom::detail
