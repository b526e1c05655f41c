// all_reduce bus bandwidth through loom::Communicator against raw MPI_Allreduce, in the same
// processes and the same run, following nccl-tests' conventions:
//   algbw = bytes / time,  busbw = algbw * 2 (n - 1) / n,
// warm-up iterations first, then the median of the timed iterations (each iteration's time is
// the slowest rank's). The two are interleaved iteration by iteration so that machine noise
// hits both alike; results are checked after every iteration.
//
// All variants reduce one buffer, refilled before each call. Three ways through loom are timed:
// "loom" is submit-then-wait (the waiting thread runs the operation itself when it is next in
// line), "loom async" is submit, then poll is_completed()
// while the communicator's progress thread runs it (the path that overlaps with computation),
// and "unchecked" is "loom" on a communicator without the always-on fingerprint check (every
// all-reduce up to 256 KB agrees in band, in its own messages; larger ones exchange 64 bytes
// first; the unchecked communicator raises LOOM_SIZE_CHECK_BYTES out of reach, so all of its
// calls are plain MPI_Allreduce): "check cost" is the checked time over the unchecked one.
//
// Then back-to-back calls (--stream-calls per block; in each round a raw block, then loom's and
// the unchecked one's in alternating order):
// a training loop's small all-reduces come one after another, not after a barrier each, and a
// block's mean per call does not carry the barrier's skew between ranks that a single call's
// time does. "added" is loom's time per call less raw MPI's in the same round; the median and
// range are over the rounds.
//
//   mpirun -np 2 build/benchmarks/allreduce_bench --json allreduce_np2.json
#include <ATen/ATen.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <nlohmann/json.hpp>
#include <vector>

#include "loom/loom.h"
#include "bench_common.h"

