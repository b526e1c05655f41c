// The checkpoint's extension seams, exercised by real pieces built on them: a user's own state
// provider (examples/data_position.h, the docs' example), providers registered by name, storages
// chosen by URL scheme, and the in-memory storage holding the same format as files (forged copies
// made through the storage interface itself are refused as forged files are).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "../../examples/data_position.h"
#include "loom/error.h"
#include "loom/train/checkpoint.h"
#include "loom/train/checkpoint_state.h"
#include "loom/train/checkpoint_storage.h"
#include "train/checkpoint_hooks.h"
#include "train/checkpoint_storage.h"

namespace {

namespace fs = std::filesystem;
using loom::Checkpointer;
using loom::checkpoint::CheckpointStorage;

// A location in the storage named by `kind`: a fresh directory, or a fresh in-memory store.
std::string location(const std::string& kind, const std::string& name) {
  const std::string unique = name + "_" + std::to_string(::getpid());
  if (kind == "mem") return "mem://" + unique;
  const std::string dir = ::testing::TempDir() + "loom_seams_" + unique;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

template <typename Error>
std::string expect_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected another error type, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "nothing was thrown";
  return "";
}

void expect_contains(const std::string& message, const std::vector<std::string>& parts) {
  for (const auto& part : parts) EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in\n" << message;
}

std::vector<int64_t> take(ShuffledOrder& loader, int n) {
  std::vector<int64_t> out;
  for (int i = 0; i < n; ++i) out.push_back(loader.next());
  return out;
}

class DataPositionThroughStorage : public ::testing::TestWithParam<std::string> {};

// The loader resumed from a checkpoint hands out exactly what an uninterrupted one does, across an
// epoch boundary (the saved order, not a reshuffle, continues the epoch).
TEST_P(DataPositionThroughStorage, ResumedLoaderContinuesTheUninterruptedOrder) {
  const std::string where = location(GetParam(), "data_position");
  ShuffledOrder uninterrupted(10, 5);
  take(uninterrupted, 13);
  const auto expected = take(uninterrupted, 15);

  ShuffledOrder a(10, 5);
  take(a, 13);  // epoch 1, position 3
  {
    Checkpointer ckpt(nullptr, {.directory = where, .async = false});
    ckpt.state("data", std::make_shared<DataPosition>(a));
    ckpt.save({.step = 13});
  }
  ShuffledOrder b(10, 99);  // another seed, elsewhere in its own order
  take(b, 4);
  Checkpointer ckpt(nullptr, {.directory = where});
  ckpt.state("data", std::make_shared<DataPosition>(b));
  const auto info = ckpt.load_latest();
  ASSERT_TRUE(info);
  EXPECT_EQ(info->path, where + "/step_000013");
  EXPECT_EQ(b.epoch(), 1);
  EXPECT_EQ(b.position(), 3);
  EXPECT_EQ(take(b, 15), expected);

  // The section is the provider's, by its name, under the manifest's "state".
  auto storage = loom::checkpoint::open_storage(where, 0, "test");
  auto manifest = storage->open(info->path, "manifest.json");
  std::string text(manifest->size(), '\0');
  manifest->read(0, text.data(), text.size());
  const auto doc = nlohmann::json::parse(text);
  EXPECT_EQ(doc["state"]["data"], nlohmann::json({{"seed", 5}, {"epoch", 1}, {"position", 3}, {"samples", 10}})) << text;
  EXPECT_TRUE(doc["tensors"].contains("data/order"));
}

INSTANTIATE_TEST_SUITE_P(Storages, DataPositionThroughStorage, ::testing::Values("file", "mem"));

TEST(CheckpointStateProviders, ARefusedDataPositionChangesNothing) {
  const std::string where = location("mem", "data_refused");
  ShuffledOrder a(10, 5);
  take(a, 4);
  {
    Checkpointer ckpt(nullptr, {.directory = where, .async = false});
    ckpt.state("data", std::make_shared<DataPosition>(a));
    ckpt.save({.step = 4});
  }
  ShuffledOrder other(12, 5);
  take(other, 7);
  const at::Tensor order = other.order().clone();
  Checkpointer ckpt(nullptr, {.directory = where});
  ckpt.state("data", std::make_shared<DataPosition>(other));
  expect_contains(expect_error<loom::CheckpointError>([&] { ckpt.load_latest(); }),
                  {"data position: saved over 10 samples; the loader has 12", "nothing was changed"});
  EXPECT_EQ(other.position(), 7);
  EXPECT_TRUE(at::equal(other.order(), order));

  // A checkpoint saved without the provider has no section for it.
  const std::string bare = location("mem", "data_missing");
  {
    Checkpointer plain(nullptr, {.directory = bare, .async = false});
    plain.save({.step = 1});
  }
  ShuffledOrder c(10, 5);
  Checkpointer reader(nullptr, {.directory = bare});
  reader.state("data", std::make_shared<DataPosition>(c));
  expect_contains(expect_error<loom::CheckpointError>([&] { reader.load_latest(); }),
                  {"the checkpoint holds no data position (section \"data\")"});
}

// Writes section `name` (JSON text `text`) when armed; nothing otherwise.
class SectionWriter final : public loom::checkpoint::StateProvider {
 public:
  SectionWriter(std::string name, std::string text) : name_(std::move(name)), text_(std::move(text)) {}
  std::atomic<bool> armed{true};
  std::atomic<int> collected{0};
  void collect(int, loom::checkpoint::SaveState& out) override {
    ++collected;
    if (armed) out.sections[name_] = text_;
  }
  void plan(const loom::checkpoint::LoadContext&, std::vector<loom::checkpoint::Need>&,
            std::vector<std::string>&) override {}
  void apply(const loom::checkpoint::LoadContext&, const loom::checkpoint::LoadedTensors&) override {}

