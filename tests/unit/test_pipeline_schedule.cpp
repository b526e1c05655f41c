// Pipeline schedules as data (loom/parallel/pipeline_schedule.h): every generated plan is proven
// by the replay (rendezvous messages), times to the bubble its formula promises, and the replay
// refuses by name the plans that would hang or compute wrongly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "loom/error.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/pipeline_schedule.h"
#include "parallel/deferred_weight_gradients.h"

namespace {

using loom::pp::Action;
using loom::pp::make_schedule;
using loom::pp::PipelinePlan;
using loom::pp::prove;
using loom::pp::Schedule;

void expect_refused(const PipelinePlan& plan, const std::vector<std::string>& parts) {
  try {
    prove(plan);
    ADD_FAILURE() << "proven, expected a refusal";
  } catch (const loom::InvalidArgumentError& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// Messages between different ranks: two per stage boundary and micro-batch.
int64_t boundary_messages(const loom::pp::PipelineShape& s) {
  int64_t crossings = 0;
  for (int stage = 0; stage + 1 < s.stages(); ++stage)
    crossings += s.rank_of_stage(stage) != s.rank_of_stage(stage + 1) ? 1 : 0;
  return 2 * crossings * s.micro_batches;
}

TEST(PipelineSchedule, EveryPlanOfAGridOfShapesIsProven) {
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1})
    for (int p = 1; p <= 8; ++p)
      for (int m = 1; m <= 12; ++m) {  // fewer micro-batches than stages included
        const auto plan = make_schedule(schedule, {.ranks = p, .micro_batches = m});
        const auto proof = prove(plan);
        EXPECT_EQ(proof.messages, boundary_messages(plan.shape)) << schedule_name(schedule) << " p" << p << " m" << m;
      }
  for (int p = 1; p <= 4; ++p)
    for (int v = 2; v <= 4; ++v)
      for (int m = p; m <= 12; m += p) {
        const auto plan = make_schedule(Schedule::Interleaved1F1B, {.ranks = p, .micro_batches = m, .virtual_stages = v});
        EXPECT_EQ(prove(plan).messages, boundary_messages(plan.shape)) << "p" << p << " v" << v << " m" << m;
      }
}

TEST(PipelineSchedule, BubblesAreTheFormulas) {
  // A forward one unit, a backward two: 1F1B and GPipe idle (p - 1) / (m + p - 1) of the time,
  // interleaving over v virtual stages (p - 1) / (v m + p - 1).
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB})
    for (auto [p, m] : {std::pair{2, 8}, {4, 8}, {4, 16}, {8, 4}})
      EXPECT_NEAR(prove(make_schedule(schedule, {.ranks = p, .micro_batches = m})).bubble,
                  double(p - 1) / (m + p - 1), 1e-12)
          << schedule_name(schedule) << " p" << p << " m" << m;
  for (auto [p, v, m] : {std::tuple{2, 2, 8}, {4, 2, 8}, {4, 3, 8}, {2, 4, 4}})
    EXPECT_NEAR(prove(make_schedule(Schedule::Interleaved1F1B, {.ranks = p, .micro_batches = m, .virtual_stages = v}))
                    .bubble,
                double(p - 1) / (v * m + p - 1), 1e-12)
        << "p" << p << " v" << v << " m" << m;
}

