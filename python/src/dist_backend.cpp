// See dist_backend.h.
#include "dist_backend.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

#include "loom/error.h"

namespace torchloom_py {
namespace {

std::string describe_ranks(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s + "]";
}

}  // namespace

DistBackend::DistBackend(std::shared_ptr<loom::Communicator> host, std::shared_ptr<loom::Communicator> device,
                         loom::Timeout timeout, c10::intrusive_ptr<Options> options)
    : c10d::Backend(host->rank(), host->size()),
      host_(std::move(host)),
      device_(std::move(device)),
      timeout_ms_(timeout.count()),
      options_(std::move(options)),
      completer_(std::make_shared<FutureCompleter>()) {
  if (device_ && (device_->rank() != host_->rank() || device_->size() != host_->size()))
    throw loom::InvalidArgumentError(host_->context("torch.distributed backend loom")(
        "the device communicator " + device_->name() + " (rank " + std::to_string(device_->rank()) + " of " +
        std::to_string(device_->size()) + ") does not have the host communicator's ranks"));
  init();
}

DistBackend::~DistBackend() = default;

void DistBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ms_ = timeout.count();
  options_->timeout = timeout;
}

loom::Communicator& DistBackend::comm_for(const at::Device& device, const char* op) {
  if (device.is_cpu()) return *host_;
  if (device.is_cuda() && device_) return *device_;
  throw loom::InvalidArgumentError(host_->context(std::string("torch.distributed backend loom: ") + op)(
      "a tensor on " + device.str() +
      (device.is_cuda() ? ", but torchloom has no device communicator here (LOOM_NCCL=off, or not every rank has "
                          "a GPU of its own)"
                        : ": only CPU and CUDA tensors are served")));
}

loom::Timeout DistBackend::timeout_of(std::chrono::milliseconds requested) const {
  // c10d's "unset" (-1 ms) and loom's kDefaultTimeout are the same value, but say so explicitly.
  if (requested == c10d::kUnsetTimeout) return loom::Timeout(timeout_ms_.load());
  return loom::Timeout(requested.count());
}

c10::intrusive_ptr<c10d::Work> DistBackend::make_work(c10d::OpType type, std::vector<loom::WorkPtr> works,
                                                      std::vector<at::Tensor> outputs) {
  return c10::make_intrusive<DistWork>(rank_, type, std::move(works), std::move(outputs), completer_);
}

namespace {

// The single tensor of a one-tensor call (c10d's lists are per device; one device per process here).
at::Tensor& single(std::vector<at::Tensor>& tensors, loom::Communicator& comm, const char* op) {
  if (tensors.size() != 1)
    throw loom::InvalidArgumentError(comm.context(std::string("torch.distributed backend loom: ") + op)(
        "expected one tensor, found " + std::to_string(tensors.size()) + " (one device per process)"));
  return tensors[0];
}

loom::ReduceOp to_loom(const c10d::ReduceOp& op, const at::Tensor& t, loom::Communicator& comm, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return loom::ReduceOp::Sum;
    case c10d::ReduceOp::AVG: return loom::ReduceOp::Avg;
    case c10d::ReduceOp::PRODUCT: return loom::ReduceOp::Product;
    case c10d::ReduceOp::MIN: return loom::ReduceOp::Min;
    case c10d::ReduceOp::MAX: return loom::ReduceOp::Max;
    // Logical and/or are bitwise and/or on bool, which loom's Min/Max are.
    case c10d::ReduceOp::BAND:
      if (t.scalar_type() == at::kBool) return loom::ReduceOp::Min;
      break;
    case c10d::ReduceOp::BOR:
      if (t.scalar_type() == at::kBool) return loom::ReduceOp::Max;
      break;
    default: break;
  }
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM", "UNUSED"};
  const int index = static_cast<int>(op.op_);
  throw loom::InvalidArgumentError(comm.context(std::string("torch.distributed backend loom: ") + name)(
      std::string("reduce op ") + (index < 10 ? names[index] : "?") + " on " + c10::toString(t.scalar_type()) +
      " is not supported (SUM, AVG, PRODUCT, MIN, MAX; BAND and BOR on bool)"));
}

}  // namespace

