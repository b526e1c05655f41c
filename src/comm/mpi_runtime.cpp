// Starting and ending MPI, and the job layout as MPI sees it.
#include <mpi.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "comm/abort.h"
#include "comm/mpi_state.h"
#include "comm/mpi_status_channel.h"
#include "comm/mpi_types.h"
#include "loom/comm/mpi.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom::mpi {
namespace {
std::atomic<bool> g_we_initialized{false};
}

bool initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  int finalized = 0;
  MPI_Finalized(&finalized);
  return flag && !finalized;
}

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(text, &length);  // callable before MPI_Init
  std::string version(text, static_cast<size_t>(length));
  while (!version.empty() && (version.back() == '\n' || version.back() == '\0')) version.pop_back();
  return version;
}

void initialize() {
  int already = 0;
  MPI_Initialized(&already);
  if (!already) {
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw ConfigError(ErrorContext("init")("MPI_Init_thread failed with code " + std::to_string(rc)));
    if (provided < MPI_THREAD_MULTIPLE)
      throw ConfigError(ErrorContext("init")("MPI provides thread level " + std::to_string(provided) +
                                             ", expected MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) +
                                             "): torchloom drives MPI from a progress thread"));
    g_we_initialized = true;
    loom::detail::create_mpi_reduce_ops();
    loom::detail::mpi_status::start();
    loom::detail::set_final_abort_step([](const std::string& reason) {
      LOOM_LOG(error, "MPI_Abort: " << reason);
      MPI_Abort(MPI_COMM_WORLD, 1);
    });
  } else {
    int provided = 0;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
      throw ConfigError(ErrorContext("init")("MPI was initialized by someone else with thread level " +
                                             std::to_string(provided) + ", expected MPI_THREAD_MULTIPLE"));
    static std::atomic<bool> ops_created{false};
    if (!ops_created.exchange(true)) {
      loom::detail::create_mpi_reduce_ops();
      loom::detail::mpi_status::start();
    }
  }
}

namespace {
void exit_now_if_stuck(int status, void*) {
  if (loom::detail::mpi_state::stuck_threads.load() == 0) return;
  std::fflush(nullptr);  // what the program printed; the log writes to stderr unbuffered
  std::_Exit(status);
}
}  // namespace

}  // namespace loom::mpi

namespace loom::detail::mpi_state {
void end_at_exit_without_teardown() {
  static std::once_flag once;
  // glibc's on_exit, unlike atexit, passes the exit status on.
  std::call_once(once, [] { on_exit(loom::mpi::exit_now_if_stuck, nullptr); });
}
}  // namespace loom::detail::mpi_state

namespace loom::mpi {

void finalize() {
  if (!initialized() || !g_we_initialized) return;
  if (loom::detail::abort_started()) return;  // MPI_Abort is on its way
  loom::detail::mpi_status::stop();
  loom::detail::note_ending_normally();
  loom::detail::mpi_state::stop_live_communicators();  // their stuck threads count in stuck_threads
  if (loom::detail::mpi_state::stuck_threads.load() > 0) {
    // A thread is still inside a collective that will never complete; MPI_Finalize would hang.
    LOOM_LOG(error, "not calling MPI_Finalize: " << loom::detail::mpi_state::stuck_threads.load()
                                                 << " operation(s) are still stuck in MPI after a timeout");
    return;
  }
  loom::detail::free_mpi_reduce_ops();
  MPI_Finalize();
}

Layout discover_layout() {
  Layout layout;
  MPI_Comm_rank(MPI_COMM_WORLD, &layout.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &layout.size);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, layout.rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &layout.local_rank);
  MPI_Comm_size(local, &layout.local_size);
  // Node index: number the first rank of every node in world order, then share it on the node.
  MPI_Comm leaders;
  MPI_Comm_split(MPI_COMM_WORLD, layout.local_rank == 0 ? 0 : MPI_UNDEFINED, layout.rank, &leaders);
  int node = 0, nodes = 0;
  if (leaders != MPI_COMM_NULL) {
    MPI_Comm_rank(leaders, &node);
    MPI_Comm_size(leaders, &nodes);
    MPI_Comm_free(&leaders);
  }
  int pair[2] = {node, nodes};
  MPI_Bcast(pair, 2, MPI_INT, 0, local);
  layout.node_index = pair[0];
  layout.num_nodes = pair[1];
  MPI_Comm_free(&local);
  return layout;
}

}  // namespace loom::mpi
