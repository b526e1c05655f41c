// Pipeline parallelism over real ranks: every schedule's step against one process running the
// whole model over the same micro-batches (gradient accumulation), to 1e-6 in fp32; random plans
// (schedule, micro-batches, virtual stages) proven and run; a stage that raises, and a stage whose
// output changes shape, named in the error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <thread>

#include "loom/amp/grad_scaler.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/grad_clip.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/checkpoint.h"
#include "test_util.h"

using namespace loom;
using loom::pp::Schedule;

namespace {

constexpr int kHidden = 6;

// A stack of blocks, identical on every rank (same seed): the reference runs all of it, each
// pipeline stage only its layers.
struct Stack {
  explicit Stack(int layers, uint64_t seed) {
    torch::manual_seed(seed);
    for (int i = 0; i < layers; ++i) blocks.push_back(torch::nn::Linear(kHidden, kHidden));
  }
  at::Tensor run(const at::Tensor& x, int first, int end) {
    at::Tensor h = x;
    for (int i = first; i < end; ++i)
      h = at::tanh(deferrable ? pp::linear(h, blocks[i]->weight, blocks[i]->bias) : blocks[i]->forward(h)) + h;
    return h;
  }
  std::vector<torch::nn::Linear> blocks;
  bool deferrable = false;  // loom::pp::linear: a zero-bubble plan computes the weight gradients apart
};

struct Data {
  std::vector<at::Tensor> inputs, targets;
};

Data make_data(int micro_batches, int rows, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  Data d;
  for (int m = 0; m < micro_batches; ++m) {
    d.inputs.push_back(at::randn({rows, kHidden}, g));
    d.targets.push_back(at::randn({rows, kHidden}, g));
  }
  return d;
}

struct Case {
  Schedule schedule;
  int micro_batches;
  int virtual_stages;
  int layers;
  bool deferrable = true;  // the stages' layers are loom::pp::linear (matters to zero-bubble plans)
};

std::string describe(const Case& c) {
  return std::string(pp::schedule_name(c.schedule)) + " M=" + std::to_string(c.micro_batches) +
         " V=" + std::to_string(c.virtual_stages) + " L=" + std::to_string(c.layers) +
         (c.deferrable ? " pp::linear" : " nn::Linear");
}

// Runs one step of `c` over the world as one pipeline and checks the losses (last stage) and the
// gradients of every layer this rank holds against the whole model in one process.
void expect_equal_to_one_process(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  auto world = test::world();
  const int ranks = world->size(), me = world->rank();
  const int stages = ranks * c.virtual_stages;
  Stack reference(c.layers, seed), staged(c.layers, seed);
  staged.deferrable = c.deferrable;
  const Data data = make_data(c.micro_batches, 3, seed + 1);
  auto loss_of = [&](const at::Tensor& out, int m) {
    return at::mse_loss(out, data.targets[m]) / static_cast<double>(c.micro_batches);
  };
  std::vector<double> expected_losses;
  for (int m = 0; m < c.micro_batches; ++m) {
    at::Tensor loss = loss_of(reference.run(data.inputs[m], 0, c.layers), m);
    loss.backward();
    expected_losses.push_back(loss.item<double>());
  }

  std::vector<pp::StageFunction> chunks;
  std::vector<std::pair<int, int>> mine;
  for (int v = 0; v < c.virtual_stages; ++v) {
    const auto range = pp::stage_layers(c.layers, stages, v * ranks + me);
    mine.push_back(range);
    chunks.push_back([&staged, range](const at::Tensor& x) { return staged.run(x, range.first, range.second); });
  }
  pp::PipelineExecutor pipeline(world, chunks, {.schedule = c.schedule, .micro_batches = c.micro_batches});
  const auto losses = pipeline.step(pipeline.holds_first_stage() ? data.inputs : std::vector<at::Tensor>{}, loss_of);
  if (pipeline.holds_last_stage()) {
    ASSERT_EQ(static_cast<int>(losses.size()), c.micro_batches);
    for (int m = 0; m < c.micro_batches; ++m) EXPECT_NEAR(losses[m].item<double>(), expected_losses[m], 1e-6) << m;
  }
  for (const auto& [first, end] : mine)
    for (int i = first; i < end; ++i) {
      ASSERT_TRUE(staged.blocks[i]->weight.grad().defined()) << "layer " << i;
      EXPECT_TRUE(at::allclose(staged.blocks[i]->weight.grad(), reference.blocks[i]->weight.grad(), 0, 1e-6))
          << "layer " << i;
      EXPECT_TRUE(at::allclose(staged.blocks[i]->bias.grad(), reference.blocks[i]->bias.grad(), 0, 1e-6))
          << "layer " << i;
    }
  // Layers of other stages were not touched here.
  for (int i = 0; i < c.layers; ++i) {
    bool held = false;
    for (const auto& [first, end] : mine) held = held || (i >= first && i < end);
    if (!held) EXPECT_FALSE(staged.blocks[i]->weight.grad().defined()) << "layer " << i;
  }
}

}  // namespace

