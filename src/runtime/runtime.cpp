// loom::init and loom::finalize: the order in which a process starts and ends torchloom.
#include "loom/runtime.h"


#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <set>

#include "loom/env.h"
#include "loom/comm/agreement.h"
#include "loom/comm/backends.h"
#include "loom/comm/gloo.h"
#include "loom/comm/leaving.h"
#include "loom/comm/mpi.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/trace.h"
#include "runtime/agreement.h"
#include "runtime/device_choice.h"
#include "runtime/placement.h"

namespace loom {
namespace {

using detail::choose_device;
using detail::DeviceChoice;
using detail::DeviceRequest;
using detail::RankDevice;
using detail::shared_gpu_problems;

std::mutex g_mutex;
// Never destroyed by static destruction: the logger, the CUDA runtime and MPI it depends on may
// already be gone by then. finalize() (or the exit handler) tears it down explicitly.
Runtime* g_runtime = nullptr;
std::atomic<bool> g_finalized{false};  // read without g_mutex by the terminate handler

// The environment told us what the launcher intended; MPI tells us what happened. They must agree.
void reconcile(World& world, const mpi::Layout& layout) {
  auto mismatch = [&](const std::string& what, int env_value, int mpi_value) {
    std::string who = "init";
    if (world.launcher != "single" && world.rank != layout.rank)
      who += " (the " + world.launcher + " environment says rank " + std::to_string(world.rank) + ")";
    return ConfigError(ErrorContext(who)(
        "the " + world.launcher + " environment gives " + what + "=" + std::to_string(env_value) + " but MPI sees " +
        std::to_string(mpi_value) +
        (world.launcher == "torchrun" ? " (an env:// launch needs MASTER_ADDR and MASTER_PORT too)" : "")));
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

// A job started by torchrun (or anything else that sets MASTER_ADDR with RANK and WORLD_SIZE and no
// MPI launcher's variables) rendezvouses through the store rather than MPI.
bool env_rendezvous(const World& world, const Environment& env) {
  return world.launcher == "torchrun" && env.count("MASTER_ADDR") && env.count("MASTER_PORT");
}

// What the env:// environment did not say (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK are optional
// for a plain env:// launch), from the ranks' host names, in the order hosts first appear; what it
// did say is checked against them.
void complete_from_hostnames(World& world, Communicator& comm) {
  const std::vector<std::string> hosts = all_gather_strings(comm, world.hostname, {"layout from host names"});
  // Two ranks of one host with the same LOCAL_RANK would share a GPU and a CPU share: refused by
  // name on every rank (each one sees the same gathered values).
  if (world.local_known) {
    const auto locals = all_gather_values(comm, std::vector<int64_t>{world.local_rank}, {"local ranks"});
    std::map<std::pair<std::string, int64_t>, size_t> first_with;
    for (size_t b = 0; b < hosts.size(); ++b) {
      const auto [first, fresh] = first_with.emplace(std::make_pair(hosts[b], locals[b]), b);
      if (fresh) continue;
      throw ConfigError(ErrorContext("init")(
          "ranks " + std::to_string(first->second) + " and " + std::to_string(b) + " both run on host '" +
          hosts[b].substr(0, 64) + "' with LOCAL_RANK=" + std::to_string(locals[b]) +
          ": expected each rank of a host to have its own LOCAL_RANK, from 0 to LOCAL_WORLD_SIZE-1"));
    }
  }
  std::vector<std::string> order;
  int local_rank = 0, local_size = 0;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (std::find(order.begin(), order.end(), hosts[r]) == order.end()) order.push_back(hosts[r]);
    if (hosts[r] != world.hostname) continue;
    if (r < world.rank) ++local_rank;
    ++local_size;
  }
  const int node = static_cast<int>(std::find(order.begin(), order.end(), world.hostname) - order.begin());
  if (world.local_known && world.local_size != local_size)
    throw ConfigError(ErrorContext("init")("the torchrun environment gives LOCAL_WORLD_SIZE=" +
                                           std::to_string(world.local_size) + " but " + std::to_string(local_size) +
                                           " ranks run on host " + world.hostname));
  if (!world.local_known) {
    world.local_rank = local_rank;
    world.local_size = local_size;
    world.local_known = true;
  }
  if (!world.node_known) {
    world.node_index = node;
    world.num_nodes = static_cast<int>(order.size());
    world.node_known = true;
  }
}

// 13020 -> "13.2"
std::string cuda_version_text(int code) {
  return std::to_string(code / 1000) + "." + std::to_string(code % 1000 / 10);
}

// What this rank sees: LOOM_DEVICE, the visible CUDA devices by bus id, and the plan's GPU for it.
DeviceRequest device_request(const Config& config, const World& world, const topo::Topology& topology,
                             const topo::Plan* plan) {
  DeviceRequest in;
  in.requested = config.device;
  in.local_rank = world.local_rank;
  const int visible = nccl::device_count();
  for (int i = 0; i < visible; ++i) {
    std::string bus = nccl::device_pci_bus_id(i);
    in.visible_bus_ids.push_back(bus.empty() ? "cuda:" + std::to_string(i) : bus);
  }
  if (plan) {
    const topo::RankPlacement& mine = plan->layout.ranks[world.rank];
    const auto& gpus = topology.nodes[mine.node].gpus;
    if (mine.device < static_cast<int>(gpus.size()) && !gpus[mine.device].pci_bus_id.empty()) {
      in.planned_bus_id = topo::normalize_bus_id(gpus[mine.device].pci_bus_id);
      in.planned_index = mine.device;
    }
  }
  return in;
}

// Every rank's device choice, checked together: either every rank drives a GPU of its own (or one it
// shares on purpose) and the device communicator is built, or none does and the job runs on the
// CPU (LOOM_NCCL=auto) or every rank raises (LOOM_NCCL=on). The log says what was chosen and why.
void build_device_communicator(Runtime& rt, World& world, const Config& config, const InitOptions& options,
                               std::shared_ptr<Communicator>& device_comm, std::optional<int>& cuda_device) {
  if (config.nccl == DeviceCommMode::Off) {
    LOOM_LOG(info, "no device communicator: LOOM_NCCL=off");
    return;
  }
  DeviceChoice choice;
  if (!nccl::compiled())
    choice.problem = "torchloom was built without NCCL";
  else if (nccl::cuda_runtime_version() < nccl::torch_cuda_runtime_version())
    choice.problem = "the CUDA runtime loaded (" + cuda_version_text(nccl::cuda_runtime_version()) +
                     ") is older than LibTorch's (" + cuda_version_text(nccl::torch_cuda_runtime_version()) +
                     "): another libcudart comes first on the library path (LD_PRELOAD, or a build linked "
                     "without torchloom's run path)";
  else
    choice = choose_device(device_request(config, world, rt.topology(), rt.plan()));
  const std::string gpu = choice.device ? nccl::device_pci_bus_id(*choice.device) : "";
  // node \n requested \n GPU (bus id, else the device number) \n problem
  const std::string mine = std::to_string(world.node_index) + "\n" + (choice.requested ? "1" : "0") + "\n" +
                           (choice.device ? (gpu.empty() ? "cuda:" + std::to_string(*choice.device) : gpu) : "") +
                           "\n" + choice.problem;
  const std::vector<std::string> all = all_gather_strings(*rt.world_comm(), mine, {"device agreement"});
  std::vector<RankDevice> ranks;
  std::vector<std::string> problems;
  for (const auto& text : all) {
    std::vector<std::string> field;
    size_t from = 0;
    for (int i = 0; i < 3; ++i) {
      const size_t to = text.find('\n', from);
      field.push_back(text.substr(from, to - from));
      from = to + 1;
    }
    ranks.push_back({std::stoi(field[0]), field[2], field[1] == "1"});
    problems.push_back(text.substr(from));
  }
  const std::vector<std::string> shared = shared_gpu_problems(ranks);
  std::string why_not;
  int without = 0;
  bool some_had_one = false;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const std::string& problem = problems[r].empty() ? shared[r] : problems[r];
    some_had_one = some_had_one || !ranks[r].gpu.empty();
    if (problem.empty()) continue;
    if (++without <= 4) why_not += (why_not.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + problem;
  }
  if (without > 4) why_not += "; and " + std::to_string(without - 4) + " more rank(s)";
  if (without > 0) {
    if (config.nccl == DeviceCommMode::On) throw ConfigError(ErrorContext("init")("LOOM_NCCL=on but " + why_not));
    const std::string text = "no device communicator (LOOM_NCCL=auto), every rank runs on the CPU: " + why_not;
    // A GPU machine that ends up training on the CPU deserves a warning (once per job).
    if (some_had_one && world.rank == 0) LOOM_LOG(warn, text);
    else LOOM_LOG(info, text);
    return;
  }
  // Ranks of a node that share a GPU on purpose (LOOM_DEVICE): NCCL 2.30 refuses two ranks on one
  // GPU of one host unless told this is wanted (or each rank has its own NCCL_HOSTID).
  std::set<std::pair<int, std::string>> seen;
  bool sharing = false;
  for (const auto& r : ranks) sharing = !seen.insert({r.node, r.gpu}).second || sharing;
  if (sharing && nccl::loaded_version() >= 23000 && setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", /*overwrite=*/0) == 0)
    LOOM_LOG(info, "ranks share a GPU as LOOM_DEVICE asks: NCCL_MULTI_RANK_GPU_ENABLE="
                       << std::getenv("NCCL_MULTI_RANK_GPU_ENABLE"));
  nccl::use_device(*choice.device);
  cuda_device = *choice.device;
  device_comm = make_communicator("nccl", {rt.world_comm(), at::Device(c10::DeviceType::CUDA, *choice.device),
                                           "world-gpu", options.comm});
  LOOM_LOG(info, "device communicator world-gpu on cuda:" << *choice.device << " (" << choice.why << ")");
}

}  // namespace

// Runtime's communicators are released only here (init() and finalize() are its friends too).
struct RuntimeAccess {
  static void release_communicators(Runtime& rt) {
    {
      std::lock_guard<std::mutex> lock(rt.comms_mutex_);
      rt.more_comms_.clear();  // built over the host communicator: released before it
    }
    rt.device_comm_.reset();
    rt.world_comm_.reset();
  }
};

namespace {

void teardown_locked() {
  try {
    trace::flush();
  } catch (const std::exception& e) {  // any error: teardown must reach NCCL and MPI
    LOOM_LOG(error, e.what());
  }
  if (g_runtime) {
    nccl::shutdown_all();  // on this thread, NCCL before MPI: its teardown may still use the bootstrap
    RuntimeAccess::release_communicators(*g_runtime);
  }
  mpi::finalize();
  gloo::finalize();
  g_finalized = true;
}

// How long a leaving rank waits for the others to take note of its departure notice (they do
// within a watchdog poll unless stopped or dead): the job ends within seconds of an error.
constexpr auto kDepartureBound = std::chrono::seconds(2);

// Why this process is leaving after an error: what the program said (uncaught exception, Python's
// excepthook), else the error that broke a runtime communicator; "" when nothing failed.
std::string failure_locked() {
  std::string reason = detail::departures::exit_reason();
  for (const auto& comm : {g_runtime->world_comm(), g_runtime->device_comm()})
    if (reason.empty() && comm && comm->is_broken()) reason = comm->broken_reason();
  return reason;
}

// At exit without finalize(), with the program's exit status (glibc's on_exit). When nothing
// failed (status 0, no broken communicator) the same teardown as finalize(). Otherwise this rank
// leaves the job: it tells the other ranks why (they fail their communicators with it at once,
// instead of waiting for it until their timeout), aborts NCCL (before the CUDA runtime's own exit
// handler, registered earlier and so run later), and leaves MPI alone: MPI_Finalize would wait
// for peers that are still inside collectives, so the exit status reaches mpirun, which ends them.
void exit_without_finalize(int status, void*) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_finalized || g_runtime == nullptr) return;
  const std::string failure = failure_locked();
  if (status == 0 && failure.empty() && !detail::abort_started()) {
    teardown_locked();
    return;
  }
  if (!detail::abort_started()) detail::departures::announce(status, failure, kDepartureBound);
  nccl::abort_all("the process exits after an error without loom::finalize()");
  try {
    trace::flush();
  } catch (const std::exception& e) {  // any error: teardown must reach NCCL and MPI
    LOOM_LOG(error, e.what());
  }
  g_finalized = true;
}

std::terminate_handler g_previous_terminate = nullptr;

// An exception nobody caught: the other ranks learn its text before the process aborts (no exit
// handler runs after std::terminate). Never takes g_mutex (terminate may come from under it).
[[noreturn]] void terminate_after_telling_the_others() {
  std::string what = "std::terminate called without an active exception";
  if (auto error = std::current_exception()) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "an exception that is not a std::exception";
    }
  }
  detail::departures::set_exit_reason(what);
  if (!g_finalized.load() && !detail::abort_started())
    detail::departures::announce(detail::departures::kUncaughtException, what, kDepartureBound);
  if (g_previous_terminate) g_previous_terminate();
  std::abort();
}

}  // namespace

