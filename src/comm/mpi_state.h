// Process-wide state shared by the MPI runtime and the MPI communicators.
#pragma once

#include <atomic>

namespace loom::detail::mpi_state {

// Progress threads still inside an MPI call on a broken communicator: MPI_Finalize would hang
// waiting for them, so loom::finalize() skips it while this is non-zero.
inline std::atomic<int> stuck_threads{0};

}  // namespace loom::detail::mpi_state
