// ZeroOptimizer: the gradient reducer's buckets, reduce-scattered; the optimizer on this rank's
// shard of each bucket; the parameters all-gathered back after each step.
//
// Layout (identical on every rank, fixed at construction: bucket rebuilding is off, since moving a
// parameter to another bucket would move its optimizer state to another rank):
//   bucket b  = the reducer's flat gradient buffer, padded to a multiple of N elements (S_b = size / N)
//   flat_params[b] = the same layout for the parameters, which are re-seated as views into it
//   rank r owns elements [r * S_b, (r + 1) * S_b) of both: shard_params[b] and shard_grads[b]
#include "loom/parallel/zero.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

#include <atomic>
#include <cmath>
#include <set>
#include <sstream>

#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/optimizer_state.h"

namespace loom {
namespace {

// A plain tensor (no autograd view) over `numel` elements of `buffer` from `offset`, shaped `sizes`:
// what an optimizer may update in place and what a parameter may be re-seated onto.
at::Tensor alias_of(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
  at::Tensor alias = at::empty({0}, buffer.options());
  alias.set_(buffer.storage(), buffer.storage_offset() + offset, sizes, strides);
  return alias;
}

// Bytes of the storages behind `tensors`, each storage counted once across calls sharing `seen`.
int64_t storage_bytes(const std::vector<at::Tensor>& tensors, std::set<const void*>& seen) {
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

}  // namespace

struct ZeroOptimizer::Impl {
  std::vector<at::Tensor> params;
  std::shared_ptr<Communicator> group;
  ZeroOptions options;
  int rank = 0, size = 1;

  std::vector<Placement> placements;         // per parameter
  std::vector<int64_t> shard_numel;          // per bucket
  std::vector<at::Tensor> flat_params;       // per bucket, padded
  std::vector<at::Tensor> shard_params;      // per bucket: this rank's slice of flat_params
  std::vector<at::Tensor> shard_grads;       // per bucket: this rank's reduced gradients
  std::atomic<bool> reduced_since_step{false};
  std::atomic<uint64_t> bytes_reduce_scattered{0};
  ZeroStats stats;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  // Last: destroyed first, so its hooks (which call back into this object) go before the rest.
  std::unique_ptr<GradientReducer> reducer;

  std::string where(const char* call = "ZeroOptimizer") const { return group->context(call).prefix(); }

  // The reducer's communication hook: this rank's shard of the bucket, reduced over the group and
  // divided by the group size. Stage 1 reduces in place (the shard is the bucket's own chunk).
  PendingReduction reduce_scatter(GradBucket& bucket) {
    const size_t b = bucket.index;
    const int64_t S = shard_numel.at(b);
    if (bucket.buffer.numel() != S * size)
      throw InvalidArgumentError(where() + ": bucket " + std::to_string(b) + " holds " +
                                 std::to_string(bucket.buffer.numel()) + " elements, expected " +
                                 std::to_string(S * size) + " (the layout changed after construction)");
    at::Tensor output = options.stage == 1 ? bucket.buffer.narrow(0, rank * S, S) : shard_grads[b];
    if (options.stage == 1) shard_grads[b] = output;
    reduced_since_step = true;
    const double divisor = bucket.divisor;
    if (size == 1) {  // alone: the bucket is the shard (stage 1 in place; stage 2 copies it out)
      at::Tensor buffer = bucket.buffer;
      return {nullptr, [output, buffer, divisor]() mutable {
                if (output.data_ptr() != buffer.data_ptr()) output.copy_(buffer);
                if (divisor != 1) output.div_(divisor);
              }};
    }
    if (options.reduce_dtype && *options.reduce_dtype != bucket.buffer.scalar_type()) {
      at::Tensor wire = bucket.buffer.div(divisor).to(*options.reduce_dtype);
      at::Tensor wire_shard = at::empty({S}, wire.options());
      bytes_reduce_scattered += wire.nbytes();
      WorkPtr work = group->reduce_scatter(wire_shard, wire, {ReduceOp::Sum});
      return {work, [output, wire_shard]() mutable { output.copy_(wire_shard); }};
    }
    bytes_reduce_scattered += bucket.buffer.nbytes();
    WorkPtr work = group->reduce_scatter(output, bucket.buffer, {ReduceOp::Sum});
    return {work, [output, divisor]() mutable {
              if (divisor != 1) output.div_(divisor);
            }};
  }

