// Cross-entropy over vocabulary-split logits, without gathering them.
//
// Per row i with global logits z (split over ranks), target t, V classes and smoothing e:
//   lse   = m + log sum_c exp(z_c - m)          m = max_c z_c (all-reduce max)
//   nll   = lse - z_t
//   loss  = (1 - e) nll + e/V sum_c (lse - z_c)  (torch's label smoothing: uniform over V classes)
// Each rank contributes its classes to three row sums (sum exp, z_t, sum z), all-reduced together
// in one call. The gradient d loss / d z_c = p_c - (1 - e) [c = t] - e/V only needs the softmax of
// this rank's classes, which forward saves: backward communicates nothing.
#include <ATen/ops/empty.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include "loom/parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_util.h"

namespace loom {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            const TensorParallelGroup& group, int64_t ignore_index, double smoothing,
                            int64_t reduction) {
    const int t = detail::tp_size(group);
    const int64_t local_classes = logits.size(-1);
    const int64_t classes = local_classes * t;
    const int64_t start = detail::tp_rank(group) * local_classes;
    // Half-precision logits would lose the sums; compute in float32 (or float64 if given).
    const auto compute = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor z = logits.reshape({-1, local_classes}).to(compute);
    at::Tensor tgt = target.reshape({-1}).to(at::kLong);

    at::Tensor max = z.amax(1);
    if (t > 1) {
      // Ranks must hold slices of one width: two more entries, this rank's width and its negation,
      // ride along in the max all-reduce; after it they equal the width on every rank only when
      // every rank's width is the same (max of -w is -min w). Read on the host where that is free.
      const bool check = detail::host_checks_enabled(logits);
      if (check) {
        const double w = static_cast<double>(local_classes);
        max = at::cat({max, at::tensor({w, -w}, max.options())});
      }
      detail::tp_all_reduce(max, group, ReduceOp::Max);
      if (check) {
        const int64_t widest = static_cast<int64_t>(max[-2].item<double>());
        const int64_t narrowest = -static_cast<int64_t>(max[-1].item<double>());
        if (widest != local_classes || narrowest != local_classes)
          throw MismatchError(detail::tp_where(group, "vocab_parallel_cross_entropy") +
                              ": ranks pass logits of different widths: this rank's last dimension is " +
                              std::to_string(local_classes) + ", the group's ranges from " + std::to_string(narrowest) +
                              " to " + std::to_string(widest) + " (every rank must hold vocab / tp classes)");
        max = max.narrow(0, 0, max.size(0) - 2);
      }
    }
    at::Tensor shifted = z - max.unsqueeze(1);
    at::Tensor exp = shifted.exp();

    at::Tensor valid = tgt.ne(ignore_index);
    at::Tensor mine = valid.logical_and(tgt.ge(start)).logical_and_(tgt.lt(start + local_classes));
    at::Tensor local_target = (tgt - start).masked_fill_(mine.logical_not(), 0);
    at::Tensor target_logit = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill_(mine.logical_not(), 0);

    std::vector<at::Tensor> rows = {exp.sum(1), target_logit};
    if (smoothing > 0) rows.push_back(shifted.sum(1));
    at::Tensor sums = at::stack(rows);
    if (t > 1) detail::tp_all_reduce(sums, group, ReduceOp::Sum);

    at::Tensor sum_exp = sums[0];
    at::Tensor lse = sum_exp.log();  // of the shifted logits; the shift cancels in every term below
    at::Tensor loss = lse - sums[1];
    if (smoothing > 0) loss = loss * (1 - smoothing) + (lse * classes - sums[2]) * (smoothing / classes);
    loss = loss.masked_fill(valid.logical_not(), 0);

    at::Tensor count = valid.sum().to(compute);
    at::Tensor result;
    switch (static_cast<LossReduction>(reduction)) {
      case LossReduction::Mean: result = loss.sum() / count; break;
      case LossReduction::Sum: result = loss.sum(); break;
      case LossReduction::None: result = loss.reshape(target.sizes()); break;
    }
    ctx->save_for_backward({exp.div_(sum_exp.unsqueeze(1)), local_target, mine, valid, count});
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["classes"] = classes;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["shape"] = logits.sizes().vec();
    ctx->saved_data["dtype"] = logits.scalar_type();
    return result.to(logits.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], local_target = saved[1], mine = saved[2], valid = saved[3], count = saved[4];
    const double smoothing = ctx->saved_data["smoothing"].toDouble();
    const int64_t classes = ctx->saved_data["classes"].toInt();
    const auto reduction = static_cast<LossReduction>(ctx->saved_data["reduction"].toInt());

    at::Tensor g = grads[0].to(softmax.scalar_type());
    at::Tensor weight = reduction == LossReduction::None ? g.reshape({-1}) : g.expand({softmax.size(0)});
    weight = weight.masked_fill(valid.logical_not(), 0);
    // Every target ignored: the loss is 0/0 = NaN (as in PyTorch), but each row's weight is already
    // 0, and so is PyTorch's gradient; dividing by max(count, 1) keeps it 0 instead of 0/0.
    if (reduction == LossReduction::Mean) weight = weight / count.clamp_min(1);

    at::Tensor grad = softmax.clone();
    if (smoothing > 0) grad.sub_(smoothing / classes);
    grad.scatter_add_(1, local_target.unsqueeze(1), mine.unsqueeze(1).to(grad.scalar_type()) * -(1 - smoothing));
    grad.mul_(weight.unsqueeze(1));
    grad = grad.reshape(ctx->saved_data["shape"].toIntVector()).to(ctx->saved_data["dtype"].toScalarType());
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                        const TensorParallelGroup& group,
                                        const VocabParallelCrossEntropyOptions& options) {
  const std::string where = detail::tp_where(group, "vocab_parallel_cross_entropy");
  if (logits.dim() < 1 || !at::isFloatingType(logits.scalar_type()))
    throw InvalidArgumentError(where + ": expected floating-point logits with a class dimension last; found " +
                               std::string(c10::toString(logits.scalar_type())) + " " + c10::str(logits.sizes()));
  if (!at::isIntegralType(target.scalar_type(), /*includeBool=*/false))
    throw InvalidArgumentError(where + ": expected integer class ids as target; found dtype " +
                               std::string(c10::toString(target.scalar_type())));
  auto expected = logits.sizes().vec();
  expected.pop_back();
  if (target.sizes().vec() != expected)
    throw InvalidArgumentError(where + ": target shape should be the logits' shape without the class dimension, " +
                               c10::str(at::IntArrayRef(expected)) + "; found " + c10::str(target.sizes()));
  if (options.label_smoothing < 0 || options.label_smoothing > 1)
    throw InvalidArgumentError(where + ": label_smoothing must be in [0, 1]; found " +
                               std::to_string(options.label_smoothing));
  // Out-of-range targets are an error in torch too; checked here because a target no rank owns
  // would silently contribute a zero logit. (On a GPU only in the debug mode: reading the flag would
  // stall the stream every step.)
  const int64_t classes = logits.size(-1) * detail::tp_size(group);
  at::Tensor checked = target.ne(options.ignore_index);
  if (detail::host_checks_enabled(target) &&
      checked.logical_and(target.lt(0).logical_or(target.ge(classes))).any().item<bool>())
    throw InvalidArgumentError(where + ": target ids must be in [0, " + std::to_string(classes) +
                               ") or equal ignore_index " + std::to_string(options.ignore_index) + "; found min " +
                               std::to_string(target.min().item<int64_t>()) + ", max " +
                               std::to_string(target.max().item<int64_t>()));
  return VocabParallelCrossEntropy::apply(logits, target, group, options.ignore_index, options.label_smoothing,
                                          static_cast<int64_t>(options.reduction));
}

}  // namespace loom
