// Fully sharded checkpoints in the plain format: saved by FullyShardedDataParallel over N ranks and
// resumed by it over N/2 (whose shards cut the parameters elsewhere), by DDP, and by ZeRO; and DDP's
// and ZeRO's checkpoints resumed by it. Each resumed run must equal the uninterrupted one to 1e-6.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>

#include <torch/nn.h>
#include <torch/optim.h>

#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fully_shard.h"
#include "loom/parallel/zero.h"
#include "loom/train/checkpoint.h"
#include "shard_net.h"
#include "test_optimizers.h"
#include "test_util.h"

using namespace loom;

namespace {

// Step s's global batch of 8 samples, its rows split evenly over the group's ranks: the same global
// step at 1, 2 or 4 ranks.
std::pair<at::Tensor, at::Tensor> rows_of_global_batch(int step, const Communicator& group) {
  at::manual_seed(40000 + step);
  at::Tensor x = at::randn({8, 12}), y = at::randn({8, 4});
  const int64_t rows = 8 / group.size();
  return {x.narrow(0, group.rank() * rows, rows), y.narrow(0, group.rank() * rows, rows)};
}

enum class Method { FullyShard, FullyShardBf16, Ddp, Zero };
const char* method_name(Method m) {
  switch (m) {
    case Method::FullyShard: return "fully sharded";
    case Method::FullyShardBf16: return "fully sharded (bf16 compute)";
    case Method::Ddp: return "DDP";
    case Method::Zero: return "ZeRO stage 2";
  }
  return "?";
}

// ShardNet trained with Adam by one method over a group, registered with a checkpointer as that
// method's users do it.
class Trainer {
 public:
  Trainer(Method method, std::shared_ptr<Communicator> group, int seed) : group_(std::move(group)) {
    at::manual_seed(seed);
    net_ = test::ShardNet();
    auto adam = [](std::vector<at::Tensor> p) { return test::make(test::Opt::Adam, std::move(p)); };
    switch (method) {
      case Method::FullyShard:
      case Method::FullyShardBf16: {
        FullyShardOptions options;
        if (method == Method::FullyShardBf16) options.param_dtype = at::kBFloat16;
        fsdp_ = std::make_unique<FullyShardedDataParallel>(*net_, test::units_of(net_), group_, adam, options);
        break;
      }
      case Method::Ddp:
        reducer_ = std::make_unique<GradientReducer>(net_->parameters(), group_);
        optimizer_ = adam(net_->parameters());
        break;
      case Method::Zero:
        zero_ = std::make_unique<ZeroOptimizer>(net_->parameters(), group_, adam);
        break;
    }
  }

  void steps(int from, int to) {
    for (int s = from; s < to; ++s) {
      auto [x, y] = rows_of_global_batch(s, *group_);
      if (fsdp_) {
        fsdp_->zero_grad();
        torch::mse_loss(test::sharded_forward(*fsdp_, net_, x.to(net_->in->weight.scalar_type())).to(at::kFloat), y)
            .backward();
        fsdp_->step();
      } else if (zero_) {
        zero_->zero_grad();
        torch::mse_loss(net_(x), y).backward();
        zero_->step();
      } else {
        reducer_->zero_grad();
        torch::mse_loss(net_(x), y).backward();
        optimizer_->step();
      }
    }
  }

  void register_with(Checkpointer& ckpt, bool with_the_model = true) {
    if (with_the_model) ckpt.model(*net_);
    if (fsdp_) ckpt.optimizer(*fsdp_);
    if (zero_) ckpt.optimizer(*zero_);
    if (optimizer_) ckpt.optimizer(*optimizer_);
  }

  // The whole parameters (fully sharded: as the fp32 shards hold them).
  std::vector<at::Tensor> parameters() {
    std::vector<at::Tensor> out;
    if (fsdp_) {
      std::vector<at::Tensor> whole;
      for (const auto& p : fsdp_->parameters()) whole.push_back(at::empty(p.sizes(), at::kFloat));
      const auto shards = fsdp_->shard_parameters();
      for (size_t u = 0; u < shards.size(); ++u) {
        at::Tensor full = at::empty({shards[u].numel() * group_->size()}, shards[u].options());
        group_->all_gather(full, shards[u])->wait();
        for (size_t i = 0; i < whole.size(); ++i)
          if (fsdp_->placements()[i].bucket == u)
            whole[i].copy_(full.narrow(0, fsdp_->placements()[i].offset, whole[i].numel()).view(whole[i].sizes()));
      }
      return whole;
    }
    if (zero_) zero_->wait_parameters();
    for (auto& p : net_->parameters()) out.push_back(p.detach().clone());
    return out;
  }

