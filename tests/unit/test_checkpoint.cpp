// Checkpoints in one process (no MPI): the safetensors reader and the manifest parser on valid,
// hostile and mutated input (a fixed-seed fuzz of a few thousand inputs), bitwise round trips of
// every saved piece through real files, corruption of those files (each detected, named, and the
// model left untouched), rotation and the latest pointer, and the Python `safetensors` package
// reading every shard.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <filesystem>
#include <sys/stat.h>
#include <fstream>
#include <new>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "../hostile_json.h"
#include "loom/amp/grad_scaler.h"
#include "loom/error.h"
#include "loom/parallel/optimizer_state.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/checkpoint.h"
#include "train/checkpoint_checksum.h"
#include "train/checkpoint_files.h"
#include "train/checkpoint_layout.h"
#include "train/checkpoint_load_plan.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_storage.h"
#include "train/safetensors.h"
#include "../time_scale.h"

// Allocation tracking: the largest single operator-new request while armed, to show that a bogus
// header size is refused before anything is allocated from it.
namespace {
std::atomic<bool> g_track_allocations{false};
std::atomic<size_t> g_largest_allocation{0};
}  // namespace

void* operator new(size_t bytes) {
  if (g_track_allocations.load(std::memory_order_relaxed)) {
    size_t seen = g_largest_allocation.load();
    while (bytes > seen && !g_largest_allocation.compare_exchange_weak(seen, bytes)) {
    }
  }
  if (void* p = std::malloc(bytes ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, size_t) noexcept {
  std::free(p);
}

namespace {

namespace fs = std::filesystem;
namespace ckpt = loom::detail::ckpt;
using json = nlohmann::json;

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "loom_ckpt_" + name + "_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A shard in memory: header + data of two tensors.
std::string small_shard() {
  std::vector<ckpt::TensorSpec> specs = {{"a", at::kFloat, {2, 3}}, {"b", at::kLong, {4}}};
  std::string bytes = ckpt::build_header(specs, {{"format", "pt"}});
  std::string data(2 * 3 * 4 + 4 * 8, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  return bytes + data;
}

std::string expect_checkpoint_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const loom::CheckpointError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected loom::CheckpointError, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected loom::CheckpointError, nothing was thrown";
  return "";
}

// ---- Safetensors ---------------------------------------------------------------------------------

TEST(Safetensors, HeaderIsPaddedAndRoundTrips) {
  const std::string shard = small_shard();
  uint64_t n = 0;
  std::memcpy(&n, shard.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(shard[8], '{');
  auto header = ckpt::parse_shard(shard, "shard");
  ASSERT_EQ(header.tensors.size(), 2u);
  EXPECT_EQ(header.tensors[0].name, "a");
  EXPECT_EQ(header.tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(header.tensors[0].begin, 0u);
  EXPECT_EQ(header.tensors[0].end, 24u);
  EXPECT_EQ(header.tensors[1].dtype, at::kLong);
  EXPECT_EQ(header.data_start, 8 + n);
  EXPECT_EQ(header.metadata.at("format"), "pt");
}

std::string shard_with_header(const std::string& header_json, size_t data_bytes) {
  std::string json = header_json;
  std::string out(8, '\0');
  uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + std::string(data_bytes, '\0');
}

TEST(Safetensors, RejectsHostileHeaders) {
  struct Case {
    std::string json;
    size_t data;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4, "hold 4 bytes; shape [2] x F32 needs 8"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
       6, "(overlaps the previous one)"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "expected 0 (gap)"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8, "cover 4 bytes of a data region of 8"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,400]}})", 8, "outside the data region"},
      {R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", 8, "unsupported dtype"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, "expected non-negative integers"},
      {R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})", 4, "needs more than 2^64"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", 4, "exactly the keys"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4, "outside the data region"},
      {R"({"__metadata__":{"k":1}})", 0, "is not a string"},
      {R"([1,2])", 0, "does not start with '{'"},
      {R"({"a":[[[[[[[[1]]]]]]]]})", 0, "nests deeper"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", 4, "not a JSON object"},
  };
  for (const auto& c : cases) {
    const std::string message =
        expect_checkpoint_error([&] { ckpt::parse_shard(shard_with_header(c.json, c.data), "shard X"); });
    EXPECT_NE(message.find(c.message), std::string::npos) << c.json << "\n -> " << message;
    EXPECT_NE(message.find("shard X"), std::string::npos) << message;
  }
}

TEST(Safetensors, HugeHeaderLengthIsRefusedBeforeAnyAllocation) {
  const std::string dir = fresh_dir("huge");
  std::string shard = small_shard();
  const uint64_t huge = uint64_t(1) << 60;
  std::memcpy(shard.data(), &huge, 8);
  const std::string path = dir + "/shard.safetensors";
  write_file(path, shard);
  auto file = ckpt::open_file(path, "test");
  g_largest_allocation = 0;
  g_track_allocations = true;
  const std::string message =
      expect_checkpoint_error([&] { ckpt::read_header(*file, shard.size(), "shard " + path, nullptr); });
  g_track_allocations = false;
  EXPECT_NE(message.find("header claims 1152921504606846976 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_LT(g_largest_allocation.load(), size_t(1) << 16) << "an allocation was sized by the bogus header length";
  // A claim within the cap but beyond the file is refused the same way (not read and found short).
  const uint64_t big = 50u << 20;
  std::memcpy(shard.data(), &big, 8);
  write_file(path, shard);
  auto file2 = ckpt::open_file(path, "test");
  g_largest_allocation = 0;
  g_track_allocations = true;
  const std::string message2 =
      expect_checkpoint_error([&] { ckpt::read_header(*file2, shard.size(), "shard " + path, nullptr); });
  g_track_allocations = false;
  EXPECT_NE(message2.find("header claims 52428800 bytes"), std::string::npos) << message2;
  EXPECT_LT(g_largest_allocation.load(), size_t(1) << 16);
}

// Slices of a split tensor tile it exactly, and a shard holds one entry per tensor name.
TEST(CheckpointManifest, OverlappingSlicesAndTwoSlicesInOneShardAreRefused) {
  ckpt::Manifest m;
  m.world = {2, 2, 1, {0, 1}};
  m.shards = {{"shard-00000-of-00002.safetensors", 0, 100, 0x1234},
              {"shard-00001-of-00002.safetensors", 1, 90, 0xabcd}};
  ckpt::TensorRecord w;
  w.shape = {8, 4};
  w.split_dim = 0;
  auto refused = [&](std::vector<ckpt::SliceRecord> slices) {
    w.slices = std::move(slices);
    m.tensors = {{"model/w", w}};
    return expect_checkpoint_error([&] { ckpt::parse_manifest(ckpt::manifest_to_json(m), "manifest"); });
  };
  EXPECT_NE(refused({{0, 0, 4}, {1, 2, 6}}).find("(overlap)"), std::string::npos);
  EXPECT_NE(refused({{0, 0, 4}, {0, 4, 4}}).find("places two slices in shard 0"), std::string::npos);
  w.slices = {{0, 0, 4}, {1, 4, 4}};
  m.tensors = {{"model/w", w}};
  EXPECT_EQ(ckpt::parse_manifest(ckpt::manifest_to_json(m), "manifest").tensors.at("model/w").slices.size(), 2u);
}

// A declared parallel layout round-trips, and is refused when it contradicts the world beside it:
// another size, TP or DP degree, a position taken twice, a TP rank its position does not give.
TEST(CheckpointManifest, DeclaredLayoutRoundTripsAndMustAgreeWithTheWorld) {
  ckpt::Manifest m;
  m.world = {4, 1, 2, {0, 0, 0, 0}, "dp=2,pp=2,tp=1", {3, 2, 1, 0}};
  m.shards = {{"shard-00000-of-00004.safetensors", 0, 10, 1}, {"shard-00001-of-00004.safetensors", 1, 10, 2},
              {"shard-00002-of-00004.safetensors", 2, 10, 3}, {"shard-00003-of-00004.safetensors", 3, 10, 4}};
  ckpt::TensorRecord b;
  b.shape = {2};
  b.slices = {{0, 0, 0}};
  m.tensors = {{"model/b", b}};
  const ckpt::Manifest back = ckpt::parse_manifest(ckpt::manifest_to_json(m), "manifest");
  EXPECT_EQ(back.world.layout, "dp=2,pp=2,tp=1");
  EXPECT_EQ(back.world.positions, (std::vector<int>{3, 2, 1, 0}));
  auto refused = [&](ckpt::WorldLayout world) {
    ckpt::Manifest changed = m;
    changed.world = std::move(world);
    return expect_checkpoint_error([&] { ckpt::parse_manifest(ckpt::manifest_to_json(changed), "manifest"); });
  };
  EXPECT_NE(refused({4, 1, 2, {0, 0, 0, 0}, "dp=2,pp=3,tp=1", {3, 2, 1, 0}}).find("disagrees with size 4"),
            std::string::npos);
  EXPECT_NE(refused({4, 1, 4, {0, 0, 0, 0}, "dp=2,pp=2,tp=1", {3, 2, 1, 0}}).find("or data_parallel 4"),
            std::string::npos);
  EXPECT_NE(refused({4, 1, 2, {0, 0, 0, 0}, "dp=2,pp=2,tp=1", {3, 2, 2, 0}}).find("expected each of 0..3 once"),
            std::string::npos);
  EXPECT_NE(refused({4, 1, 2, {0, 0, 0, 0}, "dp=2,pp=2,tp=1", {3, 2, 1}}).find("not an array of 4 positions"),
            std::string::npos);
  EXPECT_NE(refused({4, 1, 2, {0, 0, 0, 0}, "dp=2,pp=2,TP=1", {3, 2, 1, 0}}).find("dimension name \"TP\""),
            std::string::npos);
  EXPECT_NE(refused({4, 2, 1, {0, 1, 0, 1}, "pp=2,tp=2", {1, 0, 2, 3}}).find("makes rank 0 tensor-parallel rank 0, but "
                                                                             "its position 1 in pp=2,tp=2 is tp 1"),
            std::string::npos);
}

// The save planner, in one process, at TP 2 x DP 2 (ranks 0 and 2 hold the first half of every
// split tensor, 1 and 3 the second): each distinct slice is written once, largest first onto the
// least-loaded holder, a buffer by its lowest holder; the records name each slice's writer.
TEST(CheckpointSavePlan, EachSliceOnceBalancedOverItsHolders) {
  auto slice = [](const std::string& name, std::vector<int64_t> shape, int64_t offset, int64_t length) {
    const int64_t row = shape[1] * 4;  // bytes of one float row
    return ckpt::Descriptor{name, at::kFloat, shape, 0, offset, length, false, static_cast<uint64_t>(length * row)};
  };
  const ckpt::Descriptor bias{"b", at::kFloat, {4}, -1, 0, 0, true, 16};
  std::vector<std::vector<ckpt::Descriptor>> per_rank(4);
  for (int r = 0; r < 4; ++r) {
    const int64_t half = r % 2;
    per_rank[r] = {slice("big", {16, 4}, 8 * half, 8), slice("w", {8, 4}, 4 * half, 4), bias};
  }
  const auto plan = ckpt::plan_save(per_rank, "save");
  const std::vector<std::set<std::string>> writes = {{"big", "b"}, {"big"}, {"w"}, {"w"}};
  EXPECT_EQ(plan.writes, writes);
  EXPECT_EQ(plan.bytes, (std::vector<uint64_t>{144, 128, 64, 64}));  // 400: every distinct byte once
  auto writers = [&](const std::string& name) {
    std::vector<int> shards;
    for (const auto& s : plan.tensors.at(name).slices) shards.push_back(s.shard);
    return shards;
  };
  EXPECT_EQ(writers("big"), (std::vector<int>{0, 1}));
  EXPECT_EQ(writers("w"), (std::vector<int>{2, 3}));  // ranks 0 and 1 already write 128 bytes
  EXPECT_EQ(writers("b"), (std::vector<int>{0}));     // a buffer: the lowest holder's copy
  EXPECT_EQ(plan.tensors.at("big").shape, (std::vector<int64_t>{16, 4}));
  EXPECT_EQ(plan.tensors.at("b").split_dim, -1);

  // Descriptions that cannot make one checkpoint are refused before anything is written.
  auto refused = [&](auto edit) {
    auto bad = per_rank;
    edit(bad);
    return expect_checkpoint_error([&] { ckpt::plan_save(bad, "save"); });
  };
  EXPECT_NE(refused([](auto& d) { d[3][1].dtype = at::kHalf; }).find("ranks disagree about tensor w"),
            std::string::npos);
  EXPECT_NE(refused([](auto& d) { d[1][1].offset = d[3][1].offset = 5; }).find("do not tile it"), std::string::npos);
  EXPECT_NE(refused([](auto& d) { d[2][0].length = 6; }).find("ranks hold different slices of big at offset 0"),
            std::string::npos);
}

// The load planner, in one process: which saved slices feed which need, which shards a rank
// verifies whole, and which pieces it reads partially (rows only where possible).
TEST(CheckpointLoadPlan, SameLayoutReshardingAndPartialReads) {
  ckpt::Manifest m;
  m.world = {2, 2, 1, {0, 1}};
  m.shards = {{"a", 0, 1, 0}, {"b", 1, 1, 0}};
  ckpt::TensorRecord rows;  // [8, 4] split along dim 0 over two shards
  rows.shape = {8, 4};
  rows.split_dim = 0;
  rows.slices = {{0, 0, 4}, {1, 4, 4}};
  ckpt::TensorRecord cols = rows;  // [4, 8] split along dim 1
  cols.shape = {4, 8};
  cols.split_dim = 1;
  ckpt::TensorRecord whole;  // [8, 4] in shard 0 only
  whole.shape = {8, 4};
  whole.slices = {{0, 0, 0}};
  auto need = [](const std::string& name, const ckpt::TensorRecord& r, std::vector<int64_t> start,
                 std::vector<int64_t> size) { return ckpt::Need{name, &r, {start, size}, size}; };

  // Same layout, rank 0 of 2: its own slice from the shard it verifies; nothing partial.
  auto same = ckpt::plan_load(m, {need("rows", rows, {0, 0}, {4, 4})}, 0, 2);
  ASSERT_EQ(same.pieces.size(), 1u);
  EXPECT_EQ(same.pieces[0].shard, 0);
  EXPECT_EQ(same.verify.size(), 1u);
  EXPECT_EQ(same.verify.at(0), std::set<std::string>{"rows"});
  EXPECT_TRUE(same.uncovered.empty());

  // TP 2 -> 1 at one rank: both slices, both shards verified by the only rank.
  auto joined = ckpt::plan_load(m, {need("rows", rows, {0, 0}, {8, 4})}, 0, 1);
  ASSERT_EQ(joined.pieces.size(), 2u);
  EXPECT_EQ(joined.verify.size(), 2u);
  EXPECT_EQ(joined.pieces[1].inter, (ckpt::Box{{4, 0}, {4, 4}}));

  // TP 1 -> 2, rank 1 of 2: shard 0 is rank 0's to verify, so rank 1 reads its rows partially.
  auto split = ckpt::plan_load(m, {need("whole", whole, {4, 0}, {4, 4})}, 1, 2);
  ASSERT_EQ(split.pieces.size(), 1u);
  EXPECT_TRUE(split.pieces[0].rows_only);
  EXPECT_EQ(split.pieces[0].inter, (ckpt::Box{{4, 0}, {4, 4}}));
  EXPECT_EQ(split.verify.count(0), 0u);
  ASSERT_EQ(split.verify.count(1), 1u);
  EXPECT_TRUE(split.verify.at(1).empty()) << "rank 1 verifies shard 1 and keeps nothing from it";

  // Rows of a stored column slice are contiguous in it: read as rows when the piece spans the
  // slice's columns; a piece that takes only some of them is read whole.
  auto spanning = ckpt::plan_load(m, {need("cols", cols, {1, 0}, {2, 4})}, 1, 2);
  ASSERT_EQ(spanning.pieces.size(), 1u);
  EXPECT_TRUE(spanning.pieces[0].rows_only);
  auto straddling = ckpt::plan_load(m, {need("cols", cols, {1, 2}, {2, 4})}, 1, 2);
  ASSERT_EQ(straddling.pieces.size(), 2u);
  EXPECT_FALSE(straddling.pieces[0].rows_only);
  EXPECT_FALSE(straddling.pieces[1].rows_only);

  // A need reaching outside its tensor is reported, not silently zero-filled.
  auto outside = ckpt::plan_load(m, {need("rows", rows, {6, 0}, {4, 4})}, 0, 1);
  ASSERT_EQ(outside.uncovered.size(), 1u);
  EXPECT_NE(outside.uncovered[0].find("rows: 8 of 16"), std::string::npos) << outside.uncovered[0];
}

// ---- Fuzz: mutated shards and manifests ------------------------------------------------------------

std::string mutate(std::string input, std::mt19937_64& rng) {
  const char interesting[] = {'\0', '\xff', '"', '{', '}', '[', ']', ',', ':', '9', '-', ' ', '\\', 'e'};
  const int mutations = 1 + static_cast<int>(rng() % 4);
  for (int m = 0; m < mutations; ++m) {
    if (input.empty()) input = "{";
    const size_t at = rng() % input.size();
    switch (rng() % 9) {
      case 0:
        input[at] = static_cast<char>(input[at] ^ (1 << (rng() % 8)));
        break;
      case 1:
        input[at] = interesting[rng() % sizeof(interesting)];
        break;
      case 2:
        input.resize(at);
        break;
      case 3:
        input.erase(at, 1 + rng() % 16);
        break;
      case 4:
        input.insert(at, input.substr(rng() % input.size(), 1 + rng() % 32));
        break;
      case 5:
        input.insert(at, std::to_string(rng() % 2 ? rng() : rng() % 100000));
        break;
      case 6:
        input[at] = static_cast<char>(rng());
        break;
      case 7: {  // the length field: small, large, or just off
        if (input.size() >= 8) {
          uint64_t n;
          std::memcpy(&n, input.data(), 8);
          const uint64_t choices[] = {n + 1, n - 1, 0, uint64_t(1) << 60, UINT64_MAX, rng() % 4096};
          n = choices[rng() % 6];
          std::memcpy(input.data(), &n, 8);
        }
        break;
      }
      case 8:
        std::swap(input[at], input[rng() % input.size()]);
        break;
    }
  }
  return input;
}

TEST(CheckpointFuzz, MutatedShardsAndManifestsAreAcceptedOrRefusedWithCheckpointError) {
  std::mt19937_64 rng(20260417);
  // A realistic manifest: two shards, a split and a replicated tensor, every section.
  ckpt::Manifest m;
  m.step = 12;
  m.world = {2, 2, 1, {0, 1}, "pp=1,dp=1,tp=2", {0, 1}};  // a declared layout, for the fuzzer to break
  m.shards = {{"shard-00000-of-00002.safetensors", 0, 100, 0x1234},
              {"shard-00001-of-00002.safetensors", 1, 90, 0xabcd}};
  ckpt::TensorRecord w;
  w.dtype = at::kFloat;
  w.shape = {8, 4};
  w.split_dim = 0;
  w.slices = {{0, 0, 4}, {1, 4, 4}};
  ckpt::TensorRecord b;
  b.dtype = at::kBFloat16;
  b.shape = {4};
  b.slices = {{1, 0, 0}};
  m.tensors = {{"model/w", w}, {"model/b", b}};
  m.progress = {{"step", 12}, {"epoch", 0}, {"sample", 96}};
  m.state["optimizer"] = {
      {"type", "Adam"},
      {"param_groups", json::array({{{"params", {"w", "b"}}, {"options", {{"lr", 0.1}, {"betas", {0.9, 0.99}}}}}})},
      {"steps", {{"w", 3}}}};
  m.state["scaler"] = {{"scale", 1024.0}};
  m.user = {{"k", "v"}};
  const std::string manifest = ckpt::manifest_to_json(m);
  ASSERT_NO_THROW(ckpt::parse_manifest(manifest, "manifest"));
  const std::string shard = small_shard();
  const std::string dir = fresh_dir("fuzz");
  const std::string path = dir + "/fuzz.safetensors";

  int accepted = 0, refused = 0;
  for (int i = 0; i < 4000; ++i) {
    const bool shard_case = i % 2 == 0;
    const std::string input = mutate(shard_case ? shard : manifest, rng);
    try {
      if (shard_case) {
        ckpt::ShardHeader h;
        if (i % 10 == 0) {  // through a real file: the bounded reader
          write_file(path, input);
          auto f = ckpt::open_file(path, "fuzz");
          h = ckpt::read_header(*f, input.size(), "fuzz", nullptr);
        } else {
          h = ckpt::parse_shard(input, "fuzz");
        }
        uint64_t end = 0;  // what was accepted tiles the data region exactly
        for (const auto& t : h.tensors) {
          ASSERT_EQ(t.begin, end);
          end = t.end;
        }
        ASSERT_EQ(end, h.data_bytes);
        ASSERT_EQ(h.data_start + h.data_bytes, input.size());
      } else {
        auto parsed = ckpt::parse_manifest(input, "fuzz");
        for (const auto& [name, t] : parsed.tensors)
          for (const auto& s : t.slices) ASSERT_LT(static_cast<size_t>(s.shard), parsed.shards.size());
      }
      ++accepted;
    } catch (const loom::CheckpointError&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL() << "input " << i << " raised a non-CheckpointError: " << e.what();
    }
  }
  EXPECT_EQ(accepted + refused, 4000);
  EXPECT_GT(refused, 2000);  // most mutations break something
  EXPECT_GT(accepted, 20);   // and some survive (e.g. padding, metadata)
}

// ---- Round trips through real files ----------------------------------------------------------------

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t out = 3) {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    col = register_module("col", loom::ColumnParallelLinear(8, 6, nullptr));
    fc2 = register_module("fc2", torch::nn::Linear(6, out));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(col(bn(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  loom::ColumnParallelLinear col{nullptr};
};
TORCH_MODULE(Net);

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, Net& net) {
  if (kind == "sgd")
    return std::make_unique<torch::optim::SGD>(net->parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.01).amsgrad(true));
  if (kind == "rmsprop")  // every state tensor: square_avg, momentum_buffer, grad_avg
    return std::make_unique<torch::optim::RMSprop>(net->parameters(),
                                                   torch::optim::RMSpropOptions(0.01).momentum(0.9).centered(true));
  if (kind == "adagrad")
    return std::make_unique<torch::optim::Adagrad>(net->parameters(), torch::optim::AdagradOptions(0.05).lr_decay(0.01));
  return std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

struct Training {
  Net net;
  std::unique_ptr<torch::optim::Optimizer> opt;
  loom::GradScaler scaler{{.init_scale = 1024.0, .growth_interval = 2}};
  loom::RngTracker tracker;
  at::Tensor ema = at::zeros({5});

  Training(const std::string& kind, uint64_t seed) : net(nullptr) {
    torch::manual_seed(seed);
    net = Net();
    opt = make_optimizer(kind, net);
    tracker.add("model-parallel", seed + 1);
  }
  void steps(int n) {
    for (int i = 0; i < n; ++i) {
      opt->zero_grad();
      at::Tensor x = at::randn({6, 4});
      at::Tensor loss = net->forward(x).pow(2).mean();
      scaler.scale(loss).backward();
      scaler.step(*opt);
      scaler.update();
      auto guard = tracker.fork();
      ema.mul_(0.9).add_(at::rand({5}));  // in place: the checkpointer holds this tensor
    }
  }
  void attach(loom::Checkpointer& c) { c.model(net).optimizer(*opt).scaler(scaler).rng(tracker).tensor("ema", ema); }
};

// Every hyper-parameter of a group's options, whatever the optimizer.
std::vector<double> option_values(const torch::optim::OptimizerOptions& o) {
  if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o))
    return {a->lr(), std::get<0>(a->betas()), std::get<1>(a->betas()), a->eps(), a->weight_decay(), double(a->amsgrad())};
  if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o))
    return {w->lr(), std::get<0>(w->betas()), std::get<1>(w->betas()), w->eps(), w->weight_decay(), double(w->amsgrad())};
  if (auto* m = dynamic_cast<const torch::optim::SGDOptions*>(&o))
    return {m->lr(), m->momentum(), m->dampening(), m->weight_decay(), double(m->nesterov())};
  if (auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&o))
    return {r->lr(), r->alpha(), r->eps(), r->weight_decay(), r->momentum(), double(r->centered())};
  if (auto* g = dynamic_cast<const torch::optim::AdagradOptions*>(&o))
    return {g->lr(), g->lr_decay(), g->weight_decay(), g->initial_accumulator_value(), g->eps()};
  ADD_FAILURE() << "options of an optimizer the snapshot does not know";
  return {};
}

