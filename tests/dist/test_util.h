// Helpers for the multi-rank tests: the world communicator, and inputs whose reductions are
// exact in every supported dtype so that expected values can be computed independently.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "loom/comm/agreement.h"
#include "loom/comm/communicator.h"
#include "loom/comm/gloo.h"
#include "loom/comm/mpi.h"
#include "loom/error.h"
#include "loom/runtime.h"
#include "../time_scale.h"

namespace loom::test {

// True when the job started through the env:// rendezvous (torchrun): the world is a Gloo one.
inline bool gloo_bootstrap() {
  return std::string(loom::init()->world_comm()->backend()) == "gloo";
}

// A fresh communicator over the whole job from the bootstrap the job started with: MPI under
// mpirun, Gloo under torchrun. Collective: every rank calls it, in the same order.
inline std::shared_ptr<Communicator> fresh_world(const CommunicatorOptions& options = {}) {
  if (gloo_bootstrap()) return gloo::world_communicator(gloo::rendezvous_from_environment(), options);
  return mpi::world_communicator(options);
}

// For tests of what only the MPI backend does (its progress thread's counters, the size check
// before host collectives move data).
#define LOOM_SKIP_UNLESS_MPI(why)                                                          \
  do {                                                                                     \
    if (::loom::test::gloo_bootstrap()) GTEST_SKIP() << "MPI backend only: " << (why);     \
  } while (0)

// The message of the InvalidArgumentError `call` raises ("not rejected", or the wrong type's, otherwise).
template <typename Call>
std::string rejection(Call call) {
  try {
    call();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "not rejected";
}

inline void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "message: " << text << "\nexpected to contain: " << part;
}

inline std::shared_ptr<Communicator> world() { return loom::init()->world_comm(); }

// A smaller data-parallel group for resuming at another size: the first half of the world's ranks
// (null on the others), or the world alone at one rank. Collective over the world.
inline std::shared_ptr<Communicator> first_half_of_the_world() {
  auto all = world();
  if (all->size() == 1) return all;
  const bool in = all->rank() < all->size() / 2;
  return all->split(in ? 0 : -1, all->rank(), "first half");
}

inline const std::vector<at::ScalarType>& all_dtypes() {
  static const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kChar,
                                                     at::kByte,  at::kInt,    at::kLong, at::kBool};
  return dtypes;
}

// Rank r's input for a reduction: small integers, so sums and products over 4 ranks are exact
// even in int8, float16 and bfloat16. For product the values are 1 or 2.
inline at::Tensor rank_input(int rank, at::IntArrayRef shape, at::ScalarType dtype, bool for_product = false) {
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  at::Tensor i = at::arange(numel, at::kLong);
  at::Tensor values;
  if (dtype == at::kBool) {
    values = ((i + rank) % 3).eq(0);
  } else if (for_product) {
    values = 1 + (i + rank) % 2;
  } else {
    values = (rank + 1) + (i % 3) * ((rank % 2) ? -1 : 1) + (dtype == at::kByte || dtype == at::kBool ? 2 : 0);
  }
  return values.to(dtype).reshape(shape).contiguous();
}

// The reduction of every rank's input, computed on this rank alone in float64.
inline at::Tensor expected_reduction(int size, at::IntArrayRef shape, at::ScalarType dtype, ReduceOp op) {
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < size; ++r)
    inputs.push_back(rank_input(r, shape, dtype, op == ReduceOp::Product).to(at::kDouble));
  at::Tensor all = at::stack(inputs);
  at::Tensor result;
  switch (op) {
    case ReduceOp::Sum: result = all.sum(0); break;
    case ReduceOp::Avg: result = all.sum(0) / size; break;
    case ReduceOp::Product: result = all.prod(0); break;
    case ReduceOp::Min: result = std::get<0>(all.min(0)); break;
    case ReduceOp::Max: result = std::get<0>(all.max(0)); break;
  }
  if (dtype == at::kBool) {
    // Sum and max are logical or; min and product logical and.
    result = (op == ReduceOp::Sum || op == ReduceOp::Max) ? all.ne(0).any(0) : all.ne(0).all(0);
  }
  return result.to(dtype);
}

