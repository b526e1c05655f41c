// Checkpoints: loom::Checkpointer with what maps to Python without a C++ module or optimizer —
// named tensors (a Python model's parameters and buffers, optimizer state tensors), the
// GradScaler, the RNG tracker; progress and user key-values.
#include "bindings.h"

#include "loom/amp/grad_scaler.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/checkpoint.h"
#include "loom/train/checkpoint_state.h"

namespace torchloom_py {

void bind_checkpoint(py::module_& m) {
  py::class_<loom::TrainingProgress>(m, "TrainingProgress", "Where training stands (loom::TrainingProgress).")
      .def(py::init([](int64_t step, int64_t epoch, int64_t sample) {
             return loom::TrainingProgress{step, epoch, sample};
           }),
           py::arg("step") = 0, py::arg("epoch") = 0, py::arg("sample") = 0)
      .def_readwrite("step", &loom::TrainingProgress::step)
      .def_readwrite("epoch", &loom::TrainingProgress::epoch)
      .def_readwrite("sample", &loom::TrainingProgress::sample);
  py::class_<loom::CheckpointInfo>(m, "CheckpointInfo", "What a save published or a load read.")
      .def_readonly("path", &loom::CheckpointInfo::path)
      .def_readonly("progress", &loom::CheckpointInfo::progress)
      .def_readonly("user", &loom::CheckpointInfo::user)
      .def_readonly("bytes", &loom::CheckpointInfo::bytes)
      .def_readonly("seconds", &loom::CheckpointInfo::seconds)
      .def_readonly("stall_seconds", &loom::CheckpointInfo::stall_seconds);

  // The registered objects must outlive the checkpointer: keep_alive ties them to it.
  py::class_<loom::Checkpointer>(m, "Checkpointer", "loom::Checkpointer (collective construction).",
      destroyed_without_gil())
      .def(py::init([](std::shared_ptr<loom::Communicator> world, const std::string& directory, int keep_last,
                       bool async, const py::object& timeout) {
             loom::CheckpointOptions o;
             o.directory = directory;
             o.keep_last = keep_last;
             o.async = async;
             o.timeout = to_timeout(timeout);
             py::gil_scoped_release release;
             return std::make_unique<loom::Checkpointer>(std::move(world), o);
           }),
           py::arg("world"), py::arg("directory"), py::arg("keep_last") = 3, py::arg("async_") = true,
           py::arg("timeout") = py::none())
      .def("tensor", [](loom::Checkpointer& c, const std::string& name, at::Tensor t) -> loom::Checkpointer& {
             return c.tensor(name, std::move(t));
           }, py::arg("name"), py::arg("tensor"), py::return_value_policy::reference_internal)
      .def(
          "tensor_slice",
          [](loom::Checkpointer& c, const std::string& name, at::Tensor t, std::vector<int64_t> global_shape, int dim,
             int64_t offset, bool tensor_parallel) -> loom::Checkpointer& {
            return c.tensor(name, std::move(t),
                            loom::Checkpointer::Slice{std::move(global_shape), dim, offset, tensor_parallel});
          },
          py::arg("name"), py::arg("tensor"), py::arg("global_shape"), py::arg("dim"), py::arg("offset"),
          py::arg("tensor_parallel") = false, py::return_value_policy::reference_internal)
      .def("remove_tensor", &loom::Checkpointer::remove_tensor, py::arg("name"))
      .def("tensor_parallel", &loom::Checkpointer::tensor_parallel, py::arg("size"), py::arg("rank"),
           py::return_value_policy::reference_internal)
      .def("parallel_layout", &loom::Checkpointer::parallel_layout, py::arg("layout"), py::arg("position"),
           py::return_value_policy::reference_internal,
           "The job's parallel layout and this rank's position in it, recorded in the manifest.")
      // The callables run on the calling thread inside save() and load() (pybind11 takes the GIL).
      .def(
          "object",
          [](loom::Checkpointer& c, const std::string& name, std::function<std::string()> save,
             std::function<void(const std::string&)> check,
             std::function<void(const std::string&)> load) -> loom::Checkpointer& {
            return c.object(name, {std::move(save), std::move(check), std::move(load)});
          },
          py::arg("name"), py::arg("save"), py::arg("check"), py::arg("load"), py::return_value_policy::reference_internal)
      .def(
          "state",
          [](loom::Checkpointer& c, const std::string& name,
             std::shared_ptr<loom::checkpoint::StateProvider> provider) -> loom::Checkpointer& {
            return c.state(name, std::move(provider));
          },
          py::arg("name"), py::arg("provider"), py::keep_alive<1, 3>(), py::return_value_policy::reference,
          "A state provider of this checkpointer's (a torchloom.checkpoint.StateProvider subclass).")
      .def("scaler", &loom::Checkpointer::scaler, py::arg("scaler"), py::keep_alive<1, 2>(),
           py::return_value_policy::reference_internal)
      .def("rng", &loom::Checkpointer::rng, py::arg("tracker"), py::keep_alive<1, 2>(),
           py::return_value_policy::reference_internal)
      .def("save", &loom::Checkpointer::save, py::arg("progress"),
           py::arg("user") = std::map<std::string, std::string>{}, release_gil())
      .def("wait", &loom::Checkpointer::wait, release_gil())
      .def("pending", &loom::Checkpointer::pending)
      .def("load_latest", &loom::Checkpointer::load_latest, release_gil())
      .def("load", &loom::Checkpointer::load, py::arg("path"), release_gil())
      .def("latest", &loom::Checkpointer::latest, release_gil())
      .def_static("find_latest", &loom::Checkpointer::find_latest, py::arg("directory"));

  m.def(
      "consolidate_checkpoint",
      [](const std::string& checkpoint, const std::string& out, bool optimizer) {
        loom::ConsolidateInfo info;
        {
          py::gil_scoped_release release;
          info = loom::consolidate_checkpoint(checkpoint, out, {.optimizer = optimizer});
        }
        py::dict d;
        d["tensors"] = info.tensors;
        d["bytes"] = info.bytes;
        return d;
      },
      py::arg("checkpoint"), py::arg("out"), py::arg("optimizer") = false,
      "The full tensors of a checkpoint as one safetensors file (loom::consolidate_checkpoint).");
}

}  // namespace torchloom_py
