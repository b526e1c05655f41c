// The small pieces of a training run's state: the grad scaler ("scaler" section), the RNG
// generators and tracker streams (rng/rank<r>/...), and the accumulation window ("accumulation").
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <cstdio>
#include <mutex>

#include "loom/amp/grad_scaler.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/accumulation.h"
#include "train/checkpoint_providers.h"

namespace loom::detail::ckpt {

using json = nlohmann::json;

// ---- Grad scaler -------------------------------------------------------------------------------

namespace {

std::map<std::string, double> scaler_state(const json& saved) {
  std::map<std::string, double> state;
  for (auto it = saved.begin(); it != saved.end(); ++it)
    if (it.value().is_number()) state[it.key()] = it.value().get<double>();
  return state;
}

}  // namespace

void ScalerState::collect(int /*rank*/, SaveState& out) {
  if (scaler_ == nullptr) return;
  json section = json::object();
  for (const auto& [key, value] : scaler_->state_dict()) section[key] = value;
  out.sections["scaler"] = section.dump();
}

void ScalerState::plan(const LoadContext& context, std::vector<Need>& /*needs*/, std::vector<std::string>& problems) {
  if (scaler_ == nullptr || !scaler_->is_enabled()) return;
  const json& saved = context.manifest.section("scaler");
  if (saved.is_null() || !saved.is_object() || saved.empty())
    return problems.push_back("the checkpoint holds no grad scaler state (none, or a disabled one, was saved)");
  bool complete = true;
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    if (!saved.contains(key) || !saved[key].is_number()) {
      problems.push_back(std::string("grad scaler state \"") + key + "\" missing or not a number");
      complete = false;
    }
  if (!complete) return;
  // Loaded into a scratch scaler first: whatever it would refuse (a growth factor of 0.5, say) is
  // refused before anything live has changed.
  try {
    GradScaler scratch;
    scratch.load_state_dict(scaler_state(saved));
  } catch (const std::exception& e) {
    problems.push_back(std::string("grad scaler state refused: ") + e.what());
  }
}

void ScalerState::apply(const LoadContext& context, const LoadedTensors& /*data*/) {
  if (scaler_ == nullptr || !scaler_->is_enabled()) return;
  scaler_->load_state_dict(scaler_state(context.manifest.section("scaler")));
}

// ---- RNG ---------------------------------------------------------------------------------------

std::string rng_prefix(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rng/rank%05d/", rank);
  return name;
}

std::string rng_stream_prefix(c10::DeviceType type) {
  if (type == c10::DeviceType::CPU) return "stream/";
  return "stream-" + c10::DeviceTypeName(type, /*lower_case=*/true) + "/";
}

namespace {

bool cuda_present() { return at::hasCUDA() && at::detail::getCUDAHooks().getNumGPUs() > 0; }

void set_generator_state(const std::string& key, const at::Tensor& state) {
  at::Generator gen = generator_for_key(key);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

at::Generator generator_for_key(const std::string& key) {
  if (key == "cpu") return at::detail::getDefaultCPUGenerator();
  if (key == "cuda")
    return at::globalContext().defaultGenerator(at::Device(at::kCUDA, at::detail::getCUDAHooks().current_device()));
  if (key.rfind("cuda", 0) == 0 && key.size() > 4 && key.size() < 8 &&
      key.find_first_not_of("0123456789", 4) == std::string::npos)
    return at::globalContext().defaultGenerator(
        at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(key.substr(4)))));
  throw CheckpointError("no generator for the RNG state \"" + key + "\"");
}

void RngState::add(RngTracker& tracker, const std::string& where) {
  for (RngTracker* known : trackers_) {
    if (known == &tracker) return;
    if (known->device().type() == tracker.device().type())
      throw InvalidArgumentError(where + ": Checkpointer::rng: a tracker for " + known->device().str() +
                                 " is registered already; a checkpoint holds one tracker per device type (found one for " +
                                 tracker.device().str() + ")");
  }
  trackers_.push_back(&tracker);
}

void RngState::collect(int rank, SaveState& out) {
  std::map<std::string, at::Tensor> states;
  std::vector<std::string> keys = {"cpu"};
  if (cuda_present()) keys.push_back("cuda");
  for (const auto& key : keys) {
    at::Generator gen = generator_for_key(key);
    std::lock_guard<std::mutex> lock(gen.mutex());
    states[key] = gen.get_state();
  }
  for (RngTracker* tracker : trackers_)
    for (auto& [name, state] : tracker->get_states()) states[rng_stream_prefix(tracker->device().type()) + name] = state;
  for (auto& [key, state] : states) out.tensors.push_back(describe_slice(rng_prefix(rank) + key, state, -1, {}, 0));
}

void RngState::plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& /*problems*/) {
  sources_.clear();
  const Manifest& m = context.manifest;
  // The same rank's states at the same layout; otherwise rank 0's generators (identical in
  // TP-style training) and, at the same TP degree, the streams of a rank with this TP rank.
  const bool same_layout = context.same_layout();
  const int generator_source = same_layout ? context.rank : 0;
  int stream_source = same_layout ? context.rank : -1;
  if (!same_layout && m.world.tensor_parallel == context.live.tp_size)
    for (int r = 0; r < m.world.size && stream_source < 0; ++r)
      if (m.world.tp_ranks[r] == context.live.tp_rank) stream_source = r;
  const std::string mine = rng_prefix(context.rank);
  for (const auto& t : context.live.tensors) {
    if (t.name.rfind(mine, 0) != 0) continue;
    const std::string key = t.name.substr(mine.size());
    if (key.rfind("stream", 0) == 0) continue;
    const std::string saved = rng_prefix(generator_source) + key;
    if (m.tensors.count(saved)) {
      sources_[key] = saved;
    } else if (key == "cuda") {
      // Saved before generators were keyed without their device number: this rank's device's.
      const std::string legacy =
          rng_prefix(generator_source) + "cuda" + std::to_string(at::detail::getCUDAHooks().current_device());
      if (m.tensors.count(legacy)) sources_[key] = legacy;
    }
  }
  for (RngTracker* tracker : trackers_) {
    if (stream_source < 0) break;
    const std::string key_prefix = rng_stream_prefix(tracker->device().type());
    const std::string prefix = rng_prefix(stream_source) + key_prefix;
    for (const auto& [name, r] : m.tensors)
      if (name.rfind(prefix, 0) == 0) sources_[key_prefix + name.substr(prefix.size())] = name;
  }
  if (!trackers_.empty() && stream_source < 0)
    LOOM_LOG(info, "checkpoint " << context.path << " was saved at TP " << m.world.tensor_parallel << ", loaded at TP "
                                 << context.live.tp_size << ": RNG tracker streams are not restored");
  for (const auto& [key, saved] : sources_) {
    const TensorRecord& r = m.tensors.at(saved);
    needs.push_back({saved, &r, slice_box(r.shape, -1, 0, 0), r.shape});
  }
}

