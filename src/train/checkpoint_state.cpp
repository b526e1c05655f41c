#include "train/checkpoint_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <type_traits>
#include <unordered_map>

#include "loom/amp/grad_scaler.h"
#include "loom/error.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/accumulation.h"
#include "train/checkpoint_manifest.h"

namespace loom::detail::ckpt {

namespace {

using json = nlohmann::json;

enum class OptimizerKind { SGD, Adam, AdamW };

const char* kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::SGD:
      return "SGD";
    case OptimizerKind::Adam:
      return "Adam";
    case OptimizerKind::AdamW:
      return "AdamW";
  }
  return "?";
}

std::optional<OptimizerKind> kind_of(torch::optim::Optimizer& optimizer) {
  // AdamW is not derived from Adam, so the order does not matter; it is spelled out anyway.
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return OptimizerKind::AdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return OptimizerKind::Adam;
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return OptimizerKind::SGD;
  return std::nullopt;
}

// The optimizer's state is keyed by the parameter's TensorImpl: as void* in current LibTorch, as
// its printed address in older releases.
template <typename Map>
typename Map::key_type state_key(const Map&, const at::Tensor& parameter) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << parameter.unsafeGetTensorImpl();
    return s.str();
  } else {
    return static_cast<Key>(parameter.unsafeGetTensorImpl());
  }
}

torch::optim::OptimizerParamState* find_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
  auto& state = optimizer.state();
  auto it = state.find(state_key(state, parameter));
  return it == state.end() ? nullptr : it->second.get();
}