const topo::Plan* placement_plan() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_runtime ? g_runtime->plan() : nullptr;
}

std::vector<std::vector<int>> planned_dp_rings(int tensor_parallel, int pipeline_parallel) {
  std::vector<std::vector<int>> rings;
  const topo::Plan* plan = placement_plan();
  if (!plan || plan->request.tp_degree != tensor_parallel || plan->request.pp_degree != pipeline_parallel) return rings;
  for (const auto& group : plan->layout.dp_groups) rings.push_back(group.ranks);
  return rings;
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

  if (env_rendezvous(runtime->world_, env)) {
    // torchrun, PyTorchJob, any env:// launcher: no MPI; Gloo through LibTorch's TCPStore.
    log::set_rank(runtime->world_.rank, runtime->world_.size);
    BackendContext context{nullptr, at::Device(c10::DeviceType::CPU), "world", options.comm};
    if (config_problem.empty()) context.bootstrap_timeout = runtime->config_.timeout;  // LOOM_TIMEOUT
    runtime->world_comm_ = make_communicator(runtime->world_backend_ = "gloo", context);
    complete_from_hostnames(runtime->world_, *runtime->world_comm_);
  } else {
    mpi::initialize();
    reconcile(runtime->world_, mpi::discover_layout());
    detail::set_job_rank(runtime->world_.rank);
    log::set_rank(runtime->world_.rank, runtime->world_.size);
    runtime->world_comm_ =
        make_communicator(runtime->world_backend_ = "mpi", {nullptr, at::Device(c10::DeviceType::CPU), "world", options.comm});
  }
  detail::agree_on_configuration(*runtime->world_comm_, env);
  // The same on every rank but for per-process variables (LOOM_DEVICE): all raise together.
  detail::agree_all_ok(*runtime->world_comm_, config_problem, "reading the LOOM_ configuration");
  if (runtime->world_.rank == 0)
    for (const auto& [name, closest] : env::unknown_variables(env))
      LOOM_LOG(warn, "environment variable " << name << " is not one torchloom reads (ignored)"
                         << (closest.empty() ? std::string() : "; did you mean " + closest + "?"));

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
                                 << detail::bind_to_planned_cpus(runtime->plan_->layout.ranks[runtime->world_.rank].cpus));
  } else if (auto cpus = detail::cpu_share_without_plan(runtime->topology_, runtime->world_)) {
    LOOM_LOG(info, "no placement plan (" << placement.skipped << "); CPU share of this node: "
                                         << detail::bind_to_planned_cpus(*cpus));
  } else {
    LOOM_LOG(info, "no placement plan: " << placement.skipped);
  }

  build_device_communicator(*runtime, runtime->world_, runtime->config_, options, runtime->device_comm_,
                            runtime->cuda_device_);
  if (runtime->device_comm_) runtime->device_backend_ = "nccl";
  runtime->comm_options_ = options.comm;
  LOOM_LOG(info, "initialized: rank " << runtime->world_.rank << "/" << runtime->world_.size << " local "
                                      << runtime->world_.local_rank << "/" << runtime->world_.local_size << " node "
                                      << runtime->world_.node_index << " (" << runtime->world_.hostname
                                      << ") launcher " << runtime->world_.launcher);
  g_runtime = runtime.release();
  g_finalized = false;
  // Registered after MPI and CUDA started, so it runs before their own exit handlers.
  static bool exit_handler = (on_exit(exit_without_finalize, nullptr), true);
  (void)exit_handler;
  static bool terminate_handler = (g_previous_terminate = std::set_terminate(terminate_after_telling_the_others), true);
  (void)terminate_handler;
  return std::shared_ptr<Runtime>(g_runtime, [](Runtime*) {});
}

