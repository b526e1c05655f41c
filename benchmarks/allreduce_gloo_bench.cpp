// all_reduce under torchrun (no MPI): loom's Communicator over Gloo against LibTorch's
// c10d::ProcessGroupGloo called directly, in the same processes and the same run. The engine is
// the same (loom's world communicator is a ProcessGroupGloo behind loom's core), so the
// difference is loom's own cost per operation: validation, numbering, fingerprint, flight record,
// watchdog registration, the completion callback on Gloo's future.
//
// Both reduce one float32 buffer (sum, in place), refilled before each call; each call starts
// after a barrier and its time is the slowest rank's. Barrier and max go through a third Gloo
// group, so neither timed group does other work. The two are interleaved call by call in
// alternating order; every result is checked. ratio = reference median / loom median (>= 1: loom
// at least as fast; issue 24 asks >= 0.95).
//
// Then back-to-back calls (--stream-calls per block, --stream-rounds rounds, loom's and the
// reference's blocks in alternating order): a training loop's small all-reduces come one after
// another, and a block's mean per call carries no barrier skew. "added" is loom's time per call
// less the reference's in the same round.
//
//   python3 -m torch.distributed.run --standalone --nproc_per_node 2 --no-python \
//       build/benchmarks/allreduce_gloo_bench --json allreduce_gloo_cpp_np2.json
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ATen.h>
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/comm/gloo.h"
#include "loom/loom.h"

