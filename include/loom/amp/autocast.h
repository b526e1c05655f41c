// Autocast for C++ training loops: an RAII guard that turns on automatic mixed precision for
// a device type (CUDA: float16 or bfloat16; CPU: bfloat16 or float16) and restores the previous state on
// exit, clearing the cast cache when the outermost guard ends (as torch.autocast does).
//
//   {
//     loom::AutocastGuard autocast(at::kCPU, at::kBFloat16);
//     auto logits = model->forward(x);       // matmuls run in bfloat16
//   }
//   auto loss = torch::nn::functional::cross_entropy(logits.to(at::kFloat), y);
//
// Whether bfloat16 pays off on this CPU: `cpu_bf16_support()`. Where the CPU has no bfloat16
// arithmetic (no AVX512-BF16 or AMX, or LibTorch's kernels capped below AVX512 by
// ATEN_CPU_CAPABILITY), every bf16 operation converts to fp32 and back, and bf16 autocast runs
// several times slower than plain fp32 (train_gpt: 5.1x, median of 3 runs, on a 2-core AVX2 AMD EPYC):
//
//   const loom::CpuBf16Support bf16 = loom::cpu_bf16_support();
//   const bool autocast = bf16.native;            // else train in fp32
//   std::printf("precision: %s (%s)\n", autocast ? "bf16" : "fp32", bf16.reason.c_str());
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace loom {

struct CpuBf16Support {
  bool native = false;     // bfloat16 arithmetic in hardware, and LibTorch's kernels use it
  std::string capability;  // LibTorch's CPU kernel level ("AVX2", "AVX512", ...; ATEN_CPU_CAPABILITY caps it)
  std::string reason;      // one line: what was found, e.g. "LibTorch's CPU kernels are AVX2, without bfloat16 arithmetic"
};

// What this process's CPU and LibTorch's kernel dispatch offer for bfloat16 (cheap; read once).
CpuBf16Support cpu_bf16_support();

class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
};

}  // namespace loom
