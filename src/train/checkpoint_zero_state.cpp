// A sharded optimizer's state, ZeRO's (buckets) or a fully sharded model's (units), saved and loaded
// in the plain optimizer's format (the "optimizer" section, optim/<param>/<key> sliced like the
// parameter), so that the checkpoint loads at any data-parallel size, with or without sharding, and
// a plain one loads into either.
//
// Both keep flat shards over a group: each bucket or unit lays its parameters one after another,
// and rank r holds elements [r * S, (r + 1) * S). Through a view: an optimizer of the same kind and
// options over the parameters, holding state only for what this rank writes (save) or needs (load),
// handed to the plain OptimizerState.
//   save: each bucket's state is all-gathered over the group, one bucket and key at a time, and this
//         rank copies to host memory the parameters whose first element lies in its shard (so each
//         rank writes about 1/N of the state, and no device holds more than one bucket's gathered
//         key beyond its own shards);
//   load: only the saved tensors of parameters that overlap this rank's shards are read; their
//         overlapping elements are copied into the shard state.
// ZeRO's fp32 master weights (bf16/fp16 parameters) are saved the same way, as master/<param>
// sliced like the parameter, so that a resumed run steps the values the uninterrupted one would. A
// checkpoint without them (from DDP, or from fp32 parameters) gives the masters the loaded
// parameters' values. A fully sharded model's parameters are its shards: model/<param> is written
// from them the same way (in the shards' dtype: fp32 masters under a param_dtype), and read into
// them (from master/<param> where a bf16 ZeRO run saved one).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <set>
#include <unordered_set>

#include "loom/comm/agreement.h"
#include "loom/comm/communicator.h"
#include "loom/error.h"
#include "loom/parallel/fully_shard.h"
#include "loom/parallel/optimizer_state.h"
#include "loom/parallel/zero.h"
#include "train/checkpoint_providers.h"

namespace loom::detail::ckpt {

// What the provider reads of ZeRO or of a fully sharded model: flat shards over a group.
struct FlatShards {
  Communicator& group;
  torch::optim::Optimizer& optimizer;
  const std::vector<at::Tensor>& params;                    // every sharded parameter
  const std::vector<ZeroOptimizer::Placement>& placements;  // each one's bucket (unit) and offset
  std::vector<at::Tensor> shards;                           // what the optimizer steps, per bucket
  std::vector<int64_t> shard_numel;                         // per bucket
  std::vector<bool> masters;           // ZeRO: the bucket's shard is an fp32 master copy (master/<param>)
  bool shards_are_parameters = false;  // fully sharded: the parameters' values are the shards'
  const char* what = "ZeRO";           // for messages

