// FullyShardedDataParallel: units of parameters kept as flat shards, gathered into a flat buffer
// for their forward and backward, gradients reduce-scattered as each unit's backward ends.
//
// Layout of unit u (identical on every rank, fixed at construction): its trainable parameters, in
// the order the module lists them, one after another in a flat buffer `full` of N * S elements
// (S = ceil(numel / N), the tail zero); rank r's `shard` is a copy of elements [r * S, (r + 1) * S).
// The module's parameter tensors are re-seated as views of `full`'s storage. "Resharding" takes
// that storage's memory away (its size becomes 0 bytes) and "gathering" gives it memory again and
// all-gathers the shards into it: the parameters, and every view of them autograd saved for
// backward, see the gathered values without their tensors changing (the approach of FSDP, which
// resizes the storage of its unsharded parameters).
//
// Per iteration:
//   forward(unit)        -> gather it (waiting for a prefetch), start the next unit's gather (the
//                           previous iteration's order), run the body, reshard (not the root),
//                           hook the outputs: their gradient arriving is the unit's "pre-backward"
//   pre-backward(unit)   -> first in a backward: queue finalize() for the end of backward; gather
//                           the unit, start the gather of the unit whose forward ended before it
//   a gradient arrives   -> (AccumulateGrad's post hook) when a unit has them all it is ready;
//                           ready units are reduce-scattered in one order on every rank: the
//                           reverse of the order their forwards started
//   finalize()           -> units that ran but got no gradient for some parameter reduce with zeros
//                           there; wait for the reductions, add the averages into the gradient
//                           shards, reshard everything
#include "loom/parallel/fully_shard.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/data_parallel.h"
#include "parallel/flat_alias.h"
#include "parallel/sharded_step.h"

