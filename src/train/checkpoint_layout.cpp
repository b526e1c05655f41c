#include "train/checkpoint_layout.h"

#include <algorithm>
#include <tuple>

#include "loom/error.h"
#include "train/safetensors.h"

namespace loom::detail::ckpt {

nlohmann::json descriptor_to_json(const Descriptor& d) {
  return nlohmann::json::array({d.name, *safetensors_dtype(d.dtype), d.global_shape, d.split_dim, d.offset, d.length,
                                d.lowest_rank_writes, d.bytes});
}

Descriptor descriptor_from_json(const nlohmann::json& j) {
  Descriptor d;
  d.name = j.at(0).get<std::string>();
  d.dtype = *parse_safetensors_dtype(j.at(1).get<std::string>());
  d.global_shape = j.at(2).get<std::vector<int64_t>>();
  d.split_dim = j.at(3).get<int>();
  d.offset = j.at(4).get<int64_t>();
  d.length = j.at(5).get<int64_t>();
  d.lowest_rank_writes = j.at(6).get<bool>();
  d.bytes = j.at(7).get<uint64_t>();
  return d;
}

namespace {

struct SliceHolders {
  int64_t length = 0;
  std::vector<int> holders;
  bool lowest = false;
  uint64_t bytes = 0;
};

struct TensorHolders {
  Descriptor first;  // the first rank's view, to compare the others with
  int first_rank = 0;
  std::map<int64_t, SliceHolders> slices;  // by offset
};

std::string describe(const Descriptor& d) {
  return std::string(c10::toString(d.dtype)) + " " + shape_to_string(d.global_shape) +
         (d.split_dim >= 0 ? " split along dim " + std::to_string(d.split_dim) : std::string(" whole"));
}

}  // namespace

SavePlan plan_save(const std::vector<std::vector<Descriptor>>& per_rank, const std::string& where) {
  std::map<std::string, TensorHolders> tensors;
  for (int r = 0; r < static_cast<int>(per_rank.size()); ++r) {
    for (const auto& d : per_rank[r]) {
      auto [it, inserted] = tensors.try_emplace(d.name);
      TensorHolders& t = it->second;
      if (inserted) {
        t.first = d;
        t.first_rank = r;
      } else if (t.first.dtype != d.dtype || t.first.global_shape != d.global_shape ||
                 t.first.split_dim != d.split_dim) {
        throw CheckpointError(where + ": ranks disagree about tensor " + d.name + ": rank " +
                              std::to_string(t.first_rank) + " has " + describe(t.first) + ", rank " +
                              std::to_string(r) + " has " + describe(d));
      }
      auto [s, new_slice] = t.slices.try_emplace(d.offset);
      if (new_slice) {
        s->second.length = d.length;
        s->second.bytes = d.bytes;
      } else if (s->second.length != d.length) {
        throw CheckpointError(where + ": ranks hold different slices of " + d.name + " at offset " +
                              std::to_string(d.offset) + ": lengths " + std::to_string(s->second.length) + " and " +
                              std::to_string(d.length) + " (rank " + std::to_string(r) + ")");
      }
      s->second.holders.push_back(r);
      s->second.lowest = s->second.lowest || d.lowest_rank_writes;
    }
  }

  SavePlan plan;
  plan.writes.resize(per_rank.size());
  plan.bytes.assign(per_rank.size(), 0);
  struct Pending {
    uint64_t bytes;
    std::string name;
    int64_t offset;
  };
  std::vector<Pending> order;
  for (auto& [name, t] : tensors) {
    TensorRecord record;
    record.dtype = t.first.dtype;
    record.shape = t.first.global_shape;
    record.split_dim = t.first.split_dim;
    const int64_t extent = record.split_dim >= 0 ? record.shape[record.split_dim] : 0;
    int64_t expected = 0;
    for (auto& [offset, s] : t.slices) {
      if (record.split_dim >= 0 && offset != expected)
        throw CheckpointError(where + ": the slices of " + name + " along dim " + std::to_string(record.split_dim) +
                              " do not tile it: one starts at " + std::to_string(offset) + ", expected " +
                              std::to_string(expected) + " (" + (offset < expected ? "overlap" : "gap") + ")");
      expected = offset + s.length;
      record.slices.push_back({-1, offset, s.length});
      order.push_back({s.bytes, name, offset});
    }
    if (record.split_dim >= 0 && expected != extent)
      throw CheckpointError(where + ": the slices of " + name + " cover [0, " + std::to_string(expected) + ") of dim " +
                            std::to_string(record.split_dim) + " of size " + std::to_string(extent));
    plan.tensors.emplace(name, std::move(record));
  }
  // Largest first onto the least-loaded holder: a greedy balance of the bytes each rank writes.
  std::stable_sort(order.begin(), order.end(), [](const Pending& a, const Pending& b) {
    return std::tie(b.bytes, a.name, a.offset) < std::tie(a.bytes, b.name, b.offset);
  });
  for (const auto& p : order) {
    const SliceHolders& s = tensors.at(p.name).slices.at(p.offset);
    int writer = s.holders.front();
    if (!s.lowest)
      for (int h : s.holders)
        if (plan.bytes[h] < plan.bytes[writer] || (plan.bytes[h] == plan.bytes[writer] && h < writer)) writer = h;
    plan.bytes[writer] += p.bytes;
    plan.writes[writer].insert(p.name);
    for (auto& slice : plan.tensors.at(p.name).slices)
      if (slice.offset == p.offset) slice.shard = writer;
  }
  return plan;
}

}  // namespace loom::detail::ckpt
