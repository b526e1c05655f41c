// Argument checks shared by every backend: run on the calling rank before anything is sent.
#include <ATen/core/Tensor.h>

#include <sstream>

#include "comm/op.h"
#include "loom/error.h"

namespace loom::detail {
namespace {

bool supported_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Char:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Bool:
      return true;
    default:
      return false;
  }
}

std::string shape_string(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < sizes.size(); ++i) s << (i ? ", " : "") << sizes[i];
  s << "]";
  return s.str();
}

[[noreturn]] void reject(const Op& op, const std::string& what) {
  std::ostringstream s;
  s << "[rank " << op.info.world_rank << "] " << to_string(op.info.type) << " group=" << op.info.group
    << " (rank " << op.info.rank << " of " << op.info.group_size << "): " << what;
  throw InvalidArgumentError(s.str());
}

void check_tensor(const Op& op, const at::Tensor& t, const char* role, c10::DeviceType device_type) {
  if (!t.defined()) reject(op, std::string(role) + ": expected a defined tensor, found an undefined one");
  if (t.layout() != c10::kStrided)
    reject(op, std::string(role) + ": expected a dense (strided) tensor, found layout " + c10::toString(t.layout()));
  if (t.device().type() != device_type)
    reject(op, std::string(role) + ": expected a tensor on " + c10::DeviceTypeName(device_type, true) +
                   ", found one on " + t.device().str());
  if (!supported_dtype(t.scalar_type()))
    reject(op, std::string(role) + ": dtype " + c10::toString(t.scalar_type()) +
                   " is not supported (expected float32, float64, float16, bfloat16, int8, uint8, int32, int64 or bool)");
  if (!t.is_contiguous())
    reject(op, std::string(role) + ": expected a contiguous tensor, found shape " + shape_string(t.sizes()) +
                   " with strides " + shape_string(t.strides()) + " (call .contiguous() first)");
}

void check_same(const Op& op, const at::Tensor& a, const char* a_role, const at::Tensor& b, const char* b_role) {
  if (a.scalar_type() != b.scalar_type())
    reject(op, std::string("expected ") + b_role + " dtype " + c10::toString(a.scalar_type()) + " (as " + a_role +
                   "), found " + c10::toString(b.scalar_type()));
  if (a.device() != b.device())
    reject(op, std::string("expected ") + b_role + " on " + a.device().str() + " (as " + a_role + "), found " +
                   b.device().str());
}

void check_rank(const Op& op, int value, const char* role) {
  if (value < 0 || value >= op.info.group_size)
    reject(op, std::string(role) + " " + std::to_string(value) + " is out of range: expected 0.." +
                   std::to_string(op.info.group_size - 1));
}

}  // namespace

void validate(const Op& op, c10::DeviceType device_type) {
  const int n = op.info.group_size;
  for (const auto& t : op.inputs) check_tensor(op, t, "input", device_type);
  for (const auto& t : op.outputs) check_tensor(op, t, "output", device_type);

  const bool reduces = op.info.type == OpType::AllReduce || op.info.type == OpType::ReduceScatter;
  if (reduces && op.info.reduce == ReduceOp::Avg) {
    const auto& t = op.outputs.front();
    if (!at::isFloatingType(t.scalar_type()))
      reject(op, std::string("op avg needs a floating-point dtype, found ") + c10::toString(t.scalar_type()) +
                     " (use sum and divide)");
  }

  switch (op.info.type) {
    case OpType::AllReduce:
    case OpType::Barrier:
      break;
    case OpType::Broadcast:
      check_rank(op, op.info.peer, "root");
      break;
    case OpType::AllGather: {
      const auto& in = op.inputs.front();
      if (!op.list_output) {
        const auto& out = op.outputs.front();
        check_same(op, in, "input", out, "output");
        if (out.numel() != n * in.numel())
          reject(op, "output has " + std::to_string(out.numel()) + " elements, expected " +
                         std::to_string(n * in.numel()) + " (group size " + std::to_string(n) + " x input elements " +
                         std::to_string(in.numel()) + ")");
        break;
      }
      if (static_cast<int>(op.outputs.size()) != n)
        reject(op, "expected " + std::to_string(n) + " output tensors (one per rank), found " +
                       std::to_string(op.outputs.size()));
      for (const auto& out : op.outputs) {
        check_same(op, in, "input", out, "each output");
        if (out.sizes() != in.sizes())
          reject(op, "expected each output shaped " + shape_string(in.sizes()) + " like the input, found " +
                         shape_string(out.sizes()));
      }
      break;
    }
    case OpType::ReduceScatter: {
      const auto& in = op.inputs.front();
      const auto& out = op.outputs.front();
      check_same(op, out, "output", in, "input");
      if (in.numel() != n * out.numel())
        reject(op, "input has " + std::to_string(in.numel()) + " elements, expected " + std::to_string(n * out.numel()) +
                       " (group size " + std::to_string(n) + " x output elements " + std::to_string(out.numel()) + ")");
      break;
    }
    case OpType::AllToAll: {
      const auto& in = op.inputs.front();
      const auto& out = op.outputs.front();
      check_same(op, in, "input", out, "output");
      if (in.numel() != out.numel())
        reject(op, "output has " + std::to_string(out.numel()) + " elements, expected " + std::to_string(in.numel()) +
                       " (as many as the input)");
      if (in.numel() % n != 0)
        reject(op, "input has " + std::to_string(in.numel()) + " elements, expected a multiple of the group size " +
                       std::to_string(n));
      break;
    }
    case OpType::Send:
    case OpType::Recv:
      check_rank(op, op.info.peer, op.info.type == OpType::Send ? "destination" : "source");
      if (op.tag < 0 || op.tag > 32767)
        reject(op, "tag " + std::to_string(op.tag) + " is out of range: expected 0..32767");
      if (op.info.peer == op.info.rank)
        reject(op, std::string("peer ") + std::to_string(op.info.peer) + " is this rank itself: expected another rank");
      break;
  }
}

}  // namespace loom::detail