TEST(Pipeline, EverySchedulesStepEqualsOneProcessOverTheSameMicroBatches) {
  const int ranks = test::world()->size();
  std::vector<Case> cases = {
      {Schedule::GPipe, 4, 1, 2 * ranks},
      {Schedule::OneFOneB, 4, 1, 2 * ranks + 1},
      {Schedule::OneFOneB, 8, 1, ranks},
      {Schedule::GPipe, 1, 1, ranks},      // fewer micro-batches than stages
      {Schedule::OneFOneB, 1, 1, ranks},
      {Schedule::Interleaved1F1B, 2 * ranks, 2, 2 * ranks},
      {Schedule::Interleaved1F1B, ranks, 3, 3 * ranks + 2},
      {Schedule::ZeroBubbleH1, 8, 1, 2 * ranks},
      {Schedule::ZeroBubbleH1, 3, 1, ranks + 1, /*deferrable=*/false},
      {Schedule::ZeroBubbleH1, 1, 1, ranks},
  };
  if (ranks > 1) cases.push_back({Schedule::OneFOneB, ranks - 1, 1, ranks});
  uint64_t seed = 11;
  for (const Case& c : cases) expect_equal_to_one_process(c, seed++);
}

// Random plans: each is proven (by the executor's constructor) and run, and equals one process.
TEST(Pipeline, RandomPlansAreProvenAndRunEqualToOneProcess) {
  const int ranks = test::world()->size();
  std::mt19937 rng(2026);
  const int plans = 100;
  for (int k = 0; k < plans; ++k) {
    Case c{};
    const int kind = static_cast<int>(rng() % 4);
    c.schedule = kind == 0   ? Schedule::GPipe
                 : kind == 1 ? Schedule::OneFOneB
                 : kind == 2 ? Schedule::Interleaved1F1B
                             : Schedule::ZeroBubbleH1;
    c.deferrable = rng() % 4 != 0;
    c.virtual_stages = c.schedule == Schedule::Interleaved1F1B ? 2 + static_cast<int>(rng() % 2) : 1;
    c.micro_batches = c.schedule == Schedule::Interleaved1F1B ? ranks * (1 + static_cast<int>(rng() % 3))
                                                              : 1 + static_cast<int>(rng() % (2 * ranks + 2));
    c.layers = ranks * c.virtual_stages + static_cast<int>(rng() % 3);
    expect_equal_to_one_process(c, 100 + k);
    if (HasFailure()) break;
  }
}

