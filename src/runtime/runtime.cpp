// loom::init and loom::finalize: the order in which a process starts and ends torchloom.
#include "loom/runtime.h"

#include <ATen/ops/full.h>

#include <cstdlib>
#include <mutex>

#include "comm/abort.h"
#include "loom/comm/mpi.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/trace.h"
#include "runtime/agreement.h"
#include "runtime/placement.h"

namespace loom {
namespace {

std::mutex g_mutex;
// Never destroyed by static destruction: the logger, the CUDA runtime and MPI it depends on may
// already be gone by then. finalize() (or the exit handler) tears it down explicitly.
Runtime* g_runtime = nullptr;
bool g_finalized = false;

// The environment told us what the launcher intended; MPI tells us what happened. They must agree.
void reconcile(World& world, const mpi::Layout& layout) {
  auto mismatch = [&](const std::string& what, int env_value, int mpi_value) {
    std::string who = "init";
    if (world.launcher != "single" && world.rank != layout.rank)
      who += " (the " + world.launcher + " environment says rank " + std::to_string(world.rank) + ")";
    return ConfigError(ErrorContext(who)(
        "the " + world.launcher + " environment gives " + what + "=" + std::to_string(env_value) + " but MPI sees " +
        std::to_string(mpi_value) +
        (world.launcher == "torchrun" ? " (start torchloom programs with mpirun, loomrun or srun, not torchrun)" : "")));
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

// Decides this rank's CUDA device and whether it can drive one. Returns the problem ("" if none).
std::string choose_device(const Config& config, const World& world, const topo::Plan* plan, int& device,
                          std::string& why) {
  if (!nccl::compiled()) return "torchloom was built without NCCL";
  const int visible = nccl::device_count();
  if (visible == 0) return "no CUDA device is visible";
  // LOOM_DEVICE first; then the placement plan (when it describes the devices this process sees);
  // a process that sees one GPU (CUDA_VISIBLE_DEVICES per rank, Slurm --gpus-per-task=1) uses it;
  // else its local rank.
  if (config.device) {
    device = *config.device;
    why = "LOOM_DEVICE";
  } else if (plan && visible > 1) {
    device = plan->layout.ranks[world.rank].device;
    why = "the placement plan";
  } else {
    device = visible == 1 ? 0 : world.local_rank;
    why = visible == 1 ? "the one GPU this process sees" : "the local rank";
  }
  if (device >= visible)
    return "device " + std::to_string(device) + " (" + why + ") is not among the " + std::to_string(visible) +
           " visible";
  return "";
}

void build_device_communicator(Runtime& rt, World& world, const Config& config, const InitOptions& options,
                               std::shared_ptr<Communicator>& device_comm, std::optional<int>& cuda_device) {
  if (config.nccl == DeviceCommMode::Off) {
    LOOM_LOG(info, "no device communicator: LOOM_NCCL=off");
    return;
  }
  int device = -1;
  std::string why;
  const std::string problem = choose_device(config, world, rt.plan(), device, why);
  // Making the communicator is collective: every rank learns first whether every rank can.
  auto& comm = *rt.world_comm();
  at::Tensor fits = at::full({1}, problem.empty() ? 1 : 0, at::kInt);
  {
    detail::InternalOperations internal("device agreement");
    comm.all_reduce(fits, {ReduceOp::Min})->wait();
  }
  const bool everyone = fits.item<int>() == 1;
  if (!everyone) {
    const std::string why = problem.empty() ? "another rank cannot use a CUDA device" : "this rank: " + problem;
    if (config.nccl == DeviceCommMode::On) throw ConfigError(ErrorContext("init")("LOOM_NCCL=on but " + why));
    LOOM_LOG(info, "no device communicator (LOOM_NCCL=auto): " << why);
    return;
  }
  nccl::use_device(device);
  cuda_device = device;
  device_comm = nccl::make_communicator(rt.world_comm(), device, "world-gpu", options.comm);
  LOOM_LOG(info, "device communicator world-gpu on cuda:" << device << " (" << why << ")");
}

}  // namespace

// Runtime's communicators are released only here (init() and finalize() are its friends too).
struct RuntimeAccess {
  static void release_communicators(Runtime& rt) {
    rt.device_comm_.reset();
    rt.world_comm_.reset();
  }
};

namespace {

void teardown_locked() {
  try {
    trace::flush();
  } catch (const Error& e) {
    LOOM_LOG(error, e.what());
  }
  if (g_runtime) {
    nccl::shutdown_all();  // on this thread, NCCL before MPI: its teardown may still use the bootstrap
    RuntimeAccess::release_communicators(*g_runtime);
  }
  mpi::finalize();
  g_finalized = true;
}

// At exit without finalize(): the same teardown when nothing failed; after an error, NCCL is
// aborted (before the CUDA runtime's own exit handler, which was registered earlier and so runs
// later) and MPI is left alone (a peer may never arrive), so the exit code reaches mpirun.
void exit_without_finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_finalized || g_runtime == nullptr) return;
  const bool failed = detail::abort_started() || (g_runtime->world_comm() && g_runtime->world_comm()->is_broken()) ||
                      (g_runtime->device_comm() && g_runtime->device_comm()->is_broken());
  if (!failed) {
    teardown_locked();
    return;
  }
  nccl::abort_all("the process exits after an error without loom::finalize()");
  try {
    trace::flush();
  } catch (const Error& e) {
    LOOM_LOG(error, e.what());
  }
  g_finalized = true;
}

}  // namespace

const topo::Plan* placement_plan() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_runtime ? g_runtime->plan() : nullptr;
}