// Every piece of state, as bytes, for bitwise comparison.
std::map<std::string, at::Tensor> snapshot(Training& t) {
  std::map<std::string, at::Tensor> s;
  for (const auto& p : t.net->named_parameters()) s["p/" + p.key()] = p.value().detach().clone();
  for (const auto& b : t.net->named_buffers()) s["b/" + b.key()] = b.value().clone();
  const auto kind = loom::optimizer_kind(*t.opt);
  for (size_t g = 0; g < t.opt->param_groups().size(); ++g) {
    const auto& group = t.opt->param_groups()[g];
    for (const auto& p : group.params()) {
      auto* state = loom::find_optimizer_state(*t.opt, p);
      if (state == nullptr) continue;
      std::ostringstream key;
      key << "o/" << s.size();
      std::optional<int64_t> step;
      for (const auto& [name, tensor] : loom::optimizer_state_tensors(*kind, *state, &step))
        s[key.str() + "/" + name] = tensor.clone();
      if (step) s[key.str() + "/step"] = at::tensor({*step});
    }
    s["options/" + std::to_string(g)] = at::tensor(option_values(group.options()), at::kDouble);
  }
  for (const auto& [k, v] : t.scaler.state_dict()) s["scaler/" + k] = at::tensor({v});
  s["rng/cpu"] = at::detail::getDefaultCPUGenerator().get_state();
  for (const auto& [k, v] : t.tracker.get_states()) s["rng/" + k] = v;
  s["ema"] = t.ema.clone();
  return s;
}

