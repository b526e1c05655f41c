// Checkpoints of a training job: sharded, atomic, verified, reshardable, written in the background.
//
// A checkpoint is a directory `step_000120/` of safetensors shard files (one per rank, readable
// by Python's `safetensors`) and a JSON manifest: the world layout, every logical tensor's global
// shape, dtype and which shard holds which slice, an XXH3-64 checksum per shard, and the
// non-tensor state (docs/checkpoint-format.md). What is saved: the model's parameters and buffers
// (tensor-parallel ones as slices, replicated ones once, the writes spread over the ranks), the
// optimizer's state and parameter groups (SGD, Adam, AdamW, RMSprop, Adagrad), the GradScaler's
// state, the RNG states (CPU, the current CUDA device's, RngTracker streams), step/epoch/sample,
// the GradientAccumulator's position, extra tensors (whole or sliced), objects with JSON state and
// user key-values.
//
//   auto rt = loom::init();
//   loom::Checkpointer ckpt(rt->world_comm(), {.directory = "ckpt", .keep_last = 3});
//   ckpt.model(ddp).optimizer(opt).scaler(scaler).rng(loom::rng_tracker()).accumulator(accumulate);
//   int64_t start = 0;
//   if (auto resumed = ckpt.load_latest()) start = resumed->progress.step;   // nullopt: start fresh
//   for (int64_t step = start + 1; step <= steps; ++step) {
//     ...train...
//     if (step % 100 == 0) ckpt.save({.step = step});   // copies the state, writes in the background
//   }
//   ckpt.wait();                                        // throws the save's error on every rank
//
// Guarantees:
// - Atomic: shards go to a hidden temporary directory and are fsync'ed; only when every rank has
//   written its shard (agreed: no rank publishes alone) does rank 0 write the manifest (temporary
//   file, fsync, rename), rename the directory into place, fsync the parent and replace the
//   `latest` pointer (write, fsync, rename). A crash at any moment leaves the previous checkpoint
//   intact; a directory without a manifest is not a checkpoint. keep_last rotation deletes old
//   checkpoints only after the new one is published, never the newest.
// - Asynchronous: save() copies the state to host memory (CUDA tensors through a small pinned
//   ring; the buffer is kept for the next save) and returns; a background thread writes and publishes, agreeing over
//   the checkpointer's own communicator, so the training loop's collectives are never interleaved
//   with it. A second save() waits for the first; wait() returns or throws its error on every
//   rank.
// - Verified, and no code run: load() checks the manifest's own checksum, parses it, checks every
//   shard's size, header (bounded and validated before anything is allocated from it) and
//   checksum, checks every value on scratch objects (scaler, optimizer hyper-parameters, RNG
//   states, the accumulation position), and agrees on the result across ranks before it touches
//   anything: a load that fails changes nothing. Failures are loom::CheckpointError naming the
//   file and tensor; names or shapes that differ from the model are listed as a diff.
// - Reshardable: a checkpoint written at one TP x DP layout loads at another (slices are cut and
//   joined along the split dimension); tensor-parallel modules describe their slices through
//   loom::tp::ShardedModule.
//
// Ranks share the checkpoint directory (a shared file system across nodes). The constructor is a
// collective over the communicator (it splits a private one off it).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/layout.h"
#include "loom/train/checkpoint_state.h"

namespace torch::optim {
class Optimizer;
}