// ---- Collectives ------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> DistBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  auto& t = single(tensors, *host_, "broadcast");
  auto& comm = comm_for(t.device(), "broadcast");
  auto w = comm.broadcast(t, {static_cast<int>(opts.rootRank), timeout_of(opts.timeout)});
  return make_work(c10d::OpType::BROADCAST, {std::move(w)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DistBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  auto& t = single(tensors, *host_, "allreduce");
  auto& comm = comm_for(t.device(), "allreduce");
  auto w = comm.all_reduce(t, {to_loom(opts.reduceOp, t, comm, "allreduce"), timeout_of(opts.timeout)});
  return make_work(c10d::OpType::ALLREDUCE, {std::move(w)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DistBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  std::vector<loom::WorkPtr> works;
  for (auto& t : tensors) {
    auto& comm = comm_for(t.device(), "allreduce_coalesced");
    works.push_back(comm.all_reduce(t, {to_loom(opts.reduceOp, t, comm, "allreduce_coalesced"),
                                        timeout_of(opts.timeout)}));
  }
  return make_work(c10d::OpType::ALLREDUCE_COALESCED, std::move(works), tensors);
}

c10::intrusive_ptr<c10d::Work> DistBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  auto& t = single(tensors, *host_, "reduce");
  auto& comm = comm_for(t.device(), "reduce");
  if (opts.rootRank < 0 || opts.rootRank >= size_)
    throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: reduce")(
        "root " + std::to_string(opts.rootRank) + " is out of range (group of " + std::to_string(size_) + ")"));
  // An all-reduce; ranks other than the root reduce a copy, so their tensor is left as it was.
  at::Tensor target = rank_ == opts.rootRank ? t : t.clone();
  auto w = comm.all_reduce(target, {to_loom(opts.reduceOp, t, comm, "reduce"), timeout_of(opts.timeout)});
  return make_work(c10d::OpType::REDUCE, {std::move(w)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DistBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  auto& in = single(inputs, *host_, "allgather");
  if (outputs.size() != 1)
    throw loom::InvalidArgumentError(host_->context("torch.distributed backend loom: allgather")(
        "expected one output list, found " + std::to_string(outputs.size())));
  auto& comm = comm_for(in.device(), "allgather");
  auto w = comm.all_gather(outputs[0], in, {timeout_of(opts.timeout)});
  return make_work(c10d::OpType::ALLGATHER, {std::move(w)}, outputs[0]);
}

c10::intrusive_ptr<c10d::Work> DistBackend::all_gather_single(at::Tensor& output, at::Tensor& input,
                                                              const c10d::AllgatherOptions& opts) {
  auto& comm = comm_for(input.device(), "all_gather_into_tensor");
  auto w = comm.all_gather(output, input, {timeout_of(opts.timeout)});
  return make_work(c10d::OpType::_ALLGATHER_BASE, {std::move(w)}, {output});
}

c10::intrusive_ptr<c10d::Work> DistBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  return all_gather_single(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> DistBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  if (outputs.size() != inputs.size())
    throw loom::InvalidArgumentError(host_->context("torch.distributed backend loom: allgather_coalesced")(
        std::to_string(inputs.size()) + " inputs but " + std::to_string(outputs.size()) + " output lists"));
  std::vector<loom::WorkPtr> works;
  std::vector<at::Tensor> all;
  for (size_t i = 0; i < inputs.size(); ++i) {
    works.push_back(comm_for(inputs[i].device(), "allgather_coalesced")
                        .all_gather(outputs[i], inputs[i], {timeout_of(opts.timeout)}));
    all.insert(all.end(), outputs[i].begin(), outputs[i].end());
  }
  return make_work(c10d::OpType::ALLGATHER_COALESCED, std::move(works), std::move(all));
}

c10::intrusive_ptr<c10d::Work> DistBackend::all_gather_single_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  if (outputs.size() != inputs.size())
    throw loom::InvalidArgumentError(host_->context("torch.distributed backend loom: allgather_into_tensor_coalesced")(
        std::to_string(inputs.size()) + " inputs but " + std::to_string(outputs.size()) + " outputs"));
  std::vector<loom::WorkPtr> works;
  for (size_t i = 0; i < inputs.size(); ++i) {
    works.push_back(comm_for(inputs[i].device(), "allgather_into_tensor_coalesced")
                        .all_gather(outputs[i], inputs[i], {timeout_of(opts.timeout)}));
  }
  return make_work(c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED, std::move(works), outputs);
}

c10::intrusive_ptr<c10d::Work> DistBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  return all_gather_single_coalesced(outputs, inputs, opts);
}