// PP 2 x DP 2 on one layout (4 ranks): each replica pipelines its half of the global batch, each
// stage's GradientReducer averages over the stage's DP group, its reduction enabled only for the
// stage's last backward of the step; the gradients equal one process over the whole global batch.
TEST(Pipeline, PipelinesTimesDataParallelReplicasEqualOneProcessOverTheGlobalBatch) {
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  ParallelConfig config;
  config.pipeline_parallel = 2;
  ParallelState ps(world, config);
  ASSERT_EQ(ps.layout().to_string(), "dp=2,pp=2,tp=1");
  const int micro_batches = 3, layers = 5;
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB}) {
    SCOPED_TRACE(pp::schedule_name(schedule));
    Stack reference(layers, 21), staged(layers, 21);
    const Data global = make_data(2 * micro_batches, 3, 22);  // replica d takes micro-batches d*M .. d*M+M-1
    for (int m = 0; m < 2 * micro_batches; ++m)
      (at::mse_loss(reference.run(global.inputs[m], 0, layers), global.targets[m]) / (2.0 * micro_batches)).backward();
    const auto [first, end] = pp::stage_layers(layers, 2, ps.pp_rank());
    std::vector<at::Tensor> parameters;
    for (int i = first; i < end; ++i)
      for (const auto& p : staged.blocks[i]->parameters()) parameters.push_back(p);
    GradientReducer reducer(parameters, ps.dp_group());
    const int offset = ps.dp_rank() * micro_batches;
    std::vector<at::Tensor> inputs(global.inputs.begin() + offset, global.inputs.begin() + offset + micro_batches);
    std::vector<bool> sync_seen;
    pp::PipelineExecutor pipeline(
        ps.pp_group(), {[&, first = first, end = end](const at::Tensor& x) { return staged.run(x, first, end); }},
        {.schedule = schedule,
         .micro_batches = micro_batches,
         .before_backward = [&](int, int, bool last) {
           reducer.set_sync(last);
           sync_seen.push_back(last);
         }});
    pipeline.step(inputs, [&](const at::Tensor& out, int m) {
      return at::mse_loss(out, global.targets[offset + m]) / static_cast<double>(micro_batches);
    });
    reducer.synchronize();
    EXPECT_EQ(sync_seen, (std::vector<bool>{false, false, true}));
    for (int i = first; i < end; ++i) {
      EXPECT_TRUE(at::allclose(staged.blocks[i]->weight.grad(), reference.blocks[i]->weight.grad(), 0, 1e-6)) << i;
      EXPECT_TRUE(at::allclose(staged.blocks[i]->bias.grad(), reference.blocks[i]->bias.grad(), 0, 1e-6)) << i;
    }
  }
}

// A pipeline stage as a module: the blocks [first, end) of the whole stack, registered under their
// global names ("block3"), so that checkpoints name every parameter the same at any pipeline size.
struct StageModel : torch::nn::Module {
  StageModel(int layers, int first, int end, uint64_t seed) {
    Stack whole(layers, seed);
    for (int i = first; i < end; ++i) blocks.push_back(register_module("block" + std::to_string(i), whole.blocks[i]));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : blocks) h = at::tanh(b->forward(h)) + h;
    return h;
  }
  std::vector<torch::nn::Linear> blocks;
};

// One training step of a replica at `pipeline_parallel` stages over the global micro-batches
// (replica d takes its consecutive share), gradients averaged over the replicas, SGD with momentum.
struct PipelinedRun {
  PipelinedRun(int pipeline_parallel, int layers, uint64_t seed) {
    ParallelConfig config;
    config.pipeline_parallel = pipeline_parallel;
    ps = std::make_unique<ParallelState>(test::world(), config);
    const auto range = pp::stage_layers(layers, pipeline_parallel, ps->pp_rank());
    model = std::make_shared<StageModel>(layers, range.first, range.second, seed);
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    reducer = std::make_unique<GradientReducer>(model->parameters(), ps->dp_group());
  }
  void step(const Data& global) {
    const int replicas = ps->dp_degree(), share = static_cast<int>(global.inputs.size()) / replicas;
    const int offset = ps->dp_rank() * share;
    std::vector<at::Tensor> inputs(global.inputs.begin() + offset, global.inputs.begin() + offset + share);
    pp::PipelineExecutor pipeline(ps->pp_group(), {[this](const at::Tensor& x) { return model->forward(x); }},
                                  {.schedule = Schedule::OneFOneB,
                                   .micro_batches = share,
                                   .before_backward = [this](int, int, bool last) { reducer->set_sync(last); }});
    optimizer->zero_grad();
    pipeline.step(pipeline.holds_first_stage() ? inputs : std::vector<at::Tensor>{}, [&](const at::Tensor& out, int m) {
      return at::mse_loss(out, global.targets[offset + m]) / static_cast<double>(share);
    });
    reducer->synchronize();
    optimizer->step();
  }
  void attach(Checkpointer& c) { c.model(*model).optimizer(*optimizer).parallel_layout(ps->layout(), ps->groups().position); }
  std::unique_ptr<ParallelState> ps;
  std::shared_ptr<StageModel> model;
  std::unique_ptr<torch::optim::SGD> optimizer;
  std::unique_ptr<GradientReducer> reducer;
};

