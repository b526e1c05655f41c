// Checkpoints across ranks (CTest runs this at 1, 2 and 4 ranks): bitwise round trips of every
// saved piece of a TP x DP job (model slices, AdamW state, grad scaler, RNG generator and tracker
// streams, accumulation position, progress, user values), replicated tensors written once and the
// writes spread over the ranks, hostile training-state values refused alike on every rank changing
// nothing, asynchronous saves that capture the state at save(), a write error
// on one rank raised by wait() on every rank, and loads at other TP x DP layouts (TP 2 -> 1,
// 1 -> 4, 4 -> 2, any DP) checked against one process's master weights, optimizer state and output.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "../hostile_json.h"
#include "loom/amp/grad_scaler.h"
#include "loom/comm/agreement.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/runtime.h"
#include "loom/train/accumulation.h"
#include "loom/train/checkpoint.h"
#include "rank_report.h"
#include "test_util.h"
#include "train/checkpoint_files.h"
#include "train/checkpoint_hooks.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_storage.h"
#include "train/safetensors.h"

using namespace loom;
namespace fs = std::filesystem;
namespace ckpt = loom::detail::ckpt;

namespace {

std::map<int, std::unique_ptr<ParallelState>>& states() {
  static std::map<int, std::unique_ptr<ParallelState>> cache;
  return cache;
}

// Built once per degree, in the same order on every rank (a collective).
const ParallelState& state(int tp) {
  auto& cache = states();
  if (!cache.count(tp)) cache[tp] = std::make_unique<ParallelState>(test::world(), tp);
  return *cache.at(tp);
}

using test::cleanup;
using test::shared_dir;

constexpr int64_t kVocab = 16, kHidden = 16, kHeads = 4, kFfn = 32, kSeq = 6;

struct TinyGptImpl : torch::nn::Module {
  TinyGptImpl(TensorParallelGroup group, RngTracker* rng) : group(group) {
    // Master initialisation: the same function at every TP degree (resharding compares across them).
    ParallelInit master;
    master.mode = ParallelInit::Mode::Master;
    VocabParallelEmbeddingOptions tok_options;
    tok_options.initialization = master;
    tok = register_module("tok", VocabParallelEmbedding(kVocab, kHidden, group, tok_options));
    ParallelTransformerBlockOptions b;
    b.initialization = master;
    b.ffn_hidden_size = kFfn;
    b.attention_dropout = 0.1;
    b.hidden_dropout = 0.1;
    b.rng = rng;
    block = register_module("block", ParallelTransformerBlock(kHidden, kHeads, group, b));
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    ColumnParallelLinearOptions head_options;
    head_options.bias = false;
    head_options.initialization = master;
    head = register_module("head", ColumnParallelLinear(kHidden, kVocab, group, head_options));
  }
  at::Tensor forward(const at::Tensor& ids) { return head(lnf(block(tok(ids)))); }
  // The whole logits on every rank of the TP group.
  at::Tensor full_logits(const at::Tensor& ids) { return tp::gather_from_region(forward(ids), group); }
  TensorParallelGroup group;
  VocabParallelEmbedding tok{nullptr};
  ParallelTransformerBlock block{nullptr};
  torch::nn::LayerNorm lnf{nullptr};
  ColumnParallelLinear head{nullptr};
};
TORCH_MODULE(TinyGpt);

at::Tensor tokens(int64_t batch, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return at::randint(kVocab, {kSeq + 1, batch}, gen);
}

// Shard metadata of every parameter, by full name.
std::map<std::string, tp::ShardInfo> shard_infos(TinyGpt& model) {
  std::map<std::string, tp::ShardInfo> out;
  for (const auto& item : model->named_modules())
    if (auto* sharded = dynamic_cast<tp::ShardedModule*>(item.value().get()))
      for (const auto& [name, info] : sharded->shard_info())
        out[item.key().empty() ? name : item.key() + "." + name] = info;
  return out;
}

// A TP x DP training job: model, reducer, accumulation, AdamW, grad scaler, RNG tracker.
struct Job {
  const ParallelState& ps;
  RngTracker tracker;
  TinyGpt model{nullptr};
  std::unique_ptr<GradientReducer> reducer;
  std::unique_ptr<GradientAccumulator> accumulate;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<GradScaler> scaler;
  at::Tensor counter = at::zeros({3}, at::kLong);