// A gather is an all-gather whose result only the root keeps: loom's size and order checks apply
// to it like to any collective (the other ranks gather into scratch tensors).
c10::intrusive_ptr<c10d::Work> DistBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  auto& in = single(inputs, *host_, "gather");
  auto& comm = comm_for(in.device(), "gather");
  const bool root = rank_ == opts.rootRank;
  if (opts.rootRank < 0 || opts.rootRank >= size_)
    throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: gather")(
        "root " + std::to_string(opts.rootRank) + " is out of range (group of " + std::to_string(size_) + ")"));
  if (root ? outputs.size() != 1 : !outputs.empty() && !(outputs.size() == 1 && outputs[0].empty()))
    throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: gather")(
        root ? "the root expects one output list, found " + std::to_string(outputs.size())
             : std::string("only the root passes output tensors")));
  std::vector<at::Tensor> scratch;
  if (!root) {
    for (int r = 0; r < size_; ++r) scratch.push_back(at::empty_like(in, at::MemoryFormat::Contiguous));
  }
  std::vector<at::Tensor>& target = root ? outputs[0] : scratch;
  auto w = comm.all_gather(target, in, {timeout_of(opts.timeout)});
  return make_work(c10d::OpType::GATHER, {std::move(w)}, root ? outputs[0] : std::vector<at::Tensor>{});
}

c10::intrusive_ptr<c10d::Work> DistBackend::gather_single(at::Tensor& output, at::Tensor& input,
                                                          const c10d::GatherOptions& opts) {
  auto& comm = comm_for(input.device(), "gather_into_tensor");
  at::Tensor target = rank_ == opts.rootRank ? output : at::empty({input.numel() * size_}, input.options());
  auto w = comm.all_gather(target, input, {timeout_of(opts.timeout)});
  return make_work(c10d::OpType::GATHER, {std::move(w)}, {output});
}

c10::intrusive_ptr<c10d::Work> DistBackend::gather_into_tensor(at::Tensor& output, at::Tensor& input,
                                                               const c10d::GatherOptions& opts) {
  return gather_single(output, input, opts);
}

// A scatter is point-to-point: the root sends each rank its tensor and copies its own.
c10::intrusive_ptr<c10d::Work> DistBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  auto& out = single(outputs, *host_, "scatter");
  auto& comm = comm_for(out.device(), "scatter");
  const int root = static_cast<int>(opts.rootRank);
  if (root < 0 || root >= size_)
    throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: scatter")(
        "root " + std::to_string(root) + " is out of range (group of " + std::to_string(size_) + ")"));
  const loom::SendRecvOptions o{0, timeout_of(opts.timeout)};
  if (rank_ != root) {
    if (!inputs.empty() && !(inputs.size() == 1 && inputs[0].empty()))
      throw loom::InvalidArgumentError(
          comm.context("torch.distributed backend loom: scatter")("only the root passes input tensors"));
    return make_work(c10d::OpType::SCATTER, {comm.recv(out, root, o)}, outputs);
  }
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size_)
    throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: scatter")(
        "the root expects one list of " + std::to_string(size_) + " tensors, found " +
        (inputs.size() == 1 ? std::to_string(inputs[0].size()) + " tensors" : std::to_string(inputs.size()) + " lists")));
  std::vector<loom::P2POp> ops;
  for (int r = 0; r < size_; ++r) {
    const at::Tensor& chunk = inputs[0][r];
    if (chunk.sizes() != out.sizes() || chunk.scalar_type() != out.scalar_type())
      throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: scatter")(
          "input " + std::to_string(r) + " is " + c10::toString(chunk.scalar_type()) + " " +
          c10::str(chunk.sizes()) + ", the output " + c10::toString(out.scalar_type()) + " " + c10::str(out.sizes())));
    if (r == root) continue;
    ops.push_back(loom::P2POp{loom::P2POp::Kind::Send, chunk.contiguous(), r, 0});
  }
  out.copy_(inputs[0][root]);
  std::vector<loom::WorkPtr> works;
  if (!ops.empty()) works.push_back(comm.batch_isend_irecv(std::move(ops), o));
  return make_work(c10d::OpType::SCATTER, std::move(works), outputs);
}