namespace loom {
namespace {

// Gives the storage under `flat` memory again (its content undefined until written).
void give_storage_memory(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(flat.numel()) * flat.element_size();
  if (storage->nbytes() == bytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

// Takes the memory of the storage under `flat` away; the tensors viewing it keep their shapes.
void take_storage_memory(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

// "blocks.2" from "blocks.2.attn.weight" and "blocks.2.mlp.bias": the names' common module path.
std::string common_module_path(const std::vector<std::string>& names) {
  if (names.empty()) return "";
  std::string prefix = names.front();
  for (const auto& n : names) {
    size_t k = 0;
    while (k < prefix.size() && k < n.size() && prefix[k] == n[k]) ++k;
    prefix.resize(k);
  }
  const size_t dot = prefix.rfind('.');
  return dot == std::string::npos ? "" : prefix.substr(0, dot);
}

constexpr size_t kNoUnit = static_cast<size_t>(-1);

}  // namespace

struct FullyShardedDataParallel::Impl : std::enable_shared_from_this<FullyShardedDataParallel::Impl> {
  struct Unit {
    std::string name;  // "unit 2 (blocks.2)", "the root"
    bool is_root = false;
    std::vector<at::Tensor> params;  // trainable, as the module holds them
    std::vector<int64_t> offsets;
    int64_t numel = 0;
    int64_t shard_numel = 0;
    at::Tensor full;       // size * shard_numel elements; no memory while resharded
    at::Tensor shard;      // this rank's elements: what the optimizer steps
    WorkPtr gathering;     // an all-gather into `full` nobody waited for yet
    at::Tensor gather_input;  // its input: the shard cast to param_dtype
    bool unsharded = false;  // `full` holds the parameters (once `gathering` is waited for)
    // Under no_sync, when the parameters' dtype is not the reduce dtype: the micro-batches' gradients
    // summed in the reduce dtype (as `full` is laid out), instead of in the parameters' own .grad.
    at::Tensor accumulated;
    // This backward:
    size_t gradients_pending = 0;
    bool pre_backward_done = false;
    bool gradients_ready = false;
  };
  struct Reduction {
    size_t unit;
    WorkPtr work;
    at::Tensor input;
    at::Tensor output;
    double predivided = 1;  // the input was divided by this before the sum (fp16: predivide_factor)
  };
  using AccumulatorPtr =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::autograd::Variable&>()));

  std::shared_ptr<Communicator> group;
  FullyShardOptions options;
  int rank = 0;
  int size = 1;
  int64_t divisor = 1;  // ranks averaged over: the group's, times the replicate group's
  std::vector<Unit> units;  // the named units holding trainable parameters, then the root
  std::unordered_map<const torch::nn::Module*, size_t> unit_of;  // kNoUnit: a unit without trainable ones
  std::vector<at::Tensor> frozen;
  std::vector<at::Tensor> trainable;  // the units' parameters in the root's order, and where each lies
  std::vector<ZeroOptimizer::Placement> placements;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::vector<AccumulatorPtr> accumulators;
  std::vector<uintptr_t> hook_keys;

  std::vector<size_t> forward_starts, forward_ends;  // this iteration's forwards, in order
  std::vector<size_t> last_forward_starts;           // the last iteration's, for the prefetch
  size_t forward_depth = 0;
  size_t forward_position = 0;  // forwards started since the outermost one began
  bool in_backward = false;
  bool backward_finished = false;  // since the last forward: the forward lists are complete
  bool sync = true;            // no_sync() clears it
  bool backward_syncs = true;  // this backward's: sync when it began
  std::vector<size_t> reduce_order;  // this backward's: forward_starts reversed, each unit once
  size_t next_to_reduce = 0;
  std::vector<Reduction> reductions;
  bool reduced_since_step = false;
  FullyShardStats stats;
  std::recursive_mutex mutex;  // hooks may run on autograd's device threads

  std::string where(const char* what = "FullyShardedDataParallel") const { return group->context(what).prefix(); }

  void check_clip(double max_norm) {
    abandon_failed_backward();
    if (!reduced_since_step)
      throw InvalidArgumentError(where("FullyShardedDataParallel::clip_grad_norm") +
                                 ": no backward since the last step: expected gradients to clip");
    if (!(max_norm > 0))
      throw InvalidArgumentError(where("FullyShardedDataParallel::clip_grad_norm") +
                                 ": max_norm must be positive, found " + std::to_string(max_norm));
  }

  const Unit& unit_at(size_t u, const char* what) const {
    if (u >= units.size())
      throw InvalidArgumentError(where(what) + ": expected a unit below " + std::to_string(units.size()) + ", found " +
                                 std::to_string(u));
    return units[u];
  }

  // --- gathering and resharding -------------------------------------------------------------
  void start_gather(size_t u) {
    Unit& unit = units[u];
    if (unit.unsharded) return;
    give_storage_memory(unit.full);
    at::NoGradGuard no_grad;
    if (size == 1) {
      unit.full.copy_(unit.shard);
    } else {
      // In the parameters' dtype (param_dtype): this rank's shard cast first, held until gathered.
      unit.gather_input = unit.shard.scalar_type() == unit.full.scalar_type() ? unit.shard
                                                                              : unit.shard.to(unit.full.scalar_type());
      unit.gathering = group->all_gather(unit.full, unit.gather_input);
      unit.gathering->run_in_background();
      ++stats.all_gathers;
      stats.bytes_all_gathered += unit.full.nbytes();
    }
    unit.unsharded = true;
    uint64_t held = 0;
    for (const Unit& other : units)
      if (other.unsharded) held += other.full.nbytes();
    stats.peak_unsharded_bytes = std::max(stats.peak_unsharded_bytes, held);
  }

  void gather(size_t u) {
    start_gather(u);
    if (WorkPtr work = std::move(units[u].gathering)) work->wait();
    units[u].gather_input.reset();
  }

  void reshard(size_t u) {
    Unit& unit = units[u];
    if (!unit.unsharded) return;
    if (WorkPtr work = std::move(unit.gathering)) work->wait();  // its output must stay until it is done
    unit.gather_input.reset();
    take_storage_memory(unit.full);
    unit.unsharded = false;
  }

  void reshard_all() {
    for (size_t u = 0; u < units.size(); ++u) reshard(u);
  }

  // A backward that failed (an exception inside it) leaves no finalize callback behind: autograd
  // runs none after an error. Seen from outside any backward (the next forward, zero_grad, step),
  // such a backward is abandoned: the reductions it started are waited for (each bounded by the
  // group's timeout) and dropped, with every gradient not yet in the shards; the units are freed.
  void abandon_failed_backward() {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (!in_backward || torch::autograd::get_current_graph_task_id() != -1) return;
    LOOM_LOG(warn, where() << ": the last backward did not finish (it raised): abandoning it; the gradients "
                              "it had not yet reduced into the shards are dropped");
    for (Reduction& r : reductions) {
      if (!r.work) continue;
      try {
        r.work->wait();
      } catch (const std::exception& e) {
        LOOM_LOG(warn, where() << ": a reduce-scatter of the abandoned backward failed too: " << e.what());
      }
    }
    reductions.clear();
    for (Unit& unit : units) {
      for (auto& p : unit.params) p.mutable_grad().reset();
      unit.accumulated.reset();
      unit.pre_backward_done = unit.gradients_ready = false;
    }
    reshard_all();
    backward_finished = true;
    in_backward = false;
  }

  // --- forward ------------------------------------------------------------------------------
  size_t unit_index(const torch::nn::Module& module) const {
    auto it = unit_of.find(&module);
    if (it == unit_of.end())
      throw InvalidArgumentError(where("FullyShardedDataParallel::forward") + ": expected the root or one of the " +
                                 std::to_string(unit_of.size() - 1) + " units given at construction, found another "
                                 "module (" + module.name() + ")");
    return it->second;
  }

  void enter_forward(size_t u) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (forward_depth == 0) abandon_failed_backward();
    if (forward_depth++ == 0) forward_position = 0;
    // The first forward after a backward: the finished iteration's order drives the prefetch now.
    // (Kept until here, so that a second backward through the same graph reduces as the first.)
    if (backward_finished && at::GradMode::is_enabled()) {
      last_forward_starts = std::move(forward_starts);
      forward_starts.clear();
      forward_ends.clear();
      backward_finished = false;
    }
    if (u == kNoUnit) return;
    // Positions count units with parameters only: those are what the recorded order holds.
    const size_t position = forward_position++;
    if (at::GradMode::is_enabled()) forward_starts.push_back(u);
    gather(u);
    // The next unit of the last iteration's order, when this one is where that order says.
    if (*options.prefetch && position + 1 < last_forward_starts.size() && last_forward_starts[position] == u)
      start_gather(last_forward_starts[position + 1]);
  }

