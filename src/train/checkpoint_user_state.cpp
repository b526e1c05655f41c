// What the user registers by name: tensors (extra/<name>, whole or a slice of a global tensor) and
// objects whose state is JSON text (the manifest's "objects" section).
#include <algorithm>

#include "loom/error.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_providers.h"

namespace loom::detail::ckpt {

void ExtraTensors::add(const std::string& name, at::Tensor tensor, std::optional<Slice> slice,
                       const std::string& where) {
  if (name.empty()) throw InvalidArgumentError(where + ": Checkpointer::tensor: the name is empty");
  if (!tensor.defined()) throw InvalidArgumentError(where + ": Checkpointer::tensor: \"" + name + "\" is undefined");
  if (slice) {
    try {
      describe_slice("extra/" + name, tensor, slice->dim, slice->global_shape, slice->offset);  // checked now
    } catch (const CheckpointError& e) {
      throw InvalidArgumentError(where + ": Checkpointer::tensor: " + e.what());
    }
  }
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  if (it != entries_.end())
    *it = {name, std::move(tensor), std::move(slice)};
  else
    entries_.push_back({name, std::move(tensor), std::move(slice)});
}

bool ExtraTensors::remove(const std::string& name) {
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
  if (it == entries_.end()) return false;
  entries_.erase(it);
  return true;
}

void ExtraTensors::collect(int /*rank*/, SaveState& out) {
  if (tp_) {
    out.tp_size = std::max(out.tp_size, tp_->first);
    if (tp_->first > 1) out.tp_rank = tp_->second;
  }
  for (const auto& e : entries_) {
    if (e.slice && e.slice->dim >= 0)
      out.tensors.push_back(describe_slice("extra/" + e.name, e.tensor, e.slice->dim, e.slice->global_shape,
                                           e.slice->offset));
    else
      out.tensors.push_back(describe_slice("extra/" + e.name, e.tensor, -1, {}, 0));
  }
}

void ExtraTensors::plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) {
  std::vector<std::string> missing, mismatched;
  for (const auto& t : context.live.tensors) {
    if (t.name.rfind("extra/", 0) != 0) continue;
    auto it = context.manifest.tensors.find(t.name);
    if (it == context.manifest.tensors.end()) {
      missing.push_back(t.name);
      continue;
    }
    if (auto mismatch = need_for(t, it->second, needs)) mismatched.push_back(*mismatch);
  }
  if (!missing.empty()) {
    std::string list;
    for (const auto& n : missing) list += "\n    + " + n;
    problems.push_back("tensor names differ between the checkpoint's manifest and the live state (+ only live):" +
                       list);
  }
  if (!mismatched.empty()) {
    std::string lines;
    for (const auto& m : mismatched) lines += "\n  " + m;
    problems.push_back("shapes or dtypes differ:" + lines);
  }
  // The manifest's tp_ranks, which pick each rank's RNG streams at another layout, agree with the
  // slices of the tensors registered as tensor-parallel (Python models' weights and their
  // optimizer state), as parse_manifest checks for ShardedModules' state.
  for (const auto& e : entries_) {
    if (!e.slice || !e.slice->tensor_parallel) continue;
    auto it = context.manifest.tensors.find("extra/" + e.name);
    if (it == context.manifest.tensors.end()) continue;  // reported above
    if (auto contradiction = tensor_parallel_ranks_contradict(context.manifest, it->first, it->second))
      problems.push_back(*contradiction);
  }
}

void ExtraTensors::apply(const LoadContext& context, const LoadedTensors& data) {
  for (const auto& t : context.live.tensors) {
    if (t.name.rfind("extra/", 0) != 0) continue;
    at::Tensor live = t.tensor;
    copy_into(live, data.at(t.name));
  }
}

void UserObjects::collect(int /*rank*/, SaveState& out) {
  if (objects_.empty() || out.for_load) return;
  nlohmann::json section = nlohmann::json::object();
  for (const auto& [name, object] : objects_) {
    const std::string text = object.save();
    nlohmann::json state = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (state.is_discarded())
      throw CheckpointError("the state of object \"" + name + "\" is not JSON: " + text.substr(0, 200));
    section[name] = std::move(state);
  }
  out.sections["objects"] = section.dump();
}

void UserObjects::plan(const LoadContext& context, std::vector<Need>& /*needs*/, std::vector<std::string>& problems) {
  if (objects_.empty()) return;
  const nlohmann::json& saved = context.manifest.section("objects");
  for (const auto& [name, object] : objects_) {
    if (!saved.is_object() || !saved.contains(name)) {
      problems.push_back("the checkpoint holds no state for object \"" + name + "\"");
      continue;
    }
    if (!object.check) continue;
    try {
      object.check(saved[name].dump());
    } catch (const std::exception& e) {
      problems.push_back("the state of object \"" + name + "\" is refused: " + e.what());
    }
  }
}

void UserObjects::apply(const LoadContext& context, const LoadedTensors& /*data*/) {
  for (const auto& [name, object] : objects_) object.load(context.manifest.section("objects").at(name).dump());
}

}  // namespace loom::detail::ckpt