c10::intrusive_ptr<c10d::Work> DistBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  auto& out = single(outputs, *host_, "reduce_scatter");
  auto& comm = comm_for(out.device(), "reduce_scatter");
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != size_)
    throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: reduce_scatter")(
        "expected one list of " + std::to_string(size_) + " input tensors"));
  std::vector<at::Tensor> flat;
  for (auto& t : inputs[0]) {
    if (t.sizes() != out.sizes())
      throw loom::InvalidArgumentError(comm.context("torch.distributed backend loom: reduce_scatter")(
          "an input is " + c10::str(t.sizes()) + ", the output " + c10::str(out.sizes())));
    flat.push_back(t.reshape({-1}));
  }
  at::Tensor input = at::cat(flat);
  auto w = comm.reduce_scatter(out, input, {to_loom(opts.reduceOp, out, comm, "reduce_scatter"), timeout_of(opts.timeout)});
  return make_work(c10d::OpType::REDUCE_SCATTER, {std::move(w)}, outputs);
}

c10::intrusive_ptr<c10d::Work> DistBackend::reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  auto& comm = comm_for(input.device(), "reduce_scatter_tensor");
  auto w = comm.reduce_scatter(output, input, {to_loom(opts.reduceOp, input, comm, "reduce_scatter_tensor"),
                                               timeout_of(opts.timeout)});
  return make_work(c10d::OpType::_REDUCE_SCATTER_BASE, {std::move(w)}, {output});
}

c10::intrusive_ptr<c10d::Work> DistBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_single(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> DistBackend::reduce_scatter_single_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() != inputs.size())
    throw loom::InvalidArgumentError(host_->context("torch.distributed backend loom: reduce_scatter_tensor_coalesced")(
        std::to_string(inputs.size()) + " inputs but " + std::to_string(outputs.size()) + " outputs"));
  std::vector<loom::WorkPtr> works;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto& comm = comm_for(inputs[i].device(), "reduce_scatter_tensor_coalesced");
    works.push_back(comm.reduce_scatter(
        outputs[i], inputs[i],
        {to_loom(opts.reduceOp, inputs[i], comm, "reduce_scatter_tensor_coalesced"), timeout_of(opts.timeout)}));
  }
  return make_work(c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, std::move(works), outputs);
}

c10::intrusive_ptr<c10d::Work> DistBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_single_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> DistBackend::all_to_all_single(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_splits,
                                                              std::vector<int64_t>& input_splits,
                                                              const c10d::AllToAllOptions& opts) {
  auto& comm = comm_for(input.device(), "all_to_all_single");
  if (output_splits.empty() && input_splits.empty()) {
    auto w = comm.all_to_all(output, input, {timeout_of(opts.timeout)});
    return make_work(c10d::OpType::ALLTOALL_BASE, {std::move(w)}, {output});
  }
  return all_to_all_uneven(output, input, output_splits, input_splits, timeout_of(opts.timeout));
}

c10::intrusive_ptr<c10d::Work> DistBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_splits,
                                                          std::vector<int64_t>& input_splits,
                                                          const c10d::AllToAllOptions& opts) {
  return all_to_all_single(output, input, output_splits, input_splits, opts);
}

