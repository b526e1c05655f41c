// Process-wide state shared by the MPI runtime and the MPI communicators.
#pragma once

#include <atomic>

namespace loom::detail::mpi_state {

// Progress threads still inside an MPI call on a broken communicator: MPI_Finalize would hang
// waiting for them, so loom::finalize() skips it while this is non-zero.
inline std::atomic<int> stuck_threads{0};

// Called when a thread is left stuck in MPI: from then on, a process that exits (returning from
// main without loom::finalize(), or exit()) ends at once with its exit status, before the
// handlers and destructors registered earlier run. They would tear down MPI's shared memory
// under the stuck thread, which then crashed (exit 139 instead of the program's code).
void end_at_exit_without_teardown();

// Stops the progress thread of every MPI communicator still alive, before MPI_Finalize: none may
// call MPI during or after it (mpi_communicator.cpp). Their unfinished operations fail and later
// ones are refused. Returns how many threads are stuck inside an MPI call (then MPI_Finalize is
// skipped: it would hang).
int stop_live_communicators();

}  // namespace loom::detail::mpi_state
