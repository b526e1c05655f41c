// The MPI runtime and the MPI communicator (CPU tensors).
//
// MPI is started with MPI_THREAD_MULTIPLE: each communicator runs its operations in submission
// order on its own progress thread (Open MPI has no asynchronous progress, so a thread of the
// library must drive it), which lets the caller compute while communication proceeds.
//
//   loom::mpi::initialize();
//   auto world = loom::mpi::world_communicator();       // a duplicate of MPI_COMM_WORLD
//   auto work = world->all_reduce(grad, {loom::ReduceOp::Avg});
//   ...                                                  // overlap
//   work->wait();
//
// loom::init() does all of this; use these directly only to manage MPI yourself.
#pragma once

#include <memory>
#include <string>

#include "loom/comm/communicator.h"

namespace loom::mpi {

// Starts MPI (idempotent). Throws loom::ConfigError when MPI_THREAD_MULTIPLE is not provided.
void initialize();
bool initialized();
// The MPI library's version string (MPI_Get_library_version), e.g. "Open MPI v4.1.4, ...".
std::string library_version();
// Finalizes MPI (idempotent). Communicators should be destroyed first.
void finalize();

// A communicator over every process of the job.
std::shared_ptr<Communicator> world_communicator(const CommunicatorOptions& options = {});

// The job's layout as MPI sees it (collective over all processes).
struct Layout {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int node_index = 0;
  int num_nodes = 1;
};
Layout discover_layout();

}  // namespace loom::mpi
