// The dtype and reduce-op mapping of the NCCL backend, checked on any machine (no GPU needed): a
// wrong mapping (float16 and bfloat16 swapped, bool summed as bytes) would otherwise only show on
// a GPU with two ranks, where NCCL's one-rank shortcut cannot hide it.
#include <gtest/gtest.h>

#include "comm/nccl/nccl_types.h"
#include "loom/error.h"

using loom::ReduceOp;
using loom::nccl::detail::nccl_datatype;
using loom::nccl::detail::nccl_reduce_op;

TEST(NcclTypes, EveryDtypeMapsToTheNcclTypeOfItsWidthAndKind) {
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Float), ncclFloat32);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Double), ncclFloat64);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Half), ncclFloat16);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::BFloat16), ncclBfloat16);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Char), ncclInt8);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Byte), ncclUint8);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Int), ncclInt32);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Long), ncclInt64);
  EXPECT_EQ(nccl_datatype(c10::ScalarType::Bool), ncclUint8);
  EXPECT_THROW(nccl_datatype(c10::ScalarType::ComplexFloat), loom::InvalidArgumentError);
}

TEST(NcclTypes, ReduceOpsMapOneToOneAndBoolIsLogical) {
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Sum, c10::ScalarType::Float), ncclSum);
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Avg, c10::ScalarType::Half), ncclAvg);
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Min, c10::ScalarType::Int), ncclMin);
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Max, c10::ScalarType::Long), ncclMax);
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Product, c10::ScalarType::Double), ncclProd);
  // Bytes holding 0 or 1: or is max, and is min (a byte sum of 256 ranks would wrap to 0).
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Sum, c10::ScalarType::Bool), ncclMax);
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Max, c10::ScalarType::Bool), ncclMax);
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Min, c10::ScalarType::Bool), ncclMin);
  EXPECT_EQ(nccl_reduce_op(ReduceOp::Product, c10::ScalarType::Bool), ncclMin);
  EXPECT_THROW(nccl_reduce_op(ReduceOp::Avg, c10::ScalarType::Bool), loom::InvalidArgumentError);
}
