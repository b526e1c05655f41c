// Mapping of torch dtypes and reduce operations to MPI. MPI has no float16 or bfloat16: those
// travel as 16-bit words and reduce with user-defined operations that compute in float.
#pragma once

#include <c10/core/ScalarType.h>
#include <mpi.h>

#include "loom/comm/types.h"

namespace loom::detail {

MPI_Datatype mpi_datatype(c10::ScalarType dtype);
// Avg maps to the sum (the caller divides); bool reduces with logical or (sum, max) and and (min, product).
MPI_Op mpi_reduce_op(ReduceOp op, c10::ScalarType dtype);

// Creates and frees the user-defined operations; called by the MPI runtime.
void create_mpi_reduce_ops();
void free_mpi_reduce_ops();

}  // namespace loom::detail
