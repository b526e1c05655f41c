// Shared by the optimizers over shards: see sharded_step.h.
#include "parallel/sharded_step.h"

#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "loom/comm/communicator.h"
#include "loom/error.h"
#include "loom/parallel/optimizer_state.h"
#include "loom/parallel/tensor_parallel.h"

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

TensorParallelNorm tensor_parallel_norm(const torch::nn::Module& model, Communicator& tensor_parallel,
                                        const std::vector<at::Tensor>& params,
                                        const std::vector<ZeroOptimizer::Placement>& placements,
                                        const std::vector<int64_t>& shard_numel, int shard_rank,
                                        const std::string& where) {
  // A model that does not hold the sharded parameters would say nothing of their slices: every
  // one would count as replicated, and the norm would be wrong without a word.
  std::unordered_set<const c10::TensorImpl*> held;
  for (const auto& p : model.parameters()) held.insert(p.unsafeGetTensorImpl());
  const auto missing = std::count_if(params.begin(), params.end(),
                                     [&](const at::Tensor& p) { return !held.count(p.unsafeGetTensorImpl()); });
  if (missing > 0)
    throw InvalidArgumentError(where + ": expected the model whose parameters are sharded, found one that holds " +
                               std::to_string(params.size() - missing) + " of the " + std::to_string(params.size()) +
                               " sharded parameters");
  std::unordered_set<const c10::TensorImpl*> slices;
  for (const auto& item : model.named_modules()) {
    const auto* sharded = dynamic_cast<const tp::ShardedModule*>(item.value().get());
    if (sharded == nullptr) continue;
    const auto own = item.value()->named_parameters(/*recurse=*/false);
    for (const auto& [name, info] : sharded->shard_info())
      if (const at::Tensor* p = own.find(name); p != nullptr && info.dim >= 0 && info.tp_size > 1)
        slices.insert(p->unsafeGetTensorImpl());
  }
  TensorParallelNorm norm;
  norm.tensor_parallel = &tensor_parallel;
  norm.counted.resize(shard_numel.size());
  const bool first = tensor_parallel.rank() == 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!first && !slices.count(params[i].unsafeGetTensorImpl())) continue;
    const auto& p = placements[i];
    const int64_t S = shard_numel[p.bucket];
    const int64_t begin = std::max(p.offset, shard_rank * S), end = std::min(p.offset + p.numel, (shard_rank + 1) * S);
    if (begin < end) norm.counted[p.bucket].emplace_back(begin - shard_rank * S, end - shard_rank * S);
  }
  return norm;
}

double clip_sharded_gradients(const std::vector<at::Tensor>& shard_gradients, Communicator& group, double max_norm,
                              const TensorParallelNorm* tp) {
  at::Tensor squares = at::zeros({1}, at::TensorOptions(group.device()).dtype(at::kDouble));
  for (size_t b = 0; b < shard_gradients.size(); ++b) {
    const at::Tensor& g = shard_gradients[b];
    if (!g.defined()) continue;
    if (tp == nullptr) {
      squares += g.to(at::kDouble).pow(2).sum();
      continue;
    }
    for (const auto& [begin, end] : tp->counted.at(b)) squares += g.narrow(0, begin, end - begin).to(at::kDouble).pow(2).sum();
  }
  group.all_reduce(squares, {ReduceOp::Sum})->wait();
  if (tp != nullptr && tp->tensor_parallel->size() > 1) tp->tensor_parallel->all_reduce(squares, {ReduceOp::Sum})->wait();
  const double norm = std::sqrt(squares.item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1)
    for (const auto& g : shard_gradients)
      if (g.defined()) g.mul_(coefficient);
  return norm;
}

}  // namespace loom::detail
