// The NCCL backend's entry points in a build without NCCL (LOOM_WITH_NCCL undefined): the API
// stays the same so callers need no #ifdef, and asking for a communicator says why there is none.
#include "loom/comm/nccl.h"

#include "loom/error.h"

namespace loom::nccl {

bool compiled() {
  return false;
}

bool device_available() {
  return false;
}

int device_count() {
  return 0;
}

std::string device_pci_bus_id(int /*device_index*/) { return ""; }

void use_device(int /*device_index*/) {}

int built_version() { return 0; }

int loaded_version() { return 0; }

int cuda_runtime_version() { return 0; }

int torch_cuda_runtime_version() { return 0; }

void shutdown_all() {}

void abort_all(const std::string& /*reason*/) {}

std::shared_ptr<Communicator> make_communicator(std::shared_ptr<Communicator> /*bootstrap*/, int device_index,
                                                const std::string& name, const CommunicatorOptions& /*options*/) {
  throw InvalidArgumentError(ErrorContext("NCCL communicator " + name)(
      "not created on cuda:" + std::to_string(device_index) +
      ": torchloom was built without NCCL (CUDA or NCCL was not found at configure time); use the MPI communicator "
      "for CPU tensors or rebuild with NCCL"));
}

}  // namespace loom::nccl
