// A tensor over part of a flat buffer's storage: how the reducer's buckets, ZeRO's flat parameter
// buffers and the fully sharded units seat parameters and gradients in one allocation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

namespace loom::detail {

// Shares `buffer`'s storage from element `offset`, contiguous, shaped `sizes`. Made with set_
// rather than narrow().view(): an autograd view could not be detach_()ed, which LibTorch's
// Optimizer::zero_grad() does to every gradient, and set_data() of a parameter to it keeps the
// parameter a leaf.
inline at::Tensor alias_into(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
  at::Tensor alias = at::empty({0}, buffer.options());
  alias.set_(buffer.storage(), buffer.storage_offset() + offset, sizes, strides);
  return alias;
}

}  // namespace loom::detail
