// The layout of every parallel dimension: named dimensions with sizes, outermost first, as
// PyTorch's DeviceMesh (its shape and mesh_dim_names) or Megatron-Core's order string. The last
// dimension varies fastest with the rank, so with "dp=2,pp=2,tp=2" positions 0 and 1 form a
// tensor-parallel group, {0, 2} a pipeline, and {0, 4} a data-parallel group.
//
//   loom::ParallelLayout layout = loom::ParallelLayout::standard(/*world=*/8, /*tp=*/2, /*pp=*/2);
//   layout.to_string();                    // "dp=2,pp=2,tp=2"
//   layout.group(5, {"pp"});               // {5, 7}: position 5's pipeline, stage by stage
//   layout.coordinate(5, "dp");            // 1
//   layout.describe(5);                    // "dp 1, pp 0, tp 1"
//
// A layout speaks of positions 0..world_size()-1; which world rank sits at each position is the
// placement's business (loom::make_parallel_groups takes that order beside the layout). Groups,
// ParallelState, the placement planner, loomrun and the checkpoint manifest all take this one
// description, so a new dimension is one entry here. A dimension the layout lacks has size 1.
//
// (This header is the core layer's, usable from every layer: it holds no tensors and calls no one.)
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace loom {

// The names the library's own dimensions use.
inline constexpr std::string_view kDataParallelDim = "dp";
inline constexpr std::string_view kPipelineParallelDim = "pp";
inline constexpr std::string_view kTensorParallelDim = "tp";

struct LayoutDimension {
  std::string name;  // lower-case letters, digits and '_', starting with a letter
  int size = 1;      // at least 1
  friend bool operator==(const LayoutDimension&, const LayoutDimension&) = default;
};

class ParallelLayout {
 public:
  // One position, no dimension.
  ParallelLayout() = default;
  // Outermost first. loom::InvalidArgumentError for an invalid name, a repeated name, a size below 1,
  // or a product above 2^24 positions.
  explicit ParallelLayout(std::vector<LayoutDimension> dimensions);

  // "dp=4,pp=2,tp=2" (to_string()'s form); "" is the layout of one position.
  static ParallelLayout parse(std::string_view text);
  // The dimensions named in `order` ("dp,pp,tp": outermost first), sized from `sizes`; exactly one
  // named dimension may be absent from `sizes` and takes the rest of world_size. Every size must
  // divide the world: the error names the dimension, its size and the world.
  //   ParallelLayout::arrange(8, "dp,pp,tp", {{"tp", 2}, {"pp", 2}})   // dp=2,pp=2,tp=2
  static ParallelLayout arrange(int world_size, std::string_view order, const std::vector<LayoutDimension>& sizes);
  // arrange(world_size, order, {{"tp", tensor_parallel}, {"pp", pipeline_parallel}}): data-parallel
  // replicas outermost, then pipeline stages, tensor-parallel ranks innermost (consecutive positions,
  // which the placement puts on the best-connected GPUs).
  static ParallelLayout standard(int world_size, int tensor_parallel, int pipeline_parallel = 1,
                                 std::string_view order = kStandardOrder);
  static constexpr std::string_view kStandardOrder = "dp,pp,tp";

  const std::vector<LayoutDimension>& dimensions() const { return dimensions_; }
  int world_size() const { return world_size_; }
  bool has(std::string_view name) const;
  // The dimension's size; 1 when the layout has no such dimension.
  int size(std::string_view name) const;

  // The coordinates of a position, one per dimension in layout order; loom::InvalidArgumentError
  // when position is outside 0..world_size()-1.
  std::vector<int> coordinates(int position) const;
  // One coordinate; 0 for a dimension the layout lacks.
  int coordinate(int position, std::string_view name) const;
  // The inverse of coordinates().
  int position(const std::vector<int>& coordinates) const;

  // The group of `position` along `names`: every position that differs from it only in those
  // dimensions, ordered by their coordinates (row-major in layout order). Names the layout lacks
  // add nothing ({} is the position alone); an unknown name is not an error, a repeated one is.
  std::vector<int> group(int position, const std::vector<std::string_view>& names) const;
  // Which of the groups along `names` holds position (row-major over the other coordinates), and
  // where in it position is: group(p, names)[rank_in_group(p, names)] == p.
  int group_index(int position, const std::vector<std::string_view>& names) const;
  int rank_in_group(int position, const std::vector<std::string_view>& names) const;
  // All groups along names, in group_index order.
  std::vector<std::vector<int>> groups(const std::vector<std::string_view>& names) const;

  // "dp=4,pp=2,tp=2"; "" for the layout of one position.
  std::string to_string() const;
  // "dp 1, pp 0, tp 1": a position's coordinates, for messages.
  std::string describe(int position) const;

  friend bool operator==(const ParallelLayout&, const ParallelLayout&) = default;

 private:
  int index_of(std::string_view name) const;  // -1 when absent
  std::vector<bool> selected(const std::vector<std::string_view>& names) const;
  void check_position(int position) const;

  std::vector<LayoutDimension> dimensions_;
  std::vector<int> strides_;  // positions between neighbours along each dimension
  int world_size_ = 1;
};

}  // namespace loom
