// Activation recomputation: a backward node that keeps the input and reruns the function.
//
// Reentrant, like torch.utils.checkpoint(use_reentrant=True): forward runs fn under no-grad and
// attaches one node to the output whose edges are the input's and the parameters' gradient
// edges. Its apply() reruns fn with grad enabled on a detached copy of the input, under the random
// and autocast state of the first run, and computes the gradients with torch::autograd::grad (a
// nested backward; the engine supports it) with respect to that copy and the parameters. Using
// grad() rather than backward() matters: the parameters' gradients return through this node's
// edges and are accumulated once, by their accumulators, where the reducer's hooks sit.
#include "loom/parallel/recompute.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <map>
#include <optional>
#include <type_traits>

#include "loom/parallel/tensor_parallel.h"

namespace loom {
namespace {

// Everything random or precision-changing that fn may depend on, captured and restored whole.
struct RandomAndAutocastState {
  at::Tensor cpu;
  std::optional<c10::Device> cuda_device;
  at::Tensor cuda;
  std::map<std::string, at::Tensor> tracker;
  bool cpu_autocast = false, cuda_autocast = false;
  at::ScalarType cpu_autocast_dtype = at::kBFloat16, cuda_autocast_dtype = at::kHalf;

  static RandomAndAutocastState capture(RngTracker& rng, const at::Tensor& input) {
    RandomAndAutocastState s;
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cpu = gen.get_state();
    }
    if (input.is_cuda()) {
      s.cuda_device = input.device();
      at::Generator gen = at::globalContext().defaultGenerator(input.device());
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cuda = gen.get_state();
    }
    s.tracker = rng.get_states();
    s.cpu_autocast = at::autocast::is_autocast_enabled(at::kCPU);
    s.cpu_autocast_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_autocast = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cuda_autocast_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    return s;
  }

  void restore(RngTracker& rng) const {
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(cpu);
    }
    if (cuda_device) {
      at::Generator gen = at::globalContext().defaultGenerator(*cuda_device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(cuda);
    }
    rng.set_states(tracker);
    at::autocast::set_autocast_enabled(at::kCPU, cpu_autocast);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_autocast_dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_autocast);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_autocast_dtype);
  }
};

struct RecomputeBackward : torch::autograd::Node {
  std::function<at::Tensor(const at::Tensor&)> fn;
  at::Tensor input;  // detached: the node must not keep the graph that produced it
  bool input_requires_grad = false;
  std::vector<at::Tensor> parameters;
  RngTracker* rng = nullptr;
  RandomAndAutocastState first_run;

  std::string name() const override { return "loom::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads.at(0).defined()) return torch::autograd::variable_list(num_outputs());
    // The caller's state is put back afterwards: recomputing must not advance its generators.
    const RandomAndAutocastState callers = RandomAndAutocastState::capture(*rng, input);
    first_run.restore(*rng);
    at::Tensor x = input.detach().requires_grad_(input_requires_grad);
    // Autocast's cast cache stays off: it is keyed by tensor address and cleared only when an
    // autocast region ends, and backward runs outside one, so casts cached here would outlive this
    // recomputation and be found again for other tensors at the same address.
    const bool cast_cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    at::Tensor out;
    try {
      at::AutoGradMode grad_mode(true);
      out = fn(x);
    } catch (...) {
      at::autocast::set_autocast_cache_enabled(cast_cache);
      callers.restore(*rng);
      throw;
    }
    at::autocast::set_autocast_cache_enabled(cast_cache);
    callers.restore(*rng);

    // Gradients for the edges in their order: input, then parameters; none for those that need none.
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;
    if (input_requires_grad) {
      wrt.push_back(x);
      slot.push_back(0);
    }
    for (size_t i = 0; i < parameters.size(); ++i)
      if (parameters[i].requires_grad()) {
        wrt.push_back(parameters[i]);
        slot.push_back(i + 1);
      }
    torch::autograd::variable_list result(num_outputs());
    if (wrt.empty() || !out.requires_grad()) return result;
    auto computed = torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                          /*allow_unused=*/true);
    for (size_t k = 0; k < computed.size(); ++k) result[slot[k]] = computed[k];
    return result;
  }
};

// Nodes are held by std::shared_ptr in LibTorch up to 2.8 and by c10::intrusive_ptr after.
// (A template, so that only the branch of the LibTorch at hand is compiled.)
template <typename Tensor = at::Tensor>
auto make_node() {
  using NodePtr = std::decay_t<decltype(std::declval<const Tensor&>().grad_fn())>;
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<RecomputeBackward>();
  else
    return c10::make_intrusive<RecomputeBackward>();
}

}  // namespace

at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                     const std::vector<at::Tensor>& parameters, const RecomputeOptions& options) {
  bool any_requires_grad = input.requires_grad();
  for (const auto& p : parameters) any_requires_grad = any_requires_grad || p.requires_grad();
  if (!at::GradMode::is_enabled() || !any_requires_grad) return fn(input);

  RngTracker& rng = options.rng ? *options.rng : rng_tracker();
  auto node = make_node();
  node->fn = fn;
  node->input = input.detach();
  node->input_requires_grad = input.requires_grad();
  node->parameters = parameters;
  node->rng = &rng;
  node->first_run = RandomAndAutocastState::capture(rng, input);

  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = fn(input);
  }
  torch::autograd::edge_list edges;
  edges.push_back(torch::autograd::impl::gradient_edge(input));
  for (const auto& p : parameters) edges.push_back(torch::autograd::impl::gradient_edge(p));
  node->set_next_edges(std::move(edges));
  torch::autograd::create_gradient_edge(out, node);
  return out;
}

}  // namespace loom
