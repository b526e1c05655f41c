// GPU test of checkpoints: CUDA parameters, Adam state and GradScaler saved asynchronously through
// the staging ring (device-to-host copies ordered after the current stream, awaited before save()
// returns, so changing the weights right after save() must not reach the checkpoint; the stream is
// kept busy for half a second first, so a save that did not wait would read stale bytes), the
// CUDA generator saved and restored, and the same checkpoint loaded on the CPU (the format does
// not depend on the device). Run by benchmarks/gpu_check.sh under `mpirun -np 1`; skips without a
// GPU.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "loom/loom.h"
#include "train/device_staging.h"

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

  loom::RngTracker& device_rng = loom::rng_tracker(device);
  loom::model_parallel_seed(7, 0, device_rng);
  {
    auto guard = device_rng.fork();
    (void)at::rand({4}, device);  // the stream has moved on from its seed
  }
  loom::Checkpointer c(g_runtime->world_comm(), {.directory = dir});
  c.model(net).optimizer(opt).scaler(scaler).rng(device_rng).rng(loom::rng_tracker());
  std::vector<at::Tensor> saved;
  for (const auto& p : net->parameters()) saved.push_back(p.detach().clone());
  for (const auto& p : net->parameters())
    saved.push_back(
        static_cast<torch::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).exp_avg_sq().clone());
  at::cuda::sleep(1'000'000'000);  // about half a second of the current stream before the copies
  c.save({.step = 3});
  {
    at::NoGradGuard no_grad;  // right after save(): must not reach the checkpoint
    for (auto& p : net->parameters()) p.add_(1.0);
  }
  const at::Tensor next_draw = at::rand({8}, device);  // the CUDA generator after the save
  at::Tensor next_stream_draw;
  {
    auto guard = device_rng.fork();
    next_stream_draw = at::rand({8}, device);  // the CUDA tracker's stream after the save
  }
  c.wait();
  {
    // Device-independent keys: the current device's generator, the CUDA tracker's streams.
    std::ifstream manifest(dir + "/step_000003/manifest.json");
    const std::string text((std::istreambuf_iterator<char>(manifest)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("\"rng/rank00000/cuda\""), std::string::npos) << text.substr(0, 2000);
    EXPECT_NE(text.find("\"rng/rank00000/stream-cuda/model-parallel\""), std::string::npos);
    EXPECT_EQ(text.find("\"rng/rank00000/cuda0\""), std::string::npos);
  }
  device_rng.reset();
  loom::model_parallel_seed(8, 0, device_rng);  // a different stream, to be replaced by the load

  torch::manual_seed(2);
  Net fresh;
  fresh->to(device);
  torch::optim::Adam fresh_opt(fresh->parameters(), torch::optim::AdamOptions(1e-2));
  loom::GradScaler fresh_scaler;
  loom::Checkpointer cf(g_runtime->world_comm(), {.directory = dir});
  cf.model(fresh).optimizer(fresh_opt).scaler(fresh_scaler).rng(device_rng);
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
  {
    auto guard = device_rng.fork();
    EXPECT_TRUE(at::equal(at::rand({8}, device), next_stream_draw)) << "the CUDA tracker's stream was not restored";
  }

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

// The ring copies non-contiguous tensors, tensors larger than a slot and empty ones byte for byte,
// and waits for the producer's stream only: a long kernel on another stream does not hold it up.
TEST(CudaCheckpoint, StagingRingCopiesExactlyAndWaitsOnlyForTheProducerStream) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU visible";
  const at::Device device(at::kCUDA, 0);
  c10::cuda::CUDAGuard guard(device);
  std::vector<at::Tensor> sources = {at::randn({1000, 37}, device), at::randn({64, 64}, device).t(),
                                     at::arange(0, 5, at::TensorOptions().dtype(at::kLong).device(device)),
                                     at::empty({0}, device), at::randn({3}, device).to(at::kHalf)};
  // The producer stream changes the first tensor after a delay: the ring must see the final value.
  at::cuda::sleep(200'000'000);
  sources[0].mul_(2);
  std::vector<at::Tensor> expected, hosts;
  std::vector<std::pair<at::Tensor, void*>> jobs;
  for (const auto& t : sources) {
    hosts.push_back(at::empty(t.sizes(), t.options().device(at::kCPU)));
    jobs.emplace_back(t, hosts.back().data_ptr());
  }
  // A long kernel on another stream of the same device.
  auto other = c10::cuda::getStreamFromPool(false, device.index());
  {
    c10::cuda::CUDAStreamGuard on_other(other);
    at::cuda::sleep(4'000'000'000);  // about 2 s
  }
  loom::detail::ckpt::DeviceToHostRing ring(/*slot_bytes=*/4096, /*slots=*/2);
  const auto start = std::chrono::steady_clock::now();
  ring.copy(jobs);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0) << "the ring waited for another stream";
  EXPECT_EQ(ring.pinned_bytes(), 2u * 4096u);
  for (size_t i = 0; i < sources.size(); ++i)
    EXPECT_TRUE(at::equal(hosts[i], sources[i].cpu())) << "tensor " << i;
  other.synchronize();
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
