// Where does a pipeline step's time go, schedule by schedule? A stack of MLP blocks (hidden ->
// 4 hidden -> hidden, residual; its linears are loom::pp::linear, whose weight gradients a
// zero-bubble plan computes apart) cut into stages over every rank of the job runs GPipe, 1F1B,
// interleaved 1F1B (2 virtual stages) and ZB-H1 for M micro-batches; the schedules take turns step
// by step in the same processes. Reported per schedule (medians over the steps; a sample is the slowest
// rank's): step time, the bubble each rank measured (1 - compute / step time, averaged over ranks)
// beside the bubble the schedule promises (loom::pp::prove: a forward costs 1, a backward 2), and
// the activation memory each rank held at its peak, counted from live storage: the heap in use
// (glibc's count of allocated bytes, where every tensor of this rank's thread lives) above what it
// was when the step began, sampled after every forward and before every backward. Gradients stay
// allocated between steps (zero_grad without freeing), so the count is what the schedule keeps
// for backward (and for ZB-H1's deferred weight gradients) plus the messages in flight.
//
//   mpirun -np 2 build/benchmarks/pipeline_bench --micro-batches 8 --json pipeline_np2.json
#include <ATen/ATen.h>
#include <malloc.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/comm/agreement.h"
#include "loom/loom.h"
#include "loom/parallel/pipeline.h"

