// Sub-communicators: split by color/key, and the tensor-parallel x data-parallel layout.
#include <gtest/gtest.h>

#include "loom/comm/groups.h"
#include "loom/parallel/layout.h"
#include "loom/comm/nccl.h"
#include "test_util.h"

using namespace loom;

TEST(Groups, SplitByParityOrderedByKey) {
  auto comm = test::world();
  const int me = comm->rank();
  // Reverse order inside each group: the key is the negated rank.
  auto half = comm->split(me % 2, -me, "parity" + std::to_string(me % 2));
  ASSERT_NE(half, nullptr);
  const int members = (comm->size() + 1 - me % 2) / 2;
  EXPECT_EQ(half->size(), members);
  EXPECT_EQ(half->rank(), members - 1 - me / 2);
  EXPECT_EQ(half->name(), "parity" + std::to_string(me % 2));
  at::Tensor t = at::full({1}, me, at::kLong);
  half->all_reduce(t)->wait();
  int64_t expected = 0;
  for (int r = me % 2; r < comm->size(); r += 2) expected += r;
  EXPECT_EQ(t.item<int64_t>(), expected);
}

TEST(Groups, NegativeColorJoinsNothing) {
  auto comm = test::world();
  auto sub = comm->split(comm->rank() == 0 ? -1 : 0, comm->rank(), "without_rank0");
  if (comm->rank() == 0) {
    EXPECT_EQ(sub, nullptr);
  } else {
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), comm->size() - 1);
    sub->barrier()->wait();
  }
}

TEST(Groups, TensorAndDataParallelLayout) {
  auto comm = test::world();
  const int n = comm->size();
  for (int tp = 1; tp <= n; ++tp) {
    if (n % tp) continue;
    auto groups = make_parallel_groups(*comm, tp);
    EXPECT_EQ(groups.tp_degree, tp);
    EXPECT_EQ(groups.dp_degree, n / tp);
    EXPECT_EQ(groups.tensor_parallel->size(), tp);
    EXPECT_EQ(groups.data_parallel->size(), n / tp);
    EXPECT_EQ(groups.tp_rank, comm->rank() % tp);
    EXPECT_EQ(groups.dp_rank, comm->rank() / tp);
    // TP groups are consecutive ranks; DP groups are strided by tp.
    at::Tensor t = at::full({1}, comm->rank(), at::kLong);
    groups.tensor_parallel->all_reduce(t)->wait();
    const int block = comm->rank() / tp;
    int64_t tp_sum = 0;
    for (int r = block * tp; r < (block + 1) * tp; ++r) tp_sum += r;
    EXPECT_EQ(t.item<int64_t>(), tp_sum) << "tp=" << tp;
    at::Tensor d = at::full({1}, comm->rank(), at::kLong);
    groups.data_parallel->all_reduce(d)->wait();
    int64_t dp_sum = 0;
    for (int r = comm->rank() % tp; r < n; r += tp) dp_sum += r;
    EXPECT_EQ(d.item<int64_t>(), dp_sum) << "tp=" << tp;
  }
}

TEST(Groups, LayoutFollowsAGivenOrder) {
  auto comm = test::world();
  const int n = comm->size();
  if (n < 4) GTEST_SKIP() << "needs 4 ranks";
  // Placement order 0,2,1,3: TP groups {0,2} and {1,3}.
  auto groups = make_parallel_groups(*comm, 2, {0, 2, 1, 3});
  at::Tensor t = at::full({1}, comm->rank(), at::kLong);
  groups.tensor_parallel->all_reduce(t)->wait();
  EXPECT_EQ(t.item<int64_t>(), comm->rank() % 2 == 0 ? 0 + 2 : 1 + 3);
}