void expect_same(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_TRUE(v.sizes() == b.at(k).sizes() && v.dtype() == b.at(k).dtype() && at::equal(v, b.at(k)))
        << k << " differs";
  }
}

// Through each storage: files, and the same format held in memory (mem://).
class RoundTrip : public ::testing::TestWithParam<std::tuple<std::string, bool, std::string>> {};

TEST_P(RoundTrip, EveryPieceIsRestoredBitwise) {
  const auto [kind, async, storage] = GetParam();
  const std::string name = "roundtrip_" + kind + (async ? "_async" : "_sync");
  const std::string dir = storage == "mem" ? "mem://" + name : fresh_dir(name);
  Training a(kind, 1);
  a.steps(3);
  loom::Checkpointer ca(nullptr, {.directory = dir, .async = async});
  a.attach(ca);
  const auto before = snapshot(a);
  ca.save({.step = 3, .epoch = 1, .sample = 18}, {{"note", "hello"}, {"loss", "0.125"}});
  if (async) a.steps(2);  // training goes on while the writer works: the checkpoint is the state at save()
  const auto saved = ca.wait();
  EXPECT_EQ(saved.path, dir + "/step_000003");
  EXPECT_GT(saved.bytes, 0u);

  Training b(kind, 99);  // different weights, empty optimizer state, other scale and streams
  b.steps(1);
  loom::Checkpointer cb(nullptr, {.directory = dir});
  b.attach(cb);
  auto loaded = cb.load_latest();
  ASSERT_TRUE(loaded);
  EXPECT_EQ(loaded->path, dir + "/step_000003");
  EXPECT_EQ(loaded->progress.step, 3);
  EXPECT_EQ(loaded->progress.epoch, 1);
  EXPECT_EQ(loaded->progress.sample, 18);
  EXPECT_EQ(loaded->user.at("note"), "hello");
  EXPECT_EQ(loaded->user.at("loss"), "0.125");
  expect_same(before, snapshot(b));
  // Resumed training continues exactly as an uninterrupted run: 5 steps from the same seed, run
  // now (each Training draws its data from the global generator, which the load restored).
  const auto resumed_generator = at::detail::getDefaultCPUGenerator().get_state();
  Training c(kind, 1);
  c.steps(5);
  const auto uninterrupted = snapshot(c);
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(resumed_generator);
  b.steps(2);
  expect_same(uninterrupted, snapshot(b));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, RoundTrip,
                         ::testing::Combine(::testing::Values("sgd", "adam", "adamw", "rmsprop", "adagrad"),
                                            ::testing::Bool(), ::testing::Values("file", "mem")));

