// GPU tests of the training paths on CUDA: the gradient reducer over the NCCL communicator
// (hooks on CUDA parameters, buckets as gradient views, end-of-backward wait on the device
// stream), gradient accumulation, the GradScaler with float16 autocast (and a state loaded before
// the first scale), the device loom::init() chooses, and tensor-parallel layers whose region
// operations run over NCCL. Run by benchmarks/gpu_check.sh at `mpirun -np 1` and `-np 2` on one
// GPU; every test skips where no GPU is visible. At one rank the reducer is handed the average
// hook explicitly, so buckets really go through NCCL (the default would leave gradients alone);
// the tensor-parallel test communicates only at two ranks.
//
// `test_cuda_training --exit-without-finalize` initialises, runs one all_reduce on the device
// communicator and returns from main without loom::finalize(): the NCCL communicator must be
// torn down before the CUDA runtime, exit status 0 (gpu_check.sh checks it).
#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include "loom/loom.h"

namespace {

std::shared_ptr<loom::Runtime> g_runtime;
std::shared_ptr<loom::Communicator> g_gpu;

int device_index() {
  if (auto device = g_runtime->cuda_device()) return *device;
  return c10::cuda::device_count() == 1 ? 0 : g_runtime->world().local_rank % c10::cuda::device_count();
}

class CudaTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!loom::nccl::device_available()) GTEST_SKIP() << "no GPU visible";
    if (!g_gpu) {
      loom::CommunicatorOptions options;
      options.timeout = std::chrono::seconds(60);
      options.on_error = loom::OnError::Raise;
      g_gpu = loom::nccl::make_communicator(g_runtime->world_comm(), device_index(), "gpu", options);
    }
    device_ = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index()));
  }
  at::Device device_{at::kCPU};
};

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    l1 = register_module("l1", torch::nn::Linear(32, 64));
    l2 = register_module("l2", torch::nn::Linear(64, 64));
    l3 = register_module("l3", torch::nn::Linear(64, 8));
  }
  at::Tensor forward(const at::Tensor& x) { return l3(torch::relu(l2(torch::relu(l1(x))))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace

TEST_F(CudaTraining, DataParallelOverNcclEqualsOneProcessOnTheWholeBatch) {
  const int R = g_gpu->size(), rank = g_gpu->rank();
  const int B = 16;
  for (int micro_batches : {1, 2}) {
    at::manual_seed(1);
    Mlp reference;
    reference->to(device_);
    at::manual_seed(1);
    Mlp local;
    local->to(device_);
    loom::ReducerOptions options;
    options.first_bucket_cap_bytes = 4096;
    options.bucket_cap_bytes = 8192;
    options.comm_hook = loom::comm_hooks::all_reduce_average();  // through NCCL even at one rank
    loom::DistributedDataParallel<Mlp> ddp(local, g_gpu, {options, true});
    torch::optim::SGD ddp_opt(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    loom::GradientAccumulator accumulate(ddp.reducer(), micro_batches);
    for (int step = 0; step < 5; ++step) {
      at::manual_seed(100 + step);
      at::Tensor x = at::randn({R * B, 32}).to(device_);
      at::Tensor y = at::randn({R * B, 8}).to(device_);
      ddp.zero_grad();
      const int micro = B / micro_batches;
      for (int m = 0; m < micro_batches; ++m) {
        auto scope = accumulate.next();
        auto xs = x.narrow(0, rank * B + m * micro, micro);
        auto ys = y.narrow(0, rank * B + m * micro, micro);
        (torch::mse_loss(ddp.forward(xs), ys) / micro_batches).backward();
      }
      ddp_opt.step();
      ref_opt.zero_grad();
      torch::mse_loss(reference->forward(x), y).backward();
      ref_opt.step();
    }
    EXPECT_GE(ddp.reducer().stats().buckets, 2u);
    EXPECT_GT(ddp.reducer().stats().buckets_reduced, 0u);
    auto a = ddp->parameters();
    auto b = reference->parameters();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(at::allclose(a[i], b[i], 1e-4, 1e-5)) << "parameter " << i << " micro_batches " << micro_batches;
  }
}

TEST_F(CudaTraining, ZeroStages1And2AndOverlappedGatherOverNcclEqualDdpOverNccl) {
  // ZeRO's in-place reduce-scatter and all-gather on the device communicator, the released
  // buckets of stage 2 on the caching allocator, the shard optimizer on CUDA: equal to DDP (Adam)
  // over the same communicator after 10 steps, each rank on its own batch. The third variant leaves
  // the all-gather running past step() (overlap_param_gather) and waits per layer: the wait must
  // order the compute stream after NCCL's, or the forward reads half-written parameters.
  const int rank = g_gpu->rank();
  auto train = [&](auto&& make_step, Mlp& net) {
    for (int step = 0; step < 10; ++step) {
      at::manual_seed(200 + 10 * step + rank);
      at::Tensor x = at::randn({8, 32}).to(device_), y = at::randn({8, 8}).to(device_);
      make_step(x, y);
    }
  };
  at::manual_seed(1);
  Mlp ddp_net;
  ddp_net->to(device_);
  loom::ReducerOptions options;
  options.first_bucket_cap_bytes = 4096;
  options.bucket_cap_bytes = 8192;
  options.comm_hook = loom::comm_hooks::all_reduce_average();  // through NCCL even at one rank
  loom::DistributedDataParallel<Mlp> ddp(ddp_net, g_gpu, {options, true});
  torch::optim::Adam ddp_opt(ddp->parameters(), torch::optim::AdamOptions(1e-2));
  train([&](const at::Tensor& x, const at::Tensor& y) {
    ddp.zero_grad();
    torch::mse_loss(ddp.forward(x), y).backward();
    ddp_opt.step();
  }, ddp_net);
  for (const auto& [stage, overlap] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    const std::string what = "stage " + std::to_string(stage) + (overlap ? " with overlapped gather" : "");
    at::manual_seed(1);
    Mlp net;
    net->to(device_);
    loom::ZeroOptions zero_options;
    zero_options.stage = stage;
    zero_options.first_bucket_cap_bytes = 4096;
    zero_options.bucket_cap_bytes = 8192;
    zero_options.overlap_param_gather = overlap;
    loom::ZeroOptimizer zero(net->parameters(), g_gpu, [](std::vector<at::Tensor> shard) {
      return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-2));
    }, zero_options);
    EXPECT_TRUE(zero.shard_parameters().front().is_cuda());
    train([&](const at::Tensor& x, const at::Tensor& y) {
      zero.zero_grad();
      zero.wait_parameters(*net->l1);  // returns at once without overlap
      at::Tensor h = torch::relu(net->l1(x));
      zero.wait_parameters(*net->l2);
      h = torch::relu(net->l2(h));
      zero.wait_parameters(*net->l3);
      torch::mse_loss(net->l3(h), y).backward();
      zero.step();
      if (overlap && g_gpu->size() > 1) EXPECT_GT(zero.unwaited_buckets(), 0u) << "step() left the gathers running";
    }, net);
    zero.wait_parameters();
    auto a = net->parameters(), b = ddp->parameters();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(at::allclose(a[i], b[i], 1e-4, 1e-5))
          << what << " parameter " << i << ": largest difference " << (a[i] - b[i]).abs().max().item<double>();
    if (g_gpu->size() > 1) EXPECT_GT(zero.stats().bytes_reduce_scattered, 0u);
  }
}

TEST_F(CudaTraining, ZeroBf16ParametersGetFp32MasterShardsOnTheDevice) {
  // bf16 parameters with fp32 master shards on the device: the masters are fp32 CUDA tensors, the
  // step casts them back into the parameters, and training moves them.
  const int rank = g_gpu->rank();
  at::manual_seed(1);
  Mlp half;
  half->to(device_, at::kBFloat16);
  const auto before = half->l1->weight.detach().clone();
  loom::ZeroOptimizer masters(half->parameters(), g_gpu, [](std::vector<at::Tensor> shard) {
    return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-2));
  }, {.stage = 2});
  EXPECT_TRUE(masters.has_master_weights(0));
  EXPECT_EQ(masters.shard_parameters().front().scalar_type(), at::kFloat);
  EXPECT_TRUE(masters.shard_parameters().front().is_cuda());
  for (int step = 0; step < 5; ++step) {
    at::manual_seed(300 + 10 * step + rank);
    at::Tensor x = at::randn({8, 32}).to(device_, at::kBFloat16), y = at::randn({8, 8}).to(device_, at::kBFloat16);
    masters.zero_grad();
    torch::mse_loss(half->forward(x), y).backward();
    masters.step();
  }
  EXPECT_GT((half->l1->weight - before).abs().max().item<double>(), 1e-3) << "bf16 parameters moved";
  EXPECT_GT(masters.memory().master_weights, 0);
}

