// The optimizer's state: hyper-parameters, parameter groups (by parameter name) and step counts
// in the manifest's "optimizer" section; state tensors under optim/<param>/<key>, sliced like their
// parameter, so they reshard with it. SGD, Adam, AdamW, RMSprop and Adagrad (LibTorch's optimizers
// whose state is tensors and a step); LBFGS (a closure and history) is refused by name.
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <ATen/Dispatch.h>
#include <ATen/ops/zeros.h>
#include <c10/util/overflows.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <type_traits>

#include "loom/error.h"
#include "loom/parallel/optimizer_state.h"
#include "train/checkpoint_providers.h"

namespace loom::detail::ckpt {

namespace {

using json = nlohmann::json;
using namespace torch::optim;

using Kind = OptimizerKind;

// Each kind's hyper-parameters: 'd' double, 'b' bool, 'p' pair of doubles.
std::vector<std::pair<const char*, char>> option_keys(Kind kind) {
  switch (kind) {
    case Kind::SGD:
      return {{"lr", 'd'}, {"momentum", 'd'}, {"dampening", 'd'}, {"weight_decay", 'd'}, {"nesterov", 'b'}};
    case Kind::Adam:
    case Kind::AdamW:
      return {{"lr", 'd'}, {"betas", 'p'}, {"eps", 'd'}, {"weight_decay", 'd'}, {"amsgrad", 'b'}};
    case Kind::RMSprop:
      return {{"lr", 'd'}, {"alpha", 'd'}, {"eps", 'd'}, {"weight_decay", 'd'}, {"momentum", 'd'}, {"centered", 'b'}};
    case Kind::Adagrad:
      return {{"lr", 'd'}, {"lr_decay", 'd'}, {"weight_decay", 'd'}, {"initial_accumulator_value", 'd'}, {"eps", 'd'}};
  }
  return {};
}

json options_json(Kind kind, const OptimizerOptions& options) {
  switch (kind) {
    case Kind::SGD: {
      const auto& o = static_cast<const SGDOptions&>(options);
      return {{"lr", o.lr()}, {"momentum", o.momentum()}, {"dampening", o.dampening()},
              {"weight_decay", o.weight_decay()}, {"nesterov", o.nesterov()}};
    }
    case Kind::Adam: {
      const auto& o = static_cast<const AdamOptions&>(options);
      return {{"lr", o.lr()}, {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}}, {"eps", o.eps()},
              {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
    }
    case Kind::AdamW: {
      const auto& o = static_cast<const AdamWOptions&>(options);
      return {{"lr", o.lr()}, {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}}, {"eps", o.eps()},
              {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
    }
    case Kind::RMSprop: {
      const auto& o = static_cast<const RMSpropOptions&>(options);
      return {{"lr", o.lr()}, {"alpha", o.alpha()}, {"eps", o.eps()}, {"weight_decay", o.weight_decay()},
              {"momentum", o.momentum()}, {"centered", o.centered()}};
    }
    case Kind::Adagrad: {
      const auto& o = static_cast<const AdagradOptions&>(options);
      return {{"lr", o.lr()}, {"lr_decay", o.lr_decay()}, {"weight_decay", o.weight_decay()},
              {"initial_accumulator_value", o.initial_accumulator_value()}, {"eps", o.eps()}};
    }
  }
  return nullptr;
}

void set_options(Kind kind, OptimizerOptions& options, const json& j) {
  switch (kind) {
    case Kind::SGD: {
      auto& o = static_cast<SGDOptions&>(options);
      o.lr(j["lr"].get<double>()).momentum(j["momentum"].get<double>()).dampening(j["dampening"].get<double>());
      o.weight_decay(j["weight_decay"].get<double>()).nesterov(j["nesterov"].get<bool>());
      return;
    }
    case Kind::Adam: {
      auto& o = static_cast<AdamOptions&>(options);
      o.lr(j["lr"].get<double>()).eps(j["eps"].get<double>()).weight_decay(j["weight_decay"].get<double>());
      o.betas({j["betas"][0].get<double>(), j["betas"][1].get<double>()}).amsgrad(j["amsgrad"].get<bool>());
      return;
    }
    case Kind::AdamW: {
      auto& o = static_cast<AdamWOptions&>(options);
      o.lr(j["lr"].get<double>()).eps(j["eps"].get<double>()).weight_decay(j["weight_decay"].get<double>());
      o.betas({j["betas"][0].get<double>(), j["betas"][1].get<double>()}).amsgrad(j["amsgrad"].get<bool>());
      return;
    }
    case Kind::RMSprop: {
      auto& o = static_cast<RMSpropOptions&>(options);
      o.lr(j["lr"].get<double>()).alpha(j["alpha"].get<double>()).eps(j["eps"].get<double>());
      o.weight_decay(j["weight_decay"].get<double>()).momentum(j["momentum"].get<double>());
      o.centered(j["centered"].get<bool>());
      return;
    }
    case Kind::Adagrad: {
      auto& o = static_cast<AdagradOptions&>(options);
      o.lr(j["lr"].get<double>()).lr_decay(j["lr_decay"].get<double>()).weight_decay(j["weight_decay"].get<double>());
      o.initial_accumulator_value(j["initial_accumulator_value"].get<double>()).eps(j["eps"].get<double>());
      return;
    }
  }
}

// Builds an optimizer of `kind` from saved options on a scratch parameter: LibTorch's constructors
// check the ranges (a negative lr, betas outside [0, 1)), so what they refuse is refused here.
void check_options_on_scratch(Kind kind, const OptimizerOptions& live, const json& saved) {
  std::unique_ptr<OptimizerOptions> options = live.clone();
  set_options(kind, *options, saved);
  make_optimizer(kind, {at::zeros({1})}, *options);
}

// A step hands each hyper-parameter to its parameters' kernels as a Scalar (add_(p, weight_decay),
// addcdiv_(.., -lr), add_(eps)), converted to their dtype; LibTorch raises there for a value the
// dtype cannot hold (weight_decay 1e308 for float parameters), at the first step after the load.
// Refused here, by the same rule (c10::overflows), while nothing has changed.
void check_options_fit_dtypes(Kind kind, const json& options, const std::vector<at::Tensor>& params,
                              std::vector<std::string>& problems, const std::string& context) {
  std::set<at::ScalarType> dtypes;
  for (const auto& p : params)
    if (at::isFloatingType(p.scalar_type())) dtypes.insert(p.scalar_type());
  for (const auto& [key, type] : option_keys(kind)) {
    if (type == 'b') continue;
    std::vector<double> values;
    if (type == 'd') values = {options[key].get<double>()};
    else values = {options[key][0].get<double>(), options[key][1].get<double>()};
    for (const at::ScalarType dtype : dtypes)
      for (const double v : values) {
        bool overflows = false;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "check_options_fit_dtypes",
                                        [&] { overflows = c10::overflows<scalar_t, double>(v); });
        if (overflows) {
          std::ostringstream text;
          text << context << "option \"" << key << "\" is " << v << ", which the parameters' dtype "
               << c10::toString(dtype) << " cannot hold (its steps would fail)";
          problems.push_back(text.str());
        }
      }
  }
}

// The state tensors a parameter with state must have, and may have, for these saved options
// (LibTorch creates them together at a parameter's first step).
void state_keys(Kind kind, const json& options, std::set<std::string>& required, std::set<std::string>& allowed) {
  switch (kind) {
    case Kind::SGD:
      allowed = {"momentum_buffer"};
      return;
    case Kind::Adam:
    case Kind::AdamW:
      required = {"exp_avg", "exp_avg_sq"};
      if (options["amsgrad"].get<bool>()) required.insert("max_exp_avg_sq");
      allowed = required;
      return;
    case Kind::RMSprop:
      required = {"square_avg"};
      if (options["momentum"].get<double>() > 0) required.insert("momentum_buffer");
      if (options["centered"].get<bool>()) required.insert("grad_avg");
      allowed = required;
      return;
    case Kind::Adagrad:
      required = allowed = {"sum"};
      return;
  }
}

}  // namespace

void OptimizerState::collect(int /*rank*/, SaveState& out) {
  if (optimizer_ == nullptr) return;
  auto& optimizer = *optimizer_;
  const auto kind = optimizer_kind(optimizer);
  if (!kind) throw CheckpointError("cannot save the optimizer: " + unsupported_optimizer(optimizer, "checkpointed"));
  if (model_.model() == nullptr)
    throw CheckpointError("the optimizer's state is saved by parameter name: register the model too");
  const auto names = model_.parameter_names();
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
      const auto* s = find_optimizer_state(optimizer, p);
      if (s == nullptr) continue;
      std::optional<int64_t> step;
      const auto tensors = optimizer_state_tensors(*kind, *s, &step);
      if (step) steps[name->second] = *step;
      // The parameter's layout, so the state follows it when resharded.
      const LocalTensor* param = out.find("model/" + name->second);
      for (auto& [key, tensor] : tensors) {
        const std::string saved = "optim/" + name->second + "/" + key;
        if (param != nullptr && param->split_dim >= 0 && tensor.sizes() == param->tensor.sizes())
          state.push_back(describe_slice(saved, tensor, param->split_dim, param->global_shape, param->offset));
        else
          state.push_back(describe_slice(saved, tensor, -1, {}, 0));
      }
    }
    groups.push_back({{"params", std::move(params)}, {"options", options_json(*kind, group.options())}});
  }
  if (!unnamed.empty()) {
    std::string list;
    for (size_t i = 0; i < unnamed.size() && i < 8; ++i) list += (i ? ", " : "") + unnamed[i];
    throw CheckpointError(std::to_string(unnamed.size()) + " optimizer parameter(s) are not parameters of the model (shapes " +
                          list + ")");
  }
  out.sections["optimizer"] =
      json({{"type", optimizer_kind_name(*kind)}, {"param_groups", std::move(groups)}, {"steps", std::move(steps)}}).dump();
  for (auto& t : state) out.tensors.push_back(std::move(t));
}

