// The state-provider seam, as the library's own providers use it: the public types
// (loom/train/checkpoint_state.h) under the checkpoint code's namespace, and the manifest they read.
#pragma once

#include "loom/train/checkpoint_state.h"
#include "train/checkpoint_layout.h"
#include "train/checkpoint_manifest.h"

namespace loom::detail::ckpt {

using checkpoint::copy_into;
using checkpoint::describe_slice;
using checkpoint::LoadContext;
using checkpoint::LoadedTensors;
using checkpoint::LocalTensor;
using checkpoint::Need;
using checkpoint::need_for;
using checkpoint::need_like;
using checkpoint::SaveState;
using checkpoint::StateProvider;

// The library's own providers by name, in the order a Checkpointer builds them
// (checkpoint_builtin_providers.cpp): the registry starts with these.
std::vector<std::pair<std::string, checkpoint::StateProviderFactory>> builtin_state_providers();

}  // namespace loom::detail::ckpt

namespace loom::checkpoint {
// The registered factories, in registration order (a Checkpointer builds one provider from each).
std::vector<std::pair<std::string, StateProviderFactory>> registered_state_provider_factories();
}  // namespace loom::checkpoint
