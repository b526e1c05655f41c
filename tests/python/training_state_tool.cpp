// The C++ side of the cross-language training-state check (tests/python/test_checkpoint_languages.py):
// a model, an optimizer, a loom::GradScaler and an RNG tracker checkpointed by loom::Checkpointer in
// one process, so that Python loads what C++ saved and C++ loads what Python saved, state for state.
//   training_state_tool save DIR OPTIMIZER   three training steps (seed 0), the learning rate set to 0.007,
//                                            saved as step 3; prints the state
//   training_state_tool load DIR OPTIMIZER   a fresh model (seed 77) loaded from DIR; prints the state
// OPTIMIZER: adam, adamw, sgd, rmsprop or adagrad (non-default options, the same as the Python side's).
// The state printed (one JSON object): every parameter and buffer, each parameter's optimizer state
// tensors and step, the group's options, the scaler's scale and growth tracker, and the next draws
// of the default generator and of the tracker's stream.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/rand.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "loom/amp/grad_scaler.h"
#include "loom/error.h"
#include "loom/parallel/optimizer_state.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/checkpoint.h"

namespace {

using json = nlohmann::json;

torch::nn::Sequential make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8), torch::nn::Tanh(),
                               torch::nn::Linear(8, 3));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, torch::nn::Sequential& model) {
  auto params = model->parameters();
  using namespace torch::optim;
  if (kind == "adam") return std::make_unique<Adam>(params, AdamOptions(0.01).betas({0.8, 0.95}).weight_decay(0.01).amsgrad(true));
  if (kind == "adamw") return std::make_unique<AdamW>(params, AdamWOptions(0.01).betas({0.8, 0.95}).weight_decay(0.1));
  if (kind == "sgd") return std::make_unique<SGD>(params, SGDOptions(0.05).momentum(0.9).nesterov(true).dampening(0));
  if (kind == "rmsprop") return std::make_unique<RMSprop>(params, RMSpropOptions(0.01).momentum(0.5).centered(true));
  if (kind == "adagrad") return std::make_unique<Adagrad>(params, AdagradOptions(0.05).lr_decay(0.01));
  throw loom::InvalidArgumentError("training_state_tool: unknown optimizer " + kind);
}

std::vector<double> values(const at::Tensor& t) {
  at::Tensor flat = t.detach().to(at::kDouble).contiguous().view(-1);
  return {flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel()};
}

json state_json(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer, loom::GradScaler& scaler,
                loom::RngTracker& tracker) {
  json out;
  for (const auto& item : model->named_parameters()) out["model"][item.key()] = values(item.value());
  for (const auto& item : model->named_buffers()) out["model"][item.key()] = values(item.value());
  const auto kind = *loom::optimizer_kind(optimizer);
  for (const auto& item : model->named_parameters()) {
    const auto* s = loom::find_optimizer_state(optimizer, item.value());
    if (s == nullptr) continue;
    std::optional<int64_t> step;
    for (const auto& [key, tensor] : loom::optimizer_state_tensors(kind, *s, &step))
      out["optim"][item.key()][key] = values(tensor);
    if (step) out["steps"][item.key()] = *step;
  }
  out["lr"] = optimizer.param_groups()[0].options().get_lr();
  out["scale"] = scaler.get_scale();
  out["growth_tracker"] = scaler.get_growth_tracker();
  {
    auto guard = tracker.fork("model-parallel");
    out["stream_rand"] = values(at::rand({3}));
  }
  out["rand"] = values(at::rand({3}));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 3 ? argv[1] : "";
  if (mode != "save" && mode != "load") {
    std::fprintf(stderr, "usage: training_state_tool save|load DIR adam|adamw|sgd|rmsprop|adagrad\n");
    return 2;
  }
  try {
    const std::string kind = argv[3];
    auto model = make_model(mode == "save" ? 0 : 77);
    auto optimizer = make_optimizer(kind, model);
    loom::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 5});
    loom::RngTracker& tracker = loom::rng_tracker();
    tracker.reset();
    tracker.add("model-parallel", mode == "save" ? 123 : 999);
    loom::Checkpointer ckpt(nullptr, {.directory = argv[2], .async = false});
    ckpt.model(*model).optimizer(*optimizer).scaler(scaler).rng(tracker);
    if (mode == "save") {
      const at::Tensor x = at::arange(24, at::kFloat).view({6, 4}).sin();
      const at::Tensor y = at::arange(18, at::kFloat).view({6, 3}).cos();
      for (int step = 1; step <= 3; ++step) {
        optimizer->zero_grad();
        at::Tensor loss = (model->forward(x) - y).pow(2).mean();
        scaler.scale(loss).backward();
        scaler.step(*optimizer);
        scaler.update();
      }
      optimizer->param_groups()[0].options().set_lr(0.007);  // as a scheduler would
      {
        auto guard = tracker.fork("model-parallel");
        (void)at::rand({2});  // the stream moves on before the save
      }
      ckpt.save({.step = 3});
    } else if (!ckpt.load_latest()) {
      throw loom::CheckpointError("no checkpoint in " + std::string(argv[2]));
    }
    std::printf("%s\n", state_json(model, *optimizer, scaler, tracker).dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "training_state_tool: %s\n", e.what());
    return 1;
  }
}
