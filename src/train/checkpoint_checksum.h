// Checksums of checkpoint shard files: XXH3-64 over every byte of the file, computed while the
// file is written or read (streaming, so no second pass over the data), stored in the manifest as
// 16 lower-case hex digits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace loom::detail::ckpt {

class Checksum {
 public:
  Checksum();
  ~Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;

  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t, kept out of the header
};

// One-shot XXH3-64 of a buffer.
uint64_t checksum_of(const void* data, size_t bytes);

std::string to_hex(uint64_t value);
// nullopt unless `text` is exactly 16 hex digits.
std::optional<uint64_t> parse_hex(std::string_view text);

}  // namespace loom::detail::ckpt
