// Assignment of parameters to gradient buckets.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <vector>

namespace loom::detail {

// Walks `order` (parameter indices, in the order their gradients are expected) and groups the
// parameters into buckets: one open bucket per (dtype, device), closed when it reaches its cap
// (the first bucket of each kind `first_cap_bytes`, later ones `cap_bytes`). Buckets come out in
// the order they close, then the still-open ones; each keeps its parameters in walk order.
std::vector<std::vector<size_t>> plan_buckets(const std::vector<at::Tensor>& parameters,
                                              const std::vector<size_t>& order, size_t first_cap_bytes,
                                              size_t cap_bytes);

}  // namespace loom::detail
