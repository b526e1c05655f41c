// loom::GradScaler: torch.amp.GradScaler's state machine (READY -> UNSCALED -> STEPPED per
// optimizer, reset by update()), with found-inf agreed across the parallel groups.
#include "loom/amp/grad_scaler.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>

#include "loom/error.h"

namespace loom {

GradScaler::GradScaler(GradScalerOptions options) : options_(std::move(options)) {
  if (!options_.enabled) return;
  if (!(options_.growth_factor > 1.0))
    throw InvalidArgumentError(where("GradScaler") + ": growth_factor must be > 1.0, found " +
                               std::to_string(options_.growth_factor));
  if (!(options_.backoff_factor < 1.0 && options_.backoff_factor > 0.0))
    throw InvalidArgumentError(where("GradScaler") + ": backoff_factor must be in (0, 1), found " +
                               std::to_string(options_.backoff_factor));
  if (options_.growth_interval < 1)
    throw InvalidArgumentError(where("GradScaler") + ": growth_interval must be at least 1, found " +
                               std::to_string(options_.growth_interval));
  if (!(options_.init_scale > 0.0))
    throw InvalidArgumentError(where("GradScaler") + ": init_scale must be positive, found " +
                               std::to_string(options_.init_scale));
}

std::string GradScaler::where(const char* call) const { return ErrorContext(std::string("GradScaler.") + call).prefix(); }

void GradScaler::lazy_init(const at::Device& device) {
  if (scale_.defined()) return;
  scale_ = at::full({1}, options_.init_scale, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  if (pending_state_) {
    scale_.fill_(pending_state_->first);
    growth_tracker_.fill_(pending_state_->second);
    pending_state_.reset();
  }
}

void GradScaler::set_state(double scale, int64_t growth_tracker) {
  if (!scale_.defined()) {
    // Not created yet: on the first scale()'s device (a CPU tensor here would make every CUDA
    // step read found-inf through a copy).
    pending_state_ = {scale, growth_tracker};
    return;
  }
  scale_.fill_(scale);
  growth_tracker_.fill_(growth_tracker);
}

void GradScaler::scaled_by_another_rank(const at::Device& device) {
  if (options_.enabled) lazy_init(device);
}

at::Tensor GradScaler::scale(const at::Tensor& output) {
  if (!output.defined()) throw InvalidArgumentError(where("scale") + ": expected a defined tensor (the loss), found none");
  if (!output.is_floating_point())
    throw InvalidArgumentError(where("scale") + ": expected a floating-point loss, found " +
                               c10::toString(output.scalar_type()));
  if (!options_.enabled) return output;
  lazy_init(output.device());
  return output * scale_.to(output.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const auto& o : outputs) scaled.push_back(scale(o));
  return scaled;
}

GradScaler::PerOptimizer& GradScaler::state_of(const void* optimizer) { return per_optimizer_[optimizer]; }

namespace {

// A value as saved, in full (std::to_string writes 1e-320 as 0.000000).
std::string to_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}
std::vector<at::Tensor> defined_grads(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups())
    for (auto& param : group.params())
      if (param.grad().defined()) grads.push_back(param.grad());
  return grads;
}
}  // namespace

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  unscale_(&optimizer, defined_grads(optimizer));
}

void GradScaler::unscale_(const void* optimizer, const std::vector<at::Tensor>& gradients,
                          Communicator* shard_group) {
  if (!options_.enabled) return;
  PerOptimizer& state = state_of(optimizer);
  if (state.stage == Stage::Unscaled)
    throw InvalidArgumentError(where("unscale_") +
                               ": unscale_() has already been called on this optimizer since the last update()");
  if (state.stage == Stage::Stepped)
    throw InvalidArgumentError(where("unscale_") + ": unscale_() is being called after step() (expected before it)");
  if (!scale_.defined())
    throw InvalidArgumentError(where("unscale_") + ": no loss was scaled yet: call scale(loss).backward() first");

  // Group gradients by (device, dtype): one fused kernel per group.
  std::map<std::tuple<int, int, int>, std::vector<at::Tensor>> groups;
  for (const at::Tensor& grad : gradients) {
    if (!grad.defined()) continue;
    if (grad.scalar_type() == at::kHalf)
      throw InvalidArgumentError(where("unscale_") +
                                 ": attempting to unscale float16 gradients (expected float32 master parameters; "
                                 "keep the parameters in float32 and let autocast run the math in float16)");
    if (grad.is_sparse())
      throw InvalidArgumentError(where("unscale_") + ": sparse gradients are not supported");
    groups[{static_cast<int>(grad.device().type()), grad.device().index(), static_cast<int>(grad.scalar_type())}]
        .push_back(grad);
  }
  if (groups.empty())
    throw InvalidArgumentError(where("unscale_") +
                               ": no inf checks were recorded for this optimizer: none of its parameters has a "
                               "gradient (call backward() before step())");

  // The reciprocal in double, as PyTorch does, so 1/scale is exact for powers of two.
  at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  at::Tensor found = at::zeros({1}, scale_.options());
  for (auto& [key, grads] : groups) {
    const at::Device device = grads.front().device();
    if (device == found.device()) {
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale);
      continue;
    }
    at::Tensor device_found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, device_found, inv_scale.to(device));
    // Blocking: a non-blocking device-to-host copy lands in pinned memory later than add_ reads it.
    found.add_(device_found.to(found.device()));
  }
  // Every rank that shards or still holds different gradients must agree on skipping: the flag
  // travels on each group's own device (a device communicator takes only its GPU's tensors).
  std::vector<Communicator*> agree_over;
  for (const auto& group : options_.sync_groups) agree_over.push_back(group.get());
  if (shard_group) agree_over.push_back(shard_group);
  for (Communicator* group : agree_over) {
    if (!group || group->size() == 1) continue;
    const bool same_device = group->device() == found.device();
    at::Tensor flag = same_device ? found : found.to(group->device());
    group->all_reduce(flag, {ReduceOp::Max})->wait();
    if (!same_device) found.copy_(flag);
  }
  state.found_inf = found;
  state.stage = Stage::Unscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  const bool unscaled = !options_.enabled || state_of(&optimizer).stage != Stage::Ready;
  return step(&optimizer, unscaled ? std::vector<at::Tensor>{} : defined_grads(optimizer), [&] { optimizer.step(); });
}

