// loom::pp::linear: a linear layer whose weight gradient a zero-bubble schedule can defer
// (Megatron-Core's WeightGradStore idea). Backward computes dX = dY W at once (the previous stage
// waits for it); dW = dY^T X and db = sum(dY) either follow at once, as autograd would, or, inside
// the executor's input-gradient pass, become work the plan's W action runs later, accumulating into
// .grad() as autograd would have.
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

#include "loom/error.h"
#include "loom/parallel/pipeline.h"
#include "parallel/deferred_weight_gradients.h"

namespace loom::pp {
namespace detail {
namespace {
std::atomic<std::vector<DeferredGradient>*> open_list{nullptr};
}  // namespace

DeferWeightGradients::DeferWeightGradients(std::vector<DeferredGradient>& into) {
  std::vector<DeferredGradient>* none = nullptr;
  if (!open_list.compare_exchange_strong(none, &into))
    throw InvalidArgumentError(ErrorContext("PipelineExecutor")(
        "a zero-bubble step's input-gradient pass while another one defers weight gradients: expected one "
        "pipeline step at a time per process, found two"));
}
DeferWeightGradients::~DeferWeightGradients() { open_list.store(nullptr); }
std::vector<DeferredGradient>* deferred_weight_gradients() { return open_list.load(); }
}  // namespace detail

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Adds `gradient` to `param`'s .grad() as AccumulateGrad would (outside autograd: no hooks run).
void accumulate(const at::Tensor& param, const at::Tensor& gradient) {
  at::Tensor& grad = const_cast<at::Tensor&>(param).mutable_grad();
  if (grad.defined())
    grad.add_(gradient);
  else
    grad = gradient;
}

struct DeferrableLinear : torch::autograd::Function<DeferrableLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias) {
    // An empty tensor stands for "no bias": autograd functions take no undefined inputs.
    const bool has_bias = bias.numel() > 0;
    ctx->save_for_backward({input});
    // The parameters themselves (leaves: no cycle through autograd), for a deferred accumulation.
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["bias"] = has_bias ? bias : at::Tensor();
    return at::linear(input, weight, has_bias ? bias : at::Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    const at::Tensor weight = ctx->saved_data.at("weight").toTensor();
    const at::Tensor bias = ctx->saved_data.at("bias").toTensor();
    const at::Tensor grad_output = grads[0];
    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) grad_input = at::matmul(grad_output, weight.to(grad_output.scalar_type()));
    const bool want_weight = ctx->needs_input_grad(1), want_bias = bias.defined() && ctx->needs_input_grad(2);
    auto weight_gradients = [grad_output, input, weight, bias, want_weight, want_bias] {
      const int64_t out = grad_output.size(-1), in = input.size(-1);
      const at::Tensor g2 = grad_output.reshape({-1, out});
      return std::pair<at::Tensor, at::Tensor>{
          want_weight ? g2.t().matmul(input.reshape({-1, in}).to(g2.scalar_type())).to(weight.scalar_type())
                      : at::Tensor(),
          want_bias ? g2.sum(0).to(bias.scalar_type()) : at::Tensor()};
    };
    // Deferred only for leaves (parameters): a weight that is itself computed (cast, gathered)
    // needs its gradient to flow on through autograd now.
    auto* deferred = detail::deferred_weight_gradients();
    const bool leaves = (!want_weight || weight.is_leaf()) && (!want_bias || bias.is_leaf());
    if (deferred && leaves && (want_weight || want_bias)) {
      deferred->push_back([weight_gradients, weight, bias] {
        at::NoGradGuard no_grad;
        auto [grad_weight, grad_bias] = weight_gradients();
        if (grad_weight.defined()) accumulate(weight, grad_weight);
        if (grad_bias.defined()) accumulate(bias, grad_bias);
      });
      return {grad_input, at::Tensor(), at::Tensor()};
    }
    auto [grad_weight, grad_bias] = weight_gradients();
    return {grad_input, grad_weight, grad_bias};
  }
};

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  return DeferrableLinear::apply(input, weight, bias.defined() ? bias : at::empty({0}, weight.options()));
}

}  // namespace loom::pp
