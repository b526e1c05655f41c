// The proof of a pipeline plan (loom::pp::prove): every rank's actions replayed together, with
// rendezvous messages and unit costs (or the costs and send mode given), until every rank is done
// or none can move.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "loom/error.h"
#include "loom/parallel/pipeline_schedule.h"

namespace loom::pp {

namespace {

constexpr double kForwardCost = 1.0;
constexpr double kBackwardCost = 2.0;  // the whole backward; split, an input and a weight gradient of 1 each
constexpr double kSplitCost = 1.0;

// One rank during the replay.
struct RankState {
  size_t next = 0;            // index of the action it is at
  double clock = 0;           // when it reached it
  bool posted = false;        // a Communicate action: its group is posted
  std::vector<bool> matched;  // per message of the group: sends first, then receives
  double matched_at = 0;      // the latest match in the group
};

// The plan's shape, refused before anything is sized by it (a hand-made plan may say anything).
const PipelineShape& checked_shape(const PipelinePlan& plan) {
  const PipelineShape& s = plan.shape;
  constexpr int kMost = 1 << 16;
  if (s.ranks < 1 || s.micro_batches < 1 || s.virtual_stages < 1 || s.ranks > kMost || s.micro_batches > kMost ||
      s.virtual_stages > kMost || int64_t{s.ranks} * s.virtual_stages * s.micro_batches > (int64_t{1} << 26))
    throw InvalidArgumentError(std::string("pipeline plan ") + schedule_name(plan.schedule) + ": ranks " +
                               std::to_string(s.ranks) + ", micro-batches " + std::to_string(s.micro_batches) +
                               ", virtual stages " + std::to_string(s.virtual_stages) +
                               ": expected each at least 1 and at most 2^26 (stage, micro-batch) pairs");
  return s;
}

class Replay {
 public:
  Replay(const PipelinePlan& plan, const ReplayCosts& costs)
      : plan_(plan),
        costs_(costs),
        shape_(checked_shape(plan)),
        stages_(shape_.stages()),
        ranks_(static_cast<size_t>(shape_.ranks)),
        forward_(cells(), 0),
        backward_(cells(), 0),
        weight_(cells(), 0),
        split_(plan.schedule == Schedule::ZeroBubbleH1),
        arrived_(2 * cells(), false),
        posted_at_(costs.sends_posted ? 2 * cells() : 0, -1.0) {
    if (plan.actions.size() != static_cast<size_t>(shape_.ranks))
      fail("the plan lists " + std::to_string(plan.actions.size()) + " ranks; its shape has " +
           std::to_string(shape_.ranks));
    check_costs();
    proof_.busy.assign(ranks_.size(), 0.0);
  }

  Proof run() {
    for (;;) {
      bool moved = false;
      for (int r = 0; r < shape_.ranks; ++r) moved = advance(r) || moved;
      moved = match() || moved;
      bool all_done = true;
      for (int r = 0; r < shape_.ranks; ++r) all_done = all_done && done(r);
      if (all_done) break;
      if (!moved) deadlock();
    }
    for (int m = 0; m < shape_.micro_batches; ++m)
      for (int s = 0; s < stages_; ++s)
        if (forward_[cell(m, s)] != 1 || backward_[cell(m, s)] != 1 || weight_[cell(m, s)] != (split_ ? 1 : 0))
          fail("micro-batch " + std::to_string(m) + " on stage " + std::to_string(s) + " runs its forward " +
               std::to_string(forward_[cell(m, s)]) + ", its backward " + std::to_string(backward_[cell(m, s)]) +
               " and its weight gradient " + std::to_string(weight_[cell(m, s)]) + " time(s); expected once each" +
               (split_ ? "" : ", and no weight gradient apart from the backward"));
    for (const auto& r : ranks_) proof_.makespan = std::max(proof_.makespan, r.clock);
    double idle = 0;
    for (double busy : proof_.busy) idle += proof_.makespan > 0 ? 1.0 - busy / proof_.makespan : 0.0;
    proof_.bubble = idle / static_cast<double>(ranks_.size());
    return proof_;
  }

