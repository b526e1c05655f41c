// Pipeline schedules as data (loom/parallel/pipeline_schedule.h): every generated plan is proven
// by the replay (rendezvous messages), times to the bubble its formula promises, and the replay
// refuses by name the plans that would hang or compute wrongly.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "loom/error.h"
#include "loom/parallel/pipeline_schedule.h"

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
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB})
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
    expect_refused(plan, {"micro-batch 0 on stage 0 runs its forward 2 and its backward 1 time(s)"});
  }
}

TEST(PipelineSchedule, RandomShapesAreAllProven) {
  std::mt19937 random(20261206);
  for (int i = 0; i < 300; ++i) {
    const int p = 1 + static_cast<int>(random() % 8);
    const auto schedule = static_cast<Schedule>(random() % 3);
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

}  // namespace