// Every dimension of a three-dimensional layout is a communicator holding exactly the world ranks
// whose positions agree on the other coordinates (found here by comparing coordinates, not by the
// layout's group arithmetic), under a placement order that is not the identity; the library's own
// dimensions a layout lacks are groups of one.
TEST(Groups, EveryDimensionOfALayoutIsAGroupOfTheRanksAgreeingElsewhere) {
  auto comm = test::world();
  const int n = comm->size();
  std::vector<int> reversed(n);
  for (int p = 0; p < n; ++p) reversed[p] = n - 1 - p;
  for (const char* order : {"dp,pp,tp", "pp,dp,tp", "tp,pp,dp"})
    for (int tp = 1; tp <= n; ++tp)
      for (int pp = 1; pp * tp <= n; ++pp) {
        if (n % (tp * pp)) continue;
        const ParallelLayout layout = ParallelLayout::standard(n, tp, pp, order);
        auto groups = make_parallel_groups(*comm, layout, reversed);
        const int me = n - 1 - comm->rank();  // my position
        EXPECT_EQ(groups.position, me);
        for (const auto& d : layout.dimensions()) {
          int64_t expected = 0;
          int members = 0;
          for (int p = 0; p < n; ++p) {
            bool same = true;
            for (const auto& other : layout.dimensions())
              if (other.name != d.name) same = same && layout.coordinate(p, other.name) == layout.coordinate(me, other.name);
            if (same) expected += reversed[p], ++members;
          }
          const auto& group = groups.group(d.name);
          EXPECT_EQ(group->size(), members) << layout.to_string() << " " << d.name;
          EXPECT_EQ(group->rank(), layout.coordinate(me, d.name)) << layout.to_string() << " " << d.name;
          at::Tensor t = at::full({1}, comm->rank(), at::kLong);
          group->all_reduce(t)->wait();
          EXPECT_EQ(t.item<int64_t>(), expected) << layout.to_string() << " " << d.name;
        }
        EXPECT_EQ(groups.tp_degree, tp);
        EXPECT_EQ(groups.data_parallel->size(), n / tp / pp);
      }
  // A layout without the library's dimensions: each of dp, pp and tp is this rank alone.
  auto custom = make_parallel_groups(*comm, ParallelLayout({{"cp", n}}));
  EXPECT_EQ(custom.group("cp")->size(), n);
  for (const char* own : {"dp", "pp", "tp"}) EXPECT_EQ(custom.group(own)->size(), 1) << own;
  EXPECT_THROW(custom.group("ep"), InvalidArgumentError);
}

TEST(Groups, LayoutOfAnotherWorldSizeOrRingsForAnAbsentDimensionAreRefused) {
  auto comm = test::world();
  const int n = comm->size();
  try {
    make_parallel_groups(*comm, ParallelLayout({{"dp", n + 1}}));
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("the layout dp=" + std::to_string(n + 1) + " holds " + std::to_string(n + 1) +
                                         " ranks; the world has " + std::to_string(n)),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(make_parallel_groups(*comm, ParallelLayout({{"dp", n}}), {}, {{"pp", {}}}), InvalidArgumentError);
}

TEST(Groups, WrongDegreeOrOrderIsAnError) {
  auto comm = test::world();
  const int n = comm->size();
  try {
    make_parallel_groups(*comm, n + 1);
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor-parallel degree " + std::to_string(n + 1) +
                                         " must be at least 1 and divide the world size " + std::to_string(n)),
              std::string::npos)
        << e.what();
  }
  std::vector<int> not_a_permutation(n, 0);
  if (n > 1) EXPECT_THROW(make_parallel_groups(*comm, 1, not_a_permutation), InvalidArgumentError);
}

TEST(Runtime, NoDeviceCommunicatorWithoutAGpu) {
  // LOOM_NCCL=auto (the default): where no GPU is visible, init() builds none.
  auto rt = loom::init();
  if (loom::nccl::device_available()) GTEST_SKIP() << "a GPU is visible";
  EXPECT_EQ(rt->device_comm(), nullptr);
  EXPECT_EQ(rt->world().size, rt->world_comm()->size());
  EXPECT_EQ(rt->world().rank, rt->world_comm()->rank());
}