// Steps outside what a checkpoint name holds are refused at save, on every rank, writing nothing.
TEST(Checkpoint, StepsOutsideTheNamedRangeAreRefused) {
  const std::string dir = fresh_dir("bad_steps");
  Training a("sgd", 3);
  loom::Checkpointer c(nullptr, {.directory = dir});
  a.attach(c);
  for (int64_t step : {int64_t(-1), int64_t(1'000'000'000'000'000'000LL)}) {
    const std::string message = expect_checkpoint_error([&] { c.save({.step = step}); });
    EXPECT_NE(message.find("cannot name a checkpoint"), std::string::npos) << message;
  }
  EXPECT_FALSE(loom::Checkpointer::find_latest(dir));
}

// Objects with JSON state: saved by name, checked before anything changes, loaded after.
TEST(Checkpoint, ObjectsWithJsonStateRoundTripAndARefusalChangesNothing) {
  const std::string dir = fresh_dir("objects");
  Training a("adam", 4);
  a.steps(1);
  int epoch_of_loader = 7;
  loom::Checkpointer c(nullptr, {.directory = dir, .async = false});
  a.attach(c);
  auto loader_state = [&](int& target) {
    return loom::Checkpointer::ObjectState{
        [&target] { return "{\"epoch\": " + std::to_string(target) + "}"; },
        [](const std::string& text) {
          if (json::parse(text)["epoch"].get<int>() < 0) throw std::invalid_argument("negative epoch");
        },
        [&target](const std::string& text) { target = json::parse(text)["epoch"].get<int>(); }};
  };
  c.object("loader", loader_state(epoch_of_loader));
  c.save({.step = 1});

  Training b("adam", 5);
  b.steps(1);
  int restored = -1;
  loom::Checkpointer cb(nullptr, {.directory = dir});
  b.attach(cb);
  cb.object("loader", loader_state(restored));
  ASSERT_TRUE(cb.load_latest());
  EXPECT_EQ(restored, 7);

  // A state the object refuses: CheckpointError, and neither the object nor the model changed.
  epoch_of_loader = -3;
  c.save({.step = 2});
  restored = 11;
  const auto before = snapshot(b);
  const std::string message = expect_checkpoint_error([&] { cb.load_latest(); });
  EXPECT_NE(message.find("the state of object \"loader\" is refused: negative epoch"), std::string::npos) << message;
  EXPECT_EQ(restored, 11);
  expect_same(before, snapshot(b));
}