namespace {

// One parameter group of the checkpoint's optimizer section against the live group `live_group`:
// the same parameters (by name), well-formed options the optimizer's constructor accepts.
void check_group(OptimizerKind kind, size_t g, const json& group, const torch::optim::OptimizerParamGroup& live_group,
                 const std::unordered_map<const c10::TensorImpl*, std::string>& names, bool pipelined,
                 std::vector<std::string>& problems) {
  const std::string context_text = "optimizer parameter group " + std::to_string(g) + ": ";
  if (!group.is_object() || !group.contains("params") || !group["params"].is_array() || !group.contains("options") ||
      !group["options"].is_object()) {
    problems.push_back(context_text + "malformed in the checkpoint");
    return;
  }
  std::vector<std::string> saved_names, live_names;
  for (const auto& n : group["params"]) saved_names.push_back(n.is_string() ? n.get<std::string>() : n.dump());
  for (const auto& p : live_group.params()) {
    auto it = names.find(p.unsafeGetTensorImpl());
    live_names.push_back(it == names.end() ? "(not in the model)" : it->second);
  }
  // A pipeline stage holds part of the saved group: only its own parameters must be there.
  const bool part_of_it = pipelined && std::all_of(live_names.begin(), live_names.end(), [&](const std::string& n) {
    return std::find(saved_names.begin(), saved_names.end(), n) != saved_names.end();
  });
  if (saved_names != live_names && !part_of_it) {
    std::string diff;
    for (const auto& n : saved_names)
      if (!pipelined && std::find(live_names.begin(), live_names.end(), n) == live_names.end()) diff += " -" + n;
    for (const auto& n : live_names)
      if (std::find(saved_names.begin(), saved_names.end(), n) == saved_names.end()) diff += " +" + n;
    problems.push_back(context_text + "parameters differ (- only in the checkpoint, + only live):" +
                       (diff.empty() ? std::string(" same names in another order") : diff) +
                       (pipelined ? "" : " (pipeline stages hold parts of a model: declare the layout, "
                                         "Checkpointer::parallel_layout)"));
  }
  const json& options = group["options"];
  bool well_formed = true;
  for (const auto& [key, type] : option_keys(kind)) {
    const bool ok =
        options.contains(key) && (type == 'd'   ? options[key].is_number()
                                  : type == 'b' ? options[key].is_boolean()
                                                : options[key].is_array() && options[key].size() == 2 &&
                                                      options[key][0].is_number() && options[key][1].is_number());
    if (!ok) problems.push_back(context_text + "option \"" + key + "\" missing or malformed in the checkpoint");
    well_formed = well_formed && ok;
  }
  if (!well_formed) return;
  // A checkpoint saved from Python carries torch.optim's options too: implementation choices
  // (foreach, fused, capturable, differentiable) do not change the update and are ignored; those
  // that do and that LibTorch's optimizers lack are refused rather than silently dropped.
  for (const char* key : {"maximize", "decoupled_weight_decay"}) {
    const bool decoupled_adamw = kind == Kind::AdamW && std::string(key) == "decoupled_weight_decay";
    if (options.contains(key) && options[key] != false && !decoupled_adamw)
      problems.push_back(context_text + "option \"" + key + "\" is " + options[key].dump() + ", which LibTorch's " +
                         optimizer_kind_name(kind) + " does not have");
  }
  try {
    check_options_on_scratch(kind, live_group.options(), options);
  } catch (const std::exception& e) {
    std::string what = e.what();
    problems.push_back(context_text + "options refused by " + optimizer_kind_name(kind) + ": " + what.substr(0, what.find('\n')));
  }
  check_options_fit_dtypes(kind, options, live_group.params(), problems, context_text);
}

// Each parameter's state is complete for the saved options (a manifest that lost one of them
// would leave an optimizer that fails at its next step), and nothing else.
void check_state_keys(OptimizerKind kind, const LoadContext& context, const json& groups, size_t group_count,
                      std::vector<std::string>& problems) {
  std::map<std::string, std::set<std::string>> saved_keys;  // parameter -> state keys
  for (const auto& [name, r] : context.manifest.tensors)
    if (name.rfind("optim/", 0) == 0) {
      const size_t slash = name.find_last_of('/');
      saved_keys[name.substr(6, slash - 6)].insert(name.substr(slash + 1));
    }
  for (size_t g = 0; g < group_count; ++g) {
    std::set<std::string> required, allowed;
    state_keys(kind, groups[g]["options"], required, allowed);
    for (const auto& n : groups[g]["params"]) {
      const std::string param = n.get<std::string>();
      auto it = saved_keys.find(param);
      if (it == saved_keys.end()) continue;  // no state yet (never stepped)
      for (const auto& key : required)
        if (!it->second.count(key))
          problems.push_back("optimizer state of " + param + " lacks " + key + ", which " + optimizer_kind_name(kind) +
                             " with these options keeps for every parameter with state");
      for (const auto& key : it->second)
        if (!allowed.count(key))
          problems.push_back("optimizer state of " + param + " has " + key + ", which " + optimizer_kind_name(kind) +
                             " with these options does not keep");
    }
  }
}

// State tensors follow their parameter's live layout.
void plan_state_tensors(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) {
  const bool pipelined = context.pipelined();
  for (const auto& [name, r] : context.manifest.tensors) {
    if (name.rfind("optim/", 0) != 0) continue;
    const std::string param = "model/" + name.substr(6, name.find_last_of('/') - 6);
    const LocalTensor* p = context.live.find(param);
    if (p == nullptr && pipelined) continue;  // another stage's parameter
    if (p == nullptr) {
      problems.push_back("optimizer state " + name + " belongs to no live parameter");
      continue;
    }
    // Shape alone: state may be kept in another dtype than its parameter (fp32 beside bf16). Every
    // state tensor of the optimizers supported has its parameter's shape.
    if (auto mismatch = need_like(name, r, p, needs)) problems.push_back("optimizer state " + *mismatch);
  }
}

}  // namespace

