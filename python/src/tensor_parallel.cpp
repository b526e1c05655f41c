// Tensor parallelism: the C++ layers (their Python nn.Module counterparts own the parameters and
// hand them to these objects), the region operations, the vocabulary-parallel cross-entropy, the
// RNG tracker and ParallelState.
#include "bindings.h"

#include "loom/parallel/tensor_parallel.h"

#include <torch/cuda.h>

namespace torchloom_py {
namespace {

template <typename Impl>
py::dict shard_info_dict(const Impl& layer) {
  py::dict out;
  for (const auto& [name, info] : layer.shard_info()) {
    py::dict d;
    d["dim"] = info.dim;
    d["global_shape"] = info.global_shape;
    d["offset"] = info.offset;
    d["tp_rank"] = info.tp_rank;
    d["tp_size"] = info.tp_size;
    out[py::str(name)] = d;
  }
  return out;
}

// `with tracker.fork(name):` — a ForkGuard alive between __enter__ and __exit__.
struct ForkContext {
  loom::RngTracker* tracker;
  std::string name;
  std::optional<loom::RngTracker::ForkGuard> guard;
  // torchloom.tensor_parallel.fork(): also the current CUDA device's tracker, when seeded.
  loom::RngTracker* cuda_tracker = nullptr;
  std::optional<loom::RngTracker::ForkGuard> cuda_guard;
};

// The current CUDA device's tracker, or nullptr where torch sees no GPU.
loom::RngTracker* current_cuda_tracker() {
  if (!torch::cuda::is_available()) return nullptr;
  return &loom::rng_tracker(c10::Device(c10::kCUDA));  // no index: the current device
}

// Seeds the CPU tracker and, where there is a GPU, the current CUDA device's (as Megatron's
// model_parallel_cuda_manual_seed): draws in a forked region differ per TP rank on either device.
void seed_every_device(uint64_t seed, int tp_rank) {
  loom::model_parallel_seed(seed, tp_rank, loom::rng_tracker());
  if (loom::RngTracker* cuda = current_cuda_tracker()) loom::model_parallel_seed(seed, tp_rank, *cuda);
}

// init=None keeps the C++ default. "master": the full weight drawn as the plain torch layer would
// from the default generator, then sliced (equal to the plain layer at every TP degree); "sharded":
// each rank draws only its shard from the model-parallel stream (loom::ParallelInit, where the
// library has it).
template <typename Options>
void set_initialization(Options& o, const std::optional<std::string>& init, const char* layer) {
  if (!init) return;
  if (*init != "master" && *init != "sharded")
    throw loom::InvalidArgumentError(std::string(layer) + ": init must be 'master' or 'sharded', found '" + *init + "'");
  if constexpr (requires { o.initialization.mode; }) {
    using Mode = decltype(o.initialization.mode);
    o.initialization.mode = *init == "master" ? Mode::Master : Mode::Sharded;
  } else if (*init == "sharded") {
    throw loom::InvalidArgumentError(std::string(layer) +
                                     ": init='sharded' needs a library with loom::ParallelInit; this one draws the "
                                     "master weight (init='master')");
  }
}

loom::LossReduction parse_reduction(const std::string& r) {
  if (r == "mean") return loom::LossReduction::Mean;
  if (r == "sum") return loom::LossReduction::Sum;
  if (r == "none") return loom::LossReduction::None;
  throw loom::InvalidArgumentError("vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', found '" +
                                   r + "'");
}

}  // namespace

void bind_tensor_parallel(py::module_& m) {
  using Group = loom::TensorParallelGroup;
  py::module_& tp = m;  // flat in _C: the Python package groups them (torchloom.tensor_parallel)
  tp.def("copy_to_region", &loom::tp::copy_to_region, py::arg("input"), py::arg("group"), release_gil());
  tp.def("reduce_from_region", &loom::tp::reduce_from_region, py::arg("input"), py::arg("group"), release_gil());
  tp.def("scatter_to_region", &loom::tp::scatter_to_region, py::arg("input"), py::arg("group"), release_gil());
  tp.def("gather_from_region", &loom::tp::gather_from_region, py::arg("input"), py::arg("group"), release_gil());
  tp.def("scatter_to_sequence_region", &loom::tp::scatter_to_sequence_region, py::arg("input"), py::arg("group"),
         release_gil());
  tp.def("gather_from_sequence_region", &loom::tp::gather_from_sequence_region, py::arg("input"), py::arg("group"),
         py::arg("grad_is_partial") = true, release_gil());
  tp.def("reduce_scatter_to_sequence_region", &loom::tp::reduce_scatter_to_sequence_region, py::arg("input"),
         py::arg("group"), release_gil());
  tp.def("vocab_parallel_cross_entropy", [](const at::Tensor& logits, const at::Tensor& target, const Group& group,
                                            int64_t ignore_index, double label_smoothing, const std::string& reduction) {
           loom::VocabParallelCrossEntropyOptions o{ignore_index, label_smoothing, parse_reduction(reduction)};
           py::gil_scoped_release release;
           return loom::vocab_parallel_cross_entropy(logits, target, group, o);
         }, py::arg("logits"), py::arg("target"), py::arg("group"), py::arg("ignore_index") = -100,
         py::arg("label_smoothing") = 0.0, py::arg("reduction") = "mean");
  tp.def("padded_vocab_size", &loom::padded_vocab_size, py::arg("vocab"), py::arg("tp_degree"),
         py::arg("multiple") = 1);

  py::class_<loom::ColumnParallelLinearImpl, std::shared_ptr<loom::ColumnParallelLinearImpl>>(
      tp, "ColumnParallelLinear", "loom::ColumnParallelLinear", destroyed_without_gil())
      .def(py::init([](int64_t in, int64_t out, Group group, bool bias, bool gather_output, bool sequence_parallel,
                       const std::optional<std::string>& init) {
             loom::ColumnParallelLinearOptions o;
             o.bias = bias;
             o.gather_output = gather_output;
             o.sequence_parallel = sequence_parallel;
             set_initialization(o, init, "ColumnParallelLinear");
             return std::make_shared<loom::ColumnParallelLinearImpl>(in, out, std::move(group), std::move(o));
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("group"), py::arg("bias") = true,
           py::arg("gather_output") = false, py::arg("sequence_parallel") = false, py::arg("init") = py::none())
      .def("forward", &loom::ColumnParallelLinearImpl::forward, release_gil())
      .def("load_master", [](loom::ColumnParallelLinearImpl& l, const at::Tensor& w, const std::optional<at::Tensor>& b) {
             l.load_master(w, b.value_or(at::Tensor()));
           }, py::arg("weight"), py::arg("bias") = py::none())
      .def("shard_info", &shard_info_dict<loom::ColumnParallelLinearImpl>)
      .def_readwrite("weight", &loom::ColumnParallelLinearImpl::weight)
      .def_readwrite("bias", &loom::ColumnParallelLinearImpl::bias)
      .def_readonly("out_per_rank", &loom::ColumnParallelLinearImpl::out_per_rank)
      .def_readonly("out_start", &loom::ColumnParallelLinearImpl::out_start);

  py::class_<loom::RowParallelLinearImpl, std::shared_ptr<loom::RowParallelLinearImpl>>(tp, "RowParallelLinear",
                                                                                        "loom::RowParallelLinear",
                                                                                        destroyed_without_gil())
      .def(py::init([](int64_t in, int64_t out, Group group, bool bias, bool input_is_parallel,
                       bool sequence_parallel, const std::optional<std::string>& init) {
             loom::RowParallelLinearOptions o;
             o.bias = bias;
             o.input_is_parallel = input_is_parallel;
             o.sequence_parallel = sequence_parallel;
             set_initialization(o, init, "RowParallelLinear");
             return std::make_shared<loom::RowParallelLinearImpl>(in, out, std::move(group), std::move(o));
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("group"), py::arg("bias") = true,
           py::arg("input_is_parallel") = true, py::arg("sequence_parallel") = false, py::arg("init") = py::none())
      .def("forward", &loom::RowParallelLinearImpl::forward, release_gil())
      .def("load_master", [](loom::RowParallelLinearImpl& l, const at::Tensor& w, const std::optional<at::Tensor>& b) {
             l.load_master(w, b.value_or(at::Tensor()));
           }, py::arg("weight"), py::arg("bias") = py::none())
      .def("shard_info", &shard_info_dict<loom::RowParallelLinearImpl>)
      .def_readwrite("weight", &loom::RowParallelLinearImpl::weight)
      .def_readwrite("bias", &loom::RowParallelLinearImpl::bias)
      .def_readonly("in_per_rank", &loom::RowParallelLinearImpl::in_per_rank)
      .def_readonly("in_start", &loom::RowParallelLinearImpl::in_start);

  py::class_<loom::VocabParallelEmbeddingImpl, std::shared_ptr<loom::VocabParallelEmbeddingImpl>>(
      tp, "VocabParallelEmbedding", "loom::VocabParallelEmbedding", destroyed_without_gil())
      .def(py::init([](int64_t n, int64_t dim, Group group, bool sequence_parallel,
                       const std::optional<std::string>& init) {
             loom::VocabParallelEmbeddingOptions o;
             o.sequence_parallel = sequence_parallel;
             set_initialization(o, init, "VocabParallelEmbedding");
             return std::make_shared<loom::VocabParallelEmbeddingImpl>(n, dim, std::move(group), std::move(o));
           }),
           py::arg("num_embeddings"), py::arg("embedding_dim"), py::arg("group"), py::arg("sequence_parallel") = false,
           py::arg("init") = py::none())
      .def("forward", &loom::VocabParallelEmbeddingImpl::forward, release_gil())
      .def("load_master", &loom::VocabParallelEmbeddingImpl::load_master, py::arg("weight"))
      .def("shard_info", &shard_info_dict<loom::VocabParallelEmbeddingImpl>)
      .def_readwrite("weight", &loom::VocabParallelEmbeddingImpl::weight)
      .def_readonly("vocab_start", &loom::VocabParallelEmbeddingImpl::vocab_start)
      .def_readonly("vocab_end", &loom::VocabParallelEmbeddingImpl::vocab_end);

  py::class_<ForkContext>(tp, "_ForkContext")
      .def("__enter__", [](ForkContext& c) {
        c.guard.emplace(c.tracker->fork(c.name));
        if (c.cuda_tracker) c.cuda_guard.emplace(c.cuda_tracker->fork(c.name));
      })
      .def("__exit__", [](ForkContext& c, const py::args&) {
        c.cuda_guard.reset();
        c.guard.reset();
        return false;
      });
  tp.def(
      "fork",
      [](const std::string& name) {
        ForkContext c{&loom::rng_tracker(), name, std::nullopt};
        // The CUDA tracker too when it has the stream (seeded by ParallelState.seed on a GPU
        // machine); a CPU-only program never touches CUDA.
        loom::RngTracker* cuda = current_cuda_tracker();
        if (cuda && cuda->has(name)) c.cuda_tracker = cuda;
        return c;
      },
      py::arg("name") = std::string(loom::kModelParallelRngStream),
      "with torchloom.tensor_parallel.fork(): draws inside come from the named stream (different per TP rank) on "
      "the CPU and, where seeded, on the current CUDA device: dropout in a split region, wherever it runs.");
  py::class_<loom::RngTracker>(tp, "RngTracker", "Named random streams (loom::RngTracker).")
      .def("add", &loom::RngTracker::add, py::arg("name"), py::arg("seed"))
      .def("has", &loom::RngTracker::has, py::arg("name"))
      .def("reset", &loom::RngTracker::reset)
      .def("fork", [](loom::RngTracker& t, const std::string& name) { return ForkContext{&t, name, std::nullopt}; },
           py::arg("name") = std::string(loom::kModelParallelRngStream), py::keep_alive<0, 1>())
      .def("get_states", &loom::RngTracker::get_states)
      .def("set_states", &loom::RngTracker::set_states, py::arg("states"));
  tp.def(
      "rng_tracker",
      [](std::optional<c10::Device> device) -> loom::RngTracker& {
        return loom::rng_tracker(device.value_or(c10::Device(c10::kCPU)));
      },
      py::arg("device") = py::none(), py::return_value_policy::reference,
      "The process's RNG tracker for `device`'s default generator (CPU when None; the layers use the CPU "
      "one unless given another). Fork the tracker of the device the random draws happen on.");
  tp.def(
      "model_parallel_seed",
      [](uint64_t seed, int tp_rank, loom::RngTracker* tracker) {
        if (tracker) loom::model_parallel_seed(seed, tp_rank, *tracker);
        else seed_every_device(seed, tp_rank);
      },
      py::arg("seed"), py::arg("tp_rank"), py::arg("tracker") = nullptr);

  py::class_<loom::ParallelState, std::shared_ptr<loom::ParallelState>>(m, "ParallelState",
                                                                        "DP, PP and TP groups (loom::ParallelState).",
                                                                        destroyed_without_gil())
      .def(py::init([](std::shared_ptr<loom::Communicator> world, int tensor_parallel, std::vector<int> order,
                       std::vector<std::vector<int>> dp_rings, int64_t hidden_size, int64_t num_heads,
                       int64_t ffn_hidden_size, int64_t vocab_size, int pipeline_parallel, std::string layout_order) {
             loom::ParallelConfig c;
             c.tensor_parallel = tensor_parallel;
             c.pipeline_parallel = pipeline_parallel;
             c.layout_order = std::move(layout_order);
             c.order = std::move(order);
             c.dp_rings = std::move(dp_rings);
             c.hidden_size = hidden_size;
             c.num_heads = num_heads;
             c.ffn_hidden_size = ffn_hidden_size;
             c.vocab_size = vocab_size;
             py::gil_scoped_release release;
             return std::make_shared<loom::ParallelState>(std::move(world), c);
           }),
           py::arg("world"), py::arg("tensor_parallel") = 1, py::arg("order") = std::vector<int>{},
           py::arg("dp_rings") = std::vector<std::vector<int>>{}, py::arg("hidden_size") = 0,
           py::arg("num_heads") = 0, py::arg("ffn_hidden_size") = 0, py::arg("vocab_size") = 0,
           py::arg("pipeline_parallel") = 1, py::arg("layout_order") = std::string(loom::ParallelLayout::kStandardOrder))
      .def_property_readonly("pp_degree", &loom::ParallelState::pp_degree)
      .def_property_readonly("pp_rank", &loom::ParallelState::pp_rank)
      .def_property_readonly("pp_group", &loom::ParallelState::pp_group)
      .def_property_readonly("layout", &loom::ParallelState::layout)
      .def_property_readonly("groups", &loom::ParallelState::groups, py::return_value_policy::reference_internal)
      .def_property_readonly("tp_degree", &loom::ParallelState::tp_degree)
      .def_property_readonly("tp_rank", &loom::ParallelState::tp_rank)
      .def_property_readonly("dp_degree", &loom::ParallelState::dp_degree)
      .def_property_readonly("dp_rank", &loom::ParallelState::dp_rank)
      .def_property_readonly("world", &loom::ParallelState::world)
      .def_property_readonly("tp_group", &loom::ParallelState::tp_group)
      .def_property_readonly("dp_group", &loom::ParallelState::dp_group)
      .def(
          "seed",
          [](const loom::ParallelState& ps, uint64_t seed, loom::RngTracker* tracker) {
            if (tracker) ps.seed(seed, *tracker);
            else seed_every_device(seed, ps.tp_rank());  // the CPU's and the current GPU's trackers
          },
          py::arg("seed"), py::arg("tracker") = nullptr)
      .def("require_divisible", &loom::ParallelState::require_divisible, py::arg("what"), py::arg("value"));
}

}  // namespace torchloom_py
