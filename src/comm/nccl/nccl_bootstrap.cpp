// Making an NCCL communicator: every rank checks its device, rank 0's ncclUniqueId travels over
// the CPU (MPI) bootstrap communicator, and ncclCommInitRankConfig (nonblocking) is polled to a
// deadline. The ranks agree over the bootstrap after each step, so either every rank gets a
// communicator or every rank raises: none is left waiting for the others.
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

#include "comm/durations.h"
#include "comm/nccl/nccl_communicator.h"
#include "loom/comm/nccl.h"
#include "loom/log.h"
#include "topology/pcie_path.h"

namespace loom::nccl {
namespace {

using detail::Clock;
using detail::NcclHandle;
using detail::nccl_error_text;

// Every rank contributes whether it succeeded; true when all did. The step is the library's own.
bool all_ranks_ok(Communicator& bootstrap, bool ok, const char* purpose) {
  at::Tensor flag = at::full({1}, ok ? 1 : 0, at::kInt);
  loom::detail::InternalOperations internal(purpose);
  bootstrap.all_reduce(flag, {ReduceOp::Min})->wait();
  return flag.item<int>() == 1;
}

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
  return topo::detail::normalize_bus_id(text);
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
  at::Tensor mine = at::full({1}, problem.empty() ? 1 : 0, at::kInt);
  at::Tensor usable = at::empty({size}, at::kInt);
  {
    loom::detail::InternalOperations internal("NCCL device check");
    bootstrap->all_gather(usable, mine)->wait();
  }
  std::string unusable;
  for (int r = 0; r < size; ++r)
    if (usable.data_ptr<int32_t>()[r] == 0) unusable += (unusable.empty() ? "" : ",") + std::to_string(r);
  if (!unusable.empty()) {
    const std::string text = "not created: " + (problem.empty() ? "" : problem + "; ") + "bootstrap rank(s) " +
                             unusable + " cannot use their CUDA device";
    if (problem.find("older") != std::string::npos) throw ConfigError(who(text));
    throw InvalidArgumentError(who(text));
  }

  // Rank 0's unique id, plus a byte saying whether it could make one.
  at::Tensor id = at::zeros({NCCL_UNIQUE_ID_BYTES + 1}, at::kByte);
  std::string id_error;
  if (rank == 0) {
    ncclUniqueId unique;
    const ncclResult_t result = ncclGetUniqueId(&unique);
    if (result == ncclSuccess) {
      std::memcpy(id.data_ptr(), &unique, NCCL_UNIQUE_ID_BYTES);
      id.data_ptr<uint8_t>()[NCCL_UNIQUE_ID_BYTES] = 1;
    } else {
      id_error = nccl_error_text(result, nullptr);
    }
  }
  {
    loom::detail::InternalOperations internal("NCCL unique id");
    bootstrap->broadcast(id, {/*root=*/0})->wait();
  }
  if (id.data_ptr<uint8_t>()[NCCL_UNIQUE_ID_BYTES] != 1)
    throw CommError(who("not created: ncclGetUniqueId failed on bootstrap rank 0" +
                        (id_error.empty() ? std::string() : ": " + id_error)));
  ncclUniqueId unique;
  std::memcpy(&unique, id.data_ptr(), NCCL_UNIQUE_ID_BYTES);

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
  if (!all_ranks_ok(*bootstrap, failure.empty(), "NCCL init agreement")) {
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