std::string OptimizerState::merge_section(const std::string& section, const std::vector<std::string>& texts) const {
  json merged;
  for (size_t r = 0; r < texts.size(); ++r) {
    const json part = json::parse(texts[r]);
    if (r == 0) {
      merged = part;
      continue;
    }
    if (part["type"] != merged["type"] || part["param_groups"].size() != merged["param_groups"].size())
      throw CheckpointError("ranks' optimizers differ: " + merged["type"].dump() + " with " +
                            std::to_string(merged["param_groups"].size()) + " parameter group(s) against " +
                            part["type"].dump() + " with " + std::to_string(part["param_groups"].size()));
    for (size_t g = 0; g < part["param_groups"].size(); ++g) {
      json& into = merged["param_groups"][g];
      const json& from = part["param_groups"][g];
      if (from["options"] != into["options"])
        throw CheckpointError("parameter group " + std::to_string(g) + " has options " + from["options"].dump() +
                              " on one rank and " + into["options"].dump() + " on another");
      for (const auto& name : from["params"])
        if (std::find(into["params"].begin(), into["params"].end(), name) == into["params"].end())
          into["params"].push_back(name);
    }
    for (const auto& [name, step] : part["steps"].items()) {
      if (merged["steps"].contains(name) && merged["steps"][name] != step)
        throw CheckpointError("parameter " + name + " has taken " + merged["steps"][name].dump() +
                              " optimizer steps on one rank and " + step.dump() + " on another");
      merged["steps"][name] = step;
    }
  }
  (void)section;
  return merged.dump();
}

