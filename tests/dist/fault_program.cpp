// Fault scenarios, each run as a real job by check_fault.py, which checks the exit status,
// the elapsed time and what every rank reports. A rank reports a caught error as one line:
//   RESULT rank=<r> kind=<TimeoutError|InvalidArgumentError|MismatchError|none> elapsed=<s> message=<what()>
#include <ATen/ATen.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "loom/error.h"
#include "loom/runtime.h"

namespace {

using Clock = std::chrono::steady_clock;

void report(int rank, const char* kind, Clock::time_point start, const std::string& message) {
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("RESULT rank=%d kind=%s elapsed=%.3f message=%s\n", rank, kind, elapsed, message.c_str());
  std::fflush(stdout);
}

// Runs one call and reports which typed error it raised.
template <typename Call>
void run_and_report(int rank, Call call) {
  auto start = Clock::now();
  try {
    call();
    report(rank, "none", start, "");
  } catch (const loom::TimeoutError& e) {
    report(rank, "TimeoutError", start, e.what());
  } catch (const loom::InvalidArgumentError& e) {
    report(rank, "InvalidArgumentError", start, e.what());
  } catch (const loom::MismatchError& e) {
    report(rank, "MismatchError", start, e.what());
  } catch (const loom::Error& e) {
    report(rank, "Error", start, e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SCENARIO\n", argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  if (scenario == "nccl_on_without_gpu") {
    // LOOM_NCCL=on where no GPU is visible: init() refuses with a ConfigError on every rank.
    auto start = Clock::now();
    try {
      loom::init();
      report(-1, "none", start, "");
    } catch (const loom::ConfigError& e) {
      const std::string what = e.what();
      const int rank = std::atoi(what.substr(what.find("[rank ") + 6).c_str());
      report(rank, "ConfigError", start, what);
    }
    loom::finalize();
    return 0;
  }
  auto rt = loom::init();
  auto comm = rt->world_comm();
  const int rank = comm->rank();
  auto control = comm->split(0, rank, "control");  // for the test's own coordination
  at::Tensor t = at::ones({4, 6});

  if (scenario == "bad_input_one_rank") {
    // Rank 1 passes a non-contiguous tensor: it fails at once; rank 0 times out.
    if (rank == 1) {
      at::Tensor bad = at::ones({6, 4}).t();
      run_and_report(rank, [&] { comm->all_reduce(bad)->wait(); });
    } else {
      run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    }
    // Clean-up only the test needs: once rank 0 has seen its timeout, rank 1 makes the call it
    // skipped, so rank 0's progress thread is released and both ranks finalize MPI normally.
    control->barrier({std::chrono::seconds(30)})->wait();
    if (rank == 1) comm->all_reduce(t)->wait();
    control->barrier({std::chrono::seconds(30)})->wait();
  } else if (scenario == "missing_call_abort") {
    // Rank 1 never makes the call. Rank 0's all_reduce times out, raises, and the job is ended.
    if (rank == 0) {
      run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
      std::this_thread::sleep_for(std::chrono::seconds(60));  // the abort must come before this ends
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
  } else if (scenario == "mismatch_detected") {
    // LOOM_CHECK_COLLECTIVES=1: different collectives on the two ranks are caught before any
    // data moves, on both ranks, with both sides in the message.
    if (rank == 0) {
      run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    } else {
      at::Tensor other = at::ones({12}, at::kDouble);
      run_and_report(rank, [&] { comm->broadcast(other, {0})->wait(); });
    }
  } else if (scenario == "sigkill_rank" || scenario == "sigstop_rank") {
    comm->all_reduce(t)->wait();  // a healthy collective first
    if (rank == 1) {
      std::printf("RANK 1 SIGNALLING ITSELF\n");
      std::fflush(stdout);
      raise(scenario == "sigkill_rank" ? SIGKILL : SIGSTOP);
    }
    run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } else {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  control.reset();
  comm.reset();
  rt.reset();
  loom::finalize();
  return 0;
}