TEST(PipelineSchedule, ShapesThatDoNotFitAreRefusedByName) {
  auto refused = [](Schedule schedule, loom::pp::PipelineShape shape, const std::string& part) {
    try {
      make_schedule(schedule, shape);
      ADD_FAILURE() << "made, expected a refusal";
    } catch (const loom::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  refused(Schedule::Interleaved1F1B, {.ranks = 4, .micro_batches = 6, .virtual_stages = 2},
          "expected a multiple of 4, found 6");
  refused(Schedule::Interleaved1F1B, {.ranks = 2, .micro_batches = 4}, "needs 2 or more virtual stages, found 1");
  refused(Schedule::OneFOneB, {.ranks = 2, .micro_batches = 4, .virtual_stages = 2}, "expected 1, found 2");
  refused(Schedule::GPipe, {.ranks = 0, .micro_batches = 4}, "must each be at least 1");
}

TEST(PipelineSchedule, SendsBeforeReceivesOneAtATimeWouldDeadlockAndAreRefused) {
  // 1F1B with each group cut into single messages, sends first: in the steady state rank 0 sends
  // an activation while rank 1 sends a gradient, each waiting for the other to receive (the
  // criss-crossed sends of pytorch#127332). Paired in one group, as the generator does, they pass.
  PipelinePlan plan = make_schedule(Schedule::OneFOneB, {.ranks = 2, .micro_batches = 4});
  prove(plan);
  for (auto& actions : plan.actions) {
    std::vector<Action> split;
    for (const Action& a : actions) {
      if (a.kind != Action::Kind::Communicate) {
        split.push_back(a);
        continue;
      }
      for (const auto& m : a.sends) split.push_back({Action::Kind::Communicate, 0, 0, {m}, {}});
      for (const auto& m : a.receives) split.push_back({Action::Kind::Communicate, 0, 0, {}, {m}});
    }
    actions = split;
  }
  expect_refused(plan, {"1F1B (ranks 2, micro-batches 4, virtual stages 1): would deadlock",
                        "rank 0 waits at action", "(send A1 s0>s1)", "rank 1 waits at action", "(send G0 s1>s0)"});
}

TEST(PipelineSchedule, WrongPlansAreRefusedBeforeTheyRun) {
  const PipelinePlan good = make_schedule(Schedule::OneFOneB, {.ranks = 2, .micro_batches = 2});
  {  // a backward dropped: its gradient is never sent, rank 0 waits for it after rank 1 finished
    PipelinePlan plan = good;
    auto& last = plan.actions[1];
    last.erase(std::find_if(last.begin(), last.end(), [](const Action& a) { return a.kind == Action::Kind::Backward; }));
    expect_refused(plan, {"rank 1, action", "sends what it has not computed yet"});
  }
  {  // rank 1's first forward moved before the receive of its input
    PipelinePlan plan = good;
    auto& actions = plan.actions[1];
    std::swap(actions[0], actions[1]);
    expect_refused(plan, {"rank 1, action 0 (F0@s1): its input activation has not arrived"});
  }
  {  // a hand-made shape that sizes nothing
    PipelinePlan plan = good;
    plan.shape.micro_batches = -3;
    expect_refused(plan, {"micro-batches -3", "expected each at least 1"});
    plan.shape = {.ranks = 2, .micro_batches = 1 << 16, .virtual_stages = 1 << 16};
    expect_refused(plan, {"at most 2^26"});
  }
  {  // a forward run twice
    PipelinePlan plan = good;
    plan.actions[0].insert(plan.actions[0].begin(), plan.actions[0].front());
    expect_refused(plan, {"micro-batch 0 on stage 0 runs its forward 2, its backward 1"});
  }
  {  // a weight gradient apart from the backward in a plan whose backward is whole
    PipelinePlan plan = good;
    plan.actions[1].push_back({Action::Kind::Weight, 0, 1, {}, {}});
    expect_refused(plan, {"W0@s1", "a weight gradient apart from its backward, in a plan whose backward is whole"});
  }
  const PipelinePlan zero_bubble = make_schedule(Schedule::ZeroBubbleH1, {.ranks = 2, .micro_batches = 2});
  auto weight_of = [](std::vector<Action>& actions, int micro_batch) {
    return std::find_if(actions.begin(), actions.end(), [&](const Action& a) {
      return a.kind == Action::Kind::Weight && a.micro_batch == micro_batch;
    });
  };
  {  // a weight gradient dropped
    PipelinePlan plan = zero_bubble;
    plan.actions[0].erase(weight_of(plan.actions[0], 1));
    expect_refused(plan, {"ZB-H1", "micro-batch 1 on stage 0", "its weight gradient 0 time(s); expected once each"});
  }
  {  // a weight gradient before its input gradient
    PipelinePlan plan = zero_bubble;
    auto& actions = plan.actions[1];
    const Action w = *weight_of(actions, 0);
    actions.erase(weight_of(actions, 0));
    actions.insert(actions.begin(), w);
    expect_refused(plan, {"rank 1, action 0 (W0@s1): the input gradient of this micro-batch on this stage has not run"});
  }
}

// ZB-H1: the input gradient goes first, the weight gradient fills what 1F1B leaves idle. At p = 2
// the plan reaches the paper's (p - 1) / (3m + p - 1) (0.04 at m = 8); at no shape does it idle
// more than 1F1B (and less at the shapes below); no rank holds more micro-batches than one more than 1F1B's first rank (p + 1),
// nor waits for more input gradients than 1F1B's rank r (p - r).
TEST(PipelineSchedule, ZeroBubbleFillsTheBubbleWithinOneFOneBsMemory) {
  EXPECT_NEAR(prove(make_schedule(Schedule::ZeroBubbleH1, {.ranks = 2, .micro_batches = 8})).bubble, 1.0 / 25, 1e-12);
  for (auto [p, m, bubble] : {std::tuple{3, 13, 0.093}, {4, 8, 0.111}, {4, 16, 0.127}, {8, 16, 0.172}})
    EXPECT_NEAR(prove(make_schedule(Schedule::ZeroBubbleH1, {.ranks = p, .micro_batches = m})).bubble, bubble, 5e-4)
        << "p" << p << " m" << m << " (1F1B: " << double(p - 1) / (m + p - 1) << ")";
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE("p" + std::to_string(p) + " m" + std::to_string(m));
      const auto plan = make_schedule(Schedule::ZeroBubbleH1, {.ranks = p, .micro_batches = m});
      const auto proof = prove(plan);
      EXPECT_EQ(proof.messages, boundary_messages(plan.shape));
      const double one_f_one_b = double(p - 1) / (m + p - 1);
      EXPECT_LE(proof.bubble, one_f_one_b + 1e-12);
      if (p == 2 && m > 1) EXPECT_NEAR(proof.bubble, 1.0 / (3 * m + 1), 1e-12);
      for (int r = 0; r < p; ++r) {
        int holding = 0, awaiting = 0, most_holding = 0, most_awaiting = 0;
        for (const Action& a : plan.actions[r]) {
          if (a.kind == Action::Kind::Forward) ++holding, ++awaiting;
          if (a.kind == Action::Kind::Backward) --awaiting;
          if (a.kind == Action::Kind::Weight) --holding;
          most_holding = std::max(most_holding, holding);
          most_awaiting = std::max(most_awaiting, awaiting);
        }
        EXPECT_LE(most_holding, p + 1) << "rank " << r;
        EXPECT_LE(most_awaiting, p - r) << "rank " << r;
      }
    }
}

TEST(PipelineSchedule, RandomShapesAreAllProven) {
  std::mt19937 random(20261206);
  for (int i = 0; i < 300; ++i) {
    const int p = 1 + static_cast<int>(random() % 8);
    const auto schedule = static_cast<Schedule>(random() % 4);
    const int v = schedule == Schedule::Interleaved1F1B ? 2 + static_cast<int>(random() % 3) : 1;
    const int m = schedule == Schedule::Interleaved1F1B ? p * (1 + static_cast<int>(random() % 4))
                                                        : 1 + static_cast<int>(random() % 16);
    const auto plan = make_schedule(schedule, {.ranks = p, .micro_batches = m, .virtual_stages = v});
    const auto proof = prove(plan);
    EXPECT_EQ(proof.messages, boundary_messages(plan.shape));
    EXPECT_GE(proof.bubble, 0.0);
    EXPECT_LT(proof.bubble, 1.0);
  }
}

// Costs for every action of a plan: `compute(rank, action)` for computations, 0 for message groups.
template <typename F>
loom::pp::ReplayCosts costs_of(const PipelinePlan& plan, bool sends_posted, F compute) {
  loom::pp::ReplayCosts costs{.sends_posted = sends_posted};
  for (size_t r = 0; r < plan.actions.size(); ++r) {
    costs.action.emplace_back();
    for (const Action& a : plan.actions[r])
      costs.action.back().push_back(a.kind == Action::Kind::Communicate ? 0.0 : compute(static_cast<int>(r), a));
  }
  return costs;
}

TEST(PipelineSchedule, ReplayAtTheUnitCostsIsTheProof) {
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B, Schedule::ZeroBubbleH1})
    for (auto [p, m] : {std::pair{2, 8}, {4, 8}, {3, 6}}) {
      const int v = schedule == Schedule::Interleaved1F1B ? 2 : 1;
      const auto plan = make_schedule(schedule, {.ranks = p, .micro_batches = m, .virtual_stages = v});
      const bool split = schedule == Schedule::ZeroBubbleH1;
      const auto unit = costs_of(plan, false, [&](int, const Action& a) {
        return a.kind == Action::Kind::Forward ? 1.0 : split ? 1.0 : 2.0;
      });
      const auto proof = prove(plan), replay = prove(plan, unit);
      EXPECT_DOUBLE_EQ(replay.makespan, proof.makespan) << schedule_name(schedule) << " p" << p << " m" << m;
      EXPECT_DOUBLE_EQ(replay.bubble, proof.bubble) << schedule_name(schedule) << " p" << p << " m" << m;
      EXPECT_EQ(replay.messages, proof.messages);
    }
}