// Saved at PP 2 x DP 2 after one step, loaded at PP 1 (DP 4) and at PP 4 (DP 1): the next step over
// the same global batch gives the parameters the uninterrupted PP 2 run has (momentum included).
TEST(Pipeline, ACheckpointSavedAtTwoStagesResumesAtOneAndAtFour) {
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int layers = 8;
  const Data first = make_data(4, 3, 41), second = make_data(4, 3, 42);
  const std::string dir = test::shared_dir("pipeline_resume");
  PipelinedRun uninterrupted(2, layers, 40);
  uninterrupted.step(first);
  {
    Checkpointer c(world, {.directory = dir, .async = false});
    uninterrupted.attach(c);
    c.save({.step = 1});
  }
  uninterrupted.step(second);
  // Every parameter of the uninterrupted run, gathered by name on every rank (each name from the
  // replica-0 stage that holds it).
  std::map<std::string, at::Tensor> expected;
  for (int i = 0; i < layers; ++i)
    for (const char* kind : {"weight", "bias"}) {
      const std::string name = "block" + std::to_string(i) + "." + kind;
      at::Tensor value = at::zeros(std::string(kind) == "weight" ? std::vector<int64_t>{kHidden, kHidden}
                                                                 : std::vector<int64_t>{kHidden});
      for (const auto& p : uninterrupted.model->named_parameters())
        if (p.key() == name && uninterrupted.ps->dp_rank() == 0) value.copy_(p.value().detach());
      world->all_reduce(value)->wait();  // one holder per name among replica 0's stages
      expected[name] = value;
    }
  for (int stages : {1, 4}) {
    SCOPED_TRACE("resumed at PP " + std::to_string(stages));
    PipelinedRun resumed(stages, layers, /*another seed: the checkpoint must replace it*/ 99);
    {
      Checkpointer c(world, {.directory = dir, .async = false});
      resumed.attach(c);
      c.load(dir + "/step_000001");
    }
    resumed.step(second);
    for (const auto& p : resumed.model->named_parameters())
      EXPECT_TRUE(at::allclose(p.value(), expected.at(p.key()), 1e-5, 1e-6)) << p.key();
  }
  world->barrier()->wait();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

// Each stage loads the part of the model it holds; together they must hold all of it. A pipeline
// of 6 blocks loading a checkpoint of 8 (every name it has is there, at its shape) is refused on
// every rank, naming the blocks no stage holds, and changes nothing.
TEST(Pipeline, ALoadWhoseStagesTogetherLeaveSavedTensorsUnheldIsRefused) {
  auto world = test::world();
  if (world->size() != 2 && world->size() != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  const std::string dir = test::shared_dir("pipeline_unheld");
  {
    PipelinedRun saved(2, 8, 50);
    Checkpointer c(world, {.directory = dir, .async = false});
    c.model(*saved.model).parallel_layout(saved.ps->layout(), saved.ps->groups().position);
    c.save({.step = 1});
  }
  PipelinedRun shorter(2, 6, 51);
  std::vector<at::Tensor> before;
  for (const auto& p : shorter.model->parameters()) before.push_back(p.detach().clone());
  Checkpointer c(world, {.directory = dir, .async = false});
  c.model(*shorter.model).parallel_layout(shorter.ps->layout(), shorter.ps->groups().position);
  try {
    c.load(dir + "/step_000001");
    ADD_FAILURE() << "loaded, expected a refusal";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank " + std::to_string(world->rank())), std::string::npos) << what;
    EXPECT_NE(what.find("nothing was changed"), std::string::npos) << what;
    EXPECT_NE(what.find("no pipeline stage holds"), std::string::npos) << what;
    for (const char* name : {"model/block6.weight", "model/block6.bias", "model/block7.weight", "model/block7.bias"})
      EXPECT_NE(what.find(name), std::string::npos) << name << " not named in: " << what;
    EXPECT_EQ(what.find("model/block5."), std::string::npos) << what;
  }
  const auto after = shorter.model->parameters();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i])) << "parameter " << i;
  world->barrier()->wait();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