  void leave_forward(size_t u, const std::vector<at::Tensor>& outputs) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    --forward_depth;
    if (u == kNoUnit) return;
    Unit& unit = units[u];
    if (options.reshard_after_forward && !unit.is_root && !in_backward) reshard(u);
    if (!at::GradMode::is_enabled()) return;
    forward_ends.push_back(u);
    std::weak_ptr<Impl> weak = weak_from_this();
    for (const auto& out : outputs)
      if (out.defined() && out.requires_grad())
        out.register_hook([weak, u](const at::Tensor& grad) {
          if (auto self = weak.lock()) self->pre_backward(u);
          return grad;
        });
  }

  // --- backward -----------------------------------------------------------------------------
  void begin_backward() {
    if (in_backward) return;
    in_backward = true;
    backward_syncs = sync;
    reduce_order.clear();
    std::unordered_set<size_t> seen;
    for (auto it = forward_starts.rbegin(); it != forward_starts.rend(); ++it)
      if (seen.insert(*it).second) reduce_order.push_back(*it);
    next_to_reduce = 0;
    for (Unit& unit : units) unit.gradients_pending = unit.params.size();
    std::weak_ptr<Impl> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) self->finalize();
    });
  }

  void pre_backward(size_t u) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    begin_backward();
    Unit& unit = units[u];
    if (unit.pre_backward_done) return;
    unit.pre_backward_done = true;
    gather(u);
    if (!*options.prefetch) return;
    // Backward reaches units in the reverse of the order their forwards ended: prefetch the next.
    auto it = std::find(forward_ends.rbegin(), forward_ends.rend(), u);
    if (it == forward_ends.rend()) return;
    for (++it; it != forward_ends.rend(); ++it)
      if (!units[*it].pre_backward_done && !units[*it].gradients_ready) {
        start_gather(*it);
        break;
      }
  }

  void on_gradient(size_t u) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    begin_backward();
    Unit& unit = units[u];
    if (unit.gradients_pending > 0 && --unit.gradients_pending == 0) unit.gradients_ready = true;
    if (backward_syncs) {
      issue_ready_reductions();
    } else if (unit.gradients_ready) {
      accumulate_in_reduce_dtype(unit);
      reshard(u);  // its gradients stay whole; its parameters are not needed again
    }
  }

  // Under no_sync, gradients computed in param_dtype would add up in it from micro-batch to
  // micro-batch (bf16 keeps 8 significant bits): they are summed in the reduce dtype instead, as
  // FSDP2 does, and reduce() starts from that sum.
  void accumulate_in_reduce_dtype(Unit& unit) {
    const at::ScalarType dtype = reduce_dtype_of(unit);
    if (unit.full.scalar_type() == dtype) return;
    at::NoGradGuard no_grad;
    if (!unit.accumulated.defined()) unit.accumulated = at::zeros({unit.full.numel()}, unit.full.options().dtype(dtype));
    for (size_t k = 0; k < unit.params.size(); ++k) {
      at::Tensor& grad = unit.params[k].mutable_grad();
      if (!grad.defined()) continue;
      unit.accumulated.narrow(0, unit.offsets[k], unit.params[k].numel()).add_(grad.reshape({-1}));
      grad.reset();
    }
  }

  void issue_ready_reductions() {
    while (next_to_reduce < reduce_order.size() && units[reduce_order[next_to_reduce]].gradients_ready)
      reduce(reduce_order[next_to_reduce++]);
  }

  // The unit's gradients into one padded flat buffer (zeros where a parameter got none), their
  // reduce-scatter started, the parameters' own gradients dropped and the unit resharded.
  void reduce(size_t u) {
    Unit& unit = units[u];
    at::NoGradGuard no_grad;
    // The micro-batches accumulated under no_sync (zeros where none came), or a fresh buffer.
    const bool accumulated = unit.accumulated.defined();
    at::Tensor flat = accumulated ? std::exchange(unit.accumulated, at::Tensor())
                                  : at::empty({unit.full.numel()}, unit.full.options().dtype(reduce_dtype_of(unit)));
    for (size_t k = 0; k < unit.params.size(); ++k) {
      at::Tensor& grad = unit.params[k].mutable_grad();
      at::Tensor slot = flat.narrow(0, unit.offsets[k], unit.params[k].numel());
      if (grad.defined() && accumulated)
        slot.add_(grad.reshape({-1}));
      else if (grad.defined())
        slot.copy_(grad.reshape({-1}));
      else if (!accumulated)
        slot.zero_();
      grad.reset();
    }
    flat.narrow(0, unit.numel, flat.numel() - unit.numel).zero_();
    Reduction r{u, nullptr, flat, flat, predivide_factor(flat.scalar_type())};
    if (r.predivided > 1) flat.div_(r.predivided);
    if (size > 1) {
      r.output = at::empty({unit.shard_numel}, flat.options());
      r.work = group->reduce_scatter(r.output, flat, {ReduceOp::Sum});
      r.work->run_in_background();
      ++stats.reduce_scatters;
      stats.bytes_reduce_scattered += flat.nbytes();
    }
    reductions.push_back(std::move(r));
    reshard(u);
  }

  void finalize() {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (!in_backward) return;
    if (backward_syncs) reduce_remaining_and_wait();
    reshard_all();
    for (Unit& unit : units) unit.pre_backward_done = unit.gradients_ready = false;
    backward_finished = true;
    in_backward = false;
  }

  // Units still waiting for a gradient reduce with zeros there; every reduction is waited for and
  // added into its gradient shard.
  void reduce_remaining_and_wait() {
    for (size_t u : reduce_order) units[u].gradients_ready = true;
    issue_ready_reductions();
    at::NoGradGuard no_grad;
    for (Reduction& r : reductions) {
      if (r.work) r.work->wait();
      if (options.replicate && options.replicate->size() > 1) {
        options.replicate->all_reduce(r.output, {ReduceOp::Sum})->wait();
        stats.bytes_all_reduced += r.output.nbytes();
      }
      if (r.predivided > 1)
        r.output.div_(static_cast<double>(divisor) / r.predivided);
      else if (divisor > 1)
        r.output.div_(divisor);
      at::Tensor& grad = units[r.unit].shard.mutable_grad();
      if (grad.defined())
        grad.add_(r.output);
      else
        grad = r.output.scalar_type() == units[r.unit].shard.scalar_type() ? r.output
                                                                           : r.output.to(units[r.unit].shard.scalar_type());
    }
    reductions.clear();
    reduced_since_step = true;
  }

  at::ScalarType reduce_dtype_of(const Unit& unit) const {
    return options.reduce_dtype.value_or(unit.shard.scalar_type());
  }

  // A sum over the ranks in fp16 overflows where the average would not (65504 at most): the
  // gradients are divided by about the square root of the ranks before the sum and by the rest
  // after, as FSDP2 does (the same factors). fp32, bf16 and fp64 sum first (fp32's exponent range).
  double predivide_factor(at::ScalarType dtype) const {
    if (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kDouble || divisor <= 1) return 1;
    int64_t pre = 1;
    while (divisor % pre == 0 && divisor / pre > pre) pre *= 2;
    return static_cast<double>(pre);
  }

  // --- construction -------------------------------------------------------------------------
  void assign_units(torch::nn::Module& root, const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  void lay_out(Unit& unit, const std::vector<std::string>& names);
  void install_hooks();
  void remove_hooks() {
    size_t k = 0;
    for (const Unit& unit : units)
      for (size_t i = 0; i < unit.params.size(); ++i, ++k) accumulators[k]->del_post_hook(hook_keys[k]);
    accumulators.clear();
    hook_keys.clear();
  }
};

