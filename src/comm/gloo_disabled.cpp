// The Gloo backend's entry points in a build whose LibTorch offers no usable ProcessGroupGloo
// (LOOM_C10D_GLOO_FOUND off): the API stays, and asking for a communicator says why there is none.
#include "loom/comm/gloo.h"
#include "loom/error.h"

namespace loom::gloo {

bool compiled() { return false; }

Rendezvous rendezvous_from_environment() { return {}; }

std::shared_ptr<Communicator> world_communicator(const Rendezvous&, const CommunicatorOptions&) {
  throw ConfigError(ErrorContext("init")(
      "this torchloom was built without Gloo (its LibTorch's ProcessGroupGloo did not compile with the Gloo "
      "headers in third_party/gloo): start the job with mpirun, loomrun or srun instead of an env:// launcher"));
}

void store_set(const std::string&, const std::string&) {}
std::optional<std::string> store_get_if_set(const std::string&) { return std::nullopt; }
void finalize(std::chrono::milliseconds) {}
bool initialized() { return false; }

}  // namespace loom::gloo
