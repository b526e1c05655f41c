// Who writes what, and who reads what: the pure (communication-free) planning of a checkpoint.
//
// At save every rank describes what it holds (a Descriptor per tensor: the whole tensor, or a
// slice along one dimension); the descriptors of all ranks are exchanged, and every rank computes
// the same plan from them: each distinct slice is written once, by one of the ranks holding it
// (the lowest for buffers, otherwise the one with the fewest bytes so far, largest slices first:
// writes spread over the ranks, and DP replicas never write the same bytes twice). Slices that do
// not tile their tensor exactly, or ranks that disagree about a tensor's dtype or global shape,
// are errors here, before anything is written.
//
// At load, a rank's piece of a tensor is assembled from the saved slices that intersect it
// (boxes in global coordinates), whatever the layouts at save and at load.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "train/checkpoint_manifest.h"

namespace loom::detail::ckpt {

struct Descriptor {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> global_shape;
  int split_dim = -1;
  int64_t offset = 0, length = 0;  // along split_dim
  bool lowest_rank_writes = false;
  uint64_t bytes = 0;  // of this rank's piece
};

nlohmann::json descriptor_to_json(const Descriptor& d);
Descriptor descriptor_from_json(const nlohmann::json& j);

struct SavePlan {
  std::vector<std::set<std::string>> writes;    // per rank, the tensors it writes
  std::vector<uint64_t> bytes;                  // per rank, what it writes
  std::map<std::string, TensorRecord> tensors;  // manifest records; shard index = writer rank
};

// Throws CheckpointError (prefixed by `where`) for inconsistent or non-tiling descriptors.
SavePlan plan_save(const std::vector<std::vector<Descriptor>>& per_rank, const std::string& where);

using checkpoint::Box;
using checkpoint::intersect;
using checkpoint::slice_box;

}  // namespace loom::detail::ckpt
