// The gradient reducer: buckets, autograd hooks, in-order issue, end-of-backward wait.
//
// Per iteration (one backward pass):
//   first hook      -> begin: queue finalize() as an engine callback for the end of backward
//   each hook       -> the parameter's gradient is in its bucket slot (a view, or copied in);
//                      when a bucket's last gradient arrives, issue every ready bucket that is
//                      next in order (bucket k never goes before bucket k-1: all ranks issue the
//                      same sequence whatever order their hooks fire in)
//   finalize()      -> handle parameters that got no gradient, issue the rest, wait for all,
//                      write back (copy mode), rebuild buckets after the first iteration.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <sstream>

#include "loom/comm/agreement.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/data_parallel.h"
#include "loom/trace.h"
#include "parallel/bucket_plan.h"
#include "parallel/flat_alias.h"
#include "parallel/released_buffers.h"

namespace loom {
namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < t.dim(); ++d) s << (d ? ", " : "") << t.size(d);
  s << "]";
  return s.str();
}

}  // namespace

// How many parameters an error message lists by name before "and N more".
constexpr size_t kNamedInErrors = 8;

struct GradientReducer::Impl : std::enable_shared_from_this<GradientReducer::Impl> {
  struct Slot {
    size_t bucket = 0;
    int64_t offset = 0;
    at::Tensor view;  // this parameter's gradient inside its bucket, shaped like the parameter
    bool ready = false;
  };
  struct Bucket {
    at::Tensor buffer;  // undefined while released (release_buckets)
    int64_t numel = 0;  // padded to options.bucket_alignment
    at::TensorOptions tensor_options;
    std::vector<size_t> members;
    size_t pending = 0;
    bool issued = false;
    PendingReduction reduction;
    trace::Clock::time_point ready_at, issued_at;
  };

  std::vector<at::Tensor> params;
  std::shared_ptr<Communicator> group;
  ReducerOptions options;
  // release_buckets: each bucket's pages handed back lazily, reused without faults (released_buffers.h).
  std::shared_ptr<detail::ReleasedBuffers> released = std::make_shared<detail::ReleasedBuffers>();
  double divisor = 1;
  CommHook hook;
  bool default_hook = true;