void RngState::verify(const LoadContext& context, const LoadedTensors& data, std::vector<std::string>& problems) {
  // A tracker inside fork() refuses new states (apply would throw after the model changed): asked
  // now by handing it its own states back, which changes nothing.
  for (RngTracker* tracker : trackers_) {
    try {
      tracker->set_states(tracker->get_states());
    } catch (const std::exception& e) {
      problems.push_back("an RNG tracker cannot take the saved streams now: " + std::string(e.what()) +
                         " (load outside its fork)");
    }
  }
  // Checked on scratch generators of the kind they restore (a CUDA tracker's streams on a CUDA
  // generator), so that a malformed state fails here.
  for (const auto& [key, saved] : sources_) {
    try {
      at::Generator scratch;
      if (key.rfind("stream", 0) != 0) {
        scratch = generator_for_key(key).clone();
      } else {
        for (RngTracker* tracker : trackers_)
          if (key.rfind(rng_stream_prefix(tracker->device().type()), 0) == 0)
            scratch = at::globalContext().defaultGenerator(tracker->device()).clone();
      }
      if (!scratch.defined()) throw CheckpointError("no tracker restores it");
      scratch.set_state(data.at(saved));
    } catch (const std::exception& e) {
      problems.push_back("RNG state " + saved + " in " + context.path + " is not a generator state: " + e.what());
    }
  }
}

void RngState::apply(const LoadContext& /*context*/, const LoadedTensors& data) {
  for (const auto& [key, saved] : sources_)
    if (key.rfind("stream", 0) != 0) set_generator_state(key, data.at(saved));
  for (RngTracker* tracker : trackers_) {
    const std::string prefix = rng_stream_prefix(tracker->device().type());
    std::map<std::string, at::Tensor> streams;
    for (const auto& [key, saved] : sources_)
      if (key.rfind(prefix, 0) == 0) streams[key.substr(prefix.size())] = data.at(saved);
    if (!streams.empty()) tracker->set_states(streams);
  }
}

// ---- Accumulation window -----------------------------------------------------------------------

void AccumulationState::collect(int /*rank*/, SaveState& out) {
  if (accumulator_ == nullptr) return;
  out.sections["accumulation"] =
      json({{"position", accumulator_->position()}, {"micro_batches", accumulator_->micro_batches()}}).dump();
}

void AccumulationState::plan(const LoadContext& context, std::vector<Need>& /*needs*/,
                             std::vector<std::string>& problems) {
  position_ = 0;
  if (accumulator_ == nullptr) return;
  const json& a = context.manifest.section("accumulation");
  if (!a.is_object()) return;  // saved without an accumulator
  if (!a.contains("position") || !a["position"].is_number_unsigned() || !a.contains("micro_batches") ||
      !a["micro_batches"].is_number_unsigned())
    return problems.push_back("manifest accumulation position is malformed");
  const uint64_t position = a["position"].get<uint64_t>(), saved_window = a["micro_batches"].get<uint64_t>();
  if (position >= saved_window)
    return problems.push_back("manifest accumulation position " + std::to_string(position) +
                              " is outside its window of " + std::to_string(saved_window) + " micro-batches");
  if (position != 0 && saved_window != accumulator_->micro_batches())
    return problems.push_back("the checkpoint was taken inside an accumulation window of " +
                              std::to_string(saved_window) + " micro-batches (position " + std::to_string(position) +
                              "); the live accumulator has " + std::to_string(accumulator_->micro_batches()));
  position_ = static_cast<int64_t>(position);
}

void AccumulationState::apply(const LoadContext& /*context*/, const LoadedTensors& /*data*/) {
  if (accumulator_ != nullptr) accumulator_->set_position(static_cast<size_t>(position_));
}

}  // namespace loom::detail::ckpt
