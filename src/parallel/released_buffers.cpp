#include "parallel/released_buffers.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>

namespace loom::detail {

namespace {

#if defined(__linux__) && defined(MADV_FREE)
constexpr bool kLazyFree = true;
#else
constexpr bool kLazyFree = false;
#endif

}  // namespace

ReleasedBuffers::~ReleasedBuffers() {
#if defined(__linux__)
  // Tensors hold a reference to this object: none is alive now.
  for (auto& r : regions_)
    if (r.base) ::munmap(r.base, r.bytes);
  for (auto& r : retired_)
    if (r.base) ::munmap(r.base, r.bytes);
#endif
}

at::Tensor ReleasedBuffers::take(size_t slot, int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (!kLazyFree || !options.device().is_cpu() || options.pinned_memory() || bytes == 0)
    return at::empty({numel}, options);
#if defined(__linux__)
  void* base = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (regions_.size() <= slot) regions_.resize(slot + 1);
    Region& r = regions_[slot];
    if (r.base && (r.in_use || r.bytes < bytes)) {
      if (r.in_use) {
        retired_.push_back(r);  // unmapped when its tensor dies
      } else {
        ::munmap(r.base, r.bytes);
      }
      r = Region{};
    }
    if (!r.base) {
      void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mapped == MAP_FAILED) return at::empty({numel}, options);
      r = Region{mapped, bytes, false};
    }
    r.in_use = true;
    base = r.base;
  }
  std::shared_ptr<ReleasedBuffers> keep = shared_from_this();  // the mappings outlive every tensor
  return at::from_blob(
      base, {numel}, [keep, slot](void* p) { keep->give_back(slot, p); }, options);
#else
  return at::empty({numel}, options);
#endif
}

void ReleasedBuffers::give_back(size_t slot, void* base) {
#if defined(__linux__)
  std::lock_guard<std::mutex> lock(mutex_);
  if (slot < regions_.size() && regions_[slot].base == base) {
    ::madvise(base, regions_[slot].bytes, MADV_FREE);
    regions_[slot].in_use = false;
    return;
  }
  auto it = std::find_if(retired_.begin(), retired_.end(), [base](const Region& r) { return r.base == base; });
  if (it != retired_.end()) {
    ::munmap(it->base, it->bytes);
    retired_.erase(it);
  }
#endif
}

}  // namespace loom::detail