  std::vector<Slot> slots;
  std::vector<Bucket> buckets;
  size_t next_to_issue = 0;
  bool in_backward = false;
  bool sync = true;
  bool iteration_sync = true;
  size_t issued_during_backward = 0;
  std::vector<size_t> ready_order;  // hook order of the first synchronized iteration
  bool rebuilt = false;
  std::optional<std::vector<uint8_t>> static_used;  // static graph: agreed once
  ReducerStats stats;
  // shared_ptr in LibTorch up to 2.8, intrusive_ptr later: take whatever grad_accumulator returns.
  using AccumulatorPtr =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::autograd::Variable&>()));
  std::vector<AccumulatorPtr> accumulators;
  std::vector<uintptr_t> hook_keys;
  mutable std::mutex mutex;

  std::string where() const { return group->context("GradientReducer").prefix(); }
  // "l2.weight [32, 32]" when names were given, else "3 [32, 32]".
  std::string parameter(size_t i) const {
    const std::string name = i < options.parameter_names.size() ? options.parameter_names[i] : std::to_string(i);
    return name + " " + shape_of(params[i]);
  }

  // Alone in the group with the plain average there is nothing to reduce: gradients stay where
  // autograd put them and buckets are not used (no copies, no communication).
  bool passthrough() const { return group->size() == 1 && divisor == 1 && default_hook; }

  void check_parameters() {
    if (params.empty()) throw InvalidArgumentError(where() + ": expected at least one parameter, found none");
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.defined()) throw InvalidArgumentError(where() + ": parameter " + std::to_string(i) + " is undefined");
      if (!p.requires_grad())
        throw InvalidArgumentError(where() + ": parameter " + parameter(i) +
                                   " does not require grad (pass only trainable parameters; "
                                   "DistributedDataParallel leaves frozen ones out itself)");
      if (!p.is_leaf())
        throw InvalidArgumentError(where() + ": parameter " + std::to_string(i) + " is not a leaf tensor");
      for (size_t j = 0; j < i; ++j)
        if (params[j].is_same(p))
          throw InvalidArgumentError(where() + ": parameter " + std::to_string(i) + " is the same tensor as parameter " +
                                     std::to_string(j));
    }
  }

  // Every rank must hold the same parameter list: count, then each parameter's dtype and shape.
  void verify_same_model_on_all_ranks() {
    detail::check_same_tensors_across_ranks(*group, params, options.parameter_names, "parameter", where());
  }

  void broadcast_parameters() {
    if (group->size() == 1) return;
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> data;
    for (auto& p : params) data.push_back(p.detach());
    detail::broadcast_tensors(*group, data, "parameter broadcast");
  }

  // Lays out buckets in `order`; gradients already present are carried over into the new slots.
  void build_buckets(const std::vector<size_t>& order) {
    auto plan = detail::plan_buckets(params, order, options.first_bucket_cap_bytes, options.bucket_cap_bytes);
    std::vector<Bucket> fresh(plan.size());
    std::vector<Slot> fresh_slots(params.size());
    const auto alignment = static_cast<int64_t>(options.bucket_alignment);
    for (size_t b = 0; b < plan.size(); ++b) {
      int64_t total = 0;
      for (size_t i : plan[b]) {
        Slot& slot = fresh_slots[i];
        slot.bucket = b;
        slot.offset = total;
        total += params[i].numel();
      }
      fresh[b].numel = (total + alignment - 1) / alignment * alignment;
      fresh[b].tensor_options = params[plan[b].front()].options().requires_grad(false);
      fresh[b].members = plan[b];
      fresh[b].pending = plan[b].size();
    }
    buckets = std::move(fresh);
    slots = std::move(fresh_slots);
    stats.buckets = buckets.size();
    // Allocated when their first gradient arrives: released buckets, and all of them while there is
    // nothing to reduce (alone in the group: gradients stay where autograd put them).
    if (options.release_buckets || passthrough()) return;
    for (size_t b = 0; b < buckets.size(); ++b) {
      allocate(b);
      // Gradients present are carried over; absent ones stay absent (an optimizer skips a
      // parameter without gradient, and must keep doing so for one no rank has used yet).
      for (size_t i : buckets[b].members) {
        at::Tensor& grad = params[i].mutable_grad();
        if (grad.defined() && !passthrough()) {
          slots[i].view.copy_(grad);
          if (options.gradient_as_bucket_view) grad = slots[i].view;
        }
      }
    }
  }

  // The bucket's buffer and its members' slot views into it. Zeroed, except a released bucket's
  // (allocated every iteration): every slot of it is written before it is reduced (a gradient
  // copied in, or zeros for a parameter without one), so only the padding is zeroed here.
  void allocate(size_t b) {
    Bucket& bucket = buckets[b];
    if (bucket.buffer.defined()) return;
    if (options.release_buckets) {
      bucket.buffer = released->take(b, bucket.numel, bucket.tensor_options);
      const size_t last = bucket.members.back();
      const int64_t used = slots[last].offset + params[last].numel();
      bucket.buffer.narrow(0, used, bucket.numel - used).zero_();
    } else {
      bucket.buffer = at::zeros({bucket.numel}, bucket.tensor_options);
    }
    for (size_t i : bucket.members)
      slots[i].view = detail::alias_into(bucket.buffer, slots[i].offset, params[i].sizes());
  }

  void release(size_t b) {
    buckets[b].buffer.reset();
    for (size_t i : buckets[b].members) slots[i].view.reset();
  }

  void install_hooks() {
    std::weak_ptr<Impl> weak = weak_from_this();
    for (size_t i = 0; i < params.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
      auto key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (auto self = weak.lock()) self->on_gradient_ready(i);
            return outputs;
          }));
      accumulators.push_back(std::move(accumulator));
      hook_keys.push_back(key);
    }
  }

  void remove_hooks() {
    for (size_t i = 0; i < accumulators.size(); ++i) accumulators[i]->del_post_hook(hook_keys[i]);
    accumulators.clear();
    hook_keys.clear();
  }

  // Puts the parameter's fresh gradient into its bucket slot.
  void place_gradient(size_t i) {
    at::Tensor& grad = params[i].mutable_grad();
    Slot& slot = slots[i];
    allocate(slot.bucket);
    if (options.release_buckets) {  // the bucket holds it from now on; the parameter keeps none
      slot.view.copy_(grad);
      grad.reset();
    } else if (options.gradient_as_bucket_view) {
      if (!grad.is_same(slot.view)) {  // e.g. after optimizer.zero_grad() dropped the view
        slot.view.copy_(grad);
        grad = slot.view;
      }
    } else {
      slot.view.copy_(grad);
    }
  }

  void on_gradient_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!in_backward) begin_iteration();
    Slot& slot = slots[i];
    if (slot.ready)
      throw InvalidArgumentError(where() + ": parameter " + std::to_string(i) +
                                 " received its gradient twice in one backward pass (a second backward before the "
                                 "first finished, or a parameter used in two graphs)");
    slot.ready = true;
    // Under no_sync a released bucket stays released: the gradient accumulates in .grad.
    if (!passthrough() && (iteration_sync || !options.release_buckets)) place_gradient(i);
    if (!iteration_sync) return;
    if (options.rebuild_buckets && !rebuilt) ready_order.push_back(i);
    Bucket& bucket = buckets[slot.bucket];
    if (--bucket.pending == 0) {
      bucket.ready_at = trace::now();
      issue_in_order(/*during_backward=*/true);
    }
  }

  void begin_iteration() {
    in_backward = true;
    iteration_sync = sync;
    issued_during_backward = 0;
    std::weak_ptr<Impl> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) self->finalize();
    });
  }

  void issue_in_order(bool during_backward) {
    while (next_to_issue < buckets.size() && buckets[next_to_issue].pending == 0 && !buckets[next_to_issue].issued) {
      Bucket& bucket = buckets[next_to_issue];
      GradBucket handed{next_to_issue, bucket.buffer, bucket.members, group.get(), divisor,
                        next_to_issue + 1 == buckets.size()};
      bucket.issued_at = trace::now();
      try {
        bucket.reduction = passthrough() ? PendingReduction{} : hook(handed);
      } catch (...) {
        abandon_iteration();
        throw;
      }
      // Nobody waits on a bucket before backward ends: it runs in the background from now on.
      if (bucket.reduction.work) bucket.reduction.work->run_in_background();
      bucket.issued = true;
      // Counted only when a bucket really went to a communicator (alone in the group, none does).
      if (!passthrough()) {
        ++stats.buckets_reduced;
        stats.bytes_reduced += static_cast<uint64_t>(bucket.buffer.numel()) * bucket.buffer.element_size();
        if (during_backward) ++issued_during_backward;
      }
      ++next_to_issue;
    }
  }

  void finalize() {
    std::unique_lock<std::mutex> lock(mutex);
    if (!in_backward) return;
    ++stats.iterations;
    std::vector<size_t> missing;
    for (size_t i = 0; i < params.size(); ++i)
      if (!slots[i].ready) missing.push_back(i);
    if (!iteration_sync) {  // no_sync: gradients stay local; nothing was issued
      reset_iteration();
      return;
    }

    // A parameter this rank did not use contributes zeros (its slot may hold an older gradient).
    // Every bucket is issued before the used-set agreement below: ranks that used everything have
    // issued all of theirs from the hooks already, so this keeps one order of operations on every
    // rank (buckets, then the agreement) whatever each rank used.
    for (size_t i : missing) {
      allocate(slots[i].bucket);
      slots[i].view.zero_();
      --buckets[slots[i].bucket].pending;
    }
    issue_in_order(/*during_backward=*/false);

    std::string error;
    const std::vector<uint8_t> globally_used = agree_on_used(missing, error);
    wait_for_buckets();
    const size_t unused = hand_out_gradients(globally_used);
    stats.last_unused_parameters = unused;
    stats.last_buckets_issued_during_backward = issued_during_backward;
    ++stats.synchronized_iterations;
    if (options.rebuild_buckets && !rebuilt) rebuild_from_observed_order(missing);
    reset_iteration();
    if (!error.empty()) throw InvalidArgumentError(error);
  }

  // Which parameters any rank used this iteration (1: used). Without find_unused_parameters every
  // one must have been: `error` names the missing ones (thrown after the iteration is reset).
  std::vector<uint8_t> agree_on_used(const std::vector<size_t>& missing, std::string& error) {
    std::vector<uint8_t> globally_used(params.size(), 1);
    if (options.find_unused_parameters) {
      if (options.static_graph && static_used) return *static_used;
      std::vector<int64_t> used(params.size(), 1);
      for (size_t i : missing) used[i] = 0;
      used = all_reduce_values(*group, used, ReduceOp::Max, {"used-parameter agreement"});
      ++stats.used_set_agreements;
      for (size_t i = 0; i < params.size(); ++i) globally_used[i] = used[i] != 0;
      if (options.static_graph) static_used = globally_used;
    } else if (!missing.empty()) {
      std::ostringstream s;
      s << where() << ": parameters";
      for (size_t k = 0; k < missing.size() && k < kNamedInErrors; ++k) s << (k ? ", " : " ") << parameter(missing[k]);
      if (missing.size() > kNamedInErrors) s << " and " << missing.size() - kNamedInErrors << " more";
      s << " received no gradient in this backward pass; build the reducer with find_unused_parameters = true "
           "when the model does not use every parameter in every iteration";
      error = s.str();
    }
    return globally_used;
  }

  // Waits for every issued bucket (and runs the hooks' finishing work), timing what backward did
  // not hide.
  void wait_for_buckets() {
    const auto waiting_since = trace::now();
    bool host_waits = true;
    for (size_t b = 0; b < buckets.size(); ++b) {
      Bucket& bucket = buckets[b];
      if (!bucket.reduction.work && !bucket.reduction.finish) continue;
      if (bucket.reduction.work) {  // a hook may return only a finish that waits by itself
        host_waits = host_waits && bucket.reduction.work->wait_blocks_the_host();
        bucket.reduction.work->wait();
      }
      if (bucket.reduction.finish) bucket.reduction.finish();
      if (trace::enabled() && bucket.reduction.work) record_bucket(b);
    }
    // A device wait returns at once (the stream waits): not a measurement.
    if (host_waits)
      stats.wait_seconds += std::chrono::duration<double>(trace::now() - waiting_since).count();
    else
      ++stats.unmeasured_iterations;
  }

  // Each parameter's .grad becomes its reduced gradient (a view of its bucket, or a copy); none for
  // a parameter no rank used. Returns how many no rank used.
  size_t hand_out_gradients(const std::vector<uint8_t>& globally_used) {
    size_t unused = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& grad = params[i].mutable_grad();
      if (options.release_buckets) {  // the hook took the reduced gradients where it wanted them
        grad.reset();
        unused += globally_used[i] ? 0 : 1;
        continue;
      }
      if (!globally_used[i]) {  // no rank used it: no gradient, as in one process
        grad.reset();
        ++unused;
        continue;
      }
      if (passthrough()) continue;
      if (options.gradient_as_bucket_view) {
        if (!grad.is_same(slots[i].view)) grad = slots[i].view;
      } else if (grad.defined()) {
        grad.copy_(slots[i].view);
      } else {
        grad = slots[i].view.clone();
      }
    }
    if (options.release_buckets)
      for (size_t b = 0; b < buckets.size(); ++b) release(b);
    return unused;
  }

  void record_bucket(size_t b) {
    Bucket& bucket = buckets[b];
    auto started = bucket.reduction.work->started_at_time().value_or(bucket.issued_at);
    auto finished = bucket.reduction.work->finished_at_time().value_or(trace::now());
    const std::string name = "bucket " + std::to_string(b);
    trace::instant(name + " ready", "reducer", bucket.ready_at, "backward");
    trace::span(name + " queued", "reducer", bucket.issued_at, started, "comm");
    trace::span(name + " all_reduce", "reducer", started, finished, "comm");
  }

  // Rank 0's order of gradient arrival, agreed by all ranks, becomes the bucket order.
  void rebuild_from_observed_order(const std::vector<size_t>& missing) {
    const int64_t P = static_cast<int64_t>(params.size());
    std::vector<int64_t> order(params.size(), 0);
    if (group->rank() == 0) {
      std::vector<size_t> full = ready_order;
      for (auto it = missing.rbegin(); it != missing.rend(); ++it) full.push_back(*it);
      for (int64_t k = 0; k < P; ++k) order[k] = static_cast<int64_t>(full[k]);
    }
    if (group->size() > 1) order = broadcast_values(*group, order, 0, {"bucket order"});
    std::vector<size_t> agreed(P);
    for (int64_t k = 0; k < P; ++k) agreed[k] = static_cast<size_t>(order[k]);
    build_buckets(agreed);
    rebuilt = true;
    stats.buckets_rebuilt = true;
    ready_order.clear();
  }

  // A hook refused its bucket in the middle of backward (the error reaches the caller of
  // backward()): the iteration ends on this rank as if it had not started, so that the next
  // backward is a fresh one, once the buckets already handed to the communicator have finished
  // (they write into buffers the next iteration fills; each wait is bounded by the group's
  // timeout). Autograd does not run the finalize callback of a backward that failed.
  void abandon_iteration() {
    for (auto& bucket : buckets) {
      if (!bucket.reduction.work) continue;
      try {
        bucket.reduction.work->wait();
      } catch (const std::exception& e) {
        LOOM_LOG(warn, where() << ": a bucket of the abandoned backward failed too: " << e.what());
      }
    }
    reset_iteration();
  }

  void reset_iteration() {
    in_backward = false;
    next_to_issue = 0;
    for (auto& bucket : buckets) {
      bucket.pending = bucket.members.size();
      bucket.issued = false;
      bucket.reduction = {};
    }
    for (auto& slot : slots) slot.ready = false;
  }
};