  Job(const ParallelState& ps, uint64_t seed, double init_scale = 1024.0) : ps(ps) {
    ps.seed(seed, tracker);
    model = TinyGpt(ps.tp_group(), &tracker);
    reducer = std::make_unique<GradientReducer>(model->parameters(), ps.dp_group());
    accumulate = std::make_unique<GradientAccumulator>(*reducer, 2);
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(0.01));
    GradScalerOptions so;
    so.init_scale = init_scale;
    so.growth_interval = 2;
    so.sync_groups = {ps.tp_group()};
    scaler = std::make_unique<GradScaler>(so);
  }

  void train(int steps, int first_step = 0) {
    const int64_t per_replica = 4;
    for (int s = first_step; s < first_step + steps; ++s) {
      at::Tensor batch = tokens(per_replica * ps.dp_degree(), s).narrow(1, ps.dp_rank() * per_replica, per_replica);
      reducer->zero_grad();
      for (const auto& micro : batch.chunk(2, 1)) {
        auto scope = accumulate->next();
        at::Tensor loss =
            vocab_parallel_cross_entropy(model(micro.narrow(0, 0, kSeq)), micro.narrow(0, 1, kSeq), ps.tp_group()) /
            2.0;
        scaler->scale(loss).backward();
      }
      scaler->step(*opt);
      scaler->update();
      counter += 1;
    }
  }

  void attach(Checkpointer& c) {
    c.model(model).optimizer(*opt).scaler(*scaler).rng(tracker).accumulator(*accumulate).tensor("counter", counter);
  }
};

// Every piece of local state, for bitwise comparison.
std::map<std::string, at::Tensor> snapshot(Job& job) {
  std::map<std::string, at::Tensor> s;
  for (const auto& p : job.model->named_parameters()) {
    s["p/" + p.key()] = p.value().detach().clone();
    auto it = job.opt->state().find(p.value().unsafeGetTensorImpl());
    if (it == job.opt->state().end()) continue;
    auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
    s["o/" + p.key() + "/exp_avg"] = st.exp_avg().clone();
    s["o/" + p.key() + "/exp_avg_sq"] = st.exp_avg_sq().clone();
    s["o/" + p.key() + "/step"] = at::tensor({st.step()});
  }
  for (size_t g = 0; g < job.opt->param_groups().size(); ++g) {  // every hyper-parameter of every group
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(job.opt->param_groups()[g].options());
    const std::vector<double> values = {o.lr(),  std::get<0>(o.betas()), std::get<1>(o.betas()),
                                        o.eps(), o.weight_decay(),        double(o.amsgrad())};
    s["options/" + std::to_string(g)] = at::tensor(values, at::kDouble);
  }
  for (const auto& [k, v] : job.scaler->state_dict()) s["scaler/" + k] = at::tensor({v});
  s["rng/cpu"] = at::detail::getDefaultCPUGenerator().get_state();
  for (const auto& [k, v] : job.tracker.get_states()) s["rng/" + k] = v;
  s["accumulate"] = at::tensor({static_cast<int64_t>(job.accumulate->position())});
  s["counter"] = job.counter.clone();
  return s;
}

void expect_same(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_TRUE(v.sizes() == b.at(k).sizes() && v.dtype() == b.at(k).dtype() && at::equal(v, b.at(k))) << k;
  }
}

// Bit for bit (at::equal says a NaN differs from itself; a forged hyper-parameter that loaded can
// make the next training step produce NaNs).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.dtype() != b.dtype()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

int default_tp() {
  return test::world()->size() % 2 == 0 ? 2 : 1;
}

