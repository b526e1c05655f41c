// The RNG tracker: named generator states swapped into the default generator on demand.
//
// Swapping the default generator's state (rather than handing a generator to each op) means every
// op that draws from the default generator, including those inside LibTorch modules, follows the
// stream without being told. The cost is two state copies per fork (a few KB on CPU).
#include <ATen/Context.h>

#include <map>
#include <memory>
#include <mutex>

#include "loom/error.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {

RngTracker::RngTracker(c10::Device device) : device_(device) {}

at::Generator RngTracker::default_generator() const { return at::globalContext().defaultGenerator(device_); }

void RngTracker::add(const std::string& name, uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (states_.count(name))
    throw InvalidArgumentError("RngTracker::add: a stream named \"" + name + "\" already exists");
  for (const auto& [other, other_seed] : seeds_)
    if (other_seed == seed)
      throw InvalidArgumentError("RngTracker::add: seed " + std::to_string(seed) + " for stream \"" + name +
                                 "\" is already the seed of stream \"" + other + "\"; expected distinct seeds");
  at::Generator gen = default_generator();
  std::lock_guard<std::mutex> gen_lock(gen.mutex());
  at::Tensor saved = gen.get_state();
  gen.set_current_seed(seed);
  states_[name] = gen.get_state();
  gen.set_state(saved);
  seeds_[name] = seed;
  forked_[name] = false;
}

bool RngTracker::has(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return states_.count(name) > 0;
}

void RngTracker::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [name, forked] : forked_)
    if (forked) throw InvalidArgumentError("RngTracker::reset: stream \"" + name + "\" is forked");
  states_.clear();
  seeds_.clear();
  forked_.clear();
}

RngTracker::ForkGuard RngTracker::fork(const std::string& name) { return ForkGuard(*this, name); }

RngTracker::ForkGuard::ForkGuard(RngTracker& tracker, std::string name) : tracker_(&tracker), name_(std::move(name)) {
  std::lock_guard<std::mutex> lock(tracker_->mutex_);
  auto it = tracker_->states_.find(name_);
  if (it == tracker_->states_.end())
    throw InvalidArgumentError("RngTracker::fork: no stream named \"" + name_ +
                               "\"; seed it first (loom::model_parallel_seed or ParallelState::seed)");
  if (tracker_->forked_[name_])
    throw InvalidArgumentError("RngTracker::fork: stream \"" + name_ + "\" is already forked");
  at::Generator gen = tracker_->default_generator();
  std::lock_guard<std::mutex> gen_lock(gen.mutex());
  saved_default_ = gen.get_state();
  gen.set_state(it->second);
  tracker_->forked_[name_] = true;
}

RngTracker::ForkGuard::ForkGuard(ForkGuard&& other) noexcept
    : tracker_(other.tracker_), name_(std::move(other.name_)), saved_default_(std::move(other.saved_default_)) {
  other.tracker_ = nullptr;
}

RngTracker::ForkGuard::~ForkGuard() {
  if (!tracker_) return;
  std::lock_guard<std::mutex> lock(tracker_->mutex_);
  at::Generator gen = tracker_->default_generator();
  std::lock_guard<std::mutex> gen_lock(gen.mutex());
  // The stream keeps what was drawn from it; the default generator continues where it was.
  tracker_->states_[name_] = gen.get_state();
  gen.set_state(saved_default_);
  tracker_->forked_[name_] = false;
}

std::map<std::string, at::Tensor> RngTracker::get_states() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<std::string, at::Tensor> copy;
  for (const auto& [name, state] : states_) copy[name] = state.clone();
  return copy;
}

void RngTracker::set_states(const std::map<std::string, at::Tensor>& states) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [name, forked] : forked_)
    if (forked) throw InvalidArgumentError("RngTracker::set_states: stream \"" + name + "\" is forked");
  // Validate by loading each state into a scratch generator of the device's kind: a malformed
  // tensor fails here, not at the next fork.
  at::Generator scratch = default_generator().clone();
  for (const auto& [name, state] : states) {
    try {
      scratch.set_state(state);
    } catch (const std::exception& e) {
      throw InvalidArgumentError("RngTracker::set_states: state of stream \"" + name +
                                 "\" is not a generator state of this device: " + e.what());
    }
  }
  // A stream that stays keeps its seed on record (it still started from it, and a state saved by
  // this tracker -- recomputation, a checkpoint of this run -- continues it); a new one's is unknown,
  // so later add() calls check only its name.
  std::map<std::string, uint64_t> seeds;
  for (const auto& [name, seed] : seeds_)
    if (states.count(name)) seeds[name] = seed;
  seeds_ = std::move(seeds);
  states_.clear();
  forked_.clear();
  for (const auto& [name, state] : states) {
    states_[name] = state.clone();
    forked_[name] = false;
  }
}

RngTracker& rng_tracker(c10::Device device) {
  static std::mutex mutex;
  // Never destroyed: trackers hold generator states that may be used from exit handlers.
  static auto* trackers = new std::map<std::string, std::unique_ptr<RngTracker>>();
  std::lock_guard<std::mutex> lock(mutex);
  auto& tracker = (*trackers)[device.str()];
  if (!tracker) tracker = std::make_unique<RngTracker>(device);
  return *tracker;
}

void model_parallel_seed(uint64_t seed, int tp_rank, RngTracker& tracker) {
  at::manual_seed(seed);
  tracker.reset();
  tracker.add(kModelParallelRngStream, seed + kModelParallelSeedOffset + static_cast<uint64_t>(tp_rank));
}

}  // namespace loom
