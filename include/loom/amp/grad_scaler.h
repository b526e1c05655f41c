// Dynamic loss scaling for mixed-precision training, with torch.amp.GradScaler's semantics step
// for step, and aware of parallel groups.
//
//   loom::GradScaler scaler({.sync_groups = {groups.tensor_parallel}});
//   for (...) {
//     opt.zero_grad();
//     at::Tensor loss;
//     { loom::AutocastGuard autocast(at::kCUDA, at::kHalf); loss = loss_fn(model(x), y); }
//     scaler.scale(loss).backward();
//     scaler.step(opt);      // unscales; skips opt.step() when any gradient is inf/NaN on any rank
//     scaler.update();       // backs off after a skip, grows after growth_interval clean steps
//   }
//
// Unscaling uses LibTorch's fused kernels over all gradients of a device and dtype at once
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_). The found-inf flag is
// all-reduced (MAX) over `sync_groups` — the groups that shard the gradients (tensor parallel)
// or still hold different gradients — so every rank steps or skips together and the scale
// stays identical everywhere. At most one host synchronisation per step (reading the flag).
// The scale lives on the device of the first loss scaled; a state loaded (load_state_dict,
// update(new_scale)) before that is applied there, as torch.amp.GradScaler does.
#pragma once

#include <ATen/core/Tensor.h>

#include <concepts>
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"

namespace torch::optim {
class Optimizer;
}

namespace loom {

// An optimizer whose gradients are sharded over a group (loom::ZeroOptimizer, loom/parallel/zero.h):
// shard_gradients() are this rank's shards, group() the communicator they are sharded over. The
// scaler knows it by these calls only, as PyTorch keeps its sharded scaler with FSDP: amp sees no
// optimizer wrapper of the layers above it.
template <typename T>
concept ShardedOptimizer = requires(T& optimizer) {
  { optimizer.shard_gradients() } -> std::convertible_to<std::vector<at::Tensor>>;
  { optimizer.group() } -> std::convertible_to<Communicator&>;
  optimizer.step();
};

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
  // found-inf is all-reduced (MAX) over each of these groups, on each group's own device.
  std::vector<std::shared_ptr<Communicator>> sync_groups;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // outputs * scale (as is when disabled). The scale lives on the first output's device.
  at::Tensor scale(const at::Tensor& output);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);
  // For a rank whose gradients another rank's scale(loss) scaled (a pipeline stage before the last,
  // which receives scaled gradients and never sees the loss): keeps the scale on `device` so that
  // unscale_, step and update run here as on the rank that scaled. Every stage's scaler starts from
  // the same options and agrees on found-inf (its sync groups include the pipeline), so the scales
  // stay equal.
  //   if (!pipeline.holds_last_stage()) scaler.scaled_by_another_rank(device);
  void scaled_by_another_rank(const at::Device& device);

  // Divides the optimizer's gradients by the scale in place and records whether any is inf/NaN.
  // At most once per optimizer between update()s; loom::InvalidArgumentError otherwise.
  void unscale_(torch::optim::Optimizer& optimizer);
  // Unscales (if not done yet) and runs optimizer.step() unless a gradient was inf/NaN on any
  // rank of the sync groups. Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // The same two calls for an optimizer LibTorch does not know (a Python one): `optimizer` only
  // identifies it, `grads` are its parameters' defined gradients, `optimizer_step` runs its step.
  // Gradients sharded over a group name it as `shard_group`: found-inf is agreed over it too.
  void unscale_(const void* optimizer, const std::vector<at::Tensor>& grads, Communicator* shard_group = nullptr);
  bool step(const void* optimizer, const std::vector<at::Tensor>& grads, const std::function<void()>& optimizer_step,
            Communicator* shard_group = nullptr);
  // The same for ZeRO (loom/parallel/zero.h): its gradients are this rank's shards, so found-inf is
  // agreed over its group as well as the sync groups, and a skipped step skips every shard.
  //   scaler.unscale_(zero); zero.clip_grad_norm(1.0); scaler.step(zero); scaler.update();
  template <ShardedOptimizer Sharded>
  void unscale_(Sharded& optimizer) {
    unscale_(&optimizer, optimizer.shard_gradients(), &optimizer.group());
  }
  template <ShardedOptimizer Sharded>
  bool step(Sharded& optimizer) {
    return step(optimizer, [&optimizer] { optimizer.step(); });
  }
  // For a ZeroOptimizer without an optimizer of its own: `step_shards` steps it (begin_step(), the
  // held optimizer's step, gather_parameters()).
  template <ShardedOptimizer Sharded>
  bool step(Sharded& optimizer, const std::function<void()>& step_shards) {
    return step(&optimizer, optimizer.shard_gradients(), step_shards, &optimizer.group());
  }
  // Adjusts the scale from this step's found-inf flags (back off, or grow after growth_interval
  // clean steps) and starts the next step.
  void update();
  void update(double new_scale);

  double get_scale() const;
  bool is_enabled() const { return options_.enabled; }
  double get_growth_factor() const { return options_.growth_factor; }
  double get_backoff_factor() const { return options_.backoff_factor; }
  int64_t get_growth_interval() const { return options_.growth_interval; }
  int64_t get_growth_tracker() const;
  // As torch.amp.GradScaler's setters: take effect at the next update().
  void set_growth_factor(double factor) { options_.growth_factor = factor; }
  void set_backoff_factor(double factor) { options_.backoff_factor = factor; }
  void set_growth_interval(int64_t interval) { options_.growth_interval = interval; }

  // {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}, as
  // torch.amp.GradScaler.state_dict(); empty when disabled.
  std::map<std::string, double> state_dict() const;
  // Throws loom::InvalidArgumentError for an empty, incomplete or out-of-range dict.
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    at::Tensor found_inf;  // agreed over the sync groups; on the scale's device
  };

  void lazy_init(const at::Device& device);
  // Sets the scale and growth tracker, now or (before the first scale()) when they are created.
  void set_state(double scale, int64_t growth_tracker);
  PerOptimizer& state_of(const void* optimizer);
  std::string where(const char* call) const;

  GradScalerOptions options_;
  at::Tensor scale_;           // float32 [1]
  at::Tensor growth_tracker_;  // int32 [1]
  // A state set before the first scale(): applied on the loss's device by lazy_init.
  std::optional<std::pair<double, int64_t>> pending_state_;
  std::map<const void*, PerOptimizer> per_optimizer_;
};

}  // namespace loom
