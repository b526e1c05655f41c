// PipelineExecutor: proves its plan, agrees on the shapes crossing each stage boundary, then runs
// the plan's actions in order: chunks forward and backward under autograd, message groups as one
// batch of point-to-point operations each.
#include "loom/parallel/pipeline.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "loom/comm/agreement.h"
#include "loom/error.h"
#include "loom/trace.h"
#include "parallel/deferred_weight_gradients.h"

namespace loom::pp {

namespace {

// Tags keep the kinds of message apart between one pair of ranks (MPI matches by source and tag,
// in issue order; the messages of a group are issued in one canonical order on both sides).
constexpr int kActivationTag = 1;
constexpr int kGradientTag = 2;
constexpr int kBoundaryTag = 3;
constexpr int kMaxDims = 8;
constexpr int64_t kHeaderWords = 2 + kMaxDims;  // dtype, rank, sizes

std::string shape_text(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

std::string where(int rank) { return ErrorContext("PipelineExecutor").prefix() + " pipeline rank " + std::to_string(rank); }

// The first host send let go earlier that failed with a timeout: "<its group>: <its error>". Its
// timeout broke the communicator, so a message group waiting after it fails as "not run" (a
// CommError) while the cause is that timeout. Its failure is visible here: the watchdog fails the
// timed-out work before the ones after it.
std::optional<std::string> send_that_timed_out(const std::vector<std::pair<std::string, WorkPtr>>& sends) {
  for (const auto& [group, work] : sends) {
    const std::exception_ptr error = work->exception();
    if (!error) continue;
    try {
      std::rethrow_exception(error);
    } catch (const TimeoutError& e) {
      return group + ": " + e.what();
    } catch (...) {
    }
  }
  return std::nullopt;
}

}  // namespace

std::pair<int, int> stage_layers(int layers, int stages, int stage) {
  if (layers < stages || stages < 1 || stage < 0 || stage >= stages)
    throw InvalidArgumentError(ErrorContext("stage_layers")("expected 1 <= stages <= layers and 0 <= stage < stages; found " +
                                                            std::to_string(layers) + " layers, " + std::to_string(stages) +
                                                            " stages, stage " + std::to_string(stage)));
  const int base = layers / stages, extra = layers % stages;
  const int first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

PipelineExecutor::PipelineExecutor(std::shared_ptr<Communicator> pipeline, std::vector<StageFunction> chunks,
                                   const PipelineOptions& options)
    : pipeline_(std::move(pipeline)), chunks_(std::move(chunks)), options_(options) {
  if (!pipeline_) throw InvalidArgumentError(ErrorContext("PipelineExecutor")("the pipeline communicator is null"));
  rank_ = pipeline_->rank();
  const int virtual_stages = static_cast<int>(chunks_.size());
  for (const auto& chunk : chunks_)
    if (!chunk) throw InvalidArgumentError(where(rank_) + ": a model chunk is empty");
  agree_on_shape(virtual_stages);
  plan_ = make_schedule(options_.schedule,
                        {.ranks = pipeline_->size(), .micro_batches = options_.micro_batches, .virtual_stages = virtual_stages});
  proof_ = prove(plan_);  // the same plan on every rank: refused on every rank alike
}

// Ranks built with another schedule, micro-batch count or chunk count would run plans that do
// not match (and wait for each other until the timeout): one small exchange names the difference.
void PipelineExecutor::agree_on_shape(int virtual_stages) const {
  const int64_t mine[] = {static_cast<int64_t>(options_.schedule), options_.micro_batches, virtual_stages};
  const char* names[] = {"schedule", "micro_batches", "model chunks"};
  const std::vector<int64_t> all = all_gather_values(*pipeline_, mine, {"PipelineExecutor agreement"});
  for (int r = 0; r < pipeline_->size(); ++r)
    for (int f = 0; f < 3; ++f)
      if (all[r * 3 + f] != mine[f]) {
        auto shown = [&](int64_t v) {
          return f == 0 ? std::string(schedule_name(static_cast<Schedule>(v))) : std::to_string(v);
        };
        throw MismatchError(where(rank_) + ": pipeline ranks were built differently: " + names[f] + " is " +
                            shown(mine[f]) + " here but " + shown(all[r * 3 + f]) + " on pipeline rank " +
                            std::to_string(r));
      }
}

const StageFunction& PipelineExecutor::chunk_of(int stage) const { return chunks_[stage / plan_.shape.ranks]; }

std::optional<std::pair<std::vector<int64_t>, at::ScalarType>> PipelineExecutor::boundary(int stage) const {
  auto found = boundaries_.find(stage);
  if (found == boundaries_.end()) return std::nullopt;
  return found->second;
}

// One input forward through every stage in order, without autograd: each stage sends the next one
// a header (dtype, rank, sizes) and then the activation, so a receiver needs no agreed shape.
// Returns the last stage's output on its rank (undefined elsewhere); `sent`, when given, records
// what each of this rank's stages sent on. `what` names the input in errors.
at::Tensor PipelineExecutor::relay_forward(const at::Tensor& input, const std::string& what, Boundaries* sent) {
  const int stages = plan_.shape.stages();
  const SendRecvOptions header_options{kBoundaryTag, options_.timeout.value_or(kDefaultTimeout)};
  at::NoGradGuard no_grad;
  at::Tensor carried;
  for (int s = 0; s < stages; ++s) {
    if (plan_.shape.rank_of_stage(s) != rank_) continue;
    at::Tensor received;
    if (s == 0) {
      received = input;
    } else if (plan_.shape.rank_of_stage(s - 1) == rank_) {
      received = carried;  // virtual stages on one rank: the previous stage was this rank's
    } else {
      // Headers travel on the chunks' device, as everything else (NCCL moves only device tensors).
      at::Tensor header = at::empty({kHeaderWords}, at::TensorOptions().dtype(at::kLong).device(options_.device));
      pipeline_->recv(header, plan_.shape.rank_of_stage(s - 1), header_options)->wait();
      header = header.cpu();
      const auto words = header.accessor<int64_t, 1>();
      if (words[1] < 0 || words[1] > kMaxDims)
        throw CommError(where(rank_) + ": stage " + std::to_string(s) + " received a header of " +
                        std::to_string(words[1]) + " dimensions from pipeline rank " +
                        std::to_string(plan_.shape.rank_of_stage(s - 1)) + "; expected 0 to " + std::to_string(kMaxDims));
      std::vector<int64_t> sizes(words[1]);
      for (int64_t d = 0; d < words[1]; ++d) sizes[d] = words[2 + d];
      const auto dtype = static_cast<at::ScalarType>(words[0]);
      received = at::empty(sizes, at::TensorOptions().dtype(dtype).device(options_.device));
      pipeline_->recv(received, plan_.shape.rank_of_stage(s - 1), header_options)->wait();
    }
    at::Tensor output;
    try {
      output = chunk_of(s)(received);
    } catch (const std::exception& e) {
      throw Error(where(rank_) + ": stage " + std::to_string(s) + " failed in forward of " + what + ": " + e.what());
    }
    if (s == stages - 1) return output;
    if (output.dim() > kMaxDims)
      throw InvalidArgumentError(where(rank_) + ": stage " + std::to_string(s) + " sends a tensor of " +
                                 std::to_string(output.dim()) + " dimensions; at most " + std::to_string(kMaxDims));
    if (sent) (*sent)[s] = {output.sizes().vec(), output.scalar_type()};
    at::Tensor header = at::zeros({kHeaderWords}, at::kLong);
    header[0] = static_cast<int64_t>(output.scalar_type());
    header[1] = output.dim();
    for (int64_t d = 0; d < output.dim(); ++d) header[2 + d] = output.size(d);
    const int next = plan_.shape.rank_of_stage(s + 1);
    if (next == rank_) {
      carried = output;
      continue;
    }
    pipeline_->send(header.to(options_.device), next, header_options)->wait();
    pipeline_->send(output.contiguous(), next, header_options)->wait();
  }
  return at::Tensor();
}

std::vector<at::Tensor> PipelineExecutor::forward_only(const std::vector<at::Tensor>& inputs) {
  // How many inputs: the first stage's rank knows (the others may pass none).
  at::Tensor count =
      at::full({1}, static_cast<int64_t>(inputs.size()), at::TensorOptions().dtype(at::kLong).device(options_.device));
  pipeline_->broadcast(count, {0})->wait();
  std::vector<at::Tensor> outputs;
  const int64_t n = count.item<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor out = relay_forward(holds_first_stage() ? inputs[i] : at::Tensor(),
                                   "forward-only input " + std::to_string(i), nullptr);
    if (holds_last_stage()) outputs.push_back(out);
  }
  return outputs;
}

// Micro-batch 0 forward through every stage (relay_forward), so every receiver learns the
// boundary's shape. The outputs are dropped; the step computes them again.
void PipelineExecutor::agree_on_boundaries(const std::vector<at::Tensor>& inputs) {
  const int stages = plan_.shape.stages();
  relay_forward(holds_first_stage() ? inputs.at(0) : at::Tensor(), "micro-batch 0", &boundaries_);
  // Every rank learns every boundary it receives across: the sender's record is the agreed one,
  // and a receiver needs the shapes of what it receives (activations) and sends back (gradients).
  for (int s = 0; s + 1 < stages; ++s) {
    at::Tensor words = at::zeros({kHeaderWords}, at::kLong);  // filled on the host, sent from the device
    const int holder = plan_.shape.rank_of_stage(s);
    if (holder == rank_) {
      const auto& [sizes, dtype] = boundaries_.at(s);
      words[0] = static_cast<int64_t>(dtype);
      words[1] = static_cast<int64_t>(sizes.size());
      for (size_t d = 0; d < sizes.size(); ++d) words[2 + d] = sizes[d];
    }
    at::Tensor wire = words.to(options_.device);
    pipeline_->broadcast(wire, {holder})->wait();
    words = wire.cpu();
    const auto w = words.accessor<int64_t, 1>();
    std::vector<int64_t> sizes(w[1]);
    for (int64_t d = 0; d < w[1]; ++d) sizes[d] = w[2 + d];
    boundaries_[s] = {sizes, static_cast<at::ScalarType>(w[0])};
  }
}

std::vector<at::Tensor> PipelineExecutor::step(const std::vector<at::Tensor>& inputs, const LossFunction& loss) {
  const int micro_batches = plan_.shape.micro_batches;
  if (holds_first_stage() && static_cast<int>(inputs.size()) != micro_batches)
    throw InvalidArgumentError(where(rank_) + ": step() expected " + std::to_string(micro_batches) +
                               " micro-batches on the first stage; found " + std::to_string(inputs.size()));
  if (holds_last_stage() && !loss) throw InvalidArgumentError(where(rank_) + ": step() needs a loss function on the last stage");
  if (boundaries_.empty() && plan_.shape.stages() > 1) agree_on_boundaries(inputs);
  std::vector<at::Tensor> losses(holds_last_stage() ? micro_batches : 0);
  in_flight_.clear();
  backwards_done_.clear();
  deferred_.clear();
  arrived_activations_.clear();
  arrived_gradients_.clear();
  sends_in_flight_.clear();
  last_step_ = {};
  const auto step_start = trace::now();
  const std::vector<Action>& actions = plan_.actions[rank_];
  last_step_.actions.reserve(actions.size());
  auto since_start = [&](trace::Clock::time_point t) { return std::chrono::duration<double>(t - step_start).count(); };
  for (size_t index = 0; index < actions.size(); ++index) {
    const Action& action = actions[index];
    const auto start = trace::now();
    switch (action.kind) {
      case Action::Kind::Forward:
        forward(action.micro_batch, action.stage, inputs, loss, losses);
        break;
      case Action::Kind::Backward:
        backward(action.micro_batch, action.stage);
        break;
      case Action::Kind::Weight:
        weight(action.micro_batch, action.stage);
        break;
      case Action::Kind::Communicate:
        communicate(action);
        break;
    }
    const auto end = trace::now();
    const bool computes = action.kind != Action::Kind::Communicate;
    (computes ? last_step_.compute : last_step_.communicate) += std::chrono::duration<double>(end - start).count();
    last_step_.actions.push_back({static_cast<int>(index), since_start(start), since_start(end)});
    if (trace::enabled())
      trace::span(action.describe(), "pipeline", start, end, computes ? "pipeline compute" : "pipeline messages");
  }
  const auto sends_start = trace::now();
  let_go_of_sends(/*wait_for_all=*/true);  // the step ends with every message delivered
  last_step_.communicate += std::chrono::duration<double>(trace::now() - sends_start).count();
  last_step_.seconds = since_start(trace::now());
  return losses;
}

void PipelineExecutor::forward(int micro_batch, int stage, const std::vector<at::Tensor>& inputs,
                               const LossFunction& loss, std::vector<at::Tensor>& losses) {
  InFlight& f = in_flight_[key(micro_batch, stage)];
  if (stage == 0) {
    f.input = inputs.at(micro_batch);
  } else if (plan_.shape.rank_of_stage(stage - 1) == rank_) {
    // The previous stage is this rank's too (one rank holding several chunks): handed over in memory.
    f.input = in_flight_.at(key(micro_batch, stage - 1)).output.detach().requires_grad_(true);
  } else {
    f.input = arrived_activations_.at(key(micro_batch, stage)).requires_grad_(true);
    arrived_activations_.erase(key(micro_batch, stage));
  }
  const bool last = stage == plan_.shape.stages() - 1;
  try {
    f.output = chunk_of(stage)(f.input);
    if (last) f.loss = loss(f.output, micro_batch);
  } catch (const std::exception& e) {
    throw Error(where(rank_) + ": stage " + std::to_string(stage) + " failed in forward of micro-batch " +
                std::to_string(micro_batch) + ": " + e.what());
  }
  if (last) {
    losses[micro_batch] = f.loss.detach();
    f.output = at::Tensor();  // the loss holds what backward needs
    return;
  }
  const auto& [sizes, dtype] = boundaries_.at(stage);
  if (f.output.sizes().vec() != sizes || f.output.scalar_type() != dtype)
    throw MismatchError(where(rank_) + ": stage " + std::to_string(stage) + " produced " +
                        std::string(c10::toString(f.output.scalar_type())) + " " + shape_text(f.output.sizes()) +
                        " for micro-batch " + std::to_string(micro_batch) + "; the boundary to stage " +
                        std::to_string(stage + 1) + " was agreed at " + c10::toString(dtype) + " " + shape_text(sizes) +
                        " on micro-batch 0 (every micro-batch of a pipeline has the same shape)");
}

void PipelineExecutor::backward(int micro_batch, int stage) {
  InFlight& f = in_flight_.at(key(micro_batch, stage));
  const bool last = ++backwards_done_[stage] == plan_.shape.micro_batches;
  try {
    if (options_.before_backward) options_.before_backward(stage, micro_batch, last);
    // A zero-bubble plan: loom::pp::linear layers leave their weight gradients to the W action.
    std::optional<detail::DeferWeightGradients> defer;
    if (plan_.schedule == Schedule::ZeroBubbleH1) defer.emplace(deferred_[key(micro_batch, stage)]);
    if (f.loss.defined()) {
      torch::autograd::backward({f.loss});
    } else if (plan_.shape.rank_of_stage(stage + 1) == rank_) {
      const int next = key(micro_batch, stage + 1);  // this rank's next stage ran its backward already
      torch::autograd::backward({f.output}, {in_flight_.at(next).input_grad});
      in_flight_.erase(next);
    } else {
      torch::autograd::backward({f.output}, {arrived_gradients_.at(key(micro_batch, stage))});
      arrived_gradients_.erase(key(micro_batch, stage));
    }
  } catch (const std::exception& e) {
    throw Error(where(rank_) + ": stage " + std::to_string(stage) + " failed in backward of micro-batch " +
                std::to_string(micro_batch) + ": " + e.what());
  }
  if (stage > 0) {
    // A chunk whose output does not depend on its input sends back zeros, as autograd would give.
    f.input_grad = f.input.grad().defined() ? f.input.grad() : at::zeros_like(f.input);
  }
  f.input = f.output = f.loss = at::Tensor();
}

// The weight gradients micro-batch `micro_batch`'s input-gradient pass on `stage` deferred.
void PipelineExecutor::weight(int micro_batch, int stage) {
  auto found = deferred_.find(key(micro_batch, stage));
  if (found == deferred_.end()) return;  // (proven: the backward ran; it deferred nothing)
  try {
    for (auto& gradient : found->second) gradient();
  } catch (const std::exception& e) {
    throw Error(where(rank_) + ": stage " + std::to_string(stage) + " failed computing the weight gradients of " +
                "micro-batch " + std::to_string(micro_batch) + ": " + e.what());
  }
  deferred_.erase(found);
}

// On the host (MPI, Gloo) a send of more than a few kilobytes completes only once its receiver has
// posted the receive. Waited for in its message group, it would hold the sending stage idle until
// its neighbour has finished whatever it computes first (a W of a zero-bubble plan, another
// chunk's forward): the coupling that made interleaved and ZB-H1 plans idle 0.04 of a step beyond
// their promise at p = 2. So host sends go out on their own and are let go once delivered; a
// group waits only for its receives, which what follows needs. The plan stays proven: a send that
// no longer blocks can only let a rank go further. Device (NCCL) sends stay in one group call with
// the receives, as Megatron's do: a send kernel waits on the stream for its peer's receive, and
// two ranks that each launched a send first would wait for each other.
void PipelineExecutor::let_go_of_sends(bool wait_for_all) {
  auto delivered = [&](std::pair<std::string, WorkPtr>& send) {
    if (!wait_for_all && !send.second->is_completed()) return false;
    try {
      send.second->wait(options_.timeout.value_or(kDefaultTimeout));
    } catch (const TimeoutError& e) {
      throw TimeoutError(where(rank_) + ": the sends of " + send.first + " did not complete: " + e.what());
    } catch (const CommError& e) {
      throw CommError(where(rank_) + ": the sends of " + send.first + " did not complete: " + e.what());
    }
    return true;
  };
  std::erase_if(sends_in_flight_, delivered);
}

void PipelineExecutor::communicate(const Action& action) {
  // One canonical order on both sides of every pair: the messages sorted alike.
  auto order = [](const Message& a, const Message& b) {
    return std::tie(a.carries, a.micro_batch, a.from_stage) < std::tie(b.carries, b.micro_batch, b.from_stage);
  };
  std::vector<Message> sends = action.sends, receives = action.receives;
  std::sort(sends.begin(), sends.end(), order);
  std::sort(receives.begin(), receives.end(), order);
  std::vector<P2POp> ops;
  for (const Message& m : sends) {
    InFlight& f = in_flight_.at(key(m.micro_batch, m.from_stage));
    const bool activation = m.carries == Carries::Activation;
    at::Tensor tensor = activation ? f.output.detach().contiguous() : f.input_grad.contiguous();
    if (!activation) {
      in_flight_.erase(key(m.micro_batch, m.from_stage));  // its backward is done: nothing else needs it
    }
    ops.push_back({P2POp::Kind::Send, tensor, plan_.shape.rank_of_stage(m.to_stage),
                   activation ? kActivationTag : kGradientTag});
  }
  std::vector<std::pair<const Message*, at::Tensor>> landing;
  for (const Message& m : receives) {
    const int boundary = m.carries == Carries::Activation ? m.from_stage : m.to_stage;
    const auto& [sizes, dtype] = boundaries_.at(boundary);
    at::Tensor buffer = at::empty(sizes, at::TensorOptions().dtype(dtype).device(options_.device));
    landing.emplace_back(&m, buffer);
    ops.push_back({P2POp::Kind::Recv, buffer, plan_.shape.rank_of_stage(m.from_stage),
                   m.carries == Carries::Activation ? kActivationTag : kGradientTag});
  }
  const Timeout timeout = options_.timeout.value_or(kDefaultTimeout);
  let_go_of_sends(/*wait_for_all=*/false);
  if (options_.device.is_cpu() && !sends.empty()) {
    std::vector<P2POp> sent(ops.begin(), ops.begin() + static_cast<long>(sends.size()));
    ops.erase(ops.begin(), ops.begin() + static_cast<long>(sends.size()));
    WorkPtr work = pipeline_->batch_isend_irecv(std::move(sent), {0, timeout});
    work->run_in_background();
    sends_in_flight_.emplace_back(action.describe(), std::move(work));
  }
  if (ops.empty()) return;
  try {
    pipeline_->batch_isend_irecv(std::move(ops), {0, timeout})->wait();
  } catch (const TimeoutError& e) {  // the stages whose messages these were, then the cause
    throw TimeoutError(where(rank_) + ": " + action.describe() + " did not complete: " + e.what());
  } catch (const CommError& e) {
    if (auto timed_out = send_that_timed_out(sends_in_flight_))
      throw TimeoutError(where(rank_) + ": " + action.describe() + " did not complete: the sends of " + *timed_out +
                         "; then this group: " + e.what());
    throw CommError(where(rank_) + ": " + action.describe() + " did not complete: " + e.what());
  }
  for (auto& [m, buffer] : landing) {
    auto& into = m->carries == Carries::Activation ? arrived_activations_ : arrived_gradients_;
    into[key(m->micro_batch, m->to_stage)] = buffer;
  }
}

}  // namespace loom::pp
