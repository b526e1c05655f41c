// The state-provider seam (loom/train/checkpoint_state.h): what every provider shares (matching a
// live tensor with its saved record, copying loaded data into place), the view a provider has of
// the checkpoint it loads, and the registry the Checkpointer builds its providers from.
#include "loom/train/checkpoint_state.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <mutex>

#include "loom/error.h"
#include "loom/parallel/layout.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_provider.h"

namespace loom::checkpoint {

using detail::ckpt::shape_to_string;

Box slice_box(const std::vector<int64_t>& global_shape, int split_dim, int64_t offset, int64_t length) {
  Box b;
  b.size = global_shape;
  b.start.assign(global_shape.size(), 0);
  if (split_dim >= 0) {
    b.start[split_dim] = offset;
    b.size[split_dim] = length;
  }
  return b;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.start.size() != b.start.size()) return std::nullopt;
  Box out;
  for (size_t d = 0; d < a.start.size(); ++d) {
    const int64_t lo = std::max(a.start[d], b.start[d]);
    const int64_t hi = std::min(a.start[d] + a.size[d], b.start[d] + b.size[d]);
    if (hi <= lo) return std::nullopt;
    out.start.push_back(lo);
    out.size.push_back(hi - lo);
  }
  return out;
}

std::vector<int64_t> TensorRecord::slice_shape(const SliceRecord& slice) const {
  std::vector<int64_t> s = shape;
  if (split_dim >= 0) s[split_dim] = slice.length;
  return s;
}

const LocalTensor* SaveState::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

std::optional<std::string> need_for(const LocalTensor& live, const TensorRecord& record, std::vector<Need>& needs) {
  if (record.shape != live.global_shape || record.dtype != live.tensor.scalar_type())
    return live.name + ": checkpoint " + c10::toString(record.dtype) + " " + shape_to_string(record.shape) + ", live " +
           c10::toString(live.tensor.scalar_type()) + " " + shape_to_string(live.global_shape);
  needs.push_back({live.name, &record, live.box(), live.tensor.sizes().vec()});
  return std::nullopt;
}

std::optional<std::string> need_like(const std::string& saved, const TensorRecord& record, const LocalTensor* like,
                                     std::vector<Need>& needs) {
  if (like == nullptr) {
    needs.push_back({saved, &record, slice_box(record.shape, -1, 0, 0), record.shape});
    return std::nullopt;
  }
  if (record.shape != like->global_shape)
    return saved + " " + shape_to_string(record.shape) + " does not match " + like->name + " " +
           shape_to_string(like->global_shape);
  needs.push_back({saved, &record, like->box(), like->tensor.sizes().vec()});
  return std::nullopt;
}

void copy_into(at::Tensor& live, const at::Tensor& source) {
  at::NoGradGuard no_grad;
  live.copy_(source);
}

LocalTensor describe_slice(const std::string& name, const at::Tensor& tensor, int dim,
                           const std::vector<int64_t>& global_shape, int64_t offset) {
  LocalTensor t;
  t.name = name;
  t.tensor = tensor.detach();
  t.global_shape = tensor.sizes().vec();
  if (dim < 0) return t;
  const int64_t dims = tensor.dim();
  bool ok = dim < dims && static_cast<int64_t>(global_shape.size()) == dims && offset >= 0;
  for (int64_t d = 0; ok && d < dims; ++d)
    ok = d == dim ? offset + tensor.size(d) <= global_shape[d] : tensor.size(d) == global_shape[d];
  if (!ok)
    throw CheckpointError("tensor " + name + " of shape " + shape_to_string(tensor.sizes().vec()) +
                          " is not a slice of its declared global shape " + shape_to_string(global_shape) +
                          " along dim " + std::to_string(dim) + " at offset " + std::to_string(offset));
  t.global_shape = global_shape;
  t.split_dim = dim;
  t.offset = offset;
  return t;
}

const TensorRecord* LoadContext::record(const std::string& name) const {
  auto it = manifest.tensors.find(name);
  return it == manifest.tensors.end() ? nullptr : &it->second;
}

std::vector<std::string> LoadContext::saved_names(const std::string& prefix) const {
  std::vector<std::string> names;
  for (auto it = manifest.tensors.lower_bound(prefix); it != manifest.tensors.end() && it->first.rfind(prefix, 0) == 0;
       ++it)
    names.push_back(it->first);
  return names;
}

std::string LoadContext::section(const std::string& name) const {
  const auto& saved = manifest.section(name);
  return saved.is_null() ? std::string() : saved.dump();
}

const WorldLayout& LoadContext::saved_world() const { return manifest.world; }
int64_t LoadContext::saved_step() const { return manifest.step; }

bool LoadContext::pipelined() const {
  for (const std::string* text : {&manifest.world.layout, &live.layout})
    if (!text->empty() && ParallelLayout::parse(*text).size(kPipelineParallelDim) > 1) return true;
  return false;
}

bool LoadContext::same_layout() const {
  if (manifest.world.size != size || manifest.world.tensor_parallel != live.tp_size) return false;
  if (manifest.world.layout.empty() || live.layout.empty()) return true;
  return manifest.world.layout == live.layout && manifest.world.positions.at(rank) == live.position;
}

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::pair<std::string, StateProviderFactory>> factories;
};

// The library's own kinds of state first, registered like any other.
Registry& registry() {
  static Registry r{{}, detail::ckpt::builtin_state_providers()};
  return r;
}

}  // namespace

void register_state_provider(const std::string& name, StateProviderFactory factory) {
  const std::string where = ErrorContext("register_state_provider").prefix();
  if (name.empty() || !factory)
    throw InvalidArgumentError(where + ": expected a name and a factory; found name \"" + name + "\"" +
                               (factory ? "" : " and no factory"));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [taken, _] : r.factories)
    if (taken == name)
      throw InvalidArgumentError(where + ": a state provider named \"" + name + "\" is registered already");
  r.factories.emplace_back(name, std::move(factory));
}

std::vector<std::string> registered_state_providers() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& [name, _] : r.factories) names.push_back(name);
  return names;
}

std::vector<std::pair<std::string, StateProviderFactory>> registered_state_provider_factories() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.factories;
}

}  // namespace loom::checkpoint