bool GradScaler::step(const void* optimizer, const std::vector<at::Tensor>& grads,
                      const std::function<void()>& optimizer_step, Communicator* shard_group) {
  if (!options_.enabled) {
    optimizer_step();
    return true;
  }
  PerOptimizer& state = state_of(optimizer);
  if (state.stage == Stage::Stepped)
    throw InvalidArgumentError(where("step") + ": step() has already been called since the last update()");
  if (state.stage == Stage::Ready) unscale_(optimizer, grads, shard_group);
  // The step's one host synchronisation: whether to run the optimizer at all.
  const bool skip = state.found_inf.item<float>() != 0.0f;
  if (!skip) optimizer_step();
  state.stage = Stage::Stepped;
  return !skip;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  if (!scale_.defined())
    throw InvalidArgumentError(where("update") + ": no loss was scaled yet: nothing to update");
  at::Tensor found_combined;
  for (auto& [optimizer, state] : per_optimizer_) {
    if (!state.found_inf.defined()) continue;
    at::Tensor f = state.found_inf.to(scale_.device(), true);
    found_combined = found_combined.defined() ? found_combined + f : f.clone();
  }
  if (!found_combined.defined())
    throw InvalidArgumentError(where("update") +
                               ": no inf checks were recorded prior to update() (call step() or unscale_() first)");
  at::_amp_update_scale_(scale_, growth_tracker_, found_combined, options_.growth_factor, options_.backoff_factor,
                         options_.growth_interval);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  if (!(new_scale > 0.0) || !std::isfinite(new_scale))
    throw InvalidArgumentError(where("update") + ": new_scale must be a positive finite number, found " +
                               std::to_string(new_scale));
  set_state(new_scale, get_growth_tracker());
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  if (scale_.defined()) return scale_.item<float>();
  // As torch.amp.GradScaler before its first scale(): the value as given.
  return pending_state_ ? pending_state_->first : options_.init_scale;
}

int64_t GradScaler::get_growth_tracker() const {
  if (!options_.enabled) return 0;
  if (growth_tracker_.defined()) return growth_tracker_.item<int>();
  return pending_state_ ? pending_state_->second : 0;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(get_growth_tracker())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled) return;
  if (state.empty())
    throw InvalidArgumentError(where("load_state_dict") +
                               ": the state dict is empty, possibly because it was saved from a disabled GradScaler");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    if (!state.count(key))
      throw InvalidArgumentError(where("load_state_dict") + ": missing key '" + key +
                                 "' (expected scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)");
  const double scale = state.at("scale"), growth = state.at("growth_factor"), backoff = state.at("backoff_factor");
  const double interval = state.at("growth_interval"), tracker = state.at("_growth_tracker");
  auto bad = [&](const std::string& what) { return InvalidArgumentError(where("load_state_dict") + ": " + what); };
  // The scale lives in a float32 tensor (as in PyTorch): a double beyond float32's range cannot,
  // and one too small for it would become 0 there.
  if (!(scale > 0) || !(scale <= std::numeric_limits<float>::max()) || !(static_cast<float>(scale) > 0))
    throw bad("scale must be positive and within float32's range (at most " +
              std::to_string(std::numeric_limits<float>::max()) + ", not rounding to 0), found " + to_text(scale));
  if (!(growth > 1) || !std::isfinite(growth))
    throw bad("growth_factor must be > 1.0 and finite, found " + to_text(growth));
  if (!(backoff > 0 && backoff < 1)) throw bad("backoff_factor must be in (0, 1), found " + to_text(backoff));
  // At most 2^53: every integer up to it is exact in a double, and it fits the int64 it becomes.
  if (!(interval >= 1) || !(interval <= 9007199254740992.0) || interval != std::floor(interval))
    throw bad("growth_interval must be an integer in [1, 2^53], found " + to_text(interval));
  if (!(tracker >= 0) || tracker != std::floor(tracker) || tracker >= interval)
    throw bad("_growth_tracker must be an integer in [0, growth_interval), found " + to_text(tracker));
  options_.init_scale = scale;
  options_.growth_factor = growth;
  options_.backoff_factor = backoff;
  options_.growth_interval = static_cast<int64_t>(interval);
  set_state(scale, static_cast<int64_t>(tracker));
}

}  // namespace loom