// LBFGS keeps a closure's history, not tensors per parameter: refused by name at save.
TEST(Checkpoint, LbfgsIsRefusedByName) {
  Net net;
  torch::optim::LBFGS lbfgs(net->parameters());
  loom::Checkpointer c(nullptr, {.directory = fresh_dir("lbfgs")});
  c.model(*net).optimizer(lbfgs);
  const std::string message = expect_checkpoint_error([&] { c.save({.step = 1}); });
  EXPECT_NE(message.find("LBFGS cannot be checkpointed"), std::string::npos) << message;
}

// One tracker per device type: a second CPU tracker would save its streams over the first's keys.
TEST(Checkpoint, RefusesTwoTrackersOfOneDeviceType) {
  loom::RngTracker cpu_a, cpu_b;
  loom::Checkpointer c(nullptr, {.directory = fresh_dir("two_trackers")});
  c.rng(cpu_a).rng(cpu_a);  // the same tracker twice is one registration
  c.rng(loom::rng_tracker(c10::Device(c10::kCUDA, 0)));  // another device type: accepted
  try {
    c.rng(cpu_b);
    FAIL() << "a second CPU tracker was accepted";
  } catch (const loom::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("one tracker per device type"), std::string::npos) << e.what();
  }
}

// ---- Corruption ------------------------------------------------------------------------------------

struct Saved {
  std::string dir, step_dir, shard, manifest;
};

Saved save_one(const std::string& name) {
  Saved s;
  s.dir = fresh_dir(name);
  Training a("adam", 5);
  a.steps(2);
  loom::Checkpointer c(nullptr, {.directory = s.dir, .async = false});
  a.attach(c);
  c.save({.step = 7});
  s.step_dir = s.dir + "/step_000007";
  s.shard = s.step_dir + "/shard-00000-of-00001.safetensors";
  s.manifest = s.step_dir + "/manifest.json";
  return s;
}

// Loads into a fresh state: the checkpoint of save_one, at its step.
void expect_loads(const Saved& s) {
  Training b("adam", 42);
  loom::Checkpointer c(nullptr, {.directory = s.dir});
  b.attach(c);
  const auto info = c.load_latest();
  ASSERT_TRUE(info);
  EXPECT_EQ(info->progress.step, 7);
}

// Loads into a fresh state and checks that the failure names what it should and changed nothing.
void expect_load_fails(const Saved& s, const std::vector<std::string>& parts) {
  Training b("adam", 42);
  b.steps(1);
  const auto before = snapshot(b);
  loom::Checkpointer c(nullptr, {.directory = s.dir});
  b.attach(c);
  const std::string message = expect_checkpoint_error([&] { c.load_latest(); });
  for (const auto& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in\n" << message;
  EXPECT_NE(message.find("nothing was changed"), std::string::npos) << message;
  expect_same(before, snapshot(b));
}

TEST(CheckpointCorruption, FlippedByteInData) {
  auto s = save_one("flip");
  std::string bytes = read_file(s.shard);
  bytes[bytes.size() - 3] ^= 0x10;
  write_file(s.shard, bytes);
  expect_load_fails(s, {s.shard, "checksum mismatch"});
}

TEST(CheckpointCorruption, FlippedByteInHeader) {
  auto s = save_one("flip_header");
  std::string bytes = read_file(s.shard);
  const size_t at = bytes.find("\"shape\":[") + 9;  // a dimension digit
  bytes[at] = bytes[at] == '1' ? '2' : '1';
  write_file(s.shard, bytes);
  expect_load_fails(s, {s.shard});
}

TEST(CheckpointCorruption, Truncation) {
  auto s = save_one("truncate");
  std::string bytes = read_file(s.shard);
  write_file(s.shard, bytes.substr(0, bytes.size() - 100));
  expect_load_fails(s, {s.shard, "truncated"});
}

TEST(CheckpointCorruption, MissingShard) {
  auto s = save_one("missing");
  fs::remove(s.shard);
  expect_load_fails(s, {"cannot open " + s.shard, "No such file"});
}

// A FIFO where a shard or the latest pointer should be: a clear error at once, never a rank
// blocked in open() (where no timeout applies).
TEST(CheckpointCorruption, FifoInsteadOfAShardOrLatestDoesNotBlock) {
  auto s = save_one("fifo");
  fs::remove(s.shard);
  ASSERT_EQ(::mkfifo(s.shard.c_str(), 0644), 0);
  const auto start = std::chrono::steady_clock::now();
  expect_load_fails(s, {s.shard, "is not a regular file (a FIFO)"});
  const std::string latest = s.dir + "/latest";
  fs::remove(latest);
  ASSERT_EQ(::mkfifo(latest.c_str(), 0644), 0);
  EXPECT_EQ(loom::Checkpointer::find_latest(s.dir), s.step_dir);  // the pointer is skipped, the scan finds it
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), loom::test::time_bound(5.0))
      << loom::test::time_scale_note();
}

TEST(CheckpointCorruption, HeaderClaims2To60Bytes) {
  auto s = save_one("huge_header");
  std::string bytes = read_file(s.shard);
  const uint64_t huge = uint64_t(1) << 60;
  std::memcpy(bytes.data(), &huge, 8);
  write_file(s.shard, bytes);
  expect_load_fails(s, {s.shard, "header claims 1152921504606846976 bytes"});
}