 private:
  size_t cells() const { return static_cast<size_t>(shape_.micro_batches) * static_cast<size_t>(stages_); }
  size_t cell(int m, int s) const { return static_cast<size_t>(m) * static_cast<size_t>(stages_) + static_cast<size_t>(s); }
  size_t message_slot(const Message& m) const {
    return (m.carries == Carries::Gradient ? cells() : 0) + cell(m.micro_batch, m.to_stage);
  }
  // Whether a message has arrived at its stage (activations, then gradients).
  std::vector<bool>::reference arrived(const Message& m) { return arrived_[message_slot(m)]; }
  // With sends posted: when its sender posted it (-1 until then).
  double& posted_at(const Message& m) { return posted_at_[message_slot(m)]; }

  void check_costs() const {
    const auto& costs = costs_.action;
    if (costs.empty()) return;
    if (costs.size() != plan_.actions.size())
      fail("costs list " + std::to_string(costs.size()) + " ranks; the plan has " + std::to_string(plan_.actions.size()));
    for (size_t r = 0; r < costs.size(); ++r) {
      if (costs[r].size() != plan_.actions[r].size())
        fail("costs list " + std::to_string(costs[r].size()) + " actions for rank " + std::to_string(r) +
             "; its plan has " + std::to_string(plan_.actions[r].size()));
      for (size_t i = 0; i < costs[r].size(); ++i)
        if (!std::isfinite(costs[r][i]) || costs[r][i] < 0)
          fail("the cost of rank " + std::to_string(r) + "'s action " + std::to_string(i) + " (" +
               plan_.actions[r][i].describe() + ") is " + std::to_string(costs[r][i]) +
               "; expected a finite number, 0 or more");
    }
  }
  double cost_of(int r, const Action& a) const {
    if (!costs_.action.empty())
      return costs_.action[static_cast<size_t>(r)][ranks_[static_cast<size_t>(r)].next];
    return a.kind == Action::Kind::Forward ? kForwardCost : split_ ? kSplitCost : kBackwardCost;
  }
  bool done(int r) const { return ranks_[static_cast<size_t>(r)].next >= plan_.actions[static_cast<size_t>(r)].size(); }
  const Action& current(int r) const { return plan_.actions[static_cast<size_t>(r)][ranks_[static_cast<size_t>(r)].next]; }

  [[noreturn]] void fail(const std::string& why) const {
    throw InvalidArgumentError(std::string("pipeline plan ") + schedule_name(plan_.schedule) + " (ranks " +
                               std::to_string(shape_.ranks) + ", micro-batches " + std::to_string(shape_.micro_batches) +
                               ", virtual stages " + std::to_string(shape_.virtual_stages) + "): " + why);
  }
  [[noreturn]] void fail_at(int r, const std::string& why) const {
    fail("rank " + std::to_string(r) + ", action " + std::to_string(ranks_[static_cast<size_t>(r)].next) + " (" +
         current(r).describe() + "): " + why);
  }

  bool valid_micro_batch_and_stage(int m, int s) const {
    return m >= 0 && m < shape_.micro_batches && s >= 0 && s < stages_;
  }

  // Runs rank r's computations up to its next Communicate action (posting that group).
  bool advance(int r) {
    RankState& st = ranks_[static_cast<size_t>(r)];
    bool moved = false;
    while (!done(r)) {
      const Action& a = current(r);
      if (a.kind == Action::Kind::Communicate) {
        if (!st.posted) post(r, a);
        return moved;
      }
      compute(r, a);
      ++st.next;
      moved = true;
    }
    return moved;
  }