GradientReducer::GradientReducer(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group,
                                 ReducerOptions options)
    : impl_(std::make_shared<Impl>()) {
  if (!group) throw InvalidArgumentError(ErrorContext("GradientReducer")("expected a communicator, found none"));
  impl_->params = std::move(parameters);
  impl_->group = std::move(group);
  impl_->options = std::move(options);
  impl_->divisor = impl_->options.divisor.value_or(static_cast<double>(impl_->group->size()));
  if (!(impl_->divisor > 0))
    throw InvalidArgumentError(impl_->where() + ": divisor must be positive, found " + std::to_string(impl_->divisor));
  impl_->default_hook = !impl_->options.comm_hook;
  impl_->hook = impl_->default_hook ? comm_hooks::all_reduce_average() : impl_->options.comm_hook;
  if (!impl_->options.parameter_names.empty() && impl_->options.parameter_names.size() != impl_->params.size())
    throw InvalidArgumentError(impl_->where() + ": " + std::to_string(impl_->options.parameter_names.size()) +
                               " parameter names for " + std::to_string(impl_->params.size()) + " parameters");
  if (impl_->options.bucket_alignment == 0)
    throw InvalidArgumentError(impl_->where() + ": bucket_alignment must be at least 1, found 0");
  if (impl_->options.release_buckets && impl_->options.gradient_as_bucket_view)
    throw InvalidArgumentError(impl_->where() + ": release_buckets needs gradient_as_bucket_view = false (a gradient "
                               "cannot stay a view of a buffer that is freed after each reduction)");
  impl_->check_parameters();
  impl_->verify_same_model_on_all_ranks();
  if (impl_->options.broadcast_parameters) impl_->broadcast_parameters();
  std::vector<size_t> reverse_registration;
  for (size_t i = impl_->params.size(); i-- > 0;) reverse_registration.push_back(i);
  impl_->build_buckets(reverse_registration);
  impl_->install_hooks();
  LOOM_LOG(info, impl_->where() << ": " << impl_->params.size() << " parameters in " << impl_->buckets.size()
                                << " buckets over group " << impl_->group->name());
}

