// Executing a load plan (checkpoint_load_plan.h) against a storage: the shards this rank verifies
// are read whole and checksummed, the other pieces partially, and each need is assembled as a
// host tensor of this rank's shape.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/checkpoint_load_plan.h"
#include "train/checkpoint_provider.h"
#include "train/checkpoint_storage.h"

namespace loom::detail::ckpt {

// Bytes read are added to `bytes_read`. CheckpointError (prefixed by `where`) for anything damaged.
LoadedTensors read_planned(CheckpointStorage& storage, const std::string& path, const Manifest& manifest,
                           const std::vector<Need>& needs, const LoadPlan& plan, uint64_t& bytes_read,
                           const std::string& where);

}  // namespace loom::detail::ckpt
