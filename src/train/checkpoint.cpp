// loom::Checkpointer: the protocol. It knows when ranks agree and in which order things happen;
// what is saved comes from the state providers (checkpoint_providers.h), who writes and reads
// which bytes from the planners (checkpoint_layout.h, checkpoint_load_plan.h), and how bytes
// reach the medium and become visible from the storage (checkpoint_storage.h).
//
// Save: collect -> exchange descriptions and agree on a plan -> stage (the training stall) ->
// write, agree that every shard is written, publish (on the writer thread when asynchronous).
// Load: read and verify the manifest -> every provider plans its needs and checks its state on
// scratch objects -> read and checksum the shards, assemble -> providers verify the data ->
// agree -> only then apply.
//
// Agreements run over a communicator split off the user's at construction, so that the writer
// thread's collectives can never interleave with the training loop's; they are library-internal
// operations (numbered apart, named in messages).
#include "loom/train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <random>
#include <set>
#include <thread>

#include "loom/comm/agreement.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/trace.h"
#include "train/checkpoint_checksum.h"
#include "train/checkpoint_hooks.h"
#include "train/checkpoint_io.h"
#include "train/checkpoint_layout.h"
#include "train/checkpoint_load_plan.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_providers.h"
#include "train/checkpoint_read.h"
#include "train/checkpoint_storage.h"

