// libFuzzer target: checkpoint manifests (scripts/fuzz.sh). A manifest is refused with
// CheckpointError or accepted, and an accepted one holds what the loader relies on without further
// checks: every slice names a shard in range, a split tensor's slices tile its dimension in order,
// replicated tensors have one slice, every shard's rank and every tp_ranks entry are in range and
// agree with the TP slices the shards hold, and it survives a round trip through manifest_to_json. The integrity check (the manifest's own
// checksum) refuses with CheckpointError or answers. Any other exception is a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "loom/error.h"
#include "train/checkpoint_manifest.h"

namespace ckpt = loom::detail::ckpt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    ckpt::check_manifest_integrity(text, "fuzz");
  } catch (const loom::CheckpointError&) {
  }
  ckpt::Manifest m;
  try {
    m = ckpt::parse_manifest(text, "fuzz");
  } catch (const loom::CheckpointError&) {
    return 0;
  }
  if (m.world.size < 1 || m.world.tp_ranks.size() != static_cast<size_t>(m.world.size)) std::abort();
  for (int tp_rank : m.world.tp_ranks)
    if (tp_rank < 0 || tp_rank >= m.world.tensor_parallel) std::abort();
  for (const auto& shard : m.shards)
    if (shard.rank < 0 || shard.rank >= m.world.size) std::abort();
  for (const auto& [name, record] : m.tensors) {
    if (record.slices.empty() || (record.split_dim < 0 && record.slices.size() != 1)) std::abort();
    int64_t covered = 0;
    for (const auto& slice : record.slices) {
      if (slice.shard < 0 || static_cast<size_t>(slice.shard) >= m.shards.size()) std::abort();
      if (record.split_dim >= 0 && slice.offset != covered) std::abort();
      covered += slice.length;
    }
    if (record.split_dim >= 0 && covered != record.shape.at(record.split_dim)) std::abort();
    // Model, optimizer and master state split tensor_parallel ways: slice i is TP rank i's.
    const bool tp_state = name.rfind("model/", 0) == 0 || name.rfind("optim/", 0) == 0 || name.rfind("master/", 0) == 0;
    if (tp_state && m.world.tensor_parallel > 1 && record.split_dim >= 0 &&
        record.slices.size() == static_cast<size_t>(m.world.tensor_parallel))
      for (size_t i = 0; i < record.slices.size(); ++i)
        if (m.world.tp_ranks.at(m.shards.at(record.slices[i].shard).rank) != static_cast<int>(i)) std::abort();
  }
  const ckpt::Manifest again = ckpt::parse_manifest(ckpt::manifest_to_json(m), "fuzz round trip");
  if (again.step != m.step || again.tensors.size() != m.tensors.size() || again.shards.size() != m.shards.size())
    std::abort();
  return 0;
}
