// What a checkpoint holds, gathered from the objects a Checkpointer was given, and put back.
//
// Everything becomes named tensors plus a few JSON sections:
//   model/<name>              parameters and buffers (slices of tensor-parallel ones)
//   optim/<param>/<key>       optimizer state tensors, sliced like their parameter
//   rng/rank<r>/cpu           the default CPU generator of rank r (and /cuda<i>, /stream/<name>)
//   extra/<name>              tensors registered with Checkpointer::tensor
// Optimizer hyper-parameters, parameter groups (by parameter name) and step counts, and the grad
// scaler's state dict are JSON. Collecting reads only; applying happens after the whole checkpoint
// has been verified.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

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
}  // namespace loom

namespace loom::detail::ckpt {

struct Targets {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  GradScaler* scaler = nullptr;
  std::vector<RngTracker*> rng;  // at most one per device type
  GradientAccumulator* accumulator = nullptr;
  std::vector<std::pair<std::string, at::Tensor>> extra;
};

// One tensor (or this rank's slice of it) as it is saved.
struct LocalTensor {
  std::string name;
  at::Tensor tensor;                  // this rank's piece, any device and strides
  std::vector<int64_t> global_shape;  // == tensor's shape unless split
  int split_dim = -1;                 // -1: the whole tensor
  int64_t offset = 0;                 // along split_dim
  bool lowest_rank_writes = false;    // buffers: the lowest holder's copy is the one saved
  int64_t length() const { return split_dim >= 0 ? tensor.size(split_dim) : 0; }
};

struct CollectedState {
  std::vector<LocalTensor> tensors;  // sorted by name
  nlohmann::json optimizer;          // null without an optimizer
  nlohmann::json scaler;             // null without a scaler
  int tp_size = 1;                   // as the model's tensor-parallel modules report it
  int tp_rank = 0;
};

std::string rng_prefix(int rank);

// `rank` names this rank's RNG tensors. Throws CheckpointError (prefixed by `where`) for state that
// cannot be saved: an unsupported optimizer, an optimizer parameter that is not in the model,
// inconsistent shard metadata.
CollectedState collect_state(const Targets& targets, int rank, const std::string& where);

// Checks the saved optimizer / scaler sections against the live objects without changing them;
// returns the problems found (empty: compatible).
std::vector<std::string> check_optimizer(const Targets& targets, const nlohmann::json& saved);
std::vector<std::string> check_scaler(const Targets& targets, const nlohmann::json& saved);

// Applies optimizer hyper-parameters and step counts and installs state tensors:
// `tensors` maps "optim/<param>/<key>" to host tensors already shaped like this rank's slice.
void apply_optimizer(const Targets& targets, const nlohmann::json& saved,
                     const std::map<std::string, at::Tensor>& tensors);
void apply_scaler(const Targets& targets, const nlohmann::json& saved);
// Copies `source` into the live tensor (no autograd record).
void copy_into(at::Tensor& live, const at::Tensor& source);

// The RNG states of this process -> uint8 tensors: "cpu", "cuda" (the current CUDA device's default
// generator, keyed without its number: a resumed rank may see its GPU under another one), and
// each tracker's streams under rng_stream_prefix(tracker device) + name.
std::map<std::string, at::Tensor> rng_states(const Targets& targets);
// "stream/" for the CPU tracker, "stream-<type>/" (e.g. "stream-cuda/") for another device's.
std::string rng_stream_prefix(c10::DeviceType type);
// The generator a saved key restores: "cpu", "cuda" (current device), or the legacy "cuda<i>".
at::Generator generator_for_key(const std::string& key);
void apply_generator_state(const std::string& key, const at::Tensor& state);

}  // namespace loom::detail::ckpt
