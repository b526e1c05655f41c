// Entry point of the multi-rank tests: starts torchloom (MPI) once, runs every test on every
// rank, and lets only rank 0 print the full report; other ranks print their failures, tagged.
// mpirun's exit status is non-zero when any rank fails.
#include <gtest/gtest.h>

#include "loom/runtime.h"
#include "rank_report.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  auto rt = loom::init();
  loom::test::report_failures_only_unless_rank0(rt->world().rank);
  int status = RUN_ALL_TESTS();
  rt.reset();
  loom::finalize();
  return status;
}