// Which unit holds each trainable parameter: the named unit with the fewest parameters among those
// holding it (the innermost), else the root. Frozen parameters stay out of every unit.
void FullyShardedDataParallel::Impl::assign_units(torch::nn::Module& root,
                                                  const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::unordered_set<const void*> seen;
  for (const auto& item : root.named_parameters(/*recurse=*/true))
    if (item.value().defined() && seen.insert(item.value().unsafeGetTensorImpl()).second)
      named.emplace_back(item.key(), item.value());
  std::unordered_map<const void*, size_t> owner;  // parameter -> index into `modules`
  std::vector<size_t> by_size(modules.size());
  for (size_t m = 0; m < modules.size(); ++m) {
    if (!modules[m]) throw InvalidArgumentError(where() + ": unit " + std::to_string(m) + " is a null module");
    by_size[m] = m;
  }
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return modules[a]->parameters().size() < modules[b]->parameters().size(); });
  for (size_t m : by_size)
    for (const auto& p : modules[m]->parameters()) {
      if (!seen.count(p.unsafeGetTensorImpl()))
        throw InvalidArgumentError(where() + ": unit " + std::to_string(m) + " (" + modules[m]->name() +
                                   ") is not a submodule of the root: its parameters are not the root's");
      owner.emplace(p.unsafeGetTensorImpl(), m);
    }
  std::vector<Unit> by_module(modules.size() + 1);  // the root last
  std::vector<std::vector<std::string>> names(modules.size() + 1);
  std::vector<at::Tensor> trainable;
  std::vector<std::string> trainable_names;
  for (auto& [name, p] : named) {
    if (!p.requires_grad()) {
      frozen.push_back(p);
      continue;
    }
    auto it = owner.find(p.unsafeGetTensorImpl());
    const size_t m = it == owner.end() ? modules.size() : it->second;
    by_module[m].params.push_back(p);
    names[m].push_back(name);
    trainable.push_back(p);
    trainable_names.push_back(name);
  }
  detail::check_same_tensors_across_ranks(*group, trainable, trainable_names, "parameter", where());
  for (size_t m = 0; m <= modules.size(); ++m) {
    const bool is_root = m == modules.size();
    if (!is_root) unit_of[modules[m].get()] = kNoUnit;
    if (by_module[m].params.empty()) continue;
    Unit& unit = by_module[m];
    unit.is_root = is_root;
    const std::string path = common_module_path(names[m]);
    unit.name = is_root ? "the root" : "unit " + std::to_string(m) + (path.empty() ? "" : " (" + path + ")");
    lay_out(unit, names[m]);
    if (!is_root) unit_of[modules[m].get()] = units.size();
    units.push_back(std::move(unit));
  }
  unit_of[&root] = units.empty() || !units.back().is_root ? kNoUnit : units.size() - 1;
  std::unordered_map<const void*, ZeroOptimizer::Placement> placed;
  for (size_t u = 0; u < units.size(); ++u)
    for (size_t k = 0; k < units[u].params.size(); ++k)
      placed[units[u].params[k].unsafeGetTensorImpl()] = {u, units[u].offsets[k], units[u].params[k].numel()};
  this->trainable = trainable;
  for (const auto& p : trainable) placements.push_back(placed.at(p.unsafeGetTensorImpl()));
}

