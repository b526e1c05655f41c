// Starting torchloom in a process: read the launch environment and the LOOM_* configuration,
// start MPI, check the two agree, agree on the configuration across ranks, and build the world
// communicators.
//
//   int main() {
//     try {
//       auto rt = loom::init();
//       const loom::World& w = rt->world();          // rank, size, local rank, node, hostname
//       auto comm = rt->world_comm();                 // CPU tensors (MPI), = rt->comm(c10::kCPU)
//       auto gpu = rt->device_comm();                 // CUDA tensors (NCCL), where every rank has a GPU
//       ...
//       loom::finalize();
//     } catch (const loom::Error& e) {
//       std::fprintf(stderr, "%s\n", e.what());
//       return 1;                                     // mpirun then ends the other ranks
//     }
//   }
//
// Placement: init() describes the machine(s) and plans which GPU and CPUs each rank uses and how
// ranks group for tensor and data parallelism (docs/topology.md); it makes the planned device
// current and binds the rank to its CPUs where that is allowed.
//
// Launch with mpirun, loomrun or srun (the world communicator is MPI's), or with torchrun, a
// Kubeflow PyTorchJob or any launcher that sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (the
// env:// rendezvous through LibTorch's TCPStore; the world communicator is Gloo's, see
// loom/comm/gloo.h). A process started without a launcher is a world of size 1.
//
// Teardown is safe on every exit path: finalize() destroys the communicators on the calling
// thread (NCCL before MPI) and finalizes MPI; a program that leaves without it gets the same at
// exit when nothing failed (exit status 0, no broken communicator). A rank that leaves after an
// error (an uncaught exception, a non-zero exit status, a broken communicator) first tells the
// other ranks why: their pending and later operations with it fail at once with loom::CommError
// ("rank 1 exited with status 1 (RuntimeError: boom)") instead of waiting for their timeout; then
// its NCCL communicators are aborted (before the CUDA runtime shuts down) and MPI is left to
// mpirun, which ends the job with the program's exit status.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "loom/comm/communicator.h"
#include "loom/config.h"
#include "loom/topology/placement.h"
#include "loom/world.h"

namespace loom {

struct InitOptions {
  CommunicatorOptions comm;  // timeout and error policy of the world communicators
};

class Runtime {
 public:
  const World& world() const { return world_; }
  const Config& config() const { return config_; }
  // Every process of the job, for tensors of `type`, through `backend` (loom/comm/backends.h):
  // by default the one init() built for the type (CPU: MPI, or Gloo under torchrun; CUDA: NCCL on
  // cuda_device(), nullptr when there is none). A backend named otherwise is built on its first
  // call from the host communicator, collectively (every rank asks for it together), and kept:
  //   auto toy = rt->comm(c10::DeviceType::CPU, "toy");
  // InvalidArgumentError for a backend that is not registered or does not serve `type`.
  std::shared_ptr<Communicator> comm(c10::DeviceType type, const std::string& backend = "");
  // comm(CPU): every process of the job, for CPU tensors.
  const std::shared_ptr<Communicator>& world_comm() const { return world_comm_; }
  // comm(CUDA): for CUDA tensors (NCCL) on cuda_device(); nullptr when LOOM_NCCL=off, or =auto
  // (the default) unless every rank can use a GPU of its own.
  const std::shared_ptr<Communicator>& device_comm() const { return device_comm_; }
  // This process's CUDA device (LOOM_DEVICE; else 0 when it sees one GPU, else its local rank),
  // made current by init(); nullopt without a device communicator.
  std::optional<int> cuda_device() const { return cuda_device_; }
  // The machine(s) as init() found them (NVML + hwloc on each node, or LOOM_TOPOLOGY), and the
  // placement planned on them for LOOM_TP and LOOM_PP (nullptr when no GPU was described): the device
  // and CPUs of every rank, and the TP groups, pipelines and DP rings ParallelState builds at those degrees.
  //   if (rt->plan()) std::cout << loom::topo::explain(*rt->plan(), 64 << 20);
  const topo::Topology& topology() const { return topology_; }
  const topo::Plan* plan() const { return plan_ ? &*plan_ : nullptr; }

 private:
  friend std::shared_ptr<Runtime> init(const InitOptions& options);
  friend void finalize();
  friend struct RuntimeAccess;
  World world_;
  Config config_;
  std::shared_ptr<Communicator> world_comm_;
  std::shared_ptr<Communicator> device_comm_;
  std::string world_backend_, device_backend_;  // the backends init() built them with
  // Communicators built later by comm(type, backend), by backend name and device type.
  std::mutex comms_mutex_;
  std::map<std::pair<std::string, c10::DeviceType>, std::shared_ptr<Communicator>> more_comms_;
  CommunicatorOptions comm_options_;
  std::optional<int> cuda_device_;
  topo::Topology topology_;
  std::optional<topo::Plan> plan_;
};

// The placement plan loom::init() made (nullptr before init or without one).
const topo::Plan* placement_plan();

// The DP groups of the placement plan, each in its planned ring order, when the plan was made for
// `tensor_parallel` and `pipeline_parallel` (LOOM_TP, LOOM_PP) and the whole job; empty otherwise.
// Hand them to ParallelState, which takes no plan of its own (it builds groups from what it is given):
//   loom::ParallelConfig config;
//   config.tensor_parallel = 2;
//   config.dp_rings = loom::planned_dp_rings(config.tensor_parallel);
//   loom::ParallelState ps(rt->world_comm(), config);
std::vector<std::vector<int>> planned_dp_rings(int tensor_parallel, int pipeline_parallel = 1);

// Idempotent: later calls return the same runtime. Throws loom::ConfigError (on every rank) for a
// malformed or inconsistent launch environment or configuration.
std::shared_ptr<Runtime> init(const InitOptions& options = {});
// Destroys the runtime's communicators and finalizes MPI. Idempotent; never throws (a timeline that
// cannot be written is logged as an error).
void finalize();

// Tells the other ranks now that this process is about to exit after an error, with `status` and
// `reason` (an exception's text): their operations with it fail at once, naming both (see above).
// The exit path does the same by itself, with the exit status and the text of an exception that
// reached std::terminate; the Python module's excepthook calls this before the interpreter's own,
// slower, teardown, and a program with its own last-chance handler may too. Once per process:
// later calls, and the exit path's own notice, do nothing. Waits at most 2 s for the others.
void announce_exit(int status, const std::string& reason);

}  // namespace loom
