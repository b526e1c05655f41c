// Shared by the binding's translation units: pybind11 (torch's copy, with torch's Tensor casters)
// and the helpers every part uses. The module is an adapter: each binding forwards to one C++ call.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <exception>
#include <optional>

#include "loom/config.h"

namespace torchloom_py {

namespace py = pybind11;

// Releases the GIL for the duration of a (possibly blocking) C++ call.
using release_gil = py::call_guard<py::gil_scoped_release>;

// Given to every class whose C++ destructor can wait for a thread (a communicator joins its
// progress thread, a checkpointer its writer), or that may hold the last reference to such an
// object: the destructor runs without the GIL. That thread may itself need the GIL, to drop the
// last reference to a tensor whose Python object is then freed; holding it while joining was a
// deadlock (a sub-group going out of scope while its operation ran).
using destroyed_without_gil = py::release_gil_before_calling_cpp_dtor;

// A Python timeout (seconds as a number, a datetime.timedelta, or None for the default) as the
// library's Timeout.
loom::Timeout to_timeout(const py::object& timeout);

// The mirrored Python exception for a C++ error: sets the Python error indicator; false when the
// exception is not a loom::Error.
bool set_python_error(std::exception_ptr error);
// The mirrored Python exception object (not raised) for a C++ error; None for nullptr.
py::object python_exception(std::exception_ptr error);

void bind_errors(py::module_& m);
void bind_comm(py::module_& m);
void bind_data_parallel(py::module_& m);
void bind_zero(py::module_& m);
void bind_amp(py::module_& m);
void bind_tensor_parallel(py::module_& m);
void bind_checkpoint(py::module_& m);
void bind_checkpoint_state(py::module_& m);
void bind_distributed(py::module_& m);
void bind_pipeline(py::module_& m);

}  // namespace torchloom_py
