// The checkpoint's state-provider seam (loom/train/checkpoint_state.h) from Python: a Python class
// deriving from torchloom.checkpoint.StateProvider is called by loom::Checkpointer exactly as a C++
// provider is (collect, plan, verify, apply, with the GIL taken for each call), so the state it
// saves has the same names and sections whichever language saved it.
#include "bindings.h"

#include "loom/train/checkpoint.h"
#include "loom/train/checkpoint_state.h"

namespace torchloom_py {

namespace {

namespace ckpt = loom::checkpoint;

// Calls the Python subclass's methods (arguments by pointer: Python sees the checkpointer's own
// objects, not copies); a Python exception becomes the C++ error the checkpointer reports (in plan
// and verify the protocol turns it into this rank's refusal).
class PyStateProvider : public ckpt::StateProvider {
 public:
  void collect(int rank, ckpt::SaveState& out) override {
    PYBIND11_OVERRIDE_PURE(void, ckpt::StateProvider, collect, rank, &out);
  }
  void plan(const ckpt::LoadContext& context, std::vector<ckpt::Need>& needs,
            std::vector<std::string>& problems) override {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const ckpt::StateProvider*>(this), "plan");
    if (!override) py::pybind11_fail("StateProvider.plan is not implemented");
    py::list found_needs, found_problems;
    override(&context, found_needs, found_problems);
    for (const auto& need : found_needs) needs.push_back(need.cast<ckpt::Need>());
    for (const auto& problem : found_problems) problems.push_back(problem.cast<std::string>());
  }
  void verify(const ckpt::LoadContext& context, const ckpt::LoadedTensors& data,
              std::vector<std::string>& problems) override {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const ckpt::StateProvider*>(this), "verify");
    if (!override) return;
    py::list found_problems;
    override(&context, data, found_problems);
    for (const auto& problem : found_problems) problems.push_back(problem.cast<std::string>());
  }
  void apply(const ckpt::LoadContext& context, const ckpt::LoadedTensors& data) override {
    PYBIND11_OVERRIDE_PURE(void, ckpt::StateProvider, apply, &context, data);
  }
};

}  // namespace

void bind_checkpoint_state(py::module_& m) {
  py::class_<ckpt::TensorRecord>(m, "TensorRecord", "What the manifest records of one saved tensor.")
      .def_readonly("shape", &ckpt::TensorRecord::shape)
      .def_readonly("split_dim", &ckpt::TensorRecord::split_dim);
  py::class_<ckpt::LocalTensor>(m, "LocalTensor", "A tensor (or this rank's slice of one) as it is saved.")
      .def_readonly("name", &ckpt::LocalTensor::name)
      .def_readonly("tensor", &ckpt::LocalTensor::tensor)
      .def_readonly("global_shape", &ckpt::LocalTensor::global_shape)
      .def_readonly("split_dim", &ckpt::LocalTensor::split_dim)
      .def_readonly("offset", &ckpt::LocalTensor::offset);
  py::class_<ckpt::Need>(m, "Need", "A saved tensor a provider wants back (made by need_for).")
      .def_readonly("name", &ckpt::Need::name);
  py::class_<ckpt::SaveState>(m, "SaveState", "What this rank holds, as every provider described it.")
      .def_readonly("for_load", &ckpt::SaveState::for_load)
      .def(
          "add_tensor",
          [](ckpt::SaveState& s, const std::string& name, const at::Tensor& tensor,
             std::optional<std::vector<int64_t>> global_shape, int dim, int64_t offset, bool lowest_rank_writes) {
            s.tensors.push_back(ckpt::describe_slice(name, tensor, global_shape ? dim : -1,
                                                     global_shape.value_or(std::vector<int64_t>{}), offset));
            s.tensors.back().lowest_rank_writes = lowest_rank_writes;
          },
          py::arg("name"), py::arg("tensor"), py::arg("global_shape") = py::none(), py::arg("dim") = -1,
          py::arg("offset") = 0, py::arg("lowest_rank_writes") = false,
          "Saves `tensor` as `name`: whole, or as the slice at `offset` along `dim` of a tensor of global_shape "
          "(lowest_rank_writes: a buffer every rank holds, of which the lowest rank's copy is saved).")
      .def(
          "set_section", [](ckpt::SaveState& s, const std::string& name, std::string json) { s.sections[name] = std::move(json); },
          py::arg("name"), py::arg("json"), "This provider's manifest section, as JSON text.")
      .def(
          "find", [](const ckpt::SaveState& s, const std::string& name) { return s.find(name); },
          py::return_value_policy::reference_internal, py::arg("name"));
  py::class_<ckpt::LoadContext>(m, "LoadContext", "What a provider sees of the checkpoint being loaded.")
      .def_readonly("rank", &ckpt::LoadContext::rank)
      .def_readonly("size", &ckpt::LoadContext::size)
      .def_property_readonly("path", [](const ckpt::LoadContext& c) { return c.path; })
      .def_property_readonly("live", [](const ckpt::LoadContext& c) -> const ckpt::SaveState& { return c.live; },
                             py::return_value_policy::reference_internal)
      .def("record", &ckpt::LoadContext::record, py::return_value_policy::reference_internal, py::arg("name"))
      .def("saved_names", &ckpt::LoadContext::saved_names, py::arg("prefix"),
           "The saved tensors' names starting with prefix, sorted.")
      .def("section", &ckpt::LoadContext::section, py::arg("name"), "The JSON text of a section; '' when none.")
      .def("same_layout", &ckpt::LoadContext::same_layout);
  py::class_<ckpt::StateProvider, PyStateProvider, std::shared_ptr<ckpt::StateProvider>>(
      m, "StateProvider", "loom::checkpoint::StateProvider: subclass it and implement collect, plan, verify, apply.")
      .def(py::init<>());
  m.def(
      "need_for",
      [](const ckpt::LocalTensor& live, const ckpt::TensorRecord& record, py::list needs) -> std::optional<std::string> {
        std::vector<ckpt::Need> found;
        auto mismatch = ckpt::need_for(live, record, found);
        for (auto& need : found) needs.append(std::move(need));
        return mismatch;
      },
      py::arg("live"), py::arg("record"), py::arg("needs"),
      "Appends the need for the live tensor (same name saved); the mismatch text when the record differs.");
  m.def(
      "need_like",
      [](const std::string& saved, const ckpt::TensorRecord& record, const ckpt::LocalTensor* like,
         py::list needs) -> std::optional<std::string> {
        std::vector<ckpt::Need> found;
        auto mismatch = ckpt::need_like(saved, record, like, found);
        for (auto& need : found) needs.append(std::move(need));
        return mismatch;
      },
      py::arg("saved"), py::arg("record"), py::arg("like"), py::arg("needs"),
      "Appends the need for the saved tensor laid out as the live tensor `like` (None: whole); the "
      "mismatch text when the global shapes differ.");
}

}  // namespace torchloom_py
