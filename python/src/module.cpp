// torchloom._C: the module, the exceptions mirroring loom::Error's hierarchy, versions.
#include "bindings.h"

#include <torch/version.h>

#include "loom/comm/mpi.h"
#include "loom/comm/nccl.h"
#include "loom/error.h"

namespace torchloom_py {
namespace {

// The Python classes, created once at import (strong references kept for the process's life).
PyObject* g_error = nullptr;
PyObject* g_invalid_argument = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_config = nullptr;
PyObject* g_comm = nullptr;
PyObject* g_timeout = nullptr;
PyObject* g_mismatch = nullptr;
PyObject* g_checkpoint = nullptr;

PyObject* make_exception(py::module_& m, const char* name, std::initializer_list<PyObject*> bases, const char* doc) {
  py::tuple base_tuple(bases.size());
  size_t i = 0;
  for (PyObject* b : bases) base_tuple[i++] = py::reinterpret_borrow<py::object>(b);
  std::string qualified = std::string("torchloom.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base_tuple.ptr(), nullptr);
  if (!cls) throw py::error_already_set();
  m.attr(name) = py::reinterpret_borrow<py::object>(cls);
  return cls;  // the new reference is kept
}

// The class mirroring the dynamic type of `error` and its message; nullptr when not a loom::Error.
std::pair<PyObject*, std::string> classify(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const loom::TimeoutError& e) {
    return {g_timeout, e.what()};
  } catch (const loom::CommError& e) {
    return {g_comm, e.what()};
  } catch (const loom::UnsupportedError& e) {
    return {g_unsupported, e.what()};
  } catch (const loom::InvalidArgumentError& e) {
    return {g_invalid_argument, e.what()};
  } catch (const loom::ConfigError& e) {
    return {g_config, e.what()};
  } catch (const loom::MismatchError& e) {
    return {g_mismatch, e.what()};
  } catch (const loom::CheckpointError& e) {
    return {g_checkpoint, e.what()};
  } catch (const loom::Error& e) {
    return {g_error, e.what()};
  } catch (...) {
    return {nullptr, {}};
  }
}

}  // namespace

loom::Timeout to_timeout(const py::object& timeout) {
  if (timeout.is_none()) return loom::kDefaultTimeout;
  double seconds;
  if (py::hasattr(timeout, "total_seconds")) {
    seconds = timeout.attr("total_seconds")().cast<double>();
  } else {
    seconds = timeout.cast<double>();
  }
  if (!(seconds >= 0))
    throw loom::InvalidArgumentError("timeout must be a non-negative number of seconds, found " +
                                     std::to_string(seconds));
  // Saturate instead of converting out of range (undefined behaviour for inf and for anything from
  // 9.2e15 s): a timeout beyond what int64 milliseconds hold means "practically forever", and the
  // deadline arithmetic saturates in turn.
  const double ms = seconds * 1000.0 + 0.5;
  if (ms >= 9.2e18) return loom::Timeout::max();
  return loom::Timeout(static_cast<int64_t>(ms));
}

bool set_python_error(std::exception_ptr error) {
  auto [cls, message] = classify(error);
  if (!cls) return false;
  PyErr_SetString(cls, message.c_str());
  return true;
}

py::object python_exception(std::exception_ptr error) {
  if (!error) return py::none();
  auto [cls, message] = classify(error);
  if (!cls) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(e.what());
    } catch (...) {
      return py::reinterpret_borrow<py::object>(PyExc_RuntimeError)("unknown C++ exception");
    }
  }
  return py::reinterpret_borrow<py::object>(cls)(message);
}

void bind_errors(py::module_& m) {
  g_error = make_exception(m, "Error", {PyExc_RuntimeError},
                           "Base of every torchloom error (loom::Error). The message names the rank, the operation "
                           "and what was expected against what was found.");
  g_invalid_argument = make_exception(m, "InvalidArgumentError", {g_error, PyExc_ValueError},
                                      "An argument or tensor an operation cannot accept (loom::InvalidArgumentError); "
                                      "rejected before anything is sent.");
  g_unsupported = make_exception(m, "UnsupportedError", {g_invalid_argument},
                                 "An operation the communicator's backend cannot run, refused by name before it is "
                                 "numbered (loom::UnsupportedError).");
  g_config = make_exception(m, "ConfigError", {g_error},
                            "The launch environment or a LOOM_* variable is missing, malformed or inconsistent "
                            "across ranks (loom::ConfigError).");
  g_comm = make_exception(m, "CommError", {g_error},
                          "A communication operation failed, or its communicator was aborted (loom::CommError).");
  g_timeout = make_exception(m, "TimeoutError", {g_comm, PyExc_TimeoutError},
                             "An operation did not complete within its timeout (loom::TimeoutError).");
  g_mismatch = make_exception(m, "MismatchError", {g_error},
                              "Ranks disagree (collective, model layout, configuration); the message shows both "
                              "sides (loom::MismatchError).");
  g_checkpoint = make_exception(m, "CheckpointError", {g_error},
                                "A checkpoint could not be written, read or verified (loom::CheckpointError).");
  py::register_exception_translator([](std::exception_ptr p) {
    if (p && !set_python_error(p)) std::rethrow_exception(p);
  });
}

}  // namespace torchloom_py

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using namespace torchloom_py;
  m.doc() = "torchloom's C++ runtime (libtorchloom) for Python: use the `torchloom` package, not this module.";
  m.attr("__version__") = TORCHLOOM_VERSION;
  m.attr("torch_version_compiled") = TORCH_VERSION;
  m.def("mpi_library_version", &loom::mpi::library_version, "The MPI library's version string.");
  m.def("nccl_compiled", &loom::nccl::compiled, "Whether the NCCL backend is compiled in.");
  m.def("nccl_version", &loom::nccl::built_version, "NCCL version code of the headers built with (0: not compiled).");
  bind_errors(m);
  bind_comm(m);
  bind_data_parallel(m);
  bind_zero(m);
  bind_amp(m);
  bind_tensor_parallel(m);
  bind_pipeline(m);
  bind_checkpoint_state(m);  // before the Checkpointer, whose state() takes a StateProvider
  bind_checkpoint(m);
  bind_distributed(m);
}