GradientReducer::~GradientReducer() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->remove_hooks();
}

void GradientReducer::synchronize() { impl_->finalize(); }

bool GradientReducer::has_pending() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->in_backward && impl_->iteration_sync;
}

void GradientReducer::require_synchronized(const std::string& what) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (!impl_->in_backward || !impl_->iteration_sync) return;
  size_t issued = impl_->next_to_issue;
  throw InvalidArgumentError(impl_->where() + ": " + what + " while this iteration's gradients are still being " +
                             "reduced (" + std::to_string(issued) + " of " + std::to_string(impl_->buckets.size()) +
                             " buckets issued, backward not finished): run it after backward() returns or call "
                             "synchronize() first");
}

void GradientReducer::zero_grad() {
  // Dropping the gradients is cheaper than zeroing the buckets: the next backward's first
  // gradient of each parameter is then copied into its slot once (read + write), where zeroing
  // would cost a write and autograd's in-place accumulation another read + read + write.
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (auto& param : impl_->params) param.mutable_grad().reset();
}

void GradientReducer::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->sync = enabled;
}

bool GradientReducer::sync_enabled() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->sync;
}

GradientReducer::NoSyncGuard::NoSyncGuard(GradientReducer& reducer)
    : reducer_(&reducer), previous_(reducer.sync_enabled()) {
  reducer.set_sync(false);
}

