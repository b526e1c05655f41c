// Where each byte a rank loads comes from: the pure (communication-free, I/O-free) planning of a
// load, beside the save planner (checkpoint_layout.h).
//
// Given the manifest and this rank's needs (a box of a saved tensor each, in global coordinates),
// the plan lists the pieces: which saved slice, in which shard, covers which part of which need.
// Every shard is verified (read whole, checksummed) by exactly one rank, round-robin, so a load
// reads each byte of the checkpoint at least once across the job whatever the layout; this rank
// keeps from the shards it verifies the entries it needs, and reads the rest of its pieces from
// other shards partially (only the rows needed, where a piece spans every other dimension).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "train/checkpoint_layout.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_provider.h"

namespace loom::detail::ckpt {

struct Piece {
  size_t need = 0;  // index into the needs
  int shard = 0;
  Box saved;  // the slice as stored
  Box inter;  // the part the need takes from it
  // Read partially: rows [inter.start[0], + inter.size[0]) of the slice when rows_only, else the
  // whole slice. Unused for pieces of shards this rank verifies.
  bool rows_only = false;
};

struct LoadPlan {
  std::vector<Piece> pieces;
  // Shards this rank reads whole and checksums, with the entries it keeps from each.
  std::map<int, std::set<std::string>> verify;
  // Needs the saved slices do not fully cover (a manifest that parses tiles every tensor, so this
  // is empty unless a need reaches outside its tensor): "name: covered of volume".
  std::vector<std::string> uncovered;
};

LoadPlan plan_load(const Manifest& manifest, const std::vector<Need>& needs, int rank, int size);

}  // namespace loom::detail::ckpt
