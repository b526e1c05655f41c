// The agreement helpers of include/loom/comm/agreement.h on real ranks: every rank's values and
// strings arrive in rank order, whatever their lengths; roots other than 0 and sub-groups work;
// the expected values are computed on each rank from the ranks' known inputs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "loom/comm/agreement.h"
#include "test_util.h"

using namespace loom;

namespace {
// Rank r's string: r + 1 copies of 'a' + r, an embedded NUL, and r bytes of 0xff (rank 0's is the
// shortest, and one rank sends an empty string).
std::string text_of(int r, int size) {
  if (r == size - 1 && size > 1) return "";
  std::string s(static_cast<size_t>(r + 1), static_cast<char>('a' + r));
  s += '\0';
  s += std::string(static_cast<size_t>(r), '\xff');
  return s;
}
}  // namespace

TEST(Agreement, FnvMatchesThePublishedVectors) {
  // FNV-1a 64-bit test vectors (Fowler, Noll, Vo: "FNV hash" test suite).
  EXPECT_EQ(fnv1a(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a("foobar"), 0x85944171f73967e8ull);
}

TEST(Agreement, StringsOfEveryLengthArriveInRankOrder) {
  auto comm = test::world();
  const int n = comm->size();
  const auto all = all_gather_strings(*comm, text_of(comm->rank(), n), {"test strings"});
  ASSERT_EQ(static_cast<int>(all.size()), n);
  for (int r = 0; r < n; ++r) EXPECT_EQ(all[r], text_of(r, n)) << "rank " << r << "'s string";
}

TEST(Agreement, BroadcastStringFromTheLastRank) {
  auto comm = test::world();
  const int root = comm->size() - 1;
  const std::string sent = std::string("from the last rank\0with a NUL", 29);
  const std::string got = broadcast_string(*comm, comm->rank() == root ? sent : "ignored", root, {"test broadcast"});
  EXPECT_EQ(got, sent);
}

TEST(Agreement, ValuesGatherReduceAndBroadcast) {
  auto comm = test::world();
  const int n = comm->size(), me = comm->rank();
  const std::vector<int64_t> mine = {me, -me, int64_t{1} << 40};
  const auto gathered = all_gather_values(*comm, mine, {"test gather"});
  ASSERT_EQ(gathered.size(), static_cast<size_t>(3 * n));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gathered[3 * r], r);
    EXPECT_EQ(gathered[3 * r + 1], -r);
    EXPECT_EQ(gathered[3 * r + 2], int64_t{1} << 40);
  }
  const auto maxima = all_reduce_values(*comm, mine, ReduceOp::Max, {"test max"});
  EXPECT_EQ(maxima, (std::vector<int64_t>{n - 1, 0, int64_t{1} << 40}));
  const auto sums = all_reduce_values(*comm, mine, ReduceOp::Sum, {"test sum"});
  EXPECT_EQ(sums[0], int64_t{n} * (n - 1) / 2);
  EXPECT_EQ(sums[2], int64_t{n} << 40);
  const auto from_root = broadcast_values(*comm, {me * 10, 7}, n - 1, {"test broadcast values"});
  EXPECT_EQ(from_root, (std::vector<int64_t>{(n - 1) * 10, 7}));
}

TEST(Agreement, RanksReportingNamesTheOddRanks) {
  auto comm = test::world();
  const auto reporting = ranks_reporting(*comm, comm->rank() % 2 == 1, {"test problems"});
  std::vector<int> odd;
  for (int r = 1; r < comm->size(); r += 2) odd.push_back(r);
  EXPECT_EQ(reporting, odd);
  if (odd.size() == 1) EXPECT_EQ(ranks_text(odd), "rank 1");
  EXPECT_EQ(ranks_text({0, 2}), "ranks 0, 2");
}

TEST(Agreement, WorksInsideASubGroupWithGroupRanks) {
  auto comm = test::world();
  if (comm->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int me = comm->rank();
  auto half = comm->split(me % 2, me, "agreement_parity" + std::to_string(me % 2));
  ASSERT_NE(half, nullptr);
  // Group rank 0 of each half is world rank me % 2; its string names it.
  const std::string got = broadcast_string(*half, "world rank " + std::to_string(me), 0, {"test sub-group"});
  EXPECT_EQ(got, "world rank " + std::to_string(me % 2));
  const auto names = all_gather_strings(*half, std::to_string(me), {"test sub-group"});
  for (int g = 0; g < half->size(); ++g) EXPECT_EQ(names[g], std::to_string(half->members()[g]));
}
