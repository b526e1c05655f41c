// Argument checks shared by every backend: run on the calling rank before anything is sent.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
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
  throw InvalidArgumentError(ErrorContext(to_string(op.info.type), op.info.group, op.info.rank, op.info.group_size)(what));
}

void check_tensor(const Op& op, const at::Tensor& t, const char* role, const at::Device& device) {
  if (!t.defined()) reject(op, std::string(role) + ": expected a defined tensor, found an undefined one");
  if (t.layout() != c10::kStrided)
    reject(op, std::string(role) + ": expected a dense (strided) tensor, found layout " + c10::toString(t.layout()));
  const bool same_device = t.device().type() == device.type() &&
                           (!device.has_index() || t.device().index() == device.index());
  if (!same_device)
    reject(op, std::string(role) + ": expected a tensor on " + device.str() + " (this communicator's device), found one on " +
                   t.device().str());
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

void check_peer(const Op& op, int peer, int tag, bool send) {
  check_rank(op, peer, send ? "destination" : "source");
  if (tag < 0 || tag > kMaxTag)
    reject(op, "tag " + std::to_string(tag) + " is out of range: expected 0.." + std::to_string(kMaxTag));
  if (peer == op.info.rank)
    reject(op, std::string("peer ") + std::to_string(peer) + " is this rank itself: expected another rank");
}

// The bytes a (contiguous) tensor covers. Tensors on different devices never overlap; an empty
// tensor covers nothing.
struct Span {
  uintptr_t begin = 0, end = 0;
};
Span span_of(const at::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + t.nbytes()};
}
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  const Span x = span_of(a), y = span_of(b);
  return x.begin < y.end && y.begin < x.end;
}

// MPI forbids a collective's buffers to alias (MPI 4.0, section 2.6.2) unless passed as
// MPI_IN_PLACE, and NCCL allows only its documented in-place forms: anything else gives wrong
// results or an error depending on sizes and transport, so it is refused before anything is sent.
[[noreturn]] void reject_alias(const Op& op, const std::string& what, const std::string& allowed) {
  reject(op, what + ": one operation's buffers must not overlap (" + allowed + ")");
}

void check_aliasing(const Op& op, const at::Device& device) {
  switch (op.info.type) {
    case OpType::AllGather: {
      const auto& in = op.inputs.front();
      if (!op.list_output) {
        const auto& out = op.outputs.front();
        // In place: the input is exactly this rank's chunk of the output.
        const auto own = reinterpret_cast<uintptr_t>(out.data_ptr()) + static_cast<uintptr_t>(op.info.rank) * in.nbytes();
        if (overlap(in, out) && reinterpret_cast<uintptr_t>(in.data_ptr()) != own)
          reject_alias(op, "the input overlaps the output other than as this rank's chunk",
                       "in place, the input must be exactly chunk " + std::to_string(op.info.rank) + " of the output");
        break;
      }
      // Outputs must be disjoint (each is written with its rank's data): sorted by address, each
      // checked against the next, so a large group costs n log n.
      std::vector<std::pair<Span, size_t>> spans;
      for (size_t r = 0; r < op.outputs.size(); ++r)
        if (op.outputs[r].numel() > 0) spans.push_back({span_of(op.outputs[r]), r});
      std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
      for (size_t i = 1; i < spans.size(); ++i)
        if (spans[i].first.begin < spans[i - 1].first.end &&
            op.outputs[spans[i].second].device() == op.outputs[spans[i - 1].second].device())
          reject_alias(op,
                       "outputs " + std::to_string(std::min(spans[i - 1].second, spans[i].second)) + " and " +
                           std::to_string(std::max(spans[i - 1].second, spans[i].second)) + " overlap",
                       "give each rank's output its own memory");
      break;
    }
    case OpType::ReduceScatter: {
      const auto& in = op.inputs.front();
      const auto& out = op.outputs.front();
      if (!overlap(in, out)) break;
      const auto own = reinterpret_cast<uintptr_t>(in.data_ptr()) + static_cast<uintptr_t>(op.info.rank) * out.nbytes();
      // In place (NCCL's form, which the host backends follow): the output is this rank's chunk of the input.
      if (reinterpret_cast<uintptr_t>(out.data_ptr()) == own) break;
      reject_alias(op, "the output overlaps the input",
                   "in place, the output must be exactly chunk " + std::to_string(op.info.rank) + " of the input");
    }
    case OpType::AllToAll:
      if (overlap(op.inputs.front(), op.outputs.front()))
        reject_alias(op, "the output overlaps the input", "use a separate output");
      break;
    case OpType::SendRecvBatch:
      // A receive may not share memory with any other buffer of the batch (sends may share).
      for (size_t i = 0; i < op.batch.size(); ++i) {
        if (op.batch[i].kind != P2POp::Kind::Recv || !op.batch[i].tensor.defined()) continue;
        for (size_t j = 0; j < op.batch.size(); ++j)
          if (j != i && op.batch[j].tensor.defined() && overlap(op.batch[i].tensor, op.batch[j].tensor))
            reject_alias(op, "receive " + std::to_string(i) + " overlaps " +
                                 (op.batch[j].kind == P2POp::Kind::Recv ? "receive " : "send ") + std::to_string(j),
                         "each receive needs its own memory");
      }
      break;
    default:
      break;
  }
}

}  // namespace

void validate(const Op& op, const at::Device& device) {
  const int n = op.info.group_size;
  for (const auto& t : op.inputs) check_tensor(op, t, "input", device);
  for (const auto& t : op.outputs) check_tensor(op, t, "output", device);

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
      check_peer(op, op.info.peer, op.tag, op.info.type == OpType::Send);
      break;
    case OpType::SendRecvBatch:
      if (op.batch.empty()) reject(op, "expected at least one send or receive, found none");
      for (const auto& p : op.batch) check_peer(op, p.peer, p.tag, p.kind == P2POp::Kind::Send);
      break;
    case OpType::Split:
      if (op.split == nullptr || op.split->name.empty())
        reject(op, "expected a name for the new communicator, found an empty one");
      break;
  }
  check_aliasing(op, device);
}

}  // namespace loom::detail
