// Recognising torch::optim's tensor-state optimizers and reading their per-parameter state.
#include "loom/parallel/optimizer_state.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <sstream>
#include <type_traits>

namespace loom {

using namespace torch::optim;

std::optional<OptimizerKind> optimizer_kind(Optimizer& optimizer) {
  if (dynamic_cast<AdamW*>(&optimizer)) return OptimizerKind::AdamW;
  if (dynamic_cast<Adam*>(&optimizer)) return OptimizerKind::Adam;
  if (dynamic_cast<SGD*>(&optimizer)) return OptimizerKind::SGD;
  if (dynamic_cast<RMSprop*>(&optimizer)) return OptimizerKind::RMSprop;
  if (dynamic_cast<Adagrad*>(&optimizer)) return OptimizerKind::Adagrad;
  return std::nullopt;
}

const char* optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::SGD: return "SGD";
    case OptimizerKind::Adam: return "Adam";
    case OptimizerKind::AdamW: return "AdamW";
    case OptimizerKind::RMSprop: return "RMSprop";
    case OptimizerKind::Adagrad: return "Adagrad";
  }
  return "?";
}

std::string unsupported_optimizer(Optimizer& optimizer, const std::string& cannot_be) {
  if (dynamic_cast<LBFGS*>(&optimizer))
    return "torch::optim::LBFGS cannot be " + cannot_be +
           " (its state is a closure's history, not tensors per parameter); supported are SGD, Adam, AdamW, "
           "RMSprop and Adagrad";
  return "the optimizer is not one of torch::optim::SGD, Adam, AdamW, RMSprop, Adagrad";
}

namespace {
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
}  // namespace

OptimizerParamState* find_optimizer_state(Optimizer& optimizer, const at::Tensor& parameter) {
  auto& state = optimizer.state();
  auto it = state.find(state_key(state, parameter));
  return it == state.end() ? nullptr : it->second.get();
}

void set_optimizer_state(Optimizer& optimizer, const at::Tensor& parameter,
                         std::unique_ptr<OptimizerParamState> state) {
  auto& map = optimizer.state();
  map[state_key(map, parameter)] = std::move(state);
}

std::vector<std::pair<std::string, at::Tensor>> optimizer_state_tensors(OptimizerKind kind,
                                                                        const OptimizerParamState& state,
                                                                        std::optional<int64_t>* step) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  auto add = [&](const char* key, const at::Tensor& t) {
    if (t.defined()) tensors.emplace_back(key, t);
  };
  auto set_step = [&](int64_t s) {
    if (step) *step = s;
  };
  switch (kind) {
    case OptimizerKind::SGD:
      add("momentum_buffer", static_cast<const SGDParamState&>(state).momentum_buffer());
      break;
    case OptimizerKind::Adam: {
      const auto& s = static_cast<const AdamParamState&>(state);
      set_step(s.step());
      add("exp_avg", s.exp_avg()), add("exp_avg_sq", s.exp_avg_sq()), add("max_exp_avg_sq", s.max_exp_avg_sq());
      break;
    }
    case OptimizerKind::AdamW: {
      const auto& s = static_cast<const AdamWParamState&>(state);
      set_step(s.step());
      add("exp_avg", s.exp_avg()), add("exp_avg_sq", s.exp_avg_sq()), add("max_exp_avg_sq", s.max_exp_avg_sq());
      break;
    }
    case OptimizerKind::RMSprop: {
      const auto& s = static_cast<const RMSpropParamState&>(state);
      set_step(s.step());
      add("square_avg", s.square_avg()), add("momentum_buffer", s.momentum_buffer()), add("grad_avg", s.grad_avg());
      break;
    }
    case OptimizerKind::Adagrad: {
      const auto& s = static_cast<const AdagradParamState&>(state);
      set_step(s.step());
      add("sum", s.sum());
      break;
    }
  }
  return tensors;
}

std::unique_ptr<OptimizerParamState> make_optimizer_state(OptimizerKind kind, const std::function<at::Tensor(const char*)>& get,
                                                std::optional<int64_t> step) {
  switch (kind) {
    case OptimizerKind::SGD: {
      at::Tensor momentum = get("momentum_buffer");
      if (!momentum.defined()) return nullptr;
      auto s = std::make_unique<SGDParamState>();
      s->momentum_buffer(momentum);
      return s;
    }
    case OptimizerKind::Adam:
    case OptimizerKind::AdamW: {
      at::Tensor exp_avg = get("exp_avg"), exp_avg_sq = get("exp_avg_sq"), max_sq = get("max_exp_avg_sq");
      if (!step && !exp_avg.defined()) return nullptr;
      auto fill = [&](auto s) -> std::unique_ptr<OptimizerParamState> {
        s->step(step.value_or(0));
        s->exp_avg(exp_avg);
        s->exp_avg_sq(exp_avg_sq);
        s->max_exp_avg_sq(max_sq);
        return s;
      };
      if (kind == OptimizerKind::Adam) return fill(std::make_unique<AdamParamState>());
      return fill(std::make_unique<AdamWParamState>());
    }
    case OptimizerKind::RMSprop: {
      at::Tensor square_avg = get("square_avg");
      if (!step && !square_avg.defined()) return nullptr;
      auto s = std::make_unique<RMSpropParamState>();
      s->step(step.value_or(0));
      s->square_avg(square_avg);
      s->momentum_buffer(get("momentum_buffer"));
      s->grad_avg(get("grad_avg"));
      return s;
    }
    case OptimizerKind::Adagrad: {
      at::Tensor sum = get("sum");
      if (!sum.defined()) return nullptr;  // Adagrad creates its state at construction
      auto s = std::make_unique<AdagradParamState>();
      s->step(step.value_or(0));
      s->sum(sum);
      return s;
    }
  }
  return nullptr;
}

std::unique_ptr<Optimizer> make_optimizer(OptimizerKind kind, std::vector<at::Tensor> parameters,
                                          const OptimizerOptions& options) {
  switch (kind) {
    case OptimizerKind::SGD: return std::make_unique<SGD>(parameters, static_cast<const SGDOptions&>(options));
    case OptimizerKind::Adam: return std::make_unique<Adam>(parameters, static_cast<const AdamOptions&>(options));
    case OptimizerKind::AdamW: return std::make_unique<AdamW>(parameters, static_cast<const AdamWOptions&>(options));
    case OptimizerKind::RMSprop:
      return std::make_unique<RMSprop>(parameters, static_cast<const RMSpropOptions&>(options));
    case OptimizerKind::Adagrad:
      return std::make_unique<Adagrad>(parameters, static_cast<const AdagradOptions&>(options));
  }
  return nullptr;
}

}  // namespace loom