json options_json(OptimizerKind kind, const torch::optim::OptimizerOptions& options) {
  switch (kind) {
    case OptimizerKind::SGD: {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
      return {{"lr", o.lr()},
              {"momentum", o.momentum()},
              {"dampening", o.dampening()},
              {"weight_decay", o.weight_decay()},
              {"nesterov", o.nesterov()}};
    }
    case OptimizerKind::Adam: {
      const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
      return {{"lr", o.lr()},
              {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
              {"eps", o.eps()},
              {"weight_decay", o.weight_decay()},
              {"amsgrad", o.amsgrad()}};
    }
    case OptimizerKind::AdamW: {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(options);
      return {{"lr", o.lr()},
              {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
              {"eps", o.eps()},
              {"weight_decay", o.weight_decay()},
              {"amsgrad", o.amsgrad()}};
    }
  }
  return nullptr;
}

// The option keys each kind needs, with whether they are booleans.
std::vector<std::pair<const char*, char>> option_keys(OptimizerKind kind) {
  // 'd' double, 'b' bool, 'p' pair of doubles
  if (kind == OptimizerKind::SGD)
    return {{"lr", 'd'}, {"momentum", 'd'}, {"dampening", 'd'}, {"weight_decay", 'd'}, {"nesterov", 'b'}};
  return {{"lr", 'd'}, {"betas", 'p'}, {"eps", 'd'}, {"weight_decay", 'd'}, {"amsgrad", 'b'}};
}

void set_options(OptimizerKind kind, torch::optim::OptimizerOptions& options, const json& j) {
  switch (kind) {
    case OptimizerKind::SGD: {
      auto& o = static_cast<torch::optim::SGDOptions&>(options);
      o.lr(j["lr"].get<double>()).momentum(j["momentum"].get<double>()).dampening(j["dampening"].get<double>());
      o.weight_decay(j["weight_decay"].get<double>()).nesterov(j["nesterov"].get<bool>());
      return;
    }
    case OptimizerKind::Adam: {
      auto& o = static_cast<torch::optim::AdamOptions&>(options);
      o.lr(j["lr"].get<double>()).eps(j["eps"].get<double>()).weight_decay(j["weight_decay"].get<double>());
      o.betas({j["betas"][0].get<double>(), j["betas"][1].get<double>()}).amsgrad(j["amsgrad"].get<bool>());
      return;
    }
    case OptimizerKind::AdamW: {
      auto& o = static_cast<torch::optim::AdamWOptions&>(options);
      o.lr(j["lr"].get<double>()).eps(j["eps"].get<double>()).weight_decay(j["weight_decay"].get<double>());
      o.betas({j["betas"][0].get<double>(), j["betas"][1].get<double>()}).amsgrad(j["amsgrad"].get<bool>());
      return;
    }
  }
}

// The state tensors of one parameter, by key, and its step count (Adam, AdamW).
void state_tensors(OptimizerKind kind, const torch::optim::OptimizerParamState& state,
                   std::vector<std::pair<std::string, at::Tensor>>& tensors, std::optional<int64_t>& step) {
  if (kind == OptimizerKind::SGD) {
    const auto& s = static_cast<const torch::optim::SGDParamState&>(state);
    if (s.momentum_buffer().defined()) tensors.emplace_back("momentum_buffer", s.momentum_buffer());
    return;
  }
  auto add = [&](const auto& s) {
    step = s.step();
    if (s.exp_avg().defined()) tensors.emplace_back("exp_avg", s.exp_avg());
    if (s.exp_avg_sq().defined()) tensors.emplace_back("exp_avg_sq", s.exp_avg_sq());
    if (s.max_exp_avg_sq().defined()) tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  };
  if (kind == OptimizerKind::Adam)
    add(static_cast<const torch::optim::AdamParamState&>(state));
  else
    add(static_cast<const torch::optim::AdamWParamState&>(state));
}

std::unordered_map<const c10::TensorImpl*, std::string> parameter_names(torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  return names;
}

void find_shards(torch::nn::Module& module, const std::string& prefix,
                 std::unordered_map<const c10::TensorImpl*, tp::ShardInfo>& shards, const std::string& where) {
  if (const auto* sharded = dynamic_cast<const tp::ShardedModule*>(&module)) {
    auto own = module.named_parameters(/*recurse=*/false);
    for (const auto& [name, info] : sharded->shard_info()) {
      const at::Tensor* p = own.find(name);
      if (p == nullptr)
        throw CheckpointError(where + ": module " + (prefix.empty() ? std::string("(root)") : prefix) +
                              " describes a shard of \"" + name + "\", which is not one of its parameters");
      shards[p->unsafeGetTensorImpl()] = info;
    }
  }
  for (const auto& item : module.named_children())
    find_shards(*item.value(), prefix.empty() ? item.key() : prefix + "." + item.key(), shards, where);
}

LocalTensor describe(const std::string& name, const at::Tensor& tensor, const tp::ShardInfo* info,
                     const std::string& where) {
  LocalTensor t;
  t.name = name;
  t.tensor = tensor.detach();
  t.global_shape = tensor.sizes().vec();
  if (info == nullptr || info->dim < 0) return t;
  const int64_t dims = tensor.dim();
  bool ok = info->dim < dims && static_cast<int64_t>(info->global_shape.size()) == dims && info->offset >= 0;
  for (int64_t d = 0; ok && d < dims; ++d)
    ok = d == info->dim ? info->offset + tensor.size(d) <= info->global_shape[d]
                        : tensor.size(d) == info->global_shape[d];
  if (!ok)
    throw CheckpointError(where + ": tensor " + name + " of shape " + shape_to_string(tensor.sizes().vec()) +
                          " is not a slice of its declared global shape " + shape_to_string(info->global_shape) +
                          " along dim " + std::to_string(info->dim) + " at offset " + std::to_string(info->offset));
  t.global_shape = info->global_shape;
  t.split_dim = info->dim;
  t.offset = info->offset;
  return t;
}

}  // namespace

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

}  // namespace

at::Generator generator_for_key(const std::string& key) {
  if (key == "cpu") return at::detail::getDefaultCPUGenerator();
  if (key == "cuda")
    return at::globalContext().defaultGenerator(at::Device(at::kCUDA, at::detail::getCUDAHooks().current_device()));
  if (key.rfind("cuda", 0) == 0 && key.size() > 4 && key.size() < 8 &&
      key.find_first_not_of("0123456789", 4) == std::string::npos)
    return at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(key.substr(4)))));
  throw CheckpointError("no generator for the RNG state \"" + key + "\"");
}

