// ZeRO's two collectives through loom::Communicator against raw MPI, in the same processes and
// the same run, in ZeRO's in-place forms: reduce_scatter (the output is this rank's chunk of the
// input; MPI_Reduce_scatter_block with MPI_IN_PLACE, whose result loom then moves to the chunk)
// and all_gather (the input is this rank's chunk of the output; MPI_Allgather with MPI_IN_PLACE).
// nccl-tests' conventions: busbw = bytes / time * (n - 1) / n for both (bytes = the whole buffer),
// warm-up first, then the median of interleaved timed iterations (each the slowest rank's time);
// every result is checked.
//
//   mpirun -np 2 build/benchmarks/shard_collectives_bench --json shard_collectives_np2.json
#include <ATen/ATen.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench_common.h"
#include "loom/loom.h"

namespace {

using Clock = std::chrono::steady_clock;

double slowest(double seconds) {
  double result = 0;
  MPI_Allreduce(&seconds, &result, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"reduce_scatter and all_gather (in place): loom::Communicator vs raw MPI"};
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 64ll << 20;
  int warmup = 3;
  int iters = 30;
  std::string json_path;
  app.add_option("--min-bytes", min_bytes, "smallest buffer (bytes, the whole buffer)");
  app.add_option("--max-bytes", max_bytes, "largest buffer");
  app.add_option("--warmup", warmup, "untimed iterations per size");
  app.add_option("--iters", iters, "timed iterations per size and variant")->check(CLI::PositiveNumber);
  app.add_option("--json", json_path, "write the results here");
  CLI11_PARSE(app, argc, argv);

  bool all_correct = true;
  nlohmann::json rows = nlohmann::json::array();
  {
    auto rt = loom::init();
    auto comm = rt->world_comm();
    const int n = comm->size(), rank = comm->rank();
    MPI_Comm raw;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    if (rank == 0) {
      std::printf("reduce_scatter and all_gather, float32, in place, %d ranks; median of %d interleaved iterations "
                  "(slowest rank)\n",
                  n, iters);
      std::printf("%-15s %9s %10s %10s %12s %12s %7s\n", "collective", "size", "mpi us", "loom us", "mpi busbw",
                  "loom busbw", "ratio");
    }
    for (const char* kind : {"reduce_scatter", "all_gather"}) {
      const bool scatter = std::string(kind) == "reduce_scatter";
      for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
        const int64_t chunk = std::max<int64_t>(1, bytes / 4 / n);
        at::Tensor buffer = at::empty({chunk * n}, at::kFloat);
        at::Tensor mine = buffer.narrow(0, rank * chunk, chunk);
        // Before a call: every element holds its owner's rank + 1 (all_gather: only the own chunk matters).
        auto fill = [&] { buffer.fill_(rank + 1); };
        auto check = [&] {
          if (scatter) return mine[0].item<float>() == n * (n + 1) / 2.0f;
          for (int r = 0; r < n; ++r)
            if (buffer[r * chunk].item<float>() != r + 1) return false;
          return true;
        };
        auto raw_call = [&] {
          if (scatter) {
            MPI_Reduce_scatter_block(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(chunk), MPI_FLOAT, MPI_SUM, raw);
            if (rank != 0) mine.copy_(buffer.narrow(0, 0, chunk));  // where loom leaves it: the rank's own chunk
          } else {
            MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer.data_ptr(), static_cast<int>(chunk), MPI_FLOAT, raw);
          }
        };
        auto loom_call = [&] {
          if (scatter)
            comm->reduce_scatter(mine, buffer)->wait();
          else
            comm->all_gather(buffer, mine)->wait();
        };
        std::vector<double> raw_times, loom_times;
        bool correct = true;
        for (int it = -warmup; it < iters; ++it) {
          for (int variant : {it % 2, 1 - it % 2}) {  // alternating which goes first
            fill();
            MPI_Barrier(MPI_COMM_WORLD);
            const auto start = Clock::now();
            variant == 0 ? raw_call() : loom_call();
            const double seconds = slowest(std::chrono::duration<double>(Clock::now() - start).count());
            correct = correct && check();
            if (it >= 0) (variant == 0 ? raw_times : loom_times).push_back(seconds);
          }
        }
        all_correct = all_correct && correct;
        const double mpi_s = loom::bench::median(raw_times), loom_s = loom::bench::median(loom_times);
        const double whole = static_cast<double>(chunk * n * 4);
        const double factor = n > 1 ? double(n - 1) / n : 1.0;
        if (rank == 0)
          std::printf("%-15s %9s %10.1f %10.1f %9.2f GB/s %7.2f GB/s %7.3f%s\n", kind,
                      loom::bench::human_bytes(chunk * n * 4).c_str(), mpi_s * 1e6, loom_s * 1e6,
                      whole / mpi_s * factor / 1e9, whole / loom_s * factor / 1e9, mpi_s / loom_s,
                      correct ? "" : "  WRONG RESULT");
        rows.push_back({{"collective", kind}, {"bytes", chunk * n * 4}, {"mpi_s", mpi_s}, {"loom_s", loom_s},
                        {"ratio_mpi_over_loom", mpi_s / loom_s}, {"correct", correct}});
      }
    }
    if (rank == 0) std::printf("ratio = mpi time / loom time (higher is better; 1.0 = as fast as raw MPI)\n");
    if (rank == 0 && !json_path.empty()) {
      nlohmann::json doc = {{"benchmark", "shard_collectives"}, {"ranks", n}, {"iters", iters}, {"rows", rows},
                            {"correct", all_correct}};
      if (!loom::bench::write_json(json_path, doc, "shard_collectives_bench")) all_correct = false;
    }
    MPI_Comm_free(&raw);
  }
  loom::finalize();
  return all_correct ? 0 : 1;
}