TEST_F(CudaTraining, Fp16CompressionHookOnTheDevice) {
  at::manual_seed(2);
  std::vector<at::Tensor> params = {at::randn({64, 64}, device_).requires_grad_()};
  loom::ReducerOptions options;
  options.comm_hook = loom::comm_hooks::fp16_compress();
  loom::GradientReducer reducer(params, g_gpu, options);
  reducer.zero_grad();
  (params[0] * 0.5).sum().backward();
  EXPECT_TRUE(at::allclose(params[0].grad(), at::full({64, 64}, 0.5, params[0].options()), 1e-3, 1e-3));
}

TEST_F(CudaTraining, GradScalerWithFloat16AutocastSkipsOnOverflowAndLearns) {
  at::manual_seed(3);
  Mlp model;
  model->to(device_);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  loom::GradScaler scaler({.init_scale = 65536.0, .growth_interval = 50, .sync_groups = {g_gpu}});
  at::Tensor x = at::randn({256, 32}, device_);
  at::Tensor y = at::sin(x.narrow(1, 0, 8)).contiguous();
  double first = 0, last = 0;
  int skipped = 0;
  for (int step = 0; step < 150; ++step) {
    opt.zero_grad();
    at::Tensor loss;
    {
      loom::AutocastGuard autocast(at::kCUDA, at::kHalf);
      at::Tensor out = model->forward(x);
      EXPECT_EQ(out.scalar_type(), at::kHalf);
      loss = torch::mse_loss(out.to(at::kFloat), y);
    }
    // Step 10: a huge loss overflows float16 gradients -> the step must be skipped, scale halved.
    at::Tensor scaled = scaler.scale(step == 10 ? loss * 1e30 : loss);
    scaled.backward();
    const double before = scaler.get_scale();
    if (!scaler.step(opt)) {
      ++skipped;
      scaler.update();
      EXPECT_EQ(scaler.get_scale(), before * 0.5) << "step " << step;
      continue;
    }
    scaler.update();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_GE(skipped, 1);
  EXPECT_LT(last, 0.5 * first) << "float16 training with the scaler did not learn";
}

// A state loaded before the first scale() (the usual resume order) lands on the loss's device, so
// found-inf is read from the device, not from a non-blocking copy still in flight: an overflow is
// skipped and backs the scale off, every time, even while the stream is busy.
TEST_F(CudaTraining, GradScalerStateLoadedBeforeTheFirstScaleLivesOnTheDevice) {
  for (int trial = 0; trial < 20; ++trial) {
    loom::GradScaler scaler({.sync_groups = {g_gpu}});
    scaler.load_state_dict({{"scale", 1024.0}, {"growth_factor", 2.0}, {"backoff_factor", 0.5},
                            {"growth_interval", 100.0}, {"_growth_tracker", 3.0}});
    at::Tensor w = at::ones({256}, device_).requires_grad_();
    torch::optim::SGD opt({w}, 0.1);
    at::cuda::sleep(50'000'000);  // the stream is busy: a copy issued now lands late
    scaler.scale((w * 1e30).sum() * 1e30).backward();
    EXPECT_FALSE(scaler.step(opt)) << "trial " << trial << ": an overflowing step went through";
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0) << "trial " << trial;
    EXPECT_TRUE(at::all(w.eq(1)).item<bool>()) << "trial " << trial << ": the weights moved";
  }
}

