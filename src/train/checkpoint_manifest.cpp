#include "train/checkpoint_manifest.h"

#include <cstdio>
#include <set>

#include "loom/error.h"
#include "loom/parallel/layout.h"
#include "train/checkpoint_checksum.h"
#include "train/safetensors.h"

namespace loom::detail::ckpt {

namespace {

using json = nlohmann::json;

[[noreturn]] void reject(const std::string& where, const std::string& what) {
  throw CheckpointError(where + ": " + what);
}

// Like the shard header's: a manifest nesting deeper than max_depth (kMaxManifestNesting) is refused
// before it is parsed.
bool nesting_within(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

const json& member(const json& object, const char* key, const std::string& where, const std::string& context) {
  auto it = object.find(key);
  if (it == object.end()) reject(where, context + "has no \"" + key + "\"");
  return *it;
}

int64_t integer(const json& object, const char* key, int64_t min, int64_t max, const std::string& where,
                const std::string& context) {
  const json& v = member(object, key, where, context);
  if (!v.is_number_integer()) reject(where, context + "\"" + key + "\" is not an integer");
  const int64_t value =
      v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : v.get<int64_t>();
  if (value < min || value > max)
    reject(where, context + "\"" + key + "\" is " + std::to_string(value) + "; expected " + std::to_string(min) + ".." +
                      std::to_string(max));
  return value;
}

bool safe_file_name(const std::string& name) {
  if (name.empty() || name.size() > 255 || name == "." || name == "..") return false;
  for (char c : name)
    if (c == '/' || c == '\0') return false;
  return true;
}

// The checksum of a manifest's content: XXH3-64 of its compact serialisation (member order kept).
uint64_t checksum_of_document(const nlohmann::ordered_json& doc) {
  const std::string compact = doc.dump();
  return checksum_of(compact.data(), compact.size());
}

}  // namespace

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string shard_file_name(int rank, int world_size) {
  char name[64];
  std::snprintf(name, sizeof(name), "shard-%05d-of-%05d.safetensors", rank, world_size);
  return name;
}

const json& Manifest::section(const std::string& name) const {
  static const json none;
  auto it = state.find(name);
  return it == state.end() ? none : it->second;
}

std::string manifest_to_json(const Manifest& m) {
  nlohmann::ordered_json doc;
  doc["format"] = kFormatName;
  doc["format_version"] = kFormatVersion;  // the layout below is this version's, whatever was read
  doc["step"] = m.step;
  doc["world"] = {{"size", m.world.size},
                  {"tensor_parallel", m.world.tensor_parallel},
                  {"data_parallel", m.world.data_parallel},
                  {"tp_ranks", m.world.tp_ranks}};
  if (!m.world.layout.empty()) {
    doc["world"]["layout"] = m.world.layout;
    doc["world"]["positions"] = m.world.positions;
  }
  doc["progress"] = m.progress;
  auto& shards = doc["shards"] = nlohmann::ordered_json::array();
  for (const auto& s : m.shards)
    shards.push_back({{"file", s.file}, {"rank", s.rank}, {"bytes", s.bytes}, {"xxh3_64", to_hex(s.xxh3)}});
  auto& tensors = doc["tensors"] = nlohmann::ordered_json::object();
  for (const auto& [name, t] : m.tensors) {
    nlohmann::ordered_json record;
    record["dtype"] = *safetensors_dtype(t.dtype);
    record["shape"] = t.shape;
    record["split_dim"] = t.split_dim >= 0 ? nlohmann::ordered_json(t.split_dim) : nlohmann::ordered_json(nullptr);
    auto& slices = record["slices"] = nlohmann::ordered_json::array();
    for (const auto& s : t.slices) {
      if (t.split_dim >= 0)
        slices.push_back({{"shard", s.shard}, {"offset", s.offset}, {"length", s.length}});
      else
        slices.push_back({{"shard", s.shard}});
    }
    tensors[name] = std::move(record);
  }
  auto& state = doc["state"] = nlohmann::ordered_json::object();
  for (const auto& [name, section] : m.state) state[name] = section;
  doc["user"] = m.user;
  doc[kManifestChecksumKey] = to_hex(checksum_of_document(doc));
  return doc.dump(1) + "\n";
}

bool check_manifest_integrity(std::string_view text, const std::string& where) {
  if (!nesting_within(text, kMaxManifestNesting)) return true;  // parse_manifest refuses it
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return true;
  const auto version = doc.find("format_version");
  const auto stored = doc.find(kManifestChecksumKey);
  if (version != doc.end() && version->is_number_integer() && version->get<int64_t>() == 1) {
    if (stored != doc.end())
      reject(where, std::string("says format version 1, which carries no checksum of its own, yet has \"") +
                        kManifestChecksumKey + "\": its version was edited (to skip the checksum)");
    return false;
  }
  if (stored == doc.end())
    reject(where, std::string("has no \"") + kManifestChecksumKey +
                      "\": the checksum of its own content, which every manifest of this format version carries");
  const auto expected = stored->is_string() ? parse_hex(stored->get<std::string>()) : std::nullopt;
  if (!expected) reject(where, std::string("\"") + kManifestChecksumKey + "\" is " + stored->dump() + "; expected 16 hex digits");
  doc.erase(kManifestChecksumKey);
  const uint64_t found = checksum_of_document(doc);
  if (found != *expected)
    reject(where, "was changed after it was written: the checksum of its content is " + to_hex(found) +
                      ", the manifest records " + to_hex(*expected) +
                      " (an edited manifest could load one rank's tensors into another; restore it, or reseal a "
                      "deliberate edit with the checkpoint tool)");
  return true;
}

std::string reseal_manifest(std::string_view text) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text.begin(), text.end());
  doc.erase(kManifestChecksumKey);
  doc[kManifestChecksumKey] = to_hex(checksum_of_document(doc));
  return doc.dump(1) + "\n";
}

