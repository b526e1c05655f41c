// A small GPT-style character model trained with tensor parallelism x data parallelism.
//
// The world is split into TP groups of --tp ranks (heads, MLP and vocabulary split across them)
// and DP replicas across the groups (gradients averaged by loom::GradientReducer over the DP
// group). The text is built in: sentences generated from a small grammar, so there is structure
// to learn and nothing to download; --text FILE trains on a file instead. Every step draws one
// global batch of windows from (seed, step), the same on every rank; each DP replica takes its
// columns of it. Rank 0 prints the loss (averaged over replicas), then a greedy sample, and the
// final loss with full precision. The exit status is non-zero when the final loss is not below
// half the first one. --accumulate splits each replica's batch into micro-batches (one DP
// all-reduce per step); --scaler scales the loss with loom::GradScaler.
//
// Checkpoints (loom::Checkpointer): --checkpoint-dir DIR saves every --save-every steps and at the
// end (TP slices, replicated tensors once, in the background); --resume continues from the newest
// complete checkpoint in DIR, or starts fresh without one. Weights, AdamW state, loss scale and
// the dropout RNG streams come back bit for bit, so a resumed run continues exactly.
//
//   source scripts/mpi_env.sh
//   mpirun -np 4 $LOOM_MPIRUN_FLAGS build/examples/train_gpt_tp --tp 2 --steps 300
//   mpirun -np 4 $LOOM_MPIRUN_FLAGS build/examples/train_gpt_tp --checkpoint-dir ckpt --save-every 50 --resume
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "loom/loom.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/accumulation.h"
#include "loom/train/checkpoint.h"

namespace {

struct Options {
  int tp = 0;  // 0: 2 when the world size is even, else 1
  int64_t steps = 300;
  int64_t batch = 16;  // global, split over DP replicas
  int64_t seq = 32;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  double dropout = 0.1;
  double lr = 3e-3;
  int64_t log_every = 25;
  int64_t sample_chars = 120;
  uint64_t seed = 1234;
  std::string text_path;
  int64_t accumulate = 1;
  bool scaler = false;
  std::string checkpoint_dir;
  int64_t save_every = 0;
  bool resume = false;
  int loss_digits = 4;
};

// Sentences from a tiny grammar: "the quick cat sees a red ball. " and so on.
std::string synthetic_text(uint64_t seed, size_t chars) {
  const std::vector<std::string> det = {"the", "a", "one", "every"};
  const std::vector<std::string> adj = {"quick", "lazy", "red", "small", "happy", "old"};
  const std::vector<std::string> noun = {"cat", "dog", "bird", "child", "ball", "tree", "river"};
  const std::vector<std::string> verb = {"sees", "likes", "chases", "finds", "jumps over", "sits by"};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto pick = [&](const std::vector<std::string>& words) {
    return words[torch::randint(static_cast<int64_t>(words.size()), {1}, gen).item<int64_t>()];
  };
  std::string text;
  while (text.size() < chars)
    text += pick(det) + " " + pick(adj) + " " + pick(noun) + " " + pick(verb) + " " + pick(det) + " " + pick(noun) +
            ". ";
  return text;
}

struct GptImpl : torch::nn::Module {
  GptImpl(const Options& o, int64_t vocab, loom::TensorParallelGroup group) : hidden(o.hidden) {
    tok = register_module("tok", loom::VocabParallelEmbedding(vocab, o.hidden, group));
    pos = register_module("pos", torch::nn::Embedding(o.seq, o.hidden));
    for (int64_t l = 0; l < o.layers; ++l) {
      loom::ParallelTransformerBlockOptions b;
      b.hidden_size = o.hidden;
      b.num_heads = o.heads;
      b.attention_dropout = o.dropout;
      b.hidden_dropout = o.dropout;
      blocks.push_back(register_module("block" + std::to_string(l), loom::ParallelTransformerBlock(b, group)));
    }
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden})));
    loom::ColumnParallelLinearOptions head_options;
    head_options.bias = false;
    head = register_module("head", loom::ColumnParallelLinear(o.hidden, vocab, group, head_options));
  }
  // ids [s, b] -> this rank's slice of the logits [s, b, vocab / tp].
  torch::Tensor forward(const torch::Tensor& ids) {
    torch::Tensor x = tok(ids) + pos->weight.narrow(0, 0, ids.size(0)).unsqueeze(1);
    for (auto& block : blocks) x = block(x);
    return head(lnf(x));
  }
  int64_t hidden;
  loom::VocabParallelEmbedding tok{nullptr};
  torch::nn::Embedding pos{nullptr};
  std::vector<loom::ParallelTransformerBlock> blocks;
  torch::nn::LayerNorm lnf{nullptr};
  loom::ColumnParallelLinear head{nullptr};
};
TORCH_MODULE(Gpt);

