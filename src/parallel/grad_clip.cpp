// loom::clip_grad_norm over pipeline stages and tensor-parallel slices (loom/parallel/grad_clip.h).
#include "loom/parallel/grad_clip.h"

#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/error.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {
namespace {

// Every gradient of `module` and its descendants, and the sum of squares of those this rank counts:
// slices always, replicated parameters only where `count_replicated`.
void visit(const torch::nn::Module& module, bool count_replicated, std::vector<at::Tensor>& grads, at::Tensor& squares) {
  std::map<std::string, tp::ShardInfo> shards;
  if (const auto* sharded = dynamic_cast<const tp::ShardedModule*>(&module)) shards = sharded->shard_info();
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    const at::Tensor& grad = item.value().grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    const auto found = shards.find(item.key());
    const bool slice = found != shards.end() && found->second.dim >= 0 && found->second.tp_size > 1;
    if (slice || count_replicated) squares += grad.detach().to(squares.device(), at::kDouble).pow(2).sum();
  }
  for (const auto& child : module.children()) visit(*child, count_replicated, grads, squares);
}

}  // namespace

double clip_grad_norm(const torch::nn::Module& model, double max_norm,
                      const std::shared_ptr<Communicator>& tensor_parallel,
                      const std::shared_ptr<Communicator>& pipeline) {
  if (!(max_norm > 0))
    throw InvalidArgumentError(ErrorContext("clip_grad_norm")("max_norm must be positive, found " +
                                                               std::to_string(max_norm)));
  // On the groups' device (NCCL reduces CUDA tensors), whatever this rank's part holds.
  const auto& group = tensor_parallel ? tensor_parallel : pipeline;
  at::Tensor squares = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(group ? group->device() : at::kCPU));
  std::vector<at::Tensor> grads;
  visit(model, !tensor_parallel || tensor_parallel->rank() == 0, grads, squares);
  for (const auto& g : {tensor_parallel, pipeline})
    if (g && g->size() > 1) g->all_reduce(squares, {ReduceOp::Sum})->wait();
  const double norm = std::sqrt(squares.item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (std::isfinite(norm) && coefficient < 1)
    for (auto& g : grads) g.mul_(coefficient);
  return norm;
}

}  // namespace loom
