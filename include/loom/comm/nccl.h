// The NCCL communicator: collectives and point-to-point operations on the CUDA tensors of one
// device.
//
// Built when CUDA and NCCL are found (compiled() says whether this build has it); usable where a
// GPU is present (device_available()). Creating one is collective over a CPU communicator that
// carries NCCL's bootstrap (rank 0's ncclUniqueId is broadcast over MPI). loom::init() makes the
// job's (Runtime::device_comm()); make one yourself like this:
//
//   auto rt = loom::init();
//   auto gpu = loom::nccl::make_communicator(rt->world_comm(), /*device_index=*/0, "world-gpu");
//   at::Tensor g = at::ones({1024}, at::TensorOptions().device(gpu->device()));
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
// Communicators are nonblocking (ncclCommInitRankConfig with blocking = 0): no NCCL call holds a
// thread past its operation's deadline, including the first collective or send that connects to a
// peer. With LOOM_ON_ERROR=raise a failed or timed-out communicator is aborted (ncclCommAbort, on a
// helper thread), which releases its stream: the waiter gets the error and later device work runs.
//
// NCCL matches point-to-point operations between two ranks in issue order; tags are accepted for
// API compatibility but do not reorder matching. Two ranks that exchange data must use
// batch_isend_irecv (one NCCL group), or order their sends and receives oppositely.
//
// Operations on different communicators of one device must be issued in the same order on every
// rank (NCCL's rule); torchloom serialises operations per communicator only.
//
// loom::finalize() destroys every NCCL communicator on the calling thread (ncclCommDestroy is
// collective among a node's ranks); a program that leaves without it (an error path) has its
// communicators aborted before the CUDA runtime shuts down.
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
// The PCI bus id of visible CUDA device `device_index` ("0000:07:00.0", lower case, as the
// topology writes it), which names the physical GPU whatever CUDA_VISIBLE_DEVICES and
// CUDA_DEVICE_ORDER did to the numbering; "" when it cannot be read.
std::string device_pci_bus_id(int device_index);
// NCCL's version codes: the headers this build was compiled with, and the library loaded (0
// without NCCL). make_communicator refuses a library older than the headers.
int built_version();
int loaded_version();
// The CUDA runtime this process loaded, and the one LibTorch was built with (CUDA's version codes,
// 13020 for 13.2; 0 without NCCL). loom::init() gives no rank a device when the loaded runtime is
// older than LibTorch's (another libcudart.so first on the library path).
int cuda_runtime_version();
int torch_cuda_runtime_version();

// Makes `device_index` the calling thread's current CUDA device (LibTorch's and the runtime's),
// so that tensors created "on cuda" land there. loom::init() calls it for the device communicator.
void use_device(int device_index);

// Collective over `bootstrap` (a CPU communicator; every rank calls it): returns a communicator
// with the same ranks on CUDA device `device_index` of this process. Throws
// loom::InvalidArgumentError when any rank's device index is out of range (naming those ranks) or
// NCCL is not compiled in, loom::ConfigError when the loaded NCCL is older than the headers, and
// loom::CommError / loom::TimeoutError when NCCL fails to set up on any rank (every rank raises).
std::shared_ptr<Communicator> make_communicator(std::shared_ptr<Communicator> bootstrap, int device_index,
                                                const std::string& name, const CommunicatorOptions& options = {});

// Destroys every live NCCL communicator of this process on the calling thread (waiting for its
// operations, bounded by their timeouts; a broken one is aborted). Called by loom::finalize().
void shutdown_all();
// Aborts every live NCCL communicator (local, needs no peer). For exits without finalize().
void abort_all(const std::string& reason);

}  // namespace loom::nccl
