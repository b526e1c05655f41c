// The optimizers the sharded-state tests (ZeRO, fully sharded) train with against DDP: SGD with
// Nesterov momentum and weight decay, Adam with weight decay, AdamW.
#pragma once

#include <torch/optim.h>

#include <memory>
#include <vector>

namespace loom::test {

enum class Opt { SgdMomentum, Adam, AdamW };

inline const char* opt_name(Opt o) { return o == Opt::SgdMomentum ? "SGD" : o == Opt::Adam ? "Adam" : "AdamW"; }

inline std::unique_ptr<torch::optim::Optimizer> make(Opt opt, std::vector<at::Tensor> params) {
  switch (opt) {
    case Opt::SgdMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
    case Opt::Adam: return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
    case Opt::AdamW: return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
  }
  return nullptr;
}

}  // namespace loom::test
