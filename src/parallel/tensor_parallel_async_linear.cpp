// The column-parallel linear with its input-gradient all-reduce overlapped with the weight-gradient
// GEMM (Megatron's LinearWithGradAccumulationAndAsyncCommunication).
//
// Composed as copy_to_region + linear, backward would compute dX = dY W, then wait for its
// all-reduce inside the region op, and only then let autograd compute dW = dY^T X: the all-reduce
// is exposed. One autograd function for the pair can start the all-reduce of dX as soon as dX
// exists, compute dW and db while it runs, and wait last. The communicator progresses on its own
// thread (MPI) or stream (NCCL), so the overlap is real on both.
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loom/parallel/tensor_parallel.h"
#include "loom/trace.h"
#include "parallel/tensor_parallel_util.h"

namespace loom::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(TensorParallelGroup g) : group(std::move(g)) {}
  TensorParallelGroup group;
};

struct LinearAsyncGradAllReduce : torch::autograd::Function<LinearAsyncGradAllReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, const TensorParallelGroup& group) {
    ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    // An empty tensor stands for "no bias": autograd functions take no undefined inputs.
    const bool has_bias = bias.numel() > 0;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->save_for_backward({input, weight});
    return at::linear(input, weight, has_bias ? bias : at::Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const TensorParallelGroup group =
        c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data.at("group").toCapsule())->group;
    const at::Tensor grad_output = grads[0].contiguous();

    // dX first, and on its way: each rank holds a partial sum over its output features.
    // (Every rank of the group agrees on whether the input needs a gradient: same model, same graph.)
    at::Tensor grad_input;
    std::shared_ptr<Work> reduction;
    // Under autocast the forward ran in a lower precision than the weight's (its linear cast both
    // operands): compute the gradients in the gradient's precision, return them in the inputs'.
    const c10::ScalarType compute = grad_output.scalar_type();
    if (ctx->needs_input_grad(0))
      grad_input = at::matmul(grad_output, weight.to(compute)).to(input.scalar_type());
    if (grad_input.defined() && group && group->size() > 1) {
      reduction = group->all_reduce(grad_input);
      reduction->run_in_background();  // it travels while the weight gradient is computed
      detail::count_all_reduce(grad_input);
    }
    // dW and db while dX travels.
    const auto wgrad_start = trace::now();
    const int64_t out = grad_output.size(-1), in = input.size(-1);
    const at::Tensor g2 = grad_output.reshape({-1, out});
    at::Tensor grad_weight = g2.t().matmul(input.reshape({-1, in}).to(compute)).to(weight.scalar_type());
    at::Tensor grad_bias =
        ctx->saved_data.at("has_bias").toBool() ? g2.sum(0).to(weight.scalar_type()) : at::Tensor();
    const auto wgrad_end = trace::now();
    if (reduction) {
      detail::wait_counted(*reduction);
      if (trace::enabled()) {
        trace::span("tp wgrad (overlapped)", "tensor_parallel", wgrad_start, wgrad_end, "backward");
        if (auto started = reduction->started_at_time(), finished = reduction->finished_at_time();
            started && finished)
          trace::span("tp dgrad all_reduce", "tensor_parallel", *started, *finished, "comm");
      }
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_with_async_grad_all_reduce(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                             const TensorParallelGroup& group) {
  return LinearAsyncGradAllReduce::apply(input, weight, bias.defined() ? bias : at::empty({0}, weight.options()),
                                         group);
}

}  // namespace loom::tp