  // Each parameter becomes a view of its bucket's flat parameter buffer (same values), so that this
  // rank's shard of the bucket is one tensor the optimizer can step and the all-gather can fill.
  void reseat_parameters(const std::vector<GradientReducer::BucketShape>& shapes) {
    at::NoGradGuard no_grad;
    placements.assign(params.size(), {});
    for (size_t b = 0; b < shapes.size(); ++b) {
      const auto& shape = shapes[b];
      const at::Tensor& first = params[shape.parameters.front()];
      at::Tensor flat = at::zeros({shape.numel}, first.options().requires_grad(false));
      for (size_t k = 0; k < shape.parameters.size(); ++k) {
        const size_t i = shape.parameters[k];
        at::Tensor& p = params[i];
        const int64_t offset = shape.offsets[k];
        at::Tensor seat = alias_of(flat, offset, p.sizes());
        seat.copy_(p.detach());
        p.set_data(seat);
        placements[i] = {b, offset, p.numel()};
      }
      const int64_t S = shape.numel / size;
      flat_params.push_back(flat);
      shard_numel.push_back(S);
      shard_params.push_back(alias_of(flat, rank * S, {S}));
    }
  }

  void make_gradient_shards() {
    const auto buffers = reducer->bucket_buffers();
    for (size_t b = 0; b < flat_params.size(); ++b) {
      const int64_t S = shard_numel[b];
      if (options.stage == 1)
        shard_grads.push_back(alias_of(buffers.at(b), rank * S, {S}));
      else
        shard_grads.push_back(at::zeros({S}, flat_params[b].options()));
    }
  }

  void adopt_optimizer(std::unique_ptr<torch::optim::Optimizer> made) {
    if (!made) throw InvalidArgumentError(where() + ": the optimizer factory returned no optimizer");
    if (!optimizer_kind(*made))
      throw InvalidArgumentError(where() + ": " + unsupported_optimizer(*made, "sharded by ZeRO") +
                                 " (element-wise optimizers: each element's update depends on that element alone, so "
                                 "a shard can be stepped by itself)");
    const auto& groups = made->param_groups();
    size_t given = 0;
    for (const auto& g : groups) given += g.params().size();
    if (groups.size() != 1 || given != shard_params.size())
      throw InvalidArgumentError(where() + ": expected the optimizer over exactly the " +
                                 std::to_string(shard_params.size()) + " shard tensors it is given, in one parameter "
                                 "group; found " + std::to_string(groups.size()) + " groups with " +
                                 std::to_string(given) + " tensors");
    for (size_t b = 0; b < shard_params.size(); ++b)
      if (!groups[0].params()[b].is_same(shard_params[b]))
        throw InvalidArgumentError(where() + ": the optimizer's tensor " + std::to_string(b) +
                                   " is not shard tensor " + std::to_string(b) + " (pass the factory's argument through)");
    optimizer = std::move(made);
  }

  void all_gather_parameters() {
    if (size == 1) return;  // the shards are the parameters
    std::vector<WorkPtr> works;
    works.reserve(flat_params.size());
    for (size_t b = 0; b < flat_params.size(); ++b) {
      works.push_back(group->all_gather(flat_params[b], shard_params[b]));
      works.back()->run_in_background();
      stats.bytes_all_gathered += flat_params[b].nbytes();
    }
    for (auto& work : works) work->wait();
  }
};

ZeroOptimizer::ZeroOptimizer(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group,
                             const OptimizerFactory& make_optimizer, ZeroOptions options)
    : ZeroOptimizer(std::move(parameters), std::move(group), std::move(options)) {
  if (!make_optimizer) throw InvalidArgumentError(impl_->where() + ": expected an optimizer factory, found none");
  impl_->adopt_optimizer(make_optimizer(impl_->shard_params));
}

ZeroOptimizer::ZeroOptimizer(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group,
                             ZeroOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!group) throw InvalidArgumentError(ErrorContext("ZeroOptimizer")("expected a communicator, found none"));
  Impl& z = *impl_;
  z.group = std::move(group);
  z.options = std::move(options);
  z.rank = z.group->rank();
  z.size = z.group->size();
  if (z.options.stage != 1 && z.options.stage != 2)
    throw InvalidArgumentError(z.where() + ": stage must be 1 (optimizer state sharded) or 2 (gradients too), found " +
                               std::to_string(z.options.stage));

