// What the C++ code blocks of README.md and docs/ may use without declaring it: the names their
// prose has introduced by then (the runtime, a model, a batch, ...), declared here so that each
// block compiles on its own. Declarations only: the blocks are compiled, not linked or run
// (tests/docs/check_doc_snippets.py). A block that declares one of these names itself shadows it.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "loom/loom.h"
#include "loom/parallel/recompute.h"
#include "loom/train/metrics.h"

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  NetImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
};
TORCH_MODULE(Net);

// The job.
extern std::shared_ptr<loom::Runtime> rt;
extern std::shared_ptr<loom::Communicator> comm, world;
extern loom::ParallelGroups groups;
// A model, its optimizer and their training helpers.
extern loom::DistributedDataParallel<Net> ddp;
extern torch::optim::Adam opt;
extern loom::GradScaler scaler;
extern loom::GradientAccumulator accumulate;
extern std::vector<at::Tensor> all_parameters;
extern std::vector<torch::nn::Linear> blocks;
extern Net mlp;
extern torch::nn::LayerNorm ln;
extern loom::ParallelTransformerBlockOptions options;
at::Tensor loss_fn(const at::Tensor& output);
at::Tensor loss_fn(const at::Tensor& output, const at::Tensor& target);
void train_one_step(int64_t step);
void overlap_with_something();
// Data.
extern at::Tensor t, partial, grad, x, y, ids, targets;
extern std::vector<at::Tensor> micro;
extern std::vector<std::pair<at::Tensor, at::Tensor>> shard_of_each_batch, batches;
extern int64_t vocab, step, steps, global_batch, tokens_this_rank;
extern uint64_t bytes;
extern double loss, dt, waited;
