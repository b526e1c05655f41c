// State providers: the seam between the checkpoint protocol and the kinds of state it saves.
//
// A provider turns one kind of live state into named tensors and a JSON section of the manifest,
// and back. The Checkpointer knows nothing of the kinds: at save it asks every provider to
// collect; at load it asks every provider to plan (which saved tensors it needs, and what is
// wrong, decided without touching live state), reads and checksums the data, asks every provider
// to verify what it read, agrees with the other ranks, and only then asks every provider to apply.
// A provider never changes live state before apply, so a load that fails changes nothing.
//
// The built-in kinds are providers registered under these names (in this order, which is the
// order they collect in): "model", "extra", "optimizer", "zero", "scaler", "rng", "accumulation",
// "objects"; Checkpointer::model(), optimizer(), ... configure them. A user's own kind of state is
// one class and one line (docs/checkpoint.md has a data loader's position written out):
//
//   class DataPosition final : public loom::checkpoint::StateProvider {
//    public:
//     explicit DataPosition(MyLoader& loader) : loader_(loader) {}
//     void collect(int, loom::checkpoint::SaveState& out) override {
//       out.sections["data"] = "{\"epoch\": " + std::to_string(loader_.epoch()) + "}";
//     }
//     void plan(const loom::checkpoint::LoadContext& c, std::vector<loom::checkpoint::Need>&,
//               std::vector<std::string>& problems) override {
//       if (c.section("data").empty()) problems.push_back("the checkpoint holds no data position");
//     }
//     void apply(const loom::checkpoint::LoadContext& c, const loom::checkpoint::LoadedTensors&) override {
//       loader_.set_epoch(parse_epoch(c.section("data")));
//     }
//    private:
//     MyLoader& loader_;
//   };
//   ckpt.state("data", std::make_shared<DataPosition>(loader));        // this checkpointer only
//   loom::checkpoint::register_state_provider("data", factory);      // or every one built later
//
// Saved names: a provider names its tensors under a prefix of its own ("model/", "optim/",
// "master/", "rng/rank<r>/", "extra/" for the built-ins; its registered name for others) and its
// section by its name. Two tensors or two sections of one name are refused at save.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom {
class Checkpointer;
namespace detail::ckpt {
struct Manifest;
}
}  // namespace loom

namespace loom::checkpoint {

// The manifest format this build writes (docs/checkpoint-format.md); it reads versions 1 to this.
inline constexpr int kFormatVersion = 3;

// A box in a tensor's global index space.
struct Box {
  std::vector<int64_t> start, size;
  bool operator==(const Box& other) const { return start == other.start && size == other.size; }
};
// The box of a slice of `length` at `offset` along `split_dim` (the whole tensor when split_dim < 0).
Box slice_box(const std::vector<int64_t>& global_shape, int split_dim, int64_t offset, int64_t length);
// nullopt when the boxes do not overlap (an empty tensor's box overlaps nothing).
std::optional<Box> intersect(const Box& a, const Box& b);

// What the manifest records of one saved tensor (docs/checkpoint-format.md).
struct SliceRecord {
  int shard = 0;       // index into the manifest's shards
  int64_t offset = 0;  // along split_dim (0 when not split)
  int64_t length = 0;  // along split_dim (the whole tensor's size there, or 0 for a 0-dim tensor)
};
struct TensorRecord {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;       // global
  int split_dim = -1;               // -1: one slice holds the whole tensor
  std::vector<SliceRecord> slices;  // sorted by offset, tiling [0, shape[split_dim])
  // The slice's shape: the global shape with `length` along split_dim.
  std::vector<int64_t> slice_shape(const SliceRecord& slice) const;
};
// The layout the checkpoint was written at.
struct WorldLayout {
  int size = 1;
  int tensor_parallel = 1;
  int data_parallel = 1;
  std::vector<int> tp_ranks;  // each rank's tensor-parallel rank at save time
  // The parallel layout the ranks declared (loom::ParallelLayout::to_string(), e.g.
  // "dp=2,pp=2,tp=2"; Checkpointer::parallel_layout) and each rank's position in it; empty when none
  // was declared (then the layout is "dp=<data_parallel>,tp=<tensor_parallel>").
  std::string layout;
  std::vector<int> positions;
};

// One tensor (or this rank's slice of it) as it is saved.
struct LocalTensor {
  std::string name;
  at::Tensor tensor;                  // this rank's piece, any device and strides
  std::vector<int64_t> global_shape;  // == tensor's shape unless split
  int split_dim = -1;                 // -1: the whole tensor
  int64_t offset = 0;                 // along split_dim
  bool lowest_rank_writes = false;    // buffers: the lowest holder's copy is the one saved
  int64_t length() const { return split_dim >= 0 ? tensor.size(split_dim) : 0; }
  Box box() const { return slice_box(global_shape, split_dim, offset, length()); }
};

// What this rank holds, as every provider described it.
struct SaveState {
  // Collected for a load: only the live tensors and the layout matter (providers may skip work
  // whose result only a save writes, such as serialising objects).
  bool for_load = false;
  std::vector<LocalTensor> tensors;
  // The manifest's "state" sections, as JSON text by section name (a provider writes its own).
  std::map<std::string, std::string> sections;
  int tp_size = 1;  // as the model's tensor-parallel modules (or a declared layout) report it
  int tp_rank = 0;
  // The declared parallel layout (Checkpointer::parallel_layout) and this rank's position in it;
  // "" and -1 when none was declared.
  std::string layout;
  int position = -1;
  // The tensor of that name; nullptr when none.
  const LocalTensor* find(const std::string& name) const;
};

// A saved tensor (or the part of it this rank holds) a provider wants back.
struct Need {
  std::string name;  // the saved tensor's name
  const TensorRecord* record = nullptr;
  Box box;  // in global coordinates
  std::vector<int64_t> local_shape;
};

// What a provider sees of the checkpoint being loaded.
struct LoadContext {
  const detail::ckpt::Manifest& manifest;  // the whole parsed manifest (library-internal)
  const std::string& path;                 // the checkpoint's location
  const SaveState& live;                   // every provider's live state, collected as for a save
  int rank = 0;
  int size = 1;
  const std::string& where;  // message prefix naming the rank and the operation
  // What apply() replaces (an optimizer's old state) goes here, to be freed after load() returns:
  // munmap of a few hundred MB takes tens of milliseconds.
  std::vector<std::shared_ptr<void>>* garbage = nullptr;

