// The job aborter: a teardown step that hangs (ncclCommAbort on a dead network) cannot keep the
// process alive; it ends within the bound, and the steps run before the final one.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "comm/abort.h"

namespace {

void hang_in_a_step_then_expect_the_end() {
  loom::detail::register_abort_step([](const std::string&) {
    std::fprintf(stderr, "step started\n");
    std::this_thread::sleep_for(std::chrono::hours(1));  // never returns in time
  });
  loom::detail::set_final_abort_step([](const std::string& reason) {
    std::fprintf(stderr, "final step: %s\n", reason.c_str());
    std::_Exit(7);
  });
  loom::detail::abort_job_after(std::chrono::milliseconds(0), "test reason", std::chrono::milliseconds(300));
  std::this_thread::sleep_for(std::chrono::seconds(30));  // the process must end long before this
}

void final_step_hangs_too() {
  loom::detail::set_final_abort_step([](const std::string&) { std::this_thread::sleep_for(std::chrono::hours(1)); });
  loom::detail::abort_job_after(std::chrono::milliseconds(0), "test reason", std::chrono::milliseconds(300));
  std::this_thread::sleep_for(std::chrono::seconds(30));
}

}  // namespace

TEST(AbortDeathTest, AHangingStepStillEndsTheProcessThroughTheFinalStep) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EXIT(hang_in_a_step_then_expect_the_end(), testing::ExitedWithCode(7),
              "step started(.|\n)*final step: test reason");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(AbortDeathTest, AHangingFinalStepIsEndedByAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(final_step_hangs_too(), testing::KilledBySignal(SIGABRT), "");
}