// PP 2 x TP 2 on one layout (4 ranks): each stage's MLP blocks are column- and row-parallel over the
// stage's TP group (master-weight initialisation: the plain layers from the same seeds); every TP
// rank of a stage runs the pipeline with its peers at the other stage. Every shard's gradient
// equals the plain model's in one process, for GPipe and 1F1B.
TEST(Pipeline, TensorParallelStagesEqualThePlainModelInOneProcess) {
  auto world = test::world();
  if (world->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  ParallelConfig config;
  config.tensor_parallel = 2;
  config.pipeline_parallel = 2;
  ParallelState ps(world, config);
  ASSERT_EQ(ps.layout().to_string(), "dp=1,pp=2,tp=2");
  const int64_t h = 6, f = 8;
  const int layers = 4, micro_batches = 4;
  ParallelInit master;
  master.mode = ParallelInit::Mode::Master;
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB}) {
    SCOPED_TRACE(pp::schedule_name(schedule));
    std::vector<torch::nn::Linear> fc1, fc2;
    for (int i = 0; i < layers; ++i) {
      torch::manual_seed(300 + i);
      fc1.push_back(torch::nn::Linear(h, f));
      fc2.push_back(torch::nn::Linear(f, h));
    }
    auto plain_block = [&](const at::Tensor& x, int i) { return x + fc2[i]->forward(at::gelu(fc1[i]->forward(x))); };
    const Data data = make_data(micro_batches, 3, 310);
    std::vector<at::Tensor> targets;
    for (int m = 0; m < micro_batches; ++m) {
      at::Tensor x = data.inputs[m].narrow(1, 0, h);  // [3, h]
      targets.push_back(data.targets[m].narrow(1, 0, h));
      for (int i = 0; i < layers; ++i) x = plain_block(x, i);
      (at::mse_loss(x, targets[m]) / static_cast<double>(micro_batches)).backward();
    }
    const auto [first, end] = pp::stage_layers(layers, 2, ps.pp_rank());
    std::map<int, std::pair<ColumnParallelLinear, RowParallelLinear>> mine;
    for (int i = first; i < end; ++i) {
      torch::manual_seed(300 + i);
      ColumnParallelLinearOptions column;
      column.initialization = master;
      RowParallelLinearOptions row;
      row.initialization = master;
      ColumnParallelLinear up(h, f, ps.tp_group(), column);  // drawn in the plain layers' order
      RowParallelLinear down(f, h, ps.tp_group(), row);
      mine.emplace(i, std::make_pair(up, down));
    }
    auto stage = [&, first = first, end = end](const at::Tensor& x) {
      at::Tensor y = x;
      for (int i = first; i < end; ++i) y = y + mine.at(i).second(at::gelu(mine.at(i).first(y)));
      return y;
    };
    std::vector<at::Tensor> inputs;
    for (const auto& x : data.inputs) inputs.push_back(x.narrow(1, 0, h).contiguous());
    pp::PipelineExecutor pipeline(ps.pp_group(), {stage}, {.schedule = schedule, .micro_batches = micro_batches});
    pipeline.step(pipeline.holds_first_stage() ? inputs : std::vector<at::Tensor>{}, [&](const at::Tensor& out, int m) {
      return at::mse_loss(out, targets[m]) / static_cast<double>(micro_batches);
    });
    const int64_t n = f / 2, c0 = ps.tp_rank() * n;
    auto expect_plain_gradients = [&] {
      for (int i = first; i < end; ++i) {
        const auto& [column, row] = mine.at(i);
        EXPECT_TRUE(at::allclose(column->weight.grad(), fc1[i]->weight.grad().narrow(0, c0, n), 0, 1e-6)) << i;
        EXPECT_TRUE(at::allclose(column->bias.grad(), fc1[i]->bias.grad().narrow(0, c0, n), 0, 1e-6)) << i;
        EXPECT_TRUE(at::allclose(row->weight.grad(), fc2[i]->weight.grad().narrow(1, c0, n), 0, 1e-6)) << i;
        EXPECT_TRUE(at::allclose(row->bias.grad(), fc2[i]->bias.grad(), 0, 1e-6)) << i;
      }
    };
    expect_plain_gradients();
    // Clipping by the global norm: summed over both stages and both TP slices, the row-parallel
    // bias (replicated over TP) counted once; equal to torch's clip_grad_norm_ on the plain model.
    std::vector<at::Tensor> plain;
    for (int i = 0; i < layers; ++i)
      for (const auto& p : {fc1[i]->weight, fc1[i]->bias, fc2[i]->weight, fc2[i]->bias}) plain.push_back(p);
    double plain_norm = 0;
    for (const auto& p : plain) plain_norm += p.grad().pow(2).sum().item<double>();
    plain_norm = std::sqrt(plain_norm);
    const double max_norm = plain_norm / 3;  // clips
    EXPECT_NEAR(torch::nn::utils::clip_grad_norm_(plain, max_norm), plain_norm, 1e-6);
    torch::nn::Module part;
    for (auto& [i, layer] : mine) {
      part.register_module("up" + std::to_string(i), layer.first.ptr());
      part.register_module("down" + std::to_string(i), layer.second.ptr());
    }
    EXPECT_NEAR(clip_grad_norm(part, max_norm, ps.tp_group(), ps.pp_group()), plain_norm, 1e-6);
    expect_plain_gradients();
  }
}

