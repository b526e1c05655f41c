// A ZeRO optimizer's sharded state, saved and loaded in the plain optimizer's format (the
// "optimizer" section, optim/<param>/<key> sliced like the parameter), so that a ZeRO checkpoint
// loads at any data-parallel size, with or without ZeRO, and a plain one loads into ZeRO.
//
// Through a view: an optimizer of the same kind and options over the model's parameters, holding
// state only for what this rank writes (save) or needs (load), handed to the plain OptimizerState.
//   save: each bucket's state is all-gathered over the ZeRO group, one key at a time, and this rank
//         keeps the parameters whose first element lies in its shard (so each DP rank writes about
//         1/N of the state, and holds about that much more while saving);
//   load: only the saved tensors of parameters that overlap this rank's shards are read; their
//         overlapping elements are copied into the shard state.
// fp32 master weights (bf16/fp16 parameters) are saved the same way, as master/<param> sliced like
// the parameter, so that a resumed run steps the values the uninterrupted one would. A checkpoint
// without them (from DDP, or from fp32 parameters) gives the masters the loaded parameters' values.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/optimizer.h>

#include <algorithm>

#include "loom/comm/agreement.h"
#include "loom/comm/communicator.h"
#include "loom/error.h"
#include "loom/parallel/optimizer_state.h"
#include "loom/parallel/zero.h"
#include "train/checkpoint_providers.h"

namespace loom::detail::ckpt {

namespace {

// Parameter indices of each bucket.
std::vector<std::vector<size_t>> members_by_bucket(const ZeroOptimizer& zero) {
  std::vector<std::vector<size_t>> members(zero.shard_parameters().size());
  const auto& placements = zero.placements();
  for (size_t i = 0; i < placements.size(); ++i) members[placements[i].bucket].push_back(i);
  return members;
}

// The elements [begin, end) of parameter i (in its bucket's flat layout) that lie in rank r's shard.
struct Overlap {
  int64_t begin = 0, end = 0;
  bool empty() const { return end <= begin; }
};
Overlap overlap_with_shard(const ZeroOptimizer& zero, size_t i, int r) {
  const auto& p = zero.placements()[i];
  const int64_t S = zero.shard_numel(p.bucket);
  return {std::max(p.offset, r * S), std::min(p.offset + p.numel, (r + 1) * S)};
}


// Every shard on every rank must hold the same state keys and step before the per-key
// all-gathers: a rank whose shards stepped differently (its optimizer was replaced, its state
// cleared) would gather other keys, and the ranks would wait on each other until the group's
// timeout. One exchange of a short text instead, and every rank refuses with the same message.
void agree_on_state(ZeroOptimizer& zero, OptimizerKind kind) {
  torch::optim::Optimizer& shards_optimizer = zero.optimizer();
  const auto shards = zero.shard_parameters();
  std::vector<std::string> per_shard;  // "exp_avg exp_avg_sq, step 2", or "(no state)"
  for (const auto& shard : shards) {
    std::string held;
    std::optional<int64_t> step;
    if (const auto* s = find_optimizer_state(shards_optimizer, shard))
      for (auto& [key, tensor] : optimizer_state_tensors(kind, *s, &step)) held += (held.empty() ? "" : " ") + key;
    per_shard.push_back(held.empty() ? "(no state)" : held + (step ? ", step " + std::to_string(*step) : ""));
  }
  std::string mine;
  const bool uniform = std::all_of(per_shard.begin(), per_shard.end(), [&](const std::string& d) { return d == per_shard[0]; });
  if (uniform) {
    mine = "every shard: " + per_shard[0];
  } else {
    for (size_t b = 0; b < per_shard.size(); ++b) mine += (b ? "; " : "") + ("shard " + std::to_string(b) + ": ") + per_shard[b];
  }
  const auto all = all_gather_strings(zero.group(), mine, {"ZeRO checkpoint: optimizer state keys"});
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0])
      throw CheckpointError("the ZeRO shards' optimizer state differs between ranks (they stepped differently), "
                            "expected the same keys and step on every rank: rank 0 has " + all[0] + "; rank " +
                            std::to_string(r) + " has " + all[r]);
  if (!uniform)
    throw CheckpointError("the ZeRO shards' optimizer state differs between buckets (they stepped differently), "
                          "expected the same keys and step in every shard: " + mine);
}

}  // namespace

