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

std::shared_ptr<Communicator> make_communicator(std::shared_ptr<Communicator> /*bootstrap*/, int device_index,
                                                const std::string& name, const CommunicatorOptions& /*options*/) {
  throw InvalidArgumentError("NCCL communicator " + name + " on cuda:" + std::to_string(device_index) +
                             " not created: torchloom was built without NCCL (CUDA or NCCL was not found at "
                             "configure time); use the MPI communicator for CPU tensors or rebuild with NCCL");
}

}  // namespace loom::nccl
