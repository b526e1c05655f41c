// ZeroOptimizer: the gradient reducer's buckets, reduce-scattered; the optimizer on this rank's
// shard of each bucket; the parameters all-gathered back after each step.
//
// Layout (identical on every rank, fixed at construction: bucket rebuilding is off, since moving a
// parameter to another bucket would move its optimizer state to another rank):
//   bucket b  = the reducer's flat gradient buffer, padded to a multiple of N elements (S_b = size / N)
//   flat_params[b] = the same layout for the parameters, which are re-seated as views into it
//   rank r owns elements [r * S_b, (r + 1) * S_b) of both: shard_params[b] and shard_grads[b]
// With master weights (bf16/fp16 buckets): master_shards[b] is an fp32 copy of shard_params[b],
// and master_grads[b] the fp32 conversion of shard_grads[b], made once per reduction when first
// needed (unscale, clip, step) and dropped after the step.
#include "loom/parallel/zero.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <set>
#include <sstream>
#include <unordered_map>

#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/optimizer_state.h"
#include "parallel/flat_alias.h"
#include "parallel/sharded_step.h"

namespace loom {
namespace {

// A plain tensor (no autograd view) over `numel` elements of `buffer` from `offset`, shaped `sizes`:
// what an optimizer may update in place and what a parameter may be re-seated onto.
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
  std::vector<at::Tensor> master_shards;     // per bucket: fp32 copy of shard_params (undefined: none)
  std::vector<at::Tensor> master_grads;      // per bucket: fp32 shard_grads, while current
  std::vector<at::Tensor> optimizer_shards;  // per bucket: what the optimizer steps
  bool master_grads_current = false;
  std::vector<WorkPtr> unwaited_gathers;     // per bucket: an all-gather nobody waited for yet
  std::unordered_map<const void*, size_t> param_index;  // TensorImpl -> parameter
  std::vector<int64_t> seen_versions;        // per parameter: its version counter when masters matched it
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
    if (unwaited_gathers.at(b)) refuse_unwaited_backward(b);
    if (bucket.buffer.numel() != S * size)
      throw InvalidArgumentError(where() + ": bucket " + std::to_string(b) + " holds " +
                                 std::to_string(bucket.buffer.numel()) + " elements, expected " +
                                 std::to_string(S * size) + " (the layout changed after construction)");
    at::Tensor output = options.stage == 1 ? bucket.buffer.narrow(0, rank * S, S) : shard_grads[b];
    if (options.stage == 1) shard_grads[b] = output;
    reduced_since_step = true;
    master_grads_current = false;
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
        at::Tensor seat = detail::alias_into(flat, offset, p.sizes());
        seat.copy_(p.detach());
        p.set_data(seat);
        placements[i] = {b, offset, p.numel()};
      }
      const int64_t S = shape.numel / size;
      flat_params.push_back(flat);
      shard_numel.push_back(S);
      shard_params.push_back(detail::alias_into(flat, rank * S, {S}));
      const bool low_precision = flat.scalar_type() == at::kBFloat16 || flat.scalar_type() == at::kHalf;
      master_shards.push_back(options.master_weights && low_precision ? shard_params.back().to(at::kFloat, false, true)
                                                                      : at::Tensor());
      optimizer_shards.push_back(master_shards.back().defined() ? master_shards.back() : shard_params.back());
    }
    master_grads.resize(flat_params.size());
    unwaited_gathers.resize(flat_params.size());
    for (size_t i = 0; i < params.size(); ++i) param_index[params[i].unsafeGetTensorImpl()] = i;
  }

  // The gradients the optimizer, the scaler and clipping see: fp32 for buckets with master weights.
  const std::vector<at::Tensor>& step_gradients() {
    if (master_shards.empty() || std::none_of(master_shards.begin(), master_shards.end(),
                                              [](const at::Tensor& m) { return m.defined(); }))
      return shard_grads;
    if (!master_grads_current) {
      for (size_t b = 0; b < shard_grads.size(); ++b)
        master_grads[b] = master_shards[b].defined() ? shard_grads[b].to(at::kFloat) : shard_grads[b];
      master_grads_current = true;
    }
    return master_grads;
  }

  void check_clip(double max_norm) {
    reducer->require_synchronized("ZeroOptimizer::clip_grad_norm");
    if (!reduced_since_step)
      throw InvalidArgumentError(where("ZeroOptimizer::clip_grad_norm") +
                                 ": no synchronised backward since the last step: expected gradients to clip");
    if (!(max_norm > 0))
      throw InvalidArgumentError(where("ZeroOptimizer::clip_grad_norm") + ": max_norm must be positive, found " +
                                 std::to_string(max_norm));
  }

  bool has_masters() const {
    return std::any_of(master_shards.begin(), master_shards.end(), [](const at::Tensor& m) { return m.defined(); });
  }

  // The master elements of parameter i (those in this rank's shard) take the parameter's values.
  void master_from_parameter(size_t i) {
    const Placement& p = placements[i];
    const at::Tensor& master = master_shards[p.bucket];
    if (!master.defined()) return;
    const int64_t S = shard_numel[p.bucket];
    const int64_t begin = std::max(p.offset, rank * S), end = std::min(p.offset + p.numel, (rank + 1) * S);
    if (end > begin)
      master.narrow(0, begin - rank * S, end - begin).copy_(params[i].detach().reshape({-1}).narrow(0, begin - p.offset, end - begin));
  }

  // Parameters changed in place since the masters last matched them (a checkpoint load, an
  // assignment under NoGradGuard) pass their values to the masters, which would otherwise put the
  // old values back at the next step. The version counter moves with every in-place write.
  void adopt_changed_parameters() {
    if (!has_masters()) return;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i]._version() != seen_versions[i]) {
        master_from_parameter(i);
        seen_versions[i] = params[i]._version();
      }
  }
  void record_versions() {
    seen_versions.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) seen_versions[i] = params[i]._version();
  }

  void drop_master_grads() {
    for (auto& g : master_grads) g.reset();
    master_grads_current = false;
  }

  // The reducer abandons the backward whose bucket this refuses (the caller may wait and redo
  // it): the buckets reduced before it in that backward count for nothing.
  [[noreturn]] void refuse_unwaited_backward(size_t b) {
    reduced_since_step = false;
    master_grads_current = false;
    std::string names;
    for (size_t i = 0; i < placements.size() && names.size() < 200; ++i)
      if (placements[i].bucket == b)
        names += (names.empty() ? "" : ", ") + (i < options.parameter_names.size() && options.parameter_names.size() == params.size()
                                                     ? options.parameter_names[i]
                                                     : "parameter " + std::to_string(i));
    throw InvalidArgumentError(where("ZeroOptimizer backward") + ": gradients arrived for bucket " + std::to_string(b) +
                               " (" + names + ") whose all-gather after the last step nobody waited for: expected "
                               "wait_parameters() for them before forward read them (overlap_param_gather; a "
                               "forward that read them early used partly updated values)");
  }

  void wait_bucket(size_t b) {
    if (WorkPtr work = std::move(unwaited_gathers[b])) {
      unwaited_gathers[b] = nullptr;
      work->wait();
    }
  }
  void wait_all() {
    // In the order they were started (the last bucket first).
    for (size_t b = unwaited_gathers.size(); b-- > 0;) wait_bucket(b);
  }

  void make_gradient_shards() {
    const auto buffers = reducer->bucket_buffers();
    for (size_t b = 0; b < flat_params.size(); ++b) {
      const int64_t S = shard_numel[b];
      if (options.stage == 1)
        shard_grads.push_back(detail::alias_into(buffers.at(b), rank * S, {S}));
      else
        shard_grads.push_back(at::zeros({S}, flat_params[b].options()));
    }
  }

  void adopt_optimizer(std::unique_ptr<torch::optim::Optimizer> made) {
    optimizer = detail::adopt_shard_optimizer(std::move(made), optimizer_shards, where(), "ZeRO");
  }

  // Started from the last bucket, which holds the first parameters registered: those the next
  // forward reads first.
  void all_gather_parameters() {
    if (size == 1) return;  // the shards are the parameters
    for (size_t b = flat_params.size(); b-- > 0;) {
      unwaited_gathers[b] = group->all_gather(flat_params[b], shard_params[b]);
      unwaited_gathers[b]->run_in_background();
      stats.bytes_all_gathered += flat_params[b].nbytes();
    }
    if (!options.overlap_param_gather) wait_all();
  }
};

