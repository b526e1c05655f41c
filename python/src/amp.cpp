// loom::GradScaler for Python optimizers: the optimizer is identified by its id(), its gradients
// handed over, its step() called back (with the GIL) when the scaler decides to step.
#include "bindings.h"

#include "loom/amp/autocast.h"
#include "loom/amp/grad_scaler.h"
#include "loom/parallel/zero.h"

namespace torchloom_py {

void bind_amp(py::module_& m) {
  py::class_<loom::GradScaler, std::shared_ptr<loom::GradScaler>>(m, "GradScaler", "loom::GradScaler.",
      destroyed_without_gil())
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor, int64_t growth_interval,
                       bool enabled, std::vector<std::shared_ptr<loom::Communicator>> sync_groups) {
             loom::GradScalerOptions o;
             o.init_scale = init_scale;
             o.growth_factor = growth_factor;
             o.backoff_factor = backoff_factor;
             o.growth_interval = growth_interval;
             o.enabled = enabled;
             for (auto& g : sync_groups)
               if (g) o.sync_groups.push_back(std::move(g));
             return std::make_shared<loom::GradScaler>(std::move(o));
           }),
           py::arg("init_scale") = 65536.0, py::arg("growth_factor") = 2.0, py::arg("backoff_factor") = 0.5,
           py::arg("growth_interval") = 2000, py::arg("enabled") = true,
           py::arg("sync_groups") = std::vector<std::shared_ptr<loom::Communicator>>{})
      .def("scale", py::overload_cast<const at::Tensor&>(&loom::GradScaler::scale), py::arg("output"))
      .def("scaled_by_another_rank", [](loom::GradScaler& s, const std::string& device) {
             s.scaled_by_another_rank(at::Device(device));
           }, py::arg("device"))
      .def("unscale_", [](loom::GradScaler& s, uintptr_t optimizer_id, const std::vector<at::Tensor>& grads) {
             py::gil_scoped_release release;
             s.unscale_(reinterpret_cast<const void*>(optimizer_id), grads);
           }, py::arg("optimizer_id"), py::arg("grads"))
      .def("step", [](loom::GradScaler& s, uintptr_t optimizer_id, const std::vector<at::Tensor>& grads,
                      const py::function& optimizer_step) {
             py::gil_scoped_release release;
             return s.step(reinterpret_cast<const void*>(optimizer_id), grads, [&optimizer_step] {
               py::gil_scoped_acquire gil;
               optimizer_step();
             });
           }, py::arg("optimizer_id"), py::arg("grads"), py::arg("optimizer_step"),
           "Unscales (unless done), agrees on found-inf, calls optimizer_step() unless a gradient is inf/NaN on any "
           "rank of the sync groups; returns whether it stepped.")
      .def("unscale_zero", [](loom::GradScaler& s, loom::ZeroOptimizer& zero) { s.unscale_(zero); }, py::arg("zero"),
           release_gil())
      .def("step_zero", [](loom::GradScaler& s, loom::ZeroOptimizer& zero, const py::function& step_shards) {
             py::gil_scoped_release release;
             return s.step(zero, [&step_shards] {
               py::gil_scoped_acquire gil;
               step_shards();
             });
           }, py::arg("zero"), py::arg("step_shards"),
           "As step, for torchloom.ZeroRedundancyOptimizer: found-inf agreed over its group too.")
      .def("update", py::overload_cast<>(&loom::GradScaler::update), release_gil())
      .def("update", py::overload_cast<double>(&loom::GradScaler::update), py::arg("new_scale"))
      .def("get_scale", &loom::GradScaler::get_scale)
      .def("is_enabled", &loom::GradScaler::is_enabled)
      .def("get_growth_factor", &loom::GradScaler::get_growth_factor)
      .def("get_backoff_factor", &loom::GradScaler::get_backoff_factor)
      .def("get_growth_interval", &loom::GradScaler::get_growth_interval)
      .def("get_growth_tracker", &loom::GradScaler::get_growth_tracker)
      .def("set_growth_factor", &loom::GradScaler::set_growth_factor)
      .def("set_backoff_factor", &loom::GradScaler::set_backoff_factor)
      .def("set_growth_interval", &loom::GradScaler::set_growth_interval)
      .def("state_dict", &loom::GradScaler::state_dict)
      .def("load_state_dict", &loom::GradScaler::load_state_dict, py::arg("state"));
}

}  // namespace torchloom_py
