// Autocast for C++ training loops: an RAII guard that turns on automatic mixed precision for
// a device type (CUDA: float16 or bfloat16; CPU: bfloat16 or float16) and restores the previous state on
// exit, clearing the cast cache when the outermost guard ends (as torch.autocast does).
//
//   {
//     loom::AutocastGuard autocast(at::kCPU, at::kBFloat16);
//     auto logits = model->forward(x);       // matmuls run in bfloat16
//   }
//   auto loss = torch::nn::functional::cross_entropy(logits.to(at::kFloat), y);
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace loom {

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