namespace loom {

class GradScaler;
class RngTracker;
class GradientAccumulator;
class ZeroOptimizer;
class FullyShardedDataParallel;

struct CheckpointOptions {
  // Holds step_<N>/ directories and the `latest` pointer; created when missing.
  std::string directory;
  // Complete checkpoints kept after each save (0: keep all). The newest is never deleted.
  int keep_last = 3;
  // Write in a background thread; false: save() returns once the checkpoint is published.
  bool async = true;
  // Keep the host copy of the state between asynchronous saves, so that the training stall is a
  // memory copy, not an allocation (costs host memory of the size of this rank's share).
  bool reuse_staging_buffer = true;
  // Timeout of the agreements between ranks (the slowest rank's write is inside one of them);
  // default: the communicator's (LOOM_TIMEOUT).
  Timeout timeout = kDefaultTimeout;
  // Saves and loads that take longer than this log their throughput (LOOM_LOG_LEVEL=info).
  double log_after_seconds = 3.0;
};

// Where training stands; saved with the checkpoint and returned by load.
struct TrainingProgress {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t sample = 0;  // position in the epoch's sample order (samples consumed)
};

struct CheckpointInfo {
  std::string path;  // the checkpoint directory
  TrainingProgress progress;
  std::map<std::string, std::string> user;
  uint64_t bytes = 0;        // shard bytes written or read, all ranks together
  double seconds = 0;        // save: from save() to publication; load: the whole load
  double stall_seconds = 0;  // save: how long save() held the training loop
};

class Checkpointer {
 public:
  // `world`: a host (CPU, MPI) communicator over every rank of the job, e.g. rt->world_comm();
  // nullptr for a single process without MPI. Collective over `world`.
  Checkpointer(std::shared_ptr<Communicator> world, CheckpointOptions options);
  // Waits for a pending save; its error is logged, not thrown (call wait() to see it).
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // What is saved and loaded (each optional; the objects must outlive the checkpointer). Every rank
  // registers the same kinds of state.
  Checkpointer& model(torch::nn::Module& module);
  template <typename Contained>
  Checkpointer& model(torch::nn::ModuleHolder<Contained>& module) {
    return model(static_cast<torch::nn::Module&>(*module));
  }
  template <typename ModuleHolder>
  Checkpointer& model(DistributedDataParallel<ModuleHolder>& ddp) {
    return model(static_cast<torch::nn::Module&>(*ddp.module()));
  }
  // SGD, Adam, AdamW, RMSprop or Adagrad (other optimizers are a CheckpointError at save).
  Checkpointer& optimizer(torch::optim::Optimizer& optimizer);
  // A ZeRO optimizer (loom/parallel/zero.h) instead: its sharded state is saved in the plain
  // optimizer's format (each DP rank writing about 1/N of it), so the checkpoint loads at any
  // data-parallel size, with or without ZeRO, and a plain checkpoint loads into ZeRO. Saving
  // all-gathers the state over the ZeRO group one bucket and key at a time.
  Checkpointer& optimizer(ZeroOptimizer& zero);
  // A fully sharded model (loom/parallel/fully_shard.h): its parameters (kept as shards) and its
  // optimizer's state, in the same plain format, each rank writing the parameters whose first
  // element lies in its shards (gathered one unit at a time, copied to host memory). Register the
  // model too (its buffers and frozen parameters, and the names everything is saved by):
  //   ckpt.model(*model).optimizer(fsdp);
  // The checkpoint loads at another size, into DDP or ZeRO, and theirs load into it.
  Checkpointer& optimizer(FullyShardedDataParallel& fsdp);
  Checkpointer& scaler(GradScaler& scaler);
  // The tracker's streams (call once per tracker: one per device type, e.g. the CPU tracker and
  // loom::rng_tracker(cuda_device)); the default CPU generator and, where a GPU is visible, the
  // current CUDA device's are always saved and restored (keyed without the device number, so a
  // rank resumed on another GPU number continues its own stream).
  Checkpointer& rng(RngTracker& tracker);
  Checkpointer& accumulator(GradientAccumulator& accumulator);
  // A tensor saved once (replicated; e.g. an EMA of the weights) and restored in place. Registering
  // a name again replaces the earlier tensor (state that is reallocated between saves).
  Checkpointer& tensor(const std::string& name, at::Tensor tensor);
  // This rank's slice of a tensor split along one dimension (e.g. a tensor-parallel weight that
  // no loom::tp::ShardedModule describes): saved once per distinct slice, and resharded at load
  // to whatever slice the loading rank registers.
  struct Slice {
    std::vector<int64_t> global_shape;
    int dim = -1;        // the split dimension
    int64_t offset = 0;  // where this rank's slice starts along `dim`
    // A tensor-parallel slice: split tensor_parallel() ways, slice i (by offset) is TP rank i's.
    // A load then refuses a checkpoint whose recorded TP ranks (which pick each rank's RNG streams
    // at another layout) contradict the slices its shards hold, as it does for ShardedModules'.
    bool tensor_parallel = false;
  };
  Checkpointer& tensor(const std::string& name, at::Tensor tensor, const Slice& slice);
  // Forgets a tensor registered with tensor() (state that no longer exists); false when none is.
  bool remove_tensor(const std::string& name);
  // The tensor-parallel layout of state registered as slices (the manifest records it; per-rank
  // RNG streams follow it when the layout changes). Modules implementing loom::tp::ShardedModule
  // declare it themselves.
  Checkpointer& tensor_parallel(int size, int rank);
  // The parallel layout of the job and this rank's position in it (every rank declares the same
  // layout): the manifest records both, so a load at the same layout maps each rank's per-rank state
  // to the rank at its position, and tools can say which stage wrote what.
  //   ckpt.parallel_layout(ps.layout(), ps.groups().position);
  Checkpointer& parallel_layout(const ParallelLayout& layout, int position);
  // An object whose state is JSON text (an LR scheduler, a data loader's position), saved under
  // the manifest's "objects" by name. `check` must throw for any state `load` would refuse,
  // without changing the object: it runs before anything live changes, `load` only after every
  // rank verified the whole checkpoint.
  struct ObjectState {
    std::function<std::string()> save;
    std::function<void(const std::string&)> check;
    std::function<void(const std::string&)> load;
  };
  Checkpointer& object(const std::string& name, ObjectState state);
  // A kind of state of the user's own (loom/train/checkpoint_state.h), for this checkpointer only:
  // collected, planned, verified and applied after the registered providers, its section saved
  // under the manifest's "state". InvalidArgumentError for a name taken already.
  Checkpointer& state(const std::string& name, std::shared_ptr<checkpoint::StateProvider> provider);
  // The provider of that name (a registered or an added one); InvalidArgumentError when there is
  // none, or (the typed form) when it is of another type.
  checkpoint::StateProvider& provider(const std::string& name);
  template <typename Provider>
  Provider& provider(const std::string& name) {
    if (auto* typed = dynamic_cast<Provider*>(&provider(name))) return *typed;
    throw InvalidArgumentError(where() + ": Checkpointer::provider: state provider \"" + name +
                               "\" is not of the type asked for");
  }