// GPipe over 2 ranks whose second stage is 3 times slower: rank 1 computes without a pause from the
// first activation (t = 1) to its last backward (t = 1 + 9m); rank 0's last backward follows.
TEST(PipelineSchedule, ReplayAtMeasuredCostsWaitsForTheSlowStage) {
  constexpr int m = 4;
  const auto plan = make_schedule(Schedule::GPipe, {.ranks = 2, .micro_batches = m});
  for (bool posted : {false, true}) {
    const auto proof = prove(plan, costs_of(plan, posted, [](int rank, const Action& a) {
      return (a.kind == Action::Kind::Forward ? 1.0 : 2.0) * (rank == 1 ? 3.0 : 1.0);
    }));
    EXPECT_DOUBLE_EQ(proof.makespan, 9 * m + 3) << (posted ? "sends posted" : "rendezvous");
    ASSERT_EQ(proof.busy.size(), 2u);
    EXPECT_DOUBLE_EQ(proof.busy[0], 3 * m);
    EXPECT_DOUBLE_EQ(proof.busy[1], 9 * m);
    EXPECT_NEAR(proof.bubble, ((1 - 3.0 * m / (9 * m + 3)) + (1 - 9.0 * m / (9 * m + 3))) / 2, 1e-12);
    EXPECT_EQ(proof.messages, 2 * m);
  }
}