// Uneven splits along dim 0: one batch of sends and receives of contiguous row ranges (loom's
// all_to_all takes equal chunks only); this rank's own rows are copied here.
c10::intrusive_ptr<c10d::Work> DistBackend::all_to_all_uneven(at::Tensor& output, at::Tensor& input,
                                                              const std::vector<int64_t>& output_splits,
                                                              const std::vector<int64_t>& input_splits,
                                                              loom::Timeout timeout) {
  auto& comm = comm_for(input.device(), "all_to_all_single");
  auto ctx = comm.context("torch.distributed backend loom: all_to_all_single");
  if (!input.is_contiguous() || !output.is_contiguous() || input.dim() == 0 || output.dim() == 0)
    throw loom::InvalidArgumentError(ctx("input and output must be contiguous tensors of at least one dimension"));
  auto splits_of = [&](const std::vector<int64_t>& given, const at::Tensor& t, const char* which) {
    std::vector<int64_t> s = given;
    if (s.empty()) {
      if (t.size(0) % size_ != 0)
        throw loom::InvalidArgumentError(ctx(std::string(which) + " has " + std::to_string(t.size(0)) +
                                             " rows, not divisible by the group's " + std::to_string(size_) + " ranks"));
      s.assign(size_, t.size(0) / size_);
    }
    if (static_cast<int>(s.size()) != size_ || std::any_of(s.begin(), s.end(), [](int64_t v) { return v < 0; }) ||
        std::accumulate(s.begin(), s.end(), int64_t{0}) != t.size(0))
      throw loom::InvalidArgumentError(ctx(std::string(which) + " splits " + c10::str(s) + " do not divide its " +
                                           std::to_string(t.size(0)) + " rows among " + std::to_string(size_) +
                                           " ranks"));
    return s;
  };
  const auto in_splits = splits_of(input_splits, input, "input");
  const auto out_splits = splits_of(output_splits, output, "output");
  if (input.numel() / std::max<int64_t>(input.size(0), 1) != output.numel() / std::max<int64_t>(output.size(0), 1) ||
      input.scalar_type() != output.scalar_type())
    throw loom::InvalidArgumentError(ctx("input and output rows differ in size or dtype"));
  std::vector<loom::P2POp> ops;
  int64_t in_offset = 0, out_offset = 0;
  for (int r = 0; r < size_; ++r) {
    at::Tensor in_rows = input.narrow(0, in_offset, in_splits[r]);
    at::Tensor out_rows = output.narrow(0, out_offset, out_splits[r]);
    in_offset += in_splits[r];
    out_offset += out_splits[r];
    if (r == rank_) {
      if (in_rows.numel() != out_rows.numel())
        throw loom::InvalidArgumentError(ctx("this rank sends itself " + std::to_string(in_splits[r]) +
                                             " rows but expects " + std::to_string(out_splits[r])));
      out_rows.copy_(in_rows);
      continue;
    }
    if (in_rows.numel() > 0) ops.push_back(loom::P2POp{loom::P2POp::Kind::Send, in_rows, r, 0});
    if (out_rows.numel() > 0) ops.push_back(loom::P2POp{loom::P2POp::Kind::Recv, out_rows, r, 0});
  }
  std::vector<loom::WorkPtr> works;
  if (!ops.empty()) works.push_back(comm.batch_isend_irecv(std::move(ops), {0, timeout}));
  return make_work(c10d::OpType::ALLTOALL_BASE, std::move(works), {output});
}

c10::intrusive_ptr<c10d::Work> DistBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  auto ctx = host_->context("torch.distributed backend loom: all_to_all");
  if (static_cast<int>(inputs.size()) != size_ || static_cast<int>(outputs.size()) != size_)
    throw loom::InvalidArgumentError(ctx("expected " + std::to_string(size_) + " input and output tensors, found " +
                                         std::to_string(inputs.size()) + " and " + std::to_string(outputs.size())));
  std::vector<loom::P2POp> ops;
  loom::Communicator* comm = nullptr;
  for (int r = 0; r < size_; ++r) {
    comm = &comm_for(inputs[r].device(), "all_to_all");
    if (r == rank_) {
      outputs[r].copy_(inputs[r]);
      continue;
    }
    ops.push_back(loom::P2POp{loom::P2POp::Kind::Send, inputs[r].contiguous(), r, 0});
    ops.push_back(loom::P2POp{loom::P2POp::Kind::Recv, outputs[r], r, 0});
  }
  std::vector<loom::WorkPtr> works;
  if (!ops.empty()) works.push_back(comm->batch_isend_irecv(std::move(ops), {0, timeout_of(opts.timeout)}));
  return make_work(c10d::OpType::ALLTOALL, std::move(works), outputs);
}