  // Saves the registered state as step_<progress.step>/ (replacing one of the same step). With
  // async, returns after the host copy; throws a previous asynchronous save's error first.
  void save(const TrainingProgress& progress, const std::map<std::string, std::string>& user = {});
  // Waits for the pending save (if any) and returns what it published; throws its
  // loom::CheckpointError (on every rank). Without a pending save, returns the last one's info.
  // Also waits until the memory the last load replaced is freed (see load()).
  CheckpointInfo wait();
  bool pending() const;

  // Loads the newest complete checkpoint of the directory (the one `latest` names, else the
  // highest step with a manifest); nullopt when there is none. Waits for a pending save first.
  std::optional<CheckpointInfo> load_latest();
  // Loads the checkpoint in `path` (a step_<N> directory). Returns once the state is in place;
  // the memory it replaced (the optimizer's old state, the data read) is freed on a thread of its
  // own meanwhile (unmapping 300 MB takes ~25 ms), before the next load and by wait().
  CheckpointInfo load(const std::string& path);
  // Collective: the newest complete checkpoint as rank 0 finds it, the same path on every rank
  // (whatever a concurrent save publishes meanwhile); nullopt when there is none.
  std::optional<std::string> latest();

  // The newest complete checkpoint under `directory`, as a path; nullopt when there is none.
  // Reads the directory only (no communication, no verification).
  static std::optional<std::string> find_latest(const std::string& directory);

  struct Impl;

 private:
  std::string where() const;  // the prefix of this checkpointer's messages
  std::unique_ptr<Impl> impl_;
};

// Take a checkpoint anywhere: its full tensors, slices joined, as one safetensors file (what
// `python -m torchloom.checkpoint consolidate DIR OUT.safetensors` calls). One process, no
// communication; the manifest's and every shard's checksum are verified first. Names are the saved
// names without their "model/" or "extra/" prefix (optimizer state, when asked for, keeps
// "optim/<param>/<key>", and ZeRO's fp32 master weights "master/<param>"); RNG states are left out. `out` is written beside itself, fsync'ed and
// renamed into place. loom::CheckpointError for a damaged checkpoint or colliding names.
struct ConsolidateOptions {
  bool optimizer = false;  // include the optimizer's state tensors (and fp32 master weights)
};
struct ConsolidateInfo {
  size_t tensors = 0;
  uint64_t bytes = 0;  // of tensor data written
};
ConsolidateInfo consolidate_checkpoint(const std::string& checkpoint, const std::string& out,
                                       const ConsolidateOptions& options = {});

}  // namespace loom
