// GradScaler across ranks: an inf/NaN seen by one rank, or by one tensor-parallel shard, makes
// every rank skip the step, and the scale stays identical everywhere.
#include <gtest/gtest.h>
#include <torch/optim.h>

#include "loom/amp/grad_scaler.h"
#include "loom/comm/groups.h"
#include "loom/parallel/data_parallel.h"
#include "loom/train/accumulation.h"
#include "test_util.h"

using namespace loom;

namespace {

// One step on a 4-element parameter whose gradient is `grad` (before scaling). Returns whether
// the optimizer stepped.
bool scaled_step(GradScaler& scaler, at::Tensor& param, torch::optim::SGD& opt, const at::Tensor& grad) {
  opt.zero_grad();
  scaler.scale((param * grad).sum()).backward();
  bool stepped = scaler.step(opt);
  scaler.update();
  return stepped;
}

// Every rank's value of x, gathered.
at::Tensor gather_value(Communicator& comm, double x) {
  at::Tensor all = at::empty({comm.size()}, at::kDouble);
  comm.all_gather(all, at::full({1}, x, at::kDouble))->wait();
  return all;
}

}  // namespace

TEST(GradScalerDistributed, InfOnOneRankMakesEveryRankSkip) {
  auto comm = test::world();
  at::Tensor param = at::ones({4}).requires_grad_();
  torch::optim::SGD opt({param}, 0.1);
  GradScaler scaler({.init_scale = 256.0, .growth_interval = 2, .sync_groups = {comm}});
  for (int step = 0; step < 6; ++step) {
    at::Tensor grad = at::full({4}, 0.5);
    const bool poisoned = step == 2 || step == 3;
    if (poisoned && comm->rank() == comm->size() - 1) grad[1] = step == 2 ? INFINITY : NAN;
    at::Tensor before = param.detach().clone();
    bool stepped = scaled_step(scaler, param, opt, grad);
    EXPECT_EQ(stepped, !poisoned) << "step " << step;
    EXPECT_EQ(at::equal(before, param.detach()), poisoned) << "step " << step;
    at::Tensor scales = gather_value(*comm, scaler.get_scale());
    EXPECT_TRUE(at::all(scales.eq(scales[0])).item<bool>()) << "scales differ: " << scales;
  }
  // 256 -> grows to 512 after 2 clean steps -> two skips halve it twice -> 128 -> 256 after 2 more.
  EXPECT_EQ(scaler.get_scale(), 256.0);
}

TEST(GradScalerDistributed, InfOnOneTensorParallelShardSkipsTheWholeModel) {
  auto comm = test::world();
  if (comm->size() % 2) GTEST_SKIP() << "needs an even number of ranks";
  auto groups = make_parallel_groups(*comm, 2);
  at::Tensor shard = at::ones({4}).requires_grad_();  // this rank's slice of a TP-sharded weight
  torch::optim::SGD opt({shard}, 0.1);
  // The shards of one TP group hold different gradients: agree over TP; DP replicas already
  // hold identical gradients (after their all-reduce), so TP is enough — every replica's shard
  // 1 sees the same inf.
  GradScaler scaler({.sync_groups = {groups.tensor_parallel}});
  at::Tensor grad = at::full({4}, 0.25);
  if (groups.tp_rank == 1) grad[3] = INFINITY;
  EXPECT_FALSE(scaled_step(scaler, shard, opt, grad));
  EXPECT_TRUE(at::equal(shard.detach(), at::ones({4})));
  at::Tensor scales = gather_value(*comm, scaler.get_scale());
  EXPECT_TRUE(at::all(scales.eq(32768.0)).item<bool>()) << scales;
  // A clean step afterwards runs everywhere.
  EXPECT_TRUE(scaled_step(scaler, shard, opt, at::full({4}, 0.25)));
}

TEST(GradScalerDistributed, WithDataParallelAndAccumulationTheUpdateIsExact) {
  // Power-of-two scales make scaling and unscaling exact, so DDP + accumulation + GradScaler
  // must give the very weights of DDP + accumulation alone (the reducer has finished its
  // reductions when backward returns, so the scaler needs no hand-off from it).
  auto comm = test::world();
  auto run = [&](bool with_scaler) {
    at::manual_seed(11);
    std::vector<at::Tensor> params = {(at::randn({6, 3}) * 0.5).requires_grad_(), at::zeros({3}).requires_grad_()};
    GradientReducer reducer(params, comm);
    torch::optim::SGD opt(params, 0.1);
    GradScaler scaler({.enabled = with_scaler, .sync_groups = {comm}});
    GradientAccumulator accumulate(reducer, 2);
    for (int step = 0; step < 4; ++step) {
      reducer.zero_grad();
      for (int m = 0; m < 2; ++m) {
        at::manual_seed(100 * step + 10 * m + comm->rank());
        at::Tensor x = at::randn({4, 6});
        auto scope = accumulate.next();
        at::Tensor loss = (x.mm(params[0]) + params[1]).pow(2).mean() / 2;
        scaler.scale(loss).backward();
      }
      scaler.step(opt);
      scaler.update();
    }
    return params;
  };
  auto plain = run(false);
  auto scaled = run(true);
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(at::equal(plain[i].detach(), scaled[i].detach())) << "parameter " << i;
}