ZeroOptimizer::ZeroOptimizer(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group,
                             const OptimizerFactory& make_optimizer, ZeroOptions options)
    : ZeroOptimizer(std::move(parameters), std::move(group), std::move(options)) {
  if (!make_optimizer) throw InvalidArgumentError(impl_->where() + ": expected an optimizer factory, found none");
  impl_->adopt_optimizer(make_optimizer(impl_->optimizer_shards));
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
  z.record_versions();
  int64_t total = 0, padded = 0;
  for (const auto& p : z.params) total += p.numel();
  for (const auto& f : z.flat_params) padded += f.numel();
  LOOM_LOG(info, z.where() << ": stage " << z.options.stage << ", " << total << " parameter elements in "
                           << z.flat_params.size() << " buckets (" << padded - total << " padding), "
                           << padded / z.size << " per shard");
}

ZeroOptimizer::~ZeroOptimizer() {
  // No all-gather may outlive the buffers it writes.
  try {
    impl_->wait_all();
  } catch (const std::exception& e) {
    LOOM_LOG(error, impl_->where() << ": an all-gather failed while the optimizer was destroyed: " << e.what());
  }
}

void ZeroOptimizer::zero_grad() {
  impl_->reducer->zero_grad();
  impl_->drop_master_grads();
}

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  impl_->check_clip(max_norm);
  return detail::clip_sharded_gradients(impl_->step_gradients(), *impl_->group, max_norm);
}