// ---- Point-to-point, barrier, split -----------------------------------------------------------

c10::intrusive_ptr<c10d::Work> DistBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  auto& t = single(tensors, *host_, "send");
  auto w = comm_for(t.device(), "send").send(t, dst, {tag, timeout_of(c10d::kUnsetTimeout)});
  return make_work(c10d::OpType::SEND, {std::move(w)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DistBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  auto& t = single(tensors, *host_, "recv");
  auto w = comm_for(t.device(), "recv").recv(t, src, {tag, timeout_of(c10d::kUnsetTimeout)});
  return make_work(c10d::OpType::RECV, {std::move(w)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DistBackend::barrier(const c10d::BarrierOptions& opts) {
  // On the host communicator whatever device the caller names: a barrier orders processes, and
  // loom's barrier blocks the waiting host thread on every backend.
  auto w = host_->barrier({timeout_of(opts.timeout)});
  return make_work(c10d::OpType::BARRIER, {std::move(w)}, {});
}

c10::intrusive_ptr<DistBackend> DistBackend::split_ranks(const std::vector<int>& ranks, loom::Timeout timeout,
                                                         c10::intrusive_ptr<Options> options) {
  auto ctx = host_->context("torch.distributed backend loom: split");
  for (int r : ranks) {
    if (r < 0 || r >= size_)
      throw loom::InvalidArgumentError(ctx("rank " + std::to_string(r) + " in " + describe_ranks(ranks) +
                                           " is out of range (group of " + std::to_string(size_) + ")"));
  }
  auto mine = std::find(ranks.begin(), ranks.end(), rank_);
  // Disjoint groups of one split each get the smallest of their ranks as color; a rank not
  // listed joins none. The key keeps the caller's order of ranks.
  const int color = mine == ranks.end() ? -1 : *std::min_element(ranks.begin(), ranks.end());
  const int key = mine == ranks.end() ? 0 : static_cast<int>(mine - ranks.begin());
  const std::string name = options->group_name.empty() ? host_->name() + "/split" : "pg" + options->group_name;
  auto host = host_->split(color, key, name, {timeout});
  std::shared_ptr<loom::Communicator> device;
  if (device_) device = device_->split(color, key, name + "-cuda", {timeout});
  if (!host) return {};
  if (host->size() != static_cast<int>(ranks.size()) || host->rank() != key)
    throw loom::MismatchError(ctx("the ranks do not agree on the new group " + describe_ranks(ranks) +
                                  ": this rank is " + std::to_string(host->rank()) + " of " +
                                  std::to_string(host->size()) + " in it, expected " + std::to_string(key) + " of " +
                                  std::to_string(ranks.size())));
  options->timeout = timeout == loom::kDefaultTimeout ? options->timeout : timeout;
  return c10::make_intrusive<DistBackend>(std::move(host), std::move(device), timeout, std::move(options));
}

c10::intrusive_ptr<c10d::Backend> DistBackend::split(const c10::intrusive_ptr<c10d::Store>& /*store*/,
                                                     const std::vector<int>& ranks,
                                                     const c10::intrusive_ptr<Options>& opts) {
  auto options = c10::make_intrusive<Options>("loom", opts ? opts->timeout : options_->timeout);
  if (opts) {
    options->group_name = opts->group_name;
    options->group_desc = opts->group_desc;
  }
  // The parent's timeout unless the caller gave another (torch passes its 30-minute default when
  // split_group was given none).
  const bool given = opts && opts->timeout != options_->timeout && opts->timeout != kBackendDefaultTimeout;
  const loom::Timeout timeout = given ? loom::Timeout(opts->timeout.count()) : loom::Timeout(timeout_ms_.load());
  return split_ranks(ranks, timeout, std::move(options));
}

}  // namespace torchloom_py