// Sends that are not waited for can only let a rank get further: never a longer replay than the
// rendezvous at the same costs, and a shorter one where a sender would otherwise wait.
TEST(PipelineSchedule, PostedSendsNeverLengthenTheReplay) {
  std::mt19937 random(20261207);
  std::uniform_real_distribution<double> cost(0.1, 3.0);
  int shorter = 0;
  for (int i = 0; i < 200; ++i) {
    const int p = 2 + static_cast<int>(random() % 4);
    const auto schedule = static_cast<Schedule>(random() % 4);
    const int v = schedule == Schedule::Interleaved1F1B ? 2 : 1;
    const int m = schedule == Schedule::Interleaved1F1B ? p * (1 + static_cast<int>(random() % 3))
                                                        : 1 + static_cast<int>(random() % 10);
    const auto plan = make_schedule(schedule, {.ranks = p, .micro_batches = m, .virtual_stages = v});
    auto rendezvous = costs_of(plan, false, [&](int, const Action&) { return cost(random); });
    auto posted = rendezvous;
    posted.sends_posted = true;
    const auto waited = prove(plan, rendezvous), not_waited = prove(plan, posted);
    EXPECT_LE(not_waited.makespan, waited.makespan + 1e-9) << schedule_name(schedule) << " p" << p << " m" << m;
    EXPECT_EQ(not_waited.messages, waited.messages);
    shorter += not_waited.makespan < waited.makespan - 1e-9 ? 1 : 0;
  }
  EXPECT_GT(shorter, 0) << "posting the sends changed no replay: the two modes are one";
}

// Sends that are not waited for must not let a wrong plan through: a receive dropped, a send or a
// receive repeated, a receive naming another sending stage, each refused as under rendezvous.
TEST(PipelineSchedule, PostedSendsRefuseWhatTheRendezvousRefuses) {
  const PipelinePlan good = make_schedule(Schedule::OneFOneB, {.ranks = 2, .micro_batches = 2});
  auto group_with = [](std::vector<Action>& actions, bool sends) {
    return std::find_if(actions.begin(), actions.end(), [&](const Action& a) {
      return a.kind == Action::Kind::Communicate && !(sends ? a.sends : a.receives).empty();
    });
  };
  auto refused_both_ways = [](const PipelinePlan& plan, const std::string& posted_part) {
    EXPECT_THROW(prove(plan), loom::InvalidArgumentError);
    try {
      prove(plan, loom::pp::ReplayCosts{.sends_posted = true});
      ADD_FAILURE() << "replayed with sends posted, expected a refusal";
    } catch (const loom::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(posted_part), std::string::npos) << e.what();
    }
  };
  EXPECT_NO_THROW(prove(good, loom::pp::ReplayCosts{.sends_posted = true}));
  {  // rank 0's last gradient receive dropped: sent by rank 1, received by nobody, and the backward
     // that needs it runs without it
    PipelinePlan plan = good;
    auto& actions = plan.actions[0];
    auto it = std::find_if(actions.rbegin(), actions.rend(), [](const Action& a) {
      return a.kind == Action::Kind::Communicate && !a.receives.empty();
    });
    it->receives.clear();
    refused_both_ways(plan, "its output gradient has not arrived");
  }
  {  // rank 0's first send repeated in a group of its own
    PipelinePlan plan = good;
    auto& actions = plan.actions[0];
    auto it = group_with(actions, true);
    actions.insert(it + 1, Action{Action::Kind::Communicate, 0, 0, {it->sends.front()}, {}});
    refused_both_ways(plan, "sends a message it has sent before");
  }
  {  // rank 1's first receive repeated in a group of its own
    PipelinePlan plan = good;
    auto& actions = plan.actions[1];
    auto it = group_with(actions, false);
    actions.insert(it + 1, Action{Action::Kind::Communicate, 0, 0, {}, {it->receives.front()}});
    refused_both_ways(plan, "would deadlock");
  }
  {  // rank 1's first receive names stage 1 as the sender of its own input
    PipelinePlan plan = good;
    auto& receive = group_with(plan.actions[1], false)->receives.front();
    receive.from_stage = receive.to_stage;
    refused_both_ways(plan, "");
  }
}

