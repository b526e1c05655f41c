#include "train/checkpoint_load_plan.h"

namespace loom::detail::ckpt {

namespace {

int64_t volume(const Box& box) {
  int64_t v = 1;
  for (auto d : box.size) v *= d;
  return v;
}

}  // namespace

LoadPlan plan_load(const Manifest& manifest, const std::vector<Need>& needs, int rank, int size) {
  LoadPlan plan;
  std::vector<int64_t> covered(needs.size(), 0);
  for (size_t n = 0; n < needs.size(); ++n) {
    const TensorRecord& r = *needs[n].record;
    for (const auto& slice : r.slices) {
      const Box saved = slice_box(r.shape, r.split_dim, slice.offset, slice.length);
      auto inter = intersect(needs[n].box, saved);
      if (!inter) continue;
      Piece piece{n, slice.shard, saved, *inter, false};
      // Only the rows needed when the piece spans every other dimension of the slice.
      piece.rows_only = !saved.start.empty();
      for (size_t d = 1; piece.rows_only && d < saved.start.size(); ++d)
        piece.rows_only = inter->size[d] == saved.size[d];
      covered[n] += volume(*inter);
      plan.pieces.push_back(std::move(piece));
    }
  }
  for (int i = rank; i < static_cast<int>(manifest.shards.size()); i += size) plan.verify[i];
  for (const auto& p : plan.pieces)
    if (plan.verify.count(p.shard)) plan.verify[p.shard].insert(needs[p.need].name);
  for (size_t n = 0; n < needs.size(); ++n)
    if (covered[n] != volume(needs[n].box))
      plan.uncovered.push_back(needs[n].name + ": " + std::to_string(covered[n]) + " of " +
                               std::to_string(volume(needs[n].box)) + " elements");
  return plan;
}

}  // namespace loom::detail::ckpt
