#include "comm/nccl/nccl_types.h"

#include <string>

#include "loom/error.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "torchloom's NCCL backend needs NCCL 2.18 or newer (ncclCommSplit, nonblocking communicators, ncclAvg)"
#endif

namespace loom::nccl::detail {

ncclDataType_t nccl_datatype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return ncclFloat32;
    case c10::ScalarType::Double: return ncclFloat64;
    case c10::ScalarType::Half: return ncclFloat16;
    case c10::ScalarType::BFloat16: return ncclBfloat16;
    case c10::ScalarType::Char: return ncclInt8;
    case c10::ScalarType::Byte: return ncclUint8;
    case c10::ScalarType::Int: return ncclInt32;
    case c10::ScalarType::Long: return ncclInt64;
    case c10::ScalarType::Bool: return ncclUint8;  // one byte, 0 or 1
    default:
      throw InvalidArgumentError(std::string("dtype ") + c10::toString(type) + " has no NCCL equivalent");
  }
}

ncclRedOp_t nccl_reduce_op(ReduceOp op, c10::ScalarType type) {
  if (type == c10::ScalarType::Bool) {
    if (op == ReduceOp::Sum || op == ReduceOp::Max) return ncclMax;
    if (op == ReduceOp::Min || op == ReduceOp::Product) return ncclMin;
    throw InvalidArgumentError("reduce op avg is not defined for bool tensors");
  }
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Min: return ncclMin;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Product: return ncclProd;
  }
  throw InvalidArgumentError("unknown reduce op");
}

}  // namespace loom::nccl::detail