int train(Options o) {
  auto rt = loom::init();
  auto world = rt->world_comm();
  if (o.tp == 0) o.tp = world->size() % 2 == 0 ? 2 : 1;

  std::string text;
  if (o.text_path.empty()) {
    text = synthetic_text(o.seed, 200000);
  } else {
    std::ifstream in(o.text_path, std::ios::binary);
    if (!in) throw loom::InvalidArgumentError("train_gpt_tp: cannot read --text " + o.text_path);
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  if (static_cast<int64_t>(text.size()) < o.seq + 2)
    throw loom::InvalidArgumentError("train_gpt_tp: the text has " + std::to_string(text.size()) +
                                     " characters; expected more than --seq + 1 = " + std::to_string(o.seq + 1));
  std::set<unsigned char> charset(text.begin(), text.end());
  std::vector<unsigned char> chars(charset.begin(), charset.end());
  std::vector<int64_t> index(256, 0);
  for (size_t i = 0; i < chars.size(); ++i) index[chars[i]] = static_cast<int64_t>(i);
  // Padded so the vocabulary splits evenly; the padding classes are never targets.
  const int64_t vocab = loom::padded_vocab_size(static_cast<int64_t>(chars.size()), o.tp);
  std::vector<int64_t> ids_vec(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids_vec[i] = index[static_cast<unsigned char>(text[i])];
  const torch::Tensor corpus = torch::tensor(ids_vec, torch::kLong);

  loom::ParallelConfig config;
  config.tensor_parallel = o.tp;
  config.hidden_size = o.hidden;
  config.num_heads = o.heads;
  config.vocab_size = vocab;
  loom::ParallelState ps(world, config);
  if (o.batch % (ps.dp_degree() * o.accumulate) != 0)
    throw loom::InvalidArgumentError(
        "train_gpt_tp: --batch " + std::to_string(o.batch) + " must be divisible by the data-parallel degree " +
        std::to_string(ps.dp_degree()) + " x --accumulate " + std::to_string(o.accumulate));
  ps.seed(o.seed);  // the same initial weights on every rank; per-TP-rank dropout streams
  Gpt model(o, vocab, ps.tp_group());
  loom::GradientReducer reducer(model->parameters(), ps.dp_group());
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(0.01));
  loom::GradientAccumulator accumulate(reducer, static_cast<size_t>(o.accumulate));
  std::unique_ptr<loom::GradScaler> scaler;
  if (o.scaler) {
    loom::GradScalerOptions scaler_options;
    scaler_options.sync_groups = {ps.tp_group()};  // gradients are split over the TP group
    scaler = std::make_unique<loom::GradScaler>(scaler_options);
  }

  const int64_t per_replica = o.batch / ps.dp_degree();
  if (world->rank() == 0)
    std::printf("train_gpt_tp: %d ranks = TP %d x DP %d; %zu characters, vocabulary %zu (padded to %lld); "
                "%lld layers, hidden %lld, %lld heads; batch %lld x %lld characters\n",
                world->size(), ps.tp_degree(), ps.dp_degree(), text.size(), chars.size(), (long long)vocab,
                (long long)o.layers, (long long)o.hidden, (long long)o.heads, (long long)o.batch, (long long)o.seq);

  double first = 0, last = 0, window = 0;
  int64_t first_step = 1;
  std::unique_ptr<loom::Checkpointer> checkpointer;
  if (!o.checkpoint_dir.empty()) {
    loom::CheckpointOptions options;
    options.directory = o.checkpoint_dir;
    checkpointer = std::make_unique<loom::Checkpointer>(world, options);
    checkpointer->model(model).optimizer(opt).rng(loom::rng_tracker()).accumulator(accumulate);
    if (scaler) checkpointer->scaler(*scaler);
    if (o.resume) {
      if (auto info = checkpointer->load_latest()) {
        first_step = info->progress.step + 1;
        auto saved_first = info->user.find("first_loss");
        if (saved_first != info->user.end()) first = std::stod(saved_first->second);
        if (world->rank() == 0)
          std::printf("resumed from %s at step %lld\n", info->path.c_str(), (long long)info->progress.step);
      } else if (world->rank() == 0) {
        std::printf("no checkpoint in %s: starting fresh\n", o.checkpoint_dir.c_str());
      }
    }
  }

  const auto start = std::chrono::steady_clock::now();
  int64_t window_steps = 0;
  for (int64_t step = first_step; step <= o.steps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 7919 + step);
    torch::Tensor starts = torch::randint(corpus.size(0) - o.seq - 1, {o.batch}, gen);
    torch::Tensor offsets = torch::arange(o.seq + 1).unsqueeze(1) + starts.unsqueeze(0);  // [s+1, batch]
    torch::Tensor windows = corpus.index({offsets}).narrow(1, ps.dp_rank() * per_replica, per_replica);
    reducer.zero_grad();
    double step_loss = 0;
    for (const auto& micro : windows.chunk(o.accumulate, 1)) {
      auto scope = accumulate.next();  // only the last micro-batch's backward all-reduces
      torch::Tensor loss = loom::vocab_parallel_cross_entropy(model(micro.narrow(0, 0, o.seq)),
                                                              micro.narrow(0, 1, o.seq), ps.tp_group()) /
                           double(o.accumulate);
      if (scaler)
        scaler->scale(loss).backward();
      else
        loss.backward();
      step_loss += loss.item<double>();
    }
    if (scaler) {
      scaler->step(opt);
      scaler->update();
    } else {
      opt.step();
    }
    window += step_loss;
    ++window_steps;
    if (step == 1 || step % o.log_every == 0 || step == o.steps) {
      torch::Tensor mean = torch::full({1}, window / window_steps, torch::kFloat64);
      ps.dp_group()->all_reduce(mean, {loom::ReduceOp::Avg})->wait();
      if (step == 1) first = mean.item<double>();
      last = mean.item<double>();
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (world->rank() == 0) {
        std::printf("step %5lld/%lld  loss %.*f  %.1f steps/s\n", (long long)step, (long long)o.steps, o.loss_digits,
                    last, (step - first_step + 1) / elapsed);
        std::fflush(stdout);
      }
      window = 0;
      window_steps = 0;
    }
    if (checkpointer && ((o.save_every > 0 && step % o.save_every == 0) || step == o.steps)) {
      char first_text[32];
      std::snprintf(first_text, sizeof(first_text), "%.17g", first);
      checkpointer->save({.step = step, .epoch = 0, .sample = step * o.batch}, {{"first_loss", first_text}});
    }
  }
  if (checkpointer) checkpointer->wait();

  // Greedy continuation of the text's first characters. Every rank takes part: the last position's
  // logits are gathered over the TP group (a few hundred floats, unlike the whole batch's).
  model->eval();
  torch::NoGradGuard no_grad;
  std::vector<int64_t> context(ids_vec.begin(), ids_vec.begin() + std::min<int64_t>(o.seq / 2, corpus.size(0)));
  std::string sample;
  for (unsigned char c : std::string(text.begin(), text.begin() + context.size())) sample += static_cast<char>(c);
  for (int64_t i = 0; i < o.sample_chars; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(context.size()), o.seq);
    torch::Tensor ids = torch::tensor(std::vector<int64_t>(context.end() - n, context.end())).unsqueeze(1);
    torch::Tensor logits = loom::tp::gather_from_region(model(ids)[n - 1][0], ps.tp_group());
    const int64_t next = logits.narrow(0, 0, static_cast<int64_t>(chars.size())).argmax().item<int64_t>();
    context.push_back(next);
    sample += static_cast<char>(chars[next]);
  }
  const bool learned = last < 0.5 * first;
  if (world->rank() == 0) {
    std::printf("sample: \"%s\"\n", sample.c_str());
    std::printf("final loss %.17g\n", last);
    std::printf("first loss %.4f, final loss %.4f (%.1f%% of first): %s\n", first, last, 100 * last / first,
                learned ? "OK, the loss fell below half its start" : "FAILED, the loss did not halve");
  }
  return learned ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPT-style character model with tensor x data parallelism (torchloom)"};
  Options o;
  app.add_option("--tp", o.tp, "tensor-parallel degree (default: 2 on an even world, else 1)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "global batch (sequences per step, split over DP replicas)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "characters per sequence")->check(CLI::PositiveNumber);
  app.add_option("--hidden", o.hidden, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", o.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--dropout", o.dropout, "attention and hidden dropout");
  app.add_option("--lr", o.lr, "AdamW learning rate")->check(CLI::PositiveNumber);
  app.add_option("--log-every", o.log_every, "print every this many steps")->check(CLI::PositiveNumber);
  app.add_option("--text", o.text_path, "train on this text file instead of the built-in grammar");
  app.add_option("--seed", o.seed, "seed of the text, the batches, the weights and dropout");
  app.add_option("--accumulate", o.accumulate, "micro-batches per step (gradient accumulation)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--scaler", o.scaler, "scale the loss with loom::GradScaler");
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "save checkpoints here (every --save-every steps and at the end)");
  app.add_option("--save-every", o.save_every, "steps between checkpoints (0: only at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", o.resume, "continue from the newest complete checkpoint in --checkpoint-dir, if any");
  app.add_option("--loss-digits", o.loss_digits, "decimals of the logged loss")->check(CLI::Range(1, 17));
  CLI11_PARSE(app, argc, argv);
  if (o.resume && o.checkpoint_dir.empty()) {
    std::fprintf(stderr, "train_gpt_tp: --resume needs --checkpoint-dir\n");
    return 2;
  }

  torch::set_num_threads(1);  // ranks share the cores
  int status = 1;
  try {
    status = train(o);
  } catch (const std::exception& e) {
    // Leaving without finalizing makes mpirun end the other ranks instead of letting them hang;
    // exit code 1, as when torchloom ends the job itself (MPI_Abort), whichever rank reports first.
    std::fprintf(stderr, "train_gpt_tp: %s\n", e.what());
    return 1;
  }
  loom::finalize();
  return status;
}