std::map<std::string, at::Tensor> rng_states(const Targets& targets) {
  std::map<std::string, at::Tensor> states;
  std::vector<std::string> keys = {"cpu"};
  if (cuda_present()) keys.push_back("cuda");
  for (const auto& key : keys) {
    at::Generator gen = generator_for_key(key);
    std::lock_guard<std::mutex> lock(gen.mutex());
    states[key] = gen.get_state();
  }
  for (RngTracker* tracker : targets.rng)
    for (auto& [name, state] : tracker->get_states())
      states[rng_stream_prefix(tracker->device().type()) + name] = state;
  return states;
}

void apply_generator_state(const std::string& key, const at::Tensor& state) {
  at::Generator gen = generator_for_key(key);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

CollectedState collect_state(const Targets& targets, int rank, const std::string& where) {
  CollectedState out;
  std::unordered_map<const c10::TensorImpl*, tp::ShardInfo> shards;
  std::unordered_map<const c10::TensorImpl*, const LocalTensor*> by_parameter;
  if (targets.model) {
    find_shards(*targets.model, "", shards, where);
    for (const auto& [impl, info] : shards) {
      out.tp_size = std::max(out.tp_size, info.tp_size);
      if (info.tp_size > 1) out.tp_rank = info.tp_rank;
    }
    for (const auto& item : targets.model->named_parameters(/*recurse=*/true)) {
      auto it = shards.find(item.value().unsafeGetTensorImpl());
      out.tensors.push_back(
          describe("model/" + item.key(), item.value(), it == shards.end() ? nullptr : &it->second, where));
    }
    for (const auto& item : targets.model->named_buffers(/*recurse=*/true)) {
      if (!item.value().defined()) continue;
      out.tensors.push_back(describe("model/" + item.key(), item.value(), nullptr, where));
      out.tensors.back().lowest_rank_writes = true;
    }
  }

  if (targets.optimizer) {
    auto& optimizer = *targets.optimizer;
    const auto kind = kind_of(optimizer);
    if (!kind)
      throw CheckpointError(where + ": cannot save the optimizer: supported are torch::optim::SGD, Adam and AdamW");
    if (!targets.model)
      throw CheckpointError(where + ": the optimizer's state is saved by parameter name: register the model too");
    const auto names = parameter_names(*targets.model);
    // The slice layout of every model tensor, so optimizer state follows its parameter.
    std::unordered_map<std::string, const LocalTensor*> model_tensors;
    for (const auto& t : out.tensors) model_tensors[t.name] = &t;
    json groups = json::array();
    json steps = json::object();
    std::vector<LocalTensor> state;
    std::vector<std::string> unnamed;
    for (const auto& group : optimizer.param_groups()) {
      json params = json::array();
      for (const auto& p : group.params()) {
        auto name = names.find(p.unsafeGetTensorImpl());
        if (name == names.end()) {
          unnamed.push_back(shape_to_string(p.sizes().vec()));
          continue;
        }
        params.push_back(name->second);
        const auto* s = find_state(optimizer, p);
        if (s == nullptr) continue;
        std::vector<std::pair<std::string, at::Tensor>> tensors;
        std::optional<int64_t> step;
        state_tensors(*kind, *s, tensors, step);
        if (step) steps[name->second] = *step;
        const LocalTensor* param = model_tensors.at("model/" + name->second);
        for (auto& [key, tensor] : tensors) {
          LocalTensor t;
          t.name = "optim/" + name->second + "/" + key;
          t.tensor = tensor.detach();
          t.global_shape = tensor.sizes().vec();
          if (param->split_dim >= 0 && tensor.sizes() == param->tensor.sizes()) {
            t.global_shape = param->global_shape;
            t.split_dim = param->split_dim;
            t.offset = param->offset;
          }
          state.push_back(std::move(t));
        }
      }
      groups.push_back({{"params", std::move(params)}, {"options", options_json(*kind, group.options())}});
    }
    if (!unnamed.empty()) {
      std::string list;
      for (size_t i = 0; i < unnamed.size() && i < 8; ++i) list += (i ? ", " : "") + unnamed[i];
      throw CheckpointError(where + ": " + std::to_string(unnamed.size()) +
                            " optimizer parameter(s) are not parameters of the model (shapes " + list + ")");
    }
    out.optimizer = {{"type", kind_name(*kind)}, {"param_groups", std::move(groups)}, {"steps", std::move(steps)}};
    for (auto& t : state) out.tensors.push_back(std::move(t));
  }

  if (targets.scaler) {
    out.scaler = json::object();
    for (const auto& [key, value] : targets.scaler->state_dict()) out.scaler[key] = value;
  }

  const std::string prefix = rng_prefix(rank);
  for (auto& [key, state] : rng_states(targets)) {
    LocalTensor t;
    t.name = prefix + key;
    t.tensor = state;
    t.global_shape = state.sizes().vec();
    out.tensors.push_back(std::move(t));
  }
  for (const auto& [name, tensor] : targets.extra) {
    LocalTensor t;
    t.name = "extra/" + name;
    t.tensor = tensor.detach();
    t.global_shape = tensor.sizes().vec();
    out.tensors.push_back(std::move(t));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const LocalTensor& a, const LocalTensor& b) { return a.name < b.name; });
  for (size_t i = 1; i < out.tensors.size(); ++i)
    if (out.tensors[i].name == out.tensors[i - 1].name)
      throw CheckpointError(where + ": two tensors are both named " + out.tensors[i].name);
  return out;
}

