// Activation recomputation (torch.utils.checkpoint for C++ modules).
//
// loom::recompute(fn, input, parameters) runs fn(input) without keeping the activations it would
// save for backward; only the input is kept. In backward the function runs again, with the random
// state it saw the first time (CPU and CUDA default generators, the tensor-parallel RngTracker's
// streams, the autocast state), so dropout draws the same masks, and the gradient flows through the
// recomputation to the input and to `parameters`. The parameters are explicit inputs of the
// recomputation's backward node, so their gradients arrive through their accumulators as usual
// (DDP's hooks, GradientReducer and gradient accumulation behave as without recomputation), and
// torch::autograd::grad with respect to them works.
//
//   struct Gpt : torch::nn::Module {
//     at::Tensor forward(at::Tensor x) {
//       for (auto& block : blocks) x = loom::recompute(block, x);   // keeps one tensor per block
//       ...
//   };
//   // or any function of one tensor:
//   y = loom::recompute([&](const at::Tensor& x) { return mlp(ln(x)); }, x, mlp->parameters());
//
// Costs one more forward of fn per backward. Outside grad mode, or when neither the input nor a
// parameter requires a gradient, fn simply runs. fn must be deterministic given the random state
// (it runs twice), must not return a view of its input, and communicates twice if it communicates
// (tensor-parallel all-reduces happen again in the recomputation, on every rank alike).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <vector>

namespace loom {

class RngTracker;

struct RecomputeOptions {
  // The tracker whose streams are saved and restored; nullptr: loom::rng_tracker().
  RngTracker* rng = nullptr;
};

at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                     const std::vector<at::Tensor>& parameters, const RecomputeOptions& options = {});

// A module whose forward takes and returns one tensor (a ModuleHolder such as a
// ParallelTransformerBlock, or a torch::nn::Sequential); its parameters are the recomputation's.
template <typename ModuleHolder>
at::Tensor recompute(ModuleHolder& module, const at::Tensor& input, const RecomputeOptions& options = {}) {
  // The backward node holds the module (shared), so it may outlive the caller's handle.
  return recompute([impl = module.ptr()](const at::Tensor& x) { return impl->forward(x); }, input,
                   module->parameters(), options);
}

}  // namespace loom