TEST_F(CudaTraining, InitBuildsTheDeviceCommunicator) {
  // LOOM_NCCL=auto (the default) with a GPU visible: loom::init() made one over every rank, on the
  // device it chose (0 for a process that sees one GPU), and made that device current.
  auto gpu = g_runtime->device_comm();
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(g_runtime->cuda_device().has_value());
  EXPECT_EQ(gpu->device(), at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(*g_runtime->cuda_device())));
  EXPECT_EQ(c10::cuda::current_device(), *g_runtime->cuda_device());
  EXPECT_STREQ(gpu->backend(), "nccl");
  EXPECT_EQ(gpu->size(), g_runtime->world().size);
  at::Tensor t = at::ones({4}, device_);
  gpu->all_reduce(t)->wait();
  EXPECT_TRUE(at::all(t.eq(gpu->size())).item<bool>());
}

TEST_F(CudaTraining, TensorParallelLayersOverNcclMatchThePlainLayers) {
  // The NCCL group carries the region operations on the device (a group of one here; at N
  // ranks with one GPU each, the same code splits the weights N ways).
  const int64_t in = 32, hidden = 64 * g_gpu->size(), out = 16;
  // Master-weight initialisation straight onto the device: the plain layers' weights, split.
  loom::ColumnParallelLinearOptions column;
  column.initialization.mode = loom::ParallelInit::Mode::Master;
  column.initialization.device = device_;
  loom::RowParallelLinearOptions row;
  row.initialization = column.initialization;
  at::manual_seed(4);
  loom::ColumnParallelLinear fc1(in, hidden, g_gpu, column);
  loom::RowParallelLinear fc2(hidden, out, g_gpu, row);
  ASSERT_EQ(fc1->weight.device(), device_);
  at::manual_seed(4);
  torch::nn::Linear plain1(in, hidden), plain2(hidden, out);
  plain1->to(device_);
  plain2->to(device_);
  at::Tensor x = at::randn({8, in}, device_);
  at::Tensor y = fc2(at::gelu(fc1(x)));
  at::Tensor expected = plain2(at::gelu(plain1(x)));
  EXPECT_TRUE(at::allclose(y, expected, 1e-4, 1e-5));
  y.sum().backward();
  expected.sum().backward();
  EXPECT_TRUE(at::allclose(fc2->bias.grad(), plain2->bias.grad(), 1e-4, 1e-5));
  // Vocabulary-parallel cross-entropy on the device equals the plain one (the whole vocabulary
  // on one rank here).
  at::Tensor logits = at::randn({6, 10}, device_);
  at::Tensor target = at::randint(0, 10, {6}, at::TensorOptions().dtype(at::kLong).device(device_));
  at::Tensor loss = loom::vocab_parallel_cross_entropy(logits, target, g_gpu);
  EXPECT_TRUE(at::allclose(loss, torch::nn::functional::cross_entropy(logits, target), 1e-5, 1e-6));
}