GradientReducer::NoSyncGuard::~NoSyncGuard() {
  if (reducer_) reducer_->set_sync(previous_);
}

GradientReducer::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : reducer_(other.reducer_), previous_(other.previous_) {
  other.reducer_ = nullptr;
}

void GradientReducer::register_comm_hook(CommHook hook) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->in_backward)
    throw InvalidArgumentError(impl_->where() + ": register_comm_hook during backward: expected it between iterations");
  impl_->default_hook = !hook;
  impl_->hook = hook ? std::move(hook) : comm_hooks::all_reduce_average();
}

const std::vector<at::Tensor>& GradientReducer::parameters() const { return impl_->params; }

std::vector<std::vector<size_t>> GradientReducer::bucket_layout() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<std::vector<size_t>> layout;
  for (const auto& bucket : impl_->buckets) layout.push_back(bucket.members);
  return layout;
}

std::vector<GradientReducer::BucketShape> GradientReducer::bucket_shapes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<BucketShape> shapes;
  for (const auto& bucket : impl_->buckets) {
    BucketShape shape;
    shape.parameters = bucket.members;
    for (size_t i : bucket.members) shape.offsets.push_back(impl_->slots[i].offset);
    shape.numel = bucket.numel;
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

std::vector<at::Tensor> GradientReducer::bucket_buffers() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<at::Tensor> buffers;
  for (const auto& bucket : impl_->buckets)
    if (bucket.buffer.defined()) buffers.push_back(bucket.buffer);
  return buffers;
}

ReducerStats GradientReducer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats;
}

Communicator& GradientReducer::group() const { return *impl_->group; }

}  // namespace loom
