// Starting torchloom in a process: read the launch environment, start MPI, check the two agree,
// and build the world communicators.
//
//   int main() {
//     auto rt = loom::init();
//     const loom::World& w = rt->world();          // rank, size, local rank, node, hostname
//     auto comm = rt->world_comm();                 // CPU tensors (MPI)
//     auto gpu = rt->device_comm();                 // CUDA tensors (NCCL), where a GPU is visible
//     ...
//     loom::finalize();
//   }
//
// Launch with mpirun (or srun); a process started without a launcher is a world of size 1.
// A torchrun-style environment that claims more processes than MPI sees is a loom::ConfigError
// (torchloom's ranks must be MPI processes).
#pragma once

#include <memory>

#include "loom/comm/communicator.h"
#include "loom/world.h"

namespace loom {

struct InitOptions {
  CommunicatorOptions comm;  // timeout and error policy of the world communicators
};

class Runtime {
 public:
  const World& world() const { return world_; }
  // Every process of the job, for CPU tensors (MPI).
  const std::shared_ptr<Communicator>& world_comm() const { return world_comm_; }
  // Every process of the job, for CUDA tensors (NCCL) on device local_rank; nullptr when
  // LOOM_NCCL=off, or =auto (the default) unless every rank has a GPU of its own.
  const std::shared_ptr<Communicator>& device_comm() const { return device_comm_; }

 private:
  friend std::shared_ptr<Runtime> init(const InitOptions& options);
  friend void finalize();
  World world_;
  std::shared_ptr<Communicator> world_comm_;
  std::shared_ptr<Communicator> device_comm_;
};

// Idempotent: later calls return the same runtime.
std::shared_ptr<Runtime> init(const InitOptions& options = {});
// Destroys the runtime's communicators and finalizes MPI. Idempotent.
void finalize();

}  // namespace loom
