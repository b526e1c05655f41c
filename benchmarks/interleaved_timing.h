// Timing several variants of one step against each other in the same processes (ddp_bench,
// zero_bench): every iteration runs each variant once, in a new order that is the same on every
// rank, each after a barrier; a sample is the slowest rank's time.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "bench_common.h"
#include "loom/comm/communicator.h"

namespace loom::bench {

// samples[v][i]: variant v's time in timed iteration i (after `warmup` untimed ones), the slowest
// rank's. A fixed or rotated order would have each variant always follow the same one, whose
// leftovers (freed gradients, a busy progress thread) would then read as that variant's cost.
inline std::vector<std::vector<double>> time_interleaved(Communicator& comm, int variants, int warmup, int iters,
                                                         uint64_t seed, const std::function<void(int)>& run) {
  std::vector<std::vector<double>> local(variants);
  std::vector<int> order(variants);
  for (int it = -warmup; it < iters; ++it) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<uint32_t>(seed * 1000003 + it + warmup)));
    for (const int variant : order) {
      comm.barrier()->wait();
      const auto t0 = std::chrono::steady_clock::now();
      run(variant);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (it >= 0) local[variant].push_back(seconds);
    }
  }
  // Slowest rank per sample, gathered once at the end so the timed loop has no extra collective.
  at::Tensor times = at::empty({variants, iters}, at::kDouble);
  auto cell = times.accessor<double, 2>();
  for (int v = 0; v < variants; ++v)
    for (int i = 0; i < iters; ++i) cell[v][i] = local[v][i];
  comm.all_reduce(times, {ReduceOp::Max})->wait();
  std::vector<std::vector<double>> samples(variants);
  for (int v = 0; v < variants; ++v) {
    auto row = times[v].contiguous();
    samples[v].assign(row.data_ptr<double>(), row.data_ptr<double>() + iters);
  }
  return samples;
}

// The median over iterations of a's time over b's in the same iteration (cancels slow drifts).
inline double paired_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratios(a.size());
  for (size_t i = 0; i < a.size(); ++i) ratios[i] = a[i] / b[i];
  return median(ratios);
}

}  // namespace loom::bench