namespace loom {

namespace detail::ckpt {
TestHooks& test_hooks() {
  static TestHooks hooks;
  return hooks;
}
}  // namespace detail::ckpt

using namespace detail::ckpt;
using json = nlohmann::json;

namespace {

// Why rank r's declared parallel layout cannot be recorded: it differs from rank 0's, another rank
// declared the same position, or the model's tensor-parallel modules contradict it.
std::optional<std::string> layout_disagreement(const std::vector<json>& ranks, int r) {
  const std::string first = ranks[0]["layout"].get<std::string>();
  const json& theirs = ranks[r];
  const std::string layout = theirs["layout"].get<std::string>();
  auto shown = [](const std::string& text) { return text.empty() ? std::string("none") : "\"" + text + "\""; };
  if (layout != first)
    return "ranks declare different parallel layouts: rank 0 " + shown(first) + ", rank " + std::to_string(r) + " " +
           shown(layout);
  if (layout.empty()) return std::nullopt;
  const int position = theirs["position"].get<int>();
  for (int other = 0; other < r; ++other)
    if (ranks[other]["position"].get<int>() == position)
      return "ranks " + std::to_string(other) + " and " + std::to_string(r) + " both declare position " +
             std::to_string(position) + " of " + layout;
  const ParallelLayout parsed = ParallelLayout::parse(layout);
  const int tp_size = theirs["tp_size"].get<int>(), tp_rank = theirs["tp_rank"].get<int>();
  const int expected = parsed.coordinate(position, kTensorParallelDim);
  if (tp_size > 1 && (tp_size != parsed.size(kTensorParallelDim) || tp_rank != expected))
    return "rank " + std::to_string(r) + "'s tensor-parallel state is slice " + std::to_string(tp_rank) + " of " +
           std::to_string(tp_size) + ", but its position " + std::to_string(position) + " in " + layout +
           " is tp " + std::to_string(expected) + " of " + std::to_string(parsed.size(kTensorParallelDim));
  return std::nullopt;
}

double seconds_between(trace::Clock::time_point a, trace::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string join_lines(const std::vector<std::string>& lines, const std::string& prefix = "") {
  std::string text;
  for (const auto& line : lines) text += "\n  " + prefix + line;
  return text;
}

// Pipeline stages each load the part of the model they hold (the model provider passes over the
// rest), so a model with fewer layers than the one saved, or other names, would load with every
// stage content. Together they must hold every saved model tensor. `held`: the model tensors of
// every rank that loads a part of a pipelined model (empty: none does, and there is nothing to check).
std::optional<std::string> model_tensors_no_stage_holds(const Manifest& m, const std::set<std::string>& held) {
  if (held.empty()) return std::nullopt;
  constexpr size_t kNamed = 20;
  std::vector<std::string> unheld;
  size_t count = 0;
  for (const auto& entry : m.tensors)
    if (entry.first.rfind("model/", 0) == 0 && !held.count(entry.first) && count++ < kNamed)
      unheld.push_back("- " + entry.first);
  if (count == 0) return std::nullopt;
  if (count > kNamed) unheld.push_back("(and " + std::to_string(count - kNamed) + " more)");
  return "tensors of the checkpoint that no pipeline stage holds (a model with fewer layers than the one saved, "
         "or other names; expected every saved model tensor on some stage):" + join_lines(unheld, "  ");
}

// Every rank's verdict on a load, together: the problems any rank found (each once, and the saved
// model tensors no pipeline stage holds) and the bytes all of them read.
struct LoadVerdicts {
  std::vector<std::string> problems;
  uint64_t bytes = 0;
};

LoadVerdicts combine_verdicts(const std::vector<std::string>& verdicts, const Manifest& m, const std::string& where) {
  LoadVerdicts all;
  std::set<std::string> held;  // by every stage together
  for (const auto& v : verdicts) {
    const json j = json::parse(v);
    all.bytes += j["bytes"].get<uint64_t>();
    for (const auto& p : j["problems"])
      if (std::find(all.problems.begin(), all.problems.end(), p.get<std::string>()) == all.problems.end())
        all.problems.push_back(p.get<std::string>());
    for (const auto& name : j["model_tensors"]) held.insert(name.get<std::string>());
  }
  if (auto unheld = model_tensors_no_stage_holds(m, held)) all.problems.push_back(where + ": " + *unheld);
  return all;
}

std::string random_nonce() {
  std::random_device device;
  const uint64_t value = (uint64_t(device()) << 32) ^ device() ^ uint64_t(::getpid());
  return to_hex(value).substr(8);
}

// The manifest's training progress, range-checked; what is wrong is appended to `problems`.
TrainingProgress checked_progress(const Manifest& m, std::vector<std::string>& problems) {
  const json& pr = m.progress;
  bool valid = true;
  for (const char* key : {"step", "epoch", "sample"}) {
    if (pr.contains(key) && pr[key].is_number_integer() &&
        (pr[key].is_number_unsigned() ? pr[key].get<uint64_t>() <= INT64_MAX : pr[key].get<int64_t>() >= 0))
      continue;
    valid = false;
    problems.push_back("manifest progress \"" + std::string(key) + "\" is " +
                       (pr.contains(key) ? pr[key].dump() : "missing") + "; expected an integer in [0, 2^63)");
  }
  if (!valid) return {};
  TrainingProgress progress{pr["step"].get<int64_t>(), pr["epoch"].get<int64_t>(), pr["sample"].get<int64_t>()};
  if (progress.step != m.step)
    problems.push_back("manifest progress is at step " + std::to_string(progress.step) + "; the manifest is of step " +
                       std::to_string(m.step));
  return progress;
}

// Messages can carry bytes from a damaged file or the system: never let them make dump() throw
// on one rank while the others wait in the exchange.
std::string dump_text(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

struct Checkpointer::Impl {
  std::shared_ptr<Communicator> comm;  // private to the checkpointer; null in a single process
  CheckpointOptions options;
  int rank = 0;
  int size = 1;
  std::string layout;  // the declared parallel layout ("" when none) and this rank's position
  int position = -1;
  std::map<std::string, std::string> section_owners;  // which provider (by name) wrote each section
  std::string where;
  std::unique_ptr<CheckpointStorage> storage;
  // The providers by name, in the order they collect (registered ones first, in registration
  // order: the optimizer's state follows the model's layout; then those added to this checkpointer).
  std::vector<std::pair<std::string, std::shared_ptr<StateProvider>>> named_providers;
  std::vector<StateProvider*> providers() {
    std::vector<StateProvider*> all;
    for (auto& [name, provider] : named_providers) all.push_back(provider.get());
    return all;
  }
  StateProvider* find_provider(const std::string& name) {
    for (auto& [taken, provider] : named_providers)
      if (taken == name) return provider.get();
    return nullptr;
  }
  template <typename Provider>
  Provider& built_in(const char* name) {
    return dynamic_cast<Provider&>(*find_provider(name));
  }
  Staging staging;
  std::thread worker;
  std::future<CheckpointInfo> result;
  CheckpointInfo last;
  // Frees what the last load replaced or read (released off the caller's path, joined before the
  // next load and at destruction).
  std::thread releaser;

  void release_in_background(std::vector<std::shared_ptr<void>> garbage) {
    join_releaser();
    releaser = std::thread([held = std::move(garbage)]() mutable { held.clear(); });
  }
  void join_releaser() {
    if (releaser.joinable()) releaser.join();
  }

  // Every rank's string, in rank order.
  std::vector<std::string> exchange(const std::string& mine, const char* purpose) {
    if (!comm) return {mine};
    return all_gather_strings(*comm, mine, {purpose, options.timeout});
  }

  // Rank 0's string on every rank.
  std::string broadcast(const std::string& from_root, const char* purpose) {
    if (!comm) return from_root;
    return broadcast_string(*comm, from_root, 0, {purpose, options.timeout});
  }

  // Joins the writer thread; returns its result, or rethrows its error when asked to.
  void finish_pending(bool rethrow) {
    if (!worker.joinable()) return;
    worker.join();
    try {
      last = result.get();
    } catch (const std::exception& e) {
      if (rethrow) throw;
      LOOM_LOG(error, "checkpoint save failed: " << e.what());
    }
  }

  // Every provider's state on this rank, sorted by name (names are unique).
  SaveState collect(bool for_load) {
    SaveState out;
    out.for_load = for_load;
    out.layout = layout;
    out.position = position;
    for (auto& [name, provider] : named_providers) {
      const auto before = out.sections;
      provider->collect(rank, out);
      for (const auto& [section, text] : out.sections) {
        auto earlier = before.find(section);
        if (earlier == before.end()) section_owners[section] = name;
        if (earlier != before.end() && earlier->second != text)
          throw CheckpointError(where + ": state provider \"" + name + "\" wrote section \"" + section +
                                "\", which another provider wrote already");
        if (earlier == before.end() && !json::accept(text))
          throw CheckpointError(where + ": state provider \"" + name + "\" wrote section \"" + section +
                                "\" as text that is not JSON: " + text.substr(0, 200));
      }
    }
    std::sort(out.tensors.begin(), out.tensors.end(),
              [](const LocalTensor& a, const LocalTensor& b) { return a.name < b.name; });
    for (size_t i = 1; i < out.tensors.size(); ++i)
      if (out.tensors[i].name == out.tensors[i - 1].name)
        throw CheckpointError(where + ": two tensors are both named " + out.tensors[i].name);
    return out;
  }

  // The steps of a save, in order (Checkpointer::save runs them).
  // Every rank describes what it holds (and any error met so far); every rank derives the same
  // plan from all descriptions, or throws (the staging directory abandoned) when any rank failed.
  struct AgreedPlan {
    std::vector<json> ranks;  // every rank's description, in rank order
    std::map<std::string, std::string> sections;  // the manifest's, merged over the ranks
    SavePlan plan;
    std::string nonce, staging;  // rank 0's, naming the staging directory
  };
  AgreedPlan agree_on_plan(int64_t step, const SaveState& state, std::string error, const std::string& nonce,
                           const std::string& final_name);
  // Every section any rank wrote: its text where all writers agree, else its provider's merge of
  // them (the same on every rank: the inputs are every rank's descriptions).
  std::map<std::string, std::string> merge_sections(const std::vector<json>& ranks, std::vector<std::string>& errors);
  // This rank's shard: the tensors the plan gives it, in name order, copied into the staging buffer
  // when asynchronous (the training stall) or written from the tensors themselves.
  ShardWrite prepare_shard(const SaveState& state, const SavePlan& plan, int64_t step);
  // Rank 0's manifest, around the plan's tensor records (its shard records are added once every
  // shard is written).
  Manifest manifest_for(const AgreedPlan& agreed, std::map<std::string, TensorRecord> tensors, const SaveState& state,
                        const TrainingProgress& progress, const std::map<std::string, std::string>& user);
  CheckpointInfo write_and_publish(ShardWrite write, Manifest manifest, std::string staging, std::string final_name,
                                   std::string nonce, CheckpointInfo info, trace::Clock::time_point started);
};

Checkpointer::Checkpointer(std::shared_ptr<Communicator> world, CheckpointOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.options = std::move(options);
  s.where = ErrorContext("Checkpointer").prefix();
  if (s.options.directory.empty()) throw InvalidArgumentError(s.where + ": CheckpointOptions::directory is empty");
  if (s.options.keep_last < 0)
    throw InvalidArgumentError(s.where + ": keep_last must be >= 0; found " + std::to_string(s.options.keep_last));
  if (world) {
    if (world->device_type() != c10::DeviceType::CPU)
      throw InvalidArgumentError(s.where +
                                 ": expected a host (CPU) communicator such as rt->world_comm(); found one for " +
                                 world->device().str());
    detail::InternalOperations guard("checkpoint setup");
    s.comm = world->split(0, world->rank(), "checkpoint");
    s.rank = s.comm->rank();
    s.size = s.comm->size();
  }
  s.storage = checkpoint::open_storage(s.options.directory, s.options.keep_last, s.where);
  if (s.size > 1 && !s.storage->shared_between_processes())
    throw InvalidArgumentError(s.where + ": the checkpoint storage of \"" + s.options.directory +
                               "\" is this process's own, but the checkpointer spans " + std::to_string(s.size) +
                               " processes, which could not read each other's shards; expected a shared storage "
                               "(a path on a shared file system)");
  for (auto& [name, factory] : checkpoint::registered_state_provider_factories()) {
    std::unique_ptr<StateProvider> provider = factory(*this);
    if (!provider)
      throw InvalidArgumentError(s.where + ": the factory of state provider \"" + name + "\" returned none");
    s.named_providers.emplace_back(name, std::move(provider));
  }
}

Checkpointer& Checkpointer::state(const std::string& name, std::shared_ptr<checkpoint::StateProvider> provider) {
  auto& s = *impl_;
  if (name.empty() || !provider)
    throw InvalidArgumentError(s.where + ": Checkpointer::state: expected a name and a provider; found name \"" +
                               name + "\"" + (provider ? "" : " and no provider"));
  if (s.find_provider(name) != nullptr)
    throw InvalidArgumentError(s.where + ": Checkpointer::state: a state provider named \"" + name +
                               "\" exists already");
  s.named_providers.emplace_back(name, std::move(provider));
  return *this;
}

checkpoint::StateProvider& Checkpointer::provider(const std::string& name) {
  auto& s = *impl_;
  if (StateProvider* found = s.find_provider(name)) return *found;
  std::string names;
  for (const auto& [taken, _] : s.named_providers) names += (names.empty() ? "" : ", ") + taken;
  throw InvalidArgumentError(s.where + ": Checkpointer::provider: no state provider is named \"" + name +
                             "\"; this checkpointer has " + names);
}

std::string Checkpointer::where() const { return impl_->where; }

Checkpointer::~Checkpointer() {
  impl_->finish_pending(/*rethrow=*/false);
  impl_->join_releaser();
}

Checkpointer& Checkpointer::model(torch::nn::Module& module) {
  impl_->built_in<ModelState>("model").set(&module);
  return *this;
}
Checkpointer& Checkpointer::optimizer(torch::optim::Optimizer& optimizer) {
  impl_->built_in<OptimizerState>("optimizer").set(&optimizer);
  impl_->built_in<ZeroOptimizerState>("zero").set(static_cast<ZeroOptimizer*>(nullptr));
  return *this;
}
Checkpointer& Checkpointer::optimizer(ZeroOptimizer& zero) {
  impl_->built_in<ZeroOptimizerState>("zero").set(&zero);
  impl_->built_in<OptimizerState>("optimizer").set(nullptr);
  return *this;
}
Checkpointer& Checkpointer::optimizer(FullyShardedDataParallel& fsdp) {
  impl_->built_in<ZeroOptimizerState>("zero").set(&fsdp);
  impl_->built_in<OptimizerState>("optimizer").set(nullptr);
  return *this;
}
Checkpointer& Checkpointer::scaler(GradScaler& scaler) {
  impl_->built_in<ScalerState>("scaler").set(&scaler);
  return *this;
}
Checkpointer& Checkpointer::rng(RngTracker& tracker) {
  impl_->built_in<RngState>("rng").add(tracker, impl_->where);
  return *this;
}
Checkpointer& Checkpointer::accumulator(GradientAccumulator& accumulator) {
  impl_->built_in<AccumulationState>("accumulation").set(&accumulator);
  return *this;
}
Checkpointer& Checkpointer::tensor(const std::string& name, at::Tensor tensor) {
  impl_->built_in<ExtraTensors>("extra").add(name, std::move(tensor), std::nullopt, impl_->where);
  return *this;
}
Checkpointer& Checkpointer::tensor(const std::string& name, at::Tensor tensor, const Slice& slice) {
  impl_->built_in<ExtraTensors>("extra").add(name, std::move(tensor), ExtraTensors::Slice{slice.global_shape, slice.dim, slice.offset, slice.tensor_parallel},
                    impl_->where);
  return *this;
}
bool Checkpointer::remove_tensor(const std::string& name) { return impl_->built_in<ExtraTensors>("extra").remove(name); }
Checkpointer& Checkpointer::tensor_parallel(int size, int rank) {
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidArgumentError(impl_->where + ": Checkpointer::tensor_parallel: expected 0 <= rank < size; found rank " +
                               std::to_string(rank) + " of " + std::to_string(size));
  impl_->built_in<ExtraTensors>("extra").declare_tensor_parallel(size, rank);
  return *this;
}
Checkpointer& Checkpointer::parallel_layout(const ParallelLayout& layout, int position) {
  if (layout.world_size() != impl_->size || position < 0 || position >= impl_->size)
    throw InvalidArgumentError(impl_->where + ": Checkpointer::parallel_layout: expected a layout of the " +
                               std::to_string(impl_->size) + " ranks and a position in it; found " +
                               layout.to_string() + " (" + std::to_string(layout.world_size()) +
                               " ranks) and position " + std::to_string(position));
  impl_->layout = layout.to_string();
  impl_->position = position;
  return *this;
}
Checkpointer& Checkpointer::object(const std::string& name, ObjectState state) {
  if (name.empty() || !state.save || !state.load)
    throw InvalidArgumentError(impl_->where + ": Checkpointer::object: expected a name and save and load functions");
  impl_->built_in<UserObjects>("objects").add(name, {std::move(state.save), std::move(state.check), std::move(state.load)});
  return *this;
}

bool Checkpointer::pending() const {
  return impl_->worker.joinable();
}

CheckpointInfo Checkpointer::wait() {
  impl_->join_releaser();
  impl_->finish_pending(/*rethrow=*/true);
  return impl_->last;
}

// ---- Save ------------------------------------------------------------------------------------------

void Checkpointer::save(const TrainingProgress& progress, const std::map<std::string, std::string>& user) {
  auto& s = *impl_;
  const auto started = trace::now();
  s.finish_pending(/*rethrow=*/true);  // a second save waits for the first
  phase("snapshot");
  std::string error, nonce;
  // Reported through the agreement below, so that no rank waits alone for one that gave up.
  if (progress.step < 0 || progress.step > kMaxStep)
    error = s.where + ": step " + std::to_string(progress.step) + " cannot name a checkpoint (expected 0 to " +
            std::to_string(kMaxStep) + ")";
  const std::string final_name = step_name(std::clamp<int64_t>(progress.step, 0, kMaxStep));
  if (s.rank == 0 && error.empty()) {
    nonce = random_nonce();
    try {
      s.storage->create_staging(s.storage->staging_location(final_name, nonce));
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  SaveState state;
  try {
    state = s.collect(/*for_load=*/false);
  } catch (const CheckpointError& e) {
    if (error.empty()) error = std::string(e.what()).rfind(s.where, 0) == 0 ? e.what() : s.where + ": " + e.what();
  } catch (const std::exception& e) {
    if (error.empty()) error = s.where + ": " + e.what();
  }

  Impl::AgreedPlan agreed = s.agree_on_plan(progress.step, state, error, nonce, final_name);
  ShardWrite write = s.prepare_shard(state, agreed.plan, progress.step);
  Manifest manifest;
  if (s.rank == 0) manifest = s.manifest_for(agreed, std::move(agreed.plan.tensors), state, progress, user);
  CheckpointInfo info;
  info.path = s.storage->location(final_name);
  info.progress = progress;
  info.user = user;
  const auto staged = trace::now();
  info.stall_seconds = seconds_between(started, staged);
  trace::span("checkpoint " + final_name + " snapshot", "checkpoint", started, staged, "train");

  if (!s.options.async) {
    s.last = s.write_and_publish(std::move(write), std::move(manifest), agreed.staging, final_name, agreed.nonce,
                                 std::move(info), started);
    return;
  }
  std::promise<CheckpointInfo> promise;
  s.result = promise.get_future();
  s.worker = std::thread([&s, promise = std::move(promise), write = std::move(write), manifest = std::move(manifest),
                          staging = agreed.staging, final_name, nonce = agreed.nonce, info = std::move(info),
                          started]() mutable {
    try {
      promise.set_value(s.write_and_publish(std::move(write), std::move(manifest), staging, final_name, nonce,
                                            std::move(info), started));
    } catch (...) {
      promise.set_exception(std::current_exception());
    }
  });
}

Checkpointer::Impl::AgreedPlan Checkpointer::Impl::agree_on_plan(int64_t step, const SaveState& state,
                                                                 std::string error, const std::string& nonce,
                                                                 const std::string& final_name) {
  json mine = {{"step", step},        {"nonce", nonce},          {"tp_size", state.tp_size},
               {"tp_rank", state.tp_rank}, {"layout", state.layout}, {"position", state.position}};
  json descriptors = json::array();
  for (const auto& t : state.tensors) {
    Descriptor d;
    d.name = t.name;
    d.dtype = t.tensor.scalar_type();
    d.global_shape = t.global_shape;
    d.split_dim = t.split_dim;
    d.offset = t.offset;
    d.length = t.length();
    d.lowest_rank_writes = t.lowest_rank_writes;
    d.bytes = static_cast<uint64_t>(t.tensor.numel()) * t.tensor.element_size();
    if (!safetensors_dtype(d.dtype)) {
      if (error.empty())
        error = where + ": tensor " + t.name + " has dtype " + c10::toString(d.dtype) +
                ", which a safetensors checkpoint cannot store";
      continue;
    }
    descriptors.push_back(descriptor_to_json(d));
  }
  mine["error"] = error;
  mine["tensors"] = std::move(descriptors);
  mine["sections"] = state.sections;
  mine["section_owners"] = section_owners;
  AgreedPlan agreed;
  for (const auto& text : exchange(dump_text(mine), "checkpoint plan")) agreed.ranks.push_back(json::parse(text));
  agreed.nonce = agreed.ranks[0]["nonce"].get<std::string>();
  agreed.staging = storage->staging_location(final_name, agreed.nonce);
  try {
    std::vector<std::string> errors;
    for (int r = 0; r < size; ++r) {
      const json& theirs = agreed.ranks[r];
      if (!theirs["error"].get<std::string>().empty()) errors.push_back(theirs["error"].get<std::string>());
      if (theirs["step"].get<int64_t>() != step)
        errors.push_back(where + ": ranks save different steps: rank 0 step " + std::to_string(step) + ", rank " +
                         std::to_string(r) + " step " + std::to_string(theirs["step"].get<int64_t>()));
      if (auto wrong = layout_disagreement(agreed.ranks, r)) errors.push_back(where + ": " + *wrong);
    }
    if (errors.empty()) agreed.sections = merge_sections(agreed.ranks, errors);
    if (!errors.empty())
      throw CheckpointError(where + ": step " + std::to_string(step) + " not saved:" + join_lines(errors));
    std::vector<std::vector<Descriptor>> per_rank(size);
    for (int r = 0; r < size; ++r)
      for (const auto& d : agreed.ranks[r]["tensors"]) per_rank[r].push_back(descriptor_from_json(d));
    agreed.plan = plan_save(per_rank, where);
  } catch (...) {
    if (rank == 0 && !agreed.nonce.empty()) storage->abandon(agreed.staging);
    throw;
  }
  return agreed;
}

std::map<std::string, std::string> Checkpointer::Impl::merge_sections(const std::vector<json>& ranks,
                                                                     std::vector<std::string>& errors) {
  std::map<std::string, std::vector<std::string>> texts;
  std::map<std::string, std::string> owners;  // from the first rank that wrote it: the same everywhere
  for (const auto& theirs : ranks) {
    for (const auto& [name, text] : theirs["sections"].items()) texts[name].push_back(text.get<std::string>());
    for (const auto& [name, owner] : theirs["section_owners"].items()) owners.emplace(name, owner.get<std::string>());
  }
  std::map<std::string, std::string> merged;
  for (auto& [name, written] : texts) {
    const bool agree = std::all_of(written.begin(), written.end(), [&](const std::string& t) { return t == written[0]; });
    StateProvider* owner = owners.count(name) ? find_provider(owners[name]) : nullptr;
    if (agree || owner == nullptr) {
      merged[name] = written[0];
      continue;
    }
    try {
      merged[name] = owner->merge_section(name, written);
      if (!json::accept(merged[name])) errors.push_back(where + ": the merged section \"" + name + "\" is not JSON");
    } catch (const std::exception& e) {
      errors.push_back(where + ": section \"" + name + "\" cannot be merged over the ranks: " + e.what());
    }
  }
  return merged;
}

ShardWrite Checkpointer::Impl::prepare_shard(const SaveState& state, const SavePlan& plan, int64_t step) {
  std::vector<TensorSpec> specs;
  std::vector<at::Tensor> tensors;
  json offsets = json::object();  // where this shard's split slices start, for the load's cross-check
  for (const auto& t : state.tensors) {
    if (!plan.writes[rank].count(t.name)) continue;
    specs.push_back({t.name, t.tensor.scalar_type(), t.tensor.sizes().vec()});
    tensors.push_back(t.tensor);
    if (t.split_dim >= 0) offsets[t.name] = t.offset;
  }
  ShardWrite write;
  write.inject_failure = test_hooks().fail_write_rank == rank;
  try {
    write.header = build_header(specs, {{"format", "pt"},
                                        {kShardStepKey, std::to_string(step)},
                                        {kShardSlicesKey, dump_text(offsets)},
                                        {"torchloom.rank", std::to_string(rank)}});
    if (options.async) {
      write.regions = staging.stage(tensors);
      write.keep_alive.push_back(staging.buffer());
      if (!options.reuse_staging_buffer) staging.release();
    } else {
      write.regions = regions_in_place(tensors, write.keep_alive);
    }
  } catch (const std::exception& e) {
    // Reported in the writer's agreement, like a failed write: the other ranks are already past
    // the plan and must learn that this rank will not publish.
    write.error = where + ": cannot copy the state for writing: " + e.what();
  }
  return write;
}

Manifest Checkpointer::Impl::manifest_for(const AgreedPlan& agreed, std::map<std::string, TensorRecord> tensors,
                                          const SaveState& state, const TrainingProgress& progress,
                                          const std::map<std::string, std::string>& user) {
  Manifest manifest;
  manifest.step = progress.step;
  int tp = 1;
  for (const auto& theirs : agreed.ranks) tp = std::max(tp, theirs["tp_size"].get<int>());
  manifest.world.size = size;
  const std::string declared = agreed.ranks[0]["layout"].get<std::string>();
  if (!declared.empty()) {  // agreed by every rank, and its TP size the modules' (layout_disagreement)
    const ParallelLayout layout = ParallelLayout::parse(declared);
    manifest.world.layout = declared;
    manifest.world.tensor_parallel = layout.size(kTensorParallelDim);
    manifest.world.data_parallel = layout.size(kDataParallelDim);
    for (const auto& theirs : agreed.ranks) {
      manifest.world.positions.push_back(theirs["position"].get<int>());
      manifest.world.tp_ranks.push_back(layout.coordinate(manifest.world.positions.back(), kTensorParallelDim));
    }
  } else {
    manifest.world.tensor_parallel = size % tp == 0 ? tp : 1;
    manifest.world.data_parallel = size / manifest.world.tensor_parallel;
    for (const auto& theirs : agreed.ranks)
      manifest.world.tp_ranks.push_back(manifest.world.tensor_parallel > 1 ? theirs["tp_rank"].get<int>() : 0);
  }
  manifest.tensors = std::move(tensors);
  manifest.progress = {{"step", progress.step}, {"epoch", progress.epoch}, {"sample", progress.sample}};
  for (const auto& [name, text] : agreed.sections) {
    manifest.state[name] = json::parse(text);  // checked when collected (merged ones when merged)
  }
  manifest.user = user;
  return manifest;
}

CheckpointInfo Checkpointer::Impl::write_and_publish(ShardWrite write, Manifest manifest, std::string staging,
                                                     std::string final_name, std::string nonce, CheckpointInfo info,
                                                     trace::Clock::time_point started) {
  const auto write_start = trace::now();
  std::string error;
  ShardWritten written;
  try {
    if (!write.error.empty()) throw CheckpointError(write.error);
    const std::string file = shard_file_name(rank, size);
    write.path = staging + "/" + file;
    written = detail::ckpt::write_shard(*storage->create(staging, file), write, where);
  } catch (const std::exception& e) {
    error = e.what();
  }
  write.keep_alive.clear();  // the staging buffer stays with the Staging object when reused
  const auto write_end = trace::now();
  trace::span("checkpoint " + final_name + " write", "checkpoint", write_start, write_end, "checkpoint");

  // No rank publishes alone: rank 0 learns every rank's outcome (and checksum) first.
  phase("agree");
  json mine = {{"error", error}, {"bytes", written.bytes}, {"xxh3", to_hex(written.xxh3)}};
  std::vector<std::string> all = exchange(dump_text(mine), "checkpoint publish");
  std::vector<std::string> errors;
  uint64_t total = 0;
  for (int r = 0; r < size; ++r) {
    const json j = json::parse(all[r]);
    if (!j["error"].get<std::string>().empty()) errors.push_back(j["error"].get<std::string>());
    total += j["bytes"].get<uint64_t>();
    if (rank == 0)
      manifest.shards.push_back(
          {shard_file_name(r, size), r, j["bytes"].get<uint64_t>(), *parse_hex(j["xxh3"].get<std::string>())});
  }
  // Rank 0's outcome; every rank raises it under its own prefix.
  std::string outcome;
  if (rank == 0) {
    const std::string text = manifest_to_json(manifest);
    // Never publish what every load would refuse (a user's ShardedModule whose slices are not in
    // TP-rank order contradicts the world's TP ranks, say): the manifest's own parser judges it.
    const uint64_t max_bytes = test_hooks().max_manifest_bytes > 0 ? test_hooks().max_manifest_bytes : kMaxManifestBytes;
    if (errors.empty() && text.size() > max_bytes)  // a load reads no larger manifest
      errors.push_back(where + ": the manifest to publish has " + std::to_string(text.size()) +
                       " bytes; a manifest has at most " + std::to_string(max_bytes) +
                       " (the state sections are too large: keep large state in tensors)");
    if (errors.empty()) {
      try {
        parse_manifest(text, where + ": the manifest to publish");
      } catch (const CheckpointError& e) {
        errors.push_back(e.what());
      }
    }
    if (errors.empty()) {
      outcome = storage->publish(staging, final_name, text, nonce);
    } else {
      outcome = "not published (the previous one is intact):" + join_lines(errors);
      storage->abandon(staging);
    }
  }
  outcome = broadcast(outcome, "checkpoint publish");
  const auto end = trace::now();
  trace::span("checkpoint " + final_name + " publish", "checkpoint", write_end, end, "checkpoint");
  phase("done");
  if (!outcome.empty()) throw CheckpointError(where + ": checkpoint " + info.path + " " + outcome);
  info.bytes = total;
  info.seconds = seconds_between(started, end);
  if (info.seconds >= options.log_after_seconds)
    LOOM_LOG(info, "checkpoint " << info.path << " saved: " << total / 1e6 << " MB in " << info.seconds << " s ("
                                 << total / 1e6 / info.seconds << " MB/s; training stalled " << info.stall_seconds
                                 << " s)");
  return info;
}

// ---- Load ------------------------------------------------------------------------------------------

std::optional<std::string> Checkpointer::find_latest(const std::string& directory) {
  return checkpoint::open_storage(directory, /*keep_last=*/0, ErrorContext("Checkpointer::find_latest").prefix())
      ->find_latest();
}

std::optional<std::string> Checkpointer::latest() {
  auto& s = *impl_;
  s.finish_pending(/*rethrow=*/true);
  std::string name;
  if (s.rank == 0) {
    auto path = s.storage->find_latest();
    if (path) name = path->substr(path->find_last_of('/') + 1);
  }
  name = s.broadcast(name, "checkpoint load");  // every rank loads the same one, whatever changes meanwhile
  if (name.empty()) return std::nullopt;
  return s.storage->location(name);
}

std::optional<CheckpointInfo> Checkpointer::load_latest() {
  auto path = latest();
  if (!path) return std::nullopt;
  return load(*path);
}

CheckpointInfo Checkpointer::load(const std::string& path) {
  auto& s = *impl_;
  s.finish_pending(/*rethrow=*/true);
  s.join_releaser();  // the previous load's garbage: gone before this one reads more
  const auto started = trace::now();
  std::vector<std::string> problems;
  std::vector<std::shared_ptr<void>> garbage;
  Manifest m;
  SaveState live;
  LoadedTensors loaded;
  uint64_t bytes_read = 0;
  TrainingProgress progress;
  json held_here = json::array();  // this rank's model tensors, when pipeline stages hold parts of it
  const std::string manifest_path = path + "/" + kManifestName;
  const LoadContext context{m, path, live, s.rank, s.size, s.where, &garbage};
  try {
    const std::string manifest_text = read_manifest_text(*s.storage, path, s.where);
    if (!check_manifest_integrity(manifest_text, s.where + ": manifest " + manifest_path))
      LOOM_LOG(warn, "checkpoint " << path << " has a version-1 manifest, which carries no checksum of its own: "
                                   << "its tensor-to-slice map is trusted as it stands");
    m = parse_manifest(manifest_text, s.where + ": manifest " + manifest_path);
    live = s.collect(/*for_load=*/true);
    if (context.pipelined())
      for (const auto& t : live.tensors)
        if (t.name.rfind("model/", 0) == 0) held_here.push_back(t.name);

    progress = checked_progress(m, problems);

    // Every provider says what it needs and what is wrong; nothing live changes.
    std::vector<Need> needs;
    for (StateProvider* provider : s.providers()) provider->plan(context, needs, problems);
    if (problems.empty()) {
      const LoadPlan plan = plan_load(m, needs, s.rank, s.size);
      if (!plan.uncovered.empty())
        throw CheckpointError(s.where + ": the saved slices in " + path + " do not cover what this rank needs:" +
                              join_lines(plan.uncovered));
      loaded = read_planned(*s.storage, path, m, needs, plan, bytes_read, s.where);
      for (StateProvider* provider : s.providers()) provider->verify(context, loaded, problems);
    }
  } catch (const std::exception& e) {
    // Any failure (also an allocation or a torch error) becomes this rank's verdict: raising it
    // here would leave the other ranks waiting in the agreement below.
    problems.push_back(std::string(e.what()).rfind(s.where, 0) == 0 ? std::string(e.what())
                                                                     : s.where + ": " + e.what());
  }
  for (auto& p : problems)
    if (p.rfind(s.where, 0) != 0) p = s.where + ": " + p;

  // Every rank's verdict: nothing is touched unless all of them verified their part.
  const LoadVerdicts all = combine_verdicts(
      s.exchange(dump_text(json({{"problems", problems}, {"bytes", bytes_read}, {"model_tensors", held_here}})),
                 "checkpoint load"),
      m, s.where);
  if (!all.problems.empty())
    throw CheckpointError(s.where + ": cannot load " + path + " (nothing was changed):" + join_lines(all.problems));

  for (StateProvider* provider : s.providers()) provider->apply(context, loaded);
  context.discard(std::move(loaded));  // the data read: copied into the model, or adopted
  s.release_in_background(std::move(garbage));

  CheckpointInfo info;
  info.path = path;
  info.progress = progress;
  info.user = m.user;
  info.bytes = all.bytes;
  const auto end = trace::now();
  info.seconds = seconds_between(started, end);
  trace::span("checkpoint load " + path, "checkpoint", started, end, "train");
  if (info.seconds >= s.options.log_after_seconds)
    LOOM_LOG(info, "checkpoint " << path << " loaded: " << all.bytes / 1e6 << " MB in " << info.seconds << " s ("
                                 << all.bytes / 1e6 / info.seconds << " MB/s)");
  return info;
}

}  // namespace loom