std::shared_ptr<Runtime> init(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_runtime) return std::shared_ptr<Runtime>(g_runtime, [](Runtime*) {});
  auto runtime = std::make_unique<Runtime>();
  const Environment env = current_environment();
  runtime->world_ = world_from_environment(env, current_hostname());
  detail::set_job_rank(runtime->world_.rank);
  // A malformed value is reported after the ranks have agreed on the raw values: one rank's typo
  // is then named for what it is (a difference between ranks), and nobody waits for it.
  std::string config_problem;
  try {
    runtime->config_ = parse_config(env);
  } catch (const ConfigError& e) {
    config_problem = e.what();
  }
  detail::set_config(runtime->config_);

  mpi::initialize();
  reconcile(runtime->world_, mpi::discover_layout());
  detail::set_job_rank(runtime->world_.rank);
  log::set_rank(runtime->world_.rank, runtime->world_.size);
  runtime->world_comm_ = mpi::world_communicator(options.comm);
  detail::agree_on_configuration(*runtime->world_comm_, env);
  if (!config_problem.empty()) throw ConfigError(config_problem);  // the same on every rank

  std::string timeline_problem;
  try {
    trace::configure(runtime->config_.timeline, runtime->world_.rank);
  } catch (const Error& e) {
    timeline_problem = e.what();
  }
  detail::agree_all_ok(*runtime->world_comm_, timeline_problem, "opening the timeline (LOOM_TIMELINE)");

  detail::Placement placement = detail::plan_placement(*runtime->world_comm_, runtime->world_, runtime->config_);
  runtime->topology_ = std::move(placement.topology);
  runtime->plan_ = std::move(placement.plan);
  if (runtime->plan_) {
    LOOM_LOG(info, "placement (" << placement.source << "): "
                                 << detail::bind_to_planned_cpus(runtime->plan_->layout.ranks[runtime->world_.rank]));
  } else {
    LOOM_LOG(info, "no placement plan: " << placement.skipped);
  }

  build_device_communicator(*runtime, runtime->world_, runtime->config_, options, runtime->device_comm_,
                            runtime->cuda_device_);
  LOOM_LOG(info, "initialized: rank " << runtime->world_.rank << "/" << runtime->world_.size << " local "
                                      << runtime->world_.local_rank << "/" << runtime->world_.local_size << " node "
                                      << runtime->world_.node_index << " (" << runtime->world_.hostname
                                      << ") launcher " << runtime->world_.launcher);
  g_runtime = runtime.release();
  g_finalized = false;
  // Registered after MPI and CUDA started, so it runs before their own exit handlers.
  static bool exit_handler = (std::atexit(exit_without_finalize), true);
  (void)exit_handler;
  return std::shared_ptr<Runtime>(g_runtime, [](Runtime*) {});
}

void finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_finalized) return;
  teardown_locked();
}

}  // namespace loom