TEST(CheckpointDist, RoundTripIsBitwiseAndReplicatedTensorsAreWrittenOnce) {
  auto world = test::world();
  const std::string dir = shared_dir("roundtrip");
  const auto& ps = state(default_tp());
  Job a(ps, 11);
  a.train(3);
  { auto half = a.accumulate->next(); }  // saved inside an accumulation window: position 1
  Checkpointer ca(world, {.directory = dir});
  a.attach(ca);
  const auto before = snapshot(a);
  ca.save({.step = 3, .epoch = 2, .sample = 96}, {{"run", "roundtrip"}});
  const auto info = ca.wait();
  EXPECT_EQ(info.path, dir + "/step_000003");

  Job b(ps, 99, 64.0);  // other weights, scale, streams; optimizer state of its own
  b.train(1, 50);
  Checkpointer cb(world, {.directory = dir});
  b.attach(cb);
  auto loaded = cb.load_latest();
  ASSERT_TRUE(loaded);
  EXPECT_EQ(loaded->progress.step, 3);
  EXPECT_EQ(loaded->progress.epoch, 2);
  EXPECT_EQ(loaded->progress.sample, 96);
  EXPECT_EQ(loaded->user.at("run"), "roundtrip");
  expect_same(before, snapshot(b));

  // The manifest's layout, and each distinct slice stored exactly once across the shard files.
  const auto m =
      ckpt::parse_manifest(ckpt::read_small_file(dir + "/step_000003/manifest.json", 1 << 24, "test"), "manifest");
  EXPECT_EQ(m.world.size, world->size());
  EXPECT_EQ(m.world.tensor_parallel, ps.tp_degree());
  EXPECT_EQ(m.world.data_parallel, ps.dp_degree());
  ASSERT_EQ(m.shards.size(), static_cast<size_t>(world->size()));
  std::map<std::string, int> stored;
  std::set<int> writers_of_model_state;
  for (size_t i = 0; i < m.shards.size(); ++i) {
    const std::string path = dir + "/step_000003/" + m.shards[i].file;
    auto file = ckpt::open_file(path, "test");
    auto header = ckpt::read_header(*file, file->size(), path, nullptr);
    for (const auto& t : header.tensors) {
      ++stored[t.name];
      if (t.name.rfind("model/", 0) == 0 || t.name.rfind("optim/", 0) == 0)
        writers_of_model_state.insert(static_cast<int>(i));
    }
  }
  for (const auto& [name, record] : m.tensors) {
    EXPECT_EQ(stored[name], static_cast<int>(record.slices.size())) << name;
    const bool split = name.find("tok.weight") != std::string::npos || name.find("head.weight") != std::string::npos ||
                       name.find("qkv.") != std::string::npos || name.find("fc1.") != std::string::npos ||
                       (name.find("proj.weight") != std::string::npos) ||
                       (name.find("fc2.weight") != std::string::npos);
    if (name.rfind("model/", 0) == 0)
      EXPECT_EQ(record.slices.size(), static_cast<size_t>(split ? ps.tp_degree() : 1)) << name;
  }
  EXPECT_EQ(m.tensors.at("model/block.proj.weight").split_dim, 1);
  EXPECT_EQ(m.tensors.at("model/block.proj.bias").split_dim, -1);
  EXPECT_EQ(m.tensors.at("model/block.ln1_weight").slices.size(), 1u);
  EXPECT_EQ(writers_of_model_state.size(), static_cast<size_t>(std::min(world->size(), 4)))
      << "the writes are spread over every rank";
  cleanup(dir);
}

// A fresh job at `ps` (weights and state of its own, one step trained) loads the newest checkpoint
// in `dir`, which must be refused on every rank leaving the job exactly as it was. Returns the
// refusal's message. Collective.
std::string refused_load(const ParallelState& ps, const std::string& dir, uint64_t seed) {
  Job b(ps, seed);
  b.train(1);
  Checkpointer cb(test::world(), {.directory = dir});
  b.attach(cb);
  const auto before = snapshot(b);
  std::string message;
  try {
    cb.load_latest();
    ADD_FAILURE() << "the load of " << dir << " was not refused";
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("nothing was changed"), std::string::npos) << message;
  expect_same(before, snapshot(b));
  return message;
}

// A storage each process holds for itself (mem://) cannot serve a checkpointer over several: every
// rank refuses it at construction, naming both, instead of publishing shards no other rank can read.
TEST(CheckpointDist, AProcessLocalStorageIsRefusedAcrossProcesses) {
  auto world = test::world();
  if (world->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  try {
    Checkpointer c(world, {.directory = "mem://dist"});
    ADD_FAILURE() << "a memory storage was accepted across " << world->size() << " processes";
  } catch (const loom::InvalidArgumentError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("\"mem://dist\" is this process's own"), std::string::npos) << message;
    EXPECT_NE(message.find("spans " + std::to_string(world->size()) + " processes"), std::string::npos) << message;
  }
}

