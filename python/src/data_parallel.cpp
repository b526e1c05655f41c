// Data parallelism: the C++ GradientReducer over a Python module's named parameters, and the
// module wrapper's steps (frozen parameters, buffer broadcast, the unchanged-model check) that
// torchloom.DistributedDataParallel calls in the order loom::DistributedDataParallel does.
#include "bindings.h"

#include "loom/parallel/data_parallel.h"

#include <limits>

namespace torchloom_py {
namespace {

// A communication hook built into the library (comm_hooks::fp16_compress, ...).
struct BuiltinCommHook {
  std::string name;
  loom::CommHook hook;
};

// The bucket a Python hook sees.
struct PyGradBucket {
  size_t index;
  at::Tensor buffer;
  std::vector<size_t> parameters;
  std::shared_ptr<loom::Communicator> group;
  double divisor;
  bool last;
};

loom::ReducerOptions reducer_options(double bucket_cap_mb, double first_bucket_cap_mb, bool find_unused_parameters,
                                     bool static_graph, bool gradient_as_bucket_view, bool broadcast_parameters,
                                     std::optional<double> divisor, std::vector<std::string> names) {
  if (!(bucket_cap_mb > 0) || !(first_bucket_cap_mb > 0))
    throw loom::InvalidArgumentError("DistributedDataParallel: bucket_cap_mb must be positive, found " +
                                     std::to_string(bucket_cap_mb));
  loom::ReducerOptions o;
  // Saturating: float('inf') (one bucket for everything) or any value beyond size_t must not reach
  // a float-to-integer conversion out of range (undefined behaviour).
  auto bytes = [](double mb) {
    const double b = mb * 1024 * 1024;
    return b >= 1.8e19 ? std::numeric_limits<size_t>::max() : static_cast<size_t>(b);
  };
  o.bucket_cap_bytes = bytes(bucket_cap_mb);
  o.first_bucket_cap_bytes = bytes(first_bucket_cap_mb);
  o.find_unused_parameters = find_unused_parameters;
  o.static_graph = static_graph;
  o.gradient_as_bucket_view = gradient_as_bucket_view;
  o.broadcast_parameters = broadcast_parameters;
  o.divisor = divisor;
  o.parameter_names = std::move(names);
  return o;
}

// A Python callable hook(state, bucket) returning a Work, or (Work or None, finish) where finish()
// runs after the wait and must leave bucket.buffer holding the averaged gradients (torchloom's
// DistributedDataParallel turns a torch-style hook's Future into (None, wait-and-copy)).
loom::CommHook python_hook(py::object state, py::object fn) {
  // The Python objects are released with the GIL, whichever thread drops the reducer's last reference.
  auto keep = std::shared_ptr<std::pair<py::object, py::object>>(
      new std::pair<py::object, py::object>(std::move(state), std::move(fn)), [](std::pair<py::object, py::object>* p) {
        py::gil_scoped_acquire gil;
        delete p;
      });
  return [keep](loom::GradBucket& bucket) -> loom::PendingReduction {
    py::gil_scoped_acquire gil;
    PyGradBucket b{bucket.index, bucket.buffer, bucket.parameters,
                   bucket.group ? bucket.group->shared_from_this() : nullptr, bucket.divisor, bucket.last};
    py::object result = keep->second(keep->first, b);
    loom::PendingReduction pending;
    if (py::isinstance<py::tuple>(result)) {
      auto pair = result.cast<py::tuple>();
      if (!pair[0].is_none()) pending.work = pair[0].cast<loom::WorkPtr>();  // None: finish alone completes it
      if (!pair[1].is_none()) {
        auto finish = std::shared_ptr<py::object>(new py::object(pair[1]), [](py::object* f) {
          py::gil_scoped_acquire gil;
          delete f;
        });
        pending.finish = [finish] {
          py::gil_scoped_acquire gil;
          (*finish)();
        };
      }
    } else if (!result.is_none()) {
      pending.work = result.cast<loom::WorkPtr>();
    }
    return pending;
  };
}

}  // namespace

void bind_data_parallel(py::module_& m) {
  py::class_<BuiltinCommHook>(m, "BuiltinCommHook", "A communication hook implemented in C++ (loom::comm_hooks).")
      .def_readonly("name", &BuiltinCommHook::name)
      .def("__repr__", [](const BuiltinCommHook& h) { return "<torchloom comm hook " + h.name + ">"; });
  m.attr("allreduce_hook") = BuiltinCommHook{"allreduce_hook", loom::comm_hooks::all_reduce_average()};
  m.attr("fp16_compress_hook") = BuiltinCommHook{"fp16_compress_hook", loom::comm_hooks::fp16_compress()};
  m.attr("bf16_compress_hook") = BuiltinCommHook{"bf16_compress_hook", loom::comm_hooks::bf16_compress()};

  py::class_<PyGradBucket>(m, "_GradBucket", "One bucket handed to a communication hook (loom::GradBucket).",
      destroyed_without_gil())
      .def_readonly("index", &PyGradBucket::index)
      .def_readonly("buffer", &PyGradBucket::buffer, "Flat gradients of the bucket; reduce in place.")
      .def_readonly("parameters", &PyGradBucket::parameters, "Indices into the reducer's parameters.")
      .def_readonly("group", &PyGradBucket::group)
      .def_readonly("divisor", &PyGradBucket::divisor, "The reduced sum must be divided by this.")
      .def_readonly("last", &PyGradBucket::last, "The last bucket reduced in this iteration.");

  py::class_<loom::GradientReducer, std::shared_ptr<loom::GradientReducer>>(
      m, "GradientReducer",
      "Bucketed gradient all-reduce overlapping backward, over a list of parameters (loom::GradientReducer).",
      destroyed_without_gil())
      .def(py::init([](std::vector<at::Tensor> parameters, std::shared_ptr<loom::Communicator> group,
                       double bucket_cap_mb, double first_bucket_cap_mb, bool find_unused_parameters, bool static_graph,
                       bool gradient_as_bucket_view, bool broadcast_parameters, std::optional<double> divisor,
                       std::vector<std::string> names) {
             auto options = reducer_options(bucket_cap_mb, first_bucket_cap_mb, find_unused_parameters, static_graph,
                                            gradient_as_bucket_view, broadcast_parameters, divisor, std::move(names));
             py::gil_scoped_release release;
             return std::make_shared<loom::GradientReducer>(std::move(parameters), std::move(group), options);
           }),
           py::arg("parameters"), py::arg("group"), py::arg("bucket_cap_mb") = 25.0,
           py::arg("first_bucket_cap_mb") = 1.0, py::arg("find_unused_parameters") = false,
           py::arg("static_graph") = false, py::arg("gradient_as_bucket_view") = true,
           py::arg("broadcast_parameters") = true, py::arg("divisor") = py::none(),
           py::arg("names") = std::vector<std::string>{})
      .def("synchronize", &loom::GradientReducer::synchronize, release_gil())
      .def("has_pending", &loom::GradientReducer::has_pending)
      .def("zero_grad", &loom::GradientReducer::zero_grad)
      .def("set_sync", &loom::GradientReducer::set_sync, py::arg("enabled"))
      .def("sync_enabled", &loom::GradientReducer::sync_enabled)
      .def("register_builtin_comm_hook", [](loom::GradientReducer& r, const BuiltinCommHook& h) {
        r.register_comm_hook(h.hook);
      })
      .def("register_python_comm_hook", [](loom::GradientReducer& r, py::object state, py::object hook) {
        r.register_comm_hook(python_hook(std::move(state), std::move(hook)));
      })
      .def("bucket_layout", &loom::GradientReducer::bucket_layout)
      .def("stats", [](const loom::GradientReducer& r) {
        const loom::ReducerStats s = r.stats();
        py::dict d;
        d["iterations"] = s.iterations;
        d["synchronized_iterations"] = s.synchronized_iterations;
        d["buckets"] = s.buckets;
        d["last_buckets_issued_during_backward"] = s.last_buckets_issued_during_backward;
        d["buckets_reduced"] = s.buckets_reduced;
        d["last_unused_parameters"] = s.last_unused_parameters;
        d["used_set_agreements"] = s.used_set_agreements;
        d["buckets_rebuilt"] = s.buckets_rebuilt;
        return d;
      })
      .def_property_readonly("parameters", &loom::GradientReducer::parameters)
      .def_property_readonly("group", [](const loom::GradientReducer& r) { return r.group().shared_from_this(); });

  py::class_<loom::detail::ModuleParameters>(m, "_ModuleParameters",
                                             "A module's parameters, names and trainability at one moment.")
      .def(py::init([](std::vector<at::Tensor> all, std::vector<std::string> names, std::vector<bool> trainable) {
             if (all.size() != names.size() || all.size() != trainable.size())
               throw loom::InvalidArgumentError("_ModuleParameters: parameters, names and trainable differ in length");
             return loom::detail::ModuleParameters{std::move(all), std::move(names), std::move(trainable)};
           }),
           py::arg("parameters"), py::arg("names"), py::arg("trainable"))
      .def("trainable_tensors", &loom::detail::ModuleParameters::trainable_tensors)
      .def("trainable_names", &loom::detail::ModuleParameters::trainable_names);
  m.def("_prepare_frozen_parameters", &loom::detail::prepare_frozen_parameters, py::arg("group"),
        py::arg("parameters"), release_gil());
  m.def("_check_parameters_unchanged", &loom::detail::check_parameters_unchanged, py::arg("group"),
        py::arg("at_construction"), py::arg("now"));
  m.def("_broadcast_tensors", [](loom::Communicator& group, const std::vector<at::Tensor>& tensors,
                                 const std::string& purpose) {
        py::gil_scoped_release release;
        loom::detail::broadcast_tensors(group, tensors, purpose.c_str());
      }, py::arg("group"), py::arg("tensors"), py::arg("purpose"));
}

}  // namespace torchloom_py
