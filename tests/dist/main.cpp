// Entry point of the multi-rank tests: starts torchloom (MPI) once, runs every test on every
// rank, and lets only rank 0 print the full report; other ranks print their failures, tagged.
// mpirun's exit status is non-zero when any rank fails.
#include <gtest/gtest.h>

#include <iostream>

#include "loom/runtime.h"

namespace {

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

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  auto rt = loom::init();
  const int rank = rt->world().rank;
  if (rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int status = RUN_ALL_TESTS();
  rt.reset();
  loom::finalize();
  return status;
}