TEST(CheckpointCorruption, EditedManifest) {
  auto s = save_one("manifest");
  const std::string original = read_file(s.manifest);
  json m = json::parse(original);
  // Each edit is resealed (its checksum recomputed), as a buggy tool would write it: the checks
  // behind the manifest's own checksum must still catch it.
  auto edit = [&](const std::function<void(json&)>& change, const std::vector<std::string>& parts) {
    json copy = m;
    change(copy);
    write_file(s.manifest, ckpt::reseal_manifest(copy.dump(1)));
    expect_load_fails(s, parts);
  };
  edit([](json& j) { j["format_version"] = 4; },
       {s.manifest, "unsupported format version 4 (this build reads versions 1 to 3)"});
  edit([](json& j) { j["shards"][0]["xxh3_64"] = "0123456789abcdef"; },
       {s.shard, "checksum mismatch", "0123456789abcdef"});
  edit([](json& j) { j["shards"][0]["bytes"] = j["shards"][0]["bytes"].get<uint64_t>() + 1; },
       {s.shard, "the manifest says"});
  // A split tensor whose one slice no longer covers it.
  edit([](json& j) { j["tensors"]["model/col.weight"]["slices"][0]["length"] = 4; },
       {"tensor \"model/col.weight\"", "cover [0, 4) of a dimension of 6"});
  edit(
      [](json& j) {
        auto& t = j["tensors"]["model/col.weight"];
        t["slices"] =
            json::array({{{"shard", 0}, {"offset", 0}, {"length", 4}}, {{"shard", 0}, {"offset", 2}, {"length", 4}}});
      },
      {"tensor \"model/col.weight\"", "places two slices in shard 0"});
  // The manifest's shape disagrees with the shard (and with the model).
  edit(
      [](json& j) {
        j["tensors"]["model/fc1.weight"]["shape"] = {8, 5};
      },
      {"model/fc1.weight: checkpoint Float [8, 5], live Float [8, 4]"});
  edit([](json& j) { j["tensors"]["model/fc1.weight"]["dtype"] = "F64"; }, {"model/fc1.weight"});
  edit([](json& j) { j.erase("shards"); }, {s.manifest, "has no \"shards\""});
  // Hyper-parameters the optimizer's constructor would refuse, found on a scratch optimizer.
  edit([](json& j) { j["state"]["optimizer"]["param_groups"][0]["options"]["lr"] = -1.0; },
       {"optimizer parameter group 0: options refused by Adam", "Invalid learning rate"});
  // Hyper-parameters the constructor takes but the parameters' dtype (float) cannot hold: the
  // first step after the load would fail converting them (the loader fuzz's find).
  edit([](json& j) { j["state"]["optimizer"]["param_groups"][0]["options"]["weight_decay"] = 1e308; },
       {"optimizer parameter group 0: option \"weight_decay\" is 1e+308", "dtype Float cannot hold"});
  edit([](json& j) { j["state"]["optimizer"]["param_groups"][0]["options"]["eps"] = 3.5e38; },
       {"option \"eps\" is 3.5e+38", "dtype Float cannot hold"});
  // State the live object would refuse is refused before the model changes (it was applied after).
  edit([](json& j) { j["state"]["scaler"]["growth_factor"] = 0.5; }, {"grad scaler state refused", "growth_factor must be > 1.0"});
  // Values beyond what holds them: an interval no int64 holds exactly, a scale float32 rounds to 0.
  edit([](json& j) { j["state"]["scaler"]["growth_interval"] = 1e308; },
       {"grad scaler state refused", "growth_interval must be an integer in [1, 2^53], found 1e+308"});
  edit([](json& j) { j["state"]["scaler"]["scale"] = 1e-320; }, {"grad scaler state refused", "not rounding to 0"});
  // Progress before the start, beyond int64, or of another step than the manifest's.
  edit([](json& j) { j["progress"]["step"] = -1; }, {"manifest progress \"step\" is -1; expected an integer in [0, 2^63)"});
  edit([](json& j) { j["progress"]["sample"] = uint64_t(UINT64_MAX); }, {"manifest progress \"sample\" is 18446744073709551615"});
  edit([](json& j) { j["progress"]["step"] = 8; }, {"manifest progress is at step 8; the manifest is of step 7"});
  // Replicated optimizer state of another shape than its parameter (every state tensor of the
  // optimizers supported has its parameter's shape).
  edit(
      [](json& j) {
        auto& r = j["tensors"]["optim/fc1.weight/exp_avg"];
        r["shape"] = {32};
        r["split_dim"] = nullptr;
      },
      {"optimizer state optim/fc1.weight/exp_avg [32] does not match model/fc1.weight [8, 4]"});
  write_file(s.manifest, original.substr(0, original.size() / 2));
  expect_load_fails(s, {s.manifest, "is not a JSON object"});
}

// A load while the RNG tracker is inside fork() cannot restore its streams: refused before anything
// changes (the tracker used to throw after the model and optimizer had been loaded), and the same
// load succeeds once the fork ends.
TEST(CheckpointCorruption, LoadInsideAnRngForkIsRefusedChangingNothing) {
  auto s = save_one("rng_fork");
  Training b("adam", 42);
  b.steps(1);
  loom::Checkpointer c(nullptr, {.directory = s.dir});
  b.attach(c);
  {
    auto guard = b.tracker.fork();
    const auto before = snapshot(b);
    const std::string message = expect_checkpoint_error([&] { c.load_latest(); });
    for (const char* part : {"an RNG tracker cannot take the saved streams now", "is forked", "nothing was changed"})
      EXPECT_NE(message.find(part), std::string::npos) << part << " in\n" << message;
    expect_same(before, snapshot(b));
  }
  EXPECT_TRUE(c.load_latest().has_value());
}

// The manifest says which bytes are which tensor: an edit of one digit that is not resealed (a
// slice's shard, a step) is refused by the manifest's own checksum, naming the manifest.
TEST(CheckpointCorruption, UnsealedManifestEditIsRefused) {
  auto s = save_one("manifest_unsealed");
  const std::string original = read_file(s.manifest);
  std::string edited = original;
  const size_t at = edited.find("\"shard\": 0");
  ASSERT_NE(at, std::string::npos) << original.substr(0, 800);
  edited.replace(at, 10, "\"shard\": 1");
  write_file(s.manifest, edited);
  expect_load_fails(s, {s.manifest, "was changed after it was written"});
  // Removing the checksum is refused too; re-indenting the document is harmless.
  json doc = json::parse(original);
  doc.erase("manifest_xxh3_64");
  write_file(s.manifest, doc.dump(1));
  expect_load_fails(s, {s.manifest, "has no \"manifest_xxh3_64\""});
  write_file(s.manifest, nlohmann::ordered_json::parse(original).dump(4));
  expect_loads(s);
}

// Version-1 manifests (before manifests were checksummed) still load.
// Version-1 manifests (before manifests were checksummed) still load, with their version-1 shards
// (no step or slice metadata). A version-2 checkpoint whose manifest claims version 1, to skip its
// checksum, is refused: by the checksum a version-1 manifest cannot carry, or, that removed too, by
// the shards' version-2 metadata.
TEST(CheckpointCorruption, VersionOneManifestStillLoadsButADowngradedOneIsRefused) {
  auto s = save_one("manifest_v1");
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(read_file(s.manifest));
  // Before version 3 the sections were members of their own.
  doc["format_version"] = 1;
  doc["optimizer"] = doc["state"].value("optimizer", nlohmann::ordered_json());
  doc["scaler"] = doc["state"].value("scaler", nlohmann::ordered_json());
  doc.erase("state");
  write_file(s.manifest, doc.dump(1));
  expect_load_fails(s, {s.manifest, "says format version 1, which carries no checksum of its own",
                        "its version was edited"});
  doc.erase("manifest_xxh3_64");
  write_file(s.manifest, doc.dump(1));
  expect_load_fails(s, {s.shard, "carries torchloom.step metadata (format version 2 or later) under a manifest of "
                                 "format version 1"});
  // A genuine version-1 checkpoint: its shard has no such metadata (removed here, the header kept
  // at its length, the file's checksum updated).
  std::string bytes = read_file(s.shard);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, header_bytes));
  header["__metadata__"].erase("torchloom.step");
  header["__metadata__"].erase("torchloom.slices");
  std::string text = header.dump();
  ASSERT_LE(text.size(), header_bytes);
  text.resize(header_bytes, ' ');
  bytes.replace(8, header_bytes, text);
  write_file(s.shard, bytes);
  doc["shards"][0]["xxh3_64"] = ckpt::to_hex(ckpt::checksum_of(bytes.data(), bytes.size()));
  write_file(s.manifest, doc.dump(1));
  expect_loads(s);
}

