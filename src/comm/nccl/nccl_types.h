// How torchloom's dtypes and reduce operations map onto NCCL's: pure functions, unit-tested on
// machines without a GPU (tests/unit/test_nccl_types.cpp).
#pragma once

#include <c10/core/ScalarType.h>
#include <nccl.h>

#include "loom/comm/types.h"

namespace loom::nccl::detail {

// Throws loom::InvalidArgumentError for a dtype NCCL cannot carry.
ncclDataType_t nccl_datatype(c10::ScalarType type);
// bool travels as bytes holding 0 or 1: logical or is max, logical and is min (a byte sum could
// wrap to 0). Throws loom::InvalidArgumentError for avg on bool.
ncclRedOp_t nccl_reduce_op(ReduceOp op, c10::ScalarType type);

}  // namespace loom::nccl::detail