std::optional<std::string> tensor_parallel_ranks_contradict(const Manifest& m, const std::string& name,
                                                            const TensorRecord& r) {
  if (m.world.tensor_parallel <= 1 || r.split_dim < 0 || r.slices.size() != static_cast<size_t>(m.world.tensor_parallel))
    return std::nullopt;
  for (size_t i = 0; i < r.slices.size(); ++i) {
    const int rank = m.shards.at(r.slices[i].shard).rank;
    if (m.world.tp_ranks.at(rank) != static_cast<int>(i))
      return "world: \"tp_ranks\" makes rank " + std::to_string(rank) + " tensor-parallel rank " +
             std::to_string(m.world.tp_ranks.at(rank)) + ", but its shard holds slice " + std::to_string(i) + " of " +
             std::to_string(r.slices.size()) + " of \"" + name + "\" (tensor-parallel rank " + std::to_string(i) +
             "'s)";
  }
  return std::nullopt;
}

namespace {

// A declared layout: parseable, as large as the world, agreeing with the tensor- and data-parallel
// sizes recorded beside it, and every rank at a position of its own.
ParallelLayout parse_declared_layout(const json& world, Manifest& m, const std::string& where) {
  const json& text = world["layout"];
  if (!text.is_string() || text.get<std::string>().size() > 4096)
    reject(where, "world: \"layout\" is not a layout text (e.g. \"dp=2,pp=2,tp=2\")");
  m.world.layout = text.get<std::string>();
  ParallelLayout layout;
  try {
    layout = ParallelLayout::parse(m.world.layout);
  } catch (const Error& e) {
    reject(where, std::string("world: \"layout\" ") + e.what());
  }
  if (layout.world_size() != m.world.size || layout.size("tp") != m.world.tensor_parallel ||
      layout.size("dp") != m.world.data_parallel)
    reject(where, "world: the layout " + m.world.layout + " (" + std::to_string(layout.world_size()) +
                      " ranks) disagrees with size " + std::to_string(m.world.size) + ", tensor_parallel " +
                      std::to_string(m.world.tensor_parallel) + " or data_parallel " +
                      std::to_string(m.world.data_parallel));
  const json& positions = member(world, "positions", where, "world: ");
  if (!positions.is_array() || positions.size() != static_cast<size_t>(m.world.size))
    reject(where, "world: \"positions\" is not an array of " + std::to_string(m.world.size) + " positions");
  std::vector<bool> taken(m.world.size, false);
  for (const auto& p : positions) {
    if (!p.is_number_integer() || p.get<int64_t>() < 0 || p.get<int64_t>() >= m.world.size || taken[p.get<int>()])
      reject(where, "world: \"positions\" holds " + p.dump() + "; expected each of 0.." +
                        std::to_string(m.world.size - 1) + " once");
    taken[p.get<int>()] = true;
    m.world.positions.push_back(p.get<int>());
  }
  return layout;
}

// The pieces of a manifest, each validated as parse_manifest describes (in this order: the
// tensors' slices name shards, and the TP check reads both).
void parse_world(const json& doc, Manifest& m, const std::string& where) {
  const json& world = member(doc, "world", where, "");
  if (!world.is_object()) reject(where, "\"world\" is not an object");
  m.world.size = static_cast<int>(integer(world, "size", 1, 1 << 24, where, "world: "));
  m.world.tensor_parallel = static_cast<int>(integer(world, "tensor_parallel", 1, 1 << 24, where, "world: "));
  m.world.data_parallel = static_cast<int>(integer(world, "data_parallel", 1, 1 << 24, where, "world: "));
  const bool declared = world.contains("layout");
  ParallelLayout layout;
  if (declared) {
    layout = parse_declared_layout(world, m, where);
  } else if (int64_t(m.world.tensor_parallel) * m.world.data_parallel != m.world.size) {
    reject(where, "world: tensor_parallel " + std::to_string(m.world.tensor_parallel) + " x data_parallel " +
                      std::to_string(m.world.data_parallel) + " != size " + std::to_string(m.world.size));
  }
  const json& tp_ranks = member(world, "tp_ranks", where, "world: ");
  if (!tp_ranks.is_array() || tp_ranks.size() != static_cast<size_t>(m.world.size))
    reject(where, "world: \"tp_ranks\" is not an array of " + std::to_string(m.world.size) + " ranks");
  for (const auto& r : tp_ranks) {
    if (!r.is_number_integer() || r.get<int64_t>() < 0 || r.get<int64_t>() >= m.world.tensor_parallel)
      reject(where,
             "world: \"tp_ranks\" holds " + r.dump() + "; expected 0.." + std::to_string(m.world.tensor_parallel - 1));
    m.world.tp_ranks.push_back(r.get<int>());
  }
  if (declared)
    for (int rank = 0; rank < m.world.size; ++rank) {
      const int expected = layout.coordinate(m.world.positions[rank], "tp");
      if (m.world.tp_ranks[rank] != expected)
        reject(where, "world: \"tp_ranks\" makes rank " + std::to_string(rank) + " tensor-parallel rank " +
                          std::to_string(m.world.tp_ranks[rank]) + ", but its position " +
                          std::to_string(m.world.positions[rank]) + " in " + m.world.layout + " is tp " +
                          std::to_string(expected));
    }
}

void parse_shards(const json& doc, Manifest& m, const std::string& where) {
  const json& shards = member(doc, "shards", where, "");
  if (!shards.is_array() || shards.empty() || shards.size() > (1u << 24))
    reject(where, "\"shards\" is not a non-empty array");
  std::set<std::string> files;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string context = "shard " + std::to_string(i) + ": ";
    const json& s = shards[i];
    if (!s.is_object()) reject(where, context + "is not an object");
    ShardRecord r;
    const json& file = member(s, "file", where, context);
    if (!file.is_string() || !safe_file_name(file.get<std::string>()))
      reject(where, context + "\"file\" is " + file.dump() + "; expected a file name inside the checkpoint directory");
    r.file = file.get<std::string>();
    if (!files.insert(r.file).second) reject(where, context + "file " + r.file + " is listed twice");
    r.rank = static_cast<int>(integer(s, "rank", 0, m.world.size - 1, where, context));
    r.bytes = static_cast<uint64_t>(integer(s, "bytes", 8, INT64_MAX, where, context));
    const json& hash = member(s, "xxh3_64", where, context);
    const auto value = hash.is_string() ? parse_hex(hash.get<std::string>()) : std::nullopt;
    if (!value) reject(where, context + "\"xxh3_64\" is " + hash.dump() + "; expected 16 hex digits");
    r.xxh3 = *value;
    m.shards.push_back(std::move(r));
  }
}

