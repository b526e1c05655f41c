// The seam between the checkpoint protocol and the kinds of state it saves.
//
// A state provider turns one kind of live state (the model, the optimizer, the grad scaler, RNG
// streams, the accumulation window, user objects) into named tensors and a JSON section of the
// manifest, and back. The protocol (checkpoint.cpp) knows nothing of the kinds: at save it asks
// every provider to collect; at load it asks every provider to plan (which saved tensors it needs,
// and what is wrong, decided on scratch objects), reads and verifies the data, asks every provider
// to verify what it read, agrees with the other ranks, and only then asks every provider to apply.
// A provider never changes live state before apply, so a load that fails changes nothing.
//
// Saved names by provider:
//   model/<name>              parameters and buffers (slices of tensor-parallel ones)
//   optim/<param>/<key>       optimizer state tensors, sliced like their parameter
//   master/<param>            a ZeRO optimizer's fp32 master weights, sliced like their parameter
//   rng/rank<r>/<key>         rank r's generators and RNG-tracker streams
//   extra/<name>              tensors registered with Checkpointer::tensor (sliced when declared so)
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <type_traits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/checkpoint_layout.h"
#include "train/checkpoint_manifest.h"

namespace loom::detail::ckpt {

// One tensor (or this rank's slice of it) as it is saved.
struct LocalTensor {
  std::string name;
  at::Tensor tensor;                  // this rank's piece, any device and strides
  std::vector<int64_t> global_shape;  // == tensor's shape unless split
  int split_dim = -1;                 // -1: the whole tensor
  int64_t offset = 0;                 // along split_dim
  bool lowest_rank_writes = false;    // buffers: the lowest holder's copy is the one saved
  int64_t length() const { return split_dim >= 0 ? tensor.size(split_dim) : 0; }
  Box box() const { return slice_box(global_shape, split_dim, offset, length()); }
};

// What this rank holds, as every provider described it.
struct SaveState {
  // Collected for a load: only the live tensors and the layout matter (providers may skip work
  // whose result only a save writes, such as serialising objects).
  bool for_load = false;
  std::vector<LocalTensor> tensors;
  // Manifest sections by name: "optimizer", "scaler", "accumulation", "objects".
  nlohmann::json sections = nlohmann::json::object();
  int tp_size = 1;  // as the model's tensor-parallel modules (or a declared layout) report it
  int tp_rank = 0;
  // The tensor of that name; nullptr when none.
  const LocalTensor* find(const std::string& name) const;
};

// A saved tensor (or the part of it this rank holds) a provider wants back.
struct Need {
  std::string name;  // the saved tensor's name
  const TensorRecord* record = nullptr;
  Box box;  // in global coordinates
  std::vector<int64_t> local_shape;
};

struct LoadContext {
  const Manifest& manifest;
  const std::string& path;      // the checkpoint directory
  const SaveState& live;        // every provider's live state, collected as for a save
  int rank = 0;
  int size = 1;
  const std::string& where;     // message prefix naming the rank and the operation
  // What apply() replaces (an optimizer's old state) goes here, to be freed after load() returns:
  // munmap of a few hundred MB takes tens of milliseconds.
  std::vector<std::shared_ptr<void>>* garbage = nullptr;
  // Saved at this world size and TP degree: per-rank state (RNG) maps rank to rank.
  bool same_layout() const {
    return manifest.world.size == size && manifest.world.tensor_parallel == live.tp_size;
  }
  // Moves `value` into the garbage (destroyed in the background), or lets it go here without one.
  template <typename T>
  void discard(T&& value) const {
    auto held = std::make_shared<std::decay_t<T>>(std::forward<T>(value));
    if (garbage) garbage->push_back(std::move(held));
  }
};

// Data read for the needs, as host tensors shaped like this rank's piece, by saved name.
using LoadedTensors = std::map<std::string, at::Tensor>;

class StateProvider {
 public:
  virtual ~StateProvider() = default;
  // Adds this rank's tensors and this provider's manifest section.
  virtual void collect(int rank, SaveState& out) = 0;
  // Before any data is read: the saved tensors needed (appended to `needs`) and every problem
  // (appended to `problems`, without the `where` prefix), found on scratch objects.
  virtual void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) = 0;
  // After the data is read and checksummed: checks of its content; nothing live changes.
  virtual void verify(const LoadContext& context, const LoadedTensors& data, std::vector<std::string>& problems) {
    (void)context, (void)data, (void)problems;
  }
  // After every rank verified its part: the live state becomes the checkpoint's.
  virtual void apply(const LoadContext& context, const LoadedTensors& data) = 0;
};

// Shared by providers: a need for the live tensor `live` (same name in the checkpoint) when the
// record matches its global shape and dtype; otherwise a mismatch line is returned.
std::optional<std::string> need_for(const LocalTensor& live, const TensorRecord& record, std::vector<Need>& needs);
// A tensor as saved: whole (dim < 0), or this rank's slice of a tensor of `global_shape` along
// `dim` at `offset` (CheckpointError when it is not such a slice).
LocalTensor describe_slice(const std::string& name, const at::Tensor& tensor, int dim,
                           const std::vector<int64_t>& global_shape, int64_t offset);
// Copies `source` (host) into the live tensor, on the live tensor's device (no autograd record).
void copy_into(at::Tensor& live, const at::Tensor& source);

}  // namespace loom::detail::ckpt
