// The state providers a Checkpointer is built from (see checkpoint_provider.h for the contract):
// model (checkpoint_model_state.cpp), extra tensors and user objects (checkpoint_user_state.cpp),
// optimizer (checkpoint_optimizer_state.cpp), grad scaler, RNG and accumulation window
// (checkpoint_training_state.cpp).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "train/checkpoint_provider.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace loom {
class GradScaler;
class RngTracker;
class GradientAccumulator;
class ZeroOptimizer;
class FullyShardedDataParallel;
}  // namespace loom

namespace loom::detail::ckpt {

// Parameters and buffers under model/, sliced as the model's tp::ShardedModules describe them.
class ModelState final : public StateProvider {
 public:
  void set(torch::nn::Module* model) { model_ = model; }
  torch::nn::Module* model() const { return model_; }
  // Parameter TensorImpl -> name (for the optimizer's state, saved by parameter name).
  std::unordered_map<const c10::TensorImpl*, std::string> parameter_names() const;
  // Parameters whose values another provider writes and reads (a fully sharded model's, whose
  // values live in shards): still described at collect, as the layout the optimizer's state
  // follows, but neither planned nor applied here. Empty: none.
  void hand_over(std::unordered_set<const c10::TensorImpl*> params) { handed_over_ = std::move(params); }

  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;

 private:
  std::set<std::string> handed_over_names() const;
  torch::nn::Module* model_ = nullptr;
  std::unordered_set<const c10::TensorImpl*> handed_over_;
};

// Tensors registered by name (extra/<name>), whole or as this rank's slice of a global tensor;
// and a declared tensor-parallel layout for state no ShardedModule describes (Python models).
class ExtraTensors final : public StateProvider {
 public:
  struct Slice {
    std::vector<int64_t> global_shape;
    int dim = -1;
    int64_t offset = 0;
    bool tensor_parallel = false;  // slice i is TP rank i's (checked against the manifest's tp_ranks)
  };
  // Registering a name again replaces it.
  void add(const std::string& name, at::Tensor tensor, std::optional<Slice> slice, const std::string& where);
  // Forgets a registration (state that no longer exists); false when the name is not registered.
  bool remove(const std::string& name);
  void declare_tensor_parallel(int size, int rank) { tp_ = {size, rank}; }

  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;

 private:
  struct Entry {
    std::string name;
    at::Tensor tensor;
    std::optional<Slice> slice;
  };
  std::vector<Entry> entries_;
  std::optional<std::pair<int, int>> tp_;
};

// Objects whose state is JSON text (a Python LR scheduler's state_dict, a data loader's position):
// saved under the manifest's "objects" section by name. check() must refuse what load() would
// refuse, without changing the object.
class UserObjects final : public StateProvider {
 public:
  struct Object {
    std::function<std::string()> save;
    std::function<void(const std::string&)> check;
    std::function<void(const std::string&)> load;
  };
  void add(const std::string& name, Object object) { objects_[name] = std::move(object); }

  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;

 private:
  std::map<std::string, Object> objects_;
};

// The optimizer's hyper-parameters, parameter groups (by parameter name) and step counts as the
// "optimizer" section; its state tensors under optim/<param>/<key>, sliced like their parameter.
class OptimizerState final : public StateProvider {
 public:
  explicit OptimizerState(const ModelState& model) : model_(model) {}
  void set(torch::optim::Optimizer* optimizer) { optimizer_ = optimizer; }

  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;
  // Pipeline stages' optimizer sections as one: each group's parameters in rank order (replicas'
  // repeats once), the same type and options on every rank, every parameter's step.
  std::string merge_section(const std::string& section, const std::vector<std::string>& texts) const override;

 private:
  const ModelState& model_;
  torch::optim::Optimizer* optimizer_ = nullptr;
};

// A sharded optimizer's state, ZeRO's or a fully sharded model's, in OptimizerState's format
// (checkpoint_zero_state.cpp): the same checkpoint loads with or without sharding, at any
// data-parallel size. A fully sharded model's parameters are written and read here too (from and
// into its shards): the model provider hands them over.
struct FlatShards;
class ZeroOptimizerState final : public StateProvider {
 public:
  explicit ZeroOptimizerState(ModelState& model);
  ~ZeroOptimizerState() override;
  // One or the other (setting one clears the other).
  void set(ZeroOptimizer* zero);
  void set(FullyShardedDataParallel* fsdp);
  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;

 private:
  std::optional<FlatShards> flat_shards() const;
  void plan_parameters(const FlatShards& f, const LoadContext& context, std::vector<Need>& needs,
                       std::vector<std::string>& problems);
  ModelState& model_;
  ZeroOptimizer* zero_ = nullptr;
  FullyShardedDataParallel* fsdp_ = nullptr;
  std::unique_ptr<torch::optim::Optimizer> view_;  // the whole model's optimizer, while saving or loading
  OptimizerState full_;                            // over view_
  std::map<size_t, std::string> sources_;          // fully sharded: parameter -> the saved tensor read (plan)
};

// GradScaler::state_dict() as the "scaler" section.
class ScalerState final : public StateProvider {
 public:
  void set(GradScaler* scaler) { scaler_ = scaler; }
  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;

 private:
  GradScaler* scaler_ = nullptr;
};

// Each rank's default generators (CPU; the current CUDA device's, keyed "cuda") and RNG-tracker
// streams (one tracker per device type) under rng/rank<r>/. At the same layout a rank gets its
// own; otherwise rank 0's generators and, at the same TP degree, the streams of a rank with its
// TP rank.
class RngState final : public StateProvider {
 public:
  // InvalidArgumentError (prefixed by `where`) for a second tracker of one device type.
  void add(RngTracker& tracker, const std::string& where);

  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void verify(const LoadContext& context, const LoadedTensors& data, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;

 private:
  std::vector<RngTracker*> trackers_;
  std::map<std::string, std::string> sources_;  // local key ("cpu", "stream/x") -> saved name (from plan)
};

// The accumulation window's position (the "accumulation" section).
class AccumulationState final : public StateProvider {
 public:
  void set(GradientAccumulator* accumulator) { accumulator_ = accumulator; }
  void collect(int rank, SaveState& out) override;
  void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) override;
  void apply(const LoadContext& context, const LoadedTensors& data) override;

 private:
  GradientAccumulator* accumulator_ = nullptr;
  int64_t position_ = 0;  // from plan
};

// The generator a saved RNG key restores: "cpu", "cuda" (current device), or the legacy "cuda<i>".
at::Generator generator_for_key(const std::string& key);
// "stream/" for the CPU tracker, "stream-<type>/" (e.g. "stream-cuda/") for another device's.
std::string rng_stream_prefix(c10::DeviceType type);
std::string rng_prefix(int rank);

}  // namespace loom::detail::ckpt