void OptimizerState::plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) {
  if (optimizer_ == nullptr) return;
  auto& optimizer = *optimizer_;
  const json& saved = context.manifest.section("optimizer");
  const auto kind = optimizer_kind(optimizer);
  if (!kind) return problems.push_back(unsupported_optimizer(optimizer, "checkpointed"));
  if (saved.is_null()) return problems.push_back("the checkpoint holds no optimizer state");
  if (!saved.contains("type") || !saved["type"].is_string() || saved["type"].get<std::string>() != optimizer_kind_name(*kind))
    return problems.push_back("the checkpoint's optimizer is " +
                              (saved.contains("type") ? saved["type"].dump() : std::string("unnamed")) +
                              "; the live one is " + optimizer_kind_name(*kind));
  if (!saved.contains("param_groups") || !saved["param_groups"].is_array() || !saved.contains("steps") ||
      !saved["steps"].is_object())
    return problems.push_back("the checkpoint's optimizer section has no param_groups or steps");
  const json& groups = saved["param_groups"];
  const auto& live = optimizer.param_groups();
  if (groups.size() != live.size())
    return problems.push_back("the checkpoint's optimizer has " + std::to_string(groups.size()) +
                              " parameter groups; the live one has " + std::to_string(live.size()));
  if (model_.model() == nullptr)
    return problems.push_back("the optimizer's state is loaded by parameter name: register the model too");
  const auto names = model_.parameter_names();
  const size_t before = problems.size();
  for (size_t g = 0; g < live.size(); ++g) check_group(*kind, g, groups[g], live[g], names, context.pipelined(), problems);
  for (auto it = saved["steps"].begin(); it != saved["steps"].end(); ++it)
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0)
      problems.push_back("optimizer step count of " + it.key() + " is " + it.value().dump());
  if (problems.size() != before) return;

  check_state_keys(*kind, context, groups, live.size(), problems);
  if (problems.size() != before) return;
  plan_state_tensors(context, needs, problems);
}