std::shared_ptr<Communicator> Runtime::comm(c10::DeviceType type, const std::string& backend) {
  if (type == c10::DeviceType::CPU && (backend.empty() || backend == world_backend_)) return world_comm_;
  if (type == c10::DeviceType::CUDA && (backend.empty() || backend == device_backend_)) return device_comm_;
  std::string chosen = backend;
  if (chosen.empty())  // the first backend registered for the type
    for (const auto& info : registered_backends())
      if (std::find(info.device_types.begin(), info.device_types.end(), type) != info.device_types.end()) {
        chosen = info.name;
        break;
      }
  if (chosen.empty())
    throw InvalidArgumentError(ErrorContext("Runtime::comm")(std::string("no backend is registered for ") +
                                                             c10::DeviceTypeName(type, /*lower_case=*/true) +
                                                             " tensors"));
  std::lock_guard<std::mutex> lock(comms_mutex_);
  auto& comm = more_comms_[{chosen, type}];
  if (!comm) {
    // A device of this process's for the type: the CUDA device init() chose, else the type's first.
    const at::Device device = type == c10::DeviceType::CUDA && cuda_device_ ? at::Device(type, *cuda_device_)
                              : type == c10::DeviceType::CPU              ? at::Device(type)
                                                                          : at::Device(type, 0);
    comm = make_communicator(chosen, {world_comm_, device, "world-" + chosen, comm_options_});
  }
  return comm;
}

void finalize() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_finalized) return;
  teardown_locked();
}

void announce_exit(int status, const std::string& reason) {
  detail::departures::set_exit_reason(reason);
  if (!g_finalized.load() && !detail::abort_started()) detail::departures::announce(status, reason, kDepartureBound);
}

}  // namespace loom
