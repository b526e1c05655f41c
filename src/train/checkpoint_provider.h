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
using checkpoint::SaveState;
using checkpoint::StateProvider;

}  // namespace loom::detail::ckpt

namespace loom::checkpoint {
// The registered factories, in registration order (a Checkpointer builds one provider from each).
std::vector<std::pair<std::string, StateProviderFactory>> registered_state_provider_factories();
}  // namespace loom::checkpoint
