// The side channel over which ranks ask each other how far they have come (comm/peer_status.h),
// on MPI: a duplicate of MPI_COMM_WORLD used for nothing else. Each rank's watchdog thread serves
// incoming questions every poll interval (one MPI_Test); a rank that asks serves while it waits,
// so two ranks asking each other at once both get their answers.
#pragma once

namespace loom::detail::mpi_status {

// Collective over MPI_COMM_WORLD (called by mpi::initialize()): installs the transport.
void start();
// Before MPI_Finalize: removes the transport and releases every request.
void stop();

}  // namespace loom::detail::mpi_status
