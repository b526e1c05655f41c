// loom::GradScaler against PyTorch's torch.amp.GradScaler: the reference sequence is generated
// in this test run by the installed torch (tests/python/gradscaler_reference.py) and the C++
// scaler must reproduce its scales, skipped steps and final weights exactly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/optim.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/amp/autocast.h"
#include "loom/amp/grad_scaler.h"
#include "loom/error.h"

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{5}, {3, 4}, {7}};
constexpr int kSteps = 20;
struct Injection {
  int step, tensor, element;
  float value;
};
const std::vector<Injection> kInject = {{2, 1, 0, INFINITY}, {3, 0, 2, NAN}, {7, 2, 6, -INFINITY},
                                        {8, 1, 11, INFINITY}, {12, 0, 0, NAN}};

std::vector<at::Tensor> target_gradients(int step) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    int64_t n = 1;
    for (auto d : kShapes[i]) n *= d;
    at::Tensor g = at::sin(at::arange(n, at::kFloat) * (0.37 * (step + 1)) + static_cast<double>(i));
    for (const auto& inj : kInject)
      if (inj.step == step && inj.tensor == static_cast<int>(i)) g[inj.element] = inj.value;
    grads.push_back(g.reshape(kShapes[i]));
  }
  return grads;
}

nlohmann::json run_reference() {
  const std::string out = ::testing::TempDir() + "gradscaler_reference.json";
  const std::string command = std::string(LOOM_PYTHON) + " " + LOOM_SOURCE_DIR +
                              "/tests/python/gradscaler_reference.py " + out;
  if (std::system(command.c_str()) != 0) throw std::runtime_error("reference failed: " + command);
  std::ifstream file(out);
  return nlohmann::json::parse(file);
}

}  // namespace

TEST(GradScaler, FollowsTorchAmpGradScalerStepForStep) {
  nlohmann::json ref = run_reference();
  at::set_num_threads(1);
  std::vector<at::Tensor> params;
  for (const auto& s : kShapes) {
    int64_t n = 1;
    for (auto d : s) n *= d;
    params.push_back((at::arange(n, at::kFloat) * 0.1 - 0.2).reshape(s).requires_grad_());
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01).momentum(0.9));
  loom::GradScaler scaler({.init_scale = 1024.0, .growth_factor = 2.0, .backoff_factor = 0.5, .growth_interval = 3});
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto grads = target_gradients(step);
    at::Tensor loss = at::zeros({});
    for (size_t i = 0; i < params.size(); ++i) loss = loss + (params[i] * grads[i]).sum();
    scaler.scale(loss).backward();
    bool stepped = scaler.step(opt);
    scaler.update();
    EXPECT_EQ(stepped, ref["stepped"][step].get<bool>()) << "step " << step;
    EXPECT_EQ(scaler.get_scale(), ref["scales"][step].get<double>()) << "step " << step;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto expected = ref["final_weights"][i].get<std::vector<float>>();
    at::Tensor flat = params[i].detach().reshape({-1});
    for (int64_t k = 0; k < flat.numel(); ++k)
      EXPECT_EQ(flat[k].item<float>(), expected[k]) << "parameter " << i << " element " << k;
  }
  auto state = scaler.state_dict();
  for (auto& [key, value] : ref["state_dict"].items()) EXPECT_EQ(state.at(key), value.get<double>()) << key;
}

TEST(GradScaler, DisabledIsANoOpWrapper) {
  at::Tensor p = at::ones({3}).requires_grad_();
  torch::optim::SGD opt({p}, 0.5);
  loom::GradScaler scaler({.enabled = false});
  at::Tensor loss = (p * 2).sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
  EXPECT_TRUE(at::allclose(p.detach(), at::zeros({3})));
}