// The reproduction, resealed: the slices of a TP-split tensor swapped between two shards in
// a manifest whose own checksum was recomputed; then the same for every split tensor, with the
// world's TP ranks flipped to match, so that the manifest agrees with itself. The first contradicts
// the world's TP ranks; the second, the slices each shard records of itself. Both are refused, and
// every rank's state stays as it was.
TEST(CheckpointDist, ShardsRecordTheirSlicesSoASwappedManifestIsRefused) {
  auto world = test::world();
  if (default_tp() < 2) GTEST_SKIP() << "needs TP 2";
  const std::string dir = shared_dir("swapped_slices");
  const auto& ps = state(2);
  Job a(ps, 21);
  a.train(2);
  Checkpointer ca(world, {.directory = dir, .async = false});
  a.attach(ca);
  ca.save({.step = 2});
  test::SharedFile manifest_file(*world, dir + "/step_000002/manifest.json");
  for (bool whole_manifest : {false, true}) {
    auto manifest = nlohmann::ordered_json::parse(manifest_file.original());
    for (auto& [name, record] : manifest["tensors"].items()) {
      if (!(name == "model/head.weight" || (whole_manifest && record["slices"].size() == 2))) continue;
      auto& slices = record["slices"];
      EXPECT_EQ(slices.size(), 2u) << name;
      if (slices.size() == 2) std::swap(slices[0]["shard"], slices[1]["shard"]);
    }
    if (whole_manifest)
      for (auto& tp_rank : manifest["world"]["tp_ranks"]) tp_rank = 1 - tp_rank.get<int>();
    manifest_file.rewrite(ckpt::reseal_manifest(manifest.dump(1)));
    const std::string message = refused_load(ps, dir, 77);
    EXPECT_NE(message.find(whole_manifest ? "holds the slice at offset"
                                          : "of 2 of \"model/head.weight\" (tensor-parallel rank"),
              std::string::npos)
        << message;
  }
  cleanup(dir);
}

// The world's TP ranks, which a load at another layout follows to give each rank the RNG streams of
// its TP rank, swapped between two ranks and resealed: refused by the slices their shards hold,
// at the same layout and at another, changing nothing.
TEST(CheckpointDist, TensorParallelRanksThatContradictTheShardsAreRefused) {
  auto world = test::world();
  if (default_tp() < 2) GTEST_SKIP() << "needs TP 2";
  const std::string dir = shared_dir("swapped_tp_ranks");
  Job a(state(2), 23);
  a.train(2);
  Checkpointer ca(world, {.directory = dir, .async = false});
  a.attach(ca);
  ca.save({.step = 2});
  {
    test::SharedFile manifest_file(*world, dir + "/step_000002/manifest.json");
    auto manifest = nlohmann::ordered_json::parse(manifest_file.original());
    auto& tp_ranks = manifest["world"]["tp_ranks"];
    EXPECT_EQ(tp_ranks[0], 0);
    EXPECT_EQ(tp_ranks[1], 1);
    std::swap(tp_ranks[0], tp_ranks[1]);
    manifest_file.rewrite(ckpt::reseal_manifest(manifest.dump(1)));
  }
  for (int tp : {2, 1}) {
    const std::string message = refused_load(state(tp), dir, 78);
    // (Which rank's shard is named first depends on how the save spread the writes.)
    EXPECT_NE(message.find("\"tp_ranks\" makes rank "), std::string::npos) << "TP " << tp << ": " << message;
    EXPECT_NE(message.find(", but its shard holds slice "), std::string::npos) << "TP " << tp << ": " << message;
  }
  cleanup(dir);
}

// A user's tensor-parallel module whose slices are not in TP-rank order (TP rank 0 holds the upper
// half of the weight): the manifest it would publish contradicts the world's TP ranks, which every
// load refuses. The save refuses it on every rank and publishes nothing.
struct ReversedHalvesImpl : torch::nn::Module, tp::ShardedModule {
  explicit ReversedHalvesImpl(int tp_rank) : tp_rank(tp_rank) {
    weight = register_parameter("weight", at::full({2, 3}, static_cast<double>(tp_rank)));
  }
  std::map<std::string, tp::ShardInfo> shard_info() const override {
    return {{"weight", {0, {4, 3}, (1 - tp_rank) * 2, tp_rank, 2}}};
  }
  int tp_rank;
  at::Tensor weight;
};

TEST(CheckpointDist, ASaveWhoseManifestEveryLoadWouldRefuseIsNotPublished) {
  auto world = test::world();
  if (default_tp() < 2) GTEST_SKIP() << "needs TP 2";
  const std::string dir = shared_dir("reversed_slices");
  auto model = std::make_shared<ReversedHalvesImpl>(state(2).tp_rank());
  Checkpointer c(world, {.directory = dir, .async = false});
  c.model(*model);
  std::string message;
  try {
    c.save({.step = 1});
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("not published"), std::string::npos) << message;
  EXPECT_NE(message.find("the manifest to publish"), std::string::npos) << message;
  EXPECT_NE(message.find("\"tp_ranks\" makes rank "), std::string::npos) << message;
  world->barrier()->wait();
  EXPECT_FALSE(Checkpointer::find_latest(dir).has_value());
  if (world->rank() == 0 && fs::exists(dir))
    for (const auto& entry : fs::directory_iterator(dir)) ADD_FAILURE() << "left behind: " << entry.path();
  cleanup(dir);
}