  if (z.options.reduce_dtype && !at::isFloatingType(*z.options.reduce_dtype))
    throw InvalidArgumentError(z.where() + ": reduce_dtype must be a floating-point dtype (float16, bfloat16, float32), "
                               "found " + std::string(c10::toString(*z.options.reduce_dtype)));
  ReducerOptions reducer_options;
  reducer_options.bucket_cap_bytes = z.options.bucket_cap_bytes;
  reducer_options.first_bucket_cap_bytes = z.options.first_bucket_cap_bytes;
  reducer_options.find_unused_parameters = z.options.find_unused_parameters;
  reducer_options.broadcast_parameters = z.options.broadcast_parameters;
  // Frozen parameters stay out of the shards (as DDP leaves them out of its buckets); every rank
  // takes rank 0's values, as DDP's broadcast gives them.
  std::vector<at::Tensor> trainable, frozen;
  std::vector<std::string> trainable_names;
  const bool named = z.options.parameter_names.size() == parameters.size();
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (parameters[i].defined() && !parameters[i].requires_grad()) {
      frozen.push_back(parameters[i].detach());
      continue;
    }
    trainable.push_back(parameters[i]);
    if (named) trainable_names.push_back(z.options.parameter_names[i]);
  }
  if (!frozen.empty() && z.options.broadcast_parameters && z.size > 1)
    detail::broadcast_tensors(*z.group, frozen, "frozen parameter broadcast");
  reducer_options.parameter_names = named ? trainable_names : z.options.parameter_names;
  reducer_options.rebuild_buckets = false;
  reducer_options.bucket_alignment = static_cast<size_t>(z.size);
  // Stage 1: gradients are views into persistent buckets (no copy, reduce-scatter in place).
  // Stage 2: copied into a bucket that lives only until its reduce-scatter is done.
  reducer_options.gradient_as_bucket_view = z.options.stage == 1;
  reducer_options.release_buckets = z.options.stage == 2;
  Impl* self = impl_.get();
  reducer_options.comm_hook = [self](GradBucket& bucket) { return self->reduce_scatter(bucket); };
  z.reducer = std::make_unique<GradientReducer>(std::move(trainable), z.group, std::move(reducer_options));
  z.params = z.reducer->parameters();

  z.reseat_parameters(z.reducer->bucket_shapes());
  z.make_gradient_shards();
  int64_t total = 0, padded = 0;
  for (const auto& p : z.params) total += p.numel();
  for (const auto& f : z.flat_params) padded += f.numel();
  LOOM_LOG(info, z.where() << ": stage " << z.options.stage << ", " << total << " parameter elements in "
                           << z.flat_params.size() << " buckets (" << padded - total << " padding), "
                           << padded / z.size << " per shard");
}

ZeroOptimizer::~ZeroOptimizer() = default;

void ZeroOptimizer::zero_grad() { impl_->reducer->zero_grad(); }

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  Impl& z = *impl_;
  z.reducer->require_synchronized("ZeroOptimizer::clip_grad_norm");
  if (!z.reduced_since_step)
    throw InvalidArgumentError(z.where("ZeroOptimizer::clip_grad_norm") +
                               ": no synchronised backward since the last step: expected gradients to clip");
  if (!(max_norm > 0))
    throw InvalidArgumentError(z.where("ZeroOptimizer::clip_grad_norm") + ": max_norm must be positive, found " +
                               std::to_string(max_norm));
  at::Tensor squares = at::zeros({1}, z.shard_grads.front().options().dtype(at::kDouble));
  for (const auto& g : z.shard_grads) squares += g.to(at::kDouble).pow(2).sum();
  z.group->all_reduce(squares, {ReduceOp::Sum})->wait();
  const double norm = std::sqrt(squares.item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1)
    for (auto& g : z.shard_grads) g.mul_(coefficient);
  return norm;
}