// The unit's flat buffer, its parameters re-seated in it, this rank's shard copied out.
void FullyShardedDataParallel::Impl::lay_out(Unit& unit, const std::vector<std::string>& names) {
  at::NoGradGuard no_grad;
  const at::Tensor& first = unit.params.front();
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const at::Tensor& p = unit.params[k];
    if (p.scalar_type() != first.scalar_type() || p.device() != group->device())
      throw InvalidArgumentError(where() + ": " + unit.name + " holds " + names[k] + " as " +
                                 std::string(c10::toString(p.scalar_type())) + " on " + p.device().str() +
                                 ", expected every parameter of a unit as " +
                                 std::string(c10::toString(first.scalar_type())) + " on the group's device " +
                                 group->device().str());
    unit.offsets.push_back(unit.numel);
    unit.numel += p.numel();
  }
  unit.shard_numel = (unit.numel + size - 1) / size;
  at::Tensor values = at::zeros({unit.shard_numel * size}, first.options().requires_grad(false));
  for (size_t k = 0; k < unit.params.size(); ++k)
    values.narrow(0, unit.offsets[k], unit.params[k].numel()).copy_(unit.params[k].detach().reshape({-1}));
  // The shard keeps the parameters' dtype (fp32 masters under a param_dtype); the gathered buffer,
  // and so the module's parameters, take param_dtype.
  unit.shard = values.narrow(0, rank * unit.shard_numel, unit.shard_numel).clone();
  unit.full = options.param_dtype ? values.to(*options.param_dtype) : values;
  for (size_t k = 0; k < unit.params.size(); ++k)
    unit.params[k].set_data(detail::alias_into(unit.full, unit.offsets[k], unit.params[k].sizes()));
  unit.unsharded = true;
}

