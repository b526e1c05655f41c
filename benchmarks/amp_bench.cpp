// How fast is loom::GradScaler::unscale_ (divide every gradient by the scale and check it for
// inf/NaN), against memory bandwidth, a naive per-tensor loop, and PyTorch's own
// torch.amp.GradScaler.unscale_? Two workloads of float32 gradients on the CPU, 1 intra-op thread:
//   small   1000 tensors, sizes drawn (seeded splitmix64, the same in amp_reference.py) from a
//           list of 64..65536 elements, each its own allocation as autograd makes them
//   large   4 tensors of 16M elements
// Timed in rounds (each variant a few passes in a row per round, see run_workload) so that machine
// noise hits all alike:
//   loom unscale_   loom::GradScaler::unscale_ over a torch::optim::SGD holding the gradients
//   naive loop      per tensor: isinf(g).any().item() || isnan(g).any().item(), then g.mul_(1/scale)
//   foreach mul     at::_foreach_mul_(grads, 1/scale): the same in-place traffic without the check
//                   (what the check costs on large tensors; on the CPU it runs tensor by tensor
//                   through the dispatcher, so it pays more per call on many small ones)
//   copy/tensor     dst[i].copy_(g[i]) for every gradient: the same bytes in the same calls
//   copy flat       one copy_ of a flat buffer holding as many bytes: memory bandwidth alone
// Before every timed pass the gradients are refilled from a pristine scaled copy (untimed): the
// values stay finite and normal (unscaling them again and again would reach denormals, which the
// CPU handles slowly), and the gradients were just written, as after a backward.
// After each unscale_, update(scale) (untimed) resets the scaler for the next pass with the same scale.
//
// GB/s counts each gradient byte read once and written once (2 x bytes) for every row, so the rows
// compare as times do. Target: unscale bandwidth >= 0.9 x per-tensor copy bandwidth. A copy moves
// more than that through memory (its destination is read for ownership before it is written), an
// in-place pass does not, so unscale_ can beat the copy; _foreach_mul_ is the tighter bound.
// Ratios are medians of paired ratios (see paired()); the table also shows each minimum.
// With --python-json (amp_reference.py's output on the same sizes), loom's time is also set against
// Python's, raw and normalised by each program's own per-tensor copy (which cancels drift between
// the two processes).
//
//   python3 benchmarks/amp_reference.py --json amp_python.json
//   build/benchmarks/amp_bench --python-json amp_python.json --json amp.json
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/sgd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "loom/amp/grad_scaler.h"
#include "bench_common.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  int warmup = 1;
  int block = 4;
  int iters = 20;
  int64_t small_tensors = 1000;
  int64_t large_tensors = 4;
  int64_t large_elements = 16ll << 20;
  double scale = 65536.0;
  uint64_t seed = 7;
  std::string python_json;
  std::string json_path;
};

// Mixed parameter sizes: biases and norms, small and medium weights (not all powers of two, so the
// kernels' vector tails are exercised too). amp_reference.py holds the same list.
constexpr std::array<int64_t, 10> kSmallSizes = {64, 96, 256, 768, 1024, 3000, 4096, 12288, 16384, 65536};

// splitmix64: a generator simple enough to be written identically in Python, so both programs draw
// the same sizes (checked when the Python JSON is read).
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<int64_t> small_sizes(int64_t count, uint64_t seed) {
  std::vector<int64_t> sizes;
  uint64_t state = seed;
  for (int64_t i = 0; i < count; ++i) sizes.push_back(kSmallSizes[splitmix64(state) % kSmallSizes.size()]);
  return sizes;
}

using loom::bench::median;

// Ratios between variants are medians of paired ratios: the i-th timed passes of two variants ran
// in the same round, a few hundred milliseconds apart, so a slow phase of the machine (other jobs on
// the same cores or memory) hits both sides of a ratio alike, which a ratio of medians does not
// guarantee.
double paired(const std::vector<double>& numerator, const std::vector<double>& denominator) {
  std::vector<double> ratios;
  for (size_t i = 0; i < numerator.size() && i < denominator.size(); ++i)
    ratios.push_back(numerator[i] / denominator[i]);
  return median(ratios);
}

enum Variant { kLoom = 0, kNaive = 1, kForeachMul = 2, kCopy = 3, kFlatCopy = 4, kVariants = 5 };
constexpr std::array<const char*, kVariants> kKeys = {"loom_unscale", "naive_loop", "foreach_mul_no_check",
                                                      "copy_per_tensor", "copy_flat"};
constexpr std::array<const char*, kVariants> kLabels = {"loom GradScaler::unscale_", "naive per-tensor loop",
                                                        "_foreach_mul_ in place, no check", "copy_ per tensor",
                                                        "copy_ flat (one call)"};