namespace {

// The fp32 master copies this rank writes (laid out like their parameter: tensor-parallel slices
// stay slices), and the step of every parameter in the optimizer section (rank 0's goes into the
// manifest, so it must name all of them, not only those rank 0 writes).
void add_masters_and_steps(const ModelState& model, const std::vector<at::Tensor>& params,
                           const std::map<size_t, at::Tensor>& masters, std::optional<int64_t> step,
                           SaveState& out) {
  const auto names = model.parameter_names();
  for (const auto& [i, master] : masters) {
    const std::string& name = names.at(params[i].unsafeGetTensorImpl());
    const LocalTensor* param = out.find("model/" + name);  // its layout: tensor-parallel slices stay slices
    if (param != nullptr && param->split_dim >= 0)
      out.tensors.push_back(describe_slice("master/" + name, master, param->split_dim, param->global_shape, param->offset));
    else
      out.tensors.push_back(describe_slice("master/" + name, master, -1, {}, 0));
  }
  if (step) {
    nlohmann::json section = nlohmann::json::parse(out.sections.at("optimizer"));
    nlohmann::json& steps = section["steps"];
    for (const auto& p : params) {
      auto it = names.find(p.unsafeGetTensorImpl());
      if (it != names.end()) steps[it->second] = *step;
    }
    out.sections["optimizer"] = section.dump();
  }
}

}  // namespace

ZeroOptimizerState::ZeroOptimizerState(const ModelState& model) : model_(model), full_(model) {}
ZeroOptimizerState::~ZeroOptimizerState() = default;

void ZeroOptimizerState::collect(int rank, SaveState& out) {
  if (zero_ == nullptr || out.for_load) return;  // a load reads the layout from the model alone
  ZeroOptimizer& zero = *zero_;
  torch::optim::Optimizer& shards_optimizer = zero.optimizer();
  const OptimizerKind kind = *optimizer_kind(shards_optimizer);
  const auto& params = zero.parameters();
  const auto shards = zero.shard_parameters();
  Communicator& group = zero.group();
  const int me = group.rank();
  const int64_t n = group.size();

  view_ = make_optimizer(kind, params, shards_optimizer.param_groups()[0].options());
  // Every shard steps at every step: one step count and one set of keys (rank-independent).
  std::optional<int64_t> step;
  std::vector<std::string> keys;
  if (const auto* s = find_optimizer_state(shards_optimizer, shards.front()))
    for (auto& [key, tensor] : optimizer_state_tensors(kind, *s, &step)) keys.push_back(key);
  agree_on_state(zero, kind);

  zero.wait_parameters();  // the parameters are saved next to this state: every all-gather done
  const auto members = members_by_bucket(zero);
  std::map<size_t, std::map<std::string, at::Tensor>> written;  // parameter -> key -> its whole state
  std::map<size_t, at::Tensor> masters;                         // parameter -> its whole master copy
  for (size_t b = 0; b < shards.size(); ++b) {
    const auto* s = find_optimizer_state(shards_optimizer, shards[b]);
    std::map<std::string, at::Tensor> mine;
    if (s != nullptr)
      for (auto& [key, tensor] : optimizer_state_tensors(kind, *s)) mine[key] = tensor;
    const int64_t S = zero.shard_numel(b);
    for (const auto& key : keys) {
      auto it = mine.find(key);
      if (it == mine.end())
        throw CheckpointError("ZeRO shard " + std::to_string(b) + " has no optimizer state " + key +
                              " where shard 0 has (the shards stepped differently)");
      at::Tensor full = at::empty({S * n}, it->second.options());
      group.all_gather(full, it->second.contiguous())->wait();
      for (size_t i : members[b]) {
        const auto& p = zero.placements()[i];
        if (p.offset / S != me) continue;  // the rank holding its first element writes it
        written[i][key] = full.narrow(0, p.offset, p.numel).view(params[i].sizes()).clone();
      }
    }
    if (!zero.has_master_weights(b)) continue;
    at::Tensor full = at::empty({S * n}, shards[b].options());
    group.all_gather(full, shards[b])->wait();
    for (size_t i : members[b]) {
      const auto& p = zero.placements()[i];
      if (p.offset / S == me) masters[i] = full.narrow(0, p.offset, p.numel).view(params[i].sizes()).clone();
    }
  }
  for (auto& [i, tensors] : written) {
    auto get = [&](const char* key) -> at::Tensor {
      auto it = tensors.find(key);
      return it == tensors.end() ? at::Tensor() : it->second;
    };
    if (auto state = make_optimizer_state(kind, get, step)) set_optimizer_state(*view_, params[i], std::move(state));
  }
  full_.set(view_.get());
  full_.collect(rank, out);
  full_.set(nullptr);
  view_.reset();
  add_masters_and_steps(model_, params, masters, step, out);
}

