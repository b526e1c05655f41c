// Helpers shared by the tensor-parallel sources: a null group is a group of one, and error
// messages start with who raised them.
#pragma once

#include <cstdint>
#include <string>

#include "loom/error.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom::detail {

inline int tp_size(const TensorParallelGroup& group) { return group ? group->size() : 1; }
inline int tp_rank(const TensorParallelGroup& group) { return group ? group->rank() : 0; }

// "[rank 3] ColumnParallelLinear group=tp1 (rank 1 of 2)", or "[rank 3] ColumnParallelLinear"
// without a group.
inline std::string tp_where(const TensorParallelGroup& group, const std::string& what) {
  return group ? group->context(what).prefix() : ErrorContext(what).prefix();
}

// Throws InvalidArgumentError naming what was expected (a multiple of degree) and what was found.
inline void require_divisible(const std::string& where, const std::string& what, int64_t value, int degree) {
  if (value <= 0 || value % degree != 0)
    throw InvalidArgumentError(where + ": " + what + " must be a positive multiple of the tensor-parallel degree " +
                               std::to_string(degree) + "; found " + std::to_string(value) + " (" +
                               std::to_string(value) + " % " + std::to_string(degree) + " = " +
                               std::to_string(value % degree) + ")");
}

// Checks that read a device value on the host (a range check, a cross-rank agreement) are free on
// the CPU; on a GPU they would stall the stream every call, so there they run only in the debug
// mode (LOOM_CHECK_COLLECTIVES=1).
bool host_checks_enabled(const at::Tensor& on);

// An in-place all-reduce over the TP group, counted in tp::comm_stats() (for code that
// communicates outside the region operations, such as the cross-entropy).
void tp_all_reduce(at::Tensor& tensor, const TensorParallelGroup& group, ReduceOp op);

// Counts an all-reduce of `tensor` (issued by the caller) in tp::comm_stats().
void count_all_reduce(const at::Tensor& tensor);
// Waits for a tensor-parallel collective; the time blocked is tp::comm_stats().wait_seconds, the
// exposed communication of the tensor-parallel layers.
void wait_counted(Work& work);

}  // namespace loom::detail
