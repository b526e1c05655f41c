// ParallelLayout: positions, coordinates and groups against an independent enumeration (nested
// loops over the dimensions), the standard order, parsing, and refusals that name what is wrong.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "loom/error.h"
#include "loom/parallel/layout.h"

using namespace loom;

namespace {

// Every position's coordinates by nested counting, the last dimension fastest: the reference the
// layout's arithmetic is checked against.
std::vector<std::vector<int>> enumerate(const std::vector<int>& sizes) {
  std::vector<std::vector<int>> all;
  std::vector<int> c(sizes.size(), 0);
  int total = 1;
  for (int s : sizes) total *= s;
  for (int k = 0; k < total; ++k) {
    all.push_back(c);
    for (int i = static_cast<int>(sizes.size()) - 1; i >= 0; --i) {
      if (++c[i] < sizes[i]) break;
      c[i] = 0;
    }
  }
  return all;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(ParallelLayout, StandardOrderPutsTensorParallelInnermostAndReplicasOutermost) {
  const ParallelLayout layout = ParallelLayout::standard(8, /*tp=*/2, /*pp=*/2);
  EXPECT_EQ(layout.to_string(), "dp=2,pp=2,tp=2");
  EXPECT_EQ(layout.world_size(), 8);
  EXPECT_EQ(layout.group(5, {"tp"}), (std::vector<int>{4, 5}));
  EXPECT_EQ(layout.group(5, {"pp"}), (std::vector<int>{5, 7}));
  EXPECT_EQ(layout.group(5, {"dp"}), (std::vector<int>{1, 5}));
  EXPECT_EQ(layout.coordinate(5, "dp"), 1);
  EXPECT_EQ(layout.coordinate(5, "pp"), 0);
  EXPECT_EQ(layout.coordinate(5, "tp"), 1);
  EXPECT_EQ(layout.describe(5), "dp 1, pp 0, tp 1");
  // The classic two-dimensional layout is the same with one stage.
  const ParallelLayout two = ParallelLayout::standard(8, 2);
  EXPECT_EQ(two.to_string(), "dp=4,pp=1,tp=2");
  EXPECT_EQ(two.groups({"dp"}), (std::vector<std::vector<int>>{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(two.groups({"tp"}), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
}

TEST(ParallelLayout, CoordinatesAndGroupsMatchAnEnumerationForEveryOrderAndSubset) {
  const std::vector<std::vector<LayoutDimension>> shapes = {
      {{"dp", 3}, {"pp", 2}, {"tp", 2}},
      {{"pp", 4}, {"dp", 1}, {"tp", 3}},
      {{"tp", 2}, {"dp", 5}},
      {{"ep", 2}, {"dp", 2}, {"cp", 3}, {"pp", 2}, {"tp", 1}},
      {{"dp", 7}},
  };
  for (const auto& dims : shapes) {
    const ParallelLayout layout(dims);
    std::vector<int> sizes;
    for (const auto& d : dims) sizes.push_back(d.size);
    const auto reference = enumerate(sizes);
    ASSERT_EQ(layout.world_size(), static_cast<int>(reference.size()));
    for (int p = 0; p < layout.world_size(); ++p) {
      EXPECT_EQ(layout.coordinates(p), reference[p]) << layout.to_string() << " position " << p;
      EXPECT_EQ(layout.position(reference[p]), p);
      for (size_t i = 0; i < dims.size(); ++i) EXPECT_EQ(layout.coordinate(p, dims[i].name), reference[p][i]);
    }
    // Every subset of the dimensions: a group is exactly the positions agreeing on the others.
    for (unsigned mask = 0; mask < (1u << dims.size()); ++mask) {
      std::vector<std::string_view> names;
      for (size_t i = 0; i < dims.size(); ++i)
        if (mask & (1u << i)) names.push_back(dims[i].name);
      std::map<std::vector<int>, std::vector<int>> by_others;  // ordered by the other coordinates
      for (int p = 0; p < layout.world_size(); ++p) {
        std::vector<int> others;
        for (size_t i = 0; i < dims.size(); ++i)
          if (!(mask & (1u << i))) others.push_back(reference[p][i]);
        by_others[others].push_back(p);
      }
      std::vector<std::vector<int>> expected;
      for (auto& [key, members] : by_others) expected.push_back(members);
      EXPECT_EQ(layout.groups(names), expected) << layout.to_string() << " mask " << mask;
      for (int p = 0; p < layout.world_size(); ++p) {
        const int g = layout.group_index(p, names);
        ASSERT_LT(g, static_cast<int>(expected.size()));
        EXPECT_EQ(layout.group(p, names), expected[g]);
        EXPECT_EQ(expected[g][layout.rank_in_group(p, names)], p);
      }
    }
  }
}

TEST(ParallelLayout, AbsentDimensionsHaveSizeOneAndCoordinateZero) {
  const ParallelLayout layout = ParallelLayout::parse("dp=2,tp=2");
  EXPECT_FALSE(layout.has("pp"));
  EXPECT_EQ(layout.size("pp"), 1);
  EXPECT_EQ(layout.coordinate(3, "pp"), 0);
  EXPECT_EQ(layout.group(3, {"pp"}), (std::vector<int>{3}));
  EXPECT_EQ(layout.group(3, {"pp", "tp"}), (std::vector<int>{2, 3}));
  const ParallelLayout one;
  EXPECT_EQ(one.world_size(), 1);
  EXPECT_EQ(one.to_string(), "");
  EXPECT_EQ(one.group(0, {"dp"}), (std::vector<int>{0}));
  EXPECT_EQ(ParallelLayout::parse(""), one);
}

TEST(ParallelLayout, ParseAndToStringRoundTrip) {
  for (const char* text : {"dp=4,pp=2,tp=2", "tp=8", "pp=3,dp=1,cp=2,tp=4"}) {
    EXPECT_EQ(ParallelLayout::parse(text).to_string(), text);
  }
  EXPECT_EQ(ParallelLayout::parse("pp=2,tp=4"), ParallelLayout({{"pp", 2}, {"tp", 4}}));
  EXPECT_NE(ParallelLayout::parse("pp=2,tp=4"), ParallelLayout::parse("tp=4,pp=2"));  // order matters
}

TEST(ParallelLayout, ArrangeGivesTheRestToTheOneUnsizedDimension) {
  EXPECT_EQ(ParallelLayout::arrange(12, "pp,dp,tp", {{"tp", 2}, {"pp", 3}}).to_string(), "pp=3,dp=2,tp=2");
  EXPECT_EQ(ParallelLayout::arrange(4, "dp,tp", {{"tp", 4}}).to_string(), "dp=1,tp=4");
  EXPECT_EQ(ParallelLayout::arrange(6, "dp,tp", {{"tp", 3}, {"dp", 2}}).to_string(), "dp=2,tp=3");
}

TEST(ParallelLayout, RefusalsNameTheDimensionAndWhatWasFound) {
  EXPECT_NE(error_of([] { ParallelLayout::standard(6, 4); }).find("the tp size 4 must be at least 1 and divide the world size 6 (6 % 4 = 2)"),
            std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::standard(8, 2, 3); }).find("the pp size 3"), std::string::npos);
  // Each size divides the world, their product does not.
  EXPECT_NE(error_of([] { ParallelLayout::standard(12, 4, 6); }).find("pp 6 x tp 4 = 24 must divide the world size 12"),
            std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::arrange(4, "dp,tp", {{"tp", 2}, {"dp", 1}}); }).find("must equal the world size 4"),
            std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::arrange(4, "dp,pp,tp", {{"tp", 2}}); }).find("leaves both \"dp\" and \"pp\" unsized"),
            std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::arrange(4, "dp,tp", {{"pp", 2}}); }).find("a size is given for \"pp\""),
            std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::parse("dp=2,dp=2"); }).find("dimension \"dp\" appears twice"), std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::parse("dp=x"); }).find("\"dp=x\": expected name=size with a size of 1 or more"),
            std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::parse("dp"); }).find("expected name=size"), std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout::parse("DP=2"); }).find("dimension name \"DP\""), std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout({{"dp", 0}}); }).find("has size 0; expected at least 1"), std::string::npos);
  EXPECT_NE(error_of([] { ParallelLayout({{"a", 4096}, {"b", 4096}, {"c", 2}}); }).find("more than 16777216 positions"),
            std::string::npos);
  const ParallelLayout layout = ParallelLayout::parse("dp=2,tp=2");
  EXPECT_NE(error_of([&] { layout.coordinates(4); }).find("position 4 is outside the layout dp=2,tp=2 (0..3)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { layout.position({1, 2}); }).find("coordinate 2 along \"tp\" is outside 0..1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { layout.group(0, {"tp", "tp"}); }).find("named twice"), std::string::npos);
}