double ZeroOptimizer::clip_grad_norm(double max_norm, const torch::nn::Module& model,
                                     const std::shared_ptr<Communicator>& tensor_parallel) {
  Impl& z = *impl_;
  z.check_clip(max_norm);
  if (!tensor_parallel || tensor_parallel->size() == 1)
    return detail::clip_sharded_gradients(z.step_gradients(), *z.group, max_norm);
  std::vector<int64_t> shard_numel;
  for (size_t b = 0; b < z.step_gradients().size(); ++b) shard_numel.push_back(this->shard_numel(b));
  const auto tp = detail::tensor_parallel_norm(model, *tensor_parallel, z.params, z.placements, shard_numel, z.group->rank(),
                                                  z.where("ZeroOptimizer::clip_grad_norm"));
  return detail::clip_sharded_gradients(z.step_gradients(), *z.group, max_norm, &tp);
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
  z.wait_all();
  z.adopt_changed_parameters();
  const auto& grads = z.step_gradients();
  for (size_t b = 0; b < z.optimizer_shards.size(); ++b) z.optimizer_shards[b].mutable_grad() = grads[b];
}

void ZeroOptimizer::gather_parameters() {
  Impl& z = *impl_;
  at::NoGradGuard no_grad;
  for (auto& shard : z.optimizer_shards) shard.mutable_grad().reset();
  z.drop_master_grads();
  for (size_t b = 0; b < z.shard_params.size(); ++b)
    if (z.master_shards[b].defined()) z.shard_params[b].copy_(z.master_shards[b]);
  z.all_gather_parameters();
  z.record_versions();
  z.reduced_since_step = false;
  ++z.stats.steps;
}

void ZeroOptimizer::refresh_master_weights() {
  Impl& z = *impl_;
  z.wait_all();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < z.params.size(); ++i) z.master_from_parameter(i);
  z.record_versions();
}

bool ZeroOptimizer::has_master_weights(size_t bucket) const { return impl_->master_shards.at(bucket).defined(); }

void ZeroOptimizer::wait_parameters() { impl_->wait_all(); }

void ZeroOptimizer::wait_parameters(const std::vector<at::Tensor>& parameters) {
  Impl& z = *impl_;
  for (const auto& p : parameters) {
    auto it = z.param_index.find(p.unsafeGetTensorImpl());
    if (it != z.param_index.end()) z.wait_bucket(z.placements[it->second].bucket);  // others: frozen, or not ours
  }
}

void ZeroOptimizer::wait_parameters(const torch::nn::Module& module) { wait_parameters(module.parameters()); }

size_t ZeroOptimizer::unwaited_buckets() const {
  return static_cast<size_t>(std::count_if(impl_->unwaited_gathers.begin(), impl_->unwaited_gathers.end(),
                                           [](const WorkPtr& w) { return w != nullptr; }));
}

std::vector<at::Tensor> ZeroOptimizer::shard_gradients() const { return impl_->step_gradients(); }
std::vector<at::Tensor> ZeroOptimizer::shard_parameters() const { return impl_->optimizer_shards; }
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
  grads.insert(grads.end(), z.master_grads.begin(), z.master_grads.end());
  ZeroMemory m = count_training_memory(z.params, grads, z.optimizer.get());  // none: its state lives elsewhere
  std::set<const void*> seen;
  m.master_weights = storage_bytes(z.master_shards, seen);
  return m;
}

ZeroStats ZeroOptimizer::stats() const {
  ZeroStats s = impl_->stats;
  s.bytes_reduce_scattered = impl_->bytes_reduce_scattered.load();
  return s;
}

}  // namespace loom
