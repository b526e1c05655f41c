// libFuzzer target: checkpoint shards in the safetensors format (scripts/fuzz.sh). A shard is
// refused with CheckpointError or accepted, and an accepted one is what the loader reads without
// further checks: the header lies inside the file, the entries tile the data region in order with
// no gap or overlap, and each entry's bytes are exactly its dtype's size times its shape. Any
// other exception is a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "loom/error.h"
#include "train/safetensors.h"

namespace ckpt = loom::detail::ckpt;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ckpt::ShardHeader header;
  try {
    header = ckpt::parse_shard(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const loom::CheckpointError&) {
    return 0;
  }
  if (header.data_start < 8 || header.data_start + header.data_bytes != size) std::abort();
  uint64_t covered = 0;
  for (const auto& entry : header.tensors) {
    if (entry.begin != covered || entry.end < entry.begin) std::abort();
    const auto bytes = ckpt::tensor_bytes(entry.dtype, entry.shape, UINT64_MAX);
    if (!bytes || *bytes != entry.bytes()) std::abort();
    if (header.find(entry.name) != &entry) std::abort();
    covered = entry.end;
  }
  if (covered != header.data_bytes) std::abort();
  return 0;
}
