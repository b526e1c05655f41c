// The model's parameters and buffers (model/<name>), sliced as the model's tp::ShardedModules
// describe them.
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <set>

#include "loom/error.h"
#include "loom/parallel/tensor_parallel.h"
#include "train/checkpoint_providers.h"

namespace loom::detail::ckpt {

namespace {

void find_shards(torch::nn::Module& module, const std::string& prefix,
                 std::unordered_map<const c10::TensorImpl*, tp::ShardInfo>& shards) {
  if (const auto* sharded = dynamic_cast<const tp::ShardedModule*>(&module)) {
    auto own = module.named_parameters(/*recurse=*/false);
    for (const auto& [name, info] : sharded->shard_info()) {
      const at::Tensor* p = own.find(name);
      if (p == nullptr)
        throw CheckpointError("module " + (prefix.empty() ? std::string("(root)") : prefix) +
                              " describes a shard of \"" + name + "\", which is not one of its parameters");
      shards[p->unsafeGetTensorImpl()] = info;
    }
  }
  for (const auto& item : module.named_children())
    find_shards(*item.value(), prefix.empty() ? item.key() : prefix + "." + item.key(), shards);
}

}  // namespace

std::unordered_map<const c10::TensorImpl*, std::string> ModelState::parameter_names() const {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  if (model_ == nullptr) return names;
  for (const auto& item : model_->named_parameters(/*recurse=*/true))
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  return names;
}

std::set<std::string> ModelState::handed_over_names() const {
  std::set<std::string> names;
  if (model_ == nullptr || handed_over_.empty()) return names;
  for (const auto& item : model_->named_parameters(/*recurse=*/true))
    if (handed_over_.count(item.value().unsafeGetTensorImpl())) names.insert(item.key());
  return names;
}

void ModelState::collect(int /*rank*/, SaveState& out) {
  if (model_ == nullptr) return;
  std::unordered_map<const c10::TensorImpl*, tp::ShardInfo> shards;
  find_shards(*model_, "", shards);
  for (const auto& [impl, info] : shards) {
    out.tp_size = std::max(out.tp_size, info.tp_size);
    if (info.tp_size > 1) out.tp_rank = info.tp_rank;
  }
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    auto it = shards.find(item.value().unsafeGetTensorImpl());
    if (it == shards.end() || it->second.dim < 0)
      out.tensors.push_back(describe_slice("model/" + item.key(), item.value(), -1, {}, 0));
    else
      out.tensors.push_back(describe_slice("model/" + item.key(), item.value(), it->second.dim,
                                           it->second.global_shape, it->second.offset));
  }
  for (const auto& item : model_->named_buffers(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    out.tensors.push_back(describe_slice("model/" + item.key(), item.value(), -1, {}, 0));
    out.tensors.back().lowest_rank_writes = true;
  }
}

void ModelState::plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) {
  if (model_ == nullptr) return;
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> live_names;
  const auto handed_over = handed_over_names();
  for (const auto& t : context.live.tensors) {
    if (t.name.rfind("model/", 0) != 0) continue;
    live_names.insert(t.name);
    if (handed_over.count(t.name.substr(6))) continue;
    auto it = context.manifest.tensors.find(t.name);
    if (it == context.manifest.tensors.end()) {
      missing.push_back(t.name);
      continue;
    }
    if (auto mismatch = need_for(t, it->second, needs)) mismatched.push_back(*mismatch);
  }
  // A pipeline stage loads the part of the model it holds; the other stages load the rest.
  const bool pipelined = context.pipelined();
  for (const auto& [name, r] : context.manifest.tensors)
    if (name.rfind("model/", 0) == 0 && !live_names.count(name) && !pipelined) unexpected.push_back(name);
  if (!missing.empty() || !unexpected.empty()) {
    std::string diff;
    for (const auto& n : unexpected) diff += "\n    - " + n;
    for (const auto& n : missing) diff += "\n    + " + n;
    problems.push_back("tensor names differ between the checkpoint's manifest and the live state (- only in the "
                       "checkpoint, + only live):" + diff +
                       (pipelined || missing.empty() == unexpected.empty() ? ""
                                                                           : "\n  (pipeline stages hold parts of a model: "
                                                                             "declare the layout, Checkpointer::parallel_layout)"));
  }
  if (!mismatched.empty()) {
    std::string lines;
    for (const auto& m : mismatched) lines += "\n  " + m;
    problems.push_back("shapes or dtypes differ:" + lines);
  }
}

void ModelState::apply(const LoadContext& context, const LoadedTensors& data) {
  if (model_ == nullptr) return;
  const auto handed_over = handed_over_names();
  for (const auto& t : context.live.tensors) {
    if (t.name.rfind("model/", 0) != 0 || handed_over.count(t.name.substr(6))) continue;
    at::Tensor live = t.tensor;
    copy_into(live, data.at(t.name));
  }
}

}  // namespace loom::detail::ckpt
