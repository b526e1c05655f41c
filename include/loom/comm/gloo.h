// The Gloo communicator (CPU tensors) and the env:// rendezvous, for jobs started without MPI:
// torchrun, Kubeflow's PyTorchJob, or any launcher that sets MASTER_ADDR, MASTER_PORT, RANK and
// WORLD_SIZE.
//
// The engine is LibTorch's own c10d::ProcessGroupGloo over a c10d::TCPStore; loom's Communicator
// core sits in front of it unchanged (validation, sequence numbers, flight record, watchdog
// timeouts, LOOM_CHECK_COLLECTIVES, the error policy). loom::init() chooses it by itself under
// torchrun; use these directly only to manage the rendezvous yourself.
//
//   loom::gloo::Rendezvous where = loom::gloo::rendezvous_from_environment();   // MASTER_ADDR, ...
//   auto world = loom::gloo::world_communicator(where);
//   world->all_reduce(t, {loom::ReduceOp::Sum})->wait();
//
// Differences from the MPI communicator: the side channel runs over the store (a timeout still
// names the ranks not arrived or not answering; a rank leaving after an error is named at once);
// collectives are compared across ranks before their data moves only for the program's first
// checked call and every 64th after it (MPI compares every one above LOOM_SIZE_CHECK_BYTES), so
// a mismatch of equal size (op, dtype) is found within 64 collectives;
// and Gloo's transport ends the process, rather than raising, on a message of another size.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"

namespace loom::gloo {

// False in a build whose LibTorch offers no usable ProcessGroupGloo (the Gloo headers did not
// compile against it); then world_communicator raises ConfigError.
bool compiled();

struct Rendezvous {
  std::string master_addr;  // MASTER_ADDR
  int master_port = 0;      // MASTER_PORT
  int rank = 0;             // RANK
  int size = 1;             // WORLD_SIZE
  // TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent serves the store at MASTER_ADDR:PORT and
  // every rank is a client; otherwise rank 0 serves it (as torch.distributed's env:// does).
  bool agent_store = false;
  // Gloo's network interface (GLOO_SOCKET_IFNAME); empty: the address the host name resolves to.
  std::string interface;
  // How long connecting to the store and waiting for every rank may take (loom::init() passes
  // LOOM_TIMEOUT); a rank that has not arrived by then is named.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(300)};
  // The attempt of the job this process belongs to (TORCHELASTIC_RESTART_COUNT under torchrun,
  // LOOM_RESTART_COUNT under loomrun; 0 otherwise). Every store key of torchloom's is under it, so a
  // restarted job never reads the keys (Gloo addresses, arrivals) of an attempt that died, which
  // torchrun's agent store keeps.
  int generation = 0;
};

// From the environment. ConfigError naming the variable when one is missing or malformed, or when
// MASTER_ADDR does not resolve.
Rendezvous rendezvous_from_environment();

// A communicator over every process of the job (collective: every rank calls it).
std::shared_ptr<Communicator> world_communicator(const Rendezvous& rendezvous, const CommunicatorOptions& options = {});

// The job's key-value store, for the runtime's own exchanges (set once world_communicator ran).
// Keys are under a prefix of torchloom's own.
void store_set(const std::string& key, const std::string& value);
// nullopt when the key is not set (never blocks).
std::optional<std::string> store_get_if_set(const std::string& key);
// Ends the store (the server, rank 0 unless torchrun's agent serves it, waits until every rank is
// done with it, bounded by `bound`). Communicators should be destroyed first.
void finalize(std::chrono::milliseconds bound = std::chrono::seconds(30));
bool initialized();

}  // namespace loom::gloo
