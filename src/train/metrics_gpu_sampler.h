// GPU gauges for the metrics exporter, read from NVML on a thread of their own: NVML's PCIe
// throughput calls each sample a counter over 20 ms, so reading them while rendering put 40 ms or
// more on the training step that wrote the metrics file. The sampler reads every `period` and the
// exporter renders the last reading.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "loom/topology/gpu_gauges.h"

namespace loom::detail {

class GpuSampler {
 public:
  // Starts sampling NVML device `index` (NVML's numbering) at once, then every `period`.
  GpuSampler(unsigned index, std::chrono::milliseconds period);
  ~GpuSampler();  // waits for a reading in progress (bounded by NVML), never for a full period
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // The last reading; nullopt before the first one completes, or where NVML has no such device.
  std::optional<topo::GpuGauges> latest() const;

 private:
  void run(unsigned index, std::chrono::milliseconds period);

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::optional<topo::GpuGauges> latest_;
  std::thread thread_;
};

}  // namespace loom::detail
