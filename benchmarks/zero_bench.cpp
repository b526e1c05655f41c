// What does ZeRO cost in time, and what does it save in memory? One training step (zero_grad,
// forward, cross-entropy, backward, Adam step) of ddp_bench's MLP (1024 inputs, 4 hidden layers
// of 1024, 10 classes, float32, 1 intra-op thread per rank), timed four ways, interleaved
// iteration by iteration in the same processes (a new order each iteration) so that machine noise
// hits all alike:
//   ddp    loom::DistributedDataParallel and torch::optim::Adam over every parameter
//   zero1  loom::ZeroOptimizer stage 1 (Adam state sharded over the ranks)
//   zero2  loom::ZeroOptimizer stage 2 (gradients sharded too)
//   zero2_overlap  stage 2 with overlap_param_gather: step() returns with the parameter
//          all-gathers running, and the forward waits for each layer's parameters before the layer
//   fsdp   loom::FullyShardedDataParallel (ZeRO stage 3), each Linear layer a unit: parameters
//          sharded too, gathered per layer (the next one's prefetched) in forward and again in
//          backward; target: at most 1.15 of zero2's time at 2 ranks
// Each timed step starts after a barrier; a step's time is the slowest rank's. Reported: medians,
// and the paired ratios zero / ddp (median over iterations of the two times in the same iteration;
// target <= 1.05). Also, per variant, the training state per rank counted from the live tensors'
// storages (parameters, gradients, optimizer state: loom::count_training_memory) against the
// formulas (fp32 with Adam: DDP 4+4+8, stage 1 4+4+8/N, stage 2 4+4/N+8/N, fully sharded 16/N bytes
// per parameter, counted between steps, when no unit is gathered),
// and the bytes each step hands to the communicator. And, untimed, the same MLP in bfloat16 with
// fp32 master weights: bytes per parameter against ZeRO's mixed-precision formulas (stage 1
// 2+2+12/N, stage 2 2+14/N).
//
// Every rank trains on the same batch, so all four must stay equal: checked at the end.
//
// Stage 2 frees its gradient buckets after each backward (that is its saving). Through glibc's
// malloc that memory went back to the kernel and was faulted in again in the next backward, 5-15% of
// a step on the CPU here; the reducer now keeps each released bucket's mapping and hands its pages
// back lazily (madvise MADV_FREE, src/parallel/released_buffers.h), as jemalloc does. run_all.sh
// still runs it once more with GLIBC_TUNABLES raising malloc's trim and mmap thresholds (memory
// kept in the heap, as the CUDA caching allocator keeps it on a GPU): the two should agree now. The
// JSON records the setting.
//
//   mpirun -np 2 build/benchmarks/zero_bench --json zero_np2.json
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_mlp.h"
#include "interleaved_timing.h"
#include "loom/loom.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fully_shard.h"
#include "loom/parallel/zero.h"

namespace {

using Clock = std::chrono::steady_clock;
using loom::bench::median;

struct Config {
  loom::bench::MlpShape shape;
  int64_t batch_per_rank = 64;
  int warmup = 5;
  int iters = 40;
  double lr = 1e-3;
  double bucket_cap_mb = 25;
  uint64_t seed = 7;
  std::string json_path;
};

// glibc's defaults, or the GLIBC_TUNABLES the run was given.
std::string malloc_setting() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables ? std::string("GLIBC_TUNABLES=") + tunables : "glibc defaults";
}

enum Variant { kDdp = 0, kZero1 = 1, kZero2 = 2, kZero2Overlap = 3, kFsdp = 4, kVariants = 5 };
const char* kNames[kVariants] = {"ddp", "zero1", "zero2", "zero2_overlap", "fsdp"};

nlohmann::json memory_json(const loom::ZeroMemory& m, int64_t numel) {
  return {{"parameters_bytes", m.parameters},
          {"gradients_bytes", m.gradients},
          {"optimizer_state_bytes", m.optimizer_state},
          {"master_weights_bytes", m.master_weights},
          {"bytes_per_parameter", double(m.parameters + m.gradients + m.master_weights + m.optimizer_state) / double(numel)}};
}