// Forward only (evaluation, generation): inputs of shapes no step has seen, one of them of another
// rank, go through every stage (virtual stages too) and come out of the last stage equal to one
// process's forward of the whole stack, without autograd.
TEST(Pipeline, ForwardOnlyEqualsOneProcessForInputsOfAnyShape) {
  auto world = test::world();
  const int ranks = world->size(), me = world->rank();
  for (int v : {1, 2}) {
    if (v > 1 && ranks == 1) continue;
    SCOPED_TRACE("virtual stages " + std::to_string(v));
    const int stages = ranks * v, layers = stages + 1;
    Stack reference(layers, 61), staged(layers, 61);
    std::vector<pp::StageFunction> chunks;
    for (int c = 0; c < v; ++c) {
      const std::pair<int, int> span = pp::stage_layers(layers, stages, c * ranks + me);
      chunks.push_back([&staged, span](const at::Tensor& x) { return staged.run(x, span.first, span.second); });
    }
    pp::PipelineExecutor pipeline(
        world, chunks, {.schedule = v > 1 ? Schedule::Interleaved1F1B : Schedule::OneFOneB, .micro_batches = ranks});
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(62);
    const std::vector<at::Tensor> inputs = {at::randn({1, kHidden}, g), at::randn({5, 3, kHidden}, g),
                                            at::randn({7, kHidden}, g)};
    const std::vector<at::Tensor> outputs = pipeline.forward_only(me == 0 ? inputs : std::vector<at::Tensor>{});
    if (!pipeline.holds_last_stage()) {
      EXPECT_TRUE(outputs.empty());
      continue;
    }
    ASSERT_EQ(outputs.size(), inputs.size());
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_EQ(outputs[i].sizes(), inputs[i].sizes()) << "input " << i;
      EXPECT_TRUE(at::allclose(outputs[i], reference.run(inputs[i], 0, layers), 1e-6, 1e-6)) << "input " << i;
      EXPECT_FALSE(outputs[i].requires_grad()) << "input " << i;
    }
  }
}

