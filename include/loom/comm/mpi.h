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

// How an MPI communicator's operations were run, since it was made: for tuning, and for tests of
// its progress thread. Submit-then-wait callers should see their operations run by their waiter
// and the thread left asleep; overlapping callers (run_in_background) by the thread.
//
//   auto before = loom::mpi::progress_counters(*comm);
//   for (int i = 0; i < 1000; ++i) comm->all_reduce(t)->wait();
//   auto after = loom::mpi::progress_counters(*comm);  // after.run_by_waiter - before.run_by_waiter
struct ProgressCounters {
  uint64_t run_by_waiter = 0;           // operations the waiting thread ran itself
  uint64_t run_by_progress_thread = 0;  // operations the communicator's own thread ran
  uint64_t submission_wakeups = 0;      // submissions that woke the sleeping progress thread (a system call each)
};
// Throws loom::InvalidArgumentError for a communicator of another backend.
ProgressCounters progress_counters(const Communicator& communicator);

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
