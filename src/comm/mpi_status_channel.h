// The side channel's transport on MPI (comm/side_channel.h runs the protocol): a duplicate of
// MPI_COMM_WORLD used for nothing else; questions, answers, departure notices and their
// acknowledgements are tagged point-to-point messages, served by the watchdog's poll (an
// MPI_Test each when nothing arrived).
#pragma once

namespace loom::detail::mpi_status {

// Collective over MPI_COMM_WORLD (called by mpi::initialize()): installs the transport.
void start();
// Before MPI_Finalize: removes the transport and releases every request.
void stop();

}  // namespace loom::detail::mpi_status
