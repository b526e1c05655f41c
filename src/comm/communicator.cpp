// The one checked entry every public call goes through (like NCCL's ncclEnqueueCheck): the
// public methods only describe the operation; enqueue_checked validates it, numbers it,
// optionally checks it against the other ranks, logs it and hands it to the backend.
#include "loom/comm/communicator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <sstream>

#include "comm/op.h"
#include "core/env.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    case ReduceOp::Product: return "product";
  }
  return "?";
}

const char* to_string(OpType op) {
  switch (op) {
    case OpType::AllReduce: return "all_reduce";
    case OpType::Broadcast: return "broadcast";
    case OpType::AllGather: return "all_gather";
    case OpType::ReduceScatter: return "reduce_scatter";
    case OpType::AllToAll: return "all_to_all";
    case OpType::Send: return "send";
    case OpType::Recv: return "recv";
    case OpType::Barrier: return "barrier";
  }
  return "?";
}

std::string OpInfo::describe() const {
  std::ostringstream s;
  s << "[rank " << world_rank << "] " << to_string(type) << " seq=" << seq << " group=" << group << " (rank " << rank
    << " of " << group_size << ")";
  if (type != OpType::Barrier) {
    s << " shape=[";
    for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
    s << "] dtype=" << c10::toString(dtype);
  }
  if (type == OpType::AllReduce || type == OpType::ReduceScatter) s << " op=" << to_string(reduce);
  if (type == OpType::Broadcast) s << " root=" << peer;
  if (type == OpType::Send) s << " dst=" << peer;
  if (type == OpType::Recv) s << " src=" << peer;
  return s.str();
}

namespace {

Timeout resolve_timeout(Timeout requested) {
  if (requested != kDefaultTimeout) return requested;
  return env::seconds_as_duration("LOOM_TIMEOUT", 0.001, 86400);
}

OnError resolve_on_error(int requested) {
  if (requested >= 0) return static_cast<OnError>(requested);
  return env::choice("LOOM_ON_ERROR", {"abort", "raise"}) == "abort" ? OnError::Abort : OnError::Raise;
}

}  // namespace

Communicator::Communicator(int rank, int size, int world_rank, std::string name, const CommunicatorOptions& options)
    : rank_(rank),
      size_(size),
      world_rank_(world_rank),
      name_(std::move(name)),
      options_(options),
      timeout_(resolve_timeout(options.timeout)),
      on_error_(resolve_on_error(options.on_error)),
      check_collectives_(options.check_collectives >= 0 ? options.check_collectives == 1
                                                        : env::flag("LOOM_CHECK_COLLECTIVES")) {
  if (timeout_.count() <= 0)
    throw InvalidArgumentError("[rank " + std::to_string(world_rank) + "] communicator " + name_ +
                               ": timeout must be positive, found " + std::to_string(timeout_.count()) + " ms");
  options_.timeout = timeout_;
  options_.on_error = static_cast<int>(on_error_);
  options_.check_collectives = check_collectives_ ? 1 : 0;
}

namespace {

detail::Op make_op(OpType type, Timeout timeout, const at::Tensor* described) {
  detail::Op op;
  op.info.type = type;
  op.info.timeout = timeout;
  if (described != nullptr && described->defined()) {
    op.info.shape = described->sizes().vec();
    op.info.dtype = described->scalar_type();
  }
  return op;
}

}  // namespace

WorkPtr Communicator::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  auto op = make_op(OpType::AllReduce, options.timeout, &tensor);
  op.info.reduce = options.op;
  op.inputs = {tensor};
  op.outputs = {tensor};
  return enqueue_checked(op);
}

WorkPtr Communicator::broadcast(at::Tensor& tensor, const BroadcastOptions& options) {
  auto op = make_op(OpType::Broadcast, options.timeout, &tensor);
  op.info.peer = options.root;
  op.inputs = {tensor};
  op.outputs = {tensor};
  return enqueue_checked(op);
}

WorkPtr Communicator::all_gather(at::Tensor& output, const at::Tensor& input, const AllGatherOptions& options) {
  auto op = make_op(OpType::AllGather, options.timeout, &input);
  op.inputs = {input};
  op.outputs = {output};
  return enqueue_checked(op);
}

WorkPtr Communicator::all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                 const AllGatherOptions& options) {
  auto op = make_op(OpType::AllGather, options.timeout, &input);
  op.inputs = {input};
  op.outputs = outputs;
  op.list_output = true;
  return enqueue_checked(op);
}

WorkPtr Communicator::reduce_scatter(at::Tensor& output, const at::Tensor& input, const ReduceScatterOptions& options) {
  auto op = make_op(OpType::ReduceScatter, options.timeout, &input);
  op.info.reduce = options.op;
  op.inputs = {input};
  op.outputs = {output};
  return enqueue_checked(op);
}

WorkPtr Communicator::all_to_all(at::Tensor& output, const at::Tensor& input, const AllToAllOptions& options) {
  auto op = make_op(OpType::AllToAll, options.timeout, &input);
  op.inputs = {input};
  op.outputs = {output};
  return enqueue_checked(op);
}

