#include "loom/runtime.h"

#include <ATen/ops/full.h>

#include <mutex>

#include "core/env.h"
#include "loom/comm/mpi.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/trace.h"

namespace loom {
namespace {
std::mutex g_mutex;
std::shared_ptr<Runtime> g_runtime;

// The environment told us what the launcher intended; MPI tells us what happened. They must agree.
void reconcile(World& world, const mpi::Layout& layout) {
  auto mismatch = [&](const std::string& what, int env_value, int mpi_value) {
    return ConfigError("[rank " + std::to_string(layout.rank) + "] init: the " + world.launcher +
                       " environment gives " + what + "=" + std::to_string(env_value) + " but MPI sees " +
                       std::to_string(mpi_value) +
                       (world.launcher == "torchrun" ? " (start torchloom programs with mpirun or srun, not torchrun)"
                                                     : ""));
  };
  if (world.size_known && world.size != layout.size) throw mismatch("world size", world.size, layout.size);
  if (world.rank != layout.rank && world.launcher != "single") throw mismatch("rank", world.rank, layout.rank);
  if (world.local_known && world.local_size != layout.local_size)
    throw mismatch("local size", world.local_size, layout.local_size);
  world.rank = layout.rank;
  world.size = layout.size;
  world.size_known = true;
  if (!world.local_known) {
    world.local_rank = layout.local_rank;
    world.local_size = layout.local_size;
    world.local_known = true;
  }
  if (!world.node_known) {
    world.node_index = layout.node_index;
    world.num_nodes = layout.num_nodes;
    world.node_known = true;
  }
}

}  // namespace

std::shared_ptr<Runtime> init(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_runtime) return g_runtime;
  auto runtime = std::shared_ptr<Runtime>(new Runtime());
  runtime->world_ = world_from_environment(current_environment(), current_hostname());
  mpi::initialize();
  reconcile(runtime->world_, mpi::discover_layout());
  log::set_rank(runtime->world_.rank, runtime->world_.size);
  trace::set_rank(runtime->world_.rank);
  runtime->world_comm_ = mpi::world_communicator(options.comm);
  // The device communicator. Making one is collective, so the ranks agree first whether every
  // rank has a GPU of its own (local rank < visible GPUs): with LOOM_NCCL=auto a node short of
  // GPUs opts everyone out; with =on every rank raises the same error instead of some waiting.
  const std::string nccl_mode = env::choice("LOOM_NCCL", {"auto", "on", "off"});
  bool build_device_comm = false;
  if (nccl_mode != "off") {
    const bool fits = nccl::device_available() && runtime->world_.local_rank < nccl::device_count();
    at::Tensor all_fit = at::full({1}, fits ? 1 : 0, at::kInt);
    runtime->world_comm_->all_reduce(all_fit, {ReduceOp::Min})->wait();
    build_device_comm = all_fit.item<int>() == 1;
    if (nccl_mode == "on" && !build_device_comm)
      throw ConfigError("[rank " + std::to_string(runtime->world_.rank) + "] init: LOOM_NCCL=on but " +
                        (!nccl::compiled() ? std::string("torchloom was built without NCCL")
                         : fits ? std::string("another rank has no CUDA device of its own")
                                : "this rank (local rank " + std::to_string(runtime->world_.local_rank) +
                                      ") has no CUDA device of its own: " + std::to_string(nccl::device_count()) +
                                      " visible"));
  }
  if (build_device_comm)
    runtime->device_comm_ =
        nccl::make_communicator(runtime->world_comm_, runtime->world_.local_rank, "world-gpu", options.comm);
  LOOM_LOG(info, "initialized: rank " << runtime->world_.rank << "/" << runtime->world_.size << " local "
                                      << runtime->world_.local_rank << "/" << runtime->world_.local_size << " node "
                                      << runtime->world_.node_index << " (" << runtime->world_.hostname
                                      << ") launcher " << runtime->world_.launcher);
  g_runtime = runtime;
  return g_runtime;
}

void finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  trace::flush();
  if (g_runtime) {
    g_runtime->device_comm_.reset();  // NCCL before MPI: its teardown may still use the bootstrap
    g_runtime->world_comm_.reset();
    g_runtime.reset();
  }
  mpi::finalize();
}

}  // namespace loom