TEST(CheckpointCorruption, ParameterNamesAndShapesAreListedAsADiff) {
  auto s = save_one("names");
  struct OtherImpl : torch::nn::Module {
    OtherImpl() {
      register_module("fc1", torch::nn::Linear(4, 8));
      register_module("bn", torch::nn::BatchNorm1d(8));
      register_module("col", loom::ColumnParallelLinear(8, 6, nullptr));
      register_module("head", torch::nn::Linear(6, 3));  // was fc2
    }
  };
  auto other = std::make_shared<OtherImpl>();
  loom::Checkpointer c(nullptr, {.directory = s.dir});
  c.model(*other);
  const std::string message = expect_checkpoint_error([&] { c.load_latest(); });
  for (const char* part :
       {"tensor names differ", "- model/fc2.weight", "- model/fc2.bias", "+ model/head.weight", "+ model/head.bias"})
    EXPECT_NE(message.find(part), std::string::npos) << part << " in\n" << message;
  Net wider(5);  // fc2 is [5, 6]
  loom::Checkpointer c2(nullptr, {.directory = s.dir});
  c2.model(wider);
  const std::string message2 = expect_checkpoint_error([&] { c2.load_latest(); });
  EXPECT_NE(message2.find("model/fc2.weight: checkpoint Float [3, 6], live Float [5, 6]"), std::string::npos)
      << message2;
}

// The manifest with one of its numbers or strings replaced by a hostile value.
std::string hostile_value(const std::string& manifest, std::mt19937_64& rng) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(manifest);
  loom::test::replace_random_leaf(doc, rng);
  return doc.dump(1);
}

// Random mutations of the shard and the manifest (half of the manifest's resealed, so the checks
// behind its checksum are reached too), from a fresh seed each run (printed; LOOM_FUZZ_SEED replays
// one), for at most 10 s: every load either succeeds or raises CheckpointError having changed
// nothing at all.
// A data loader's position as a checkpoint object (JSON state, checked before any change).
struct Sampler {
  int64_t position = 0;
  static int64_t parse(const std::string& text) {
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("position") || !j["position"].is_number_integer() ||
        j["position"].get<int64_t>() < 0 || j["position"].get<int64_t>() > 1000000)
      throw std::invalid_argument("sampler state " + text + ": expected {\"position\": 0..1000000}");
    return j["position"].get<int64_t>();
  }
  loom::Checkpointer::ObjectState state() {
    return {[this] { return json{{"position", position}}.dump(); }, [](const std::string& text) { parse(text); },
            [this](const std::string& text) { position = parse(text); }};
  }
};