 private:
  std::string name_, text_;
};

TEST(CheckpointStateProviders, BuiltInsAreRegisteredByNameAndUsersRegisterTheSameWay) {
  const auto names = loom::checkpoint::registered_state_providers();
  const std::vector<std::string> built_in = {"model", "extra", "optimizer", "zero", "scaler", "rng", "accumulation", "objects"};
  ASSERT_GE(names.size(), built_in.size());
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + built_in.size()), built_in);

  // Registered once for the process: every checkpointer built afterwards has its own instance.
  loom::checkpoint::register_state_provider("seams_registered", [](Checkpointer&) {
    auto provider = std::make_unique<SectionWriter>("seams_registered", "{\"x\": 1}");
    provider->armed = false;  // silent in the other tests of this process
    return provider;
  });
  expect_contains(expect_error<loom::InvalidArgumentError>([] {
                    loom::checkpoint::register_state_provider("seams_registered",
                                                              [](Checkpointer&) { return nullptr; });
                  }),
                  {"register_state_provider", "\"seams_registered\" is registered already"});

  const std::string where = location("mem", "registered");
  Checkpointer ckpt(nullptr, {.directory = where, .async = false});
  auto& mine = ckpt.provider<SectionWriter>("seams_registered");
  mine.armed = true;
  ckpt.save({.step = 2});
  EXPECT_EQ(mine.collected, 1);
  expect_contains(expect_error<loom::InvalidArgumentError>([&] { ckpt.provider<DataPosition>("seams_registered"); }),
                  {"state provider \"seams_registered\" is not of the type asked for"});
  expect_contains(expect_error<loom::InvalidArgumentError>([&] { ckpt.provider("nonesuch"); }),
                  {"no state provider is named \"nonesuch\"", "model, extra, optimizer"});
  expect_contains(expect_error<loom::InvalidArgumentError>([&] {
                    ckpt.state("model", std::make_shared<SectionWriter>("m", "{}"));
                  }),
                  {"a state provider named \"model\" exists already"});
  Checkpointer other(nullptr, {.directory = where});
  EXPECT_NE(&other.provider("seams_registered"), &ckpt.provider("seams_registered"));
}

TEST(CheckpointStateProviders, ASectionWrittenTwiceOrNotJsonIsRefusedAtSave) {
  {
    Checkpointer ckpt(nullptr, {.directory = location("mem", "twice"), .async = false});
    ckpt.state("first", std::make_shared<SectionWriter>("shared", "{\"a\": 1}"));
    ckpt.state("second", std::make_shared<SectionWriter>("shared", "{\"b\": 2}"));
    expect_contains(expect_error<loom::CheckpointError>([&] { ckpt.save({.step = 1}); }),
                    {"state provider \"second\" wrote section \"shared\", which another provider wrote already"});
    EXPECT_FALSE(ckpt.latest());
  }
  Checkpointer ckpt(nullptr, {.directory = location("mem", "not_json"), .async = false});
  ckpt.state("broken", std::make_shared<SectionWriter>("broken", "{\"a\": "));
  expect_contains(expect_error<loom::CheckpointError>([&] { ckpt.save({.step = 1}); }),
                  {"state provider \"broken\" wrote section \"broken\" as text that is not JSON"});
}

