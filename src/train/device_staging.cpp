#include "train/device_staging.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <unordered_map>

#include "loom/error.h"
#include "train/checkpoint_io.h"

namespace loom::detail::ckpt {

namespace {

// A chunk in flight: which slot it occupies, where its bytes go, and the event that says they landed.
struct InFlight {
  int slot;
  void* destination;
  size_t bytes;
  c10::Event landed;
};

}  // namespace

DeviceToHostRing::DeviceToHostRing(size_t slot_bytes, int slots)
    : slot_bytes_(std::max<size_t>(slot_bytes, 1)), slot_count_(std::max(slots, 1)) {}

size_t DeviceToHostRing::pinned_bytes() const { return slots_.size() * slot_bytes_; }

void DeviceToHostRing::copy(const std::vector<std::pair<at::Tensor, void*>>& jobs) {
  if (jobs.empty()) return;
  if (slots_.empty())
    for (int i = 0; i < slot_count_; ++i)
      slots_.push_back(host_empty({static_cast<int64_t>(slot_bytes_)}, at::kByte, /*pinned=*/true));

  // Contiguous byte views first, on the producers' streams (kept alive until every copy landed:
  // a temporary freed early could be reused by the producer while the copy stream still reads it).
  std::vector<at::Tensor> sources;
  sources.reserve(jobs.size());
  for (const auto& job : jobs) sources.push_back(job.first.contiguous().view({-1}).view(at::kByte));

  // One copy stream per device, ordered after what that device's current stream queued so far.
  std::unordered_map<c10::Device, c10::Stream> copy_streams;
  for (const auto& source : sources) {
    const c10::Device device = source.device();
    if (copy_streams.count(device)) continue;
    c10::impl::VirtualGuardImpl guard(device.type());
    const c10::Stream producer = guard.getStream(device);
    const c10::Stream copier = guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
    c10::Event produced(device.type());
    produced.record(producer);
    produced.block(copier);
    copy_streams.emplace(device, copier);
  }

  std::deque<InFlight> in_flight;
  std::vector<bool> busy(slots_.size(), false);
  auto land_oldest = [&] {
    InFlight& oldest = in_flight.front();
    oldest.landed.synchronize();
    std::memcpy(oldest.destination, slots_[oldest.slot].data_ptr(), oldest.bytes);
    busy[oldest.slot] = false;
    in_flight.pop_front();
  };
  for (size_t j = 0; j < jobs.size(); ++j) {
    const at::Tensor& bytes = sources[j];
    void* destination = jobs[j].second;
    const c10::Stream copier = copy_streams.at(bytes.device());
    const int64_t total = bytes.numel();
    for (int64_t done = 0; done < total;) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(slot_bytes_), total - done);
      if (in_flight.size() == slots_.size()) land_oldest();
      const int slot = static_cast<int>(std::find(busy.begin(), busy.end(), false) - busy.begin());
      {
        c10::StreamGuard on_copier(copier);
        slots_[slot].narrow(0, 0, n).copy_(bytes.narrow(0, done, n), /*non_blocking=*/true);
      }
      c10::Event landed(bytes.device().type());
      landed.record(copier);
      busy[slot] = true;
      in_flight.push_back({slot, static_cast<uint8_t*>(destination) + done, static_cast<size_t>(n), std::move(landed)});
      done += n;
    }
  }
  while (!in_flight.empty()) land_oldest();
}

}  // namespace loom::detail::ckpt