void FullyShardedDataParallel::Impl::install_hooks() {
  std::weak_ptr<Impl> weak = weak_from_this();
  for (size_t u = 0; u < units.size(); ++u)
    for (const auto& p : units[u].params) {
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      hook_keys.push_back(accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, u](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (auto self = weak.lock()) self->on_gradient(u);
            return outputs;
          })));
      accumulators.push_back(std::move(accumulator));
    }
}

FullyShardedDataParallel::FullyShardedDataParallel(torch::nn::Module& root,
                                                   std::vector<std::shared_ptr<torch::nn::Module>> units,
                                                   std::shared_ptr<Communicator> group,
                                                   const OptimizerFactory& make_optimizer, FullyShardOptions options)
    : impl_(std::make_shared<Impl>()) {
  if (!group) throw InvalidArgumentError(ErrorContext("FullyShardedDataParallel")("expected a communicator, found none"));
  Impl& f = *impl_;
  f.group = std::move(group);
  f.options = options;
  f.rank = f.group->rank();
  f.size = f.group->size();
  for (const auto& [dtype, name] : {std::pair{f.options.param_dtype, "param_dtype"}, {f.options.reduce_dtype, "reduce_dtype"}})
    if (dtype && !at::isFloatingType(*dtype))
      throw InvalidArgumentError(f.where() + ": " + name + " must be a floating-point dtype, found " +
                                 std::string(c10::toString(*dtype)));
  if (!f.options.prefetch) f.options.prefetch = f.group->device().type() != c10::DeviceType::CPU;
  if (!make_optimizer) throw InvalidArgumentError(f.where() + ": expected an optimizer factory, found none");
  f.divisor = f.size * (f.options.replicate ? f.options.replicate->size() : 1);
  if (f.options.broadcast_parameters) {
    std::vector<at::Tensor> all;
    for (const auto& p : root.parameters()) all.push_back(p.detach());
    // Every rank ends with the values of the rank that is rank 0 of both groups.
    if (f.options.replicate && f.options.replicate->size() > 1)
      detail::broadcast_tensors(*f.options.replicate, all, "parameter broadcast");
    if (f.size > 1) detail::broadcast_tensors(*f.group, all, "parameter broadcast");
  }
  f.assign_units(root, units);
  if (f.units.empty()) throw InvalidArgumentError(f.where() + ": expected trainable parameters, found none");
  // The optimizer while every unit is still gathered: a refused one leaves the model whole (its
  // parameters are views of the gathered buffers, with their values).
  f.optimizer = detail::adopt_shard_optimizer(make_optimizer(shard_parameters()), shard_parameters(), f.where(),
                                              "FullyShardedDataParallel");
  at::NoGradGuard no_grad;
  // Frozen parameters compute beside the gathered ones: in param_dtype too (as FSDP2 casts them).
  if (f.options.param_dtype)
    for (auto& p : f.frozen) p.set_data(p.detach().to(*f.options.param_dtype));
  // A gradient left from before would be reduced with the first backward's.
  for (const auto& unit : f.units)
    for (auto p : unit.params) p.mutable_grad().reset();
  f.reshard_all();
  f.install_hooks();
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  try {
    impl_->reshard_all();  // waits for gathers still in flight
  } catch (...) {  // the communicator failed: nothing more to wait for
  }
  impl_->remove_hooks();
}

