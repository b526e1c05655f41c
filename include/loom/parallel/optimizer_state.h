// The torch::optim optimizers whose state is tensors per parameter plus a step count (SGD, Adam,
// AdamW, RMSprop, Adagrad), and that state, by key: what ZeRO shards and what checkpoints save.
//
//   if (auto kind = loom::optimizer_kind(opt))
//     if (auto* state = loom::find_optimizer_state(opt, param))
//       for (auto& [key, tensor] : loom::optimizer_state_tensors(*kind, *state)) ...  // "exp_avg", ...
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
class OptimizerParamState;
class OptimizerOptions;
}  // namespace torch::optim

namespace loom {

enum class OptimizerKind { SGD, Adam, AdamW, RMSprop, Adagrad };

// The kind, or nothing for any other optimizer (LBFGS, a user's own).
std::optional<OptimizerKind> optimizer_kind(torch::optim::Optimizer& optimizer);
// "SGD", "Adam", ...
const char* optimizer_kind_name(OptimizerKind kind);
// Why an optimizer has no kind, for error messages: "torch::optim::LBFGS cannot be ..." or
// "the optimizer is not one of torch::optim::SGD, ...".
std::string unsupported_optimizer(torch::optim::Optimizer& optimizer, const std::string& cannot_be);
// The state of one parameter, or nullptr before the optimizer's first step with it.
torch::optim::OptimizerParamState* find_optimizer_state(torch::optim::Optimizer& optimizer,
                                                        const at::Tensor& parameter);
// Installs (replaces) the state of one parameter.
void set_optimizer_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter,
                         std::unique_ptr<torch::optim::OptimizerParamState> state);
// The state's tensors by key (those defined), and its step count where the kind keeps one.
std::vector<std::pair<std::string, at::Tensor>> optimizer_state_tensors(
    OptimizerKind kind, const torch::optim::OptimizerParamState& state, std::optional<int64_t>* step = nullptr);

// A fresh state object of `kind` from tensors by key (`get` returns an undefined tensor for a key
// not held) and a step count; nullptr when there is nothing to restore.
std::unique_ptr<torch::optim::OptimizerParamState> make_optimizer_state(
    OptimizerKind kind, const std::function<at::Tensor(const char*)>& get, std::optional<int64_t> step);
// An optimizer of `kind` over `parameters` with a copy of `options` (which must be that kind's);
// LibTorch's constructor checks their ranges.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(OptimizerKind kind, std::vector<at::Tensor> parameters,
                                                        const torch::optim::OptimizerOptions& options);

}  // namespace loom