// Hostile values (seeded, the seed printed; LOOM_FUZZ_SEED replays it) in what a manifest says of
// the training state: progress and the accumulation position, the grad scaler, the optimizer's
// groups and steps, the world, the tensor and shard records; resealed, so that the checks behind
// the manifest's checksum are reached. Every rank refuses with CheckpointError changing nothing,
// or every rank loads, and then what it loaded is the checkpoint's data; never some ranks of each.
// Bounded: 8 s (at least 50 forgeries) or 400 forgeries.
TEST(CheckpointDist, HostileTrainingStateIsRefusedOnEveryRankChangingNothing) {
  auto world = test::world();
  const std::string dir = shared_dir("hostile_state");
  const auto& ps = state(default_tp());
  Job a(ps, 31);
  a.train(2);
  { auto half = a.accumulate->next(); }  // saved inside an accumulation window: position 1 of 2
  Checkpointer ca(world, {.directory = dir, .async = false});
  a.attach(ca);
  const auto saved = snapshot(a);
  ca.save({.step = 2, .epoch = 1, .sample = 16});
  test::SharedFile manifest_file(*world, dir + "/step_000002/manifest.json");
  const std::string& original = manifest_file.original();

  const uint64_t seed = test::fuzz_seed(*world, "training state forgery");
  SCOPED_TRACE("LOOM_FUZZ_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);

  Job b(ps, 77);
  b.train(1);
  Checkpointer cb(world, {.directory = dir});
  b.attach(cb);
  const char* sections[] = {"accumulation", "accumulation", "progress", "scaler", "optimizer", "world", "tensors", "shards"};
  auto section_of = [](nlohmann::ordered_json& doc, const std::string& name) -> nlohmann::ordered_json& {
    const bool provider = name == "accumulation" || name == "scaler" || name == "optimizer";
    return provider ? doc["state"][name] : doc[name];
  };
  int refused = 0, loaded = 0, iterations = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(8);
  for (bool go = true; go && iterations < 400; ++iterations) {
    nlohmann::ordered_json doc = nlohmann::ordered_json::parse(original);
    const std::string section = sections[rng() % std::size(sections)];
    test::replace_random_leaf(section_of(doc, section), rng);
    manifest_file.rewrite(ckpt::reseal_manifest(doc.dump(1)));
    const auto before = snapshot(b);
    std::string refusal;
    try {
      cb.load(dir + "/step_000002");
    } catch (const CheckpointError& e) {
      refusal = e.what();
    }
    const int64_t ok = refusal.empty();
    bool good = true;
    for (int64_t theirs : all_gather_values(*world, std::vector<int64_t>{ok}, {"fuzz outcome"}))
      ASSERT_EQ(theirs, ok) << "iteration " << iterations << " (" << section << "): ranks disagree on the load: "
                            << (ok ? "loaded here" : refusal);
    if (ok) {
      ++loaded;
      // A value the checks accept (a user string, say): the load is whole. The live state then
      // moves away from the checkpoint's again, so that a later partial load would show.
      // (A forged position the checks cannot tell from a genuine one, 0 of 2, loads as such.)
      const auto& forged = doc["state"]["accumulation"]["position"];
      const int64_t expected_position = forged.is_number_integer() ? forged.get<int64_t>() : 1;
      EXPECT_EQ(static_cast<int64_t>(b.accumulate->position()), expected_position)
          << nlohmann::ordered_json::diff(nlohmann::ordered_json::parse(original), doc).dump();
      good = static_cast<int64_t>(b.accumulate->position()) == expected_position;
      const auto now = snapshot(b);
      for (const auto& [k, v] : saved)  // the data itself is the checkpoint's, whatever value was forged
        if (k.rfind("p/", 0) == 0 || k.rfind("rng/", 0) == 0 || k == "counter" ||
            (k.rfind("o/", 0) == 0 && k.find("/exp_avg") != std::string::npos)) {
          EXPECT_TRUE(at::equal(v, now.at(k))) << "iteration " << iterations << ": " << k << " loaded wrong";
          good = good && at::equal(v, now.at(k));
        }
    } else {
      ++refused;
      const auto after = snapshot(b);
      EXPECT_EQ(after.size(), before.size());
      for (const auto& [k, v] : before) {
        const bool same = after.count(k) && same_bits(v, after.at(k));
        EXPECT_TRUE(same) << "iteration " << iterations << " (" << section << "): a refused load changed " << k
                          << ": " << refusal;
        good = good && same;
      }
    }
    // (EXPECT, not ASSERT, above: a rank returning alone would leave the others in a collective.
    // A failure on any rank ends the loop on every rank here.)
    bool everyone_good = true;
    for (int64_t theirs : all_gather_values(*world, std::vector<int64_t>{good}, {"fuzz verdict"}))
      everyone_good = everyone_good && theirs != 0;
    if (!everyone_good) break;
    if (ok) {
      b.train(1, 100 + iterations);
      { auto half = b.accumulate->next(); }  // position 1 -> 0: differs from the checkpoint's
    }
    // At least 50 forgeries however slow the build (a sanitizer's), so that the share refused is
    // a share; then until the deadline.
    go = iterations + 1 < 50 ||
         broadcast_values(*world, std::vector<int64_t>{std::chrono::steady_clock::now() < deadline}, 0,
                          {"fuzz deadline"})[0] != 0;
  }
  if (world->rank() == 0)
    std::printf("training state forgery: %d forgeries, %d refused, %d loaded\n", iterations, refused, loaded);
  EXPECT_GT(refused, iterations / 2);
  cleanup(dir);
}

TEST(CheckpointDist, AsyncSaveCapturesTheStateAtSaveAndASecondSaveWaits) {
  auto world = test::world();
  const std::string dir = shared_dir("async");
  torch::manual_seed(3);
  DistributedDataParallel<torch::nn::Linear> ddp(torch::nn::Linear(32, 64), world);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Checkpointer c(world, {.directory = dir, .keep_last = 0});
  c.model(ddp).optimizer(opt);
  auto step = [&] {
    ddp.zero_grad();
    ddp.forward(at::randn({8, 32})).pow(2).sum().backward();
    opt.step();
  };
  step();
  const at::Tensor w1 = ddp.module()->weight.detach().clone();
  c.save({.step = 1});
  EXPECT_TRUE(c.pending());
  step();  // training goes on while the shards are written
  const at::Tensor w2 = ddp.module()->weight.detach().clone();
  c.save({.step = 2});  // waits for step 1's publication first
  step();
  c.wait();
  EXPECT_FALSE(c.pending());
  c.load(dir + "/step_000001");
  EXPECT_TRUE(at::equal(ddp.module()->weight, w1));
  c.load(dir + "/step_000002");
  EXPECT_TRUE(at::equal(ddp.module()->weight, w2));
  EXPECT_EQ(*Checkpointer::find_latest(dir), dir + "/step_000002");
  cleanup(dir);
}

TEST(CheckpointDist, AWriteErrorOnOneRankIsRaisedByWaitOnEveryRankAndThePreviousCheckpointStays) {
  auto world = test::world();
  const std::string dir = shared_dir("write_error");
  torch::manual_seed(4);
  torch::nn::Linear model(8, 8);
  Checkpointer c(world, {.directory = dir});
  c.model(*model);
  c.save({.step = 1});
  c.wait();
  const int culprit = world->size() - 1;
  ckpt::test_hooks().fail_write_rank = culprit;
  c.save({.step = 2});
  std::string message;
  try {
    c.wait();
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  ckpt::test_hooks().fail_write_rank = -1;
  for (const std::string& part : std::vector<std::string>{
           "[rank " + std::to_string(world->rank()) + "] Checkpointer: checkpoint " + dir +
               "/step_000002 not published (the previous one is intact)",
           "[rank " + std::to_string(culprit) + "] Checkpointer: cannot write " + dir + "/.step_000002.tmp-",
           "/" + ckpt::shard_file_name(culprit, world->size()), "No space left on device"})
    EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in: " << message;
  world->barrier()->wait();
  EXPECT_EQ(*Checkpointer::find_latest(dir), dir + "/step_000001");
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_TRUE(entry.path().filename() == "latest" || entry.path().filename() == "step_000001") << entry.path();
  world->barrier()->wait();  // everyone has looked before rank 0 starts the next save
  c.save({.step = 3});       // the checkpointer is still usable
  c.wait();
  EXPECT_EQ(*Checkpointer::find_latest(dir), dir + "/step_000003");
  cleanup(dir);
}

// ---- Resharding ---------------------------------------------------------------------------------------

// Gradients as an elementwise function of the parameter: every TP slice then follows the same
// AdamW trajectory as its part of the one-process model, bit for bit.
void elementwise_steps(torch::optim::Optimizer& opt, torch::nn::Module& model, int steps) {
  for (int s = 0; s < steps; ++s) {
    for (auto& p : model.parameters()) p.mutable_grad() = at::sin(p.detach() * (3.0 + s));
    opt.step();
  }
}

struct Layout {
  int tp;
  bool alone;  // a world of one (TP 1 x DP 1): this rank loads by itself
};

void check_reshard(const Layout& save_at, const std::vector<Layout>& load_at) {
  auto world = test::world();
  const std::string dir = shared_dir("reshard_tp" + std::to_string(save_at.tp));
  // The reference: the one-process model (master weights), on every rank.
  torch::manual_seed(5);
  TinyGpt master(nullptr, nullptr);
  torch::optim::AdamW master_opt(master->parameters(), torch::optim::AdamWOptions(0.01));
  elementwise_steps(master_opt, *master, 2);
  master->eval();
  at::Tensor ids = tokens(3, 7).narrow(0, 0, kSeq);
  const at::Tensor expected = master(ids).detach();
  std::map<std::string, at::Tensor> master_params;
  for (const auto& p : master->named_parameters()) master_params[p.key()] = p.value();

  {
    const auto& ps = state(save_at.tp);
    torch::manual_seed(5);
    TinyGpt model(ps.tp_group(), nullptr);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01));
    elementwise_steps(opt, *model, 2);
    Checkpointer c(world, {.directory = dir, .async = false});
    c.model(model).optimizer(opt);
    c.save({.step = 2});
  }
  for (const auto& layout : load_at) {
    SCOPED_TRACE("saved at TP " + std::to_string(save_at.tp) + ", loaded at TP " + std::to_string(layout.tp) +
                 (layout.alone ? " alone" : ""));
    std::shared_ptr<Communicator> comm = world;
    if (layout.alone) comm = world->split(world->rank(), 0, "alone");
    ParallelState ps(comm, layout.tp);
    torch::manual_seed(77);  // other weights, and optimizer state of its own
    TinyGpt model(ps.tp_group(), nullptr);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.5));
    elementwise_steps(opt, *model, 1);
    Checkpointer c(comm, {.directory = dir});
    c.model(model).optimizer(opt);
    c.load_latest();
    EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.01);
    const auto infos = shard_infos(model);
    for (const auto& p : model->named_parameters()) {
      at::Tensor want = master_params.at(p.key());
      auto it = infos.find(p.key());
      if (it != infos.end() && it->second.dim >= 0)
        want = want.narrow(it->second.dim, it->second.offset, p.value().size(it->second.dim));
      EXPECT_TRUE(at::equal(p.value(), want)) << p.key();
      auto& st = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.value().unsafeGetTensorImpl()));
      auto& ms = static_cast<torch::optim::AdamWParamState&>(
          *master_opt.state().at(master_params.at(p.key()).unsafeGetTensorImpl()));
      at::Tensor want_avg = ms.exp_avg(), want_sq = ms.exp_avg_sq();
      if (it != infos.end() && it->second.dim >= 0) {
        want_avg = want_avg.narrow(it->second.dim, it->second.offset, p.value().size(it->second.dim));
        want_sq = want_sq.narrow(it->second.dim, it->second.offset, p.value().size(it->second.dim));
      }
      EXPECT_TRUE(at::equal(st.exp_avg(), want_avg)) << p.key();
      EXPECT_TRUE(at::equal(st.exp_avg_sq(), want_sq)) << p.key();
      EXPECT_EQ(st.step(), 2) << p.key();
    }
    model->eval();
    at::Tensor out = model->full_logits(ids);
    EXPECT_TRUE(at::allclose(out, expected, 1e-5, 1e-6))
        << "largest difference " << (out - expected).abs().max().item<double>();
  }
  cleanup(dir);
}