void ZeroOptimizer::step() {
  Impl& z = *impl_;
  if (!z.optimizer)
    throw InvalidArgumentError(z.where("ZeroOptimizer::step") +
                               ": built without an optimizer: step shard_parameters() between begin_step() and "
                               "gather_parameters()");
  begin_step();
  {
    at::NoGradGuard no_grad;
    z.optimizer->step();
  }
  gather_parameters();
}

void ZeroOptimizer::begin_step() {
  Impl& z = *impl_;
  z.reducer->require_synchronized("ZeroOptimizer::step");
  if (!z.reduced_since_step)
    throw InvalidArgumentError(z.where("ZeroOptimizer::step") +
                               ": no synchronised backward since the last step (only backward passes under no_sync, "
                               "or none): expected reduced gradients to step with");
  for (size_t b = 0; b < z.shard_params.size(); ++b) z.shard_params[b].mutable_grad() = z.shard_grads[b];
}

void ZeroOptimizer::gather_parameters() {
  Impl& z = *impl_;
  at::NoGradGuard no_grad;
  for (auto& shard : z.shard_params) shard.mutable_grad().reset();
  z.all_gather_parameters();
  z.reduced_since_step = false;
  ++z.stats.steps;
}

std::vector<at::Tensor> ZeroOptimizer::shard_gradients() const { return impl_->shard_grads; }
std::vector<at::Tensor> ZeroOptimizer::shard_parameters() const { return impl_->shard_params; }
torch::optim::Optimizer& ZeroOptimizer::optimizer() {
  if (!impl_->optimizer)
    throw InvalidArgumentError(impl_->where("ZeroOptimizer::optimizer") + ": built without an optimizer of its own");
  return *impl_->optimizer;
}
bool ZeroOptimizer::has_optimizer() const { return impl_->optimizer != nullptr; }
GradientReducer& ZeroOptimizer::reducer() { return *impl_->reducer; }
Communicator& ZeroOptimizer::group() const { return *impl_->group; }
const std::vector<at::Tensor>& ZeroOptimizer::parameters() const { return impl_->params; }
const std::vector<ZeroOptimizer::Placement>& ZeroOptimizer::placements() const { return impl_->placements; }
int64_t ZeroOptimizer::shard_numel(size_t bucket) const { return impl_->shard_numel.at(bucket); }
int ZeroOptimizer::stage() const { return impl_->options.stage; }

ZeroMemory count_training_memory(const std::vector<at::Tensor>& parameters,
                                 const std::vector<at::Tensor>& gradient_buffers, torch::optim::Optimizer* optimizer) {
  std::set<const void*> seen;
  ZeroMemory m;
  m.parameters = storage_bytes(parameters, seen);
  std::vector<at::Tensor> grads = gradient_buffers;
  for (const auto& p : parameters) grads.push_back(p.grad());  // e.g. accumulated locally under no_sync
  m.gradients = storage_bytes(grads, seen);
  std::vector<at::Tensor> state;
  const auto kind = optimizer ? optimizer_kind(*optimizer) : std::nullopt;
  if (kind)
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params())
        if (const auto* s = find_optimizer_state(*optimizer, p))
          for (auto& [key, tensor] : optimizer_state_tensors(*kind, *s)) state.push_back(tensor);
  m.optimizer_state = storage_bytes(state, seen);
  return m;
}

ZeroMemory ZeroOptimizer::memory() const {
  const Impl& z = *impl_;
  std::vector<at::Tensor> grads = z.reducer->bucket_buffers();
  if (z.options.stage == 2) grads.insert(grads.end(), z.shard_grads.begin(), z.shard_grads.end());
  return count_training_memory(z.params, grads, z.optimizer.get());  // none: its state lives elsewhere
}

ZeroStats ZeroOptimizer::stats() const {
  ZeroStats s = impl_->stats;
  s.bytes_reduce_scattered = impl_->bytes_reduce_scattered.load();
  return s;
}

}  // namespace loom
