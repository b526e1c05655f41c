// torchloom.PipelineExecutor: loom::pp::PipelineExecutor over Python callables (torch.nn.Module
// stages). step() runs without the GIL; each stage, the loss and before_backward take it when
// called (pybind11's function wrappers), so autograd's own threads never wait on it.
#include "bindings.h"
#include "loom/error.h"
#include "loom/parallel/pipeline.h"

namespace torchloom_py {

void bind_pipeline(py::module_& m) {
  using loom::pp::PipelineExecutor;
  using loom::pp::PipelineStepTimes;
  py::class_<PipelineStepTimes>(m, "PipelineStepTimes", "Where this rank's last pipeline step went (seconds).")
      .def_readonly("seconds", &PipelineStepTimes::seconds)
      .def_readonly("compute", &PipelineStepTimes::compute)
      .def_readonly("communicate", &PipelineStepTimes::communicate)
      .def_property_readonly("bubble", &PipelineStepTimes::bubble, "1 - compute / seconds");
  py::class_<PipelineExecutor, std::shared_ptr<PipelineExecutor>>(
      m, "PipelineExecutor",
      "Runs a pipeline schedule over this rank's stages (loom::pp::PipelineExecutor): "
      "PipelineExecutor(group, [stage], schedule='1f1b', micro_batches=8).",
      destroyed_without_gil())
      .def(py::init([](std::shared_ptr<loom::Communicator> group, std::vector<loom::pp::StageFunction> chunks,
                       const std::string& schedule, int micro_batches,
                       std::function<void(int, int, bool)> before_backward, const py::object& timeout) {
             loom::pp::PipelineOptions options;
             options.schedule = loom::pp::parse_schedule(schedule);
             options.micro_batches = micro_batches;
             options.before_backward = std::move(before_backward);
             if (!timeout.is_none()) options.timeout = to_timeout(timeout);
             py::gil_scoped_release release;
             return std::make_shared<PipelineExecutor>(std::move(group), std::move(chunks), options);
           }),
           py::arg("group"), py::arg("chunks"), py::arg("schedule") = "1f1b", py::arg("micro_batches") = 1,
           py::arg("before_backward") = nullptr, py::arg("timeout") = py::none())
      .def("step", &PipelineExecutor::step, py::arg("inputs"), py::arg("loss") = nullptr, release_gil(),
           "Every micro-batch forward and backward; inputs on the first stage, loss(output, m) on the last. "
           "Returns the last stage's losses (detached), else [].")
      .def("forward_only", &PipelineExecutor::forward_only, py::arg("inputs"), release_gil(),
           "Forward only (evaluation, generation), inputs of any shape on the first stage; returns the last "
           "stage's outputs, else [].")
      .def_property_readonly("last_step", &PipelineExecutor::last_step, py::return_value_policy::copy)
      .def_property_readonly("bubble_promised", [](const PipelineExecutor& e) { return e.proof().bubble; })
      .def_property_readonly("holds_first_stage", &PipelineExecutor::holds_first_stage)
      .def_property_readonly("holds_last_stage", &PipelineExecutor::holds_last_stage)
      .def_property_readonly("rank", &PipelineExecutor::rank);
  m.def(
      "pipeline_linear",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
        return loom::pp::linear(input, weight, bias.value_or(at::Tensor()));
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
      "torch.nn.functional.linear whose weight gradient a 'zero-bubble' PipelineExecutor computes apart from the "
      "input gradient (its W step); elsewhere the same gradients at once.");
  m.def("stage_layers", &loom::pp::stage_layers, py::arg("layers"), py::arg("stages"), py::arg("stage"),
        "(first, end): the layers of `stage` when `layers` blocks are cut into `stages` consecutive runs.");
}

}  // namespace torchloom_py