  void compute(int r, const Action& a) {
    RankState& st = ranks_[static_cast<size_t>(r)];
    const int m = a.micro_batch, s = a.stage;
    if (!valid_micro_batch_and_stage(m, s)) fail_at(r, "no such micro-batch or stage");
    if (shape_.rank_of_stage(s) != r) fail_at(r, "stage " + std::to_string(s) + " lives on rank " +
                                                     std::to_string(shape_.rank_of_stage(s)));
    const bool forward = a.kind == Action::Kind::Forward;
    if (a.kind == Action::Kind::Weight) {
      if (!split_) fail_at(r, "a weight gradient apart from its backward, in a plan whose backward is whole");
      if (backward_[cell(m, s)] == 0) fail_at(r, "the input gradient of this micro-batch on this stage has not run");
      ++weight_[cell(m, s)];
    } else if (forward) {
      const bool input = s == 0 || (shape_.rank_of_stage(s - 1) == r ? forward_[cell(m, s - 1)] > 0
                                                                       : arrived({Carries::Activation, m, s - 1, s}));
      if (!input) fail_at(r, "its input activation has not arrived");
      ++forward_[cell(m, s)];
    } else {
      if (forward_[cell(m, s)] == 0) fail_at(r, "the forward of this micro-batch on this stage has not run");
      const bool last = s == stages_ - 1;
      const bool gradient = last || (shape_.rank_of_stage(s + 1) == r ? backward_[cell(m, s + 1)] > 0
                                                                      : arrived({Carries::Gradient, m, s + 1, s}));
      if (!gradient) fail_at(r, "its output gradient has not arrived");
      ++backward_[cell(m, s)];
    }
    const double cost = cost_of(r, a);
    st.clock += cost;
    proof_.busy[static_cast<size_t>(r)] += cost;
  }

  // A group is posted: its sends must carry what this rank has computed, to another rank.
  void post(int r, const Action& a) {
    RankState& st = ranks_[static_cast<size_t>(r)];
    for (const Message& m : a.sends) {
      if (!valid_micro_batch_and_stage(m.micro_batch, m.from_stage) || !valid_micro_batch_and_stage(m.micro_batch, m.to_stage))
        fail_at(r, "a message names no such micro-batch or stage");
      const bool activation = m.carries == Carries::Activation;
      if (m.to_stage != m.from_stage + (activation ? 1 : -1) || shape_.rank_of_stage(m.from_stage) != r ||
          shape_.rank_of_stage(m.to_stage) == r)
        fail_at(r, "sends " + std::string(activation ? "an activation" : "a gradient") +
                       " that is not this rank's to the next rank's (" + std::to_string(m.from_stage) + " to " +
                       std::to_string(m.to_stage) + ")");
      const int produced = activation ? forward_[cell(m.micro_batch, m.from_stage)]
                                      : backward_[cell(m.micro_batch, m.from_stage)];
      if (produced == 0) fail_at(r, "sends what it has not computed yet");
    }
    for (const Message& m : a.receives)
      if (!valid_micro_batch_and_stage(m.micro_batch, m.to_stage) || shape_.rank_of_stage(m.to_stage) != r)
        fail_at(r, "receives a message for a stage of another rank");
    st.posted = true;
    st.matched.assign(a.sends.size() + a.receives.size(), false);
    st.matched_at = st.clock;
    if (!costs_.sends_posted) return;
    for (size_t i = 0; i < a.sends.size(); ++i) {  // out, and done with as far as this rank goes
      if (posted_at(a.sends[i]) >= 0) fail_at(r, "sends a message it has sent before");
      posted_at(a.sends[i]) = st.clock;
      st.matched[i] = true;
    }
  }