void OptimizerState::apply(const LoadContext& context, const LoadedTensors& data) {
  if (optimizer_ == nullptr) return;
  auto& optimizer = *optimizer_;
  const json& saved = context.manifest.section("optimizer");
  const auto kind = *optimizer_kind(optimizer);
  const auto names = model_.parameter_names();
  auto& groups = optimizer.param_groups();
  auto& state = optimizer.state();
  context.discard(std::move(state));
  state.clear();
  const json& steps = saved["steps"];
  for (size_t g = 0; g < groups.size(); ++g) {
    set_options(kind, groups[g].options(), saved["param_groups"][g]["options"]);
    for (const auto& p : groups[g].params()) {
      const std::string& name = names.at(p.unsafeGetTensorImpl());
      const std::string prefix = "optim/" + name + "/";
      // Loaded tensors are fresh host tensors: moved to the parameter's device (a copy only off CPU).
      auto get = [&](const char* key) -> at::Tensor {
        auto it = data.find(prefix + key);
        return it == data.end() ? at::Tensor() : it->second.to(p.device());
      };
      std::optional<int64_t> step;
      if (steps.contains(name)) step = steps[name].get<int64_t>();
      if (auto s = make_optimizer_state(kind, get, step)) set_optimizer_state(optimizer, p, std::move(s));
    }
  }
}

}  // namespace loom::detail::ckpt
