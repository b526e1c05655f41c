// Built-in communication hooks of the gradient reducer.
#include <ATen/ops/empty.h>

#include "loom/parallel/data_parallel.h"

namespace loom::comm_hooks {

CommHook all_reduce_average() {
  return [](GradBucket& bucket) -> PendingReduction {
    if (bucket.divisor == bucket.group->size() && at::isFloatingType(bucket.buffer.scalar_type()))
      return {bucket.group->all_reduce(bucket.buffer, {ReduceOp::Avg}), nullptr};
    at::Tensor buffer = bucket.buffer;
    const double divisor = bucket.divisor;
    return {bucket.group->all_reduce(buffer, {ReduceOp::Sum}), [buffer, divisor]() mutable {
              if (divisor != 1) buffer.div_(divisor);
            }};
  };
}

namespace {

CommHook compress(at::ScalarType wire_dtype) {
  return [wire_dtype](GradBucket& bucket) -> PendingReduction {
    // Divide first: the sum of already-averaged values stays in range for float16.
    at::Tensor compressed = bucket.buffer.div(bucket.divisor).to(wire_dtype);
    at::Tensor buffer = bucket.buffer;
    WorkPtr work = bucket.group->all_reduce(compressed, {ReduceOp::Sum});
    return {work, [buffer, compressed]() mutable { buffer.copy_(compressed); }};
  };
}

}  // namespace

CommHook fp16_compress() { return compress(at::kHalf); }
CommHook bf16_compress() { return compress(at::kBFloat16); }

}  // namespace loom::comm_hooks