  // With sends posted: a posted receive whose send has been posted arrives when both were. As under
  // rendezvous, a receive that names another sending stage than the send, or a message received
  // before, matches nothing (its rank then waits for ever: a deadlock). A message sent and never
  // received needs no check of its own: the stage it was for then computes without its input.
  bool receive_posted(int r) {
    RankState& st = ranks_[static_cast<size_t>(r)];
    const Action& a = current(r);
    bool moved = false;
    for (size_t j = 0; j < a.receives.size(); ++j) {
      const size_t slot = a.sends.size() + j;
      const Message& m = a.receives[j];
      const int from = m.to_stage + (m.carries == Carries::Gradient ? 1 : -1);
      if (st.matched[slot] || posted_at(m) < 0 || arrived(m) || m.from_stage != from) continue;
      st.matched[slot] = true;
      st.matched_at = std::max(st.matched_at, posted_at(m));
      arrived(m) = true;
      ++proof_.messages;
      moved = true;
    }
    return moved;
  }

  // Pairs every posted send with its posted receive (with sends posted: every posted receive with
  // its send); completes the groups all of whose messages are paired.
  bool match() {
    bool moved = false;
    for (int r = 0; r < shape_.ranks; ++r) {
      RankState& st = ranks_[static_cast<size_t>(r)];
      if (done(r) || !st.posted) continue;
      if (costs_.sends_posted) {
        moved = receive_posted(r) || moved;
        continue;
      }
      const Action& a = current(r);
      for (size_t i = 0; i < a.sends.size(); ++i) {
        if (st.matched[i]) continue;
        const int peer = shape_.rank_of_stage(a.sends[i].to_stage);
        RankState& ps = ranks_[static_cast<size_t>(peer)];
        if (done(peer) || !ps.posted) continue;
        const Action& b = current(peer);
        for (size_t j = 0; j < b.receives.size(); ++j) {
          const size_t slot = b.sends.size() + j;
          if (ps.matched[slot] || !(b.receives[j] == a.sends[i])) continue;
          const double at = std::max(st.clock, ps.clock);
          st.matched[i] = ps.matched[slot] = true;
          st.matched_at = std::max(st.matched_at, at);
          ps.matched_at = std::max(ps.matched_at, at);
          arrived(a.sends[i]) = true;
          ++proof_.messages;
          moved = true;
          break;
        }
      }
    }
    for (int r = 0; r < shape_.ranks; ++r) {
      RankState& st = ranks_[static_cast<size_t>(r)];
      if (done(r) || !st.posted) continue;
      if (!std::all_of(st.matched.begin(), st.matched.end(), [](bool m) { return m; })) continue;
      st.clock = st.matched_at;
      st.posted = false;
      ++st.next;
      moved = true;
    }
    return moved;
  }

  [[noreturn]] void deadlock() const {
    std::string stuck;
    for (int r = 0; r < shape_.ranks; ++r) {
      if (done(r)) continue;
      stuck += "\n  rank " + std::to_string(r) + " waits at action " +
               std::to_string(ranks_[static_cast<size_t>(r)].next) + " (" + current(r).describe() + ")";
    }
    std::string finished;
    for (int r = 0; r < shape_.ranks; ++r)
      if (done(r)) finished += (finished.empty() ? "" : ", ") + std::to_string(r);
    fail("would deadlock: no rank can move" + (finished.empty() ? std::string() : " (finished: ranks " + finished + ")") +
         stuck);
  }

  const PipelinePlan& plan_;
  const ReplayCosts& costs_;
  const PipelineShape shape_;
  const int stages_;
  std::vector<RankState> ranks_;
  std::vector<int> forward_, backward_, weight_;  // runs per (micro-batch, stage)
  bool split_ = false;                            // backward split into input and weight gradients
  std::vector<bool> arrived_;
  std::vector<double> posted_at_;  // with sends posted: per message, when (-1: not yet)
  Proof proof_;
};

}  // namespace

Proof prove(const PipelinePlan& plan) { return Replay(plan, ReplayCosts{}).run(); }

Proof prove(const PipelinePlan& plan, const ReplayCosts& costs) { return Replay(plan, costs).run(); }

}  // namespace loom::pp