TEST_F(CudaTraining, ParallelLayersForwardAndLossNeverSynchronizeTheHost) {
  // Sharded initialisation on the device from a CUDA RNG tracker, then the vocabulary-parallel
  // embedding, a column-parallel head and the vocabulary-parallel loss under CUDA's sync debug mode
  // set to error: any device-to-host synchronisation (an .item() range check, a blocking copy)
  // throws. The range checks that read the device run only under LOOM_CHECK_COLLECTIVES=1.
  const int64_t t = g_gpu->size(), vocab = 64 * t, hidden = 32;
  loom::RngTracker cuda_rng(device_);
  cuda_rng.add(loom::kModelParallelRngStream, 1234 + g_gpu->rank());
  loom::ParallelInit init;
  init.device = device_;
  init.rng = &cuda_rng;
  loom::VocabParallelEmbeddingOptions embedding_options;
  embedding_options.initialization = init;
  loom::ColumnParallelLinearOptions head_options;
  head_options.bias = false;
  head_options.initialization = init;
  loom::VocabParallelEmbedding embedding(vocab, hidden, g_gpu, embedding_options);
  loom::ColumnParallelLinear head(hidden, vocab, g_gpu, head_options);
  ASSERT_EQ(embedding->weight.device(), device_);
  const auto long_on_device = at::TensorOptions().dtype(at::kLong).device(device_);
  at::Tensor ids = at::randint(0, vocab, {16, 4}, long_on_device);
  at::Tensor target = at::randint(0, vocab, {16, 4}, long_on_device);
  auto step = [&] { return loom::vocab_parallel_cross_entropy(head(embedding(ids)), target, g_gpu); };
  step();  // first calls may set up handles and caches
  torch::cuda::synchronize();
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  try {
    at::Tensor loss = step();
  } catch (const std::exception& e) {
    error = e.what();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(error, "") << "the forward or the loss synchronised the host with the device";
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--exit-without-finalize") {
    auto rt = loom::init();
    if (!rt->device_comm()) return 3;
    at::Tensor t = at::ones({1024}, at::TensorOptions().device(rt->device_comm()->device()));
    rt->device_comm()->all_reduce(t)->synchronize();
    return t.sum().item<float>() == 1024.0f * rt->world().size ? 0 : 4;  // no loom::finalize()
  }
  ::testing::InitGoogleTest(&argc, argv);
  g_runtime = loom::init();
  const int result = RUN_ALL_TESTS();
  g_gpu.reset();
  g_runtime.reset();
  loom::finalize();
  return result;
}
