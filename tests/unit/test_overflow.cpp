// Arithmetic on hostile values: deadlines that do not fit the clock saturate (wait(1e10 s) means
// wait long, not time out at once), MPI byte counts above 2 GiB become units that fit an int, and
// a timeline whose names are not UTF-8 is still written (finalize() used to throw).
#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "comm/deadline.h"
#include "comm/mpi_counts.h"
#include "loom/comm/types.h"
#include "loom/trace.h"

using loom::detail::byte_units;
using loom::detail::deadline_after;
using Clock = std::chrono::steady_clock;

TEST(Overflow, DeadlinesSaturateInsteadOfWrapping) {
  const Clock::time_point now = Clock::now();
  // Ordinary timeouts add exactly.
  EXPECT_EQ(deadline_after<Clock>(now, std::chrono::milliseconds(1500)), now + std::chrono::milliseconds(1500));
  // 1e10 s (317 years) in milliseconds: its nanoseconds pass INT64_MAX, the plain sum wrapped into
  // the past.
  const loom::Timeout huge(10'000'000'000'000LL);
  EXPECT_EQ(deadline_after<Clock>(now, huge), Clock::time_point::max());
  EXPECT_EQ(deadline_after<Clock>(now, loom::Timeout::max()), Clock::time_point::max());
  EXPECT_GT(deadline_after<Clock>(now, huge), now);
  // Just below the clock's end still adds; zero and negative are "now".
  const Clock::time_point late = Clock::time_point::max() - std::chrono::seconds(10);
  EXPECT_EQ(deadline_after<Clock>(late, std::chrono::seconds(5)), late + std::chrono::seconds(5));
  EXPECT_EQ(deadline_after<Clock>(late, std::chrono::seconds(10)), Clock::time_point::max());
  EXPECT_EQ(deadline_after<Clock>(now, std::chrono::milliseconds(0)), now);
  EXPECT_EQ(deadline_after<Clock>(now, std::chrono::milliseconds(-5)), now);
}

TEST(Overflow, ByteCountsAbove2GiBBecomeUnitsThatFitAnInt) {
  EXPECT_EQ(byte_units(0).count, 0);
  EXPECT_EQ(byte_units(1).unit, 1);
  EXPECT_EQ(byte_units(1).count, 1);
  EXPECT_EQ(byte_units(INT_MAX).unit, 1);
  EXPECT_EQ(byte_units(INT_MAX).count, INT_MAX);
  // One byte more: units of 2, rounded up.
  EXPECT_EQ(byte_units(int64_t{INT_MAX} + 1).unit, 2);
  EXPECT_EQ(byte_units(int64_t{INT_MAX} + 1).count, 1073741824);
  // The review's case (560M float32 = 2.24 GB) and the largest legal message (INT_MAX float64).
  for (int64_t bytes : {int64_t{2'240'000'000}, int64_t{INT_MAX} * 8, int64_t{INT_MAX} * 8 + 7, int64_t{1} << 40}) {
    const auto u = byte_units(bytes);
    EXPECT_GT(u.count, 0) << bytes;
    EXPECT_LE(u.count, INT_MAX) << bytes;
    EXPECT_GE(u.unit * u.count, bytes) << "the buffer holds the message: " << bytes;
    EXPECT_LT(u.unit * u.count - bytes, u.unit) << "by less than one unit: " << bytes;
    EXPECT_EQ(u.unit & (u.unit - 1), 0) << "a power of two: " << u.unit;
  }
}

TEST(Overflow, ATimelineWithNamesThatAreNotUtf8IsWritten) {
  const std::string prefix = ::testing::TempDir() + "/loom_overflow_timeline";
  loom::trace::configure(prefix, 0);
  const auto t = loom::trace::now();
  loom::trace::span("checkpoint load scratch/ck\xff\xfe", "checkpoint", t, t, "main");
  std::string file;
  EXPECT_NO_THROW(file = loom::trace::flush());
  loom::trace::configure("", 0);  // off again for the other tests
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  const auto parsed = nlohmann::json::parse(text.str());  // valid JSON, valid UTF-8
  bool found = false;
  for (const auto& e : parsed["traceEvents"])
    if (e["name"].get<std::string>().rfind("checkpoint load scratch/ck\xEF\xBF\xBD", 0) == 0) found = true;
  EXPECT_TRUE(found) << text.str().substr(0, 400);
  std::remove(file.c_str());
}
