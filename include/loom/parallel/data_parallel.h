// Data parallelism for LibTorch: bucketed gradient all-reduce that overlaps backward.
//
// GradientReducer works on a list of parameters (so C++ modules and, through the binding,
// Python modules share it). It
//   - broadcasts the parameters from rank 0 of its group and checks every rank has the same
//     parameter count, shapes and dtypes (loom::MismatchError names the first difference);
//   - groups parameters into buckets by dtype and device, in reverse registration order (the
//     order backward produces gradients), capped in size (first bucket 1 MB, then 25 MB);
//   - makes each parameter's .grad a view into its bucket, so the all-reduce needs no copies;
//   - hooks every parameter's gradient accumulator: when all gradients of a bucket are ready,
//     the bucket is all-reduced at once, while backward continues, in one order on all ranks;
//   - at the end of backward waits for every bucket (an autograd engine callback), so that
//     optimizer.step() always sees averaged gradients;
//   - after the first iteration, rebuilds the buckets in the order gradients actually became
//     ready (rank 0's order, agreed by all).
//
//   auto rt = loom::init();
//   loom::DistributedDataParallel<Net> ddp(Net(), rt->world_comm());  // a torch::nn module holder
//   torch::optim::SGD opt(ddp->parameters(), 0.1);
//   for (auto& [x, y] : my_shard) {
//     ddp.zero_grad();                                // or opt.zero_grad()
//     auto loss = torch::mse_loss(ddp(x), y);         // ddp(x), ddp.forward(x), ddp->forward(x): all checked
//     loss.backward();                                // all-reduce overlaps backward
//     opt.step();                                     // averaged gradients
//   }
//
// Gradient accumulation: inside `auto guard = ddp.no_sync();` backward only accumulates
// locally; the next backward outside it reduces the sum (see loom/train/accumulation.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"

