// Starting torchloom in a process: read the launch environment and the LOOM_* configuration,
// start MPI, check the two agree, agree on the configuration across ranks, and build the world
// communicators.
//
//   int main() {
//     try {
//       auto rt = loom::init();
//       const loom::World& w = rt->world();          // rank, size, local rank, node, hostname
//       auto comm = rt->world_comm();                 // CPU tensors (MPI)
//       auto gpu = rt->device_comm();                 // CUDA tensors (NCCL), where every rank has a GPU
//       ...
//       loom::finalize();
//     } catch (const loom::Error& e) {
//       std::fprintf(stderr, "%s\n", e.what());
//       return 1;                                     // mpirun then ends the other ranks
//     }
//   }
//
// Launch with mpirun, loomrun or srun; a process started without a launcher is a world of size 1.
// A torchrun-style environment that claims more processes than MPI sees is a loom::ConfigError
// (torchloom's ranks must be MPI processes).
//
// Teardown is safe on every exit path: finalize() destroys the communicators on the calling
// thread (NCCL before MPI) and finalizes MPI; a program that leaves without it gets the same at
// exit when nothing failed, and after an error has its NCCL communicators aborted (before the CUDA
// runtime shuts down) and MPI left to mpirun, which ends the job with the program's exit code.
#pragma once

#include <memory>
#include <optional>

#include "loom/comm/communicator.h"
#include "loom/config.h"
#include "loom/world.h"

namespace loom {

struct InitOptions {
  CommunicatorOptions comm;  // timeout and error policy of the world communicators
};

class Runtime {
 public:
  const World& world() const { return world_; }
  const Config& config() const { return config_; }
  // Every process of the job, for CPU tensors (MPI).
  const std::shared_ptr<Communicator>& world_comm() const { return world_comm_; }
  // Every process of the job, for CUDA tensors (NCCL) on device(); nullptr when LOOM_NCCL=off, or
  // =auto (the default) unless every rank can use a GPU of its own.
  const std::shared_ptr<Communicator>& device_comm() const { return device_comm_; }
  // This process's CUDA device (LOOM_DEVICE; else 0 when it sees one GPU, else its local rank),
  // made current by init(); nullopt without a device communicator.
  std::optional<int> cuda_device() const { return cuda_device_; }

 private:
  friend std::shared_ptr<Runtime> init(const InitOptions& options);
  friend void finalize();
  friend struct RuntimeAccess;
  World world_;
  Config config_;
  std::shared_ptr<Communicator> world_comm_;
  std::shared_ptr<Communicator> device_comm_;
  std::optional<int> cuda_device_;
};

// Idempotent: later calls return the same runtime. Throws loom::ConfigError (on every rank) for a
// malformed or inconsistent launch environment or configuration.
std::shared_ptr<Runtime> init(const InitOptions& options = {});
// Destroys the runtime's communicators and finalizes MPI. Idempotent; never throws (a timeline that
// cannot be written is logged as an error).
void finalize();

}  // namespace loom
