// Probe: LibTorch's own c10d::TCPStore and c10d::ProcessGroupGloo, used from C++ with an
// env:// bootstrap (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) as torchrun sets it, and no MPI.
// The torch wheel ships ProcessGroupGloo.hpp but not the Gloo headers it includes; they come from
// third_party/gloo/include (see its README.md). Each check compares against a closed-form value
// and names the rank, the operation, what was expected and what was found; the exit status is 0
// only when every check matched.
//
//   gloo_probe            the checks (store key exchange, allreduce, allgather, barrier, a
//                         completion callback on the work's future)
//   gloo_probe --bench N  median wall time of N allreduces (sum, float32) at 4 B, 64 KiB, 4 MiB
//                         and 64 MiB, printed by rank 0 (compare benchmarks/gloo_allreduce_ref.py)

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr auto kTimeout = std::chrono::seconds(60);

int g_rank = -1;
int g_failures = 0;

// Records a mismatch instead of stopping: one run shows every check that failed.
void expect(bool ok, const std::string& operation, const std::string& expected, const std::string& found) {
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "gloo_probe rank %d: %s: expected %s, found %s\n", g_rank, operation.c_str(), expected.c_str(),
               found.c_str());
}

std::string env_or_die(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    throw std::runtime_error(std::string("environment variable ") + name +
                             " is not set (run under torchrun or set the env:// variables)");
  }
  return value;
}

long env_int(const char* name, long lo, long hi) {
  std::string text = env_or_die(name);
  size_t used = 0;
  long value = 0;
  try {
    value = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || value < lo || value > hi) {
    throw std::runtime_error(std::string(name) + "='" + text + "': expected an integer in [" + std::to_string(lo) +
                             ", " + std::to_string(hi) + "]");
  }
  return value;
}

// The bytes a rank publishes in the key exchange: binary (a zero byte, bytes above 127) like an
// NCCL unique id, and different for every rank.
std::vector<uint8_t> blob_of(int rank) {
  std::vector<uint8_t> blob(128);
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>((rank * 131 + i * 7) & 0xff);
  blob[5] = 0;
  return blob;
}

// Store: each rank sets its key, waits for everyone's, checks them; check() of a key nobody set
// is false, and wait() on it times out within its deadline (how a departure notice that never
// comes must behave).
void check_store(c10d::Store& store, int rank, int world) {
  store.set("blob/" + std::to_string(rank), blob_of(rank));
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back("blob/" + std::to_string(r));
  store.wait(keys, kTimeout);
  expect(store.check(keys), "store.check(all blob keys) after wait", "true", "false");
  for (int r = 0; r < world; ++r) {
    auto got = store.get(keys[r]);
    expect(got == blob_of(r), "store.get(" + keys[r] + ")", "the 128 bytes rank " + std::to_string(r) + " set",
           std::to_string(got.size()) + " bytes that differ");
  }
  expect(!store.check({"never-set"}), "store.check(never-set)", "false", "true");

  auto t0 = std::chrono::steady_clock::now();
  bool timed_out = false;
  try {
    store.wait({"never-set"}, std::chrono::milliseconds(300));
  } catch (const std::exception&) {
    timed_out = true;
  }
  auto waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(timed_out, "store.wait(never-set, 300 ms)", "a timeout error", "success");
  expect(waited < 10.0, "store.wait(never-set, 300 ms) duration", "< 10 s", std::to_string(waited) + " s");

  int64_t arrivals = store.add("arrivals", 1);
  expect(arrivals >= 1 && arrivals <= world, "store.add(arrivals, 1)", "1.." + std::to_string(world),
         std::to_string(arrivals));
}

// allreduce(sum): rank r contributes (r + 1) * (i % 7 + 1) at element i; the sum is
// world * (world + 1) / 2 * (i % 7 + 1), exact in float32 for these sizes.
at::Tensor allreduce_input(int rank, int64_t n) {
  auto pattern = at::arange(n, at::kLong).remainder(7).add(1).to(at::kFloat);
  return pattern.mul(static_cast<float>(rank + 1));
}