std::vector<std::string> check_optimizer(const Targets& targets, const json& saved) {
  std::vector<std::string> problems;
  if (!targets.optimizer) return problems;
  auto& optimizer = *targets.optimizer;
  const auto kind = kind_of(optimizer);
  if (!kind) return {"the optimizer is not one of torch::optim::SGD, Adam, AdamW"};
  if (saved.is_null()) return {"the checkpoint holds no optimizer state"};
  if (!saved.contains("type") || !saved["type"].is_string() || saved["type"].get<std::string>() != kind_name(*kind))
    return {"the checkpoint's optimizer is " +
            (saved.contains("type") ? saved["type"].dump() : std::string("unnamed")) + "; the live one is " +
            kind_name(*kind)};
  if (!saved.contains("param_groups") || !saved["param_groups"].is_array() || !saved.contains("steps") ||
      !saved["steps"].is_object())
    return {"the checkpoint's optimizer section has no param_groups or steps"};
  const json& groups = saved["param_groups"];
  const auto& live = optimizer.param_groups();
  if (groups.size() != live.size())
    return {"the checkpoint's optimizer has " + std::to_string(groups.size()) + " parameter groups; the live one has " +
            std::to_string(live.size())};
  if (!targets.model) return {"the optimizer's state is loaded by parameter name: register the model too"};
  const auto names = parameter_names(*targets.model);
  for (size_t g = 0; g < live.size(); ++g) {
    const std::string context = "optimizer parameter group " + std::to_string(g) + ": ";
    const json& group = groups[g];
    if (!group.is_object() || !group.contains("params") || !group["params"].is_array() || !group.contains("options") ||
        !group["options"].is_object()) {
      problems.push_back(context + "malformed in the checkpoint");
      continue;
    }
    std::vector<std::string> saved_names, live_names;
    for (const auto& n : group["params"]) saved_names.push_back(n.is_string() ? n.get<std::string>() : n.dump());
    for (const auto& p : live[g].params()) {
      auto it = names.find(p.unsafeGetTensorImpl());
      live_names.push_back(it == names.end() ? "(not in the model)" : it->second);
    }
    if (saved_names != live_names) {
      std::string diff;
      for (const auto& n : saved_names)
        if (std::find(live_names.begin(), live_names.end(), n) == live_names.end()) diff += " -" + n;
      for (const auto& n : live_names)
        if (std::find(saved_names.begin(), saved_names.end(), n) == saved_names.end()) diff += " +" + n;
      problems.push_back(context + "parameters differ (- only in the checkpoint, + only live):" +
                         (diff.empty() ? std::string(" same names in another order") : diff));
    }
    const json& options = group["options"];
    for (const auto& [key, type] : option_keys(*kind)) {
      const bool ok =
          options.contains(key) && (type == 'd'   ? options[key].is_number()
                                    : type == 'b' ? options[key].is_boolean()
                                                  : options[key].is_array() && options[key].size() == 2 &&
                                                        options[key][0].is_number() && options[key][1].is_number());
      if (!ok) problems.push_back(context + "option \"" + key + "\" missing or malformed in the checkpoint");
    }
  }
  for (auto it = saved["steps"].begin(); it != saved["steps"].end(); ++it)
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0)
      problems.push_back("optimizer step count of " + it.key() + " is " + it.value().dump());
  return problems;
}