// A manifest no load would read (over kMaxManifestBytes, from an oversized section) is never
// published: the previous checkpoint stays the latest.
TEST(CheckpointStateProviders, AManifestTooLargeToLoadIsNotPublished) {
  const std::string where = location("mem", "too_large");
  Checkpointer ckpt(nullptr, {.directory = where, .async = false});
  ckpt.save({.step = 1});
  auto& hooks = loom::detail::ckpt::test_hooks();
  hooks.max_manifest_bytes = 64 << 10;  // the bound, scaled down from kMaxManifestBytes
  auto big = std::make_shared<SectionWriter>("big", "\"" + std::string(65 << 10, 'x') + "\"");
  ckpt.state("big", big);
  const std::string message = expect_error<loom::CheckpointError>([&] { ckpt.save({.step = 2}); });
  hooks.max_manifest_bytes = 0;
  expect_contains(message, {"the manifest to publish has", "a manifest has at most 65536", "not published"});
  EXPECT_EQ(Checkpointer::find_latest(where), where + "/step_000001");
}

// ---- Storages ---------------------------------------------------------------------------------

// A storage registered under its own scheme: memory, counting the bytes its sinks take.
std::atomic<uint64_t> g_tallied{0};
class TallySink final : public loom::checkpoint::ByteSink {
 public:
  explicit TallySink(std::unique_ptr<loom::checkpoint::ByteSink> inner) : inner_(std::move(inner)) {}
  void write(const void* data, size_t bytes) override {
    g_tallied += bytes;
    inner_->write(data, bytes);
  }
  void commit() override { inner_->commit(); }

 private:
  std::unique_ptr<loom::checkpoint::ByteSink> inner_;
};
class TallyStorage final : public CheckpointStorage {
 public:
  explicit TallyStorage(std::unique_ptr<CheckpointStorage> inner) : inner_(std::move(inner)) {}
  bool shared_between_processes() const override { return false; }
  std::string staging_location(const std::string& s, const std::string& n) const override {
    return inner_->staging_location(s, n);
  }
  void create_staging(const std::string& s) override { inner_->create_staging(s); }
  std::unique_ptr<loom::checkpoint::ByteSink> create(const std::string& s, const std::string& o) override {
    return std::make_unique<TallySink>(inner_->create(s, o));
  }
  std::string publish(const std::string& s, const std::string& n, const std::string& m, const std::string& x) override {
    return inner_->publish(s, n, m, x);
  }
  void abandon(const std::string& s) override { inner_->abandon(s); }
  std::optional<std::string> find_latest() const override { return inner_->find_latest(); }
  std::string location(const std::string& s) const override { return inner_->location(s); }
  std::unique_ptr<loom::checkpoint::ByteSource> open(const std::string& c, const std::string& o) override {
    return inner_->open(c, o);
  }

 private:
  std::unique_ptr<CheckpointStorage> inner_;
};

TEST(CheckpointStorages, SchemesPickTheStorageAndUnknownOnesAreRefusedByName) {
  expect_contains(expect_error<loom::InvalidArgumentError>([] { loom::checkpoint::open_storage("s3://bucket/run", 3, "[test]"); }),
                  {"[test]: no checkpoint storage is registered for \"s3://\"", "file://", "mem://"});
  expect_contains(expect_error<loom::InvalidArgumentError>([] {
                    loom::checkpoint::register_checkpoint_storage("Bad_Scheme", [](const auto&) { return nullptr; });
                  }),
                  {"expected a scheme of [a-z0-9+.-]"});
  expect_contains(expect_error<loom::InvalidArgumentError>([] {
                    loom::checkpoint::register_checkpoint_storage("mem", [](const auto&) { return nullptr; });
                  }),
                  {"\"mem://\" is registered already"});

  loom::checkpoint::register_checkpoint_storage("tally", [](const loom::checkpoint::StorageOptions& o) {
    loom::checkpoint::StorageOptions memory = o;
    return std::make_unique<TallyStorage>(loom::detail::ckpt::memory_storage(memory));
  });
  const std::string where = "tally://run_" + std::to_string(::getpid());
  torch::nn::Linear net(4, 3), restored(4, 3);
  Checkpointer save(nullptr, {.directory = where, .async = false});
  save.model(*net);
  const auto info = (save.save({.step = 5}), save.wait());
  EXPECT_GT(g_tallied.load(), 0u);
  EXPECT_EQ(info.path, where + "/step_000005");
  Checkpointer load(nullptr, {.directory = where});
  load.model(*restored);
  ASSERT_TRUE(load.load_latest());
  EXPECT_TRUE(at::equal(net->weight, restored->weight));
  // A plain path and file:// are files; both name the same checkpoints.
  const std::string dir = location("file", "file_scheme");
  Checkpointer files(nullptr, {.directory = "file://" + dir, .async = false});
  files.model(*net);
  files.save({.step = 1});
  EXPECT_EQ(Checkpointer::find_latest(dir), dir + "/step_000001");
}