at::Tensor allreduce_expected(int world, int64_t n) {
  auto pattern = at::arange(n, at::kLong).remainder(7).add(1).to(at::kFloat);
  return pattern.mul(static_cast<float>(world * (world + 1) / 2));
}

std::string describe_mismatch(const at::Tensor& got, const at::Tensor& want) {
  auto diff = got.ne(want).nonzero();
  if (diff.numel() == 0) return "equal";
  int64_t i = diff[0][0].item<int64_t>();
  std::ostringstream os;
  os << diff.size(0) << " differing elements, first at " << i << ": " << got[i].item<float>() << " instead of "
     << want[i].item<float>();
  return os.str();
}

void check_allreduce(c10d::ProcessGroupGloo& pg, int rank, int world, int64_t n) {
  std::vector<at::Tensor> tensors{allreduce_input(rank, n)};
  pg.allreduce(tensors)->wait(kTimeout);
  auto want = allreduce_expected(world, n);
  expect(tensors[0].equal(want), "allreduce(sum, " + std::to_string(n) + " floats)", "world*(world+1)/2*(i%7+1)",
         describe_mismatch(tensors[0], want));
}

// allgather: rank r sends [10 r, 10 r + 1, 10 r + 2]; slot s of every rank's output holds rank s's.
void check_allgather(c10d::ProcessGroupGloo& pg, int rank, int world) {
  std::vector<at::Tensor> input{at::arange(3, at::kFloat).add(10.0 * rank)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < world; ++r) output[0].push_back(at::full({3}, -1.0f));
  pg.allgather(output, input)->wait(kTimeout);
  for (int s = 0; s < world; ++s) {
    auto want = at::arange(3, at::kFloat).add(10.0 * s);
    expect(output[0][s].equal(want), "allgather slot " + std::to_string(s), "[10s, 10s+1, 10s+2]",
           describe_mismatch(output[0][s], want));
  }
}

