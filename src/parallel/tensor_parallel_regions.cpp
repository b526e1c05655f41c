// Region operations: the autograd functions through which all tensor-parallel communication
// passes. Each pairs a collective in forward with its adjoint in backward (all-reduce with
// identity, split with all-gather, reduce-scatter with all-gather), so a model built from them
// gets correct gradients from plain autograd.
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <chrono>

#include "loom/config.h"
#include "loom/parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_util.h"

namespace loom::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<uint64_t> g_all_reduce_calls{0}, g_all_reduce_bytes{0};
std::atomic<uint64_t> g_all_gather_calls{0}, g_all_gather_bytes{0};
std::atomic<uint64_t> g_reduce_scatter_calls{0}, g_reduce_scatter_bytes{0};
std::atomic<uint64_t> g_wait_nanoseconds{0};
std::atomic<uint64_t> g_stream_waits{0};  // waits that only ordered a CUDA stream: not timed

uint64_t bytes_of(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// The backward pass needs the group, and AutogradContext only stores IValues: a capsule keeps the
// communicator alive for as long as the graph that uses it (a raw pointer could dangle).
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(TensorParallelGroup g) : group(std::move(g)) {}
  TensorParallelGroup group;
};
at::IValue hold(const TensorParallelGroup& group) {
  return at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
}
TensorParallelGroup held(const AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data.at("group").toCapsule())->group;
}

// ---- collectives on plain tensors (no autograd) --------------------------------------------

at::Tensor all_reduce_sum(const at::Tensor& input, const TensorParallelGroup& group) {
  at::Tensor out = input.contiguous().clone();  // the collective is in place; the input may be saved by autograd
  auto work = group->all_reduce(out);
  detail::count_all_reduce(out);
  detail::wait_counted(*work);
  return out;
}

int64_t chunk_of(const at::Tensor& t, int64_t dim, const TensorParallelGroup& group, const char* what) {
  const int size = group->size();
  const int64_t extent = t.size(dim);
  if (extent % size != 0)
    throw InvalidArgumentError(detail::tp_where(group, what) + ": dimension " + std::to_string(dim) + " of size " +
                               std::to_string(extent) + " must be divisible by the tensor-parallel degree " +
                               std::to_string(size));
  return extent / size;
}

at::Tensor split_last(const at::Tensor& input, const TensorParallelGroup& group, const char* what) {
  const int64_t n = chunk_of(input, -1, group, what);
  return input.narrow(-1, group->rank() * n, n).contiguous();
}

at::Tensor split_first(const at::Tensor& input, const TensorParallelGroup& group, const char* what) {
  const int64_t n = chunk_of(input, 0, group, what);
  return input.narrow(0, group->rank() * n, n).contiguous();
}

at::Tensor gather_last(const at::Tensor& input, const TensorParallelGroup& group) {
  at::Tensor in = input.contiguous();
  std::vector<int64_t> shape{group->size()};
  shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
  at::Tensor buffer = at::empty(shape, in.options());
  detail::wait_counted(*group->all_gather(buffer, in));
  g_all_gather_calls += 1;
  g_all_gather_bytes += bytes_of(buffer);
  // [t, ..., n] -> [..., t, n] -> [..., t*n]: rank r's block lands at columns [r*n, (r+1)*n).
  std::vector<int64_t> out_shape(in.sizes().begin(), in.sizes().end());
  if (out_shape.empty()) out_shape.push_back(1);
  out_shape.back() *= group->size();
  if (in.dim() == 0) return buffer.reshape(out_shape);
  return buffer.movedim(0, -2).reshape(out_shape);
}

at::Tensor gather_first(const at::Tensor& input, const TensorParallelGroup& group) {
  at::Tensor in = input.contiguous();
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[0] *= group->size();
  at::Tensor out = at::empty(shape, in.options());  // rank r's input is rows [r*s, (r+1)*s)
  detail::wait_counted(*group->all_gather(out, in));
  g_all_gather_calls += 1;
  g_all_gather_bytes += bytes_of(out);
  return out;
}

at::Tensor reduce_scatter_first(const at::Tensor& input, const TensorParallelGroup& group, const char* what) {
  const int64_t n = chunk_of(input, 0, group, what);
  at::Tensor in = input.contiguous();
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[0] = n;
  at::Tensor out = at::empty(shape, in.options());
  detail::wait_counted(*group->reduce_scatter(out, in));
  g_reduce_scatter_calls += 1;
  g_reduce_scatter_bytes += bytes_of(in);
  return out;
}