// loom::GradScaler over a pipeline: the loss is scaled on the last stage only, found-inf is agreed
// over the pipeline group, so a gradient overflow that only the last stage sees makes every stage
// skip its step and back off the scale alike; a clean step then updates every stage.
TEST(Pipeline, TheScalersFoundInfIsAgreedOverEveryStage) {
  auto world = test::world();
  const int ranks = world->size(), me = world->rank();
  if (ranks < 2) GTEST_SKIP() << "needs 2 ranks";
  Stack staged(ranks, 51);
  torch::optim::SGD optimizer(staged.blocks[me]->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler({.init_scale = 1024.0, .sync_groups = {world}});
  const Data data = make_data(2, 3, 52);
  pp::PipelineExecutor pipeline(world, {[&](const at::Tensor& x) { return staged.run(x, me, me + 1); }},
                                {.schedule = Schedule::OneFOneB, .micro_batches = 2});
  if (!pipeline.holds_last_stage()) scaler.scaled_by_another_rank(at::kCPU);
  for (bool overflow : {true, false}) {
    SCOPED_TRACE(overflow ? "overflowing step" : "clean step");
    const at::Tensor before = staged.blocks[me]->weight.detach().clone();
    optimizer.zero_grad();
    pipeline.step(pipeline.holds_first_stage() ? data.inputs : std::vector<at::Tensor>{},
                  [&](const at::Tensor& out, int m) { return scaler.scale(at::mse_loss(out, data.targets[m]) / 2.0); });
    // An overflow in the last stage's own gradients only: the earlier stages' gradients are finite.
    if (overflow && pipeline.holds_last_stage())
      staged.blocks[me]->weight.mutable_grad()[0][0].fill_(std::numeric_limits<float>::infinity());
    const bool stepped = scaler.step(optimizer);
    scaler.update();
    EXPECT_EQ(stepped, !overflow);
    EXPECT_EQ(at::equal(before, staged.blocks[me]->weight.detach()), overflow);
    EXPECT_EQ(scaler.get_scale(), 512.0);  // backed off once, then a clean step keeps it
  }
}

TEST(Pipeline, BoundaryShapesAreAgreedOnTheFirstMicroBatchAndKeptAcrossSteps) {
  auto world = test::world();
  const int ranks = world->size();
  if (ranks < 2) GTEST_SKIP() << "needs 2 ranks";
  Stack staged(ranks, 5);
  const int me = world->rank();
  pp::PipelineExecutor pipeline(world, {[&](const at::Tensor& x) { return staged.run(x, me, me + 1); }},
                                {.schedule = Schedule::OneFOneB, .micro_batches = 2});
  const Data data = make_data(2, 3, 6);
  auto loss = [&](const at::Tensor& out, int m) { return at::mse_loss(out, data.targets[m]); };
  pipeline.step(pipeline.holds_first_stage() ? data.inputs : std::vector<at::Tensor>{}, loss);
  for (int s = 0; s + 1 < ranks; ++s) {
    auto boundary = pipeline.boundary(s);
    ASSERT_TRUE(boundary.has_value()) << s;
    EXPECT_EQ(boundary->first, (std::vector<int64_t>{3, kHidden}));
    EXPECT_EQ(boundary->second, at::kFloat);
  }
  pipeline.step(pipeline.holds_first_stage() ? data.inputs : std::vector<at::Tensor>{}, loss);  // a second step
  // The step's timeline: every action of this rank's plan once, in order, within the step, and the
  // computing ones adding up to its compute time.
  const auto& times = pipeline.last_step();
  const auto& plan = pipeline.plan().actions[me];
  ASSERT_EQ(times.actions.size(), plan.size());
  double computed = 0, previous_end = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const auto& t = times.actions[i];
    EXPECT_EQ(t.action, static_cast<int>(i));
    EXPECT_GE(t.start, previous_end);
    EXPECT_GE(t.end, t.start);
    previous_end = t.end;
    if (plan[i].kind != pp::Action::Kind::Communicate) computed += t.end - t.start;
  }
  EXPECT_LE(previous_end, times.seconds);
  EXPECT_NEAR(computed, times.compute, 1e-9);
}

// On the host a stage does not wait for its neighbour to receive what it sent: the first stage's
// GPipe forwards run back to back while every later stage is slow (300 ms a forward), its
// activations (256 KB each, past MPI's eager size, so a send completes only once received) waited
// for at the end of the step. Waited for in their message group, the first stage's third forward
// would start only after the second stage's second one (2 x 300 ms later).
TEST(Pipeline, HostSendsDoNotWaitForTheReceivingStage) {
  auto world = test::world();
  const int ranks = world->size(), me = world->rank();
  if (ranks < 2) GTEST_SKIP() << "needs 2 ranks";
  constexpr auto kSlowForward = std::chrono::milliseconds(300);
  constexpr int kMicroBatches = 4;
  at::Tensor scale = at::full({256}, 0.5).requires_grad_(true);
  std::vector<std::chrono::steady_clock::time_point> forwards_done;
  pp::PipelineExecutor pipeline(world, {[&](const at::Tensor& x) {
                                  if (me != 0) std::this_thread::sleep_for(kSlowForward);
                                  at::Tensor y = x * scale;
                                  forwards_done.push_back(std::chrono::steady_clock::now());
                                  return y;
                                }},
                                {.schedule = Schedule::GPipe, .micro_batches = kMicroBatches});
  std::vector<at::Tensor> inputs(kMicroBatches, at::ones({256, 256}));
  auto loss = [](const at::Tensor& out, int) { return out.mean(); };
  pipeline.step(pipeline.holds_first_stage() ? inputs : std::vector<at::Tensor>{}, loss);  // agrees on boundaries
  forwards_done.clear();
  pipeline.step(pipeline.holds_first_stage() ? inputs : std::vector<at::Tensor>{}, loss);
  ASSERT_EQ(forwards_done.size(), static_cast<size_t>(kMicroBatches));
  if (me == 0) {
    const auto span = forwards_done.back() - forwards_done.front();
    EXPECT_LT(span, kSlowForward) << "the first stage's forwards took "
                                  << std::chrono::duration<double>(span).count() << " s: its sends waited for stage 1";
  }
  // Every message was delivered: stage 0's gradient is the one-process gradient of the mean over
  // the stages' products (each stage scales by 0.5; the loss is mean() per micro-batch).
  if (me == 0) {
    // d/dscale[j] of sum_m mean(x * 0.5^p) over [256, 256] ones: 256 rows / 65536 elements, times
    // the other stages' 0.5s, per micro-batch.
    const double expected = kMicroBatches * std::pow(0.5, ranks - 1) / 256.0;
    EXPECT_NEAR(scale.grad()[0].item<double>(), 2 * expected, 1e-4);  // two steps accumulate
  }
}

