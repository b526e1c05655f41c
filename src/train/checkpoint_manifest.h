// The manifest of a checkpoint (manifest.json): what a loader needs before it opens any shard —
// format version, the world layout the checkpoint was written at, every shard file with its size
// and XXH3-64 checksum, every logical tensor with its global shape, dtype and which shard holds
// which slice, and the non-tensor state (optimizer hyper-parameters and parameter groups, grad
// scaler, progress, user key-values). The format is documented in docs/checkpoint-format.md.
//
// parse_manifest validates everything it returns: a manifest that parses describes shards whose
// slices tile every tensor exactly, so the loader never has to check coverage again.
//
// The manifest is checksummed like the shards: it says which bytes are which tensor, so an edit of
// one digit (a slice's shard) would otherwise load another rank's slice silently. From format
// version 2 it carries "manifest_xxh3_64", the XXH3-64 of the compact serialisation of the document
// without that member (so re-indenting it is harmless, changing any value is not);
// check_manifest_integrity verifies it before the loader trusts anything in the file.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loom/train/checkpoint_state.h"

namespace loom::detail::ckpt {

inline constexpr int kFormatVersion = checkpoint::kFormatVersion;
// Version 1 manifests (no checksum of their own) are still read, with a warning.
inline constexpr int kOldestReadableVersion = 1;
inline constexpr const char* kManifestChecksumKey = "manifest_xxh3_64";
inline constexpr const char* kFormatName = "torchloom.checkpoint";
inline constexpr const char* kManifestName = "manifest.json";
inline constexpr uint64_t kMaxManifestBytes = 256ull << 20;
// Deepest JSON nesting a manifest may have (objects' states included): bounds the parser's recursion.
inline constexpr int kMaxManifestNesting = 32;

struct ShardRecord {
  std::string file;  // relative to the checkpoint directory
  int rank = 0;      // the rank that wrote it
  uint64_t bytes = 0;
  uint64_t xxh3 = 0;
};

using checkpoint::SliceRecord;
using checkpoint::TensorRecord;
using checkpoint::WorldLayout;

struct Manifest {
  int version = kFormatVersion;
  int64_t step = 0;
  WorldLayout world;
  std::vector<ShardRecord> shards;
  std::map<std::string, TensorRecord> tensors;
  nlohmann::json progress = nlohmann::json::object();  // step, epoch, sample
  // The providers' sections by name ("optimizer", "scaler", "accumulation", "objects", a user's);
  // from format version 3 the manifest's "state" object, before it top-level members.
  std::map<std::string, nlohmann::json> state;
  std::map<std::string, std::string> user;
  // The section of that name; null when none was saved.
  const nlohmann::json& section(const std::string& name) const;
};

std::string manifest_to_json(const Manifest& manifest);
// For a tensor split tensor_parallel ways (model state, its optimizer state, a tensor registered
// as a tensor-parallel slice): the refusal when the world's tp_ranks give a shard's rank another
// TP rank than the slice it holds (slice i is TP rank i's); nullopt when they agree or the tensor
// is not split so. parse_manifest applies it to model/, optim/ and master/ tensors.
std::optional<std::string> tensor_parallel_ranks_contradict(const Manifest& m, const std::string& name,
                                                            const TensorRecord& record);
// `where` names the manifest file in errors (loom::CheckpointError).
Manifest parse_manifest(std::string_view json, const std::string& where);

// Refuses (loom::CheckpointError naming `where`) a manifest whose own checksum is missing or does
// not match its content; returns false for a version-1 manifest, which has none to check. A text
// that is not a JSON object is left to parse_manifest to refuse.
bool check_manifest_integrity(std::string_view json, const std::string& where);
// The document with its checksum recomputed: for tools (and tests) that rewrite a manifest on purpose.
std::string reseal_manifest(std::string_view json);

std::string shard_file_name(int rank, int world_size);
std::string shape_to_string(const std::vector<int64_t>& shape);

}  // namespace loom::detail::ckpt