TEST(CheckpointCorruption, LoaderFuzzRefusesWithCheckpointErrorAndChangesNothing) {
  Saved s;
  s.dir = fresh_dir("loader_fuzz");
  {
    Training a("adam", 5);
    a.steps(2);
    Sampler sampler{17};
    loom::Checkpointer c(nullptr, {.directory = s.dir, .async = false});
    a.attach(c);
    c.object("sampler", sampler.state());
    c.save({.step = 7});
  }
  s.step_dir = s.dir + "/step_000007";
  s.shard = s.step_dir + "/shard-00000-of-00001.safetensors";
  s.manifest = s.step_dir + "/manifest.json";
  const std::string shard = read_file(s.shard), manifest = read_file(s.manifest);
  const char* fixed = std::getenv("LOOM_FUZZ_SEED");
  const uint64_t seed = fixed ? std::strtoull(fixed, nullptr, 10) : std::random_device{}();
  std::printf("loader fuzz seed %llu (LOOM_FUZZ_SEED=%llu replays it)\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(seed));
  SCOPED_TRACE("LOOM_FUZZ_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Training b("adam", 3);
  b.steps(1);
  loom::Checkpointer c(nullptr, {.directory = s.dir});
  b.attach(c);
  Sampler sampler{3};
  c.object("sampler", sampler.state());
  auto everything = [&] {
    auto all = snapshot(b);
    all["sampler"] = at::tensor({sampler.position});
    return all;
  };
  auto before = everything();
  int refused = 0, loaded = 0, iterations = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  // At least 200 mutations however slow the machine (so the share refused is a share), then until
  // the deadline.
  for (; iterations < 2000 && (iterations < 200 || std::chrono::steady_clock::now() < deadline); ++iterations) {
    // 0: manifest bytes, 1: the same resealed, 2: shard bytes, 3: one value of the manifest replaced
    // by a hostile one and resealed (reaches the range checks of every provider).
    const int target = static_cast<int>(rng() % 4);
    if (target == 2) {
      write_file(s.shard, mutate(shard, rng));
    } else if (target == 3) {
      write_file(s.manifest, ckpt::reseal_manifest(hostile_value(manifest, rng)));
    } else {
      std::string edited = mutate(manifest, rng);
      if (target == 1) {
        try {
          edited = ckpt::reseal_manifest(edited);
        } catch (const std::exception&) {
          // Not JSON any more: written as it is.
        }
      }
      write_file(s.manifest, edited);
    }
    try {
      c.load(s.step_dir);
      ++loaded;
      // A harmless edit (a resealed user value, say) loaded. The live state moves away from the
      // checkpoint's again, so that a later partial load would show: the new baseline.
      b.steps(1);
      sampler.position += 1;
      before = everything();
    } catch (const loom::CheckpointError&) {
      ++refused;
      const auto after = everything();
      bool same = after.size() == before.size();
      for (const auto& [k, v] : before) same = same && after.count(k) && at::equal(v, after.at(k));
      ASSERT_TRUE(same) << "iteration " << iterations << ": a refused load changed the state";
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iterations << ": not a CheckpointError: " << e.what();
    }
    write_file(s.shard, shard);
    write_file(s.manifest, manifest);
  }
  std::printf("loader fuzz: %d mutations, %d refused, %d loaded\n", iterations, refused, loaded);
  EXPECT_GT(refused, iterations / 2);
}

// A shard copied in from another step's checkpoint (its manifest record resealed to match it) is
// refused by the step the shard records of itself.
TEST(CheckpointCorruption, ShardOfAnotherStepIsRefused) {
  auto s = save_one("other_step");
  Training a("adam", 5);
  a.steps(2);
  loom::Checkpointer c(nullptr, {.directory = s.dir, .async = false});
  a.attach(c);
  c.save({.step = 8});
  const std::string other = read_file(s.dir + "/step_000008/shard-00000-of-00001.safetensors");
  write_file(s.shard, other);
  json m = json::parse(read_file(s.manifest));
  m["shards"][0]["bytes"] = other.size();
  m["shards"][0]["xxh3_64"] = ckpt::to_hex(ckpt::checksum_of(other.data(), other.size()));
  write_file(s.manifest, ckpt::reseal_manifest(m.dump(1)));
  write_file(s.dir + "/latest", "step_000007\n");
  expect_load_fails(s, {s.shard, "the shard was written at step 8; the manifest is of step 7"});
}

// consolidate_checkpoint: every parameter whole, byte for byte the saved one, read back from the
// file it writes; optimizer state only when asked for; RNG states never.
TEST(CheckpointConsolidate, ParametersWholeAndOptimizerStateOnlyWhenAsked) {
  const std::string dir = fresh_dir("consolidate");
  Training a("adam", 3);
  a.steps(2);
  loom::Checkpointer c(nullptr, {.directory = dir, .async = false});
  a.attach(c);
  c.save({.step = 2});
  auto read_back = [&](bool optimizer) {
    const std::string out = dir + (optimizer ? "/with_optimizer.safetensors" : "/model.safetensors");
    const auto info = loom::consolidate_checkpoint(dir + "/step_000002", out, {.optimizer = optimizer});
    const std::string bytes = read_file(out);
    const auto header = ckpt::parse_shard(bytes, out);
    EXPECT_EQ(info.tensors, header.tensors.size());
    std::map<std::string, at::Tensor> tensors;
    for (const auto& e : header.tensors)
      tensors[e.name] = at::from_blob(const_cast<char*>(bytes.data()) + header.data_start + e.begin, e.shape,
                                      at::TensorOptions().dtype(e.dtype))
                            .clone();
    return tensors;
  };
  const auto model_only = read_back(false);
  for (const auto& p : a.net->named_parameters()) {
    ASSERT_TRUE(model_only.count(p.key())) << p.key();
    EXPECT_TRUE(at::equal(model_only.at(p.key()), p.value().detach())) << p.key();  // col's slices joined
  }
  for (const auto& [name, t] : model_only) {
    EXPECT_EQ(name.rfind("optim/", 0), std::string::npos) << name;
    EXPECT_EQ(name.find("rng"), std::string::npos) << name;
  }
  const auto with_optimizer = read_back(true);
  auto* state = loom::find_optimizer_state(*a.opt, a.net->named_parameters()["fc1.weight"]);
  ASSERT_NE(state, nullptr);
  for (const auto& [key, t] : loom::optimizer_state_tensors(loom::OptimizerKind::Adam, *state)) {
    ASSERT_TRUE(with_optimizer.count("optim/fc1.weight/" + key)) << key;
    EXPECT_TRUE(at::equal(with_optimizer.at("optim/fc1.weight/" + key), t)) << key;
  }
  EXPECT_GT(with_optimizer.size(), model_only.size());
}

// ---- Directory management --------------------------------------------------------------------------

TEST(CheckpointDirectory, RotationLatestAndIncompleteDirectories) {
  const std::string dir = fresh_dir("rotation");
  Training a("sgd", 2);
  loom::Checkpointer c(nullptr, {.directory = dir, .keep_last = 2});
  a.attach(c);
  EXPECT_FALSE(loom::Checkpointer::find_latest(dir));
  EXPECT_FALSE(c.load_latest());
  for (int step = 1; step <= 4; ++step) {
    a.steps(1);
    c.save({.step = step});
    c.wait();
  }
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"latest", "step_000003", "step_000004"}));
  EXPECT_EQ(read_file(dir + "/latest"), "step_000004\n");
  // A directory without a manifest is not a checkpoint, whatever its step; a hidden temporary one
  // neither.
  fs::create_directories(dir + "/step_000009");
  write_file(dir + "/step_000009/shard-00000-of-00001.safetensors", "partial");
  fs::create_directories(dir + "/.step_000010.tmp-1234");
  EXPECT_EQ(*loom::Checkpointer::find_latest(dir), dir + "/step_000004");
  fs::remove(dir + "/latest");  // no pointer: the highest complete step
  EXPECT_EQ(*loom::Checkpointer::find_latest(dir), dir + "/step_000004");
  write_file(dir + "/latest", "step_000003\n");  // the pointer wins over a higher step
  EXPECT_EQ(*loom::Checkpointer::find_latest(dir), dir + "/step_000003");
  write_file(dir + "/latest", "../../etc\n");  // a pointer that names no checkpoint is ignored
  EXPECT_EQ(*loom::Checkpointer::find_latest(dir), dir + "/step_000004");

  // Saving a step again replaces it; stale temporary directories are cleaned up.
  const auto first = snapshot(a);
  a.steps(1);
  const auto second = snapshot(a);
  c.save({.step = 4});
  c.wait();
  EXPECT_FALSE(fs::exists(dir + "/.step_000010.tmp-1234"));
  Training b("sgd", 77);
  loom::Checkpointer cb(nullptr, {.directory = dir});
  b.attach(cb);
  EXPECT_EQ(cb.load_latest()->path, dir + "/step_000004");
  expect_same(second, snapshot(b));
  (void)first;
}

TEST(CheckpointDirectory, KeepLastNeverDeletesTheNewest) {
  const std::string dir = fresh_dir("newest");
  Training a("sgd", 2);
  loom::Checkpointer c(nullptr, {.directory = dir, .keep_last = 1, .async = false});
  a.attach(c);
  c.save({.step = 20});
  c.save({.step = 10});  // a resumed run saving below an existing step: the just-written one stays
  EXPECT_TRUE(fs::exists(dir + "/step_000010/manifest.json"));
  EXPECT_EQ(read_file(dir + "/latest"), "step_000010\n");
  EXPECT_EQ(*loom::Checkpointer::find_latest(dir), dir + "/step_000010");
}

// ---- Interoperability: Python's safetensors reads every shard ---------------------------------------

TEST(CheckpointInterop, PythonSafetensorsReadsEveryShard) {
  const std::string dir = fresh_dir("interop");
  Training a("adamw", 4);
  a.steps(2);
  loom::Checkpointer c(nullptr, {.directory = dir, .async = false});
  a.attach(c);
  at::Tensor f64 = at::arange(5, at::kDouble) / 7;  // every dtype the tests can compare exactly
  at::Tensor i32 = at::arange(-3, 3, at::kInt);
  at::Tensor u8 = at::arange(250, 256).to(at::kByte);
  c.tensor("f64", f64).tensor("i32", i32).tensor("u8", u8);
  at::Tensor flags = at::tensor({1, 0, 1}).to(at::kBool);
  at::Tensor half = at::arange(6, at::kFloat).to(at::kHalf).reshape({2, 3});
  at::Tensor bf = at::arange(4, at::kFloat).to(at::kBFloat16) / 3;
  c.tensor("flags", flags).tensor("half", half).tensor("bf16", bf);
  c.save({.step = 1});
  // The expected content of every tensor, as float64 lists (exact for every dtype used here).
  json expected = json::object();
  auto add = [&](const std::string& name, const at::Tensor& t) {
    at::Tensor d = t.detach().to(at::kDouble).contiguous().reshape({-1});
    expected[name] = {{"shape", t.sizes().vec()},
                      {"values", std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel())}};
  };
  for (const auto& p : a.net->named_parameters()) add("model/" + p.key(), p.value());
  for (const auto& b : a.net->named_buffers()) add("model/" + b.key(), b.value());
  add("extra/f64", f64);
  add("extra/i32", i32);
  add("extra/u8", u8);
  add("extra/flags", flags);
  add("extra/half", half);
  add("extra/bf16", bf);
  add("extra/ema", a.ema);
  write_file(dir + "/expected.json", expected.dump());
  const std::string command = std::string(LOOM_PYTHON) + " " + LOOM_SOURCE_DIR + "/tests/python/check_safetensors.py " +
                              dir + "/step_000001 " + dir + "/expected.json";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

}  // namespace
