// Test report for multi-rank runs: rank 0 prints gtest's usual report; every other rank prints
// only its failures, each tagged with the rank, so that mpirun's merged output stays readable.
#pragma once

#include <gtest/gtest.h>

#include <iostream>

namespace loom::test {

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (result.failed())
      std::cerr << "[rank " << rank_ << "] FAILED at " << (result.file_name() ? result.file_name() : "?") << ":"
                << result.line_number() << "\n" << result.summary() << std::endl;
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::cerr << "[rank " << rank_ << "] FAILED " << info.test_suite_name() << "." << info.name() << std::endl;
  }

 private:
  int rank_;
};

// Call after testing::InitGoogleTest, once the rank is known.
inline void report_failures_only_unless_rank0(int rank) {
  if (rank == 0) return;
  auto& listeners = testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(rank));
}

}  // namespace loom::test
