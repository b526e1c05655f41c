// Making an NCCL communicator: every rank checks its device, rank 0's ncclUniqueId travels over
// the CPU (MPI) bootstrap communicator, and ncclCommInitRankConfig (nonblocking) is polled to a
// deadline. The ranks agree over the bootstrap after each step, so either every rank gets a
// communicator or every rank raises: none is left waiting for the others.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

#include "comm/durations.h"
#include "comm/nccl/nccl_communicator.h"
#include "loom/comm/agreement.h"
#include "loom/comm/nccl.h"
#include "loom/log.h"
#include "loom/topology/topology.h"

namespace loom::nccl {
namespace {

using detail::Clock;
using detail::NcclHandle;
using detail::nccl_error_text;


std::string version_text(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." + std::to_string(code % 100);
}

}  // namespace

bool compiled() { return true; }

bool device_available() { return c10::cuda::device_count() > 0; }

int device_count() { return c10::cuda::device_count(); }

int cuda_runtime_version() {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return 0;
  return version;
}

int torch_cuda_runtime_version() { return static_cast<int>(at::detail::getCUDAHooks().versionCUDART()); }

std::string device_pci_bus_id(int device_index) {
  char text[32] = {};
  if (cudaDeviceGetPCIBusId(text, sizeof(text), device_index) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it
    return "";
  }
  return topo::normalize_bus_id(text);
}

void use_device(int device_index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index)); }

int built_version() { return NCCL_VERSION_CODE; }

int loaded_version() {
  int version = 0;
  ncclGetVersion(&version);
  return version;
}

std::shared_ptr<Communicator> make_communicator(std::shared_ptr<Communicator> bootstrap, int device_index,
                                                const std::string& name, const CommunicatorOptions& options) {
  const ErrorContext who("NCCL communicator " + name);
  if (!bootstrap) throw InvalidArgumentError(who("not created: the bootstrap communicator is null"));
  if (bootstrap->device_type() != c10::DeviceType::CPU)
    throw InvalidArgumentError(who(std::string("not created: the bootstrap communicator must be a CPU (MPI) one, found "
                                               "backend ") +
                                   bootstrap->backend()));
  const int rank = bootstrap->rank();
  const int size = bootstrap->size();
  const Timeout timeout = options.timeout.value_or(bootstrap->default_timeout());

  // Every rank learns whether every rank can use its device and loads a recent enough NCCL.
  const int visible = c10::cuda::device_count();
  std::string problem;
  if (device_index < 0 || device_index >= visible)
    problem = "device index " + std::to_string(device_index) + " is out of range: " + std::to_string(visible) +
              " CUDA device(s) visible";
  else if (loaded_version() < built_version())
    problem = "the NCCL loaded (" + version_text(loaded_version()) + ") is older than the one torchloom was built with (" +
              version_text(built_version()) + "): another libnccl.so.2 comes first on the library path";
  const std::vector<int> unusable = ranks_reporting(*bootstrap, !problem.empty(), {"NCCL device check"});
  if (!unusable.empty()) {
    const std::string text = "not created: " + (problem.empty() ? "" : problem + "; ") + "bootstrap " +
                             ranks_text(unusable) + " cannot use their CUDA device";
    if (problem.find("older") != std::string::npos) throw ConfigError(who(text));
    throw InvalidArgumentError(who(text));
  }

  // Rank 0's unique id ("id" and its bytes), or why it could not make one ("no" and the error).
  std::string id_message;
  if (rank == 0) {
    ncclUniqueId made;
    const ncclResult_t result = ncclGetUniqueId(&made);
    id_message = result == ncclSuccess ? "id" + std::string(reinterpret_cast<const char*>(&made), NCCL_UNIQUE_ID_BYTES)
                                       : "no" + nccl_error_text(result, nullptr);
  }
  id_message = broadcast_string(*bootstrap, id_message, 0, {"NCCL unique id"});
  if (id_message.rfind("id", 0) != 0 || id_message.size() != 2 + NCCL_UNIQUE_ID_BYTES)
    throw CommError(who("not created: ncclGetUniqueId failed on bootstrap rank 0" +
                        (id_message.size() > 2 ? ": " + id_message.substr(2) : std::string())));
  ncclUniqueId unique;
  std::memcpy(&unique, id_message.data() + 2, NCCL_UNIQUE_ID_BYTES);

  // Nonblocking: ncclCommInitRankConfig returns at once and is polled, so a rank that never joins
  // ends this rank's wait at the timeout instead of hanging it.
  ncclComm_t comm = nullptr;
  std::string failure;
  {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t result = ncclCommInitRankConfig(&comm, size, unique, rank, &config);
    if (comm != nullptr && result == ncclInProgress) {
      NcclHandle pending(comm, static_cast<c10::DeviceIndex>(device_index));
      result = pending.await(result, Clock::now() + timeout);
    }
    if (result == ncclInProgress)
      failure = "ncclCommInitRankConfig did not finish within " + loom::detail::seconds_text(timeout) +
                " s (a rank did not join)";
    else if (result != ncclSuccess)
      failure = "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of " + std::to_string(size) + ", cuda:" +
                std::to_string(device_index) + ") failed: " + nccl_error_text(result, comm);
  }
  if (!ranks_reporting(*bootstrap, !failure.empty(), {"NCCL init agreement"}).empty()) {
    if (comm != nullptr) ncclCommAbort(comm);
    if (!failure.empty() && failure.find("did not finish") != std::string::npos)
      throw TimeoutError(who("not created: " + failure));
    throw CommError(who("not created: " + (failure.empty() ? std::string("another rank failed to initialise NCCL")
                                                           : failure)));
  }
  LOOM_LOG(info, "NCCL communicator " << name << " ready: rank " << rank << " of " << size << " on cuda:"
                                      << device_index << ", NCCL " << version_text(loaded_version()) << " (built with "
                                      << version_text(built_version()) << ")");
  return detail::NcclCommunicator::create(std::make_shared<NcclHandle>(comm, static_cast<c10::DeviceIndex>(device_index)),
                                          rank, bootstrap->members(), static_cast<c10::DeviceIndex>(device_index), name,
                                          options);
}

void shutdown_all() {
  for (auto& comm : detail::NcclCommunicator::all_live()) comm->shutdown();
  // Bounded: each of them is itself bounded by its operations' timeouts.
  if (!detail::NcclCommunicator::wait_for_detached_destructions(std::chrono::seconds(30)))
    LOOM_LOG(warn, "an NCCL communicator released by the watchdog is still being destroyed after 30 s; going on");
}

void abort_all(const std::string& reason) {
  for (auto& comm : detail::NcclCommunicator::all_live()) {
    comm->abort_local(reason);
  }
}

}  // namespace loom::nccl
