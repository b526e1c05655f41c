// Host buffers that are freed every iteration and wanted again the next one (ZeRO stage 2's
// gradient buckets, ReducerOptions::release_buckets).
//
// Freed through glibc's malloc, a bucket of tens of MB goes back to the kernel (munmap or a heap
// trim) and is faulted in page by page at its next use: measured 5-15% of a ZeRO stage 2 step on
// the CPU. Here each bucket keeps its own mapping; when its tensor dies the pages are handed back
// with madvise(MADV_FREE), as jemalloc and tcmalloc return memory: the kernel takes them when it
// needs memory, and until then the next iteration writes into them without a fault. The content
// after a release is undefined (old data or zeros): every user writes before it reads.
//
// Elsewhere than Linux on the CPU (and on devices, whose caching allocators already keep memory)
// take() is at::empty.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace loom::detail {

class ReleasedBuffers : public std::enable_shared_from_this<ReleasedBuffers> {
 public:
  ~ReleasedBuffers();
  // A tensor of `numel` elements for slot `slot` (one per bucket): the slot's mapping when it is
  // free and large enough, a new one otherwise (the old one is unmapped once its tensor dies).
  at::Tensor take(size_t slot, int64_t numel, const at::TensorOptions& options);

 private:
  struct Region {
    void* base = nullptr;
    size_t bytes = 0;
    bool in_use = false;
  };
  void give_back(size_t slot, void* base);
  std::mutex mutex_;
  std::vector<Region> regions_;      // by slot
  std::vector<Region> retired_;      // replaced while in use: unmapped when given back
};

}  // namespace loom::detail
