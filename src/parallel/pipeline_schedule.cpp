// Pipeline schedules (generation) and their proof (a replay with rendezvous messages and unit
// costs). See loom/parallel/pipeline_schedule.h.
#include "loom/parallel/pipeline_schedule.h"

#include <algorithm>
#include <deque>

#include "loom/error.h"

namespace loom::pp {

namespace {

struct Compute {
  Action::Kind kind = Action::Kind::Forward;
  int micro_batch = 0;
  int stage = 0;
};
constexpr auto kF = Action::Kind::Forward, kB = Action::Kind::Backward, kW = Action::Kind::Weight;

std::string shape_text(Schedule schedule, const PipelineShape& s) {
  return std::string("pipeline schedule ") + schedule_name(schedule) + " (ranks " + std::to_string(s.ranks) +
         ", micro-batches " + std::to_string(s.micro_batches) + ", virtual stages " + std::to_string(s.virtual_stages) +
         ")";
}

void check_shape(Schedule schedule, const PipelineShape& s) {
  const std::string what = shape_text(schedule, s);
  if (s.ranks < 1 || s.micro_batches < 1 || s.virtual_stages < 1)
    throw InvalidArgumentError(what + ": ranks, micro-batches and virtual stages must each be at least 1");
  if (schedule != Schedule::Interleaved1F1B && s.virtual_stages != 1)
    throw InvalidArgumentError(what + ": virtual stages need Interleaved1F1B; expected 1, found " +
                               std::to_string(s.virtual_stages));
  if (schedule == Schedule::Interleaved1F1B && s.virtual_stages < 2)
    throw InvalidArgumentError(what + ": Interleaved1F1B needs 2 or more virtual stages, found " +
                               std::to_string(s.virtual_stages));
  if (schedule == Schedule::Interleaved1F1B && s.micro_batches % s.ranks != 0)
    throw InvalidArgumentError(what + ": Interleaved1F1B runs micro-batches in groups of the ranks; expected a "
                               "multiple of " + std::to_string(s.ranks) + ", found " + std::to_string(s.micro_batches));
}

// ZB-H1's order on rank `rank`: every rank's computations placed by a list schedule over unit
// time (a forward, an input gradient and a weight gradient one unit each, messages instant). A
// free rank runs, in this order of preference, the input gradient of its oldest micro-batch whose
// output gradient has arrived (the previous stage waits for it), the next forward (while fewer
// than p - rank micro-batches wait for their input gradient, as in 1F1B, and at most p hold
// activations until their weight gradient: one more than 1F1B's first rank, which buys most of the
// bubble back at every shape; with at most p the plan idles more than 1F1B's at p = 4, m = 16), or
// the oldest weight gradient due (which nobody waits for: it fills the time 1F1B leaves idle).
std::vector<Compute> zero_bubble_order(const PipelineShape& s, int rank) {
  const int p = s.ranks, m = s.micro_batches;
  constexpr int kNotYet = -1;
  struct RankState {
    std::vector<int> forward_done, input_grad_done;  // unit time each finished, by micro-batch
    int next_forward = 0, next_input_grad = 0, awaiting_input_grad = 0, holding = 0;
    std::deque<int> weight_due;
    std::vector<Compute> order;
  };
  std::vector<RankState> ranks(static_cast<size_t>(p));
  for (auto& r : ranks) r.forward_done.assign(static_cast<size_t>(m), kNotYet), r.input_grad_done.assign(static_cast<size_t>(m), kNotYet);
  auto arrived = [](int done_at, int now) { return done_at != kNotYet && done_at <= now; };
  size_t remaining = static_cast<size_t>(3) * static_cast<size_t>(p) * static_cast<size_t>(m);
  for (int now = 0; remaining > 0; ++now) {
    // Every unit some rank moves (the last rank's forward, input and weight gradients need nobody
    // once its input arrived): the loop ends within the serial time of every computation.
    if (static_cast<size_t>(now) > 3 * remaining + static_cast<size_t>(3 * p * m))
      throw InvalidArgumentError(shape_text(Schedule::ZeroBubbleH1, s) + ": the list schedule stopped moving");
    for (int r = 0; r < p; ++r) {
      RankState& st = ranks[static_cast<size_t>(r)];
      const int k = st.next_input_grad;
      const bool gradient_here =
          k < m && arrived(st.forward_done[k], now) &&
          (r == p - 1 || arrived(ranks[static_cast<size_t>(r + 1)].input_grad_done[k], now));
      const int f = st.next_forward;
      const bool input_here = f < m && (r == 0 || arrived(ranks[static_cast<size_t>(r - 1)].forward_done[f], now));
      if (gradient_here) {
        st.input_grad_done[k] = now + 1;
        st.order.push_back({kB, k, r});
        ++st.next_input_grad, --st.awaiting_input_grad;
        st.weight_due.push_back(k);
      } else if (input_here && st.awaiting_input_grad < p - r && st.holding <= p) {
        st.forward_done[f] = now + 1;
        st.order.push_back({kF, f, r});
        ++st.next_forward, ++st.awaiting_input_grad, ++st.holding;
      } else if (!st.weight_due.empty() && arrived(st.input_grad_done[st.weight_due.front()], now)) {
        st.order.push_back({kW, st.weight_due.front(), r});
        st.weight_due.pop_front();
        --st.holding;
      } else {
        continue;  // idle this unit
      }
      --remaining;
    }
  }
  return std::move(ranks[static_cast<size_t>(rank)].order);
}

// One rank's computations, in the order the schedule runs them, in units: the messages of a unit
// go out together with those the next unit needs (see make_schedule).
std::vector<std::vector<Compute>> computations(Schedule schedule, const PipelineShape& s, int rank) {
  const int p = s.ranks, m = s.micro_batches, v = s.virtual_stages;
  std::vector<std::vector<Compute>> out;
  if (schedule == Schedule::GPipe) {
    for (int k = 0; k < m; ++k) out.push_back({{kF, k, rank}});
    for (int k = 0; k < m; ++k) out.push_back({{kB, k, rank}});
    return out;
  }
  if (schedule == Schedule::ZeroBubbleH1) {
    for (const Compute& c : zero_bubble_order(s, rank)) out.push_back({c});
    return out;
  }
  // 1F1B, plain (v = 1) or interleaved: the k-th forward and backward of this rank in Megatron-Core's
  // order: micro-batches in groups of p, each group through every chunk before the next group.
  const int total = m * v;
  auto micro_batch = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto forward = [&](int k) { return Compute{kF, micro_batch(k), ((k / p) % v) * p + rank}; };
  auto backward = [&](int k) { return Compute{kB, micro_batch(k), (v - 1 - (k / p) % v) * p + rank}; };
  const int warmup = v == 1 ? std::min(p - rank - 1, total) : std::min((p - rank - 1) * 2 + (v - 1) * p, total);
  for (int k = 0; k < warmup; ++k) out.push_back({forward(k)});
  for (int k = 0; k < total - warmup; ++k) {
    // Interleaved, a forward and a backward are one unit, their messages one group with the next
    // unit's (Megatron-Core's send-forward-backward-receive-forward-backward): with chunks spread
    // along the model a rank sends to both neighbours, and one message at a time criss-crosses.
    if (v > 1) {
      out.push_back({forward(warmup + k), backward(k)});
    } else {
      out.push_back({forward(warmup + k)});
      out.push_back({backward(k)});
    }
  }
  for (int k = total - warmup; k < total; ++k) out.push_back({backward(k)});
  return out;
}

// The messages a computation needs before it runs, and those it produces, across ranks (a
// neighbouring stage on the same rank hands over in memory).
void messages_of(const Compute& c, const PipelineShape& s, int rank, std::vector<Message>& needs,
                 std::vector<Message>& produces) {
  const int last = s.stages() - 1;
  if (c.kind == kW) return;  // stays on its rank
  if (c.kind == kF) {
    if (c.stage > 0 && s.rank_of_stage(c.stage - 1) != rank)
      needs.push_back({Carries::Activation, c.micro_batch, c.stage - 1, c.stage});
    if (c.stage < last && s.rank_of_stage(c.stage + 1) != rank)
      produces.push_back({Carries::Activation, c.micro_batch, c.stage, c.stage + 1});
  } else {
    if (c.stage < last && s.rank_of_stage(c.stage + 1) != rank)
      needs.push_back({Carries::Gradient, c.micro_batch, c.stage + 1, c.stage});
    if (c.stage > 0 && s.rank_of_stage(c.stage - 1) != rank)
      produces.push_back({Carries::Gradient, c.micro_batch, c.stage, c.stage - 1});
  }
}

std::string message_text(const Message& m) {
  return std::string(m.carries == Carries::Activation ? "A" : "G") + std::to_string(m.micro_batch) + " s" +
         std::to_string(m.from_stage) + ">s" + std::to_string(m.to_stage);
}

}  // namespace

Schedule parse_schedule(const std::string& name) {
  if (name == "gpipe") return Schedule::GPipe;
  if (name == "1f1b") return Schedule::OneFOneB;
  if (name == "interleaved") return Schedule::Interleaved1F1B;
  if (name == "zero-bubble") return Schedule::ZeroBubbleH1;
  throw InvalidArgumentError(ErrorContext("pipeline schedule")(
      "schedule must be 'gpipe', '1f1b', 'interleaved' or 'zero-bubble'; found '" + name + "'"));
}

const char* schedule_name(Schedule schedule) {
  switch (schedule) {
    case Schedule::GPipe: return "GPipe";
    case Schedule::OneFOneB: return "1F1B";
    case Schedule::Interleaved1F1B: return "Interleaved1F1B";
    case Schedule::ZeroBubbleH1: return "ZB-H1";
  }
  return "?";
}

std::string Action::describe() const {
  if (kind != Kind::Communicate)
    return std::string(kind == Kind::Forward ? "F" : kind == Kind::Backward ? "B" : "W") + std::to_string(micro_batch) +
           "@s" + std::to_string(stage);
  std::string text;
  for (const auto& m : sends) text += (text.empty() ? "send " : ", send ") + message_text(m);
  for (const auto& m : receives) text += (text.empty() ? "recv " : ", recv ") + message_text(m);
  return text;
}

PipelinePlan make_schedule(Schedule schedule, PipelineShape shape) {
  check_shape(schedule, shape);
  PipelinePlan plan{schedule, shape, std::vector<std::vector<Action>>(static_cast<size_t>(shape.ranks))};
  for (int rank = 0; rank < shape.ranks; ++rank) {
    auto& actions = plan.actions[static_cast<size_t>(rank)];
    // What the previous computation produced goes out together with what the next one needs:
    // Megatron-Core's send-forward-receive-backward pairing, which keeps two neighbours that send
    // to each other at once from waiting on each other.
    std::vector<Message> pending;
    for (const auto& unit : computations(schedule, shape, rank)) {
      std::vector<Message> needs, produces;
      for (const Compute& c : unit) messages_of(c, shape, rank, needs, produces);
      // A unit's second computation may need what its first produces on this rank: not a message.
      if (!pending.empty() || !needs.empty())
        actions.push_back({Action::Kind::Communicate, 0, 0, std::move(pending), std::move(needs)});
      for (const Compute& c : unit)
        actions.push_back({c.kind, c.micro_batch, c.stage, {}, {}});
      pending = std::move(produces);
    }
    if (!pending.empty()) actions.push_back({Action::Kind::Communicate, 0, 0, std::move(pending), {}});
  }
  return plan;
}

}  // namespace loom::pp
