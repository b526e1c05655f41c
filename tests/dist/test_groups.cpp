// Sub-communicators: split by color/key, and the tensor-parallel x data-parallel layout.
#include <gtest/gtest.h>

#include "loom/comm/groups.h"
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
