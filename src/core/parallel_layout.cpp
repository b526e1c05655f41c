// ParallelLayout: named dimensions, row-major positions, groups along any set of dimensions.
#include "loom/parallel/layout.h"

#include <algorithm>

#include "loom/error.h"

namespace loom {

namespace {

constexpr long long kMaxPositions = 1LL << 24;

[[noreturn]] void refuse(const std::string& detail) {
  throw InvalidArgumentError(ErrorContext("ParallelLayout")(detail));
}

bool valid_name(std::string_view name) {
  if (name.empty() || !(name[0] >= 'a' && name[0] <= 'z')) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'; });
}

std::vector<std::string_view> split_list(std::string_view text) {
  std::vector<std::string_view> parts;
  if (text.empty()) return parts;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    parts.push_back(text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (comma == std::string_view::npos) return parts;
    start = comma + 1;
  }
}

int parse_size(std::string_view text, std::string_view entry) {
  const bool digits = !text.empty() && text.size() <= 9 &&
                      std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits) {
    std::string detail(1, '"');
    detail.append(entry).append("\": expected name=size with a size of 1 or more");
    refuse(detail);
  }
  long long value = 0;
  for (char c : text) value = value * 10 + (c - '0');
  return static_cast<int>(value);
}

}  // namespace

ParallelLayout::ParallelLayout(std::vector<LayoutDimension> dimensions) : dimensions_(std::move(dimensions)) {
  long long product = 1;
  for (size_t i = 0; i < dimensions_.size(); ++i) {
    const auto& d = dimensions_[i];
    if (!valid_name(d.name))
      refuse("dimension name \"" + d.name + "\": expected lower-case letters, digits and '_', starting with a letter");
    for (size_t j = 0; j < i; ++j)
      if (dimensions_[j].name == d.name) refuse("dimension \"" + d.name + "\" appears twice");
    if (d.size < 1) refuse("dimension \"" + d.name + "\" has size " + std::to_string(d.size) + "; expected at least 1");
    product *= d.size;
    if (product > kMaxPositions)
      refuse("the dimensions multiply to more than " + std::to_string(kMaxPositions) + " positions");
  }
  world_size_ = static_cast<int>(product);
  strides_.assign(dimensions_.size(), 1);
  for (int i = static_cast<int>(dimensions_.size()) - 2; i >= 0; --i)
    strides_[i] = strides_[i + 1] * dimensions_[i + 1].size;
}

ParallelLayout ParallelLayout::parse(std::string_view text) {
  std::vector<LayoutDimension> dimensions;
  for (std::string_view entry : split_list(text)) {
    const size_t eq = entry.find('=');
    if (eq == std::string_view::npos)
      refuse("\"" + std::string(entry) + "\" in \"" + std::string(text) + "\": expected name=size, e.g. dp=4,pp=2,tp=2");
    dimensions.push_back({std::string(entry.substr(0, eq)), parse_size(entry.substr(eq + 1), entry)});
  }
  return ParallelLayout(std::move(dimensions));
}

ParallelLayout ParallelLayout::arrange(int world_size, std::string_view order,
                                       const std::vector<LayoutDimension>& sizes) {
  if (world_size < 1) refuse("world size " + std::to_string(world_size) + ": expected at least 1");
  const std::vector<std::string_view> names = split_list(order);
  for (const auto& given : sizes)
    if (std::find(names.begin(), names.end(), given.name) == names.end())
      refuse("a size is given for \"" + given.name + "\", which the order \"" + std::string(order) + "\" does not name");
  std::vector<LayoutDimension> dimensions;
  int rest = -1;
  long long known = 1;
  for (std::string_view name : names) {
    auto given = std::find_if(sizes.begin(), sizes.end(), [&](const LayoutDimension& d) { return d.name == name; });
    if (given == sizes.end()) {
      if (rest >= 0)
        refuse("the order \"" + std::string(order) + "\" leaves both \"" + dimensions[rest].name + "\" and \"" +
               std::string(name) + "\" unsized; at most one dimension takes the rest of the world");
      rest = static_cast<int>(dimensions.size());
      dimensions.push_back({std::string(name), 1});
      continue;
    }
    if (given->size < 1 || world_size % given->size != 0)
      refuse("the " + std::string(name) + " size " + std::to_string(given->size) +
             " must be at least 1 and divide the world size " + std::to_string(world_size) + " (" +
             std::to_string(world_size) + " % " + std::to_string(given->size) + " = " +
             std::to_string(given->size < 1 ? world_size : world_size % given->size) + ")");
    known *= given->size;
    dimensions.push_back({std::string(name), given->size});
  }
  if (known > world_size || world_size % known != 0 || (rest < 0 && known != world_size)) {
    std::string product;
    for (const auto& d : dimensions) {
      if (static_cast<int>(&d - dimensions.data()) == rest) continue;
      product += (product.empty() ? "" : " x ") + d.name + " " + std::to_string(d.size);
    }
    refuse(product + " = " + std::to_string(known) + (rest < 0 ? " must equal" : " must divide") +
           " the world size " + std::to_string(world_size));
  }
  if (rest >= 0) dimensions[rest].size = static_cast<int>(world_size / known);
  return ParallelLayout(std::move(dimensions));
}

ParallelLayout ParallelLayout::standard(int world_size, int tensor_parallel, int pipeline_parallel,
                                        std::string_view order) {
  return arrange(world_size, order,
                 {{std::string(kTensorParallelDim), tensor_parallel}, {std::string(kPipelineParallelDim), pipeline_parallel}});
}

