#include "train/metrics_gpu_sampler.h"

#include <string>

#include "loom/log.h"

namespace loom::detail {

GpuSampler::GpuSampler(unsigned index, std::chrono::milliseconds period)
    : thread_([this, index, period] { run(index, period); }) {}

GpuSampler::~GpuSampler() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::optional<topo::GpuGauges> GpuSampler::latest() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return latest_;
}

void GpuSampler::run(unsigned index, std::chrono::milliseconds period) {
  bool reported = false;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    std::string why;
    auto gauges = topo::read_gpu_gauges(index, why);  // the slow part, outside the lock
    if (!gauges && !reported) {
      LOOM_LOG(info, "metrics: no GPU gauges: " << why);
      reported = true;
    }
    lock.lock();
    latest_ = gauges;
    wake_.wait_for(lock, period, [this] { return stop_; });
  }
}

}  // namespace loom::detail
