// Device-to-host copies for checkpoint staging through a small pinned ring.
//
// A snapshot of a whole shard in pinned memory would page-lock tens of GB per rank (LibTorch's
// caching host allocator also rounds each block up to a power of two and keeps it), and a
// device-wide synchronize would wait for every other stream (NCCL's, prefetches). Instead the bytes
// go through a few fixed pinned slots on a copy stream of their own, ordered after the producer's
// current stream by an event, and are copied on into pageable memory as each slot lands.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace loom::detail::ckpt {

class DeviceToHostRing {
 public:
  static constexpr size_t kDefaultSlotBytes = 64u << 20;

  explicit DeviceToHostRing(size_t slot_bytes = kDefaultSlotBytes, int slots = 2);

  // Copies each device tensor's bytes into its host destination (at least nbytes of the tensor);
  // returns when every byte is there. Waits only for the work the tensors' devices' current streams
  // queued before the call, not for other streams.
  void copy(const std::vector<std::pair<at::Tensor, void*>>& jobs);

  // The pinned bytes this ring holds (allocated at the first copy, kept for the next).
  size_t pinned_bytes() const;

 private:
  size_t slot_bytes_;
  int slot_count_;
  std::vector<at::Tensor> slots_;
};

}  // namespace loom::detail::ckpt