  size_t buckets() const { return shards.size(); }
  bool any_masters() const { return std::find(masters.begin(), masters.end(), true) != masters.end(); }
};

namespace {

FlatShards flat_shards_of(ZeroOptimizer& zero) {
  FlatShards f{zero.group(), zero.optimizer(), zero.parameters(), zero.placements(), zero.shard_parameters(), {}, {}};
  for (size_t b = 0; b < f.buckets(); ++b) {
    f.shard_numel.push_back(zero.shard_numel(b));
    f.masters.push_back(zero.has_master_weights(b));
  }
  return f;
}

FlatShards flat_shards_of(FullyShardedDataParallel& fsdp) {
  FlatShards f{fsdp.group(), fsdp.optimizer(), fsdp.parameters(), fsdp.placements(), fsdp.shard_parameters(), {}, {}};
  for (size_t u = 0; u < f.buckets(); ++u) f.shard_numel.push_back(fsdp.shard_numel(u));
  f.masters.assign(f.buckets(), false);
  f.shards_are_parameters = true;
  f.what = "fully sharded";
  return f;
}

// Parameter indices of each bucket.
std::vector<std::vector<size_t>> members_by_bucket(const FlatShards& f) {
  std::vector<std::vector<size_t>> members(f.buckets());
  for (size_t i = 0; i < f.placements.size(); ++i) members[f.placements[i].bucket].push_back(i);
  return members;
}

// The elements [begin, end) of parameter i (in its bucket's flat layout) that lie in rank r's shard.
struct Overlap {
  int64_t begin = 0, end = 0;
  bool empty() const { return end <= begin; }
};
Overlap overlap_with_shard(const FlatShards& f, size_t i, int r) {
  const auto& p = f.placements[i];
  const int64_t S = f.shard_numel[p.bucket];
  return {std::max(p.offset, r * S), std::min(p.offset + p.numel, (r + 1) * S)};
}

// The rank holding a parameter's first element writes it.
bool writes(const FlatShards& f, size_t i, int me) {
  const auto& p = f.placements[i];
  return p.offset / f.shard_numel[p.bucket] == me;
}

// Host memory for what a rank writes: gathered state is copied out of the device one bucket and key
// at a time, so that a large embedding's whole state never accumulates on one GPU.
at::Tensor host_copy(const at::Tensor& t) { return t.is_cpu() ? t.clone() : t.to(at::kCPU); }

// The whole padded bucket `shard` belongs to, gathered over the group.
at::Tensor gather_bucket(const FlatShards& f, size_t b, const at::Tensor& shard) {
  if (f.group.size() == 1) return shard;
  at::Tensor full = at::empty({f.shard_numel[b] * f.group.size()}, shard.options());
  f.group.all_gather(full, shard.contiguous())->wait();
  return full;
}

// Every shard on every rank must hold the same state keys and step before the per-key
// all-gathers: a rank whose shards stepped differently (its optimizer was replaced, its state
// cleared) would gather other keys, and the ranks would wait on each other until the group's
// timeout. One exchange of a short text instead, and every rank refuses with the same message.
void agree_on_state(const FlatShards& f, OptimizerKind kind) {
  std::vector<std::string> per_shard;  // "exp_avg exp_avg_sq, step 2", or "(no state)"
  for (const auto& shard : f.shards) {
    std::string held;
    std::optional<int64_t> step;
    if (const auto* s = find_optimizer_state(f.optimizer, shard))
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
  const auto all = all_gather_strings(f.group, mine, {"sharded checkpoint: optimizer state keys"});
  const std::string shards = std::string("the ") + f.what + " shards' optimizer state differs between ";
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0])
      throw CheckpointError(shards + "ranks (they stepped differently), expected the same keys and step on every "
                            "rank: rank 0 has " + all[0] + "; rank " + std::to_string(r) + " has " + all[r]);
  if (!uniform)
    throw CheckpointError(shards + "buckets (they stepped differently), expected the same keys and step in every "
                          "shard: " + mine);
}

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

// A fully sharded model's parameters as this rank saves them: the model provider described every
// one (its layout, tensor-parallel slices included); those whose first element lies in this rank's
// shards take the gathered values, the others are written by another rank.
void write_parameters_from_shards(const ModelState& model, const FlatShards& f, const std::map<size_t, at::Tensor>& values,
                                  SaveState& out) {
  const auto names = model.parameter_names();
  std::map<std::string, at::Tensor> mine;
  std::set<std::string> others;
  for (size_t i = 0; i < f.params.size(); ++i) {
    const std::string saved = "model/" + names.at(f.params[i].unsafeGetTensorImpl());
    auto it = values.find(i);
    if (it == values.end())
      others.insert(saved);
    else
      mine[saved] = it->second;
  }
  auto& tensors = out.tensors;
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const LocalTensor& t) { return others.count(t.name) > 0; }),
                tensors.end());
  for (auto& t : tensors)
    if (auto it = mine.find(t.name); it != mine.end()) t.tensor = it->second;
}

}  // namespace

ZeroOptimizerState::ZeroOptimizerState(ModelState& model) : model_(model), full_(model) {}
ZeroOptimizerState::~ZeroOptimizerState() = default;

void ZeroOptimizerState::set(ZeroOptimizer* zero) {
  zero_ = zero;
  fsdp_ = nullptr;
  model_.hand_over({});
}

void ZeroOptimizerState::set(FullyShardedDataParallel* fsdp) {
  zero_ = nullptr;
  fsdp_ = fsdp;
  std::unordered_set<const c10::TensorImpl*> params;
  if (fsdp != nullptr)
    for (const auto& p : fsdp->parameters()) params.insert(p.unsafeGetTensorImpl());
  model_.hand_over(std::move(params));
}

std::optional<FlatShards> ZeroOptimizerState::flat_shards() const {
  if (zero_ != nullptr) return flat_shards_of(*zero_);
  if (fsdp_ != nullptr) return flat_shards_of(*fsdp_);
  return std::nullopt;
}