WorkPtr Communicator::send(const at::Tensor& tensor, int dst, const SendRecvOptions& options) {
  auto op = make_op(OpType::Send, options.timeout, &tensor);
  op.info.peer = dst;
  op.tag = options.tag;
  op.inputs = {tensor};
  return enqueue_checked(op);
}

WorkPtr Communicator::recv(at::Tensor& tensor, int src, const SendRecvOptions& options) {
  auto op = make_op(OpType::Recv, options.timeout, &tensor);
  op.info.peer = src;
  op.tag = options.tag;
  op.outputs = {tensor};
  return enqueue_checked(op);
}

WorkPtr Communicator::barrier(const BarrierOptions& options) {
  auto op = make_op(OpType::Barrier, options.timeout, nullptr);
  return enqueue_checked(op);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  if (is_broken()) {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    throw CommError("[rank " + std::to_string(world_rank_) + "] split of " + name_ +
                    ": communicator is broken: " + broken_reason_);
  }
  return launch_split(color, key, name, options_);
}

void Communicator::mark_broken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  if (!broken_.load()) {
    broken_reason_ = reason;
    broken_.store(true);
  }
}

std::string Communicator::broken_reason() {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  return broken_reason_;
}

WorkPtr Communicator::enqueue_checked(detail::Op& op) {
  op.info.group = name_;
  op.info.rank = rank_;
  op.info.group_size = size_;
  op.info.world_rank = world_rank_;
  if (op.info.timeout == kDefaultTimeout) op.info.timeout = timeout_;
  if (op.info.timeout.count() <= 0)
    throw InvalidArgumentError("[rank " + std::to_string(world_rank_) + "] " + to_string(op.info.type) +
                               " group=" + name_ + ": timeout must be positive, found " +
                               std::to_string(op.info.timeout.count()) + " ms");
  // Validation comes before numbering: a rejected call must not shift this rank's sequence.
  detail::validate(op, device_type());
  check_device(op);
  if (is_broken()) {
    std::lock_guard<std::mutex> lock(broken_mutex_);
    throw CommError("[rank " + std::to_string(world_rank_) + "] " + to_string(op.info.type) + " group=" + name_ +
                    ": communicator is broken by an earlier error: " + broken_reason_);
  }
  const bool p2p = op.info.type == OpType::Send || op.info.type == OpType::Recv;
  op.info.seq = p2p ? p2p_seq_.fetch_add(1) : collective_seq_.fetch_add(1);
  if (check_collectives_ && !p2p && size_ > 1) check_fingerprint(op);
  LOOM_LOG(trace, "enqueue " << op.info.describe());
  return launch(op);
}

// Every rank contributes (operation, sequence number, dtype, element count, reduce op, root); a
// difference means the ranks would otherwise exchange mismatched buffers or hang.
void Communicator::check_fingerprint(const detail::Op& op) {
  int64_t numel = 1;
  for (auto d : op.info.shape) numel *= d;
  if (op.info.type == OpType::Barrier) numel = 0;
  const int64_t mine[6] = {static_cast<int64_t>(op.info.type), static_cast<int64_t>(op.info.seq),
                           static_cast<int64_t>(op.info.dtype), numel, static_cast<int64_t>(op.info.reduce),
                           op.info.type == OpType::Broadcast ? op.info.peer : -1};
  // On the operation's own device (a device communicator accepts tensors of its device only).
  at::Device device(device_type());
  if (!op.inputs.empty()) device = op.inputs.front().device();
  else if (!op.outputs.empty()) device = op.outputs.front().device();
  auto options = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor local = at::tensor(at::IntArrayRef(mine, 6), at::TensorOptions().dtype(at::kLong)).to(options.device());
  at::Tensor all = at::empty({size_ * 6}, options);
  detail::Op exchange;
  exchange.info = op.info;
  exchange.info.type = OpType::AllGather;
  exchange.info.shape = {6};
  exchange.info.dtype = at::kLong;
  exchange.inputs = {local};
  exchange.outputs = {all};
  exchange.internal = true;
  launch(exchange)->wait();
  all = all.cpu();
  const int64_t* theirs = all.data_ptr<int64_t>();
  auto describe = [](const int64_t* f) {
    std::ostringstream s;
    s << to_string(static_cast<OpType>(f[0])) << "(seq=" << f[1]
      << ", dtype=" << c10::toString(static_cast<c10::ScalarType>(f[2])) << ", numel=" << f[3];
    if (f[0] == static_cast<int64_t>(OpType::AllReduce) || f[0] == static_cast<int64_t>(OpType::ReduceScatter))
      s << ", op=" << to_string(static_cast<ReduceOp>(f[4]));
    if (f[5] >= 0) s << ", root=" << f[5];
    s << ")";
    return s.str();
  };
  for (int r = 0; r < size_; ++r) {
    if (std::equal(mine, mine + 6, theirs + 6 * r)) continue;
    throw MismatchError(op.info.describe() + ": collective mismatch: this rank called " + describe(mine) +
                        " but rank " + std::to_string(r) + " called " + describe(theirs + 6 * r));
  }
}

}  // namespace loom
