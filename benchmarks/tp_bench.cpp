// What does tensor parallelism cost and save on a transformer MLP? Forward + backward of
// fc2(gelu(fc1(x))) with fc1: hidden -> ffn and fc2: ffn -> hidden (default 1024 -> 4096 -> 1024,
// 512 tokens, float32, 1 intra-op thread per rank) is timed two ways, interleaved iteration by
// iteration in the same processes:
//   tp1   torch::nn::Linear layers, the whole computation on each rank (what TP=1 does)
//   tpN   ColumnParallelLinear + RowParallelLinear over a TP group of all ranks (default)
// Each timed pass starts after a barrier; a sample is the slowest rank's time; medians reported.
// Also reported: the bytes the region operations communicated in one TP step against the
// theoretical minimum of one all-reduce of the [tokens, hidden] activation forward and one
// backward, and a check that the TP output equals the plain one (same master weights).
//
//   mpirun -np 2 build/benchmarks/tp_bench --json tp_np2.json
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/loom.h"
#include "loom/parallel/tensor_parallel.h"
#include "bench_common.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  int tp = 0;  // 0: the world size
  int64_t hidden = 1024;
  int64_t ffn = 4096;
  int64_t tokens = 512;
  int warmup = 3;
  int iters = 15;
  uint64_t seed = 7;
  std::string json_path;
};

using loom::bench::median;

