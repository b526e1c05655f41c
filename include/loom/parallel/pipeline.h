// Runs a pipeline schedule (loom/parallel/pipeline_schedule.h) over a pipeline's communicator:
// this rank's model chunks compute the forward and backward of each micro-batch in the order the
// plan gives, and the plan's message groups move activations forward and their gradients back with
// the communicator's point-to-point operations. Parameter gradients accumulate in .grad() as in
// gradient accumulation, so a step over M micro-batches equals one process over the whole batch
// when the loss of each micro-batch is divided by M.
//
//   loom::pp::PipelineExecutor pipeline(ps.pp_group(), {[&](const at::Tensor& x) { return stage(x); }},
//                                       {.schedule = loom::pp::Schedule::OneFOneB, .micro_batches = 8});
//   auto losses = pipeline.step(micro_batches, [&](const at::Tensor& out, int m) {
//     return loss_fn(out, targets[m]) / 8;
//   });                                 // on the last stage: each micro-batch's loss; elsewhere empty
//   optimizer.step();
//
// Before the first step the plan is proven (loom::pp::prove: a plan that would deadlock is refused
// by name), and the shapes and dtypes crossing each stage boundary are agreed: micro-batch 0 runs
// forward once through every stage (without autograd), each stage telling the next what it sends.
// Every later message must have its boundary's agreed shape: a mismatch is a loom::MismatchError
// naming the stage and the micro-batch. A stage that raises ends its step with a loom::Error naming
// the stage, the micro-batch and the direction; its peers' waits then end within the
// communicator's timeout (or at once when the process leaves, as every departure does).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/parallel/pipeline_schedule.h"

namespace loom::pp {

// One model chunk: from the activation it receives (the micro-batch itself on stage 0) to the one
// it sends on (the output, on the last stage).
using StageFunction = std::function<at::Tensor(const at::Tensor&)>;
// The loss of micro-batch `micro_batch` from the last stage's output: a scalar to run backward from.
using LossFunction = std::function<at::Tensor(const at::Tensor& output, int micro_batch)>;

struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int micro_batches = 1;
  // Where received activations and gradients are placed (the chunks' device).
  c10::Device device = c10::Device(c10::kCPU);
  // Of every message group; empty: the communicator's default.
  std::optional<Timeout> timeout;
  // Called before each backward with the stage, the micro-batch and whether it is that stage's
  // last backward of the step: where data parallelism lets a stage's gradient reduction start as
  // soon as its last backward ends (GradientReducer::set_sync(last) for the stage's reducer).
  std::function<void(int stage, int micro_batch, bool last)> before_backward;
};

// y = input W^T + b (at::linear) whose weight gradient a zero-bubble schedule (Schedule::ZeroBubbleH1)
// computes apart from the input gradient: the executor's backward of a micro-batch computes dX,
// which the previous stage waits for, and the plan's later W action computes dW and db into
// .grad(). Elsewhere (any other schedule, no pipeline) it is at::linear with the same gradients.
// Build stages from it to get the bubble ZB-H1 promises; any other layer computes its weight
// gradient with the input gradient (the same result, with less of the bubble filled). A deferred
// gradient is added to .grad() outside autograd: parameter hooks (a GradientReducer's) do not see it.
//   h = loom::pp::linear(x, fc->weight, fc->bias);
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = {});

// The layers of stage `stage` when `layers` blocks are cut into `stages` consecutive runs, as even
// as possible (the first `layers % stages` stages take one more): {first, end}.
//   stage_layers(10, 4, 1)   // {3, 6}
std::pair<int, int> stage_layers(int layers, int stages, int stage);

// Where the last step's time went on this rank: computing (forward and backward of its chunks),
// in message groups (sending, and waiting for what the plan receives), and the rest.
struct PipelineStepTimes {
  double seconds = 0;      // the whole step
  double compute = 0;      // forward and backward
  double communicate = 0;  // message groups
  // When each of this rank's actions ran, in plan order: seconds from the step's start. `action`
  // indexes plan().actions[rank()] (its describe() names it: "F3@s1", "send A3 s1>s2, recv G2 s2>s1").
  // A timeline of one step without LOOM_TIMELINE (pipeline_bench draws one per schedule from it).
  struct ActionTime {
    int action = 0;
    double start = 0, end = 0;
  };
  std::vector<ActionTime> actions;
  // The idle fraction this rank saw: 1 - compute / seconds (the plan's bubble, plus overheads).
  double bubble() const { return seconds > 0 ? 1.0 - compute / seconds : 0.0; }
};