void parse_tensors(const json& doc, Manifest& m, const std::string& where) {
  const json& tensors = member(doc, "tensors", where, "");
  if (!tensors.is_object()) reject(where, "\"tensors\" is not an object");
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string context = "tensor \"" + it.key() + "\": ";
    const json& t = it.value();
    if (it.key().empty()) reject(where, "a tensor has an empty name");
    if (!t.is_object()) reject(where, context + "is not an object");
    TensorRecord r;
    const json& dtype = member(t, "dtype", where, context);
    const auto parsed = dtype.is_string() ? parse_safetensors_dtype(dtype.get<std::string>()) : std::nullopt;
    if (!parsed) reject(where, context + "unsupported dtype " + dtype.dump());
    r.dtype = *parsed;
    const json& shape = member(t, "shape", where, context);
    if (!shape.is_array() || shape.size() > kMaxDims)
      reject(where, context + "\"shape\" is not an array of dimensions");
    for (const auto& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 62))
        reject(where, context + "\"shape\" holds " + d.dump() + "; expected non-negative integers");
      r.shape.push_back(d.get<int64_t>());
    }
    if (!tensor_bytes(r.dtype, r.shape, UINT64_MAX))
      reject(where, context + "shape " + shape_to_string(r.shape) + " overflows");
    const json& split = member(t, "split_dim", where, context);
    if (split.is_null()) {
      r.split_dim = -1;
    } else if (split.is_number_integer() && split.get<int64_t>() >= 0 &&
               split.get<int64_t>() < static_cast<int64_t>(r.shape.size())) {
      r.split_dim = split.get<int>();
    } else {
      reject(where, context + "\"split_dim\" is " + split.dump() + "; expected null or 0.." +
                        std::to_string(static_cast<int64_t>(r.shape.size()) - 1));
    }
    const json& slices = member(t, "slices", where, context);
    if (!slices.is_array() || slices.empty()) reject(where, context + "\"slices\" is not a non-empty array");
    const int64_t extent = r.split_dim >= 0 ? r.shape[r.split_dim] : 0;
    for (const auto& s : slices) {
      if (!s.is_object()) reject(where, context + "a slice is not an object");
      SliceRecord slice;
      slice.shard = static_cast<int>(
          integer(s, "shard", 0, static_cast<int64_t>(m.shards.size()) - 1, where, context + "slice: "));
      if (r.split_dim >= 0) {
        slice.offset = integer(s, "offset", 0, extent, where, context + "slice: ");
        slice.length = integer(s, "length", 0, extent, where, context + "slice: ");
      }
      // A shard holds one entry per tensor name: two slices of one tensor cannot share a shard.
      for (const auto& other : r.slices)
        if (other.shard == slice.shard)
          reject(where, context + "places two slices in shard " + std::to_string(slice.shard) +
                            ", which holds one entry per tensor");
      r.slices.push_back(slice);
    }
    // Exact coverage: a replicated tensor is one slice; a split one is tiled in order with no gap
    // or overlap, and empty slices only for an empty dimension.
    if (r.split_dim < 0) {
      if (r.slices.size() != 1)
        reject(where, context + "has " + std::to_string(r.slices.size()) + " slices but no split_dim; expected one");
    } else {
      int64_t expected = 0;
      for (const auto& s : r.slices) {
        if (s.offset != expected)
          reject(where, context + "slices along dim " + std::to_string(r.split_dim) +
                            " do not cover it exactly: a slice starts at " + std::to_string(s.offset) + " where " +
                            std::to_string(expected) + " was expected (" + (s.offset < expected ? "overlap" : "gap") +
                            "); the dimension has " + std::to_string(extent));
        if (s.length == 0 && extent != 0)
          reject(where, context + "has an empty slice at offset " + std::to_string(s.offset));
        expected = s.offset + s.length;
      }
      if (expected != extent)
        reject(where, context + "slices along dim " + std::to_string(r.split_dim) + " cover [0, " +
                          std::to_string(expected) + ") of a dimension of " + std::to_string(extent));
    }
    m.tensors.emplace(it.key(), std::move(r));
  }
}