int ParallelLayout::index_of(std::string_view name) const {
  for (size_t i = 0; i < dimensions_.size(); ++i)
    if (dimensions_[i].name == name) return static_cast<int>(i);
  return -1;
}

bool ParallelLayout::has(std::string_view name) const { return index_of(name) >= 0; }

int ParallelLayout::size(std::string_view name) const {
  const int i = index_of(name);
  return i < 0 ? 1 : dimensions_[i].size;
}

void ParallelLayout::check_position(int position) const {
  if (position < 0 || position >= world_size_)
    refuse("position " + std::to_string(position) + " is outside the layout " +
           (dimensions_.empty() ? std::string("of one position") : to_string()) + " (0.." +
           std::to_string(world_size_ - 1) + ")");
}

std::vector<int> ParallelLayout::coordinates(int position) const {
  check_position(position);
  std::vector<int> out(dimensions_.size());
  for (size_t i = 0; i < dimensions_.size(); ++i) out[i] = position / strides_[i] % dimensions_[i].size;
  return out;
}

int ParallelLayout::coordinate(int position, std::string_view name) const {
  check_position(position);
  const int i = index_of(name);
  return i < 0 ? 0 : position / strides_[i] % dimensions_[i].size;
}

int ParallelLayout::position(const std::vector<int>& coordinates) const {
  if (coordinates.size() != dimensions_.size())
    refuse(std::to_string(coordinates.size()) + " coordinates for a layout of " + std::to_string(dimensions_.size()) +
           " dimensions (" + to_string() + ")");
  int position = 0;
  for (size_t i = 0; i < dimensions_.size(); ++i) {
    if (coordinates[i] < 0 || coordinates[i] >= dimensions_[i].size)
      refuse("coordinate " + std::to_string(coordinates[i]) + " along \"" + dimensions_[i].name +
             "\" is outside 0.." + std::to_string(dimensions_[i].size - 1));
    position += coordinates[i] * strides_[i];
  }
  return position;
}

std::vector<bool> ParallelLayout::selected(const std::vector<std::string_view>& names) const {
  std::vector<bool> chosen(dimensions_.size(), false);
  for (size_t n = 0; n < names.size(); ++n) {
    for (size_t m = 0; m < n; ++m)
      if (names[m] == names[n]) refuse("dimension \"" + std::string(names[n]) + "\" is named twice for one group");
    const int i = index_of(names[n]);
    if (i >= 0) chosen[i] = true;
  }
  return chosen;
}

// Row-major index over the coordinates picked by `which` (the chosen dimensions or the others).
namespace {
int mixed_index(const std::vector<int>& coordinates, const std::vector<LayoutDimension>& dimensions,
                const std::vector<bool>& chosen, bool which) {
  int index = 0;
  for (size_t i = 0; i < dimensions.size(); ++i)
    if (chosen[i] == which) index = index * dimensions[i].size + coordinates[i];
  return index;
}
}  // namespace

std::vector<int> ParallelLayout::group(int position, const std::vector<std::string_view>& names) const {
  const std::vector<bool> chosen = selected(names);
  const std::vector<int> mine = coordinates(position);
  // Start from the position with every chosen coordinate at 0, then count through them row-major.
  int base = position;
  int members = 1;
  for (size_t i = 0; i < dimensions_.size(); ++i)
    if (chosen[i]) {
      base -= mine[i] * strides_[i];
      members *= dimensions_[i].size;
    }
  std::vector<int> out;
  out.reserve(members);
  std::vector<int> counter(dimensions_.size(), 0);
  for (int k = 0; k < members; ++k) {
    int p = base;
    for (size_t i = 0; i < dimensions_.size(); ++i) p += counter[i] * strides_[i];
    out.push_back(p);
    for (int i = static_cast<int>(dimensions_.size()) - 1; i >= 0; --i) {
      if (!chosen[i]) continue;
      if (++counter[i] < dimensions_[i].size) break;
      counter[i] = 0;
    }
  }
  return out;
}

int ParallelLayout::group_index(int position, const std::vector<std::string_view>& names) const {
  return mixed_index(coordinates(position), dimensions_, selected(names), false);
}

int ParallelLayout::rank_in_group(int position, const std::vector<std::string_view>& names) const {
  return mixed_index(coordinates(position), dimensions_, selected(names), true);
}

std::vector<std::vector<int>> ParallelLayout::groups(const std::vector<std::string_view>& names) const {
  const std::vector<bool> chosen = selected(names);
  int members = 1;
  for (size_t i = 0; i < dimensions_.size(); ++i)
    if (chosen[i]) members *= dimensions_[i].size;
  std::vector<std::vector<int>> out(world_size_ / members);
  for (int p = 0; p < world_size_; ++p) {
    const std::vector<int> c = coordinates(p);
    out[mixed_index(c, dimensions_, chosen, false)].push_back(p);  // row-major order within each group
  }
  return out;
}

std::string ParallelLayout::to_string() const {
  std::string text;
  for (const auto& d : dimensions_) text += (text.empty() ? "" : ",") + d.name + "=" + std::to_string(d.size);
  return text;
}

std::string ParallelLayout::describe(int position) const {
  const std::vector<int> c = coordinates(position);
  std::string text;
  for (size_t i = 0; i < dimensions_.size(); ++i)
    text += (text.empty() ? "" : ", ") + dimensions_[i].name + " " + std::to_string(c[i]);
  return text.empty() ? "the only position" : text;
}

}  // namespace loom
