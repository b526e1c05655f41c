// The NCCL communicator: collectives and point-to-point operations on CUDA tensors.
//
// Built when CUDA and NCCL are found (compiled() says whether this build has it); usable where a
// GPU is present (device_available()). Creating one is collective over a CPU communicator that
// carries NCCL's bootstrap (rank 0's ncclUniqueId is broadcast over MPI):
//
//   auto rt = loom::init();
//   int device = rt->world().local_rank;
//   auto gpu = loom::nccl::make_communicator(rt->world_comm(), device, "world-gpu");
//   at::Tensor g = at::ones({1024}, at::TensorOptions().device(at::kCUDA, device));
//   gpu->all_reduce(g, {loom::ReduceOp::Avg})->wait();   // the current stream waits; the host does not
//   float v = g[0].item<float>();                        // ordered after the all_reduce
//
// Stream semantics follow c10d: each communicator runs its operations in order on its own CUDA
// stream, which first waits for the caller's current stream (so inputs written just before the
// call are complete). Work::wait() makes the caller's current stream wait for the operation and
// returns at once; Work::synchronize() blocks the host too; wait(timeout) host-polls up to the
// timeout. A barrier's wait() blocks the host (that is what a barrier is for). Tensors stay valid
// while an operation uses them even if the caller frees them (the caching allocator is told).
//
// NCCL matches point-to-point operations between two ranks in issue order; tags are accepted for
// API compatibility but do not reorder matching.
//
// Destroy NCCL communicators on every rank (loom::finalize() does): ncclCommDestroy is collective
// among the ranks of a node. A broken communicator (timeout, NCCL error) is aborted instead.
#pragma once

#include <memory>
#include <string>

#include "loom/comm/communicator.h"

namespace loom::nccl {

// True when this build contains the NCCL backend.
bool compiled();
// True when the backend is compiled and at least one CUDA device is visible.
bool device_available();
// CUDA devices visible to this process (0 without NCCL).
int device_count();

// Collective over `bootstrap` (a CPU communicator; every rank calls it): returns a communicator
// with the same ranks on CUDA device `device_index` of this process. Throws
// loom::InvalidArgumentError when any rank's device index is out of range (naming those ranks) or
// NCCL is not compiled in, loom::CommError when NCCL fails to set up.
std::shared_ptr<Communicator> make_communicator(std::shared_ptr<Communicator> bootstrap, int device_index,
                                                const std::string& name, const CommunicatorOptions& options = {});

}  // namespace loom::nccl