void check_tensor_parallel_ranks(const Manifest& m, const std::string& where) {
  // Each rank's tensor-parallel rank (which a load at another layout follows to pick RNG streams)
  // agrees with the TP slices its shard holds: slice i of a tensor split tensor_parallel ways, model
  // state or its optimizer state, is TP rank i's.
  // Tensors registered by name (extra/) are checked by their provider, which knows which are
  // tensor-parallel slices.
  for (const auto& [name, r] : m.tensors) {
    const bool tp_state = name.rfind("model/", 0) == 0 || name.rfind("optim/", 0) == 0 || name.rfind("master/", 0) == 0;
    if (!tp_state) continue;
    if (auto contradiction = tensor_parallel_ranks_contradict(m, name, r)) reject(where, *contradiction);
  }
}

void parse_state(const json& doc, Manifest& m, const std::string& where) {
  if (m.version >= 3) {
    const json& state = member(doc, "state", where, "");
    if (!state.is_object()) reject(where, "\"state\" is not an object");
    for (auto it = state.begin(); it != state.end(); ++it) m.state[it.key()] = it.value();
  } else {
    // Before version 3 the built-in sections were members of their own (objects from version 2,
    // when objects were saved) and the accumulation window was part of the progress.
    for (const char* name : {"optimizer", "scaler", "objects"}) {
      auto section = doc.find(name);
      if (section == doc.end()) {
        if (std::string(name) != "objects") member(doc, name, where, "");  // refuses the missing member
        continue;
      }
      if (!section->is_null()) m.state[name] = *section;
    }
    if (auto a = m.progress.find("accumulation"); a != m.progress.end() && !a->is_null()) m.state["accumulation"] = *a;
  }
  for (const char* name : {"optimizer", "scaler", "objects", "accumulation"})
    if (!m.section(name).is_null() && !m.section(name).is_object())
      reject(where, std::string("state \"") + name + "\" is neither null nor an object");
}

