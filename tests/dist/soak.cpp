// Load test: many asynchronous collectives of random kinds and sizes over the world and two
// sub-groups, many in flight at once. Every result is checked against values computed on this
// rank alone, memory must stay flat after warm-up, and nothing may time out.
//
//   mpirun -np 8 build/tests/loom_soak --ops 10000 --max-bytes 4194304 --in-flight 24
//
// Every rank draws the same sequence of operations from the seed; an operation on a sub-group is
// run by every rank on its own sub-group (the parity group of even or odd ranks, or its half).
// Prints one summary line per rank and exits non-zero on any wrong value, error or memory growth.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <malloc.h>

#include <cstdio>
#include <deque>
#include <fstream>
#include <random>
#include <string>

#include "loom/error.h"
#include "loom/runtime.h"

namespace {

// Resident memory of this process, in bytes, after handing freed heap memory back to the system
// (glibc keeps freed large blocks otherwise, which would read as growth).
double resident_bytes() {
  malloc_trim(0);
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * 4096.0;
}

struct Pending {
  loom::WorkPtr work;
  at::Tensor result;
  at::Tensor expected;
  std::string what;
};

// Rank r's input: small integers, exact in float32 when summed over 8 ranks.
at::Tensor input_of(int r, int64_t numel, int64_t salt) {
  return ((at::arange(numel, at::kLong) * 7 + r * 3 + salt) % 11).to(at::kFloat);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("torchloom soak test");
  int64_t ops = 2000, max_bytes = 4 << 20, seed = 7;
  int in_flight = 16;
  double rss_limit_mb = 16;
  app.add_option("--ops", ops, "operations to issue")->check(CLI::PositiveNumber);
  app.add_option("--max-bytes", max_bytes, "largest message (sizes are log-uniform from 4 B)")->check(CLI::PositiveNumber);
  app.add_option("--in-flight", in_flight, "operations outstanding at once")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "sequence seed (the same on every rank)");
  app.add_option("--rss-limit-mb", rss_limit_mb, "allowed growth of resident memory after warm-up");
  CLI11_PARSE(app, argc, argv);

  try {
    auto rt = loom::init();
    auto world = rt->world_comm();
    const int rank = world->rank(), n = world->size();
    auto parity = world->split(rank % 2, rank, "parity");
    auto half = world->split(rank < n / 2 ? 0 : 1, rank, "half");
    const std::vector<std::shared_ptr<loom::Communicator>> groups = {world, parity, half};

    std::mt19937_64 random(static_cast<uint64_t>(seed));
    std::deque<Pending> pending;
    int64_t checked = 0, wrong = 0;
    double bytes_moved = 0;
    double rss_after_warmup = 0;
    auto finish_oldest = [&] {
      Pending p = std::move(pending.front());
      pending.pop_front();
      p.work->wait();
      if (p.result.defined() && !at::equal(p.result, p.expected)) {
        if (wrong < 5) std::fprintf(stderr, "[rank %d] WRONG %s\n", rank, p.what.c_str());
        ++wrong;
      }
      ++checked;
    };
    const auto start = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < ops; ++k) {
      const auto& g = groups[random() % groups.size()];
      const int gn = g->size(), gr = g->rank();
      const double log_bytes = std::uniform_real_distribution<double>(std::log(4.0), std::log(double(max_bytes)))(random);
      const int64_t numel = std::max<int64_t>(gn, static_cast<int64_t>(std::exp(log_bytes) / 4) / gn * gn);
      const int kind = static_cast<int>(random() % 6);
      const int64_t salt = static_cast<int64_t>(random() % 100);
      Pending p;
      p.what = "op " + std::to_string(k) + " kind " + std::to_string(kind) + " on " + g->name() + " numel " +
               std::to_string(numel);
      // The global ranks of this rank's group, so expectations use the same inputs the peers use.
      const auto& members = g->members();
      switch (kind) {
        case 0: {  // all_reduce sum
          p.result = input_of(members[gr], numel, salt);
          p.expected = at::zeros({numel});
          for (int m : members) p.expected += input_of(m, numel, salt);
          p.work = g->all_reduce(p.result);
          break;
        }
        case 1: {  // all_reduce max
          p.result = input_of(members[gr], numel, salt);
          p.expected = input_of(members[0], numel, salt);
          for (int m : members) p.expected = at::maximum(p.expected, input_of(m, numel, salt));
          p.work = g->all_reduce(p.result, {loom::ReduceOp::Max});
          break;
        }
        case 2: {  // broadcast from a random root
          const int root = static_cast<int>(salt % gn);
          p.result = gr == root ? input_of(members[root], numel, salt) : at::zeros({numel});
          p.expected = input_of(members[root], numel, salt);
          p.work = g->broadcast(p.result, {root});
          break;
        }
        case 3: {  // all_gather
          const int64_t each = std::max<int64_t>(1, numel / gn);
          p.result = at::empty({gn * each});
          std::vector<at::Tensor> parts;
          for (int m : members) parts.push_back(input_of(m, each, salt));
          p.expected = at::cat(parts);
          p.work = g->all_gather(p.result, input_of(members[gr], each, salt));
          break;
        }
        case 4: {  // reduce_scatter
          const int64_t each = numel / gn;
          at::Tensor sum = at::zeros({numel});
          for (int m : members) sum += input_of(m, numel, salt);
          p.expected = sum.narrow(0, gr * each, each).clone();
          p.result = at::empty({each});
          p.work = g->reduce_scatter(p.result, input_of(members[gr], numel, salt));
          break;
        }
        default: {  // all_to_all: chunk j of rank i goes to rank j
          const int64_t each = numel / gn;
          at::Tensor in = input_of(members[gr], numel, salt);
          std::vector<at::Tensor> parts;
          for (int m : members) parts.push_back(input_of(m, numel, salt).narrow(0, gr * each, each));
          p.expected = at::cat(parts);
          p.result = at::empty({numel});
          p.work = g->all_to_all(p.result, in);
          break;
        }
      }
      bytes_moved += static_cast<double>(numel) * 4;
      pending.push_back(std::move(p));
      while (static_cast<int>(pending.size()) >= in_flight) finish_oldest();
      if (k == ops / 3) {
        // Measured with nothing in flight, like the end.
        while (!pending.empty()) finish_oldest();
        rss_after_warmup = resident_bytes();
      }
    }
    while (!pending.empty()) finish_oldest();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double growth_mb = (resident_bytes() - rss_after_warmup) / 1e6;
    std::printf("[rank %d] soak: %lld operations checked, %lld wrong, %.1f MB issued in %.1f s, resident memory %+.1f MB "
                "after warm-up\n",
                rank, static_cast<long long>(checked), static_cast<long long>(wrong), bytes_moved / 1e6, seconds,
                growth_mb);
    std::fflush(stdout);
    const bool ok = wrong == 0 && checked == ops && growth_mb <= rss_limit_mb;
    if (growth_mb > rss_limit_mb)
      std::fprintf(stderr, "[rank %d] resident memory grew %.1f MB after warm-up (limit %.1f MB)\n", rank, growth_mb,
                   rss_limit_mb);
    parity.reset();
    half.reset();
    loom::finalize();
    return ok ? 0 : 1;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom_soak: %s\n", e.what());
    return 1;
  }
}