struct Result {
  std::string name;
  std::vector<int64_t> sizes;
  int64_t elements = 0;
  std::array<double, kVariants> median_s{};
  std::array<std::vector<double>, kVariants> samples_s;
  bool correct = false;
  bool inf_detected = false;
};

Result run_workload(const Config& c, const std::string& name, const std::vector<int64_t>& sizes) {
  Result r;
  r.name = name;
  r.sizes = sizes;
  for (int64_t s : sizes) r.elements += s;

  // The pristine scaled gradients, one flat buffer (split into views) so the flat copy's refill
  // reads the same bytes as the per-tensor refill.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + 1);
  const at::Tensor source_flat = at::randn({r.elements}, gen).mul_(c.scale);
  const std::vector<at::Tensor> sources = at::split_with_sizes(source_flat, sizes);

  // Allocated kind by kind, in the same order as amp_reference.py, so that both programs lay the
  // gradients out alike in memory.
  // zeros, not empty: first-touch page faults would otherwise be timed in the first passes.
  std::vector<at::Tensor> params, grads, copy_dst;
  for (int64_t s : sizes) params.push_back(at::zeros({s}).requires_grad_(true));
  for (int64_t s : sizes) grads.push_back(at::zeros({s}));
  for (int64_t s : sizes) copy_dst.push_back(at::zeros({s}));
  for (size_t i = 0; i < sizes.size(); ++i) params[i].mutable_grad() = grads[i];
  at::Tensor flat_src = at::zeros({r.elements});
  at::Tensor flat_dst = at::zeros({r.elements});

  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.01));
  loom::GradScalerOptions options;
  options.init_scale = c.scale;
  loom::GradScaler scaler(options);
  scaler.scale(at::ones({1}));  // what scale(loss) does before backward: creates the scale tensor
  const double inv_scale = 1.0 / c.scale;

  auto refill = [&] {
    for (size_t i = 0; i < grads.size(); ++i) grads[i].copy_(sources[i]);
  };
  bool naive_found = false;
  auto run = [&](int variant) -> double {
    // Preparation differs by variant but always writes the bytes about to be read, untimed.
    if (variant == kFlatCopy)
      flat_src.copy_(source_flat);
    else
      refill();
    const auto t0 = Clock::now();
    switch (variant) {
      case kLoom:
        scaler.unscale_(optimizer);
        break;
      case kNaive:
        for (auto& g : grads) {
          if (at::isinf(g).any().item<bool>() || at::isnan(g).any().item<bool>()) naive_found = true;
          g.mul_(inv_scale);
        }
        break;
      case kForeachMul:
        at::_foreach_mul_(grads, at::Scalar(inv_scale));
        break;
      case kCopy:
        for (size_t i = 0; i < grads.size(); ++i) copy_dst[i].copy_(grads[i]);
        break;
      case kFlatCopy:
        flat_dst.copy_(flat_src);
        break;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (variant == kLoom) scaler.update(c.scale);  // next pass: READY again, same scale
    return seconds;
  };

  // Passes run in blocks: one variant `block` times in a row, the first `warmup` passes untimed,
  // the order of the blocks rotated every round. Inside a block a pass follows a pass of its own
  // kind, as one step's unscale_ follows the last step's in training, so each variant (and
  // amp_reference.py's unscale_) is timed from its own steady cache state. Interleaved pass by pass,
  // a variant's time depended on which other one ran just before it: up to 1.7x on the small
  // workload, whose buffers (~240 MB in all) compete for the cache.
  const int rounds = (c.iters + c.block - 1) / c.block;
  for (int round = 0; round < rounds; ++round) {
    for (int k = 0; k < kVariants; ++k) {
      const int variant = (k + round) % kVariants;
      const int timed = std::min(c.block, c.iters - round * c.block);
      for (int pass = -c.warmup; pass < timed; ++pass) {
        const double seconds = run(variant);
        if (pass >= 0) r.samples_s[variant].push_back(seconds);
      }
    }
  }
  for (int v = 0; v < kVariants; ++v) r.median_s[v] = median(r.samples_s[v]);

  // The numbers count only if unscale_ computed the right thing: 1/scale is a power of two here,
  // so the result must be exact; and an inf in one tensor must make step() skip.
  refill();
  scaler.unscale_(optimizer);
  bool exact = true;
  for (size_t i = 0; i < grads.size(); ++i) exact = exact && at::equal(grads[i], sources[i] * inv_scale);
  const bool stepped = scaler.step(optimizer);
  scaler.update(c.scale);
  refill();
  grads[grads.size() / 2][0].fill_(std::numeric_limits<float>::infinity());
  const bool skipped = !scaler.step(optimizer);
  scaler.update(c.scale);
  r.correct = exact && stepped && !naive_found;
  r.inf_detected = skipped;
  return r;
}

