// The shard format over bytes: staging a rank's tensors into host memory (the stall of an
// asynchronous save), writing a shard into a storage's sink with its checksum computed on the way,
// and reading shards back from a storage's sources, whole and verified or only the entries a rank
// needs. No file is opened here: the storage (checkpoint_storage.h) moves the bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "train/checkpoint_storage.h"
#include "train/device_staging.h"
#include "train/checkpoint_manifest.h"
#include "train/safetensors.h"

namespace loom::detail::ckpt {

struct Region {
  const void* data;
  size_t bytes;
};

struct ShardWrite {
  std::string path;
  std::string header;                  // from build_header
  std::vector<Region> regions;         // the data region, in header order
  std::vector<at::Tensor> keep_alive;  // owners of the regions' memory
  bool inject_failure = false;         // test seam: fail as a full disk would
  std::string error;                   // set when the shard could not even be prepared
};

struct ShardWritten {
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;
};

// A fresh host tensor for data about to be overwritten whole (a read, a staging copy).
at::Tensor host_empty(at::IntArrayRef shape, at::ScalarType dtype, bool pinned = false);

// Writes the shard into `sink`, computing its checksum on the way, and commits it.
ShardWritten write_shard(ByteSink& sink, const ShardWrite& write, const std::string& where);
// The manifest of `checkpoint`, refused (before allocating) when larger than kMaxManifestBytes.
std::string read_manifest_text(CheckpointStorage& storage, const std::string& checkpoint, const std::string& where);

// Host memory holding a copy of the tensors a rank writes: the asynchronous save's snapshot. The
// buffer is pageable and reused by the next save when large enough; device tensors come through
// a ring of a few pinned slots (device_staging.h).
class Staging {
 public:
  // Copies `tensors` (any device) into the buffer; returns each tensor's bytes in order.
  std::vector<Region> stage(const std::vector<at::Tensor>& tensors);
  const at::Tensor& buffer() const { return buffer_; }
  void release() { buffer_ = at::Tensor(); }

 private:
  at::Tensor buffer_;
  DeviceToHostRing ring_;
};

// The regions of tensors written in place (a synchronous save): contiguous host copies only
// where a tensor is not already one; `keep_alive` receives the owners.
std::vector<Region> regions_in_place(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& keep_alive);

// Shard metadata (safetensors __metadata__, strings): the step the shard was written at, and a
// JSON object of the offsets of its split slices by tensor name.
inline constexpr const char* kShardStepKey = "torchloom.step";
inline constexpr const char* kShardSlicesKey = "torchloom.slices";

// Checks that the shard header holds every slice the manifest assigns to shard `index`, with the
// manifest's dtype and shape, and (where the shard records them) its step and slice offsets.
void check_header_against_manifest(const ShardHeader& header, const Manifest& manifest, int index,
                                   const std::string& where);

// Reads the whole shard `index` in order, checking its size and XXH3 against the manifest;
// returns the entries named in `wanted` as fresh host tensors.
std::map<std::string, at::Tensor> read_verified_shard(CheckpointStorage& storage, const std::string& checkpoint,
                                                      const Manifest& manifest, int index,
                                                      const std::set<std::string>& wanted, const std::string& where);

// An open shard whose header has been read and checked (no checksum: another rank verifies it).
struct OpenShard {
  std::unique_ptr<ByteSource> source;
  ShardHeader header;
  std::string where;  // names the rank, the operation and the shard
};
OpenShard open_shard(CheckpointStorage& storage, const std::string& checkpoint, const Manifest& manifest, int index,
                     const std::string& where);
// Rows [row_begin, row_begin + rows) of entry `name` (dim 0; all of it for a 0-dim tensor when
// rows < 0), as a fresh host tensor.
at::Tensor read_rows(const OpenShard& shard, const std::string& name, int64_t row_begin, int64_t rows);

}  // namespace loom::detail::ckpt