inline std::string name_of(at::ScalarType t) { return c10::toString(t); }

// A directory every rank agrees on (rank 0's pid names it), empty at the start. Collective.
inline std::string shared_dir(const std::string& name) {
  auto comm = world();
  at::Tensor id = at::full({1}, comm->rank() == 0 ? static_cast<int64_t>(::getpid()) : 0, at::kLong);
  comm->all_reduce(id, {ReduceOp::Max})->wait();
  const std::string dir = ::testing::TempDir() + "loom_ckpt_" + name + "_np" + std::to_string(comm->size()) + "_" +
                          std::to_string(id.item<int64_t>());
  if (comm->rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  comm->barrier()->wait();
  return dir;
}

// Removes a shared_dir once every rank is done with it. Collective.
inline void cleanup(const std::string& dir) {
  world()->barrier()->wait();
  if (world()->rank() == 0) std::filesystem::remove_all(dir);
}

// A file that every rank reads and one rank rewrites, in the only safe order. Rank 0 reads it and
// hands its bytes to every rank (`original()`); `rewrite` waits until every rank is done with what
// it read before (a barrier), writes on rank 0 alone, and returns on every rank once the new bytes
// are in place (a second barrier). A test that edits a file others read goes through this, never
// through a write of its own: a rank rewriting a manifest while another still reads it made
// CheckpointDist fail with "manifest.json is truncated" (tests/dist/check_shared_file_writes.py
// refuses any other way of writing a file in these tests).
//
//   test::SharedFile manifest(*world, dir + "/step_000002/manifest.json");   // collective
//   auto doc = nlohmann::ordered_json::parse(manifest.original());
//   manifest.rewrite(ckpt::reseal_manifest(doc.dump(1)));                   // collective
class SharedFile {
 public:
  SharedFile(Communicator& comm, std::string path) : comm_(comm), path_(std::move(path)) {
    std::string bytes;
    int64_t size = -1;
    if (comm_.rank() == 0) {
      std::ifstream in(path_, std::ios::binary);
      if (in) {
        bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        size = static_cast<int64_t>(bytes.size());
      }
    }
    size = broadcast_values(comm_, std::vector<int64_t>{size}, 0, {"shared file size"})[0];
    if (size < 0) throw Error("test::SharedFile: rank 0 could not read " + path_);
    at::Tensor data = at::empty({size}, at::kByte);
    if (comm_.rank() == 0) std::copy(bytes.begin(), bytes.end(), data.data_ptr<uint8_t>());
    comm_.broadcast(data, {0})->wait();
    original_.assign(reinterpret_cast<const char*>(data.data_ptr<uint8_t>()), static_cast<size_t>(size));
  }

  const std::string& original() const { return original_; }
  const std::string& path() const { return path_; }

  // Collective: every rank's reads of the file are over, rank 0 writes `content`, every rank sees it.
  void rewrite(const std::string& content) {
    comm_.barrier()->wait();
    if (comm_.rank() == 0) {
      std::ofstream out(path_, std::ios::binary | std::ios::trunc);
      out << content;
      out.close();
      EXPECT_TRUE(out.good()) << "writing " << path_;
    }
    comm_.barrier()->wait();
  }

 private:
  Communicator& comm_;
  std::string path_;
  std::string original_;
};

// The seed of a fuzz test, the same on every rank: LOOM_FUZZ_SEED's if set (a replay), otherwise
// rank 0's fresh one. Rank 0 prints it under `what`. Collective.
inline uint64_t fuzz_seed(Communicator& comm, const char* what) {
  const char* fixed = std::getenv("LOOM_FUZZ_SEED");
  const int64_t mine = fixed ? std::strtoll(fixed, nullptr, 10) : static_cast<int64_t>(std::random_device{}() >> 1);
  const auto seed = static_cast<uint64_t>(broadcast_values(comm, std::vector<int64_t>{mine}, 0, {"fuzz seed"})[0]);
  if (comm.rank() == 0)
    std::printf("%s seed %llu (LOOM_FUZZ_SEED replays it)\n", what, static_cast<unsigned long long>(seed));
  return seed;
}

}  // namespace loom::test