namespace loom {

// One bucket handed to a communication hook.
struct GradBucket {
  size_t index = 0;
  at::Tensor buffer;               // flat gradients of this bucket; reduce it in place
  std::vector<size_t> parameters;  // indices into the reducer's parameter list
  Communicator* group = nullptr;
  double divisor = 1;              // the reduced sum must be divided by this
  bool last = false;               // the last bucket reduced in this iteration (torch's is_last())
};

// What a hook started: the reducer waits for `work`, then runs `finish` (e.g. cast back).
// When finish returns, bucket.buffer must hold the averaged gradients.
struct PendingReduction {
  WorkPtr work;
  std::function<void()> finish;
};
using CommHook = std::function<PendingReduction(GradBucket& bucket)>;

namespace comm_hooks {
// Average in the gradients' own dtype (the default).
CommHook all_reduce_average();
// Divide, cast to float16 / bfloat16, all-reduce, cast back: half the bytes on the wire.
// Dividing before the reduction keeps float16 from overflowing.
CommHook fp16_compress();
CommHook bf16_compress();
}  // namespace comm_hooks

struct ReducerOptions {
  size_t bucket_cap_bytes = 25u << 20;
  size_t first_bucket_cap_bytes = 1u << 20;
  // Gradients are views into the bucket storage: no copy around the all-reduce. Off: gradients
  // are copied into the bucket before and out of it after.
  bool gradient_as_bucket_view = true;
  // Parameters that get no gradient in an iteration (on some ranks or all) are handled: their
  // bucket slots count as zero, and ranks agree (one small all-reduce per iteration) which
  // parameters no rank used; those keep no gradient (undefined), as in one process.
  bool find_unused_parameters = false;
  // The set of used parameters never changes: with find_unused_parameters, agree on it in the
  // first iteration only and skip the per-iteration all-reduce afterwards.
  bool static_graph = false;
  // After the first iteration, rebuild buckets in the order gradients became ready.
  bool rebuild_buckets = true;
  // Divide the reduced sum by this; default: the group size (an average).
  std::optional<double> divisor;
  // Broadcast parameters from rank 0 of the group at construction.
  bool broadcast_parameters = true;
  // Empty: comm_hooks::all_reduce_average().
  CommHook comm_hook;
  // The parameters' names (as named_parameters() gives them), for error messages; empty: indices.
  std::vector<std::string> parameter_names;
  // Each bucket's buffer is padded with zeros to a multiple of this many elements (ZeRO pads to
  // the group size, so every rank's shard of a bucket is the same size).
  size_t bucket_alignment = 1;
  // A bucket's buffer exists only from its first gradient of a synchronised backward until its
  // reduction is finished, and parameters keep no gradient after backward (ZeRO stage 2, where the
  // hook reduces into memory of its own). Requires gradient_as_bucket_view = false.
  bool release_buckets = false;
};

struct ReducerStats {
  uint64_t iterations = 0;                // backward passes seen
  uint64_t synchronized_iterations = 0;   // of which reduced gradients (not under no_sync)
  size_t buckets = 0;
  size_t last_buckets_issued_during_backward = 0;  // handed to the communicator from a hook, before backward ended
  uint64_t buckets_reduced = 0;                     // handed to the communicator (or hook), all iterations
  uint64_t bytes_reduced = 0;                       // their sizes (before any compression hook), all iterations
  size_t last_unused_parameters = 0;                // globally unused, last iteration
  uint64_t used_set_agreements = 0;                 // all-reduces of the used-parameter flags
  bool buckets_rebuilt = false;
  // Time synchronize() spent waiting for buckets after backward, all iterations: the data-parallel
  // communication that backward did not hide (exposed). Host (MPI) buckets only: a device (NCCL)
  // bucket's wait makes the CUDA stream wait and returns at once, so its host time would read as
  // zero; such iterations are counted in unmeasured_iterations instead.
  double wait_seconds = 0;
  uint64_t unmeasured_iterations = 0;
};

class GradientReducer {
 public:
  GradientReducer(std::vector<at::Tensor> parameters, std::shared_ptr<Communicator> group,
                  ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Waits for the buckets of the current iteration and writes the averaged gradients. Called
  // automatically at the end of backward; idempotent.
  void synchronize();
  // True while buckets of this iteration are being reduced.
  bool has_pending() const;
  // Throws loom::InvalidArgumentError naming `what` when buckets are still pending.
  void require_synchronized(const std::string& what) const;

  // Drops the gradients (as optimizer.zero_grad() does): in the next backward each parameter's
  // first gradient is copied into its bucket slot and .grad becomes that slot again.
  void zero_grad();

  // While disabled, backward accumulates gradients locally and communicates nothing.
  void set_sync(bool enabled);
  bool sync_enabled() const;
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(GradientReducer& reducer);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;

   private:
    GradientReducer* reducer_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  void register_comm_hook(CommHook hook);
  const std::vector<at::Tensor>& parameters() const;
  // Parameter indices of each bucket, in issue order.
  std::vector<std::vector<size_t>> bucket_layout() const;
  // Each bucket's parameters, where each starts in the bucket's flat buffer, and the buffer's
  // element count (padding included).
  struct BucketShape {
    std::vector<size_t> parameters;
    std::vector<int64_t> offsets;
    int64_t numel = 0;
  };
  std::vector<BucketShape> bucket_shapes() const;
  // The buckets' buffers now allocated (all of them, unless release_buckets).
  std::vector<at::Tensor> bucket_buffers() const;
  ReducerStats stats() const;
  Communicator& group() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// Options of the module wrapper: the reducer's, plus buffer handling.
struct DataParallelOptions {
  ReducerOptions reducer;
  // As PyTorch's DDP: broadcast the module's buffers (e.g. batch-norm statistics) from rank 0 before
  // a forward that follows a synchronised one: with gradient accumulation, before the first
  // micro-batch of a step.
  bool broadcast_buffers = true;
};

namespace detail {
// Broadcasts tensors from rank 0 of the group in place (parameters, buffers): internal operations
// named by `purpose`.
void broadcast_tensors(Communicator& group, const std::vector<at::Tensor>& tensors, const char* purpose);
// Every rank must hold the same tensors (count, dtype and shape of each): loom::MismatchError on
// every rank naming the first difference (by name when given) and the rank that differs.
void check_same_tensors_across_ranks(Communicator& group, const std::vector<at::Tensor>& tensors,
                                     const std::vector<std::string>& names, const char* kind, const std::string& where);

// A module's parameters as the wrapper saw them at construction.
struct ModuleParameters {
  std::vector<at::Tensor> all;
  std::vector<std::string> names;
  std::vector<bool> trainable;  // requires_grad at construction
  std::vector<at::Tensor> trainable_tensors() const;
  std::vector<std::string> trainable_names() const;
};
ModuleParameters module_parameters(const torch::nn::Module& module);
// At construction: every rank holds the same parameters; the frozen ones (which the reducer does
// not see) are broadcast from rank 0, as PyTorch's DDP does.
void prepare_frozen_parameters(Communicator& group, const ModuleParameters& parameters);
// Before each forward: loom::InvalidArgumentError naming the parameter when one was added, replaced,
// frozen or unfrozen since construction (the wrapper must then be rebuilt, as in PyTorch).
void check_module_unchanged(const Communicator& group, const ModuleParameters& at_construction,
                            const torch::nn::Module& module);
// The same check on the parameters as they are now (a Python module's named_parameters()).
void check_parameters_unchanged(const Communicator& group, const ModuleParameters& at_construction,
                                const ModuleParameters& now);
// Whether grad mode is on (so the header needs no autograd include).
bool grad_enabled();
}  // namespace detail

// A module holder (e.g. a TORCH_MODULE like Net, or std::shared_ptr<MyModule>) made data
// parallel: a torch::nn::Module whose one submodule, "module", is the model (as in PyTorch's DDP),
// whose forward() is the model's after the per-step checks, and whose gradients are averaged over
// the group. Use it through its holder, DistributedDataParallel<ModuleHolder>, below.
template <typename ModuleHolder>
class DistributedDataParallelImpl : public torch::nn::Module {
 public:
  DistributedDataParallelImpl(ModuleHolder module, std::shared_ptr<Communicator> group,
                              DataParallelOptions options = {})
      : module_(register_module("module", std::move(module))),
        options_(std::move(options)),
        group_(group),
        parameters_(detail::module_parameters(*module_)) {
    if (!group_) throw InvalidArgumentError("DistributedDataParallel: expected a communicator, found none");
    detail::prepare_frozen_parameters(*group_, parameters_);
    ReducerOptions reducer_options = options_.reducer;
    reducer_options.parameter_names = parameters_.trainable_names();
    reducer_ = std::make_unique<GradientReducer>(parameters_.trainable_tensors(), std::move(group), reducer_options);
    if (options_.broadcast_buffers) detail::broadcast_tensors(*group_, module_->buffers(), "buffer broadcast");
  }

  // The model's forward, after checking that its parameters are those of construction and
  // broadcasting its buffers when the last forward was followed by a synchronised backward.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    detail::check_module_unchanged(*group_, parameters_, *module_);
    if (options_.broadcast_buffers && buffers_need_sync_)
      detail::broadcast_tensors(*group_, module_->buffers(), "buffer broadcast");
    // The next forward broadcasts when this one will be followed by a synchronised backward.
    buffers_need_sync_ = detail::grad_enabled() && reducer_->sync_enabled();
    return module_->forward(std::forward<Args>(args)...);
  }

  // The wrapped model (its own members: ddp->module()->fc1). Calling its forward directly skips
  // the checks above, as calling ddp.module in PyTorch does.
  ModuleHolder& module() { return module_; }
  GradientReducer& reducer() { return *reducer_; }
  void zero_grad(bool set_to_none = true) override { reducer_->zero_grad(); }
  [[nodiscard]] GradientReducer::NoSyncGuard no_sync() { return reducer_->no_sync(); }

 private:
  ModuleHolder module_;
  DataParallelOptions options_;
  std::shared_ptr<Communicator> group_;
  detail::ModuleParameters parameters_;
  std::unique_ptr<GradientReducer> reducer_;
  bool buffers_need_sync_ = true;  // as PyTorch's DDP, which starts with require_forward_param_sync set
};

// The holder, as TORCH_MODULE makes for a module: registrable as a submodule
// (register_module("ddp", ddp)), callable as ddp(x), and ddp->... reaches the DDP module itself,
// so ddp->forward(x) runs the checks too. The wrapper's own calls are also on the holder.
template <typename ModuleHolder>
class DistributedDataParallel : public torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleHolder>> {
  using Impl = DistributedDataParallelImpl<ModuleHolder>;
  using Holder = torch::nn::ModuleHolder<Impl>;

 public:
  DistributedDataParallel(ModuleHolder module, std::shared_ptr<Communicator> group, DataParallelOptions options = {})
      : Holder(std::make_shared<Impl>(std::move(module), std::move(group), std::move(options))) {}
  DistributedDataParallel(std::nullptr_t) : Holder(nullptr) {}  // empty, to assign later

  // ddp(x): the base holder's operator() cannot name the return type of a templated forward.
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
  ModuleHolder& module() { return this->get()->module(); }
  GradientReducer& reducer() { return this->get()->reducer(); }
  void zero_grad() { this->get()->zero_grad(); }
  [[nodiscard]] GradientReducer::NoSyncGuard no_sync() { return this->get()->no_sync(); }
};

}  // namespace loom
