// Weight gradients a zero-bubble schedule defers (internal to the pipeline executor and
// loom::pp::linear). While a DeferWeightGradients scope is open, loom::pp::linear's backward
// computes only the input gradient and appends the weight-gradient work to the scope's list; the
// executor runs the list at the plan's W action for that micro-batch and stage.
#pragma once

#include <functional>
#include <vector>

namespace loom::pp::detail {

using DeferredGradient = std::function<void()>;

// One at a time per process (the executor's input-gradient pass). Process-wide, not per thread:
// autograd may run a backward on its own threads (a device's).
class DeferWeightGradients {
 public:
  explicit DeferWeightGradients(std::vector<DeferredGradient>& into);
  ~DeferWeightGradients();
  DeferWeightGradients(const DeferWeightGradients&) = delete;
  DeferWeightGradients& operator=(const DeferWeightGradients&) = delete;
};

// The list an open scope fills, or nullptr.
std::vector<DeferredGradient>* deferred_weight_gradients();

}  // namespace loom::pp::detail