at::Tensor FullyShardedDataParallel::forward(const torch::nn::Module& unit, const at::Tensor& input,
                                             const UnitForward& body) {
  if (!body)
    throw InvalidArgumentError(impl_->where("FullyShardedDataParallel::forward") +
                               ": expected the unit's forward function, found an empty one");
  return forward(unit, std::vector<at::Tensor>{input},
                 [&body](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{body(in.front())}; })
      .front();
}

std::vector<at::Tensor> FullyShardedDataParallel::forward(const torch::nn::Module& unit,
                                                          const std::vector<at::Tensor>& inputs,
                                                          const UnitForwardMany& body) {
  Impl& f = *impl_;
  if (!body)
    throw InvalidArgumentError(f.where("FullyShardedDataParallel::forward") +
                               ": expected the unit's forward function, found an empty one");
  const size_t u = f.unit_index(unit);
  f.enter_forward(u);
  std::vector<at::Tensor> outputs;
  try {
    outputs = body(inputs);
  } catch (...) {
    std::lock_guard<std::recursive_mutex> lock(f.mutex);
    --f.forward_depth;
    throw;
  }
  f.leave_forward(u, outputs);
  return outputs;
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(FullyShardedDataParallel& fsdp)
    : fsdp_(&fsdp), previous_(fsdp.impl_->sync) {
  fsdp.impl_->sync = false;
}
FullyShardedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (fsdp_) fsdp_->impl_->sync = previous_;
}
FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : fsdp_(other.fsdp_), previous_(other.previous_) {
  other.fsdp_ = nullptr;
}

