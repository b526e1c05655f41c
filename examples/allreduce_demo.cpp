// A short multi-rank demo: every rank contributes its own tensor, and each collective's result is
// printed by every rank, checked against the value computed by hand.
//
//   mpirun -np 2 build/examples/allreduce_demo
#include <ATen/ATen.h>

#include <cstdio>
#include <sstream>

#include "loom/loom.h"

namespace {

std::string show(const at::Tensor& t) {
  std::ostringstream s;
  s << "[";
  auto flat = t.to(at::kDouble).reshape({-1});
  for (int64_t i = 0; i < flat.numel(); ++i) s << (i ? ", " : "") << flat[i].item<double>();
  s << "]";
  return s.str();
}

int run() {
  auto rt = loom::init();
  auto comm = rt->world_comm();
  const loom::World& w = rt->world();
  const int n = comm->size();
  const int r = comm->rank();
  std::ostringstream out;
  out << "rank " << r << "/" << n << " on " << w.hostname << " (local " << w.local_rank << "/" << w.local_size
      << ", launcher " << w.launcher << ")\n";

  // all_reduce, asynchronously: submit, do something else, then wait.
  at::Tensor values = at::arange(4, at::kFloat) + 10 * r;
  auto work = comm->all_reduce(values, {loom::ReduceOp::Sum});
  at::Tensor expected = at::arange(4, at::kFloat) * n + 10.0 * n * (n - 1) / 2;
  work->wait();
  out << "  all_reduce(sum) of arange(4) + 10*rank -> " << show(values)
      << (at::equal(values, expected) ? "  ok" : "  WRONG") << "\n";

  at::Tensor half = at::full({3}, 0.5 * (r + 1), at::kBFloat16);
  comm->all_reduce(half, {loom::ReduceOp::Max})->wait();
  out << "  all_reduce(max) in bfloat16 of 0.5*(rank+1) -> " << show(half) << "\n";

  at::Tensor gathered = at::empty({n}, at::kLong);
  comm->all_gather(gathered, at::full({1}, r * r, at::kLong))->wait();
  out << "  all_gather of rank^2 -> " << show(gathered) << "\n";

  at::Tensor root_value = r == 0 ? at::full({2}, 42.0) : at::zeros({2});
  comm->broadcast(root_value, {0})->wait();
  out << "  broadcast from rank 0 -> " << show(root_value) << "\n";

  // Print rank by rank so lines do not interleave.
  for (int turn = 0; turn < n; ++turn) {
    if (turn == r) {
      std::fputs(out.str().c_str(), stdout);
      std::fflush(stdout);
    }
    comm->barrier()->wait();
  }
  comm.reset();
  rt.reset();
  loom::finalize();
  return at::equal(values, expected) ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const loom::Error& e) {
    // A bad LOOM_* variable, a timeout, a rank that died: say what, and leave (mpirun ends the rest).
    std::fprintf(stderr, "allreduce_demo: %s\n", e.what());
    return 1;
  }
}