std::vector<std::string> check_scaler(const Targets& targets, const json& saved) {
  if (!targets.scaler || !targets.scaler->is_enabled()) return {};
  if (saved.is_null() || !saved.is_object() || saved.empty())
    return {"the checkpoint holds no grad scaler state (none, or a disabled one, was saved)"};
  std::vector<std::string> problems;
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    if (!saved.contains(key) || !saved[key].is_number())
      problems.push_back(std::string("grad scaler state \"") + key + "\" missing or not a number");
  if (!problems.empty()) return problems;
  // Loaded into a scratch scaler first: whatever it would refuse (a growth factor of 0.5, say) is
  // refused before anything live has changed.
  try {
    std::map<std::string, double> state;
    for (auto it = saved.begin(); it != saved.end(); ++it)
      if (it.value().is_number()) state[it.key()] = it.value().get<double>();
    GradScaler scratch;
    scratch.load_state_dict(state);
  } catch (const std::exception& e) {
    problems.push_back(std::string("grad scaler state refused: ") + e.what());
  }
  return problems;
}

void apply_optimizer(const Targets& targets, const json& saved, const std::map<std::string, at::Tensor>& tensors) {
  if (!targets.optimizer) return;
  auto& optimizer = *targets.optimizer;
  const auto kind = *kind_of(optimizer);
  const auto names = parameter_names(*targets.model);
  auto& groups = optimizer.param_groups();
  auto& state = optimizer.state();
  state.clear();
  const json& steps = saved["steps"];
  for (size_t g = 0; g < groups.size(); ++g) {
    set_options(kind, groups[g].options(), saved["param_groups"][g]["options"]);
    for (const auto& p : groups[g].params()) {
      const std::string& name = names.at(p.unsafeGetTensorImpl());
      const std::string prefix = "optim/" + name + "/";
      // Loaded tensors are fresh host tensors: moved to the parameter's device (a copy only off CPU).
      auto get = [&](const char* key) -> at::Tensor {
        auto it = tensors.find(prefix + key);
        return it == tensors.end() ? at::Tensor() : it->second.to(p.device());
      };
      const bool has_step = steps.contains(name);
      if (kind == OptimizerKind::SGD) {
        at::Tensor momentum = get("momentum_buffer");
        if (!momentum.defined()) continue;
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(momentum);
        state[state_key(state, p)] = std::move(s);
        continue;
      }
      at::Tensor exp_avg = get("exp_avg"), exp_avg_sq = get("exp_avg_sq"), max_sq = get("max_exp_avg_sq");
      if (!has_step && !exp_avg.defined()) continue;
      auto fill = [&](auto s) {
        s->step(has_step ? steps[name].get<int64_t>() : 0);
        s->exp_avg(exp_avg);
        s->exp_avg_sq(exp_avg_sq);
        s->max_exp_avg_sq(max_sq);
        state[state_key(state, p)] = std::move(s);
      };
      if (kind == OptimizerKind::Adam)
        fill(std::make_unique<torch::optim::AdamParamState>());
      else
        fill(std::make_unique<torch::optim::AdamWParamState>());
    }
  }
}

void apply_scaler(const Targets& targets, const json& saved) {
  if (!targets.scaler || !targets.scaler->is_enabled()) return;
  std::map<std::string, double> state;
  for (auto it = saved.begin(); it != saved.end(); ++it) state[it.key()] = it.value().get<double>();
  targets.scaler->load_state_dict(state);
}

void copy_into(at::Tensor& live, const at::Tensor& source) {
  at::NoGradGuard no_grad;
  live.copy_(source);
}

}  // namespace loom::detail::ckpt