std::string describe(const Result& r) {
  const auto [lo, hi] = std::minmax_element(r.sizes.begin(), r.sizes.end());
  char text[128];
  std::snprintf(text, sizeof(text), "%zu tensors of %lld..%lld elements, %.1f MB", r.sizes.size(),
                static_cast<long long>(*lo), static_cast<long long>(*hi), r.elements * 4 / 1e6);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"loom::GradScaler::unscale_ against a memory copy, a naive loop and torch.amp.GradScaler"};
  Config c;
  app.add_option("--warmup", c.warmup, "untimed passes at the start of every block")->check(CLI::NonNegativeNumber);
  app.add_option("--block", c.block, "timed passes of one variant in a row")->check(CLI::PositiveNumber);
  app.add_option("--iters", c.iters, "timed passes per variant and workload")->check(CLI::PositiveNumber);
  app.add_option("--small-tensors", c.small_tensors, "tensors in the small workload")->check(CLI::PositiveNumber);
  app.add_option("--large-tensors", c.large_tensors, "tensors in the large workload")->check(CLI::PositiveNumber);
  app.add_option("--large-elements", c.large_elements, "elements per large tensor")->check(CLI::PositiveNumber);
  app.add_option("--scale", c.scale, "loss scale (a power of two keeps the exactness check valid)");
  app.add_option("--seed", c.seed, "seed for the sizes and values");
  app.add_option("--python-json", c.python_json, "amp_reference.py's results on the same workloads");
  app.add_option("--json", c.json_path, "write the results here");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);  // as amp_reference.py: one intra-op thread, so bandwidth is one core's

  nlohmann::json python;
  if (!c.python_json.empty()) {
    std::ifstream in(c.python_json);
    if (!in) {
      std::fprintf(stderr, "amp_bench: cannot read %s\n", c.python_json.c_str());
      return 2;
    }
    python = nlohmann::json::parse(in);
  }

  const std::vector<std::pair<std::string, std::vector<int64_t>>> workloads = {
      {"small", small_sizes(c.small_tensors, c.seed)},
      {"large", std::vector<int64_t>(c.large_tensors, c.large_elements)}};
  std::map<std::string, nlohmann::json> python_workloads;
  if (!python.is_null()) {
    for (const auto& w : python.at("workloads")) python_workloads[w.at("name").get<std::string>()] = w;
    // Compare only like with like: a mismatch is an error in the scripts, not a result.
    for (const auto& [name, sizes] : workloads) {
      auto found = python_workloads.find(name);
      if (found == python_workloads.end() || found->second.at("sizes").get<std::vector<int64_t>>() != sizes) {
        std::fprintf(stderr, "amp_bench: %s has no '%s' workload with the same tensor sizes (same options?)\n",
                     c.python_json.c_str(), name.c_str());
        return 2;
      }
    }
  }

  std::vector<Result> results;
  for (const auto& [name, sizes] : workloads) results.push_back(run_workload(c, name, sizes));

  std::printf(
      "amp_bench: unscale + inf/NaN check of float32 gradients on the CPU, 1 intra-op thread, scale %g; "
      "%d timed passes per variant, in rounds of %d after %d untimed\n",
      c.scale, c.iters, c.block, c.warmup);
  std::printf("GB/s: 2 x gradient bytes (read + write) / median time, for every row alike\n");
  std::printf("vs loom: its time / loom's time, median of paired ratios (python: ratio of medians)\n");
  nlohmann::json out_workloads = nlohmann::json::array();
  bool all_correct = true;
  for (const Result& r : results) {
    const double bytes = r.elements * 4.0;
    auto gbps = [&](double seconds) { return 2 * bytes / seconds / 1e9; };
    const auto& m = r.median_s;
    const auto& samples = r.samples_s;

    const nlohmann::json py_workload = python_workloads.count(r.name) ? python_workloads[r.name] : nlohmann::json();

    std::array<double, kVariants> vs_loom{};
    for (int v = 0; v < kVariants; ++v) vs_loom[v] = paired(samples[v], samples[kLoom]);
    std::printf("\n%s: %s\n", r.name.c_str(), describe(r).c_str());
    std::printf("  %-36s %11s %11s %8s %8s\n", "", "median us", "min us", "GB/s", "vs loom");
    for (int v = 0; v < kVariants; ++v)
      std::printf("  %-36s %11.1f %11.1f %8.2f %8.3f\n", kLabels[v], m[v] * 1e6,
                  *std::min_element(samples[v].begin(), samples[v].end()) * 1e6, gbps(m[v]), vs_loom[v]);
    double py_ratio = 0, py_normalised = 0, py_us = 0;
    if (!py_workload.is_null()) {
      const auto py_unscale = py_workload.at("samples_us").at("unscale").get<std::vector<double>>();
      const auto py_copy = py_workload.at("samples_us").at("copy_per_tensor").get<std::vector<double>>();
      py_us = median(py_unscale);
      py_ratio = py_us / (m[kLoom] * 1e6);
      // Each side's unscale over its own per-tensor copy of the same bytes, paired by round:
      // cancels the machine's drift between the two processes.
      py_normalised = paired(py_unscale, py_copy) / paired(samples[kLoom], samples[kCopy]);
      std::printf("  %-36s %11.1f %11.1f %8.2f %8.3f\n", "python torch.amp.GradScaler.unscale_", py_us,
                  *std::min_element(py_unscale.begin(), py_unscale.end()), gbps(py_us / 1e6), py_ratio);
    }
    const double copy_ratio = vs_loom[kCopy], flat_ratio = vs_loom[kFlatCopy];
    std::printf("  unscale bandwidth / per-tensor copy bandwidth = %.3f   target >= 0.9   %s\n", copy_ratio,
                copy_ratio >= 0.9 ? "met" : "MISSED");
    std::printf("  unscale bandwidth / flat copy bandwidth       = %.3f\n", flat_ratio);
    std::printf("  unscale bandwidth / _foreach_mul_ bandwidth   = %.3f   (the same in-place pass, no check)\n",
                vs_loom[kForeachMul]);
    std::printf("  speedup over the naive loop                   = %.2fx\n", vs_loom[kNaive]);
    if (!py_workload.is_null())
      std::printf("  loom / python bandwidth (>1: loom faster)     = %.3f   each over its own copy: %.3f\n", py_ratio,
                  py_normalised);
    std::printf("  unscale_ result exact: %s; an inf in one tensor makes step() skip: %s\n", r.correct ? "yes" : "NO",
                r.inf_detected ? "yes" : "NO");
    all_correct = all_correct && r.correct && r.inf_detected;

    nlohmann::json w = {{"name", r.name},
                        {"tensors", r.sizes.size()},
                        {"elements", r.elements},
                        {"bytes", r.elements * 4},
                        {"sizes", r.sizes},
                        {"median_us", nlohmann::json::object()},
                        {"gbps", nlohmann::json::object()},
                        {"time_over_loom", nlohmann::json::object()},
                        {"samples_us", nlohmann::json::object()},
                        {"ratio_unscale_over_copy_bandwidth", copy_ratio},
                        {"ratio_unscale_over_flat_copy_bandwidth", flat_ratio},
                        {"ratio_unscale_over_foreach_mul_bandwidth", vs_loom[kForeachMul]},
                        {"copy_target", 0.9},
                        {"copy_target_met", copy_ratio >= 0.9},
                        {"speedup_over_naive", vs_loom[kNaive]},
                        {"correct", r.correct},
                        {"inf_detected", r.inf_detected}};
    for (int v = 0; v < kVariants; ++v) {
      w["median_us"][kKeys[v]] = m[v] * 1e6;
      w["gbps"][kKeys[v]] = gbps(m[v]);
      w["time_over_loom"][kKeys[v]] = vs_loom[v];
      std::vector<double> us;
      for (double sec : samples[v]) us.push_back(sec * 1e6);
      w["samples_us"][kKeys[v]] = us;
    }
    if (!py_workload.is_null())
      w["python"] = {{"torch_version", python.value("torch_version", "")},
                     {"unscale_us", py_us},
                     {"ratio_loom_over_python_bandwidth", py_ratio},
                     {"ratio_loom_over_python_normalised_by_copy", py_normalised}};
    out_workloads.push_back(w);
  }
  std::fflush(stdout);

  if (!c.json_path.empty()) {
    nlohmann::json doc = {{"benchmark", "amp_unscale"},
                          {"implementation", "loom"},
                          {"device", "cpu"},
                          {"dtype", "float32"},
                          {"threads", at::get_num_threads()},
                          {"scale", c.scale},
                          {"seed", c.seed},
                          {"warmup", c.warmup},
                          {"block", c.block},
                          {"iters", c.iters},
                          {"copy",
                           "copy_per_tensor: dst[i].copy_(grad[i]) per tensor; copy_flat: one copy_ of a "
                           "flat buffer of the same byte count"},
                          {"gbps_counts", "2 x gradient bytes (read + write)"},
                          {"workloads", out_workloads}};
    if (!loom::bench::write_json(c.json_path, doc, "amp_bench")) return 1;
  }
  return all_correct ? 0 : 1;
}