// Rotation keeps the newest keep_last in memory as in files; `latest` names the last published.
TEST(CheckpointStorages, MemoryStorageRotatesAndFindsTheLatest) {
  const std::string where = location("mem", "rotate");
  torch::nn::Linear net(2, 2);
  Checkpointer ckpt(nullptr, {.directory = where, .keep_last = 2, .async = false});
  ckpt.model(*net);
  for (int64_t step : {1, 2, 3, 4}) ckpt.save({.step = step});
  ckpt.save({.step = 2});  // an older step saved last is the latest, and is kept
  EXPECT_EQ(Checkpointer::find_latest(where), where + "/step_000002");
  auto storage = loom::checkpoint::open_storage(where, 0, "[test]");
  expect_contains(expect_error<loom::CheckpointError>([&] { storage->open(where + "/step_000001", "manifest.json"); }),
                  {"cannot open " + where + "/step_000001/manifest.json", "no such object"});
  EXPECT_NO_THROW(storage->open(where + "/step_000004", "manifest.json"));
  EXPECT_NO_THROW(storage->open(where + "/step_000002", "manifest.json"));
}

// Copies step 7 of `from` into a fresh store through the storage interface, each object passed
// through `forge` (which may change its bytes, or return false to leave the object out).
std::string forged_copy(const std::string& from, const std::string& name,
                        const std::function<bool(const std::string& object, std::string& bytes)>& forge) {
  auto source = loom::checkpoint::open_storage(from, 0, "[test]");
  const std::string to = location("mem", name);
  auto target = loom::checkpoint::open_storage(to, 0, "[test]");
  const std::string staging = target->staging_location("step_000007", "forged");
  target->create_staging(staging);
  auto read = [&](const std::string& object) {
    auto bytes = source->open(from + "/step_000007", object);
    std::string text(bytes->size(), '\0');
    bytes->read(0, text.data(), text.size());
    return text;
  };
  std::string shard = read("shard-00000-of-00001.safetensors");
  if (forge("shard", shard)) {
    auto sink = target->create(staging, "shard-00000-of-00001.safetensors");
    sink->write(shard.data(), shard.size());
    sink->commit();
  }
  std::string manifest = read("manifest.json");
  forge("manifest", manifest);
  EXPECT_EQ(target->publish(staging, "step_000007", manifest, "forged"), "");
  return to;
}

TEST(CheckpointStorages, ForgedInMemoryCopiesAreRefusedChangingNothing) {
  const std::string original = location("mem", "forge_source");
  torch::nn::Linear net(4, 3);
  torch::optim::Adam adam(net->parameters(), 0.01);
  net(at::ones({2, 4})).sum().backward();
  adam.step();
  {
    Checkpointer ckpt(nullptr, {.directory = original, .async = false});
    ckpt.model(*net).optimizer(adam);
    ckpt.save({.step = 7});
  }
  // The faithful copy loads: the interface moves the bytes unchanged.
  auto load_into_fresh = [](const std::string& where) {
    torch::nn::Linear other(4, 3);
    torch::optim::Adam other_adam(other->parameters(), 0.01);
    const at::Tensor before = other->weight.clone();
    Checkpointer ckpt(nullptr, {.directory = where});
    ckpt.model(*other).optimizer(other_adam);
    std::string message;
    try {
      ckpt.load_latest();
    } catch (const loom::CheckpointError& e) {
      message = e.what();
      EXPECT_TRUE(at::equal(other->weight, before)) << "a refused load changed the model";
    }
    return std::make_pair(message, other->weight.clone());
  };
  const auto [copied, weight] = load_into_fresh(forged_copy(original, "forge_none", [](auto&, auto&) { return true; }));
  EXPECT_EQ(copied, "");
  EXPECT_TRUE(at::equal(weight, net->weight));

  struct Forgery {
    std::string name;
    std::function<bool(const std::string&, std::string&)> forge;
    std::vector<std::string> parts;
  };
  const std::vector<Forgery> forgeries = {
      {"flipped_data",
       [](const std::string& o, std::string& b) {
         if (o == "shard") b[b.size() - 3] ^= 0x10;
         return true;
       },
       {"shard-00000-of-00001.safetensors", "checksum mismatch"}},
      {"truncated",
       [](const std::string& o, std::string& b) {
         if (o == "shard") b.resize(b.size() - 5);
         return true;
       },
       {"(truncated)"}},
      {"missing_shard", [](const std::string& o, std::string&) { return o != "shard"; }, {"no such object"}},
      {"edited_manifest",
       [](const std::string& o, std::string& b) {
         if (o == "manifest") b.replace(b.find("\"step\": 7"), 9, "\"step\": 8");
         return true;
       },
       {"was changed after it was written"}},
  };
  for (const auto& f : forgeries) {
    SCOPED_TRACE(f.name);
    const auto [message, _] = load_into_fresh(forged_copy(original, "forge_" + f.name, f.forge));
    expect_contains(message, f.parts);
    expect_contains(message, {"nothing was changed"});
  }
}

}  // namespace
