// Shared by the optimizers over shards: see sharded_step.h.
#include "parallel/sharded_step.h"

#include <ATen/ops/zeros.h>
#include <torch/optim/optimizer.h>

#include <cmath>

#include "loom/comm/communicator.h"
#include "loom/error.h"
#include "loom/parallel/optimizer_state.h"

namespace loom::detail {

std::unique_ptr<torch::optim::Optimizer> adopt_shard_optimizer(std::unique_ptr<torch::optim::Optimizer> made,
                                                               const std::vector<at::Tensor>& shards,
                                                               const std::string& where, const std::string& sharded_by) {
  if (!made) throw InvalidArgumentError(where + ": the optimizer factory returned no optimizer");
  if (!optimizer_kind(*made))
    throw InvalidArgumentError(where + ": " + unsupported_optimizer(*made, "sharded by " + sharded_by) +
                               " (element-wise optimizers: each element's update depends on that element alone, so "
                               "a shard can be stepped by itself)");
  const auto& groups = made->param_groups();
  size_t given = 0;
  for (const auto& g : groups) given += g.params().size();
  if (groups.size() != 1 || given != shards.size())
    throw InvalidArgumentError(where + ": expected the optimizer over exactly the " + std::to_string(shards.size()) +
                               " shard tensors it is given, in one parameter group; found " +
                               std::to_string(groups.size()) + " groups with " + std::to_string(given) + " tensors");
  for (size_t b = 0; b < shards.size(); ++b)
    if (!groups[0].params()[b].is_same(shards[b]))
      throw InvalidArgumentError(where + ": the optimizer's tensor " + std::to_string(b) + " is not shard tensor " +
                                 std::to_string(b) + " (pass the factory's argument through)");
  return made;
}

double clip_sharded_gradients(const std::vector<at::Tensor>& shard_gradients, Communicator& group, double max_norm) {
  at::Tensor squares = at::zeros({1}, at::TensorOptions(group.device()).dtype(at::kDouble));
  for (const auto& g : shard_gradients) squares += g.to(at::kDouble).pow(2).sum();
  group.all_reduce(squares, {ReduceOp::Sum})->wait();
  const double norm = std::sqrt(squares.item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1)
    for (const auto& g : shard_gradients) g.mul_(coefficient);
  return norm;
}

}  // namespace loom::detail