// Completion seen without blocking on the work: a callback on its future sets a flag under a
// mutex; this thread waits for that flag (bounded), never calling work->wait().
void check_callback(c10d::ProcessGroupGloo& pg, int rank, int world) {
  const int64_t n = 1 << 20;  // large enough that the callback is usually attached before completion
  std::vector<at::Tensor> tensors{allreduce_input(rank, n)};
  auto work = pg.allreduce(tensors);
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  bool had_error = false;
  bool inline_call = false;
  bool future_completed = false;
  const auto caller = std::this_thread::get_id();
  work->getFuture()->addCallback([&](c10::ivalue::Future& future) {
    std::lock_guard<std::mutex> lock(mutex);
    had_error = future.hasError();
    future_completed = future.completed();
    inline_call = std::this_thread::get_id() == caller;
    done = true;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    bool fired = cv.wait_for(lock, kTimeout, [&] { return done; });
    expect(fired, "allreduce future callback", "called within 60 s", "not called");
  }
  expect(!had_error, "allreduce future callback", "no error", "future.hasError()");
  expect(future_completed, "future.completed() inside its callback", "true", "false");
  // ProcessGroupGloo completes the future (running its callbacks) before it marks the work
  // completed, so work->isCompleted() may still be false inside or just after the callback;
  // it must become true soon after.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!work->isCompleted() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  expect(work->isCompleted(), "work->isCompleted() after the callback", "true within 10 s", "false");
  auto want = allreduce_expected(world, n);
  expect(tensors[0].equal(want), "allreduce result seen from the callback", "world*(world+1)/2*(i%7+1)",
         describe_mismatch(tensors[0], want));
  std::printf("rank %d: callback ran on %s thread\n", rank, inline_call ? "the calling" : "a Gloo worker");
}

void bench(c10d::ProcessGroupGloo& pg, int rank, int iterations) {
  const int64_t bytes[] = {4, 64 << 10, 4 << 20, 64 << 20};
  for (int64_t size : bytes) {
    std::vector<at::Tensor> tensors{at::ones({size / 4}, at::kFloat)};
    for (int i = 0; i < 3; ++i) pg.allreduce(tensors)->wait(kTimeout);
    std::vector<double> seconds;
    for (int i = 0; i < iterations; ++i) {
      pg.barrier()->wait(kTimeout);
      auto t0 = std::chrono::steady_clock::now();
      pg.allreduce(tensors)->wait(kTimeout);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(seconds.begin(), seconds.end());
    if (rank == 0) {
      std::printf("cpp_gloo allreduce bytes=%ld median_us=%.1f\n", static_cast<long>(size),
                  seconds[seconds.size() / 2] * 1e6);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int bench_iterations = 0;
    if (argc == 3 && std::string(argv[1]) == "--bench") {
      bench_iterations = std::stoi(argv[2]);
    } else if (argc != 1) {
      std::fprintf(stderr, "usage: gloo_probe [--bench ITERATIONS]\n");
      return 2;
    }
    const int rank = static_cast<int>(env_int("RANK", 0, 1 << 20));
    g_rank = rank;
    const int world = static_cast<int>(env_int("WORLD_SIZE", 1, 1 << 20));
    if (rank >= world) throw std::runtime_error("RANK must be below WORLD_SIZE");
    const std::string master_addr = env_or_die("MASTER_ADDR");
    const auto master_port = static_cast<uint16_t>(env_int("MASTER_PORT", 1, 65535));
    // As torch.distributed's env:// rendezvous (rendezvous.py, _create_c10d_store): under
    // torchrun the agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT, so every rank is a
    // client; without it rank 0 serves.
    const char* agent_env = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const bool agent_store = agent_env != nullptr && std::string(agent_env) == "True";

    c10d::TCPStoreOptions store_options;
    store_options.port = master_port;
    store_options.isServer = !agent_store && rank == 0;
    store_options.numWorkers = static_cast<size_t>(world);
    store_options.timeout = kTimeout;
    store_options.multiTenant = !agent_store;
    auto tcp_store = c10::make_intrusive<c10d::TCPStore>(master_addr, store_options);
    // A prefix of our own: the agent's store also holds torchrun's rendezvous keys, and a second
    // job step on the same store must not read this one's keys.
    auto store = c10::make_intrusive<c10d::PrefixStore>("loom_gloo_probe/", tcp_store);

    auto options = c10d::ProcessGroupGloo::Options::create(kTimeout);
    // Like torch.distributed: GLOO_SOCKET_IFNAME names the interface, else the address this
    // host's name resolves to (loopback when it does not resolve).
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    options->devices.push_back(ifname != nullptr && *ifname != '\0'
                                   ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                   : c10d::ProcessGroupGloo::createDefaultDevice());
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);

    if (bench_iterations > 0) {
      bench(*pg, rank, bench_iterations);
    } else {
      check_store(*store, rank, world);
      check_allreduce(*pg, rank, world, 1);
      check_allreduce(*pg, rank, world, 1000);
      check_allgather(*pg, rank, world);
      check_callback(*pg, rank, world);
    }
    pg->barrier()->wait(kTimeout);

    // The store's server (rank 0, or torchrun's agent) must outlive every client's last request.
    store->add("finished", 1);
    if (store_options.isServer) {
      auto deadline = std::chrono::steady_clock::now() + kTimeout;
      while (store->add("finished", 0) < world && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    pg.reset();
    if (g_failures == 0 && bench_iterations == 0) {
      std::printf("rank %d/%d: all gloo probe checks passed (agent store: %s)\n", rank, world,
                  agent_store ? "yes" : "no");
    }
    return g_failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_probe rank %d: %s\n", g_rank, e.what());
    return 1;
  }
}