// Records what a load says of the saved world against this job's (the public LoadContext).
struct LayoutProbe : checkpoint::StateProvider {
  void collect(int, checkpoint::SaveState&) override {}
  void plan(const checkpoint::LoadContext& context, std::vector<checkpoint::Need>&, std::vector<std::string>&) override {
    same = context.same_layout();
    saved = context.saved_world();
  }
  void apply(const checkpoint::LoadContext&, const checkpoint::LoadedTensors&) override {}
  bool same = false;
  checkpoint::WorldLayout saved;
};

// A declared parallel layout (pipelines, ranks at reversed positions) is recorded with every rank's
// position; a load maps per-rank state rank to rank only at the same layout and positions; ranks
// that declare different layouts, or one position twice, save nothing.
TEST(CheckpointDist, TheDeclaredParallelLayoutAndPositionsAreRecordedAndCompared) {
  auto world = test::world();
  const int n = world->size(), me = world->rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::string dir = shared_dir("declared_layout");
  const ParallelLayout layout = ParallelLayout::standard(n, 1, 2);
  at::Tensor w = at::arange(4, at::kFloat);
  auto save_declared = [&](const ParallelLayout& declared, int position, int64_t step) {
    Checkpointer c(world, {.directory = dir, .async = false});
    c.tensor("w", w).parallel_layout(declared, position);
    c.save({.step = step});
  };
  save_declared(layout, n - 1 - me, 1);
  {
    test::SharedFile manifest_file(*world, dir + "/step_000001/manifest.json");
    auto manifest = nlohmann::json::parse(manifest_file.original());
    EXPECT_EQ(manifest["world"]["layout"], layout.to_string());
    for (int r = 0; r < n; ++r) EXPECT_EQ(manifest["world"]["positions"][r], n - 1 - r);
  }
  auto probe_load = [&](const ParallelLayout* declared, int position) {
    Checkpointer c(world, {.directory = dir, .async = false});
    auto probe = std::make_shared<LayoutProbe>();
    c.tensor("w", w).state("probe", probe);
    if (declared) c.parallel_layout(*declared, position);
    c.load(dir + "/step_000001");
    return probe;
  };
  auto same = probe_load(&layout, n - 1 - me);
  EXPECT_TRUE(same->same);
  EXPECT_EQ(same->saved.layout, layout.to_string());
  EXPECT_FALSE(probe_load(&layout, (n - me) % n)->same);  // every rank one position further on
  EXPECT_TRUE(probe_load(nullptr, 0)->same);  // a job that declares nothing: size and TP decide
  const ParallelLayout other = ParallelLayout::parse("dp=" + std::to_string(n));
  EXPECT_FALSE(probe_load(&other, me)->same);

  auto refused_save = [&](const ParallelLayout& declared, int position) {
    try {
      save_declared(declared, position, 2);
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("(saved)");
  };
  const std::string mixed = refused_save(me == 0 ? other : layout, me == 0 ? 0 : n - 1 - me);
  EXPECT_NE(mixed.find("ranks declare different parallel layouts: rank 0 \"" + other.to_string() + "\""),
            std::string::npos) << mixed;
  const std::string twice = refused_save(layout, me == 1 ? 0 : me);
  EXPECT_NE(twice.find("ranks 0 and 1 both declare position 0 of " + layout.to_string()), std::string::npos) << twice;
  EXPECT_THROW(Checkpointer(world, {.directory = dir}).parallel_layout(ParallelLayout::parse("dp=1"), 0),
               InvalidArgumentError);
  world->barrier()->wait();
  EXPECT_EQ(Checkpointer::find_latest(dir).value_or(""), dir + "/step_000001");
  cleanup(dir);
}

TEST(CheckpointDist, LoadsAtOtherTensorAndDataParallelLayouts) {
  const int n = test::world()->size();
  if (n == 1) {
    check_reshard({1, false}, {{1, true}});
  } else if (n == 2) {
    check_reshard({2, false}, {{1, false}, {1, true}});  // TP 2 -> 1 (DP 1 -> 2, and alone)
    check_reshard({1, false}, {{2, false}});             // TP 1 -> 2
  } else if (n == 4) {
    check_reshard({2, false}, {{1, false}, {4, false}, {1, true}});  // TP2xDP2 -> TP1xDP4, TP4xDP1, TP1xDP1
    check_reshard({1, false}, {{4, false}});                         // TP 1 -> 4
    check_reshard({4, false}, {{2, false}});                         // TP 4 -> 2
  }
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  auto rt = loom::init();
  loom::test::report_failures_only_unless_rank0(rt->world().rank);
  int status = RUN_ALL_TESTS();
  states().clear();
  rt.reset();
  loom::finalize();
  return status;
}
