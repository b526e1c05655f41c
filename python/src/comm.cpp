// Start-up, the world, communicators, work handles, TP x DP groups, the placement plan.
#include "bindings.h"

#include "loom/comm/groups.h"
#include "loom/runtime.h"
#include "loom/topology/placement.h"
#include "loom/world.h"

namespace torchloom_py {

namespace {

// As torch.distributed: a collective blocks (without the GIL) unless async_op=True. Blocking, it
// still hands back the finished Work, so code written for the earlier always-asynchronous API
// (`comm.all_reduce(t).wait()`) keeps working.
std::shared_ptr<loom::Work> finish(std::shared_ptr<loom::Work> work, bool async_op) {
  if (!async_op) work->wait();
  return work;
}

// The group rank of a peer named either by its global (job) rank, as torch.distributed's src and
// dst are, or by its rank in this group (group_src, group_dst); exactly one of them.
int peer_in_group(const loom::Communicator& c, const char* op, const char* global_name, std::optional<int> global,
                  const char* group_name, std::optional<int> group) {
  const auto where = c.context(op);
  if (global && group)
    throw loom::InvalidArgumentError(where(std::string("give ") + global_name + " (a global rank) or " + group_name +
                                           " (a rank of this group), not both"));
  if (group) return *group;  // range-checked by the communicator, like every peer
  if (!global)
    throw loom::InvalidArgumentError(where(std::string("expected ") + global_name + " (a global rank) or " +
                                           group_name + " (a rank of this group); found neither"));
  const auto& members = c.members();
  for (size_t r = 0; r < members.size(); ++r)
    if (members[r] == *global) return static_cast<int>(r);
  std::string listed;
  for (int m : members) listed += (listed.empty() ? "" : ", ") + std::to_string(m);
  throw loom::InvalidArgumentError(where(std::string(global_name) + "=" + std::to_string(*global) +
                                         " is a global rank that is not in this group (its global ranks: " + listed +
                                         "); for a rank of the group write " + group_name + "="));
}

}  // namespace

void bind_comm(py::module_& m) {
  py::class_<loom::World>(m, "World", "Where this process stands in the job (loom::World).")
      .def_readonly("rank", &loom::World::rank)
      .def_readonly("size", &loom::World::size)
      .def_readonly("local_rank", &loom::World::local_rank)
      .def_readonly("local_size", &loom::World::local_size)
      .def_readonly("node_index", &loom::World::node_index)
      .def_readonly("num_nodes", &loom::World::num_nodes)
      .def_readonly("hostname", &loom::World::hostname)
      .def_readonly("launcher", &loom::World::launcher)
      .def("__repr__", [](const loom::World& w) {
        return "World(rank=" + std::to_string(w.rank) + ", size=" + std::to_string(w.size) +
               ", local_rank=" + std::to_string(w.local_rank) + ", local_size=" + std::to_string(w.local_size) +
               ", node_index=" + std::to_string(w.node_index) + ", num_nodes=" + std::to_string(w.num_nodes) +
               ", hostname='" + w.hostname + "', launcher='" + w.launcher + "')";
      });
  m.def("world_from_environment", [] {
        return loom::world_from_environment(loom::current_environment(), loom::current_hostname());
      }, "The world as the launcher's environment describes it (no MPI started).");

  py::enum_<loom::ReduceOp>(m, "ReduceOp", "Reduction of all_reduce / reduce_scatter.")
      .value("SUM", loom::ReduceOp::Sum)
      .value("AVG", loom::ReduceOp::Avg)
      .value("MIN", loom::ReduceOp::Min)
      .value("MAX", loom::ReduceOp::Max)
      .value("PRODUCT", loom::ReduceOp::Product);

  py::class_<loom::Work, std::shared_ptr<loom::Work>>(
      m, "Work", "Handle of an asynchronous operation (loom::Work), like torch.distributed's Work.",
      destroyed_without_gil())
      .def("wait", [](loom::Work& w, const py::object& timeout) {
             const loom::Timeout t = to_timeout(timeout);
             py::gil_scoped_release release;
             w.wait(t);
             return true;
           }, py::arg("timeout") = py::none(),
           "Blocks (without the GIL) until the operation is done; raises its error. With a timeout (seconds or "
           "timedelta), raises torchloom.TimeoutError when it is not done by then.")
      .def("is_completed", &loom::Work::is_completed, "True once finished, successfully or not. Never blocks.")
      .def("is_success", &loom::Work::is_success, "True once finished without error.")
      .def("run_in_background", &loom::Work::run_in_background,
           "Says the caller computes before it waits: the communicator starts the operation on its own thread now.")
      .def("synchronize", &loom::Work::synchronize, release_gil(), "Blocks the host until the operation is done.")
      .def("exception", [](loom::Work& w) { return python_exception(w.exception()); },
           "The operation's error as a torchloom exception (not raised), or None.")
      .def_property_readonly("seq", [](const loom::Work& w) { return w.info().seq; }, "Sequence number.")
      .def("__repr__", [](const loom::Work& w) { return "<torchloom.Work " + w.info().describe() + ">"; });

  py::class_<loom::Communicator, std::shared_ptr<loom::Communicator>>(
      m, "Communicator",
      "Collectives and point-to-point operations over a group of ranks (loom::Communicator). As in "
      "torch.distributed, a call blocks until done unless async_op=True, which returns a Work to wait on; "
      "tensors are updated in place. Peers (src, dst) are global ranks; group_src/group_dst are ranks of the group.",
      destroyed_without_gil())
      .def_property_readonly("rank", &loom::Communicator::rank)
      .def_property_readonly("size", &loom::Communicator::size)
      .def_property_readonly("name", &loom::Communicator::name)
      .def_property_readonly("job_rank", &loom::Communicator::job_rank)
      .def_property_readonly("members", &loom::Communicator::members)
      .def_property_readonly("backend", &loom::Communicator::backend)
      .def_property_readonly("device", [](const loom::Communicator& c) { return c.device(); })
      .def_property_readonly("default_timeout", [](const loom::Communicator& c) {
        return std::chrono::duration<double>(c.default_timeout()).count();
      }, "Seconds an operation may take unless its call says otherwise (LOOM_TIMEOUT, or the one it was built with).")
      .def("is_broken", &loom::Communicator::is_broken)
      .def("broken_reason", &loom::Communicator::broken_reason)
      .def("all_reduce", [](loom::Communicator& c, at::Tensor tensor, loom::ReduceOp op, const py::object& timeout,
                            bool async_op) {
             loom::AllReduceOptions o{op, to_timeout(timeout)};
             py::gil_scoped_release release;
             return finish(c.all_reduce(tensor, o), async_op);
           }, py::arg("tensor"), py::arg("op") = loom::ReduceOp::Sum, py::arg("timeout") = py::none(),
           py::arg("async_op") = false, "In place: every rank's tensor becomes the reduction over the group.")
      .def("broadcast", [](loom::Communicator& c, at::Tensor tensor, std::optional<int> src, std::optional<int> group_src,
                           std::optional<int> root, const py::object& timeout, bool async_op) {
             if (root) {
               // The old name, a rank in this group: kept working, and said so once.
               PyErr_WarnEx(PyExc_DeprecationWarning,
                            "Communicator.broadcast(root=) is a rank of this group; write group_src= (or src=, a "
                            "global rank, as torch.distributed does)", 1);
               if (group_src) throw loom::InvalidArgumentError(c.context("broadcast")("give group_src or root, not both"));
               group_src = root;
             }
             loom::BroadcastOptions o{peer_in_group(c, "broadcast", "src", src, "group_src", group_src),
                                      to_timeout(timeout)};
             py::gil_scoped_release release;
             return finish(c.broadcast(tensor, o), async_op);
           }, py::arg("tensor"), py::arg("src") = py::none(), py::kw_only(), py::arg("group_src") = py::none(),
           py::arg("root") = py::none(), py::arg("timeout") = py::none(), py::arg("async_op") = false,
           "The source's tensor is copied into every rank's tensor. src: a global (job) rank, as torch.distributed's; "
           "group_src: a rank of this group; give one of them.")
      .def("all_gather", [](loom::Communicator& c, const py::object& output, at::Tensor input, const py::object& timeout,
                            bool async_op) {
             loom::AllGatherOptions o{to_timeout(timeout)};
             if (py::isinstance<py::list>(output)) {
               auto outputs = output.cast<std::vector<at::Tensor>>();
               py::gil_scoped_release release;
               return finish(c.all_gather(outputs, input, o), async_op);
             }
             at::Tensor flat = output.cast<at::Tensor>();
             py::gil_scoped_release release;
             return finish(c.all_gather(flat, input, o), async_op);
           }, py::arg("output"), py::arg("input"), py::arg("timeout") = py::none(), py::arg("async_op") = false,
           "output: a tensor of size * input.numel() elements (rank r's input at offset r * numel), or a list of "
           "size tensors shaped like input.")
      .def("reduce_scatter", [](loom::Communicator& c, at::Tensor output, at::Tensor input, loom::ReduceOp op,
                                const py::object& timeout, bool async_op) {
             loom::ReduceScatterOptions o{op, to_timeout(timeout)};
             py::gil_scoped_release release;
             return finish(c.reduce_scatter(output, input, o), async_op);
           }, py::arg("output"), py::arg("input"), py::arg("op") = loom::ReduceOp::Sum, py::arg("timeout") = py::none(),
           py::arg("async_op") = false,
           "input holds size * output.numel() elements; rank r receives the reduction of every rank's r-th chunk.")
      .def("all_to_all", [](loom::Communicator& c, at::Tensor output, at::Tensor input, const py::object& timeout,
                            bool async_op) {
             loom::AllToAllOptions o{to_timeout(timeout)};
             py::gil_scoped_release release;
             return finish(c.all_to_all(output, input, o), async_op);
           }, py::arg("output"), py::arg("input"), py::arg("timeout") = py::none(), py::arg("async_op") = false,
           "Chunk j of rank i's input lands in chunk i of rank j's output.")
      .def("send", [](loom::Communicator& c, at::Tensor tensor, std::optional<int> dst, int tag,
                      std::optional<int> group_dst, const py::object& timeout, bool async_op) {
             loom::SendRecvOptions o{tag, to_timeout(timeout)};
             const int peer = peer_in_group(c, "send", "dst", dst, "group_dst", group_dst);
             py::gil_scoped_release release;
             return finish(c.send(tensor, peer, o), async_op);
           }, py::arg("tensor"), py::arg("dst") = py::none(), py::arg("tag") = 0, py::kw_only(),
           py::arg("group_dst") = py::none(), py::arg("timeout") = py::none(), py::arg("async_op") = false,
           "dst: a global (job) rank, as torch.distributed's; group_dst: a rank of this group; give one of them.")
      .def("recv", [](loom::Communicator& c, at::Tensor tensor, std::optional<int> src, int tag,
                      std::optional<int> group_src, const py::object& timeout, bool async_op) {
             loom::SendRecvOptions o{tag, to_timeout(timeout)};
             const int peer = peer_in_group(c, "recv", "src", src, "group_src", group_src);
             py::gil_scoped_release release;
             return finish(c.recv(tensor, peer, o), async_op);
           }, py::arg("tensor"), py::arg("src") = py::none(), py::arg("tag") = 0, py::kw_only(),
           py::arg("group_src") = py::none(), py::arg("timeout") = py::none(), py::arg("async_op") = false,
           "src: a global (job) rank, as torch.distributed's; group_src: a rank of this group; give one of them.")
      .def("barrier", [](loom::Communicator& c, const py::object& timeout, bool async_op) {
             loom::BarrierOptions o{to_timeout(timeout)};
             py::gil_scoped_release release;
             return finish(c.barrier(o), async_op);
           }, py::arg("timeout") = py::none(), py::arg("async_op") = false)
      .def("split", [](loom::Communicator& c, int color, int key, const std::string& name, const py::object& timeout,
                       const py::object& group_timeout) {
             loom::SplitOptions o{to_timeout(timeout)};
             if (!group_timeout.is_none()) o.group_timeout = to_timeout(group_timeout);
             py::gil_scoped_release release;
             return c.split(color, key, name, o);
           }, py::arg("color"), py::arg("key"), py::arg("name"), py::arg("timeout") = py::none(),
           py::arg("group_timeout") = py::none(),
           "Collective: ranks passing the same color form a new communicator ordered by key; color < 0 gives None. "
           "timeout: of the split itself; group_timeout: the new communicator's default (as torch's new_group(timeout=)).")
      .def("__repr__", [](const loom::Communicator& c) {
        return "<torchloom.Communicator " + c.name() + " rank " + std::to_string(c.rank()) + " of " +
               std::to_string(c.size()) + " (" + c.backend() + ")>";
      });

  using Names = std::vector<std::string>;
  auto views = [](const Names& names) { return std::vector<std::string_view>(names.begin(), names.end()); };
  py::class_<loom::ParallelLayout>(m, "ParallelLayout",
      "Named parallel dimensions, outermost first (loom::ParallelLayout): ParallelLayout([('dp', 2), ('tp', 2)]).")
      .def(py::init([](const std::vector<std::pair<std::string, int>>& dims) {
             std::vector<loom::LayoutDimension> d;
             for (const auto& [name, size] : dims) d.push_back({name, size});
             return loom::ParallelLayout(std::move(d));
           }),
           py::arg("dimensions") = std::vector<std::pair<std::string, int>>{})
      .def_static("parse", &loom::ParallelLayout::parse, py::arg("text"), "ParallelLayout.parse('dp=4,pp=2,tp=2')")
      .def_static("standard", &loom::ParallelLayout::standard, py::arg("world_size"), py::arg("tensor_parallel"),
                  py::arg("pipeline_parallel") = 1, py::arg("order") = std::string(loom::ParallelLayout::kStandardOrder),
                  "Data-parallel replicas outermost, then pipeline stages, tensor-parallel ranks innermost.")
      .def_static("arrange", [](int world_size, const std::string& order, const std::map<std::string, int>& sizes) {
             std::vector<loom::LayoutDimension> d;
             for (const auto& [name, size] : sizes) d.push_back({name, size});
             return loom::ParallelLayout::arrange(world_size, order, d);
           }, py::arg("world_size"), py::arg("order"), py::arg("sizes"),
           "The dimensions named in order, sized from sizes; one unsized dimension takes the rest of the world.")
      .def_property_readonly("dimensions", [](const loom::ParallelLayout& l) {
             std::vector<std::pair<std::string, int>> out;
             for (const auto& d : l.dimensions()) out.emplace_back(d.name, d.size);
             return out;
           })
      .def_property_readonly("world_size", &loom::ParallelLayout::world_size)
      .def("has", [](const loom::ParallelLayout& l, const std::string& name) { return l.has(name); }, py::arg("name"))
      .def("size", [](const loom::ParallelLayout& l, const std::string& name) { return l.size(name); }, py::arg("name"),
           "The dimension's size; 1 for one the layout lacks.")
      .def("coordinates", &loom::ParallelLayout::coordinates, py::arg("position"))
      .def("coordinate", [](const loom::ParallelLayout& l, int position, const std::string& name) {
             return l.coordinate(position, name);
           }, py::arg("position"), py::arg("name"))
      .def("position", &loom::ParallelLayout::position, py::arg("coordinates"))
      .def("group", [views](const loom::ParallelLayout& l, int position, const Names& names) {
             return l.group(position, views(names));
           }, py::arg("position"), py::arg("names"),
           "The positions differing from position only along names, in coordinate order.")
      .def("group_index", [views](const loom::ParallelLayout& l, int position, const Names& names) {
             return l.group_index(position, views(names));
           }, py::arg("position"), py::arg("names"))
      .def("rank_in_group", [views](const loom::ParallelLayout& l, int position, const Names& names) {
             return l.rank_in_group(position, views(names));
           }, py::arg("position"), py::arg("names"))
      .def("groups", [views](const loom::ParallelLayout& l, const Names& names) { return l.groups(views(names)); },
           py::arg("names"))
      .def("describe", &loom::ParallelLayout::describe, py::arg("position"))
      .def("__str__", &loom::ParallelLayout::to_string)
      .def("__repr__", [](const loom::ParallelLayout& l) { return "ParallelLayout.parse('" + l.to_string() + "')"; })
      .def("__eq__", [](const loom::ParallelLayout& a, const loom::ParallelLayout& b) { return a == b; }, py::is_operator());

  py::class_<loom::ParallelGroups>(m, "ParallelGroups",
      "One communicator per dimension of a parallel layout (loom::ParallelGroups).", destroyed_without_gil())
      .def_readonly("layout", &loom::ParallelGroups::layout)
      .def_readonly("position", &loom::ParallelGroups::position)
      .def("group", [](const loom::ParallelGroups& g, const std::string& name) { return g.group(name); }, py::arg("name"))
      .def("rank", [](const loom::ParallelGroups& g, const std::string& name) { return g.rank(name); }, py::arg("name"))
      .def("size", [](const loom::ParallelGroups& g, const std::string& name) { return g.size(name); }, py::arg("name"))
      .def_readonly("tp_degree", &loom::ParallelGroups::tp_degree)
      .def_readonly("dp_degree", &loom::ParallelGroups::dp_degree)
      .def_readonly("tp_rank", &loom::ParallelGroups::tp_rank)
      .def_readonly("dp_rank", &loom::ParallelGroups::dp_rank)
      .def_readonly("order", &loom::ParallelGroups::order)
      .def_readonly("tensor_parallel", &loom::ParallelGroups::tensor_parallel)
      .def_readonly("data_parallel", &loom::ParallelGroups::data_parallel);
  m.def("make_parallel_groups",
        py::overload_cast<loom::Communicator&, int, const std::vector<int>&, const std::vector<std::vector<int>>&>(
            &loom::make_parallel_groups),
        py::arg("world"), py::arg("tp_degree"), py::arg("order") = std::vector<int>{},
        py::arg("dp_rings") = std::vector<std::vector<int>>{}, release_gil(),
        "Collective over world: TP groups of tp_degree consecutive ranks (in order) and DP groups across them.");
  m.def("make_parallel_groups",
        [](loom::Communicator& world, const loom::ParallelLayout& layout, const std::vector<int>& order,
           const std::map<std::string, std::vector<std::vector<int>>>& rings) {
          loom::GroupRings r(rings.begin(), rings.end());
          py::gil_scoped_release release;
          return loom::make_parallel_groups(world, layout, order, r);
        },
        py::arg("world"), py::arg("layout"), py::arg("order") = std::vector<int>{},
        py::arg("rings") = std::map<std::string, std::vector<std::vector<int>>>{},
        "Collective over world: one communicator per dimension of layout.");

  py::class_<loom::Runtime, std::shared_ptr<loom::Runtime>>(m, "Runtime", "What loom::init() started.",
      destroyed_without_gil())
      .def_property_readonly("world", &loom::Runtime::world, py::return_value_policy::copy)
      .def_property_readonly("world_comm", &loom::Runtime::world_comm, "Every process of the job, CPU tensors (MPI).")
      .def_property_readonly("device_comm", &loom::Runtime::device_comm,
                             "Every process of the job, CUDA tensors (NCCL); None without one.")
      .def_property_readonly("cuda_device", &loom::Runtime::cuda_device);
  m.def("init", [](const py::object& timeout, const std::optional<std::string>& on_error) {
        loom::InitOptions options;
        if (!timeout.is_none()) options.comm.timeout = to_timeout(timeout);
        if (on_error) {
          if (*on_error == "raise") options.comm.on_error = loom::OnError::Raise;
          else if (*on_error == "abort") options.comm.on_error = loom::OnError::Abort;
          else throw loom::InvalidArgumentError("init: on_error must be 'raise' or 'abort', found '" + *on_error + "'");
        }
        py::gil_scoped_release release;
        return loom::init(options);
      }, py::arg("timeout") = py::none(), py::arg("on_error") = py::none());
  m.def("finalize", &loom::finalize, release_gil());
  m.def("_announce_exit", &loom::announce_exit, py::arg("status"), py::arg("reason"), release_gil());
  // For benchmarks/python_ddp_bench.py: the same all_reduce + wait loop in C++, seconds per call, so
  // that the Python call's own overhead can be measured against it.
  m.def("_time_all_reduce_loop", [](loom::Communicator& c, at::Tensor tensor, int iterations) {
        py::gil_scoped_release release;
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iterations; ++i) c.all_reduce(tensor)->wait();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
      }, py::arg("comm"), py::arg("tensor"), py::arg("iterations"));
  m.def("placement_plan_json", []() -> std::optional<std::string> {
        const loom::topo::Plan* plan = loom::placement_plan();
        if (!plan) return std::nullopt;
        return loom::topo::plan_to_json(*plan);
      }, "The placement plan loom::init() made, as JSON; None without one.");
  m.def("planned_dp_rings", &loom::planned_dp_rings, py::arg("tensor_parallel"), py::arg("pipeline_parallel") = 1,
        "The placement plan's DP groups in ring order when it was made for these TP and PP degrees, else []: "
        "ParallelState(world, tp, dp_rings=torchloom.planned_dp_rings(tp)).");
  m.def("explain_placement", [](double bytes) -> std::optional<std::string> {
        const loom::topo::Plan* plan = loom::placement_plan();
        if (!plan) return std::nullopt;
        return loom::topo::explain(*plan, bytes);
      }, py::arg("message_bytes") = double(64 << 20));
}

}  // namespace torchloom_py
