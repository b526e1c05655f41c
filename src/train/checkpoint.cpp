// loom::Checkpointer: the facade. Save = collect (checkpoint_state) -> agree on a plan
// (checkpoint_layout) -> stage (checkpoint_io) -> write + agree + publish (here, on the writer
// thread); load = find -> verify and read (checkpoint_io) -> agree -> apply.
//
// Agreements run over a communicator split off the user's at construction, so that the writer
// thread's collectives can never interleave with the training loop's; they are library-internal
// operations (numbered apart, named in messages).
#include "loom/train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <random>
#include <set>
#include <thread>

#include "loom/amp/grad_scaler.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/trace.h"
#include "loom/train/accumulation.h"
#include "train/checkpoint_checksum.h"
#include "train/checkpoint_files.h"
#include "train/checkpoint_hooks.h"
#include "train/checkpoint_io.h"
#include "train/checkpoint_layout.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_state.h"

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

constexpr const char* kLatest = "latest";
constexpr const char* kStepPrefix = "step_";

std::string step_name(int64_t step) {
  char name[40];
  std::snprintf(name, sizeof(name), "step_%06lld", static_cast<long long>(step));
  return name;
}

// The step of a directory named step_<digits>; nullopt for anything else.
std::optional<int64_t> parse_step_name(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return std::nullopt;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

bool is_complete(const std::string& path) {
  return path_exists(join_path(path, kManifestName));
}

// Complete checkpoints of a directory, by ascending step.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& directory) {
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& name : list_directory(directory)) {
    auto step = parse_step_name(name);
    if (step && is_complete(join_path(directory, name))) found.emplace_back(*step, name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

double seconds_between(trace::Clock::time_point a, trace::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += "\n  " + line;
  return text;
}

std::string random_nonce() {
  std::random_device device;
  const uint64_t value = (uint64_t(device()) << 32) ^ device() ^ uint64_t(::getpid());
  return to_hex(value).substr(8);
}

// Messages can carry bytes from a damaged file or the system: never let them make dump() throw
// on one rank while the others wait in the exchange.
std::string dump_text(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

at::Tensor narrow_to(at::Tensor t, const Box& box, const std::vector<int64_t>& origin) {
  for (size_t d = 0; d < box.start.size(); ++d)
    t = t.narrow(static_cast<int64_t>(d), box.start[d] - origin[d], box.size[d]);
  return t;
}

}  // namespace

struct Checkpointer::Impl {
  std::shared_ptr<Communicator> comm;  // private to the checkpointer; null in a single process
  CheckpointOptions options;
  Targets targets;
  int rank = 0;
  int size = 1;
  std::string where;
  Staging staging;
  std::thread worker;
  std::future<CheckpointInfo> result;
  CheckpointInfo last;

  // Every rank's string, in rank order (two all_gathers: the lengths, then the padded bytes).
  std::vector<std::string> exchange(const std::string& mine) {
    if (!comm) return {mine};
    AllGatherOptions o;
    o.timeout = options.timeout;
    at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
    at::Tensor lengths = at::empty({size}, at::kLong);
    comm->all_gather(lengths, length, o)->wait();
    const int64_t longest = std::max<int64_t>(1, lengths.max().item<int64_t>());
    at::Tensor buffer = at::zeros({longest}, at::kByte);
    std::memcpy(buffer.data_ptr(), mine.data(), mine.size());
    at::Tensor all = at::empty({size * longest}, at::kByte);
    comm->all_gather(all, buffer, o)->wait();
    std::vector<std::string> out;
    const char* base = static_cast<const char*>(all.data_ptr());
    for (int r = 0; r < size; ++r)
      out.emplace_back(base + r * longest, static_cast<size_t>(lengths[r].item<int64_t>()));
    return out;
  }

  // Rank 0's string on every rank.
  std::string broadcast(const std::string& from_root) {
    if (!comm) return from_root;
    BroadcastOptions o;
    o.timeout = options.timeout;
    at::Tensor length = at::full({1}, static_cast<int64_t>(from_root.size()), at::kLong);
    comm->broadcast(length, o)->wait();
    const int64_t n = length.item<int64_t>();
    at::Tensor buffer = at::zeros({std::max<int64_t>(n, 1)}, at::kByte);
    if (rank == 0) std::memcpy(buffer.data_ptr(), from_root.data(), from_root.size());
    comm->broadcast(buffer, o)->wait();
    return std::string(static_cast<const char*>(buffer.data_ptr()), static_cast<size_t>(n));
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

  // Rank 0, once every shard is written: manifest, rename into place, `latest`, rotation. Returns
  // the error message ("" on success).
  std::string publish(Manifest manifest, const std::string& tmp, const std::string& final_name,
                      const std::string& nonce);
  void install(const std::string& tmp, const std::string& final_path, const std::string& final_name,
               const std::string& nonce);
  void rotate(const std::string& keep, const std::string& nonce);
  CheckpointInfo write_and_publish(ShardWrite write, Manifest manifest, std::string tmp, std::string final_name,
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
}

Checkpointer::~Checkpointer() {
  impl_->finish_pending(/*rethrow=*/false);
}

Checkpointer& Checkpointer::model(torch::nn::Module& module) {
  impl_->targets.model = &module;
  return *this;
}
Checkpointer& Checkpointer::optimizer(torch::optim::Optimizer& optimizer) {
  impl_->targets.optimizer = &optimizer;
  return *this;
}
Checkpointer& Checkpointer::scaler(GradScaler& scaler) {
  impl_->targets.scaler = &scaler;
  return *this;
}
Checkpointer& Checkpointer::rng(RngTracker& tracker) {
  for (RngTracker* known : impl_->targets.rng) {
    if (known == &tracker) return *this;
    if (known->device().type() == tracker.device().type())
      throw InvalidArgumentError(impl_->where + ": Checkpointer::rng: a tracker for " + known->device().str() +
                                 " is registered already; a checkpoint holds one tracker per device type (found one for " +
                                 tracker.device().str() + ")");
  }
  impl_->targets.rng.push_back(&tracker);
  return *this;
}
Checkpointer& Checkpointer::accumulator(GradientAccumulator& accumulator) {
  impl_->targets.accumulator = &accumulator;
  return *this;
}
Checkpointer& Checkpointer::tensor(const std::string& name, at::Tensor tensor) {
  impl_->targets.extra.emplace_back(name, std::move(tensor));
  return *this;
}

bool Checkpointer::pending() const {
  return impl_->worker.joinable();
}

CheckpointInfo Checkpointer::wait() {
  impl_->finish_pending(/*rethrow=*/true);
  return impl_->last;
}

// ---- Save ------------------------------------------------------------------------------------------

void Checkpointer::save(const TrainingProgress& progress, const std::map<std::string, std::string>& user) {
  auto& s = *impl_;
  const auto started = trace::now();
  s.finish_pending(/*rethrow=*/true);  // a second save waits for the first
  phase("snapshot");
  const std::string final_name = step_name(progress.step);
  std::string error, nonce;
  if (s.rank == 0) {
    nonce = random_nonce();
    try {
      make_directories(s.options.directory, s.where);
      make_directories(join_path(s.options.directory, "." + final_name + ".tmp-" + nonce), s.where);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  CollectedState state;
  try {
    state = collect_state(s.targets, s.rank, s.where);
  } catch (const std::exception& e) {
    if (error.empty()) error = e.what();
  }

  // Every rank describes what it holds; every rank derives the same plan from all descriptions.
  json mine = {{"step", progress.step},
               {"error", error},
               {"nonce", nonce},
               {"tp_size", state.tp_size},
               {"tp_rank", state.tp_rank}};
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
        error = s.where + ": tensor " + t.name + " has dtype " + c10::toString(d.dtype) +
                ", which a safetensors checkpoint cannot store";
      mine["error"] = error;
      continue;
    }
    descriptors.push_back(descriptor_to_json(d));
  }
  mine["tensors"] = std::move(descriptors);
  std::vector<json> all;
  {
    detail::InternalOperations guard("checkpoint plan");
    for (const auto& text : s.exchange(dump_text(mine))) all.push_back(json::parse(text));
  }
  const std::string tmp =
      join_path(s.options.directory, "." + final_name + ".tmp-" + all[0]["nonce"].get<std::string>());
  SavePlan plan;
  try {
    std::vector<std::string> errors;
    for (int r = 0; r < s.size; ++r) {
      if (!all[r]["error"].get<std::string>().empty()) errors.push_back(all[r]["error"].get<std::string>());
      if (all[r]["step"].get<int64_t>() != progress.step)
        errors.push_back(s.where + ": ranks save different steps: rank 0 step " + std::to_string(progress.step) +
                         ", rank " + std::to_string(r) + " step " + std::to_string(all[r]["step"].get<int64_t>()));
    }
    if (!errors.empty())
      throw CheckpointError(s.where + ": step " + std::to_string(progress.step) + " not saved:" + join_lines(errors));
    std::vector<std::vector<Descriptor>> per_rank(s.size);
    for (int r = 0; r < s.size; ++r)
      for (const auto& d : all[r]["tensors"]) per_rank[r].push_back(descriptor_from_json(d));
    plan = plan_save(per_rank, s.where);
  } catch (...) {
    if (s.rank == 0) remove_tree(tmp);
    throw;
  }

  // This rank's shard: the tensors the plan gives it, in name order.
  std::vector<TensorSpec> specs;
  std::vector<at::Tensor> tensors;
  for (const auto& t : state.tensors) {
    if (!plan.writes[s.rank].count(t.name)) continue;
    specs.push_back({t.name, t.tensor.scalar_type(), t.tensor.sizes().vec()});
    tensors.push_back(t.tensor);
  }
  ShardWrite write;
  write.path = join_path(tmp, shard_file_name(s.rank, s.size));
  write.inject_failure = test_hooks().fail_write_rank == s.rank;
  try {
    write.header = build_header(specs, {{"format", "pt"},
                                        {"torchloom.step", std::to_string(progress.step)},
                                        {"torchloom.rank", std::to_string(s.rank)}});
    if (s.options.async) {
      write.regions = s.staging.stage(tensors);
      write.keep_alive.push_back(s.staging.buffer());
      if (!s.options.reuse_staging_buffer) s.staging.release();
    } else {
      write.regions = regions_in_place(tensors, write.keep_alive);
    }
  } catch (const std::exception& e) {
    // Reported in the writer's agreement, like a failed write: the other ranks are already past
    // the plan and must learn that this rank will not publish.
    write.error = s.where + ": cannot copy the state for writing: " + e.what();
  }

  Manifest manifest;
  if (s.rank == 0) {
    manifest.step = progress.step;
    int tp = 1;
    for (const auto& a : all) tp = std::max(tp, a["tp_size"].get<int>());
    manifest.world.size = s.size;
    manifest.world.tensor_parallel = s.size % tp == 0 ? tp : 1;
    manifest.world.data_parallel = s.size / manifest.world.tensor_parallel;
    for (const auto& a : all) manifest.world.tp_ranks.push_back(tp > 1 ? a["tp_rank"].get<int>() : 0);
    manifest.tensors = std::move(plan.tensors);
    json accumulation = nullptr;
    if (s.targets.accumulator)
      accumulation = {{"position", s.targets.accumulator->position()},
                      {"micro_batches", s.targets.accumulator->micro_batches()}};
    manifest.progress = {{"step", progress.step},
                         {"epoch", progress.epoch},
                         {"sample", progress.sample},
                         {"accumulation", accumulation}};
    manifest.optimizer = state.optimizer;
    manifest.scaler = state.scaler;
    manifest.user = user;
  }
  CheckpointInfo info;
  info.path = join_path(s.options.directory, final_name);
  info.progress = progress;
  info.user = user;
  const auto staged = trace::now();
  info.stall_seconds = seconds_between(started, staged);
  trace::span("checkpoint " + final_name + " snapshot", "checkpoint", started, staged, "train");

  if (!s.options.async) {
    s.last = s.write_and_publish(std::move(write), std::move(manifest), tmp, final_name,
                                 all[0]["nonce"].get<std::string>(), std::move(info), started);
    return;
  }
  std::promise<CheckpointInfo> promise;
  s.result = promise.get_future();
  s.worker =
      std::thread([&s, promise = std::move(promise), write = std::move(write), manifest = std::move(manifest), tmp,
                   final_name, nonce = all[0]["nonce"].get<std::string>(), info = std::move(info), started]() mutable {
        try {
          promise.set_value(s.write_and_publish(std::move(write), std::move(manifest), tmp, final_name, nonce,
                                                std::move(info), started));
        } catch (...) {
          promise.set_exception(std::current_exception());
        }
      });
}

CheckpointInfo Checkpointer::Impl::write_and_publish(ShardWrite write, Manifest manifest, std::string tmp,
                                                     std::string final_name, std::string nonce, CheckpointInfo info,
                                                     trace::Clock::time_point started) {
  detail::InternalOperations guard("checkpoint publish");
  const auto write_start = trace::now();
  std::string error;
  ShardWritten written;
  try {
    if (!write.error.empty()) throw CheckpointError(write.error);
    written = write_shard(write, where);
  } catch (const std::exception& e) {
    error = e.what();
  }
  write.keep_alive.clear();  // the staging buffer stays with the Staging object when reused
  const auto write_end = trace::now();
  trace::span("checkpoint " + final_name + " write", "checkpoint", write_start, write_end, "checkpoint");

  // No rank publishes alone: rank 0 learns every rank's outcome (and checksum) first.
  phase("agree");
  json mine = {{"error", error}, {"bytes", written.bytes}, {"xxh3", to_hex(written.xxh3)}};
  std::vector<std::string> all = exchange(dump_text(mine));
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
    if (errors.empty()) {
      outcome = publish(std::move(manifest), tmp, final_name, nonce);
    } else {
      outcome = "not published (the previous one is intact):" + join_lines(errors);
      remove_tree(tmp);
    }
  }
  outcome = broadcast(outcome);
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

std::string Checkpointer::Impl::publish(Manifest manifest, const std::string& tmp, const std::string& final_name,
                                        const std::string& nonce) {
  const std::string& directory = options.directory;
  const std::string final_path = join_path(directory, final_name);
  try {
    fsync_directory(tmp, where);  // the shards' directory entries
    phase("manifest");
    write_file_atomic(join_path(tmp, kManifestName), manifest_to_json(manifest), where);
    phase("rename");
    install(tmp, final_path, final_name, nonce);
  } catch (const std::exception& e) {
    remove_tree(tmp);
    return std::string("not published (the previous one is intact):\n  ") + e.what();
  }
  try {
    phase("latest");
    write_file_atomic(join_path(directory, kLatest), final_name + "\n", where);
  } catch (const std::exception& e) {
    // Complete, but `latest` still names the previous checkpoint, which a resume would pick.
    return std::string("was written, but the latest pointer still names the previous one:\n  ") + e.what();
  }
  phase("rotate");
  try {
    rotate(final_name, nonce);
  } catch (const std::exception& e) {
    LOOM_LOG(warn, "checkpoint " << final_path << " published; removing old checkpoints failed: " << e.what());
  }
  return "";
}

void Checkpointer::Impl::install(const std::string& tmp, const std::string& final_path, const std::string& final_name,
                                 const std::string& nonce) {
  const std::string& directory = options.directory;
  if (path_exists(final_path)) {
    // A checkpoint of the same step is replaced in one step where the file system can swap two
    // directories; otherwise it is moved aside first (a crash in between leaves the older steps).
    if (exchange_paths(tmp, final_path, where)) {
      fsync_directory(directory, where);
      remove_tree(tmp);
    } else {
      const std::string trash = join_path(directory, ".trash-" + final_name + "-" + nonce);
      rename_path(final_path, trash, where);
      rename_path(tmp, final_path, where);
      fsync_directory(directory, where);
      remove_tree(trash);
    }
  } else {
    rename_path(tmp, final_path, where);
  }
  fsync_directory(directory, where);
}

void Checkpointer::Impl::rotate(const std::string& keep, const std::string& nonce) {
  const std::string& directory = options.directory;
  // Leftovers of saves that crashed or were refused, and of interrupted deletions.
  for (const auto& name : list_directory(directory))
    if ((name.rfind(".step_", 0) == 0 && name.find(".tmp-") != std::string::npos) || name.rfind(".trash-", 0) == 0)
      remove_tree(join_path(directory, name));
  if (options.keep_last <= 0) return;
  auto found = complete_checkpoints(directory);
  if (found.size() <= static_cast<size_t>(options.keep_last)) return;
  for (size_t i = 0; i + options.keep_last < found.size(); ++i) {
    const std::string& name = found[i].second;
    if (name == keep) continue;  // the newest, even when older steps sort after it
    // Renamed first, so that a crash halfway through a deletion leaves no manifest-bearing remains.
    const std::string trash = join_path(directory, ".trash-" + name + "-" + nonce);
    rename_path(join_path(directory, name), trash, where);
    remove_tree(trash);
  }
  fsync_directory(directory, where);
}

// ---- Load ------------------------------------------------------------------------------------------

std::optional<std::string> Checkpointer::find_latest(const std::string& directory) {
  const std::string pointer = join_path(directory, kLatest);
  if (path_exists(pointer)) {
    try {
      std::string name = read_small_file(pointer, 4096, "latest");
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
      if (parse_step_name(name) && is_complete(join_path(directory, name))) return join_path(directory, name);
    } catch (const CheckpointError&) {
      // An unreadable pointer: fall back to scanning.
    }
  }
  auto found = complete_checkpoints(directory);
  if (found.empty()) return std::nullopt;
  return join_path(directory, found.back().second);
}

std::optional<CheckpointInfo> Checkpointer::load_latest() {
  auto& s = *impl_;
  s.finish_pending(/*rethrow=*/true);
  std::string name;
  if (s.rank == 0) {
    auto path = find_latest(s.options.directory);
    if (path) name = path->substr(path->find_last_of('/') + 1);
  }
  {
    detail::InternalOperations guard("checkpoint load");
    name = s.broadcast(name);  // every rank loads the same one, whatever changes meanwhile
  }
  if (name.empty()) return std::nullopt;
  return load(join_path(s.options.directory, name));
}

namespace {

// A piece of this rank's state to fill from the checkpoint.
struct Need {
  std::string name;
  const TensorRecord* record = nullptr;
  Box box;  // in global coordinates
  std::vector<int64_t> local_shape;
};

struct Piece {
  const Need* need;
  int shard;
  Box saved;  // the slice as stored
  Box inter;  // the part this rank needs
};

}  // namespace

CheckpointInfo Checkpointer::load(const std::string& path) {
  auto& s = *impl_;
  s.finish_pending(/*rethrow=*/true);
  const auto started = trace::now();
  std::vector<std::string> problems;
  Manifest m;
  CollectedState live;
  std::vector<Need> needs;
  std::map<std::string, at::Tensor> assembled;     // name -> host tensor shaped like this rank's piece
  std::map<std::string, std::string> rng_sources;  // local key ("cpu", "stream/x") -> saved tensor name
  uint64_t bytes_read = 0;
  TrainingProgress progress;
  int64_t accumulation_position = 0;
  try {
    const std::string manifest_path = join_path(path, kManifestName);
    const std::string manifest_text = read_small_file(manifest_path, kMaxManifestBytes, s.where);
    if (!check_manifest_integrity(manifest_text, s.where + ": manifest " + manifest_path))
      LOOM_LOG(warn, "checkpoint " << path << " has a version-1 manifest, which carries no checksum of its own: "
                                   << "its tensor-to-slice map is trusted as it stands");
    m = parse_manifest(manifest_text, s.where + ": manifest " + manifest_path);
    live = collect_state(s.targets, s.rank, s.where);

    // The model and extra tensors, against the manifest: names as a diff, then shapes and dtypes.
    std::vector<std::string> missing, unexpected, mismatched;
    std::set<std::string> live_names;
    for (const auto& t : live.tensors) {
      if (t.name.rfind("model/", 0) != 0 && t.name.rfind("extra/", 0) != 0) continue;
      live_names.insert(t.name);
      auto it = m.tensors.find(t.name);
      if (it == m.tensors.end()) {
        missing.push_back(t.name);
        continue;
      }
      const TensorRecord& r = it->second;
      if (r.shape != t.global_shape || r.dtype != t.tensor.scalar_type()) {
        mismatched.push_back(t.name + ": checkpoint " + c10::toString(r.dtype) + " " + shape_to_string(r.shape) +
                             ", live " + c10::toString(t.tensor.scalar_type()) + " " + shape_to_string(t.global_shape));
        continue;
      }
      needs.push_back(
          {t.name, &r, slice_box(t.global_shape, t.split_dim, t.offset, t.length()), t.tensor.sizes().vec()});
    }
    for (const auto& [name, r] : m.tensors)
      if (name.rfind("model/", 0) == 0 && s.targets.model && !live_names.count(name)) unexpected.push_back(name);
    if (!missing.empty() || !unexpected.empty()) {
      std::string diff;
      for (const auto& n : unexpected) diff += "\n    - " + n;
      for (const auto& n : missing) diff += "\n    + " + n;
      problems.push_back(s.where + ": tensor names differ between " + manifest_path +
                         " and the live state (- only in the checkpoint, + only live):" + diff);
    }
    if (!mismatched.empty()) problems.push_back(s.where + ": shapes or dtypes differ:" + join_lines(mismatched));

    // Optimizer state follows its parameter's live layout.
    for (const auto& p : check_optimizer(s.targets, m.optimizer)) problems.push_back(s.where + ": " + p);
    if (s.targets.optimizer && problems.empty()) {
      std::map<std::string, const LocalTensor*> params;
      for (const auto& t : live.tensors) params[t.name] = &t;
      for (const auto& [name, r] : m.tensors) {
        if (name.rfind("optim/", 0) != 0) continue;
        const std::string param = "model/" + name.substr(6, name.find_last_of('/') - 6);
        auto it = params.find(param);
        if (it == params.end()) {
          problems.push_back(s.where + ": optimizer state " + name + " belongs to no live parameter");
          continue;
        }
        const LocalTensor& p = *it->second;
        if (r.shape == p.global_shape && r.dtype == p.tensor.scalar_type())
          needs.push_back(
              {name, &r, slice_box(p.global_shape, p.split_dim, p.offset, p.length()), p.tensor.sizes().vec()});
        else if (r.split_dim < 0)
          needs.push_back({name, &r, slice_box(r.shape, -1, 0, 0), r.shape});
        else
          problems.push_back(s.where + ": optimizer state " + name + " " + shape_to_string(r.shape) +
                             " does not match its parameter " + shape_to_string(p.global_shape));
      }
    }
    for (const auto& p : check_scaler(s.targets, m.scaler)) problems.push_back(s.where + ": " + p);

    // Progress and the accumulation window.
    const json& pr = m.progress;
    for (const char* key : {"step", "epoch", "sample"})
      if (!pr.contains(key) || !pr[key].is_number_integer())
        problems.push_back(s.where + ": manifest progress has no integer \"" + key + "\"");
    if (problems.empty())
      progress = {pr["step"].get<int64_t>(), pr["epoch"].get<int64_t>(), pr["sample"].get<int64_t>()};
    if (s.targets.accumulator && pr.contains("accumulation") && pr["accumulation"].is_object()) {
      const json& a = pr["accumulation"];
      if (!a.contains("position") || !a["position"].is_number_unsigned() || !a.contains("micro_batches") ||
          !a["micro_batches"].is_number_unsigned()) {
        problems.push_back(s.where + ": manifest accumulation position is malformed");
      } else {
        accumulation_position = a["position"].get<int64_t>();
        if (accumulation_position != 0 && a["micro_batches"].get<uint64_t>() != s.targets.accumulator->micro_batches())
          problems.push_back(s.where + ": the checkpoint was taken inside an accumulation window of " +
                             std::to_string(a["micro_batches"].get<uint64_t>()) + " micro-batches (position " +
                             std::to_string(accumulation_position) + "); the live accumulator has " +
                             std::to_string(s.targets.accumulator->micro_batches()));
        else if (accumulation_position >= static_cast<int64_t>(s.targets.accumulator->micro_batches()))
          accumulation_position = 0;
      }
    }

    // RNG: the same rank's states at the same layout; otherwise rank 0's generators (identical in
    // TP-style training) and, at the same TP degree, the streams of a rank with this TP rank.
    const bool same_layout = m.world.size == s.size && m.world.tensor_parallel == live.tp_size;
    const int generator_source = same_layout ? s.rank : 0;
    int stream_source = same_layout ? s.rank : -1;
    if (!same_layout && m.world.tensor_parallel == live.tp_size)
      for (int r = 0; r < m.world.size && stream_source < 0; ++r)
        if (m.world.tp_ranks[r] == live.tp_rank) stream_source = r;
    for (const auto& t : live.tensors) {
      if (t.name.rfind(rng_prefix(s.rank), 0) != 0) continue;
      const std::string key = t.name.substr(rng_prefix(s.rank).size());
      if (key.rfind("stream", 0) == 0) continue;
      const std::string saved = rng_prefix(generator_source) + key;
      if (m.tensors.count(saved)) {
        rng_sources[key] = saved;
      } else if (key == "cuda") {
        // Saved before generators were keyed without their device number: this rank's device's.
        const std::string legacy =
            rng_prefix(generator_source) + "cuda" + std::to_string(at::detail::getCUDAHooks().current_device());
        if (m.tensors.count(legacy)) rng_sources[key] = legacy;
      }
    }
    for (RngTracker* tracker : s.targets.rng) {
      if (stream_source < 0) break;
      const std::string key_prefix = rng_stream_prefix(tracker->device().type());
      const std::string prefix = rng_prefix(stream_source) + key_prefix;
      for (const auto& [name, r] : m.tensors)
        if (name.rfind(prefix, 0) == 0) rng_sources[key_prefix + name.substr(prefix.size())] = name;
    }
    if (!s.targets.rng.empty() && stream_source < 0)
      LOOM_LOG(info, "checkpoint " << path << " was saved at TP " << m.world.tensor_parallel << ", loaded at TP "
                                   << live.tp_size << ": RNG tracker streams are not restored");
    for (const auto& [key, saved] : rng_sources) {
      const TensorRecord& r = m.tensors.at(saved);
      needs.push_back({saved, &r, slice_box(r.shape, -1, 0, 0), r.shape});
    }

    if (problems.empty()) {
      // Which saved slices feed which needs; shards this rank verifies are read whole (checksummed),
      // the others only for the entries (or rows) needed.
      std::vector<Piece> pieces;
      for (const auto& need : needs) {
        const TensorRecord& r = *need.record;
        for (const auto& slice : r.slices) {
          const Box saved = slice_box(r.shape, r.split_dim, slice.offset, slice.length);
          if (auto inter = intersect(need.box, saved)) pieces.push_back({&need, slice.shard, saved, *inter});
        }
      }
      std::map<int, std::set<std::string>> wanted_whole;
      for (int i = s.rank; i < static_cast<int>(m.shards.size()); i += s.size) wanted_whole[i];
      for (const auto& p : pieces)
        if (wanted_whole.count(p.shard)) wanted_whole[p.shard].insert(p.need->name);
      std::map<std::pair<int, std::string>, std::pair<at::Tensor, std::vector<int64_t>>> data;  // + origin
      for (const auto& [index, names] : wanted_whole) {
        for (auto& [name, t] : read_verified_shard(path, m, index, names, s.where)) {
          bytes_read += static_cast<uint64_t>(t.numel()) * t.element_size();
          const TensorRecord& r = m.tensors.at(name);
          for (const auto& slice : r.slices)
            if (slice.shard == index)
              data[{index, name}] = {t, slice_box(r.shape, r.split_dim, slice.offset, slice.length).start};
        }
      }
      std::map<int, OpenShard> open;
      for (const auto& p : pieces) {
        if (wanted_whole.count(p.shard)) continue;
        if (!open.count(p.shard)) open.emplace(p.shard, open_shard(path, m, p.shard, s.where));
        // Only the rows needed when the piece spans every other dimension of the slice.
        bool rows_only = !p.saved.start.empty();
        for (size_t d = 1; rows_only && d < p.saved.start.size(); ++d) rows_only = p.inter.size[d] == p.saved.size[d];
        std::vector<int64_t> origin = p.saved.start;
        at::Tensor t;
        if (rows_only) {
          t = read_rows(open.at(p.shard), p.need->name, p.inter.start[0] - p.saved.start[0], p.inter.size[0], s.where);
          origin[0] = p.inter.start[0];
        } else {
          t = read_rows(open.at(p.shard), p.need->name, 0, -1, s.where);
        }
        bytes_read += static_cast<uint64_t>(t.numel()) * t.element_size();
        data[{p.shard, p.need->name}] = {t, origin};
      }
      // Assemble each need from its pieces.
      std::map<std::string, std::vector<const Piece*>> by_need;
      for (const auto& p : pieces) by_need[p.need->name].push_back(&p);
      for (const auto& need : needs) {
        const auto& list = by_need[need.name];
        int64_t covered = 0, volume = 1;
        for (auto d : need.box.size) volume *= d;
        for (const Piece* p : list) {
          int64_t v = 1;
          for (auto d : p->inter.size) v *= d;
          covered += v;
        }
        if (covered != volume)
          throw CheckpointError(s.where + ": the slices of " + need.name + " in " + path + " cover " +
                                std::to_string(covered) + " of the " + std::to_string(volume) +
                                " elements needed here");
        if (list.size() == 1) {
          const auto& [t, origin] = data.at({list[0]->shard, need.name});
          if (origin == need.box.start && t.sizes().vec() == need.local_shape) {
            assembled[need.name] = t;
            continue;
          }
        }
        at::Tensor out = host_empty(need.local_shape, need.record->dtype);
        for (const Piece* p : list) {
          const auto& [t, origin] = data.at({p->shard, need.name});
          narrow_to(out, p->inter, need.box.start).copy_(narrow_to(t, p->inter, origin));
        }
        assembled[need.name] = out;
      }
      // Generator states are checked on scratch generators of the kind they restore (a CUDA
      // tracker's streams on a CUDA generator), so that a malformed one fails here.
      for (const auto& [key, saved] : rng_sources) {
        try {
          at::Generator scratch = generator_for_key(key.rfind("stream", 0) == 0 ? "cpu" : key).clone();
          for (RngTracker* tracker : s.targets.rng)
            if (key.rfind(rng_stream_prefix(tracker->device().type()), 0) == 0)
              scratch = at::globalContext().defaultGenerator(tracker->device()).clone();
          scratch.set_state(assembled.at(saved));
        } catch (const std::exception& e) {
          problems.push_back(s.where + ": RNG state " + saved + " in " + path +
                             " is not a generator state: " + e.what());
        }
      }
    }
  } catch (const std::exception& e) {
    // Any failure (also an allocation or a torch error) becomes this rank's verdict: raising it
    // here would leave the other ranks waiting in the agreement below.
    problems.push_back(e.what());
  }

  // Every rank's verdict: the model is touched only when all of them verified their part.
  std::vector<std::string> verdicts;
  {
    detail::InternalOperations guard("checkpoint load");
    verdicts = s.exchange(dump_text(json({{"problems", problems}, {"bytes", bytes_read}})));
  }
  std::vector<std::string> all_problems;
  uint64_t total = 0;
  for (const auto& v : verdicts) {
    const json j = json::parse(v);
    total += j["bytes"].get<uint64_t>();
    for (const auto& p : j["problems"])
      if (std::find(all_problems.begin(), all_problems.end(), p.get<std::string>()) == all_problems.end())
        all_problems.push_back(p.get<std::string>());
  }
  if (!all_problems.empty())
    throw CheckpointError(s.where + ": cannot load " + path + " (nothing was changed):" + join_lines(all_problems));

  // Apply.
  for (auto& t : live.tensors) {
    if (t.name.rfind("model/", 0) != 0 && t.name.rfind("extra/", 0) != 0) continue;
    copy_into(t.tensor, assembled.at(t.name));
  }
  std::map<std::string, at::Tensor> optimizer_tensors;
  for (auto& [name, t] : assembled)
    if (name.rfind("optim/", 0) == 0) optimizer_tensors[name] = t;
  apply_optimizer(s.targets, m.optimizer, optimizer_tensors);
  apply_scaler(s.targets, m.scaler);
  for (const auto& [key, saved] : rng_sources)
    if (key.rfind("stream", 0) != 0) apply_generator_state(key, assembled.at(saved));
  for (RngTracker* tracker : s.targets.rng) {
    const std::string prefix = rng_stream_prefix(tracker->device().type());
    std::map<std::string, at::Tensor> streams;
    for (const auto& [key, saved] : rng_sources)
      if (key.rfind(prefix, 0) == 0) streams[key.substr(prefix.size())] = assembled.at(saved);
    if (!streams.empty()) tracker->set_states(streams);
  }
  if (s.targets.accumulator) s.targets.accumulator->set_position(static_cast<size_t>(accumulation_position));

  CheckpointInfo info;
  info.path = path;
  info.progress = progress;
  info.user = m.user;
  info.bytes = total;
  const auto end = trace::now();
  info.seconds = seconds_between(started, end);
  trace::span("checkpoint load " + path, "checkpoint", started, end, "train");
  if (info.seconds >= s.options.log_after_seconds)
    LOOM_LOG(info, "checkpoint " << path << " loaded: " << total / 1e6 << " MB in " << info.seconds << " s ("
                                 << total / 1e6 / info.seconds << " MB/s)");
  return info;
}

}  // namespace loom
