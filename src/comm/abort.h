// Ending the job after a fatal communication error, so that no rank is left hanging.
//
// Backends register how to tear themselves down (ncclCommAbort for device communicators); the
// MPI runtime registers the final step (MPI_Abort, which makes mpirun end every rank). The abort
// runs once, on its own thread, after a grace period that lets the failing operation's waiter
// raise and log the error first.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "loom/comm/leaving.h"  // abort_started()

namespace loom::detail {

// Steps run in registration order; returns a handle for unregister_abort_step.
int register_abort_step(std::function<void(const std::string& reason)> step);
void unregister_abort_step(int handle);
// The last step (MPI_Abort); replaces any previous one.
void set_final_abort_step(std::function<void(const std::string& reason)> step);

// Starts the abort once (later calls are ignored): waits `grace`, runs the steps, then the final
// step, and if the process is still alive after that, std::abort(). A step that hangs (an
// ncclCommAbort stuck on a dead network) cannot keep the process alive: `steps_bound` after the
// grace a second thread runs the final step and std::abort() itself.
void abort_job_after(std::chrono::milliseconds grace, const std::string& reason,
                     std::chrono::milliseconds steps_bound = std::chrono::seconds(10));

// The program is ending normally (loom::finalize() runs): from now on abort_job_after does nothing.
// Operations still pending on communicators the program kept fail then, and aborting the job for
// them would end a program that is finishing (and call MPI_Abort after MPI_Finalize).
void note_ending_normally();

}  // namespace loom::detail