class PipelineExecutor {
 public:
  // `pipeline`: this rank's pipeline (ParallelState::pp_group(); its rank is the pipeline rank).
  // `chunks`: this rank's model chunks, chunk c being global stage c * ranks + rank (one chunk,
  // unless the schedule is interleaved). A collective over `pipeline`: loom::MismatchError when its
  // ranks were built with different schedules, micro-batch counts or chunk counts;
  // loom::InvalidArgumentError for a plan that does not fit.
  PipelineExecutor(std::shared_ptr<Communicator> pipeline, std::vector<StageFunction> chunks,
                   const PipelineOptions& options);

  // One step: every micro-batch forward and backward through every stage. `inputs` are the
  // micro-batches, read on the rank holding stage 0 (others may pass {}); `loss` runs on the rank
  // holding the last stage. Returns that rank's losses, detached, by micro-batch; empty elsewhere.
  std::vector<at::Tensor> step(const std::vector<at::Tensor>& inputs, const LossFunction& loss);

  // Forward only, for evaluation and generation: each input (read on the rank holding stage 0;
  // others may pass {}) runs through every stage in order, without autograd and whatever its shape
  // (each message carries its own). Returns the last stage's outputs on its rank; empty elsewhere.
  //   model.eval();
  //   auto logits = pipeline.forward_only({prompt});   // on the last stage: {logits}
  std::vector<at::Tensor> forward_only(const std::vector<at::Tensor>& inputs);

  const PipelinePlan& plan() const { return plan_; }
  // This rank's last step (with LOOM_TIMELINE, each action is also a span in the "pipeline" lanes).
  const PipelineStepTimes& last_step() const { return last_step_; }
  const Proof& proof() const { return proof_; }
  int rank() const { return rank_; }
  bool holds_first_stage() const { return rank_ == 0; }
  bool holds_last_stage() const { return plan_.shape.rank_of_stage(plan_.shape.stages() - 1) == rank_; }
  // The agreed shape and dtype of what stage `stage` sends on (after the first step).
  std::optional<std::pair<std::vector<int64_t>, at::ScalarType>> boundary(int stage) const;

 private:
  struct InFlight {
    at::Tensor input, output, loss, input_grad;
  };
  void agree_on_shape(int virtual_stages) const;
  using Boundaries = std::map<int, std::pair<std::vector<int64_t>, at::ScalarType>>;
  void agree_on_boundaries(const std::vector<at::Tensor>& inputs);
  at::Tensor relay_forward(const at::Tensor& input, const std::string& what, Boundaries* sent);
  void forward(int micro_batch, int stage, const std::vector<at::Tensor>& inputs, const LossFunction& loss,
               std::vector<at::Tensor>& losses);
  void backward(int micro_batch, int stage);
  void weight(int micro_batch, int stage);
  void communicate(const Action& action);
  void let_go_of_sends(bool wait_for_all);
  const StageFunction& chunk_of(int stage) const;
  int key(int micro_batch, int stage) const { return micro_batch * plan_.shape.stages() + stage; }

  std::shared_ptr<Communicator> pipeline_;
  std::vector<StageFunction> chunks_;
  PipelineOptions options_;
  PipelinePlan plan_;
  Proof proof_;
  int rank_ = 0;
  Boundaries boundaries_;                                                      // by sending stage
  std::map<int, InFlight> in_flight_;                                          // by key(m, stage)
  std::map<int, at::Tensor> arrived_activations_, arrived_gradients_;          // by key(m, receiving stage)
  std::map<int, int> backwards_done_;                                          // this step, by stage
  std::map<int, std::vector<std::function<void()>>> deferred_;                 // weight gradients, by key(m, stage)
  std::vector<std::pair<std::string, WorkPtr>> sends_in_flight_;               // host sends not yet waited for
  PipelineStepTimes last_step_;
};

}  // namespace loom::pp
