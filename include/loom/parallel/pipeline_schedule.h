// Pipeline schedules as data: for each pipeline rank, the ordered list of what it does (the
// forward or backward of micro-batch m on a stage, and with a zero-bubble schedule the weight
// gradient apart from it; groups of sends and receives started together), generated for GPipe,
// 1F1B, interleaved 1F1B and zero-bubble (ZB-H1), and proven before anything runs. The prover
// replays every rank's list with rendezvous messages (a send completes only when its receive is
// posted, the strictest transport), checks that each computation has its input when it runs and
// that every stage computes every micro-batch once, and refuses a plan that would deadlock, naming
// the rank and the action each stuck rank waits at. It also times the plan (a forward one unit, a
// backward two: one for the input gradient and one for the weight gradient when a zero-bubble
// schedule splits them), which gives the bubble the schedule promises.
//
//   auto plan = loom::pp::make_schedule(loom::pp::Schedule::OneFOneB, {.ranks = 4, .micro_batches = 8});
//   loom::pp::Proof proof = loom::pp::prove(plan);   // InvalidArgumentError when it would not finish
//   for (const auto& action : plan.actions[rank]) ...  // what the executor runs on pipeline rank `rank`
//
// Stages: with V virtual stages per rank, global stage s lives on rank s % ranks (chunk s / ranks),
// as Megatron-Core places them, so each rank holds V chunks spread along the model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::pp {

enum class Schedule {
  GPipe,            // every forward, then every backward
  OneFOneB,         // 1F1B: a warm-up of forwards, then one forward and one backward alternately
  Interleaved1F1B,  // 1F1B over virtual stages (micro-batches a multiple of the ranks)
  // Zero-bubble ZB-H1 (Qi et al., 2023): backward split into the input gradient (B), which the
  // previous stage waits for, and the weight gradient (W), which waits for nobody and fills what
  // would be the bubble. Each rank holds at most p + 1 micro-batches' activations until their W
  // (1F1B's first rank holds p). The plan's bubble: (p - 1) / (3m + p - 1) at p = 2 (0.04 at m = 8,
  // against 1F1B's 0.111); never above 1F1B's (0.111 against 0.273 at p = 4, m = 8; 0.127 against
  // 0.158 at p = 4, m = 16), short of the paper's formula beyond p = 2 (a list schedule here, where
  // the paper places each pass by hand).
  ZeroBubbleH1,
};
const char* schedule_name(Schedule schedule);
// The schedule a command line or Python names: "gpipe", "1f1b", "interleaved" or "zero-bubble".
// InvalidArgumentError naming the choices for anything else.
Schedule parse_schedule(const std::string& name);

struct PipelineShape {
  int ranks = 1;           // pipeline ranks
  int micro_batches = 1;   // per step
  int virtual_stages = 1;  // model chunks per rank (Interleaved1F1B: 2 or more)
  int stages() const { return ranks * virtual_stages; }
  int rank_of_stage(int stage) const { return stage % ranks; }
};

// An activation goes to the next stage, its gradient back to the previous one.
enum class Carries { Activation, Gradient };

struct Message {
  Carries carries = Carries::Activation;
  int micro_batch = 0;
  int from_stage = 0;
  int to_stage = 0;
  bool operator==(const Message& other) const = default;
};

struct Action {
  // Backward: the whole backward, or in a zero-bubble plan the input gradient only; Weight: the
  // weight gradient of a backward that ran (zero-bubble plans).
  enum class Kind { Forward, Backward, Weight, Communicate };
  Kind kind = Kind::Forward;
  int micro_batch = 0;  // Forward, Backward and Weight
  int stage = 0;        // Forward, Backward and Weight: the global stage
  // Communicate: started together and complete together (one group: no order among them can
  // deadlock against the peers' groups).
  std::vector<Message> sends, receives;
  // "F3@s1", "B3@s1", "W3@s1", "send A3 s1>s2, recv G2 s2>s1".
  std::string describe() const;
};

struct PipelinePlan {
  Schedule schedule = Schedule::OneFOneB;
  PipelineShape shape;
  std::vector<std::vector<Action>> actions;  // per pipeline rank, in order
};

// The plan of `schedule` for `shape`. InvalidArgumentError naming what does not fit: a count below
// 1, virtual stages with GPipe or 1F1B, fewer than 2 with Interleaved1F1B, or micro-batches that
// are not a multiple of the ranks for it.
PipelinePlan make_schedule(Schedule schedule, PipelineShape shape);

// What proving a plan found: its length and bubble under unit costs (forward 1, backward 2).
struct Proof {
  double makespan = 0;        // time units from the first action to the last
  double bubble = 0;          // the idle fraction of every rank's time, averaged: 1 - busy / makespan
  int64_t messages = 0;       // point-to-point messages the plan sends
  std::vector<double> busy;   // per rank
};

// Replays the plan (see the top of this file). InvalidArgumentError naming the first problem: a
// computation before its input arrived, one missing or repeated, a message nobody receives, or a
// deadlock (each stuck rank with the action it waits at).
Proof prove(const PipelinePlan& plan);

// The same replay at other costs: what a schedule leaves idle when its actions take the times one
// step measured (PipelineStepTimes::actions, every rank's) and messages take none. That is the part
// of a measured bubble the schedule answers for at those costs (unequal stages, cores); what the
// measurement has above it, messages and the executor cost.
//
//   loom::pp::ReplayCosts costs{.action = seconds_by_rank_and_action, .sends_posted = true};
//   double bubble = loom::pp::prove(plan, costs).bubble;
struct ReplayCosts {
  // Per pipeline rank, per action of plan.actions[rank]: how long it takes, in any unit (a
  // Communicate action's entry is not read). Empty: the unit costs of prove(plan).
  std::vector<std::vector<double>> action;
  // Each group's sends posted at its start and never waited for, its receives waited for (the
  // executor over MPI or Gloo), instead of every send completing only with its receive (the
  // rendezvous of prove(plan); NCCL's group calls). A plan proven under rendezvous finishes here too.
  bool sends_posted = false;
};
// InvalidArgumentError as prove(plan), and for costs that list other ranks or actions than the
// plan's, or a cost that is negative or not finite.
Proof prove(const PipelinePlan& plan, const ReplayCosts& costs);

}  // namespace loom::pp