// The MLP in bfloat16 with fp32 master weights, after two steps: the training state per rank.
loom::ZeroMemory bf16_memory(const Config& c, int stage) {
  torch::nn::Sequential net = loom::bench::make_mlp(c.shape, c.seed);
  net->to(at::kBFloat16);
  loom::ZeroOptions options;
  options.stage = stage;
  options.bucket_cap_bytes = static_cast<size_t>(c.bucket_cap_mb * (1 << 20));
  loom::ZeroOptimizer zero(net->parameters(), loom::mpi::world_communicator(), [&](std::vector<at::Tensor> shard) {
    return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(c.lr));
  }, options);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + 2);
  const at::Tensor x = torch::randn({c.batch_per_rank, c.shape.input}, gen).to(at::kBFloat16);
  const at::Tensor y = torch::randint(c.shape.classes, {c.batch_per_rank}, gen);
  for (int step = 0; step < 2; ++step) {
    zero.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    zero.step();
  }
  return zero.memory();
}

// The fully sharded variant: each Linear a unit, the Sequential the root (none of its own).
struct FullyShardedMlp {
  torch::nn::Sequential net;
  std::unique_ptr<loom::FullyShardedDataParallel> sharded;

  FullyShardedMlp(const Config& c, const torch::optim::AdamOptions& adam) : net(loom::bench::make_mlp(c.shape, c.seed)) {
    std::vector<std::shared_ptr<torch::nn::Module>> layers;
    for (auto& layer : *net)
      if (!layer.ptr()->parameters().empty()) layers.push_back(layer.ptr());
    sharded = std::make_unique<loom::FullyShardedDataParallel>(
        *net, layers, loom::mpi::world_communicator(),
        [&](std::vector<at::Tensor> s) { return std::make_unique<torch::optim::Adam>(s, adam); });
  }
  void step(const at::Tensor& x, const at::Tensor& y) {
    loom::FullyShardedDataParallel& fsdp = *sharded;
    fsdp.zero_grad();
    at::Tensor out = fsdp.forward(*net, x, [&](const at::Tensor& x) {
      at::Tensor h = x;
      for (auto& layer : *net)
        h = layer.ptr()->parameters().empty()
                ? layer.forward<at::Tensor>(h)  // ReLU: no parameters, not a unit
                : fsdp.forward(*layer.ptr(), h, [&](const at::Tensor& h) { return layer.forward<at::Tensor>(h); });
      return h;
    });
    torch::nn::functional::cross_entropy(out, y).backward();
    fsdp.step();
  }
  // The largest difference of the (gathered) parameters from `reference`'s.
  double max_difference(const std::vector<at::Tensor>& reference) {
    sharded->unshard();
    double most = 0;
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i)
      most = std::max(most, (params[i] - reference[i]).abs().max().item<double>());
    sharded->reshard();
    return most;
  }
};