TEST(PipelineSchedule, CostsThatDoNotFitThePlanAreRefusedByName) {
  const auto plan = make_schedule(Schedule::OneFOneB, {.ranks = 2, .micro_batches = 4});
  auto refused = [&](const loom::pp::ReplayCosts& costs, const std::string& part) {
    try {
      prove(plan, costs);
      ADD_FAILURE() << "replayed, expected a refusal";
    } catch (const loom::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const auto good = costs_of(plan, true, [](int, const Action&) { return 1.0; });
  EXPECT_NO_THROW(prove(plan, good));
  auto fewer_ranks = good;
  fewer_ranks.action.pop_back();
  refused(fewer_ranks, "costs list 1 ranks; the plan has 2");
  auto fewer_actions = good;
  fewer_actions.action[1].pop_back();
  refused(fewer_actions, "costs list " + std::to_string(plan.actions[1].size() - 1) + " actions for rank 1");
  auto negative = good;
  negative.action[0][0] = -1;
  refused(negative, "the cost of rank 0's action 0 (F0@s0) is -1");
  auto not_a_number = good;
  not_a_number.action[1][2] = std::nan("");
  refused(not_a_number, "expected a finite number");
}

// loom::pp::linear: the gradients of at::linear, all at once outside a zero-bubble backward; inside
// one (the executor's input-gradient pass) the input gradient at once and the weight and bias
// gradients only when the deferred work runs, added to what .grad() held.
TEST(PipelineLinear, GradientsEqualAtLinearAndDeferredOnesArriveWhenTheWeightStepRuns) {
  at::manual_seed(5);
  const at::Tensor x0 = at::randn({4, 3, 5}), w0 = at::randn({6, 5}), b0 = at::randn({6}), g = at::randn({4, 3, 6});
  auto leaves = [&] {
    return std::tuple{x0.clone().requires_grad_(true), w0.clone().requires_grad_(true), b0.clone().requires_grad_(true)};
  };
  auto [x_ref, w_ref, b_ref] = leaves();
  at::linear(x_ref, w_ref, b_ref).backward(g);
  auto [x, w, b] = leaves();
  loom::pp::linear(x, w, b).backward(g);
  EXPECT_TRUE(at::allclose(x.grad(), x_ref.grad(), 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(w.grad(), w_ref.grad(), 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(b.grad(), b_ref.grad(), 1e-6, 1e-6));

  // Deferred: a second backward inside the scope leaves w and b as they were until the work runs.
  std::vector<loom::pp::detail::DeferredGradient> deferred;
  const at::Tensor w_before = w.grad().clone(), b_before = b.grad().clone(), x_before = x.grad().clone();
  {
    loom::pp::detail::DeferWeightGradients scope(deferred);
    torch::autograd::backward({loom::pp::linear(x, w, b)}, {g});
  }
  EXPECT_TRUE(at::equal(x.grad(), x_before * 2) || at::allclose(x.grad(), x_before * 2, 1e-6, 1e-6));
  EXPECT_TRUE(at::equal(w.grad(), w_before));
  EXPECT_TRUE(at::equal(b.grad(), b_before));
  ASSERT_EQ(deferred.size(), 1u);
  deferred[0]();
  EXPECT_TRUE(at::allclose(w.grad(), w_ref.grad() * 2, 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(b.grad(), b_ref.grad() * 2, 1e-6, 1e-6));
  // A weight that is computed (not a leaf) gets its gradient through autograd at once.
  auto [x2, w2, b2] = leaves();
  std::vector<loom::pp::detail::DeferredGradient> none;
  {
    loom::pp::detail::DeferWeightGradients scope(none);
    loom::pp::linear(x2, w2 * 1.0, b2).backward(g);
  }
  EXPECT_TRUE(none.empty());
  EXPECT_TRUE(at::allclose(w2.grad(), w_ref.grad(), 1e-6, 1e-6));
}

}  // namespace
