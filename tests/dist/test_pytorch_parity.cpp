// loom::DistributedDataParallel against PyTorch's own DistributedDataParallel (Gloo), on the model
// a new user tries first: a conv net with BatchNorm, an auxiliary branch used on some steps only,
// a frozen parameter, AdamW, two micro-batches per step. The reference is generated in this test
// run by the installed torch (tests/python/ddp_reference.py, a CTest fixture) at the same number
// of ranks; every rank must end with PyTorch's parameters and its own rank's buffers (BatchNorm
// statistics: broadcast before the first micro-batch of a step, as PyTorch does).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/parallel/data_parallel.h"
#include "loom/train/accumulation.h"
#include "test_util.h"

using namespace loom;

namespace {

struct ConvAuxNetImpl : torch::nn::Module {
  ConvAuxNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(8));
    head = register_module("head", torch::nn::Linear(8 * 6 * 6, 10));
    aux = register_module("aux", torch::nn::Linear(8 * 6 * 6, 10));
  }
  at::Tensor forward(const at::Tensor& x, bool use_aux) {
    at::Tensor h = torch::relu(bn(conv(x))).flatten(1);
    at::Tensor out = head(h);
    return use_aux ? out + aux(h) : out;
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear head{nullptr}, aux{nullptr};
};
TORCH_MODULE(ConvAuxNet);

bool uses_aux(int step, int rank) { return step != 5 && (step + rank) % 2 == 0; }

at::Tensor from_json(const nlohmann::json& values, const at::Tensor& like) {
  std::vector<double> v = values.get<std::vector<double>>();
  return at::tensor(v, at::kDouble).reshape(like.sizes()).to(like.scalar_type());
}

}  // namespace

TEST(PyTorchParity, DataParallelWithBatchNormFrozenParameterUnusedBranchAndAccumulation) {
  auto comm = test::world();
  const char* path = std::getenv("TORCHLOOM_TEST_DDP_REFERENCE");
  if (comm->size() == 1 || path == nullptr) GTEST_SKIP() << "the reference is generated for 2 and 4 ranks";
  std::ifstream file(path);
  ASSERT_TRUE(file.good()) << path;
  const nlohmann::json ref = nlohmann::json::parse(file);
  ASSERT_EQ(ref["world"].get<int>(), comm->size());
  const nlohmann::json& mine = ref["ranks"][comm->rank()];

  ConvAuxNet net;
  net->conv->bias.set_requires_grad(false);  // frozen
  {
    at::NoGradGuard no_grad;
    for (auto& item : net->named_parameters()) item.value().copy_(from_json(mine["initial"][item.key()], item.value()));
    for (auto& item : net->named_buffers()) item.value().copy_(from_json(mine["initial"][item.key()], item.value()));
  }
  ReducerOptions reducer;
  reducer.find_unused_parameters = true;
  DistributedDataParallel<ConvAuxNet> ddp(net, comm, {reducer, /*broadcast_buffers=*/true});
  std::vector<at::Tensor> trainable;
  for (auto& p : net->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(ref["lr"].get<double>())
                                         .weight_decay(ref["weight_decay"].get<double>()));
  const int steps = ref["steps"], micro_batches = ref["micro_batches"], batch = ref["batch"];
  GradientAccumulator accumulate(ddp.reducer(), micro_batches);
  for (int step = 0; step < steps; ++step) {
    ddp.zero_grad();
    for (int micro = 0; micro < micro_batches; ++micro) {
      torch::manual_seed(1000 * step + 10 * micro + comm->rank());
      at::Tensor x = torch::randn({batch, 3, 8, 8});
      at::Tensor y = torch::randn({batch, 10});
      auto scope = accumulate.next();
      ((ddp.forward(x, uses_aux(step, comm->rank())) - y).pow(2).mean() / micro_batches).backward();
    }
    opt.step();
  }

  for (auto& item : net->named_parameters()) {
    at::Tensor expected = from_json(mine["parameters"][item.key()], item.value());
    EXPECT_TRUE(at::allclose(item.value(), expected, 1e-4, 1e-5))
        << "parameter " << item.key() << ": max difference " << (item.value() - expected).abs().max().item<double>();
  }
  for (auto& item : net->named_buffers()) {
    at::Tensor expected = from_json(mine["buffers"][item.key()], item.value());
    EXPECT_TRUE(at::allclose(item.value().to(at::kDouble), expected.to(at::kDouble), 1e-4, 1e-5))
        << "buffer " << item.key() << " on rank " << comm->rank() << ": max difference "
        << (item.value().to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>();
  }
}