namespace {

using Clock = std::chrono::steady_clock;

using loom::bench::median;

// The slowest rank's time for this iteration.
double slowest(double seconds) {
  double result = 0;
  MPI_Allreduce(&seconds, &result, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return result;
}


}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"all_reduce bandwidth: loom::Communicator vs raw MPI_Allreduce"};
  int64_t min_bytes = 4;
  int64_t max_bytes = 256ll << 20;
  int warmup = 3;
  int max_iters = 40;
  double seconds_per_size = 3.0;
  std::string json_path;
  app.add_option("--min-bytes", min_bytes, "smallest message (bytes)");
  app.add_option("--max-bytes", max_bytes, "largest message (bytes)");
  app.add_option("--warmup", warmup, "untimed iterations per size");
  app.add_option("--max-iters", max_iters, "timed iterations per size at most (at least 5)");
  app.add_option("--seconds-per-size", seconds_per_size, "time budget per size, both variants together");
  int stream_calls = 10000;
  int stream_rounds = 9;
  std::vector<int64_t> stream_sizes = {4, 64 << 10};
  app.add_option("--stream-calls", stream_calls, "back-to-back calls per block (0: skip that part)");
  app.add_option("--stream-rounds", stream_rounds, "rounds of raw, loom and unchecked blocks");
  app.add_option("--stream-bytes", stream_sizes, "message sizes of the back-to-back part");
  app.add_option("--json", json_path, "write the results here");
  CLI11_PARSE(app, argc, argv);

  auto rt = loom::init();
  auto comm = rt->world_comm();
  loom::CommunicatorOptions no_check;
  no_check.size_check_bytes = int64_t{1} << 62;
  no_check.fingerprint_interval = 0;
  auto unchecked = loom::mpi::world_communicator(no_check);
  const int n = comm->size();
  const int rank = comm->rank();
  MPI_Comm raw_comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw_comm);
  const double bus_factor = n > 1 ? 2.0 * (n - 1) / n : 1.0;

  nlohmann::json results = nlohmann::json::array();
  if (rank == 0) {
    std::printf("all_reduce float32 sum, %d ranks, in place; median of timed iterations (slowest rank)\n", n);
    std::printf("%9s %5s %10s %10s %13s %13s %7s %9s %10s %7s %12s %10s\n", "size", "iters", "mpi us", "loom us",
                "mpi busbw", "loom busbw", "ratio", "added us", "async us", "ratio", "unchecked us", "check cost");
  }
  bool all_correct = true;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int64_t count = std::max<int64_t>(1, bytes / 4);
    // One buffer for every variant, refilled before each call: separate buffers of the same size
    // were placed differently by the allocator (heap or mapping, page alignment), and with two
    // communicators that did exactly the same work, one was 4-18% slower than the other at 1-4 MB.
    at::Tensor buffer = at::empty({count}, at::kFloat);
    // Size the iteration count from one probe so each size takes about seconds_per_size.
    buffer.fill_(1);
    auto probe_start = Clock::now();
    MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw_comm);
    double probe = slowest(std::chrono::duration<double>(Clock::now() - probe_start).count());
    int iters = static_cast<int>(std::clamp(seconds_per_size / (2 * std::max(probe, 1e-6)), 5.0, double(max_iters)));
    MPI_Bcast(&iters, 1, MPI_INT, 0, MPI_COMM_WORLD);

    std::vector<double> raw_times, loom_times, async_times, unchecked_times;
    const float expected = n * (n + 1) / 2.0f;
    bool correct = true;
    // Each variant starts from a fresh buffer on ranks that start together, and its result is checked.
    auto timed = [&](auto&& call) {
      buffer.fill_(rank + 1);
      MPI_Barrier(MPI_COMM_WORLD);
      auto start = Clock::now();
      call();
      const double seconds = slowest(std::chrono::duration<double>(Clock::now() - start).count());
      correct = correct && buffer[0].item<float>() == expected && buffer[count - 1].item<float>() == expected;
      return seconds;
    };
    auto raw_call = [&] {
      MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw_comm);
    };
    auto loom_call = [&] { comm->all_reduce(buffer)->wait(); };
    auto unchecked_call = [&] { unchecked->all_reduce(buffer)->wait(); };
    auto async_call = [&] {
      auto work = comm->all_reduce(buffer);
      while (!work->is_completed()) std::this_thread::yield();
      work->wait();
    };
    for (int it = -warmup; it < iters; ++it) {
      const double raw_time = timed(raw_call);
      // The checked and the unchecked call back to back, so both meet the machine in the same
      // state, in alternating order: the second of two calls is faster by itself (0.3 us of
      // 1.7 us at 4 B, measured with both unchecked), which would read as the check's cost.
      double loom_time = 0, unchecked_time = 0;
      if (it % 2 == 0) {
        loom_time = timed(loom_call);
        unchecked_time = timed(unchecked_call);
      } else {
        unchecked_time = timed(unchecked_call);
        loom_time = timed(loom_call);
      }
      const double async_time = timed(async_call);
      if (it >= 0) {
        raw_times.push_back(raw_time);
        loom_times.push_back(loom_time);
        async_times.push_back(async_time);
        unchecked_times.push_back(unchecked_time);
      }
    }
    all_correct = all_correct && correct;
    const double raw_s = median(raw_times), loom_s = median(loom_times), async_s = median(async_times);
    const double unchecked_s = median(unchecked_times);
    const double real_bytes = count * 4.0;
    const double raw_busbw = real_bytes / raw_s * bus_factor / 1e9;
    const double loom_busbw = real_bytes / loom_s * bus_factor / 1e9;
    if (rank == 0) {
      std::printf("%9s %5d %10.1f %10.1f %8.3f GB/s %8.3f GB/s %7.3f %9.2f %10.1f %7.3f %12.1f %10.3f%s\n",
                  loom::bench::human_bytes(bytes).c_str(), iters, raw_s * 1e6, loom_s * 1e6, raw_busbw, loom_busbw, raw_s / loom_s,
                  (loom_s - raw_s) * 1e6, async_s * 1e6, raw_s / async_s, unchecked_s * 1e6, loom_s / unchecked_s,
                  correct ? "" : "  WRONG RESULT");
      std::fflush(stdout);
    }
    results.push_back({{"bytes", real_bytes},
                       {"iterations", iters},
                       {"mpi_us", raw_s * 1e6},
                       {"loom_us", loom_s * 1e6},
                       {"mpi_busbw_gbps", raw_busbw},
                       {"loom_busbw_gbps", loom_busbw},
                       {"ratio_loom_over_mpi_bandwidth", raw_s / loom_s},
                       {"added_latency_us", (loom_s - raw_s) * 1e6},
                       {"loom_async_us", async_s * 1e6},
                       {"ratio_loom_async_over_mpi_bandwidth", raw_s / async_s},
                       {"loom_unchecked_us", unchecked_s * 1e6},
                       {"check_cost_ratio", loom_s / unchecked_s},
                       {"correct", correct}});
  }
  nlohmann::json stream_results = nlohmann::json::array();
  if (rank == 0 && stream_calls > 0)
    std::printf("back-to-back calls, %d per block, %d rounds of raw, loom and unchecked blocks; per call, median over "
                "rounds [range]\n%9s %10s %10s %24s %12s %18s\n",
                stream_calls, stream_rounds, "size", "mpi us", "loom us", "added us", "unchecked us", "check cost");
  for (const int64_t bytes : stream_calls > 0 ? stream_sizes : std::vector<int64_t>{}) {
    const int64_t count = std::max<int64_t>(1, bytes / 4);
    at::Tensor buffer = at::zeros({count}, at::kFloat);  // zeros: a sum of zeros stays in range
    auto block = [&](auto&& call) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = Clock::now();
      for (int i = 0; i < stream_calls; ++i) call();
      return slowest(std::chrono::duration<double>(Clock::now() - start).count()) / stream_calls;
    };
    std::vector<double> raw_times, loom_times, unchecked_times, added, check_cost;
    for (int round = 0; round < stream_rounds; ++round) {
      raw_times.push_back(block([&] {
        MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw_comm);
      }));
      // Checked and unchecked in alternating order, as above.
      auto checked_block = [&] { loom_times.push_back(block([&] { comm->all_reduce(buffer)->wait(); })); };
      auto unchecked_block = [&] { unchecked_times.push_back(block([&] { unchecked->all_reduce(buffer)->wait(); })); };
      if (round % 2 == 0) {
        checked_block();
        unchecked_block();
      } else {
        unchecked_block();
        checked_block();
      }
      added.push_back((loom_times.back() - raw_times.back()) * 1e6);
      check_cost.push_back(loom_times.back() / unchecked_times.back());
    }
    const bool correct = buffer.abs().max().item<float>() == 0.0f;
    all_correct = all_correct && correct;
    const auto [added_min, added_max] = std::minmax_element(added.begin(), added.end());
    const auto [cost_min, cost_max] = std::minmax_element(check_cost.begin(), check_cost.end());
    if (rank == 0) {
      char range[64], cost_range[64];
      std::snprintf(range, sizeof(range), "%+.2f [%+.2f..%+.2f]", median(added), *added_min, *added_max);
      std::snprintf(cost_range, sizeof(cost_range), "%.3f [%.3f..%.3f]", median(check_cost), *cost_min, *cost_max);
      std::printf("%9s %10.2f %10.2f %24s %12.2f %18s%s\n", loom::bench::human_bytes(bytes).c_str(), median(raw_times) * 1e6,
                  median(loom_times) * 1e6, range, median(unchecked_times) * 1e6, cost_range,
                  correct ? "" : "  WRONG RESULT");
      std::fflush(stdout);
    }
    stream_results.push_back({{"bytes", count * 4},
                              {"calls_per_block", stream_calls},
                              {"rounds", stream_rounds},
                              {"mpi_us", median(raw_times) * 1e6},
                              {"loom_us", median(loom_times) * 1e6},
                              {"loom_unchecked_us", median(unchecked_times) * 1e6},
                              {"added_latency_us", median(added)},
                              {"added_latency_us_min", *added_min},
                              {"added_latency_us_max", *added_max},
                              {"check_cost_ratio", median(check_cost)},
                              {"correct", correct}});
  }
  if (rank == 0 && !json_path.empty()) {
    nlohmann::json doc = {{"benchmark", "allreduce"}, {"ranks", n},       {"dtype", "float32"},
                          {"results", results},       {"back_to_back", stream_results}};
    if (!loom::bench::write_json(json_path, doc, "allreduce_bench")) return 1;
  }
  MPI_Comm_free(&raw_comm);
  unchecked.reset();
  comm.reset();
  rt.reset();
  loom::finalize();
  return all_correct ? 0 : 1;
}