 private:
  std::shared_ptr<Communicator> group_;
  test::ShardNet net_{nullptr};
  std::unique_ptr<FullyShardedDataParallel> fsdp_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<ZeroOptimizer> zero_;
};

struct Resume {
  Method saved_by;
  Method resumed_by;
  bool at_half_size;  // resumed over half the ranks: the shards cut the parameters elsewhere
};

void expect_resume_equals_the_uninterrupted_run(const Resume& r, const std::vector<at::Tensor>& want) {
  auto world = test::world();
  const std::string what = std::string(method_name(r.saved_by)) + " -> " + method_name(r.resumed_by) +
                           (r.at_half_size ? " at half the ranks" : "");
  const std::string dir = test::shared_dir("fully_sharded_resume");
  {
    Trainer saving(r.saved_by, world, 3);
    saving.steps(0, 10);
    Checkpointer ckpt(world, {.directory = dir, .async = false});
    saving.register_with(ckpt);
    ckpt.save({.step = 10});
  }
  if (auto group = r.at_half_size ? test::first_half_of_the_world() : world) {
    Trainer resumed(r.resumed_by, group, 99);  // other weights: all must come from the checkpoint
    Checkpointer ckpt(group, {.directory = dir});
    resumed.register_with(ckpt);
    ASSERT_TRUE(ckpt.load_latest().has_value()) << what;
    resumed.steps(10, 20);
    const auto got = resumed.parameters();
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      const double diff = (got[i] - want[i]).abs().max().item<double>();
      EXPECT_LE(diff, 1e-6) << what << ": parameter " << i << " differs from the uninterrupted run's by " << diff;
    }
  }
  test::cleanup(dir);
}

}  // namespace

TEST(FullyShardCheckpoint, ResumesAtAnotherSizeAndToAndFromDdpAndZeroAsTheUninterruptedRun) {
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  Trainer uninterrupted(Method::FullyShard, test::world(), 3);
  uninterrupted.steps(0, 20);
  const auto want = uninterrupted.parameters();
  for (const Resume& r : {Resume{Method::FullyShard, Method::FullyShard, true},
                          Resume{Method::FullyShard, Method::Ddp, false}, Resume{Method::Ddp, Method::FullyShard, false},
                          Resume{Method::FullyShard, Method::Zero, true}, Resume{Method::Zero, Method::FullyShard, true}})
    expect_resume_equals_the_uninterrupted_run(r, want);
}

TEST(FullyShardCheckpoint, Bf16ComputeResumesFromItsFp32ShardsAsTheUninterruptedRun) {
  // Computing in bf16 (param_dtype), the shards hold the fp32 parameters the optimizer steps: the
  // checkpoint must keep them in fp32, not as the bf16 copies the module computes with. (At the same
  // size: bf16 matmuls over other rows would round otherwise.)
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  Trainer uninterrupted(Method::FullyShardBf16, test::world(), 3);
  uninterrupted.steps(0, 20);
  expect_resume_equals_the_uninterrupted_run({Method::FullyShardBf16, Method::FullyShardBf16, false},
                                             uninterrupted.parameters());
}

TEST(FullyShardCheckpoint, WithoutTheModelSaveAndLoadAreRefusedByNameChangingNothing) {
  // The parameters and their state are saved and found by the model's parameter names.
  if (test::gloo_bootstrap()) GTEST_SKIP() << "checkpoints are tested under mpirun";
  auto world = test::world();
  const std::string dir = test::shared_dir("fully_sharded_no_model");
  Trainer trainer(Method::FullyShard, world, 3);
  trainer.steps(0, 2);
  {
    Checkpointer ckpt(world, {.directory = dir, .async = false});
    trainer.register_with(ckpt, /*with_the_model=*/false);
    test::expect_contains(test::rejection([&] { ckpt.save({.step = 2}); }),
                          "the fully sharded state is saved by parameter name: register the model too");
    Checkpointer complete(world, {.directory = dir, .async = false});
    trainer.register_with(complete);
    complete.save({.step = 2});
  }
  trainer.steps(2, 3);
  const auto before = trainer.parameters();
  Checkpointer ckpt(world, {.directory = dir});
  trainer.register_with(ckpt, /*with_the_model=*/false);
  test::expect_contains(test::rejection([&] { ckpt.load_latest(); }),
                        "the fully sharded state is loaded by parameter name: register the model too");
  const auto after = trainer.parameters();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(after[i].equal(before[i])) << "parameter " << i << " changed";
  test::cleanup(dir);
}
