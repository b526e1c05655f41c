// loom::cpu_bf16_support() against what the kernel and LibTorch report independently: the CPU's
// flags in /proc/cpuinfo (avx512_bf16) and ATEN_CPU_CAPABILITY's cap on LibTorch's kernels.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "loom/amp/autocast.h"

namespace {

// The first "flags" line of /proc/cpuinfo, as words; empty where there is none.
std::string cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("flags", 0) == 0) return " " + line.substr(line.find(':') + 1) + " ";
  return "";
}

TEST(CpuBf16Support, NativeOnlyWithAvx512KernelsAndTheCpusBf16Instructions) {
  const loom::CpuBf16Support s = loom::cpu_bf16_support();
  const std::string flags = cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags here";
  const bool instructions = flags.find(" avx512_bf16 ") != std::string::npos;
  const bool avx512_kernels = s.capability.rfind("AVX512", 0) == 0;
  EXPECT_EQ(s.native, instructions && avx512_kernels)
      << "capability " << s.capability << ", avx512_bf16 in /proc/cpuinfo: " << instructions << "; " << s.reason;
  EXPECT_NE(s.reason.find(s.capability), std::string::npos) << s.reason;
  if (!s.native) EXPECT_NE(s.reason.find("emulated through fp32"), std::string::npos) << s.reason;
}

// Run by CTest with ATEN_CPU_CAPABILITY=avx2 (unit_bf16_capped_at_avx2): LibTorch's kernels are capped
// below AVX512, so bf16 is not native whatever the CPU has; the reason says why.
TEST(CpuBf16Support, CappedKernelsAreNeverNative) {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  if (cap == nullptr || std::string(cap) != "avx2") GTEST_SKIP() << "runs under ATEN_CPU_CAPABILITY=avx2";
  const loom::CpuBf16Support s = loom::cpu_bf16_support();
  EXPECT_EQ(s.capability, "AVX2");
  EXPECT_FALSE(s.native) << s.reason;
  EXPECT_NE(s.reason.find("AVX2"), std::string::npos) << s.reason;
}

}  // namespace