int benchmark(const Config& c, const std::shared_ptr<loom::Communicator>& comm) {
  const int rank = comm->rank();
  const int world = comm->size();
  const double n = world;
  const auto adam = torch::optim::AdamOptions(c.lr);
  const size_t cap = static_cast<size_t>(c.bucket_cap_mb * (1 << 20));

  // Each variant over a communicator of its own, built the same way.
  loom::DataParallelOptions ddp_options;
  ddp_options.reducer.bucket_cap_bytes = cap;
  loom::DistributedDataParallel<torch::nn::Sequential> ddp(loom::bench::make_mlp(c.shape, c.seed),
                                                           loom::mpi::world_communicator(), ddp_options);
  torch::optim::Adam ddp_opt(ddp->parameters(), adam);
  std::array<torch::nn::Sequential, 3> zero_nets = {loom::bench::make_mlp(c.shape, c.seed),
                                                    loom::bench::make_mlp(c.shape, c.seed),
                                                    loom::bench::make_mlp(c.shape, c.seed)};
  std::array<std::unique_ptr<loom::ZeroOptimizer>, 3> zeros;
  for (int v : {kZero1, kZero2, kZero2Overlap}) {
    loom::ZeroOptions options;
    options.stage = v == kZero1 ? 1 : 2;
    options.bucket_cap_bytes = cap;
    options.overlap_param_gather = v == kZero2Overlap;
    zeros[v - 1] = std::make_unique<loom::ZeroOptimizer>(
        zero_nets[v - 1]->parameters(), loom::mpi::world_communicator(),
        [&](std::vector<at::Tensor> shard) { return std::make_unique<torch::optim::Adam>(shard, adam); }, options);
  }
  FullyShardedMlp fsdp(c, adam);
  int64_t numel = 0;
  for (const auto& p : ddp->parameters()) numel += p.numel();

  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + 1);
  const at::Tensor x = torch::randn({c.batch_per_rank, c.shape.input}, gen);
  const at::Tensor y = torch::randint(c.shape.classes, {c.batch_per_rank}, gen);

  auto run = [&](int variant) {
    if (variant == kFsdp) return fsdp.step(x, y);
    if (variant == kDdp) {
      ddp.zero_grad();
      torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
      ddp_opt.step();
      return;
    }
    auto& zero = *zeros[variant - 1];
    zero.zero_grad();
    if (variant == kZero2Overlap) {  // each layer waits for its own parameters' all-gather
      at::Tensor h = x;
      for (auto& layer : *zero_nets[variant - 1]) {
        zero.wait_parameters(*layer.ptr());
        h = layer.forward<at::Tensor>(h);
      }
      torch::nn::functional::cross_entropy(h, y).backward();
    } else {
      torch::nn::functional::cross_entropy(zero_nets[variant - 1]->forward(x), y).backward();
    }
    zero.step();
  };

  const auto timed = loom::bench::time_interleaved(*comm, kVariants, c.warmup, c.iters, c.seed, run);
  std::array<std::vector<double>, kVariants> samples;
  std::array<double, kVariants> med{};
  for (int v = 0; v < kVariants; ++v) {
    samples[v] = timed[v];
    med[v] = median(samples[v]);
  }
  auto paired = [&](int a, int b) { return loom::bench::paired_ratio(samples[a], samples[b]); };

  double max_diff = 0;
  const auto reference = ddp->parameters();
  for (auto& zero : zeros) zero->wait_parameters();  // the overlapped variant's last gathers
  for (const auto& net : zero_nets) {
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i)
      max_diff = std::max(max_diff, (params[i] - reference[i]).abs().max().item<double>());
  }
  const loom::ZeroMemory fsdp_memory = fsdp.sharded->memory();  // between steps: nothing gathered
  const loom::FullyShardStats fsdp_stats = fsdp.sharded->stats();  // before max_difference gathers
  max_diff = std::max(max_diff, fsdp.max_difference(reference));
  const bool correct = max_diff <= 1e-5;

  const std::array<loom::ZeroMemory, kVariants> memory = {
      loom::count_training_memory(ddp->parameters(), ddp.reducer().bucket_buffers(), &ddp_opt), zeros[0]->memory(),
      zeros[1]->memory(), zeros[2]->memory(), fsdp_memory};
  const std::array<double, kVariants> formula = {16, 8 + 8 / n, 4 + 4 / n + 8 / n, 4 + 4 / n + 8 / n, 16 / n};
  const std::array<loom::ZeroMemory, 2> bf16 = {bf16_memory(c, 1), bf16_memory(c, 2)};
  const std::array<double, 2> bf16_formula = {4 + 12 / n, 2 + 14 / n};
  const loom::ReducerStats ddp_stats = ddp.reducer().stats();
  const double ddp_bytes_per_step = double(ddp_stats.bytes_reduced) / double(ddp_stats.synchronized_iterations);
  std::array<double, kVariants> bytes_per_step = {ddp_bytes_per_step, 0, 0};
  bytes_per_step[kFsdp] = double(fsdp_stats.bytes_reduce_scattered + fsdp_stats.bytes_all_gathered) /
                          double(std::max<uint64_t>(fsdp_stats.steps, 1));
  for (int v : {kZero1, kZero2, kZero2Overlap}) {
    const auto s = zeros[v - 1]->stats();
    bytes_per_step[v] = double(s.bytes_reduce_scattered + s.bytes_all_gathered) / double(s.steps);
  }

  if (rank == 0) {
    std::printf("zero_bench: %d rank%s, MLP %lld-%lldx%lld-%lld (%.2f M parameters), batch %lld per rank, float32, "
                "1 thread per rank, Adam; median of %d interleaved iterations (slowest rank), after %d warm-up\n",
                world, world > 1 ? "s" : "", (long long)c.shape.input, (long long)c.shape.hidden,
                (long long)c.shape.layers, (long long)c.shape.classes, numel / 1e6, (long long)c.batch_per_rank, c.iters,
                c.warmup);
    std::printf("  %-13s %9s %12s   %-36s %10s %9s\n", "", "step ms", "vs DDP", "bytes per parameter (measured)",
                "formula", "comm/step");
    for (int v = 0; v < kVariants; ++v) {
      const auto& m = memory[v];
      const double per = double(m.parameters + m.gradients + m.optimizer_state) / double(numel);
      char parts[64];
      std::snprintf(parts, sizeof(parts), "%.2f = %.2f + %.2f + %.2f", per, double(m.parameters) / numel,
                    double(m.gradients) / numel, double(m.optimizer_state) / numel);
      std::printf("  %-13s %9.2f %12s   %-36s %10.2f %7.1f MB\n", kNames[v], med[v] * 1e3,
                  v == kDdp ? "" : (std::to_string(paired(v, kDdp)).substr(0, 5) + (paired(v, kDdp) <= 1.05 ? " met" : " MISSED")).c_str(),
                  parts, formula[v], bytes_per_step[v] / 1e6);
    }
    std::printf("  (comm/step: DDP's all-reduced bytes; ZeRO's reduce-scattered + all-gathered bytes, each half of "
                "an all-reduce's traffic: equal volume means ZeRO's is 2x DDP's figure)\n");
    std::printf("  ZeRO parameters equal DDP's: %s (max difference %.3g); malloc: %s\n", correct ? "yes" : "NO", max_diff,
                malloc_setting().c_str());
    std::printf("  zero2_overlap / zero2 (paired): %.3f\n", paired(kZero2Overlap, kZero2));
    std::printf("  fsdp / zero2 (paired): %.3f (target <= 1.15 at 2 ranks: %s)\n", paired(kFsdp, kZero2),
                world != 2 ? "not this run" : paired(kFsdp, kZero2) <= 1.15 ? "met" : "MISSED");
    for (int stage : {1, 2}) {
      const auto& m = bf16[stage - 1];
      std::printf("  bf16 + fp32 masters, stage %d: %.2f = %.2f + %.2f + %.2f + %.2f bytes per parameter (parameters, "
                  "gradients, masters, Adam state); formula %.2f\n",
                  stage, double(m.parameters + m.gradients + m.master_weights + m.optimizer_state) / numel,
                  double(m.parameters) / numel, double(m.gradients) / numel, double(m.master_weights) / numel,
                  double(m.optimizer_state) / numel, bf16_formula[stage - 1]);
    }
    std::fflush(stdout);
  }
  if (rank == 0 && !c.json_path.empty()) {
    nlohmann::json doc = {{"benchmark", "zero"},
                          {"ranks", world},
                          {"parameters", numel},
                          {"config",
                           {{"input", c.shape.input},
                            {"hidden", c.shape.hidden},
                            {"layers", c.shape.layers},
                            {"classes", c.shape.classes},
                            {"batch_per_rank", c.batch_per_rank},
                            {"optimizer", "adam"},
                            {"bucket_cap_mb", c.bucket_cap_mb},
                            {"threads_per_rank", torch::get_num_threads()},
                            {"warmup", c.warmup},
                            {"iters", c.iters}}},
                          {"correct", correct},
                          {"malloc", malloc_setting()},
                          {"max_parameter_difference", max_diff}};
    for (int v = 0; v < kVariants; ++v) {
      doc["median_s"][kNames[v]] = med[v];
      doc["samples_s"][kNames[v]] = samples[v];
      doc["memory"][kNames[v]] = memory_json(memory[v], numel);
      doc["memory"][kNames[v]]["formula_bytes_per_parameter"] = formula[v];
      doc["communicated_bytes_per_step"][kNames[v]] = bytes_per_step[v];
      if (v != kDdp) doc["step_time_over_ddp"][kNames[v]] = paired(v, kDdp);
    }
    doc["overlap_over_zero2"] = paired(kZero2Overlap, kZero2);
    doc["fsdp_over_zero2"] = paired(kFsdp, kZero2);
    for (int stage : {1, 2}) {
      const std::string name = "bf16_masters_zero" + std::to_string(stage);
      doc["memory"][name] = memory_json(bf16[stage - 1], numel);
      doc["memory"][name]["formula_bytes_per_parameter"] = bf16_formula[stage - 1];
    }
    if (!loom::bench::write_json(c.json_path, doc, "zero_bench")) return 1;
  }
  return correct ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeRO stages 1 and 2 against DDP: step time, training state per rank, bytes communicated"};
  Config c;
  app.add_option("--hidden", c.shape.hidden, "width of every hidden layer")->check(CLI::PositiveNumber);
  app.add_option("--layers", c.shape.layers, "hidden layers (Linear+ReLU)")->check(CLI::PositiveNumber);
  app.add_option("--batch-per-rank", c.batch_per_rank, "samples per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "untimed iterations");
  app.add_option("--iters", c.iters, "timed iterations, each timing every variant once")->check(CLI::PositiveNumber);
  app.add_option("--bucket-cap-mb", c.bucket_cap_mb, "bucket size of all three (PyTorch's default is 25)");
  app.add_option("--json", c.json_path, "write the results here");
  CLI11_PARSE(app, argc, argv);

  torch::set_num_threads(1);
  int status = 1;
  {
    auto rt = loom::init();
    status = benchmark(c, rt->world_comm());
  }
  loom::finalize();
  return status;
}
