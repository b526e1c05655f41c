// ZeRO for Python: loom::ZeroOptimizer without an optimizer of its own (the reducer's
// reduce-scatter, the flat shards, the all-gather), stepped by a torch.optim optimizer that
// torchloom.ZeroRedundancyOptimizer (python/torchloom/zero.py) builds over the shard tensors.
#include "bindings.h"

#include <limits>

#include "loom/parallel/zero.h"

namespace torchloom_py {

void bind_zero(py::module_& m) {
  py::class_<loom::ZeroOptimizer, std::shared_ptr<loom::ZeroOptimizer>>(
      m, "_Zero", "loom::ZeroOptimizer without an optimizer: the shards, their gradients and the all-gather.",
      destroyed_without_gil())
      .def(py::init([](std::vector<at::Tensor> parameters, std::shared_ptr<loom::Communicator> group, int stage,
                       double bucket_cap_mb, double first_bucket_cap_mb, bool find_unused_parameters,
                       std::optional<at::ScalarType> reduce_dtype, bool broadcast_parameters,
                       std::vector<std::string> names, bool master_weights, bool overlap_param_gather) {
             if (!(bucket_cap_mb > 0) || !(first_bucket_cap_mb > 0))
               throw loom::InvalidArgumentError("ZeroRedundancyOptimizer: bucket_cap_mb must be positive, found " +
                                                std::to_string(bucket_cap_mb));
             auto bytes = [](double mb) {  // saturating, as the reducer's binding
               const double b = mb * 1024 * 1024;
               return b >= 1.8e19 ? std::numeric_limits<size_t>::max() : static_cast<size_t>(b);
             };
             loom::ZeroOptions options;
             options.stage = stage;
             options.bucket_cap_bytes = bytes(bucket_cap_mb);
             options.first_bucket_cap_bytes = bytes(first_bucket_cap_mb);
             options.find_unused_parameters = find_unused_parameters;
             options.reduce_dtype = reduce_dtype;
             options.broadcast_parameters = broadcast_parameters;
             options.parameter_names = std::move(names);
             options.master_weights = master_weights;
             options.overlap_param_gather = overlap_param_gather;
             py::gil_scoped_release release;
             return std::make_shared<loom::ZeroOptimizer>(std::move(parameters), std::move(group), options);
           }),
           py::arg("parameters"), py::arg("group"), py::arg("stage") = 1, py::arg("bucket_cap_mb") = 25.0,
           py::arg("first_bucket_cap_mb") = 1.0, py::arg("find_unused_parameters") = false,
           py::arg("reduce_dtype") = py::none(), py::arg("broadcast_parameters") = true,
           py::arg("names") = std::vector<std::string>{}, py::arg("master_weights") = true,
           py::arg("overlap_param_gather") = false)
      .def("zero_grad", &loom::ZeroOptimizer::zero_grad)
      .def("clip_grad_norm", py::overload_cast<double>(&loom::ZeroOptimizer::clip_grad_norm), py::arg("max_norm"),
           release_gil())
      .def("begin_step", &loom::ZeroOptimizer::begin_step)
      .def("gather_parameters", &loom::ZeroOptimizer::gather_parameters, release_gil())
      .def("set_sync", [](loom::ZeroOptimizer& z, bool enabled) { z.reducer().set_sync(enabled); }, py::arg("enabled"))
      .def("sync_enabled", [](loom::ZeroOptimizer& z) { return z.reducer().sync_enabled(); })
      .def("wait_parameters", py::overload_cast<const std::vector<at::Tensor>&>(&loom::ZeroOptimizer::wait_parameters),
           py::arg("parameters"), release_gil())
      .def("wait_all_parameters", py::overload_cast<>(&loom::ZeroOptimizer::wait_parameters), release_gil())
      .def("unwaited_buckets", &loom::ZeroOptimizer::unwaited_buckets)
      .def("refresh_master_weights", &loom::ZeroOptimizer::refresh_master_weights, release_gil())
      .def("placements", [](const loom::ZeroOptimizer& z) {
        std::vector<std::tuple<size_t, int64_t, int64_t>> out;
        for (const auto& p : z.placements()) out.emplace_back(p.bucket, p.offset, p.numel);
        return out;
      }, "Per parameter: (bucket, offset in the bucket's flat layout, numel).")
      .def("shard_numel", &loom::ZeroOptimizer::shard_numel, py::arg("bucket"))
      .def("has_master_weights", &loom::ZeroOptimizer::has_master_weights, py::arg("bucket"))
      .def("shard_parameters", &loom::ZeroOptimizer::shard_parameters)
      .def("shard_gradients", &loom::ZeroOptimizer::shard_gradients)
      .def("memory", [](const loom::ZeroOptimizer& z) {
        const loom::ZeroMemory mem = z.memory();
        py::dict d;
        d["parameters"] = mem.parameters;
        d["gradients"] = mem.gradients;
        d["master_weights"] = mem.master_weights;
        return d;
      }, "Bytes of the parameters' and gradients' storages (the optimizer's state is the Python optimizer's).")
      .def("stats", [](const loom::ZeroOptimizer& z) {
        const loom::ZeroStats s = z.stats();
        py::dict d;
        d["steps"] = s.steps;
        d["bytes_reduce_scattered"] = s.bytes_reduce_scattered;
        d["bytes_all_gathered"] = s.bytes_all_gathered;
        return d;
      })
      .def_property_readonly("stage", &loom::ZeroOptimizer::stage)
      .def_property_readonly("parameters", &loom::ZeroOptimizer::parameters)
      .def_property_readonly("group", [](const loom::ZeroOptimizer& z) { return z.group().shared_from_this(); });
}

}  // namespace torchloom_py
