#include "train/checkpoint_read.h"

#include <map>
#include <memory>
#include <utility>

#include "train/checkpoint_io.h"

namespace loom::detail::ckpt {

namespace {

at::Tensor narrow_to(at::Tensor t, const Box& box, const std::vector<int64_t>& origin) {
  for (size_t d = 0; d < box.start.size(); ++d)
    t = t.narrow(static_cast<int64_t>(d), box.start[d] - origin[d], box.size[d]);
  return t;
}

}  // namespace

LoadedTensors read_planned(CheckpointStorage& storage, const std::string& path, const Manifest& m,
                           const std::vector<Need>& needs, const LoadPlan& plan, uint64_t& bytes_read,
                           const std::string& where) {
  // Shards this rank verifies are read whole (checksummed); from the others only the entries (or
  // rows) needed. Each datum is kept with its origin in global coordinates.
  std::map<std::pair<int, std::string>, std::pair<at::Tensor, std::vector<int64_t>>> data;
  for (const auto& [index, names] : plan.verify) {
    for (auto& [name, t] : read_verified_shard(storage, path, m, index, names, where)) {
      bytes_read += static_cast<uint64_t>(t.numel()) * t.element_size();
      const TensorRecord& r = m.tensors.at(name);
      for (const auto& slice : r.slices)
        if (slice.shard == index)
          data[{index, name}] = {t, slice_box(r.shape, r.split_dim, slice.offset, slice.length).start};
    }
  }
  std::map<int, OpenShard> open;
  for (const auto& p : plan.pieces) {
    if (plan.verify.count(p.shard)) continue;
    const std::string& name = needs[p.need].name;
    if (!open.count(p.shard)) open.emplace(p.shard, open_shard(storage, path, m, p.shard, where));
    std::vector<int64_t> origin = p.saved.start;
    at::Tensor t;
    if (p.rows_only) {
      t = read_rows(open.at(p.shard), name, p.inter.start[0] - p.saved.start[0], p.inter.size[0]);
      origin[0] = p.inter.start[0];
    } else {
      t = read_rows(open.at(p.shard), name, 0, -1);
    }
    bytes_read += static_cast<uint64_t>(t.numel()) * t.element_size();
    data[{p.shard, name}] = {t, origin};
  }
  // Each need from its pieces (the data itself when one piece is exactly the need).
  std::map<size_t, std::vector<const Piece*>> by_need;
  for (const auto& p : plan.pieces) by_need[p.need].push_back(&p);
  LoadedTensors assembled;
  for (size_t n = 0; n < needs.size(); ++n) {
    const Need& need = needs[n];
    const auto& list = by_need[n];
    if (list.size() == 1) {
      const auto& [t, origin] = data.at({list[0]->shard, need.name});
      if (origin == need.box.start && t.sizes().vec() == need.local_shape) {
        assembled[need.name] = t;
        continue;
      }
    }
    at::Tensor out = host_empty(need.local_shape, need.record->dtype);
    for (const Piece* p : list) {
      const auto& [t, origin] = data.at({p->shard, need.name});
      narrow_to(out, p->inter, need.box.start).copy_(narrow_to(t, p->inter, origin));
    }
    assembled[need.name] = out;
  }
  return assembled;
}

}  // namespace loom::detail::ckpt
