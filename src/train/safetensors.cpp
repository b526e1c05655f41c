#include "train/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>

#include "loom/error.h"
#include "train/checkpoint_checksum.h"
#include "loom/train/checkpoint_storage.h"

namespace loom::detail::ckpt {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; a big-endian host would need byte swaps");

namespace {

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},   {at::kShort, "I16"},  {at::kInt, "I32"},  {at::kLong, "I64"},      {at::kBool, "BOOL"}};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

[[noreturn]] void reject(const std::string& where, const std::string& what) {
  throw CheckpointError(where + ": " + what);
}

// nlohmann's parser is iterative, but the depth of what it builds is not bounded; a valid header
// nests three levels, so anything deeper is refused before parsing.
bool nesting_within(std::string_view json, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : json) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

uint64_t read_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::optional<std::string> safetensors_dtype(at::ScalarType dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return std::string(d.name);
  return std::nullopt;
}

std::optional<at::ScalarType> parse_safetensors_dtype(std::string_view name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

const TensorEntry* ShardHeader::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

std::optional<uint64_t> tensor_bytes(at::ScalarType dtype, const std::vector<int64_t>& shape, uint64_t limit) {
  uint64_t bytes = c10::elementSize(dtype);
  bool zero = false;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d == 0) zero = true;
  }
  if (zero) return 0;
  for (int64_t d : shape) {
    const uint64_t u = static_cast<uint64_t>(d);
    if (bytes > limit / u) return std::nullopt;  // bytes * u > limit
    bytes *= u;
  }
  return bytes;
}

std::string build_header(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const auto bytes = tensor_bytes(t.dtype, t.shape, UINT64_MAX);
    const auto dtype = safetensors_dtype(t.dtype);
    if (!bytes || !dtype)
      throw CheckpointError("safetensors: cannot store tensor " + t.name + " of dtype " +
                            std::string(c10::toString(t.dtype)) + " and shape " + shape_text(t.shape));
    header[t.name] = {{"dtype", *dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + *bytes}}};
    offset += *bytes;
  }
  std::string json = header.dump();
  // Padded with spaces so the data region starts 8-byte aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xff);
  return out + json;
}

void check_header_length(uint64_t declared, uint64_t file_bytes, const std::string& where) {
  if (file_bytes < 8)
    reject(where, "file has " + std::to_string(file_bytes) + " bytes, fewer than the 8-byte header length (truncated)");
  if (declared > kMaxHeaderBytes || declared > file_bytes - 8)
    reject(where, "header claims " + std::to_string(declared) + " bytes but the file has " +
                      std::to_string(file_bytes - 8) + " bytes after the length field (limit " +
                      std::to_string(kMaxHeaderBytes) + "): truncated or corrupt");
}

ShardHeader parse_header_json(std::string_view json, uint64_t data_bytes, const std::string& where) {
  if (json.empty() || json.front() != '{') reject(where, "header does not start with '{'");
  if (!nesting_within(json, 4)) reject(where, "header nests deeper than a safetensors header can");
  const nlohmann::json doc = nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) reject(where, "header is not a JSON object");

  ShardHeader header;
  header.data_bytes = data_bytes;
  header.data_start = 8 + json.size();
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& value = it.value();
    if (name == "__metadata__") {
      if (!value.is_object()) reject(where, "__metadata__ is not an object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string()) reject(where, "__metadata__ value of \"" + m.key() + "\" is not a string");
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string entry = "tensor \"" + name + "\"";
    if (name.empty()) reject(where, "a tensor has an empty name");
    if (!value.is_object() || value.size() != 3 || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets"))
      reject(where, entry + ": expected exactly the keys dtype, shape and data_offsets");
    const auto& dtype_json = value["dtype"];
    const auto& shape_json = value["shape"];
    const auto& offsets_json = value["data_offsets"];
    if (!dtype_json.is_string()) reject(where, entry + ": dtype is not a string");
    const auto dtype = parse_safetensors_dtype(dtype_json.get_ref<const std::string&>());
    if (!dtype) reject(where, entry + ": unsupported dtype \"" + dtype_json.get<std::string>() + "\"");
    if (!shape_json.is_array() || shape_json.size() > kMaxDims)
      reject(where, entry + ": shape is not an array of at most " + std::to_string(kMaxDims) + " dimensions");
    TensorEntry t;
    t.name = name;
    t.dtype = *dtype;
    for (const auto& d : shape_json) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 62))
        reject(where, entry + ": shape holds " + d.dump() + "; expected non-negative integers");
      t.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    if (!offsets_json.is_array() || offsets_json.size() != 2 || !offsets_json[0].is_number_unsigned() ||
        !offsets_json[1].is_number_unsigned())
      reject(where, entry + ": data_offsets is not a pair of non-negative integers");
    t.begin = offsets_json[0].get<uint64_t>();
    t.end = offsets_json[1].get<uint64_t>();
    if (t.begin > t.end || t.end > data_bytes)
      reject(where, entry + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                        "] outside the data region of " + std::to_string(data_bytes) + " bytes");
    const auto bytes = tensor_bytes(t.dtype, t.shape, data_bytes);
    if (!bytes || *bytes != t.end - t.begin) {
      const auto needed = tensor_bytes(t.dtype, t.shape, UINT64_MAX);
      reject(where, entry + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] hold " +
                        std::to_string(t.end - t.begin) + " bytes; shape " + shape_text(t.shape) + " x " +
                        dtype_json.get<std::string>() + " needs " +
                        (needed ? std::to_string(*needed) : std::string("more than 2^64")));
    }
    header.tensors.push_back(std::move(t));
  }
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (const auto& t : header.tensors) {
    if (t.begin != expected)
      reject(where, "tensor \"" + t.name + "\" starts at data offset " + std::to_string(t.begin) + "; expected " +
                        std::to_string(expected) + (t.begin < expected ? " (overlaps the previous one)" : " (gap)"));
    expected = t.end;
  }
  if (expected != data_bytes)
    reject(where, "tensors cover " + std::to_string(expected) + " bytes of a data region of " +
                      std::to_string(data_bytes) + " bytes");
  return header;
}

ShardHeader parse_shard(std::string_view bytes, const std::string& where) {
  if (bytes.size() < 8) check_header_length(0, bytes.size(), where);
  const uint64_t n = read_le64(reinterpret_cast<const unsigned char*>(bytes.data()));
  check_header_length(n, bytes.size(), where);
  return parse_header_json(bytes.substr(8, n), bytes.size() - 8 - n, where);
}

ShardHeader read_header(const ByteSource& file, uint64_t file_bytes, const std::string& where, Checksum* checksum) {
  check_header_length(0, file_bytes, where);
  unsigned char prefix[8];
  file.read(0, prefix, 8);
  const uint64_t n = read_le64(prefix);
  check_header_length(n, file_bytes, where);  // before the allocation sized by n
  std::string json(n, '\0');
  file.read(8, json.data(), n);
  if (checksum) {
    checksum->update(prefix, 8);
    checksum->update(json.data(), json.size());
  }
  return parse_header_json(json, file_bytes - 8 - n, where);
}

}  // namespace loom::detail::ckpt