// A stage that raises: its rank's error names the stage, the micro-batch and the direction.
TEST(Pipeline, AStageThatRaisesIsNamed) {
  auto world = test::world();
  const int ranks = world->size(), me = world->rank();
  // A pipeline of this rank alone, so no peer waits on the failing stage.
  auto alone = world->split(me, 0, "alone" + std::to_string(me));
  Stack staged(2, 5);
  pp::PipelineExecutor pipeline(alone, {[&](const at::Tensor& x) -> at::Tensor {
                                  if (x.size(0) == 7) throw std::runtime_error("bad block");
                                  return staged.run(x, 0, 2);
                                }},
                                {.schedule = Schedule::GPipe, .micro_batches = 2});
  try {
    pipeline.step({at::zeros({3, kHidden}), at::zeros({7, kHidden})},
                  [](const at::Tensor& out, int) { return out.sum(); });
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stage 0 failed in forward of micro-batch 1: bad block"), std::string::npos)
        << e.what();
  }
  (void)ranks;
}

// The first stage's output changes shape on micro-batch 1: the sender refuses it by name before
// sending (its peers' waits end through the communicator's timeout; this test gives the pipeline
// its own short-lived group so the world stays usable).
TEST(Pipeline, AShapeChangeBetweenMicroBatchesIsRefusedByName) {
  auto world = test::world();
  const int ranks = world->size(), me = world->rank();
  if (ranks < 2) GTEST_SKIP() << "needs 2 ranks";
  auto group = world->split(0, me, "pp_shape", {.group_timeout = std::chrono::milliseconds(1500)});
  Stack staged(ranks, 5);
  pp::PipelineExecutor pipeline(group, {[&](const at::Tensor& x) { return staged.run(x, me, me + 1); }},
                                {.schedule = Schedule::GPipe, .micro_batches = 2});
  std::string message;
  try {
    pipeline.step(me == 0 ? std::vector<at::Tensor>{at::zeros({3, kHidden}), at::zeros({4, kHidden})}
                          : std::vector<at::Tensor>{},
                  [](const at::Tensor& out, int) { return out.sum(); });
  } catch (const Error& e) {
    message = e.what();
  }
  if (me == 0) {
    EXPECT_NE(message.find("stage 0 produced Float [4, 6] for micro-batch 1; the boundary to stage 1 was agreed at "
                           "Float [3, 6] on micro-batch 0"),
              std::string::npos)
        << message;
  } else {
    EXPECT_FALSE(message.empty()) << "a stage waiting for what was never sent must not wait forever";
  }
}

// Ranks built with different micro-batch counts are refused by name at construction, on every
// rank, before any message: no rank waits for a plan its peers do not run.
TEST(Pipeline, RanksBuiltWithDifferentPlansAreRefusedByName) {
  auto world = test::world();
  const int ranks = world->size(), me = world->rank();
  if (ranks < 2) GTEST_SKIP() << "needs 2 ranks";
  try {
    pp::PipelineExecutor pipeline(world, {[](const at::Tensor& x) { return x; }},
                                  {.schedule = Schedule::OneFOneB, .micro_batches = me == ranks - 1 ? 3 : 4});
    FAIL() << "expected MismatchError";
  } catch (const MismatchError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline ranks were built differently: micro_batches is "), std::string::npos)
        << e.what();
  }
}

TEST(Pipeline, StageLayersCutAStackAsEvenlyAsPossible) {
  EXPECT_EQ(pp::stage_layers(10, 4, 0), (std::pair<int, int>{0, 3}));
  EXPECT_EQ(pp::stage_layers(10, 4, 1), (std::pair<int, int>{3, 6}));
  EXPECT_EQ(pp::stage_layers(10, 4, 3), (std::pair<int, int>{8, 10}));
  EXPECT_THROW(pp::stage_layers(3, 4, 0), InvalidArgumentError);
}