namespace {
template <typename Call>
std::string error_of(Call call) {
  try {
    call();
  } catch (const loom::InvalidArgumentError& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST(GradScaler, MisuseIsAClearError) {
  at::Tensor p = at::ones({3}).requires_grad_();
  torch::optim::SGD opt({p}, 0.1);
  loom::GradScaler scaler;
  // Step before any backward: nothing to unscale.
  EXPECT_NE(error_of([&] { scaler.step(opt); }).find("no loss was scaled yet"), std::string::npos);
  scaler.scale((p * 3).sum());  // scaled but never backpropagated: no gradients
  EXPECT_NE(error_of([&] { scaler.step(opt); }).find("none of its parameters has a gradient"), std::string::npos);
  scaler.scale((p * 3).sum()).backward();
  scaler.unscale_(opt);
  EXPECT_NE(error_of([&] { scaler.unscale_(opt); })
                .find("unscale_() has already been called on this optimizer since the last update()"),
            std::string::npos);
  scaler.step(opt);
  EXPECT_NE(error_of([&] { scaler.step(opt); }).find("step() has already been called since the last update()"),
            std::string::npos);
  EXPECT_NE(error_of([&] { scaler.unscale_(opt); }).find("unscale_() is being called after step()"),
            std::string::npos);
  scaler.update();
  EXPECT_NE(error_of([&] { scaler.scale(at::Tensor()); }).find("expected a defined tensor (the loss)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { scaler.scale(at::ones({1}, at::kLong)); }).find("expected a floating-point loss, found Long"),
            std::string::npos);
  EXPECT_NE(error_of([&] { loom::GradScaler({.growth_factor = 0.9}); }).find("growth_factor must be > 1.0"),
            std::string::npos);
}

TEST(GradScaler, StateDictRoundTripAndMalformedDicts) {
  loom::GradScaler a({.init_scale = 512.0, .growth_interval = 7});
  auto state = a.state_dict();
  EXPECT_EQ(state.at("scale"), 512.0);
  EXPECT_EQ(state.at("growth_interval"), 7.0);
  loom::GradScaler b;
  b.load_state_dict(state);
  EXPECT_EQ(b.get_scale(), 512.0);
  EXPECT_EQ(b.get_growth_interval(), 7);
  EXPECT_NE(error_of([&] { b.load_state_dict({}); }).find("the state dict is empty"), std::string::npos);
  auto missing = state;
  missing.erase("backoff_factor");
  EXPECT_NE(error_of([&] { b.load_state_dict(missing); }).find("missing key 'backoff_factor'"), std::string::npos);
  auto bad = state;
  bad["_growth_tracker"] = 9;  // >= growth_interval
  EXPECT_NE(error_of([&] { b.load_state_dict(bad); }).find("_growth_tracker must be an integer in [0, growth_interval)"),
            std::string::npos);
  bad = state;
  bad["scale"] = -1;
  EXPECT_NE(error_of([&] { b.load_state_dict(bad); }).find("scale must be positive"), std::string::npos);
}

TEST(GradScaler, Float16GradientsAreRejected) {
  at::Tensor p = at::ones({3}, at::kHalf).requires_grad_();
  torch::optim::SGD opt({p}, 0.1);
  loom::GradScaler scaler;
  scaler.scale((p.to(at::kFloat) * 2).sum()).backward();
  EXPECT_NE(error_of([&] { scaler.unscale_(opt); }).find("attempting to unscale float16 gradients"),
            std::string::npos);
}

TEST(Autocast, CpuBfloat16TrainingMatchesFloat32) {
  // A small regression model trained with bf16 autocast (and the scaler) ends at the float32
  // loss within 5% relative: bfloat16 keeps 8 bits of mantissa, which perturbs each step's
  // gradient by ~0.4% without changing where training goes.
  auto train = [](bool mixed) {
    at::manual_seed(0);
    at::Tensor w1 = (at::randn({16, 64}) * 0.2).requires_grad_();
    at::Tensor w2 = (at::randn({64, 1}) * 0.2).requires_grad_();
    torch::optim::SGD opt({w1, w2}, 0.05);
    loom::GradScaler scaler({.enabled = mixed});
    at::Tensor x = at::randn({128, 16});
    at::Tensor y = at::sin(x.sum(1, true));
    double last = 0;
    for (int step = 0; step < 200; ++step) {
      opt.zero_grad();
      at::Tensor pred;
      {
        loom::AutocastGuard autocast(at::kCPU, at::kBFloat16, mixed);
        pred = at::relu(x.mm(w1)).mm(w2);
        if (mixed) EXPECT_EQ(pred.scalar_type(), at::kBFloat16);
      }
      at::Tensor loss = (pred.to(at::kFloat) - y).pow(2).mean();
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      last = loss.item<double>();
    }
    return last;
  };
  const double fp32 = train(false), bf16 = train(true);
  EXPECT_LT(fp32, 0.5);  // it learned
  EXPECT_NEAR(bf16, fp32, 0.05 * fp32 + 1e-3) << "fp32 " << fp32 << " bf16 " << bf16;
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));  // the guard restored the state
}
