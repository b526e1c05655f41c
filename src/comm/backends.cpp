// The backend registry (loom/comm/backends.h): the built-in backends registered like any other.
#include "loom/comm/backends.h"

#include <algorithm>
#include <mutex>

#include "loom/comm/gloo.h"
#include "loom/comm/mpi.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"

namespace loom {

namespace {

struct Registered {
  BackendInfo info;
  BackendFactory factory;
};

struct Registry {
  std::mutex mutex;
  std::vector<Registered> backends;
};

std::string join_names(const std::vector<Registered>& backends) {
  std::string names;
  for (const auto& b : backends) names += (names.empty() ? "" : ", ") + b.info.name;
  return names;
}

std::string device_types_text(const std::vector<c10::DeviceType>& types) {
  std::string text;
  for (auto type : types) text += (text.empty() ? "" : ", ") + c10::DeviceTypeName(type, /*lower_case=*/true);
  return text;
}

// MPI's world (mpirun, srun, loomrun): MPI is initialized by the runtime before. Gloo's world
// (torchrun and other env:// launchers): a rendezvous through the launcher's store. NCCL: over a
// host bootstrap, on one CUDA device of this process.
Registry& registry() {
  static Registry r{
      {},
      {{{"mpi", {c10::DeviceType::CPU}}, [](const BackendContext& c) { return mpi::world_communicator(c.options); }},
       {{"gloo", {c10::DeviceType::CPU}},
        [](const BackendContext& c) {
          gloo::Rendezvous rendezvous = gloo::rendezvous_from_environment();
          rendezvous.connect_timeout = c.bootstrap_timeout;
          return gloo::world_communicator(rendezvous, c.options);
        }},
       {{"nccl", {c10::DeviceType::CUDA}},
        [](const BackendContext& c) {
          if (!c.host)
            throw InvalidArgumentError(ErrorContext("make_communicator")(
                "the nccl backend bootstraps over a host communicator; none was given"));
          return nccl::make_communicator(c.host, c.device.has_index() ? c.device.index() : 0, c.name, c.options);
        }}}};
  return r;
}

}  // namespace

void register_backend(const std::string& name, std::vector<c10::DeviceType> device_types, BackendFactory factory) {
  const ErrorContext where("register_backend");
  if (name.empty() || device_types.empty() || !factory)
    throw InvalidArgumentError(where("expected a name, one device type or more and a factory; found name \"" + name +
                                     "\", " + std::to_string(device_types.size()) + " device type(s)" +
                                     (factory ? "" : " and no factory")));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& b : r.backends)
    if (b.info.name == name) throw InvalidArgumentError(where("a backend named \"" + name + "\" is registered already"));
  r.backends.push_back({{name, std::move(device_types)}, std::move(factory)});
}

std::vector<BackendInfo> registered_backends() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<BackendInfo> out;
  for (const auto& b : r.backends) out.push_back(b.info);
  return out;
}

std::shared_ptr<Communicator> make_communicator(const std::string& backend, const BackendContext& context) {
  const ErrorContext where("make_communicator");
  Registered chosen;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = std::find_if(r.backends.begin(), r.backends.end(), [&](const Registered& b) { return b.info.name == backend; });
    if (it == r.backends.end())
      throw InvalidArgumentError(where("no backend is registered as \"" + backend + "\"; registered: " +
                                       join_names(r.backends)));
    chosen = *it;
  }
  const auto& types = chosen.info.device_types;
  if (std::find(types.begin(), types.end(), context.device.type()) == types.end())
    throw InvalidArgumentError(where("backend \"" + backend + "\" serves " + device_types_text(types) +
                                     " tensors; expected one for " + context.device.str()));
  auto comm = chosen.factory(context);
  if (!comm) throw InvalidArgumentError(where("the factory of backend \"" + backend + "\" returned no communicator"));
  return comm;
}

}  // namespace loom