void ZeroOptimizerState::plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) {
  if (zero_ == nullptr) return;
  ZeroOptimizer& zero = *zero_;
  torch::optim::Optimizer& shards_optimizer = zero.optimizer();
  const OptimizerKind kind = *optimizer_kind(shards_optimizer);
  view_ = make_optimizer(kind, zero.parameters(), shards_optimizer.param_groups()[0].options());
  full_.set(view_.get());
  std::vector<Need> all;
  full_.plan(context, all, problems);
  // Only the state of parameters with elements in this rank's shards is read.
  const auto names = model_.parameter_names();
  std::set<std::string> overlapping;
  const int me = zero.group().rank();
  for (size_t i = 0; i < zero.parameters().size(); ++i) {
    auto it = names.find(zero.parameters()[i].unsafeGetTensorImpl());
    if (it != names.end() && !overlap_with_shard(zero, i, me).empty()) overlapping.insert(it->second);
  }
  for (auto& need : all) {
    const std::string param = need.name.substr(6, need.name.find_last_of('/') - 6);  // optim/<param>/<key>
    if (overlapping.count(param)) needs.push_back(std::move(need));
  }
  bool masters = false;
  for (size_t b = 0; b < zero.shard_parameters().size(); ++b) masters = masters || zero.has_master_weights(b);
  if (!masters) return;  // saved master weights (from a bf16 run) are not needed by fp32 parameters
  for (const auto& [name, record] : context.manifest.tensors) {
    if (name.rfind("master/", 0) != 0 || !overlapping.count(name.substr(7))) continue;
    const LocalTensor* p = context.live.find("model/" + name.substr(7));
    if (p == nullptr) continue;  // not in overlapping then
    if (record.shape != p->global_shape)
      problems.push_back("master weights " + name + " " + shape_to_string(record.shape) + " do not match the parameter " +
                         shape_to_string(p->global_shape));
    else if (record.dtype != at::kFloat)
      problems.push_back("master weights " + name + " are " + std::string(c10::toString(record.dtype)) +
                         ", expected float32");
    else
      needs.push_back({name, &record, p->box(), p->tensor.sizes().vec()});
  }
}

void ZeroOptimizerState::apply(const LoadContext& context, const LoadedTensors& data) {
  if (zero_ == nullptr) return;
  ZeroOptimizer& zero = *zero_;
  // The view takes the saved options and the whole state of the parameters read; the shards take
  // their part of it.
  full_.apply(context, data);
  torch::optim::Optimizer& shards_optimizer = zero.optimizer();
  const OptimizerKind kind = *optimizer_kind(shards_optimizer);
  shards_optimizer.param_groups()[0].set_options(view_->param_groups()[0].options().clone());
  context.discard(std::move(shards_optimizer.state()));
  shards_optimizer.state().clear();
  const auto& params = zero.parameters();
  const auto shards = zero.shard_parameters();
  const int me = zero.group().rank();
  const auto members = members_by_bucket(zero);
  for (size_t b = 0; b < shards.size(); ++b) {
    const int64_t S = zero.shard_numel(b);
    std::map<std::string, at::Tensor> shard_state;  // zeros where no saved state lies (padding)
    std::optional<int64_t> step;
    for (size_t i : members[b]) {
      const Overlap o = overlap_with_shard(zero, i, me);
      const auto* s = o.empty() ? nullptr : find_optimizer_state(*view_, params[i]);
      if (s == nullptr) continue;
      std::optional<int64_t> param_step;
      const int64_t offset = zero.placements()[i].offset;
      for (auto& [key, tensor] : optimizer_state_tensors(kind, *s, &param_step)) {
        at::Tensor& into = shard_state[key];
        if (!into.defined()) into = at::zeros({S}, shards[b].options());
        into.narrow(0, o.begin - me * S, o.end - o.begin)
            .copy_(tensor.reshape({-1}).narrow(0, o.begin - offset, o.end - o.begin));
      }
      if (param_step) step = std::max(step.value_or(0), *param_step);
    }
    auto get = [&](const char* key) -> at::Tensor {
      auto it = shard_state.find(key);
      return it == shard_state.end() ? at::Tensor() : it->second;
    };
    if (auto state = make_optimizer_state(kind, get, step)) set_optimizer_state(shards_optimizer, shards[b], std::move(state));
  }
  full_.set(nullptr);
  view_.reset();
  // The masters take the loaded parameters' values, then the saved masters' where there are some
  // (the model provider applied first).
  zero.refresh_master_weights();
  const auto names = model_.parameter_names();
  for (size_t i = 0; i < params.size(); ++i) {
    const size_t b = zero.placements()[i].bucket;
    auto it = zero.has_master_weights(b) ? data.find("master/" + names.at(params[i].unsafeGetTensorImpl())) : data.end();
    if (it == data.end()) continue;
    const Overlap o = overlap_with_shard(zero, i, me);
    if (o.empty()) continue;
    const int64_t S = zero.shard_numel(b), offset = zero.placements()[i].offset;
    shards[b].narrow(0, o.begin - me * S, o.end - o.begin)
        .copy_(it->second.reshape({-1}).narrow(0, o.begin - offset, o.end - o.begin));
  }
}

}  // namespace loom::detail::ckpt
