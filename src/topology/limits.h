// The limits every topology parser enforces, in one place (documented in docs/limits.md). A file
// beyond one is refused with a loom::topo::ParseError whose message names the limit, so hostile or
// broken input costs time and memory linear in its size, never more than these bounds allow.
#pragma once

#include <cstddef>
#include <string>

namespace loom::topo::limits {

inline constexpr size_t kFileBytes = 64u * 1024 * 1024;  // any topology file
inline constexpr int kGpusPerNode = 512;
inline constexpr int kNicsPerNode = 256;
inline constexpr long long kNodes = 100000;                 // after "replicate"
inline constexpr long long kLinkCells = 16LL * 1024 * 1024;  // GPU x GPU + GPU x NIC entries, all nodes
// CPU ids of every CPU list plus bytes of every note, name and bus id, over all nodes after
// "replicate" (a 100-byte file must not expand to gigabytes).
inline constexpr long long kExpandedItems = 32LL * 1024 * 1024;
// CPU ids in one node's lists as the text and XML readers build them (every GPU keeps its own
// list): 512 GPUs of 8192 CPUs each, and a few kilobytes of text cannot ask for more.
inline constexpr long long kNodeCpuIds = 4LL * 1024 * 1024;
// JSON: nesting depth (the schema needs 6) and values (objects, arrays, scalars), checked by a
// linear scan before the parser builds anything.
inline constexpr int kJsonDepth = 32;
inline constexpr long long kJsonValues = 8LL * 1024 * 1024;
// nvidia-smi topo -m text: lines and whitespace-separated fields.
inline constexpr size_t kTextLines = 100000;
inline constexpr size_t kTextFields = 4u * 1024 * 1024;

// "exceeds the limit of <value> <what> (docs/limits.md)": the common ending of limit messages.
inline std::string exceeded(long long value, const std::string& what) {
  return "exceeds the limit of " + std::to_string(value) + " " + what + " (docs/limits.md)";
}

// A value read from the input, as a message quotes it: at most 40 bytes, control bytes as '?', and
// its length when longer ("0000ffff,ffffffff,... (62914560 bytes)"), so a hostile file cannot make
// an error message as large as itself.
inline std::string quoted(const std::string& value, size_t at_most = 40) {
  std::string shown;
  for (size_t i = 0; i < value.size() && i < at_most; ++i)
    shown += static_cast<unsigned char>(value[i]) < 0x20 ? '?' : value[i];
  if (value.size() > at_most) shown += "... (" + std::to_string(value.size()) + " bytes)";
  return shown;
}

// The longest message a ParseError carries; past it the message is cut (a safety net behind
// quoted(): every parser's message stays bounded whatever it quotes).
inline constexpr size_t kMessageBytes = 1024;

}  // namespace loom::topo::limits
