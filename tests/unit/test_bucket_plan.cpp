// Bucket assignment: caps, the smaller first bucket, and separate buckets per dtype.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "parallel/bucket_plan.h"

using loom::detail::plan_buckets;

TEST(BucketPlan, FirstBucketSmallerThenCapped) {
  // Ten float32 parameters of 100 elements (400 bytes) each, walked in reverse.
  std::vector<at::Tensor> params(10, at::Tensor());
  for (auto& p : params) p = at::zeros({100});
  std::vector<size_t> order;
  for (size_t i = 10; i-- > 0;) order.push_back(i);
  auto buckets = plan_buckets(params, order, /*first=*/400, /*cap=*/1200);
  ASSERT_EQ(buckets.size(), 4u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{9}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{8, 7, 6}));
  EXPECT_EQ(buckets[2], (std::vector<size_t>{5, 4, 3}));
  EXPECT_EQ(buckets[3], (std::vector<size_t>{2, 1, 0}));
}

TEST(BucketPlan, DtypesNeverShareABucket) {
  std::vector<at::Tensor> params = {at::zeros({4}), at::zeros({4}, at::kDouble), at::zeros({4}),
                                    at::zeros({4}, at::kDouble)};
  auto buckets = plan_buckets(params, {0, 1, 2, 3}, 1 << 20, 1 << 20);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{0, 2}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{1, 3}));
}

TEST(BucketPlan, AParameterLargerThanTheCapGetsItsOwnBucket) {
  std::vector<at::Tensor> params = {at::zeros({10}), at::zeros({1000}), at::zeros({10})};
  auto buckets = plan_buckets(params, {2, 1, 0}, 100, 100);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0], (std::vector<size_t>{2, 1}));
  EXPECT_EQ(buckets[1], (std::vector<size_t>{0}));
}