int benchmark(Config c, const std::shared_ptr<loom::Communicator>& world) {
  if (c.tp == 0) c.tp = world->size();
  loom::ParallelConfig config;
  config.tensor_parallel = c.tp;
  config.hidden_size = c.hidden;
  config.ffn_hidden_size = c.ffn;
  loom::ParallelState ps(world, config);
  auto group = ps.tp_group();

  torch::manual_seed(c.seed);
  torch::nn::Linear fc1(c.hidden, c.ffn), fc2(c.ffn, c.hidden);
  torch::manual_seed(c.seed);
  // Master-weight initialisation: the plain layers' weights, split, so the outputs can be compared.
  loom::ColumnParallelLinearOptions column;
  column.initialization.mode = loom::ParallelInit::Mode::Master;
  loom::RowParallelLinearOptions row;
  row.initialization.mode = loom::ParallelInit::Mode::Master;
  loom::ColumnParallelLinear pfc1(c.hidden, c.ffn, group, column);
  loom::RowParallelLinear pfc2(c.ffn, c.hidden, group, row);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + 1);
  const at::Tensor x = torch::randn({c.tokens, c.hidden}, gen);
  const at::Tensor g = torch::randn({c.tokens, c.hidden}, gen);

  auto plain_step = [&] {
    fc1->zero_grad();
    fc2->zero_grad();
    at::Tensor in = x.clone().requires_grad_();
    fc2(torch::gelu(fc1(in))).backward(g);
  };
  auto tp_step = [&] {
    pfc1->zero_grad();
    pfc2->zero_grad();
    at::Tensor in = x.clone().requires_grad_();
    pfc2(torch::gelu(pfc1(in))).backward(g);
  };

  // Bytes of one TP step, counted by the region operations themselves.
  loom::tp::reset_comm_stats();
  tp_step();
  const loom::tp::CommStats stats = loom::tp::comm_stats();
  const uint64_t activation_bytes = static_cast<uint64_t>(c.tokens * c.hidden) * sizeof(float);
  const uint64_t minimum = c.tp > 1 ? 2 * activation_bytes : 0;

  std::vector<double> local[2];
  for (int it = -c.warmup; it < c.iters; ++it) {
    for (int k = 0; k < 2; ++k) {
      const int variant = (k + it + c.warmup) % 2;  // alternate which goes first
      world->barrier()->wait();
      const auto t0 = Clock::now();
      variant == 0 ? plain_step() : tp_step();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (it >= 0) local[variant].push_back(s);
    }
  }
  at::Tensor times = torch::empty({2, c.iters}, torch::kFloat64);
  for (int v = 0; v < 2; ++v)
    for (int i = 0; i < c.iters; ++i) times[v][i] = local[v][i];
  world->all_reduce(times, {loom::ReduceOp::Max})->wait();
  std::vector<double> samples[2];
  double med[2];
  for (int v = 0; v < 2; ++v) {
    auto row = times[v].contiguous();
    samples[v].assign(row.data_ptr<double>(), row.data_ptr<double>() + c.iters);
    med[v] = median(samples[v]);
  }

  // The TP MLP must compute what the plain one does.
  double max_diff = 0;
  bool correct = false;
  {
    torch::NoGradGuard no_grad;
    at::Tensor plain = pfc2(torch::gelu(pfc1(x))), parallel = fc2(torch::gelu(fc1(x)));
    max_diff = (plain - parallel).abs().max().item<double>();
    // float32 summation order is all that differs between the two.
    correct = at::allclose(parallel, plain, /*rtol=*/1e-5, /*atol=*/1e-5);
  }

  if (world->rank() == 0) {
    std::printf("tp_bench: MLP %lld -> %lld -> %lld on %lld tokens, float32, 1 thread per rank; %d ranks, TP %d\n",
                (long long)c.hidden, (long long)c.ffn, (long long)c.hidden, (long long)c.tokens, world->size(), c.tp);
    std::printf("median of %d interleaved iterations (slowest rank), after %d warm-up\n", c.iters, c.warmup);
    std::printf("  %-52s %10.2f ms\n", "TP=1 forward+backward (whole MLP per rank)", med[0] * 1e3);
    std::printf("  %-52s %10.2f ms\n", ("loom Column+Row parallel MLP, TP=" + std::to_string(c.tp)).c_str(), med[1] * 1e3);
    std::printf("  %-52s %10.2fx\n", "speedup TP=1 / TP=N", med[0] / med[1]);
    std::printf("  %-52s %10llu B in %llu calls (%llu all-reduce, %llu all-gather, %llu reduce-scatter)\n",
                "communicated per TP step", (unsigned long long)stats.total_bytes(),
                (unsigned long long)stats.total_calls(), (unsigned long long)stats.all_reduce_calls,
                (unsigned long long)stats.all_gather_calls, (unsigned long long)stats.reduce_scatter_calls);
    if (minimum)
      std::printf("  %-52s %10llu B (2 all-reduces of [%lld, %lld] float32)\n", "theoretical minimum",
                  (unsigned long long)minimum, (long long)c.tokens, (long long)c.hidden);
    else
      std::printf("  %-52s %10llu B (TP=1 communicates nothing)\n", "theoretical minimum", 0ull);
    std::printf("  %-52s %10s\n", "communicated / minimum",
                minimum ? std::to_string(double(stats.total_bytes()) / minimum).c_str() : "n/a (TP=1)");
    std::printf("  TP output equals the plain MLP's: %s (max difference %.3g)\n", correct ? "yes" : "NO", max_diff);
    std::fflush(stdout);
  }
  if (world->rank() == 0 && !c.json_path.empty()) {
    nlohmann::json doc = {
        {"benchmark", "tp_mlp"},
        {"ranks", world->size()},
        {"tp", c.tp},
        {"config", {{"hidden", c.hidden}, {"ffn", c.ffn}, {"tokens", c.tokens}, {"dtype", "float32"},
                    {"threads_per_rank", torch::get_num_threads()}, {"warmup", c.warmup}, {"iters", c.iters}}},
        {"median_s", {{"tp1", med[0]}, {"tpN", med[1]}}},
        {"samples_s", {{"tp1", samples[0]}, {"tpN", samples[1]}}},
        {"speedup", med[0] / med[1]},
        {"bytes_per_step", stats.total_bytes()},
        {"bytes_minimum", minimum},
        {"calls_per_step",
         {{"all_reduce", stats.all_reduce_calls}, {"all_gather", stats.all_gather_calls},
          {"reduce_scatter", stats.reduce_scatter_calls}}},
        {"correct", correct},
        {"max_output_difference", max_diff}};
    if (!loom::bench::write_json(c.json_path, doc, "tp_bench")) return 1;
  }
  return correct ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Column+Row parallel MLP: time at TP=N against TP=1, and bytes against the minimum"};
  Config c;
  app.add_option("--tp", c.tp, "tensor-parallel degree (default: the world size)");
  app.add_option("--hidden", c.hidden, "model width")->check(CLI::PositiveNumber);
  app.add_option("--ffn", c.ffn, "MLP width")->check(CLI::PositiveNumber);
  app.add_option("--tokens", c.tokens, "tokens (batch x sequence) per step")->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "untimed iterations");
  app.add_option("--iters", c.iters, "timed iterations")->check(CLI::PositiveNumber);
  app.add_option("--json", c.json_path, "write the results here");
  CLI11_PARSE(app, argc, argv);

  torch::set_num_threads(1);
  int status = 1;
  try {
    auto rt = loom::init();
    status = benchmark(c, rt->world_comm());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_bench: %s\n", e.what());
    return 2;
  }
  loom::finalize();
  return status;
}
