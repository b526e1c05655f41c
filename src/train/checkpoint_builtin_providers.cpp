// The library's own kinds of state, as the registry starts with them (in this order, the order
// they collect and apply in): the registry itself (checkpoint_state.cpp) knows none of them.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/train/checkpoint.h"
#include "train/checkpoint_provider.h"
#include "train/checkpoint_providers.h"

namespace loom::detail::ckpt {

namespace {

template <typename Provider>
Provider& built_in(Checkpointer& owner, const char* name) {
  return owner.provider<Provider>(name);
}

}  // namespace

std::vector<std::pair<std::string, checkpoint::StateProviderFactory>> builtin_state_providers() {
  // The optimizer's state is saved by the model's parameter names: those two find the model's provider.
  return {{"model", [](Checkpointer&) { return std::make_unique<ModelState>(); }},
          {"extra", [](Checkpointer&) { return std::make_unique<ExtraTensors>(); }},
          {"optimizer", [](Checkpointer& c) { return std::make_unique<OptimizerState>(built_in<ModelState>(c, "model")); }},
          {"zero", [](Checkpointer& c) { return std::make_unique<ZeroOptimizerState>(built_in<ModelState>(c, "model")); }},
          {"scaler", [](Checkpointer&) { return std::make_unique<ScalerState>(); }},
          {"rng", [](Checkpointer&) { return std::make_unique<RngState>(); }},
          {"accumulation", [](Checkpointer&) { return std::make_unique<AccumulationState>(); }},
          {"objects", [](Checkpointer&) { return std::make_unique<UserObjects>(); }}};
}

}  // namespace loom::detail::ckpt