namespace {

using Clock = std::chrono::steady_clock;
using GlooPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;
using loom::bench::median;


// CPU time of the calling thread (not wall time): what a call costs the caller, whatever else runs.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// A Gloo group of the job's processes, made the way loom makes its own (same device choice), under
// its own keys of the launcher's store.
GlooPtr make_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                   const loom::gloo::Rendezvous& r) {
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(300));
  options->devices.push_back(r.interface.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                                 : c10d::ProcessGroupGloo::createDeviceForInterface(r.interface));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>(prefix, store), r.rank,
                                                     r.size, options);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"all_reduce under torchrun: loom::Communicator over Gloo vs c10d::ProcessGroupGloo"};
  std::vector<int64_t> sizes = {4, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  int warmup = 3;
  int min_iters = 9;
  int max_iters = 200;
  double seconds_per_size = 3.0;
  int stream_calls = 2000;
  int stream_rounds = 9;
  std::vector<int64_t> stream_sizes = {4, 64 << 10};
  std::string json_path;
  app.add_option("--bytes", sizes, "message sizes");
  app.add_option("--warmup", warmup, "untimed pairs of calls per size");
  app.add_option("--min-iters", min_iters, "timed calls per size and side at least");
  app.add_option("--max-iters", max_iters, "timed calls per size and side at most");
  app.add_option("--seconds-per-size", seconds_per_size, "time budget per size, both sides together");
  app.add_option("--stream-calls", stream_calls, "back-to-back calls per block (0: skip that part)");
  app.add_option("--stream-rounds", stream_rounds, "rounds of loom and reference blocks");
  app.add_option("--stream-bytes", stream_sizes, "message sizes of the back-to-back part");
  app.add_option("--json", json_path, "write the results here (rank 0)");
  CLI11_PARSE(app, argc, argv);

  auto rt = loom::init();
  auto comm = rt->world_comm();
  if (std::string(comm->backend()) != "gloo") {
    std::fprintf(stderr, "allreduce_gloo_bench: loom's world communicator is %s, not gloo: launch with torchrun\n",
                 comm->backend());
    return 2;
  }
  // The launcher's store (torchrun's agent, or loom's rank 0 when that serves it), as a client.
  const loom::gloo::Rendezvous r = loom::gloo::rendezvous_from_environment();
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(r.master_port);
  store_options.isServer = false;
  store_options.numWorkers = static_cast<size_t>(r.size);
  store_options.waitWorkers = false;
  store_options.timeout = std::chrono::seconds(300);
  auto store = c10::make_intrusive<c10d::TCPStore>(r.master_addr, store_options);
  auto reference = make_group(store, "loom_allreduce_gloo_bench/reference/", r);
  auto sync = make_group(store, "loom_allreduce_gloo_bench/sync/", r);
  const int n = comm->size();
  const int rank = comm->rank();

  auto barrier = [&] { sync->barrier()->wait(); };
  auto slowest = [&](double seconds) {
    std::vector<at::Tensor> t{at::full({1}, seconds, at::kDouble)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    sync->allreduce(t, o)->wait();
    return t[0].item<double>();
  };

  if (rank == 0) {
    std::printf("all_reduce float32 sum, %d ranks, in place, torchrun: loom::Communicator (gloo) vs "
                "c10d::ProcessGroupGloo, same processes, alternating; median of timed calls (slowest rank)\n"
                "ratio = ProcessGroupGloo median / loom median (>= 0.95: issue 24's target)\n",
                n);
    std::printf("%9s %5s %10s %10s %7s %9s %18s %18s\n", "size", "iters", "loom us", "gloo us", "ratio", "added us",
                "loom p25-p75 us", "gloo p25-p75 us");
  }
  nlohmann::json results = nlohmann::json::array();
  bool all_correct = true;
  const float expected = n * (n + 1) / 2.0f;
  for (const int64_t bytes : sizes) {
    const int64_t count = std::max<int64_t>(1, bytes / 4);
    at::Tensor buffer = at::empty({count}, at::kFloat);
    bool correct = true;
    auto timed = [&](auto&& call) {
      buffer.fill_(rank + 1);
      barrier();
      const auto start = Clock::now();
      call();
      const double seconds = slowest(std::chrono::duration<double>(Clock::now() - start).count());
      correct = correct && buffer[0].item<float>() == expected && buffer[count - 1].item<float>() == expected;
      return seconds;
    };
    auto loom_call = [&] { comm->all_reduce(buffer)->wait(); };
    auto gloo_call = [&] {
      std::vector<at::Tensor> tensors{buffer};
      reference->allreduce(tensors)->wait();
    };
    const double probe = timed(gloo_call);
    int iters = static_cast<int>(
        std::clamp(seconds_per_size / (2 * std::max(probe, 1e-6)), double(min_iters), double(max_iters)));
    {
      std::vector<at::Tensor> t{at::full({1}, iters, at::kInt)};
      sync->broadcast(t)->wait();
      iters = t[0].item<int>();
    }
    std::vector<double> loom_times, gloo_times;
    for (int it = -warmup; it < iters; ++it) {
      double loom_time = 0, gloo_time = 0;
      if (it % 2 == 0) {
        loom_time = timed(loom_call);
        gloo_time = timed(gloo_call);
      } else {
        gloo_time = timed(gloo_call);
        loom_time = timed(loom_call);
      }
      if (it >= 0) {
        loom_times.push_back(loom_time);
        gloo_times.push_back(gloo_time);
      }
    }
    all_correct = all_correct && correct;
    const double loom_s = median(loom_times), gloo_s = median(gloo_times);
    if (rank == 0) {
      char loom_range[48], gloo_range[48];
      std::snprintf(loom_range, sizeof(loom_range), "%.1f-%.1f", quantile(loom_times, 0.25) * 1e6,
                    quantile(loom_times, 0.75) * 1e6);
      std::snprintf(gloo_range, sizeof(gloo_range), "%.1f-%.1f", quantile(gloo_times, 0.25) * 1e6,
                    quantile(gloo_times, 0.75) * 1e6);
      std::printf("%9s %5d %10.1f %10.1f %7.3f %9.1f %18s %18s%s\n", loom::bench::human_bytes(bytes).c_str(), iters, loom_s * 1e6,
                  gloo_s * 1e6, gloo_s / loom_s, (loom_s - gloo_s) * 1e6, loom_range, gloo_range,
                  correct ? "" : "  WRONG RESULT");
      std::fflush(stdout);
    }
    results.push_back({{"bytes", count * 4},
                       {"iterations", iters},
                       {"loom_us", loom_s * 1e6},
                       {"gloo_us", gloo_s * 1e6},
                       {"ratio_gloo_over_loom_time", gloo_s / loom_s},
                       {"added_latency_us", (loom_s - gloo_s) * 1e6},
                       {"loom_us_p25", quantile(loom_times, 0.25) * 1e6},
                       {"loom_us_p75", quantile(loom_times, 0.75) * 1e6},
                       {"gloo_us_p25", quantile(gloo_times, 0.25) * 1e6},
                       {"gloo_us_p75", quantile(gloo_times, 0.75) * 1e6},
                       {"correct", correct}});
  }

  nlohmann::json stream_results = nlohmann::json::array();
  if (rank == 0 && stream_calls > 0)
    std::printf("back-to-back calls, %d per block, %d rounds of loom and ProcessGroupGloo blocks; per call, median "
                "over rounds [range]; submit: rank 0's time inside the call that returns the work; cpu: rank 0's "
                "calling thread's CPU time per call\n%9s %10s %10s %7s %24s %15s %15s %13s %13s\n",
                stream_calls, stream_rounds, "size", "loom us", "gloo us", "ratio", "added us", "loom submit us",
                "gloo submit us", "loom cpu us", "gloo cpu us");
  for (const int64_t bytes : stream_calls > 0 ? stream_sizes : std::vector<int64_t>{}) {
    const int64_t count = std::max<int64_t>(1, bytes / 4);
    at::Tensor buffer = at::zeros({count}, at::kFloat);  // zeros: a sum of zeros stays in range
    std::vector<at::Tensor> tensors{buffer};
    // submit: the time spent in the call that returns the work (loom's core and the hand-over to
    // Gloo), this rank's mean per call; the rest of a call is Gloo's and the wait. cpu: the calling
    // thread's CPU time per call (submit and wait), this rank's.
    auto block = [&](auto&& submit, std::vector<double>& submit_times, std::vector<double>& cpu_times) {
      barrier();
      Clock::duration in_submit{0};
      const double cpu_start = thread_cpu_seconds();
      const auto start = Clock::now();
      for (int i = 0; i < stream_calls; ++i) {
        const auto before = Clock::now();
        auto work = submit();
        in_submit += Clock::now() - before;
        work->wait();
      }
      const double per_call = std::chrono::duration<double>(Clock::now() - start).count() / stream_calls;
      cpu_times.push_back((thread_cpu_seconds() - cpu_start) / stream_calls);
      submit_times.push_back(std::chrono::duration<double>(in_submit).count() / stream_calls);
      return slowest(per_call);
    };
    std::vector<double> loom_times, gloo_times, added, loom_submit, gloo_submit, loom_cpu, gloo_cpu;
    for (int round = 0; round < stream_rounds; ++round) {
      auto loom_block = [&] {
        loom_times.push_back(block([&] { return comm->all_reduce(buffer); }, loom_submit, loom_cpu));
      };
      auto gloo_block = [&] {
        gloo_times.push_back(block([&] { return reference->allreduce(tensors); }, gloo_submit, gloo_cpu));
      };
      if (round % 2 == 0) {
        loom_block();
        gloo_block();
      } else {
        gloo_block();
        loom_block();
      }
      added.push_back((loom_times.back() - gloo_times.back()) * 1e6);
    }
    const bool correct = buffer.abs().max().item<float>() == 0.0f;
    all_correct = all_correct && correct;
    const auto [added_min, added_max] = std::minmax_element(added.begin(), added.end());
    if (rank == 0) {
      char range[64];
      std::snprintf(range, sizeof(range), "%+.2f [%+.2f..%+.2f]", median(added), *added_min, *added_max);
      std::printf("%9s %10.2f %10.2f %7.3f %24s %15.2f %15.2f %13.2f %13.2f%s\n", loom::bench::human_bytes(bytes).c_str(),
                  median(loom_times) * 1e6, median(gloo_times) * 1e6, median(gloo_times) / median(loom_times), range,
                  median(loom_submit) * 1e6, median(gloo_submit) * 1e6, median(loom_cpu) * 1e6,
                  median(gloo_cpu) * 1e6, correct ? "" : "  WRONG RESULT");
      std::fflush(stdout);
    }
    stream_results.push_back({{"bytes", count * 4},
                              {"calls_per_block", stream_calls},
                              {"rounds", stream_rounds},
                              {"loom_us", median(loom_times) * 1e6},
                              {"gloo_us", median(gloo_times) * 1e6},
                              {"added_latency_us", median(added)},
                              {"added_latency_us_min", *added_min},
                              {"added_latency_us_max", *added_max},
                              {"loom_submit_us_rank0", median(loom_submit) * 1e6},
                              {"gloo_submit_us_rank0", median(gloo_submit) * 1e6},
                              {"loom_caller_cpu_us_rank0", median(loom_cpu) * 1e6},
                              {"gloo_caller_cpu_us_rank0", median(gloo_cpu) * 1e6},
                              {"correct", correct}});
  }
  if (rank == 0 && !json_path.empty()) {
    nlohmann::json doc = {{"benchmark", "allreduce_gloo_cpp"},
                          {"launcher", "torchrun"},
                          {"reference", "c10d::ProcessGroupGloo (LibTorch), same processes"},
                          {"ratio", "ProcessGroupGloo median time / loom median time"},
                          {"ranks", n},
                          {"dtype", "float32"},
                          {"results", results},
                          {"back_to_back", stream_results}};
    if (!loom::bench::write_json(json_path, doc, "allreduce_gloo_bench")) return 1;
  }
  // Every rank done with the reference groups before any tears them down.
  barrier();
  sync.reset();
  reference.reset();
  store.reset();
  comm.reset();
  rt.reset();
  loom::finalize();
  return all_correct ? 0 : 1;
}
