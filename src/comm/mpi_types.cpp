#include "comm/mpi_types.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "loom/error.h"

namespace loom::detail {
namespace {

// One MPI_Op per (16-bit float type, reduction). Values are widened to float, combined and
// rounded back, as NCCL does for these types.
template <typename T, typename Combine>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  Combine combine;
  for (int i = 0; i < *len; ++i) b[i] = T(combine(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

struct Add {
  float operator()(float x, float y) const { return x + y; }
};
struct Mul {
  float operator()(float x, float y) const { return x * y; }
};
struct Min {
  // NaN propagates, as with the built-in operations on float.
  float operator()(float x, float y) const { return (x != x || y != y) ? x + y : std::min(x, y); }
};
struct Max {
  float operator()(float x, float y) const { return (x != x || y != y) ? x + y : std::max(x, y); }
};

// [0] Half, [1] BFloat16; within each: sum, product, min, max.
MPI_Op g_ops[2][4] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                      {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return 0;
    case ReduceOp::Product: return 1;
    case ReduceOp::Min: return 2;
    case ReduceOp::Max: return 3;
  }
  return 0;
}

template <typename T>
void create_family(MPI_Op* ops) {
  MPI_Op_create(&reduce_16bit<T, Add>, 1, &ops[0]);
  MPI_Op_create(&reduce_16bit<T, Mul>, 1, &ops[1]);
  MPI_Op_create(&reduce_16bit<T, Min>, 1, &ops[2]);
  MPI_Op_create(&reduce_16bit<T, Max>, 1, &ops[3]);
}

}  // namespace

void create_mpi_reduce_ops() {
  create_family<c10::Half>(g_ops[0]);
  create_family<c10::BFloat16>(g_ops[1]);
}

void free_mpi_reduce_ops() {
  for (auto& family : g_ops)
    for (auto& op : family)
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
}

MPI_Datatype mpi_datatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return MPI_FLOAT;
    case c10::ScalarType::Double: return MPI_DOUBLE;
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16: return MPI_UINT16_T;
    case c10::ScalarType::Char: return MPI_INT8_T;
    case c10::ScalarType::Byte: return MPI_UINT8_T;
    case c10::ScalarType::Int: return MPI_INT32_T;
    case c10::ScalarType::Long: return MPI_INT64_T;
    case c10::ScalarType::Bool: return MPI_C_BOOL;
    default:
      throw InvalidArgumentError(std::string("MPI backend: dtype ") + c10::toString(dtype) + " is not supported");
  }
}

MPI_Op mpi_reduce_op(ReduceOp op, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Half) return g_ops[0][op_index(op)];
  if (dtype == c10::ScalarType::BFloat16) return g_ops[1][op_index(op)];
  if (dtype == c10::ScalarType::Bool) {
    return (op == ReduceOp::Min || op == ReduceOp::Product) ? MPI_LAND : MPI_LOR;
  }
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return MPI_SUM;
    case ReduceOp::Product: return MPI_PROD;
    case ReduceOp::Min: return MPI_MIN;
    case ReduceOp::Max: return MPI_MAX;
  }
  return MPI_SUM;
}

}  // namespace loom::detail