namespace {

using loom::pp::Schedule;

struct Config {
  int64_t hidden = 256;
  int64_t rows = 256;
  int layers_per_rank = 4;
  int micro_batches = 8;
  int warmup = 2;
  int steps = 8;
  std::string json;
};

struct Block : torch::nn::Module {
  explicit Block(int64_t h) {
    fc1 = register_module("fc1", torch::nn::Linear(h, 4 * h));
    fc2 = register_module("fc2", torch::nn::Linear(4 * h, h));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = at::gelu(loom::pp::linear(x, fc1->weight, fc1->bias));
    return x + loom::pp::linear(h, fc2->weight, fc2->bias);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// The heap in use above its level at the start of a step, at its highest.
struct ActivationMeter {
  size_t baseline = 0, peak = 0;
  static size_t heap_in_use() {
    const struct mallinfo2 m = mallinfo2();
    return m.uordblks + m.hblkhd;
  }
  void start() { baseline = heap_in_use(), peak = 0; }
  void sample() {
    const size_t now = heap_in_use();
    if (now > baseline) peak = std::max(peak, now - baseline);
  }
};

struct Result {
  std::vector<double> seconds, bubble;
  std::vector<std::vector<loom::pp::PipelineStepTimes::ActionTime>> timelines;  // this rank's, by measured step
  int64_t peak_bytes = 0;
  double promised = 0;
};

struct Run {
  Schedule schedule;
  int virtual_stages;
  std::unique_ptr<loom::pp::PipelineExecutor> executor;
  ActivationMeter meter;
  Result result;
};

// This rank's chunks of the stack for the run's schedule, each sampling the heap after its forward
// and before its backward. The run's meter is captured by address: build once every run is in place.
void build_executor(Run& run, const std::shared_ptr<loom::Communicator>& world,
                    std::vector<std::shared_ptr<Block>>& blocks, const Config& c) {
  const int ranks = world->size(), me = world->rank();
  const int layers = static_cast<int>(blocks.size()), stages = ranks * run.virtual_stages;
  std::vector<loom::pp::StageFunction> chunks;
  for (int v = 0; v < run.virtual_stages; ++v) {
    const int stage = v * ranks + me;
    const auto [first, end] = loom::pp::stage_layers(layers, stages, stage);
    ActivationMeter* meter = &run.meter;
    chunks.push_back([&blocks, first = first, end = end, meter](const at::Tensor& x) {
      at::Tensor h = x;
      for (int i = first; i < end; ++i) h = blocks[i]->forward(h);
      meter->sample();
      return h;
    });
  }
  run.executor = std::make_unique<loom::pp::PipelineExecutor>(
      world, chunks,
      loom::pp::PipelineOptions{.schedule = run.schedule,
                                .micro_batches = c.micro_batches,
                                .before_backward = [meter = &run.meter](int, int, bool) { meter->sample(); }});
}

// Every rank's actions in the measured step whose time is the median (the same step on every rank:
// the times are the gathered slowest ones): [[name, kind, start ms, end ms], ...] per rank, the
// times from each rank's step start (the ranks start together, after a barrier).
nlohmann::json median_step_timeline(const Run& run, loom::Communicator& world) {
  const auto& seconds = run.result.seconds;
  std::vector<size_t> order(seconds.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return seconds[a] < seconds[b]; });
  const auto& actions = run.executor->plan().actions[run.executor->rank()];
  nlohmann::json mine = nlohmann::json::array();
  if (!order.empty())
    for (const auto& t : run.result.timelines[order[order.size() / 2]]) {
      const auto& action = actions[t.action];
      static const char* const kKind[] = {"F", "B", "W", "C"};  // by Action::Kind
      mine.push_back({action.describe(), kKind[static_cast<int>(action.kind)], t.start * 1e3, t.end * 1e3});
    }
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& text : loom::all_gather_strings(world, mine.dump(), {"pipeline_bench timeline"}))
    ranks.push_back(nlohmann::json::parse(text));
  return ranks;
}

// The plan replayed at each measured step's own action times (every rank's) with instant messages,
// sends posted at their group's start and not waited for, as the executor does on the host
// (loom::pp::prove at those costs): the bubble this schedule leaves at those costs, by step, to set
// beside the bubble measured in the same step. What the measured bubble has above it, messages and
// the executor cost; what it has above the promise, unequal costs (stages, cores) cost.
std::vector<double> bubbles_at_measured_costs(const Run& run, loom::Communicator& world) {
  const auto& plan = run.executor->plan();
  const size_t my_actions = plan.actions[static_cast<size_t>(run.executor->rank())].size();
  nlohmann::json mine = nlohmann::json::array();  // by step, by action: seconds
  for (const auto& timeline : run.result.timelines) {
    std::vector<double> seconds(my_actions, 0.0);
    for (const auto& t : timeline) seconds.at(static_cast<size_t>(t.action)) = t.end - t.start;
    mine.push_back(seconds);
  }
  std::vector<nlohmann::json> by_rank;
  for (const auto& text : loom::all_gather_strings(world, mine.dump(), {"pipeline_bench costs"}))
    by_rank.push_back(nlohmann::json::parse(text));
  std::vector<double> bubbles;
  for (size_t step = 0; step < run.result.timelines.size(); ++step) {
    loom::pp::ReplayCosts costs{.sends_posted = true};
    for (const auto& rank : by_rank) costs.action.push_back(rank.at(step).get<std::vector<double>>());
    bubbles.push_back(loom::pp::prove(plan, costs).bubble);
  }
  return bubbles;
}

// Prints each schedule's medians (rank 0) and returns them as the JSON document.
nlohmann::json report(const std::vector<Run>& runs, const Config& c, loom::Communicator& world, int layers) {
  const int ranks = world.size(), me = world.rank();
  nlohmann::json doc = {{"ranks", ranks},       {"micro_batches", c.micro_batches}, {"hidden", c.hidden},
                        {"rows", c.rows},       {"layers", layers},                 {"steps", c.steps},
                        {"schedules", nlohmann::json::array()}};
  if (me == 0)
    std::printf("pipeline over %d ranks, %d micro-batches of [%lld, %lld], %d MLP blocks\n", ranks, c.micro_batches,
                static_cast<long long>(c.rows), static_cast<long long>(c.hidden), layers);
  const double gpipe_peak = runs.empty() ? 0 : static_cast<double>(runs[0].result.peak_bytes);
  for (auto& run : runs) {
    const double promised = run.executor->proof().bubble;
    const double seconds = loom::bench::median(run.result.seconds), bubble = loom::bench::median(run.result.bubble);
    const nlohmann::json timeline = median_step_timeline(run, world);
    const double replayed = loom::bench::median(bubbles_at_measured_costs(run, world));
    if (me == 0)
      std::printf("  %-16s step %8.2f ms   bubble %.3f (promised %.3f, off by %+.3f; at the measured costs %.3f)   "
                  "activation peak %6.1f MiB (%.2f of GPipe's)\n",
                  loom::pp::schedule_name(run.schedule), seconds * 1e3, bubble, promised, bubble - promised, replayed,
                  run.result.peak_bytes / 1048576.0, run.result.peak_bytes / gpipe_peak);
    doc["schedules"].push_back({{"schedule", loom::pp::schedule_name(run.schedule)},
                                {"virtual_stages", run.virtual_stages},
                                {"step_seconds_median", seconds},
                                {"bubble_median", bubble},
                                {"bubble_promised", promised},
                                {"activation_peak_bytes", run.result.peak_bytes},
                                {"bubble_at_measured_costs", replayed},
                                {"median_step_timeline", timeline}});
  }
  return doc;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"pipeline schedules: step time, bubble and activation memory"};
  app.add_option("--hidden", c.hidden);
  app.add_option("--rows", c.rows, "rows of one micro-batch");
  app.add_option("--layers-per-rank", c.layers_per_rank);
  app.add_option("--micro-batches", c.micro_batches);
  app.add_option("--warmup", c.warmup);
  app.add_option("--steps", c.steps);
  app.add_option("--json", c.json);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  auto rt = loom::init();
  auto world = rt->world_comm();
  const int ranks = world->size(), me = world->rank();
  const int layers = c.layers_per_rank * ranks;
  torch::manual_seed(3);
  std::vector<std::shared_ptr<Block>> blocks;
  for (int i = 0; i < layers; ++i) blocks.push_back(std::make_shared<Block>(c.hidden));
  std::vector<at::Tensor> inputs, targets;
  for (int m = 0; m < c.micro_batches; ++m) {
    inputs.push_back(at::randn({c.rows, c.hidden}));
    targets.push_back(at::randn({c.rows, c.hidden}));
  }
  std::vector<Run> runs;
  for (auto [schedule, v] : std::vector<std::pair<Schedule, int>>{
           {Schedule::GPipe, 1}, {Schedule::OneFOneB, 1}, {Schedule::Interleaved1F1B, 2}, {Schedule::ZeroBubbleH1, 1}}) {
    if (schedule == Schedule::Interleaved1F1B && c.micro_batches % ranks != 0) continue;
    runs.push_back({schedule, v, nullptr, {}, {}});
  }
  for (auto& run : runs) build_executor(run, world, blocks, c);
  auto loss = [&](const at::Tensor& out, int m) { return at::mse_loss(out, targets[m]) / c.micro_batches; };
  for (int step = 0; step < c.warmup + c.steps; ++step)
    for (auto& run : runs) {
      for (auto& b : blocks) b->zero_grad(/*set_to_none=*/false);  // allocated once, outside the count
      world->barrier()->wait();
      run.meter.start();
      run.executor->step(run.executor->holds_first_stage() ? inputs : std::vector<at::Tensor>{}, loss);
      const auto& t = run.executor->last_step();
      double words[2] = {t.seconds, t.bubble()};
      at::Tensor gathered = at::empty({2 * ranks}, at::kDouble);
      world->all_gather(gathered, at::from_blob(words, {2}, at::kDouble))->wait();
      if (step < c.warmup) continue;
      double slowest = 0, bubble = 0;
      for (int r = 0; r < ranks; ++r) {
        slowest = std::max(slowest, gathered[2 * r].item<double>());
        bubble += gathered[2 * r + 1].item<double>() / ranks;
      }
      run.result.seconds.push_back(slowest);
      run.result.bubble.push_back(bubble);
      run.result.timelines.push_back(t.actions);
      run.result.peak_bytes = std::max(run.result.peak_bytes, static_cast<int64_t>(run.meter.peak));
    }
  const nlohmann::json doc = report(runs, c, *world, layers);
  if (me == 0 && !c.json.empty() && !loom::bench::write_json(c.json, doc, "pipeline_bench")) return 1;
  runs.clear();
  rt.reset();
  loom::finalize();
  return 0;
}
