// Collective backends, registered by name for the device types their communicators accept (as
// c10d registers a backend per device type). The runtime builds its communicators through this
// registry: "mpi" and "gloo" for host tensors (the launcher decides which bootstraps the job),
// "nccl" for CUDA tensors. A new backend is its own files plus one registration:
//
//   loom::register_backend("toy", {c10::DeviceType::CPU}, [](const loom::BackendContext& c) {
//     return std::make_shared<ToyCommunicator>(c.host, c.name, c.options);   // collective over c.host
//   });
//   auto toy = rt->comm(c10::DeviceType::CPU, "toy");   // built on first use, on every rank together
//
// docs/contributing.md ("Adding a backend") says what a Communicator subclass implements.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"

namespace loom {

struct BackendContext {
  // The job's host (CPU) communicator, a bootstrap for a backend that needs one; null when the
  // host communicator itself is being built (from the launcher's environment).
  std::shared_ptr<Communicator> host;
  at::Device device = at::Device(c10::DeviceType::CPU);  // where the new communicator's tensors live
  std::string name;                                      // the new communicator's name ("world-gpu")
  CommunicatorOptions options;
  // How long a backend that rendezvouses (Gloo through the store) waits for the other ranks.
  Timeout bootstrap_timeout = Timeout(std::chrono::seconds(300));
};
using BackendFactory = std::function<std::shared_ptr<Communicator>(const BackendContext& context)>;

struct BackendInfo {
  std::string name;
  std::vector<c10::DeviceType> device_types;
};

// InvalidArgumentError for an empty or taken name, no device type, or no factory.
void register_backend(const std::string& name, std::vector<c10::DeviceType> device_types, BackendFactory factory);
// The registered backends, in registration order (the built-ins first).
std::vector<BackendInfo> registered_backends();
// A communicator of `backend` for context.device (collective as the backend's bootstrap is).
// InvalidArgumentError naming the registered backends for an unknown name, and the backend's
// device types for a device it does not serve.
std::shared_ptr<Communicator> make_communicator(const std::string& backend, const BackendContext& context);

}  // namespace loom