void ZeroOptimizerState::collect(int rank, SaveState& out) {
  if (out.for_load) return;  // a load reads the layout from the model alone
  std::optional<FlatShards> flat = flat_shards();
  if (!flat) return;
  const FlatShards& f = *flat;
  if (model_.model() == nullptr)
    throw CheckpointError(std::string("the ") + f.what + " state is saved by parameter name: register the model too");
  const OptimizerKind kind = *optimizer_kind(f.optimizer);
  const int me = f.group.rank();

  view_ = make_optimizer(kind, f.params, f.optimizer.param_groups()[0].options());
  // Every shard steps at every step: one step count and one set of keys (rank-independent).
  std::optional<int64_t> step;
  std::vector<std::string> keys;
  if (const auto* s = find_optimizer_state(f.optimizer, f.shards.front()))
    for (auto& [key, tensor] : optimizer_state_tensors(kind, *s, &step)) keys.push_back(key);
  agree_on_state(f, kind);

  if (zero_ != nullptr) zero_->wait_parameters();  // the parameters are saved next to this state
  const auto members = members_by_bucket(f);
  std::map<size_t, std::map<std::string, at::Tensor>> written;  // parameter -> key -> its whole state
  std::map<size_t, at::Tensor> values;                          // parameter -> its master copy, or its values
  for (size_t b = 0; b < f.buckets(); ++b) {
    auto keep_mine = [&](const at::Tensor& full, auto&& into) {
      for (size_t i : members[b]) {
        if (!writes(f, i, me)) continue;
        const auto& p = f.placements[i];
        into(i, host_copy(full.narrow(0, p.offset, p.numel)).view(f.params[i].sizes()));
      }
    };
    const auto* s = find_optimizer_state(f.optimizer, f.shards[b]);
    std::map<std::string, at::Tensor> state;
    if (s != nullptr)
      for (auto& [key, tensor] : optimizer_state_tensors(kind, *s)) state[key] = tensor;
    for (const auto& key : keys) {
      auto it = state.find(key);
      if (it == state.end())
        throw CheckpointError(std::string(f.what) + " shard " + std::to_string(b) + " has no optimizer state " + key +
                              " where shard 0 has (the shards stepped differently)");
      keep_mine(gather_bucket(f, b, it->second), [&](size_t i, at::Tensor t) { written[i][key] = std::move(t); });
    }
    if (f.masters[b] || f.shards_are_parameters)
      keep_mine(gather_bucket(f, b, f.shards[b].detach()), [&](size_t i, at::Tensor t) { values[i] = std::move(t); });
  }
  for (auto& [i, tensors] : written) {
    auto get = [&](const char* key) -> at::Tensor {
      auto it = tensors.find(key);
      return it == tensors.end() ? at::Tensor() : it->second;
    };
    if (auto state = make_optimizer_state(kind, get, step)) set_optimizer_state(*view_, f.params[i], std::move(state));
  }
  if (f.shards_are_parameters) write_parameters_from_shards(model_, f, values, out);
  full_.set(view_.get());
  full_.collect(rank, out);
  full_.set(nullptr);
  view_.reset();
  add_masters_and_steps(model_, f.params, f.shards_are_parameters ? std::map<size_t, at::Tensor>{} : values, step, out);
}

// A fully sharded model's parameters as a load reads them: those overlapping this rank's shards, from
// the saved fp32 master copy where there is one (a bf16 ZeRO run's), else from model/<param>, in
// whatever floating dtype they were saved (the shards take their own).
void ZeroOptimizerState::plan_parameters(const FlatShards& f, const LoadContext& context, std::vector<Need>& needs,
                                         std::vector<std::string>& problems) {
  const auto names = model_.parameter_names();
  const int me = f.group.rank();
  sources_.clear();
  for (size_t i = 0; i < f.params.size(); ++i) {
    const std::string& name = names.at(f.params[i].unsafeGetTensorImpl());
    const LocalTensor* live = context.live.find("model/" + name);
    if (live == nullptr) continue;  // a pipeline stage's load: not this stage's (the model provider says)
    const TensorRecord* master = context.record("master/" + name);
    const bool from_master = master != nullptr && master->dtype == f.shards[f.placements[i].bucket].scalar_type();
    const std::string saved = (from_master ? "master/" : "model/") + name;
    const TensorRecord* record = from_master ? master : context.record(saved);
    if (record == nullptr) {
      problems.push_back("the checkpoint has no " + saved + " (a parameter of the fully sharded model)");
    } else if (record->shape != live->global_shape || !at::isFloatingType(record->dtype)) {
      problems.push_back(saved + ": checkpoint " + c10::toString(record->dtype) + " " + shape_to_string(record->shape) +
                         ", live " + shape_to_string(live->global_shape) + " of a floating dtype");
    } else if (!overlap_with_shard(f, i, me).empty()) {
      needs.push_back({saved, record, live->box(), live->tensor.sizes().vec()});
      sources_[i] = saved;
    }
  }
}