void FullyShardedDataParallel::zero_grad() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  impl_->abandon_failed_backward();
  for (auto& unit : impl_->units) {
    unit.shard.mutable_grad().reset();
    unit.accumulated.reset();
    for (auto& p : unit.params) p.mutable_grad().reset();
  }
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm) {
  impl_->check_clip(max_norm);
  return detail::clip_sharded_gradients(shard_gradients(), *impl_->group, max_norm);
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm, const torch::nn::Module& model,
                                                const std::shared_ptr<Communicator>& tensor_parallel) {
  Impl& f = *impl_;
  f.check_clip(max_norm);
  if (!tensor_parallel || tensor_parallel->size() == 1)
    return detail::clip_sharded_gradients(shard_gradients(), *f.group, max_norm);
  std::vector<int64_t> shard_numel;
  std::vector<at::Tensor> grads;  // one per unit (undefined where a unit has none), as the layout counts them
  for (const auto& unit : f.units) {
    shard_numel.push_back(unit.shard_numel);
    grads.push_back(unit.shard.grad());
  }
  const auto tp = detail::tensor_parallel_norm(model, *tensor_parallel, f.trainable, f.placements, shard_numel, f.rank,
                                                  f.where("FullyShardedDataParallel::clip_grad_norm"));
  return detail::clip_sharded_gradients(grads, *f.group, max_norm, &tp);
}

void FullyShardedDataParallel::step() {
  Impl& f = *impl_;
  f.abandon_failed_backward();
  if (!f.reduced_since_step)
    throw InvalidArgumentError(f.where("FullyShardedDataParallel::step") +
                               ": no backward since the last step: expected reduced gradients to step with");
  f.reshard_all();  // gathered values go stale with the step
  {
    at::NoGradGuard no_grad;
    f.optimizer->step();
  }
  f.reduced_since_step = false;
  ++f.stats.steps;
}

void FullyShardedDataParallel::unshard() {
  Impl& f = *impl_;
  std::lock_guard<std::recursive_mutex> lock(f.mutex);
  f.abandon_failed_backward();
  for (size_t u = 0; u < f.units.size(); ++u) f.start_gather(u);
  for (size_t u = 0; u < f.units.size(); ++u) f.gather(u);
}

void FullyShardedDataParallel::reshard() {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  impl_->reshard_all();
}

std::vector<at::Tensor> FullyShardedDataParallel::shard_gradients() const {
  std::vector<at::Tensor> grads;
  for (const auto& unit : impl_->units)
    if (unit.shard.grad().defined()) grads.push_back(unit.shard.grad());
  return grads;
}

std::vector<at::Tensor> FullyShardedDataParallel::shard_parameters() const {
  std::vector<at::Tensor> shards;
  for (const auto& unit : impl_->units) shards.push_back(unit.shard);
  return shards;
}

const std::vector<at::Tensor>& FullyShardedDataParallel::parameters() const { return impl_->trainable; }
const std::vector<ZeroOptimizer::Placement>& FullyShardedDataParallel::placements() const { return impl_->placements; }
int64_t FullyShardedDataParallel::shard_numel(size_t unit) const {
  return impl_->unit_at(unit, "FullyShardedDataParallel::shard_numel").shard_numel;
}

torch::optim::Optimizer& FullyShardedDataParallel::optimizer() { return *impl_->optimizer; }
Communicator& FullyShardedDataParallel::group() const { return *impl_->group; }
size_t FullyShardedDataParallel::units() const { return impl_->units.size(); }
int64_t FullyShardedDataParallel::unit_numel(size_t unit) const {
  return impl_->unit_at(unit, "FullyShardedDataParallel::unit_numel").numel;
}

size_t FullyShardedDataParallel::units_unsharded() const {
  return static_cast<size_t>(
      std::count_if(impl_->units.begin(), impl_->units.end(), [](const Impl::Unit& u) { return u.unsharded; }));
}

ZeroMemory FullyShardedDataParallel::memory() const {
  const Impl& f = *impl_;
  std::vector<at::Tensor> tensors = f.frozen;
  for (const auto& unit : f.units) {
    tensors.push_back(unit.shard);
    tensors.push_back(unit.full);  // 0 bytes while resharded
    tensors.insert(tensors.end(), unit.params.begin(), unit.params.end());
  }
  std::vector<at::Tensor> in_flight;  // gradients outside the parameters' .grad
  for (const auto& r : f.reductions) in_flight.insert(in_flight.end(), {r.input, r.output});
  for (const auto& unit : f.units)
    if (unit.accumulated.defined()) in_flight.push_back(unit.accumulated);
  return count_training_memory(tensors, in_flight, f.optimizer.get());
}

FullyShardStats FullyShardedDataParallel::stats() const { return impl_->stats; }

}  // namespace loom
