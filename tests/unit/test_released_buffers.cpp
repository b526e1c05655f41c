// ReleasedBuffers (src/parallel/released_buffers.h): a bucket freed every iteration keeps its
// mapping and is written again without page faults, where a fresh allocation faults every page.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <ATen/ATen.h>

#include "parallel/released_buffers.h"

namespace {

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);  // the whole process: ATen may fill on several threads
  return usage.ru_minflt;
}

constexpr int64_t kNumel = 16 << 20 >> 2;  // 16 MB of float: 4096 pages
const auto kFloat = at::TensorOptions().dtype(at::kFloat);

long faults_writing(const at::Tensor& t) {
  const long before = minor_faults();
  t.fill_(1.5f);
  return minor_faults() - before;
}

}  // namespace

TEST(ReleasedBuffers, ABucketTakenAgainReusesItsPagesWithoutFaults) {
  auto buffers = std::make_shared<loom::detail::ReleasedBuffers>();
  void* first = nullptr;
  {
    at::Tensor bucket = buffers->take(0, kNumel, kFloat);
    first = bucket.data_ptr();
    EXPECT_GT(faults_writing(bucket), 1000) << "the first use faults its pages in";
  }  // released: madvise(MADV_FREE)
  at::Tensor again = buffers->take(0, kNumel, kFloat);
  EXPECT_EQ(again.data_ptr(), first) << "the same mapping";
  EXPECT_LT(faults_writing(again), 100) << "written again without faulting (no memory pressure here)";
  EXPECT_TRUE(again.eq(1.5f).all().item<bool>());
}

TEST(ReleasedBuffers, ASlotStillInUseGetsAnotherMappingAndSmallerRequestsFit) {
  auto buffers = std::make_shared<loom::detail::ReleasedBuffers>();
  at::Tensor held = buffers->take(0, kNumel, kFloat);
  held.fill_(2.0f);
  at::Tensor other = buffers->take(0, kNumel, kFloat);  // e.g. a reduction still holds the old bucket
  EXPECT_NE(other.data_ptr(), held.data_ptr());
  other.fill_(3.0f);
  EXPECT_TRUE(held.eq(2.0f).all().item<bool>()) << "the held buffer is untouched";
  held.reset();  // the retired mapping is unmapped
  void* kept = other.data_ptr();
  other.reset();
  at::Tensor smaller = buffers->take(0, kNumel / 2, kFloat);
  EXPECT_EQ(smaller.data_ptr(), kept);
  EXPECT_EQ(smaller.numel(), kNumel / 2);
  // A slot of its own per bucket; a tensor keeps the mappings alive after the owner is gone.
  at::Tensor second = buffers->take(1, 1024, kFloat);
  EXPECT_NE(second.data_ptr(), smaller.data_ptr());
  buffers.reset();
  second.fill_(4.0f);
  EXPECT_TRUE(second.eq(4.0f).all().item<bool>());
}
