// What the module wrapper needs beyond the reducer: buffer broadcast and a parameter check.
#include <ATen/ops/empty.h>

#include "loom/error.h"
#include "loom/parallel/data_parallel.h"

namespace loom::detail {

void broadcast_tensors(Communicator& group, const std::vector<at::Tensor>& tensors, const char* purpose) {
  if (group.size() == 1 || tensors.empty()) return;
  InternalOperations internal(purpose);
  std::vector<WorkPtr> works;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (staging, destination)
  for (const auto& t : tensors) {
    at::Tensor data = t.detach();
    if (data.is_contiguous()) {
      works.push_back(group.broadcast(data, {0}));
    } else {
      at::Tensor staging = data.contiguous();
      works.push_back(group.broadcast(staging, {0}));
      copies.emplace_back(staging, data);
    }
  }
  for (auto& w : works) w->wait();
  for (auto& [staging, destination] : copies) destination.copy_(staging);
}

void check_same_parameters(const GradientReducer& reducer, const std::vector<at::Tensor>& current) {
  const auto& known = reducer.parameters();
  const ErrorContext where = reducer.group().context("DistributedDataParallel forward");
  if (current.size() != known.size())
    throw InvalidArgumentError(where.prefix() + ": the module has " +
                               std::to_string(current.size()) + " parameters but the reducer was built with " +
                               std::to_string(known.size()) +
                               " (parameters added or removed after construction are not reduced: build the "
                               "DistributedDataParallel wrapper after the model is complete)");
  for (size_t i = 0; i < known.size(); ++i) {
    if (!current[i].is_same(known[i]))
      throw InvalidArgumentError(where.prefix() + ": parameter " +
                                 std::to_string(i) +
                                 " was replaced after construction (expected the tensor the reducer hooks)");
  }
}

}  // namespace loom::detail
