// Fault scenarios, each run as a real job by check_fault.py, which checks the exit status, the
// elapsed time and what every rank reports. A rank reports a caught error as one line:
//   RESULT rank=<r> kind=<TimeoutError|InvalidArgumentError|MismatchError|CommError|ConfigError|none> elapsed=<s> message=<what()>
// The culprit is always the last rank ("victim" below), so the scenarios mean the same at 2 and 4 ranks.
#include <ATen/ATen.h>
#include <signal.h>
#include <sys/resource.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

#include "loom/comm/gloo.h"
#include "loom/comm/mpi.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/parallel/zero.h"
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
  } catch (const loom::ConfigError& e) {
    report(rank, "ConfigError", start, e.what());
  } catch (const loom::CommError& e) {
    report(rank, "CommError", start, e.what());
  } catch (const loom::Error& e) {
    report(rank, "Error", start, e.what());
  }
}

int rank_from_environment() {
  const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
  if (r == nullptr) r = std::getenv("RANK");  // torchrun
  return r ? std::atoi(r) : 0;
}

// A small data-parallel training loop; `on_step` runs inside backward (from a gradient hook).
void train_ddp(const std::shared_ptr<loom::Communicator>& comm, int steps, const std::function<void(int)>& on_step) {
  torch::manual_seed(1);
  torch::nn::Linear model(64, 64);
  loom::GradientReducer reducer(model->parameters(), comm);
  torch::optim::SGD opt(model->parameters(), 0.01);
  int step = 0;
  model->weight.register_hook([&](const at::Tensor& grad) {
    on_step(step);
    return grad;
  });
  for (step = 0; step < steps; ++step) {
    reducer.zero_grad();
    at::Tensor loss = model(at::randn({32, 64})).pow(2).mean();
    loss.backward();
    opt.step();
  }
}

// ZeRO training (stage 2) with `on_step` called after each backward, before step(): a rank that
// dies there leaves the others inside the sharded step, waiting for its gradient shard (the
// reduce-scatter) or its parameter shard (the all-gather; with `overlap`, in wait_parameters()).
void train_zero(const std::shared_ptr<loom::Communicator>& comm, int steps, bool overlap,
                const std::function<void(int)>& on_step) {
  torch::manual_seed(1);
  torch::nn::Linear model(64, 64);
  loom::ZeroOptions options;
  options.stage = 2;
  options.overlap_param_gather = overlap;
  loom::ZeroOptimizer zero(
      model->parameters(), comm,
      [](std::vector<at::Tensor> shard) { return std::make_unique<torch::optim::SGD>(shard, 0.01); }, options);
  for (int step = 0; step < steps; ++step) {
    zero.zero_grad();
    if (overlap) zero.wait_parameters();
    at::Tensor loss = model(at::randn({32, 64})).pow(2).mean();
    loss.backward();
    on_step(step);
    zero.step();
  }
  zero.wait_parameters();
}

