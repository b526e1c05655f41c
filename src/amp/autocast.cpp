#include "loom/amp/autocast.h"

#include <ATen/Version.h>
#include <ATen/autocast_mode.h>

#include "loom/error.h"

namespace loom {

CpuBf16Support cpu_bf16_support() {
  CpuBf16Support s;
  // LibTorch's dispatch level, as torch.backends.cpu.get_cpu_capability() reports it: the CPU's
  // best, or lower where ATEN_CPU_CAPABILITY says so. Its bfloat16 kernels use the hardware's
  // bfloat16 instructions only at AVX512 and above.
  s.capability = at::get_cpu_capability();
  const bool avx512_kernels = s.capability.rfind("AVX512", 0) == 0;
#if defined(__x86_64__) || defined(__i386__)
  // AMX-BF16 CPUs (Sapphire Rapids and later) have AVX512-BF16 too.
  const bool bf16_instructions = __builtin_cpu_supports("avx512bf16");
#else
  const bool bf16_instructions = false;  // not detected on this architecture: the safe choice is fp32
#endif
  s.native = avx512_kernels && bf16_instructions;
  if (s.native)
    s.reason = "LibTorch's CPU kernels are " + s.capability + " and the CPU has AVX512-BF16";
  else if (!bf16_instructions)
    s.reason = "the CPU has no bfloat16 arithmetic (no AVX512-BF16 or AMX; LibTorch's kernels are " + s.capability +
               "): bf16 is emulated through fp32";
  else
    s.reason = "LibTorch's CPU kernels are " + s.capability +
               " (ATEN_CPU_CAPABILITY), below the AVX512 kernels that use the CPU's AVX512-BF16: bf16 is emulated "
               "through fp32";
  return s;
}

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled)
    : device_(device),
      previous_enabled_(at::autocast::is_autocast_enabled(device)),
      previous_dtype_(at::autocast::get_autocast_dtype(device)) {
  if (device == c10::DeviceType::CPU && dtype != c10::ScalarType::BFloat16 && dtype != c10::ScalarType::Half)
    throw InvalidArgumentError(std::string("AutocastGuard: CPU autocast runs in bfloat16 or float16, found ") +
                               c10::toString(dtype));
  if (device == c10::DeviceType::CUDA && dtype != c10::ScalarType::BFloat16 && dtype != c10::ScalarType::Half)
    throw InvalidArgumentError(std::string("AutocastGuard: CUDA autocast runs in float16 or bfloat16, found ") +
                               c10::toString(dtype));
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // The cache holds casts of the weights made inside the region; it must not outlive it.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, previous_enabled_);
  at::autocast::set_autocast_dtype(device_, previous_dtype_);
}

}  // namespace loom