void parse_user(const json& doc, Manifest& m, const std::string& where) {
  const json& user = member(doc, "user", where, "");
  if (!user.is_object()) reject(where, "\"user\" is not an object");
  for (auto it = user.begin(); it != user.end(); ++it) {
    if (!it.value().is_string()) reject(where, "user value of \"" + it.key() + "\" is not a string");
    m.user[it.key()] = it.value().get<std::string>();
  }
}

}  // namespace

Manifest parse_manifest(std::string_view text, const std::string& where) {
  if (!nesting_within(text, kMaxManifestNesting)) reject(where, "nests deeper than a manifest can");
  const json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) reject(where, "is not a JSON object");
  const json& format = member(doc, "format", where, "");
  if (!format.is_string() || format.get<std::string>() != kFormatName)
    reject(where, "\"format\" is " + format.dump() + "; expected \"" + kFormatName + "\"");
  Manifest m;
  m.version = static_cast<int>(integer(doc, "format_version", 0, INT32_MAX, where, ""));
  if (m.version < kOldestReadableVersion || m.version > kFormatVersion)
    reject(where, "unsupported format version " + std::to_string(m.version) + " (this build reads versions " +
                      std::to_string(kOldestReadableVersion) + " to " + std::to_string(kFormatVersion) + ")");
  m.step = integer(doc, "step", 0, INT64_MAX, where, "");

  parse_world(doc, m, where);
  const json& progress = member(doc, "progress", where, "");
  if (!progress.is_object()) reject(where, "\"progress\" is not an object");
  m.progress = progress;

  parse_shards(doc, m, where);
  parse_tensors(doc, m, where);
  check_tensor_parallel_ranks(m, where);
  parse_state(doc, m, where);
  parse_user(doc, m, where);
  return m;
}

}  // namespace loom::detail::ckpt