// Scenarios that fail inside loom::init(): every rank reports the ConfigError it raised.
int init_scenario() {
  const int rank = rank_from_environment();
  run_and_report(rank, [] { loom::init(); });
  loom::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SCENARIO\n", argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  if (scenario == "nccl_on_without_gpu" || scenario == "config_differs" || scenario == "bad_config_value" ||
      scenario == "timeline_unwritable" || scenario == "timeline_disk_full")
    return init_scenario();

  std::shared_ptr<loom::Runtime> rt;
  try {
    rt = loom::init();
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "fault_program: %s\n", e.what());
    return 1;
  }
  auto comm = rt->world_comm();
  const int rank = comm->rank();
  const int victim = comm->size() - 1;
  // For the test's own coordination: a communicator of its own, so that the tested one's sequence
  // numbers start at 0.
  // (MPI under mpirun, Gloo under torchrun: the same bootstrap as the tested one.)
  auto control = std::string(comm->backend()) == "gloo"
                     ? loom::gloo::world_communicator(loom::gloo::rendezvous_from_environment())
                     : loom::mpi::world_communicator();
  at::Tensor t = at::ones({4, 6});

  if (scenario == "bad_input_one_rank") {
    // The victim passes a non-contiguous tensor: it fails at once; the others time out, naming it.
    if (rank == victim) {
      at::Tensor bad = at::ones({6, 4}).t();
      run_and_report(rank, [&] { comm->all_reduce(bad)->wait(); });
    } else {
      run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    }
    // Clean-up only the test needs: once the others have seen their timeout, the victim makes the
    // call it skipped, so their progress threads are released and every rank finalizes MPI.
    control->barrier({std::chrono::seconds(30)})->wait();
    if (rank == victim) comm->all_reduce(t)->wait();
    control->barrier({std::chrono::seconds(30)})->wait();
  } else if (scenario == "skipped_call") {
    // The victim skips one all_reduce and goes on to the next call: the others time out naming it.
    if (rank != victim) run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    control->barrier({std::chrono::seconds(30)})->wait();
    if (rank == victim) comm->all_reduce(t)->wait();  // release the others' progress threads
    control->barrier({std::chrono::seconds(30)})->wait();
  } else if (scenario == "missing_call_abort") {
    // The victim never makes the call. The others' all_reduce times out, raises, and the job ends.
    if (rank != victim) run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    std::this_thread::sleep_for(std::chrono::seconds(60));  // the abort must come before this ends
  } else if (scenario == "mismatch_detected") {
    // LOOM_CHECK_COLLECTIVES=1: different collectives are caught before any data moves, on every
    // rank, with both sides in the message.
    if (rank != victim) {
      run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    } else {
      at::Tensor other = at::ones({12}, at::kDouble);
      run_and_report(rank, [&] { comm->broadcast(other, {0})->wait(); });
    }
  } else if (scenario == "diverged_collectives") {
    // A code path that diverged: the victim calls all_reduce where the others call barrier, at the
    // same sequence number, under the default timeout. No in-band check compares the two; asking
    // the other ranks shows it, and every rank fails within a second or two instead of 600 s.
    comm->barrier()->wait();  // a healthy collective first (seq 0)
    if (rank == victim) run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    else run_and_report(rank, [&] { comm->barrier()->wait(); });
    std::this_thread::sleep_for(std::chrono::seconds(60));  // the abort (LOOM_ON_ERROR's default) ends the job first
  } else if (scenario == "size_mismatch" || scenario == "small_size_mismatch" || scenario == "dtype_mismatch" ||
             scenario == "op_mismatch") {
    // No LOOM_CHECK_COLLECTIVES: the always-on check (host collectives of 256 bytes and more, and
    // all-reduces of any size up to 256 KB, in band) ends the call on every rank, naming both
    // sides, before MPI could write past a buffer. small_size_mismatch: 16 vs 64 bytes.
    const bool small = scenario == "small_size_mismatch";
    at::Tensor mine = at::ones({small ? 4 : 1024});
    loom::ReduceOp op = loom::ReduceOp::Sum;
    if (rank == victim) {
      if (scenario == "size_mismatch") mine = at::ones({2048});
      if (small) mine = at::ones({16});
      if (scenario == "dtype_mismatch") mine = at::ones({1024}, at::kDouble);
      if (scenario == "op_mismatch") op = loom::ReduceOp::Max;
    }
    run_and_report(rank, [&] { comm->all_reduce(mine, {op})->wait(); });
  } else if (scenario == "sigkill_rank" || scenario == "sigstop_rank") {
    comm->all_reduce(t)->wait();  // a healthy collective first
    if (rank == victim) {
      std::printf("RANK %d SIGNALLING ITSELF\n", rank);
      std::fflush(stdout);
      raise(scenario == "sigkill_rank" ? SIGKILL : SIGSTOP);
    }
    run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } else if (scenario == "sigkill_in_ddp_backward" || scenario == "sigstop_in_ddp_backward") {
    // Killed or stopped in the middle of a backward pass, while buckets are being all-reduced.
    const int signal = scenario == "sigkill_in_ddp_backward" ? SIGKILL : SIGSTOP;
    run_and_report(rank, [&] {
      train_ddp(comm, 50, [&](int step) {
        if (rank == victim && step == 5) {
          std::printf("RANK %d SIGNALLING ITSELF\n", rank);
          std::fflush(stdout);
          raise(signal);
        }
      });
    });
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } else if (scenario == "sigkill_in_zero_step" || scenario == "sigstop_in_zero_overlapped_gather") {
    // Killed between backward and the sharded step (LOOM_ON_ERROR=abort: the job ends); or stopped
    // there with the parameter all-gathers overlapping the next forward (step() returns at once)
    // under LOOM_ON_ERROR=raise: the survivors' wait_parameters() must raise the all-gather's
    // timeout, and they leave main with it, as a program's error path does.
    const bool kill = scenario == "sigkill_in_zero_step";
    run_and_report(rank, [&] {
      train_zero(comm, 50, /*overlap=*/!kill, [&](int step) {
        if (rank == victim && step == 5) {
          std::printf("RANK %d SIGNALLING ITSELF\n", rank);
          std::fflush(stdout);
          raise(kill ? SIGKILL : SIGSTOP);
        }
      });
    });
    if (!kill) {
      std::this_thread::sleep_for(std::chrono::seconds(1));  // every survivor reports before mpirun ends the job
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } else if (scenario == "sigkill_in_tp_forward") {
    loom::ParallelState ps(comm, comm->size());
    ps.seed(3);
    loom::ColumnParallelLinear fc1(32, 64, ps.tp_group());
    loom::RowParallelLinear fc2(64, 32, ps.tp_group());
    run_and_report(rank, [&] {
      for (int step = 0; step < 50; ++step) {
        at::Tensor h = fc1(at::randn({8, 32}));
        if (rank == victim && step == 5) {
          std::printf("RANK %d SIGNALLING ITSELF\n", rank);
          std::fflush(stdout);
          raise(SIGKILL);
        }
        fc2(at::gelu(h)).sum().backward();
      }
    });
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } else if (scenario == "sigkill_in_pipeline_stage" || scenario == "sigstop_in_pipeline_stage") {
    // Every rank one stage of a 1F1B pipeline; the victim (the last stage) dies or stops in its
    // tenth forward, in the middle of the second step.
    const bool kill = scenario == "sigkill_in_pipeline_stage";
    torch::nn::Linear layer(16, 16);
    int calls = 0;
    auto stage = [&](const at::Tensor& x) {
      if (rank == victim && ++calls == 10) {
        std::printf("RANK %d SIGNALLING ITSELF\n", rank);
        std::fflush(stdout);
        raise(kill ? SIGKILL : SIGSTOP);
      }
      return at::tanh(layer->forward(x));
    };
    loom::pp::PipelineExecutor pipeline(comm, {stage}, {.schedule = loom::pp::Schedule::OneFOneB, .micro_batches = 4});
    std::vector<at::Tensor> inputs(4, at::randn({8, 16}));
    run_and_report(rank, [&] {
      for (int step = 0; step < 20; ++step)
        pipeline.step(pipeline.holds_first_stage() ? inputs : std::vector<at::Tensor>{},
                      [](const at::Tensor& out, int) { return out.square().mean(); });
    });
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } else if (scenario == "exit_without_finalize") {
    // LOOM_ON_ERROR=raise with debug logging: the survivors get a TimeoutError and leave main
    // without loom::finalize(), as a program's error path does. Teardown must not crash (the log
    // and the communicators are gone in a safe order) and the exit code is the program's.
    if (rank != victim) run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    // The victim leaves last, so mpirun does not end the others before they report.
    else std::this_thread::sleep_for(std::chrono::seconds(5));
    return 1;
  } else if (scenario == "rank_throws" || scenario == "rank_returns_error") {
    // The default configuration (LOOM_TIMEOUT 600 s, LOOM_ON_ERROR=abort): after five healthy
    // all-reduces the victim leaves, with an exception nobody catches or by returning 3 from main
    // without loom::finalize(), while the others go on to a sixth. They must learn why at once.
    for (int i = 0; i < 5; ++i) comm->all_reduce(t)->wait();
    if (rank == victim) {
      std::printf("RANK %d LEAVING\n", rank);
      std::fflush(stdout);
      if (scenario == "rank_throws") throw std::runtime_error("the data loader found a corrupt record");
      return 3;
    }
    run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
    std::this_thread::sleep_for(std::chrono::seconds(60));  // the job must end before this does
  } else if (scenario == "leaves_after_completing") {
    // The victim completes a broadcast it roots (its send is eager: done at once) and then leaves
    // with an uncaught exception; the others called that broadcast but wait for it only a second
    // later, after the departure notice came. The victim completed it, so its data is here: the
    // broadcast completes with the victim's values, and only the next collective fails, naming it.
    for (int i = 0; i < 4; ++i) comm->all_reduce(t)->wait();
    at::Tensor mine = at::full({4, 6}, static_cast<float>(rank == victim ? 7 : -1));
    auto work = comm->broadcast(mine, {victim});
    if (rank == victim) {
      work->wait();
      std::printf("RANK %d LEAVING\n", rank);
      std::fflush(stdout);
      throw std::runtime_error("left right after its broadcast");
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
    run_and_report(rank, [&] {
      work->wait();
      if (!mine.eq(7).all().item<bool>()) throw loom::Error("the broadcast completed without the victim's values");
      comm->all_reduce(t)->wait();
    });
    std::this_thread::sleep_for(std::chrono::seconds(60));  // the job must end before this does
  } else if (scenario == "stall_warning") {
    // The victim comes 2 s late to a collective with a 4 s timeout: the others log a warning
    // naming it at 1 s, and the call then completes.
    if (rank == victim) std::this_thread::sleep_for(std::chrono::seconds(2));
    run_and_report(rank, [&] { comm->all_reduce(t)->wait(); });
  } else if (scenario == "timeline_write_fails") {
    // The trace cannot be written at the end (files are limited to 16 bytes from now on, as on a
    // disk that filled up during the run): finalize reports it and the run still ends normally.
    comm->all_reduce(t)->wait();
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit limit = {16, 16};
    setrlimit(RLIMIT_FSIZE, &limit);
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
