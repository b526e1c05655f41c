// The safetensors file format, written and read without trusting the file.
//
//   [8 bytes: N, little-endian u64][N bytes: JSON header, space-padded][data region]
//   header: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {"key": "value"}}
//
// Offsets are relative to the data region. A header is accepted only when (checked before any
// allocation sized by the file): N <= kMaxHeaderBytes and N <= file size - 8; the JSON nests at
// most a few levels; every entry has exactly a known dtype, a shape of non-negative integers and
// two offsets with begin <= end <= data size; end - begin == product(shape) * dtype size (no
// overflow); and the entries cover the data region exactly, in order, with no gap or overlap.
// That is safetensors' own `validate`: a file that passes can be read with no further checks.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::checkpoint {
class ByteSource;
}  // namespace loom::checkpoint

namespace loom::detail::ckpt {

class Checksum;
using checkpoint::ByteSource;

inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
inline constexpr size_t kMaxDims = 64;

// "F32", "BF16", ...; nullopt for a dtype safetensors (or torchloom) does not store.
std::optional<std::string> safetensors_dtype(at::ScalarType dtype);
std::optional<at::ScalarType> parse_safetensors_dtype(std::string_view name);

struct TensorSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

struct TensorEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // within the data region
  uint64_t bytes() const { return end - begin; }
};

struct ShardHeader {
  std::vector<TensorEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data region: 8 + N
  uint64_t data_bytes = 0;
  const TensorEntry* find(const std::string& name) const;
};

// Bytes of a tensor of this dtype and shape; nullopt on a negative dimension or on overflow past
// `limit`.
std::optional<uint64_t> tensor_bytes(at::ScalarType dtype, const std::vector<int64_t>& shape, uint64_t limit);

// The 8-byte length and the padded JSON of a shard holding `tensors` contiguously, in this order.
std::string build_header(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata);

// Checks the header length N a file declares against its size and the cap. `where` names the file.
void check_header_length(uint64_t declared, uint64_t file_bytes, const std::string& where);
// Validates the JSON header against a data region of `data_bytes`.
ShardHeader parse_header_json(std::string_view json, uint64_t data_bytes, const std::string& where);
// A whole shard in memory (tests and the fuzz target).
ShardHeader parse_shard(std::string_view bytes, const std::string& where);
// The header of a shard of `file_bytes` bytes; feeds the header's bytes to `checksum`.
ShardHeader read_header(const ByteSource& source, uint64_t file_bytes, const std::string& where, Checksum* checksum);

}  // namespace loom::detail::ckpt