  // The saved tensor of that name; nullptr when the checkpoint has none.
  const TensorRecord* record(const std::string& name) const;
  // The saved tensors' names that start with `prefix`, sorted ("optim/": every optimizer state tensor).
  std::vector<std::string> saved_names(const std::string& prefix) const;
  // The JSON text of a "state" section; "" when the checkpoint has none.
  std::string section(const std::string& name) const;
  const WorldLayout& saved_world() const;
  int64_t saved_step() const;
  // Saved at this world size and TP degree (and, where both the checkpoint and this job declared
  // one, the same parallel layout with every rank at its saved position): per-rank state (RNG)
  // maps rank to rank.
  bool same_layout() const;
  // The checkpoint or this job declared pipeline stages (a "pp" dimension of size 2 or more): each
  // rank holds part of the saved model, so a provider loads the part it holds and skips the rest.
  bool pipelined() const;
  // Moves `value` into the garbage (destroyed in the background), or lets it go here without one.
  template <typename T>
  void discard(T&& value) const {
    auto held = std::make_shared<std::decay_t<T>>(std::forward<T>(value));
    if (garbage) garbage->push_back(std::move(held));
  }
};

// Data read for the needs, as host tensors shaped like this rank's piece, by saved name.
using LoadedTensors = std::map<std::string, at::Tensor>;

class StateProvider {
 public:
  virtual ~StateProvider() = default;
  // Adds this rank's tensors and this provider's manifest section (nothing when it has no state).
  virtual void collect(int rank, SaveState& out) = 0;
  // Before any data is read: the saved tensors needed (appended to `needs`) and every problem
  // (appended to `problems`, without the `where` prefix), found without changing live state.
  virtual void plan(const LoadContext& context, std::vector<Need>& needs, std::vector<std::string>& problems) = 0;
  // After the data is read and checksummed: checks of its content; nothing live changes.
  virtual void verify(const LoadContext& context, const LoadedTensors& data, std::vector<std::string>& problems) {
    (void)context, (void)data, (void)problems;
  }
  // After every rank verified its part: the live state becomes the checkpoint's. Must not fail
  // for data plan and verify accepted.
  virtual void apply(const LoadContext& context, const LoadedTensors& data) = 0;
  // The manifest's text of `section` when ranks wrote it differently (each rank's text, in rank
  // order; ranks that wrote none are left out): pipeline stages each describe their own part. Runs
  // on every rank alike; a CheckpointError fails the save on every rank. By default rank 0's text.
  virtual std::string merge_section(const std::string& section, const std::vector<std::string>& texts) const {
    (void)section;
    return texts.front();
  }
};

// Builds a provider for a new Checkpointer; `owner` gives the providers registered before it
// (Checkpointer::state), as the optimizer's finds the model's.
using StateProviderFactory = std::function<std::unique_ptr<StateProvider>(Checkpointer& owner)>;
// Every Checkpointer constructed afterwards builds one provider of this name, after those
// registered before it. InvalidArgumentError for an empty or taken name.
void register_state_provider(const std::string& name, StateProviderFactory factory);
// The registered names, in registration order (the built-ins first).
std::vector<std::string> registered_state_providers();

// Shared by providers: a need for the live tensor `live` (same name in the checkpoint) when the
// record matches its global shape and dtype; otherwise a mismatch line is returned.
std::optional<std::string> need_for(const LocalTensor& live, const TensorRecord& record, std::vector<Need>& needs);
// A need for the saved tensor `saved` laid out as the live tensor `like` is (its box and local
// shape: an optimizer's state follows its parameter's slice, in a dtype of its own); the whole
// tensor when `like` is nullptr. A mismatch line when the saved global shape is not like's.
std::optional<std::string> need_like(const std::string& saved, const TensorRecord& record, const LocalTensor* like,
                                     std::vector<Need>& needs);
// A tensor as saved: whole (dim < 0), or this rank's slice of a tensor of `global_shape` along
// `dim` at `offset` (CheckpointError when it is not such a slice).
LocalTensor describe_slice(const std::string& name, const at::Tensor& tensor, int dim,
                           const std::vector<int64_t>& global_shape, int64_t offset);
// Copies `source` (host) into the live tensor, on the live tensor's device (no autograd record).
void copy_into(at::Tensor& live, const at::Tensor& source);

}  // namespace loom::checkpoint
