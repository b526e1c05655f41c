// torchloom as a torch.distributed backend: the c10d::Backend class for Python and the functions
// python/torchloom/distributed.py's creator calls (see there for how torch reaches them).
#include "bindings.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "dist_backend.h"
#include "loom/error.h"
#include "loom/runtime.h"

namespace torchloom_py {
namespace {

c10::intrusive_ptr<c10d::Backend::Options> make_options(const std::string& group_name, loom::Timeout timeout) {
  // c10d wants a concrete value; "the communicators' own" is reported as torch's default.
  auto options = c10::make_intrusive<c10d::Backend::Options>(
      "loom", timeout == loom::kDefaultTimeout ? kBackendDefaultTimeout : std::chrono::milliseconds(timeout.count()));
  options->group_name = group_name;
  return options;
}

}  // namespace

void bind_distributed(py::module_& m) {
  // The base class is bound by torch's own module: it must be registered before ours derives.
  py::module_::import("torch.distributed");

  py::class_<DistBackend, c10d::Backend, c10::intrusive_ptr<DistBackend>>(
      m, "_DistBackend",
      "torch.distributed's backend \"loom\" (a c10d::Backend over torchloom's communicators); made by "
      "torch.distributed.init_process_group(backend=\"loom\"), not by hand.", destroyed_without_gil())
      .def_property_readonly("host_comm", &DistBackend::host_comm, "The communicator of CPU tensors.")
      .def_property_readonly("device_comm", &DistBackend::device_comm,
                             "The communicator of CUDA tensors, or None.")
      .def("_split_members", [](DistBackend& parent, const std::vector<int>& ranks, const py::object& timeout,
                                const std::string& group_name) -> py::object {
             const loom::Timeout t = to_timeout(timeout);
             c10::intrusive_ptr<DistBackend> child;
             {
               py::gil_scoped_release release;
               child = parent.split_ranks(ranks, t, make_options(group_name, t));
             }
             if (!child) return py::none();
             return py::cast(child);
           }, py::arg("ranks"), py::arg("timeout"), py::arg("group_name"),
           "Collective over this group: the listed ranks (of this group) form a new backend, in that order.")
      .def("perform_nocolor_split", [](DistBackend& parent, const py::object& /*device*/) {
             py::gil_scoped_release release;
             parent.split_ranks({}, loom::kDefaultTimeout, make_options("", loom::kDefaultTimeout));
           }, py::arg("device"),
           "This rank's part of a split it is not a member of (torch.distributed.new_group calls it on the "
           "ranks outside the new group).");

  m.def("_make_dist_backend", [](int rank, int size, const py::object& timeout, const std::string& group_name) {
        const loom::Timeout t = to_timeout(timeout);
        py::gil_scoped_release release;
        auto rt = loom::init();  // started already by torchloom.init(): returns that runtime
        const loom::World& w = rt->world();
        if (rank != w.rank || size != w.size)
          throw loom::ConfigError(loom::ErrorContext("torch.distributed backend loom")(
              "torch.distributed says rank " + std::to_string(rank) + " of " + std::to_string(size) +
              ", torchloom's launch (" + w.launcher + ") says rank " + std::to_string(w.rank) + " of " +
              std::to_string(w.size) + ": pass init_process_group the launcher's rank and world size"));
        return c10::make_intrusive<DistBackend>(rt->world_comm(), rt->device_comm(), t, make_options(group_name, t));
      }, py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"),
      "The backend over torchloom's world communicators (torchloom.init() first).");
}

}  // namespace torchloom_py