void ZeroOptimizerState::plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) {
  std::optional<FlatShards> flat = flat_shards();
  if (!flat) return;
  const FlatShards& f = *flat;
  if (model_.model() == nullptr) {
    problems.push_back(std::string("the ") + f.what + " state is loaded by parameter name: register the model too "
                       "(Checkpointer::model)");
    return;
  }
  const OptimizerKind kind = *optimizer_kind(f.optimizer);
  view_ = make_optimizer(kind, f.params, f.optimizer.param_groups()[0].options());
  full_.set(view_.get());
  std::vector<Need> all;
  full_.plan(context, all, problems);
  // Only the state of parameters with elements in this rank's shards is read.
  const auto names = model_.parameter_names();
  std::set<std::string> overlapping;
  const int me = f.group.rank();
  for (size_t i = 0; i < f.params.size(); ++i) {
    auto it = names.find(f.params[i].unsafeGetTensorImpl());
    if (it != names.end() && !overlap_with_shard(f, i, me).empty()) overlapping.insert(it->second);
  }
  for (auto& need : all) {
    const std::string param = need.name.substr(6, need.name.find_last_of('/') - 6);  // optim/<param>/<key>
    if (overlapping.count(param)) needs.push_back(std::move(need));
  }
  if (f.shards_are_parameters) return plan_parameters(f, context, needs, problems);
  if (!f.any_masters()) return;  // saved master weights (from a bf16 run) are not needed by fp32 parameters
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
  std::optional<FlatShards> flat = flat_shards();
  if (!flat) return;
  const FlatShards& f = *flat;
  // The view takes the saved options and the whole state of the parameters read; the shards take
  // their part of it.
  full_.apply(context, data);
  const OptimizerKind kind = *optimizer_kind(f.optimizer);
  f.optimizer.param_groups()[0].set_options(view_->param_groups()[0].options().clone());
  context.discard(std::move(f.optimizer.state()));
  f.optimizer.state().clear();
  const int me = f.group.rank();
  const auto members = members_by_bucket(f);
  for (size_t b = 0; b < f.buckets(); ++b) {
    const int64_t S = f.shard_numel[b];
    std::map<std::string, at::Tensor> shard_state;  // zeros where no saved state lies (padding)
    std::optional<int64_t> step;
    for (size_t i : members[b]) {
      const Overlap o = overlap_with_shard(f, i, me);
      const auto* s = o.empty() ? nullptr : find_optimizer_state(*view_, f.params[i]);
      if (s == nullptr) continue;
      std::optional<int64_t> param_step;
      const int64_t offset = f.placements[i].offset;
      for (auto& [key, tensor] : optimizer_state_tensors(kind, *s, &param_step)) {
        at::Tensor& into = shard_state[key];
        if (!into.defined()) into = at::zeros({S}, f.shards[b].options());
        into.narrow(0, o.begin - me * S, o.end - o.begin)
            .copy_(tensor.reshape({-1}).narrow(0, o.begin - offset, o.end - o.begin));
      }
      if (param_step) step = std::max(step.value_or(0), *param_step);
    }
    auto get = [&](const char* key) -> at::Tensor {
      auto it = shard_state.find(key);
      return it == shard_state.end() ? at::Tensor() : it->second;
    };
    if (auto state = make_optimizer_state(kind, get, step)) set_optimizer_state(f.optimizer, f.shards[b], std::move(state));
  }
  full_.set(nullptr);
  view_.reset();
  // ZeRO's masters take the loaded parameters' values (the model provider applied first), then the
  // saved masters' where there are some. A fully sharded model's shards take the saved values; its
  // gathered units, if any, are stale: they are freed.
  if (zero_ != nullptr) zero_->refresh_master_weights();
  if (fsdp_ != nullptr) fsdp_->reshard();
  const auto names = model_.parameter_names();
  for (size_t i = 0; i < f.params.size(); ++i) {
    const size_t b = f.placements[i].bucket;
    std::string saved;
    if (f.shards_are_parameters) {
      auto source = sources_.find(i);
      if (source != sources_.end()) saved = source->second;
    } else if (f.masters[b]) {
      saved = "master/" + names.at(f.params[i].unsafeGetTensorImpl());
    }
    auto it = saved.empty() ? data.end() : data.find(saved);
    if (it == data.end()) continue;
    const Overlap o = overlap_with_shard(f, i, me);
    if (o.empty()) continue;
    const int64_t S = f.shard_numel[b], offset = f.placements[i].offset;
    at::NoGradGuard no_grad;
    f.shards[b].narrow(0, o.begin - me * S, o.end - o.begin)
        .copy_(it->second.reshape({-1}).narrow(0, o.begin - offset, o.end - o.begin));
  }
  sources_.clear();
}

}  // namespace loom::detail::ckpt
