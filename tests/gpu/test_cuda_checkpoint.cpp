// GPU test of checkpoints: CUDA parameters, Adam state and GradScaler saved asynchronously through
// the pinned staging buffer (device-to-host copies queued on the current stream, awaited before
// save() returns, so changing the weights right after save() must not reach the checkpoint), the
// CUDA generator saved and restored, and the same checkpoint loaded on the CPU (the format does
// not depend on the device). Run by benchmarks/gpu_check.sh under `mpirun -np 1`; skips without a
// GPU.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <filesystem>

#include "loom/loom.h"

namespace {

std::shared_ptr<loom::Runtime> g_runtime;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(256, 512));
    b = register_module("b", torch::nn::Linear(512, 16));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

void train(Net& net, torch::optim::Adam& opt, loom::GradScaler& scaler, const at::Device& device, int steps) {
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    at::Tensor loss = net->forward(at::randn({32, 256}, device)).pow(2).mean();
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
  }
}

std::string scratch(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "loom_cuda_ckpt_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(CudaCheckpoint, AsyncSaveOfCudaStateRoundTripsBitwiseAndLoadsOnTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU visible";
  const at::Device device(at::kCUDA, 0);
  const std::string dir = scratch("roundtrip");
  torch::manual_seed(1);
  Net net;
  net->to(device);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  loom::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2});
  train(net, opt, scaler, device, 3);

  loom::Checkpointer c(g_runtime->world_comm(), {.directory = dir});
  c.model(net).optimizer(opt).scaler(scaler);
  std::vector<at::Tensor> saved;
  for (const auto& p : net->parameters()) saved.push_back(p.detach().clone());
  for (const auto& p : net->parameters())
    saved.push_back(
        static_cast<torch::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).exp_avg_sq().clone());
  c.save({.step = 3});
  {
    at::NoGradGuard no_grad;  // right after save(): must not reach the checkpoint
    for (auto& p : net->parameters()) p.add_(1.0);
  }
  const at::Tensor next_draw = at::rand({8}, device);  // the CUDA generator after the save
  c.wait();

  torch::manual_seed(2);
  Net fresh;
  fresh->to(device);
  torch::optim::Adam fresh_opt(fresh->parameters(), torch::optim::AdamOptions(1e-2));
  loom::GradScaler fresh_scaler;
  loom::Checkpointer cf(g_runtime->world_comm(), {.directory = dir});
  cf.model(fresh).optimizer(fresh_opt).scaler(fresh_scaler);
  ASSERT_TRUE(cf.load_latest());
  size_t i = 0;
  for (const auto& p : fresh->parameters()) {
    EXPECT_TRUE(p.is_cuda());
    EXPECT_TRUE(at::equal(p, saved[i++]));
  }
  for (const auto& p : fresh->parameters()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*fresh_opt.state().at(p.unsafeGetTensorImpl()));
    EXPECT_TRUE(s.exp_avg_sq().is_cuda());
    EXPECT_TRUE(at::equal(s.exp_avg_sq(), saved[i++]));
    EXPECT_EQ(s.step(), 3);
  }
  EXPECT_EQ(fresh_scaler.get_scale(), scaler.get_scale());
  EXPECT_TRUE(at::equal(at::rand({8}, device), next_draw)) << "the CUDA generator was not restored";

  // The same checkpoint on the CPU.
  Net cpu;
  torch::optim::Adam cpu_opt(cpu->parameters(), torch::optim::AdamOptions(1e-2));
  loom::Checkpointer cc(g_runtime->world_comm(), {.directory = dir});
  cc.model(cpu).optimizer(cpu_opt);
  cc.load_latest();
  i = 0;
  for (const auto& p : cpu->parameters()) EXPECT_TRUE(at::equal(p, saved[i++].cpu()));
  std::filesystem::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  g_runtime = loom::init();
  int status = RUN_ALL_TESTS();
  g_runtime.reset();
  loom::finalize();
  return status;
}