// ---- autograd functions ----------------------------------------------------------------------

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TensorParallelGroup& group) {
    ctx->saved_data["group"] = hold(group);
    return input;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce_sum(grads[0], held(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& input, const TensorParallelGroup& group) {
    return all_reduce_sum(input, group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TensorParallelGroup& group) {
    ctx->saved_data["group"] = hold(group);
    return split_last(input, group, "scatter_to_region");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather_last(grads[0], held(ctx)), at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TensorParallelGroup& group) {
    ctx->saved_data["group"] = hold(group);
    return gather_last(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {split_last(grads[0], held(ctx), "gather_from_region backward"), at::Tensor()};
  }
};

struct ScatterToSequenceRegion : torch::autograd::Function<ScatterToSequenceRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TensorParallelGroup& group) {
    ctx->saved_data["group"] = hold(group);
    return split_first(input, group, "scatter_to_sequence_region");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather_first(grads[0], held(ctx)), at::Tensor()};
  }
};

struct GatherFromSequenceRegion : torch::autograd::Function<GatherFromSequenceRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TensorParallelGroup& group,
                            bool grad_is_partial) {
    ctx->saved_data["group"] = hold(group);
    ctx->saved_data["partial"] = grad_is_partial;
    return gather_first(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto group = held(ctx);
    // A column-parallel consumer gives each rank only its part of the gradient of the gathered
    // input: the sum over ranks is the true gradient, and each rank needs its rows of it.
    at::Tensor grad = ctx->saved_data.at("partial").toBool()
                          ? reduce_scatter_first(grads[0], group, "gather_from_sequence_region backward")
                          : split_first(grads[0], group, "gather_from_sequence_region backward");
    return {grad, at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterToSequenceRegion : torch::autograd::Function<ReduceScatterToSequenceRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const TensorParallelGroup& group) {
    ctx->saved_data["group"] = hold(group);
    return reduce_scatter_first(input, group, "reduce_scatter_to_sequence_region");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather_first(grads[0], held(ctx)), at::Tensor()};
  }
};

bool local(const TensorParallelGroup& group) { return detail::tp_size(group) == 1; }

}  // namespace

// A group of one communicates nothing, so no autograd node is needed: the identity is exact.
at::Tensor copy_to_region(const at::Tensor& input, const TensorParallelGroup& group) {
  return local(group) ? input : CopyToRegion::apply(input, group);
}
at::Tensor reduce_from_region(const at::Tensor& input, const TensorParallelGroup& group) {
  return local(group) ? input : ReduceFromRegion::apply(input, group);
}
at::Tensor scatter_to_region(const at::Tensor& input, const TensorParallelGroup& group) {
  return local(group) ? input : ScatterToRegion::apply(input, group);
}
at::Tensor gather_from_region(const at::Tensor& input, const TensorParallelGroup& group) {
  return local(group) ? input : GatherFromRegion::apply(input, group);
}
at::Tensor scatter_to_sequence_region(const at::Tensor& input, const TensorParallelGroup& group) {
  return local(group) ? input : ScatterToSequenceRegion::apply(input, group);
}
at::Tensor gather_from_sequence_region(const at::Tensor& input, const TensorParallelGroup& group,
                                       bool grad_is_partial) {
  return local(group) ? input : GatherFromSequenceRegion::apply(input, group, grad_is_partial);
}
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& input, const TensorParallelGroup& group) {
  return local(group) ? input : ReduceScatterToSequenceRegion::apply(input, group);
}

CommStats comm_stats() {
  CommStats s;
  s.all_reduce_calls = g_all_reduce_calls;
  s.all_reduce_bytes = g_all_reduce_bytes;
  s.all_gather_calls = g_all_gather_calls;
  s.all_gather_bytes = g_all_gather_bytes;
  s.reduce_scatter_calls = g_reduce_scatter_calls;
  s.reduce_scatter_bytes = g_reduce_scatter_bytes;
  s.wait_seconds = static_cast<double>(g_wait_nanoseconds.load()) * 1e-9;
  s.unmeasured_waits = g_stream_waits;
  return s;
}

void reset_comm_stats() {
  for (auto* c : {&g_all_reduce_calls, &g_all_reduce_bytes, &g_all_gather_calls, &g_all_gather_bytes,
                  &g_reduce_scatter_calls, &g_reduce_scatter_bytes, &g_wait_nanoseconds, &g_stream_waits})
    c->store(0);
}

}  // namespace loom::tp

namespace loom::detail {

bool host_checks_enabled(const at::Tensor& on) { return on.device().is_cpu() || config().check_collectives; }

void tp_all_reduce(at::Tensor& tensor, const TensorParallelGroup& group, ReduceOp op) {
  auto work = group->all_reduce(tensor, {op});
  count_all_reduce(tensor);
  wait_counted(*work);
}

void count_all_reduce(const at::Tensor& tensor) {
  tp::g_all_reduce_calls += 1;
  tp::g_all_reduce_bytes += tp::bytes_of(tensor);
}

void wait_counted(Work& work) {
  if (!work.wait_blocks_the_host()) {  // a device work: the host does not wait, the stream does
    work.wait();
    tp::g_stream_waits += 1;
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  tp::g_wait_nanoseconds += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

}  // namespace loom::detail
