// Data-parallel training of a C++ torch::nn module with loom::DistributedDataParallel: does a plain
// LibTorch training loop, wrapped in DDP and launched on several ranks, learn, and how fast?
//
// The task is built in, so nothing is downloaded: a fixed random "teacher" network (drawn from
// --seed) labels random inputs into 10 classes, and an MLP student learns to imitate it. Every
// step has one global batch of batch-per-rank x world-size samples, drawn from (seed, step); each
// rank takes its own shard of it. The sequence of global batches therefore does not depend on
// the number of ranks, only on how it is split.
//
// Rank 0 prints the loss averaged over ranks, global samples/s and an estimate of the time left;
// at the end it prints the first against the final loss and held-out accuracy, and the final loss
// with full precision (so that two runs can be compared). The exit status is non-zero when the
// final loss is not below half the first one (the run did not learn).
//
// Checkpoints (loom::Checkpointer): --checkpoint-dir DIR saves every --save-every steps and at the
// end, in the background; --resume continues from the newest complete checkpoint in DIR (or starts
// fresh when there is none). A resumed run continues exactly as the uninterrupted one would have:
// weights, optimizer state, loss scale and RNG come back bit for bit, and the data of a step
// depends on the step alone.
//
//   source scripts/mpi_env.sh
//   mpirun -np 2 $LOOM_MPIRUN_FLAGS build/examples/train_ddp --steps 300 --accumulate 2
//   mpirun -np 2 $LOOM_MPIRUN_FLAGS build/examples/train_ddp --checkpoint-dir ckpt --save-every 50 --resume
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

#include "loom/loom.h"
#include "loom/topology/placement.h"
#include "loom/train/accumulation.h"
#include "loom/train/checkpoint.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int64_t steps = 500;
  int64_t batch_per_rank = 64;
  int64_t accumulate = 1;
  int64_t log_every = 50;
  int64_t hidden = 256;
  int64_t input_dim = 32;
  int64_t classes = 10;
  int64_t eval_samples = 4096;
  double lr = 1e-3;
  std::string optimizer = "adam";
  uint64_t seed = 1234;
  bool scaler = false;
  std::string checkpoint_dir;
  int64_t save_every = 0;
  bool resume = false;
  int loss_digits = 4;
};

struct StudentImpl : torch::nn::Module {
  StudentImpl(int64_t in, int64_t hidden, int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        out(register_module("out", torch::nn::Linear(hidden, classes))) {}

  torch::Tensor forward(const torch::Tensor& x) { return out(torch::relu(fc2(torch::relu(fc1(x))))); }

  torch::nn::Linear fc1, fc2, out;
};
TORCH_MODULE(Student);

// The labelling function: a fixed random two-layer network, the same on every rank because it is
// drawn from the seed alone. A smooth teacher keeps the task learnable by a small student.
class Teacher {
 public:
  explicit Teacher(const Options& o) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
    w1_ = torch::randn({o.input_dim, 64}, gen) / std::sqrt(double(o.input_dim));
    w2_ = torch::randn({64, o.classes}, gen) / 8.0;
  }
  torch::Tensor label(const torch::Tensor& x) const { return torch::tanh(x.mm(w1_)).mm(w2_).argmax(1); }

 private:
  torch::Tensor w1_, w2_;
};

struct Batch {
  torch::Tensor x, y;
};

// This rank's shard of the global batch of `step`: the global batch is drawn from (seed, step) so
// all ranks agree on it without communicating; only the rank's rows are labelled.
Batch shard(const Options& o, const Teacher& teacher, uint64_t stream, int64_t step, int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003 + stream * 7919 + step);
  torch::Tensor global = torch::randn({o.batch_per_rank * world, o.input_dim}, gen);
  torch::Tensor x = global.narrow(0, rank * o.batch_per_rank, o.batch_per_rank).contiguous();
  return {x, teacher.label(x)};
}

// Mean of a per-rank value over the group (used for the loss each rank saw on its own shard).
double average(loom::Communicator& comm, double value) {
  at::Tensor t = torch::full({1}, value, torch::kFloat64);
  comm.all_reduce(t, {loom::ReduceOp::Avg})->wait();
  return t.item<double>();
}

std::string duration(double seconds) {
  char text[32];
  if (seconds < 60)
    std::snprintf(text, sizeof(text), "%.1fs", seconds);
  else
    std::snprintf(text, sizeof(text), "%dm%02ds", int(seconds) / 60, int(seconds) % 60);
  return text;
}

int train(const Options& o) {
  auto rt = loom::init();
  auto comm = rt->world_comm();
  const int rank = comm->rank();
  const int world = comm->size();

  torch::manual_seed(o.seed);  // the same initial weights everywhere (DDP broadcasts rank 0's anyway)
  Teacher teacher(o);
  loom::DistributedDataParallel<Student> ddp(Student(o.input_dim, o.hidden, o.classes), comm);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (o.optimizer == "adam")
    opt = std::make_unique<torch::optim::Adam>(ddp->parameters(), torch::optim::AdamOptions(o.lr));
  else
    opt = std::make_unique<torch::optim::SGD>(ddp->parameters(), torch::optim::SGDOptions(o.lr).momentum(0.9));
  // Each micro-batch but the last only accumulates locally; the last one's backward all-reduces
  // the sum, so a step costs one reduction whatever --accumulate is.
  loom::GradientAccumulator accumulate(ddp.reducer(), static_cast<size_t>(o.accumulate));
  // Dynamic loss scaling (float32 here, so it never finds an overflow; it shows the scaler resumes).
  std::unique_ptr<loom::GradScaler> scaler;
  if (o.scaler) scaler = std::make_unique<loom::GradScaler>();

  if (rank == 0)
    std::printf("train_ddp: %d ranks, %lld steps, global batch %lld (%lld per rank, %lld micro-batches), %s lr %g\n",
                world, (long long)o.steps, (long long)(o.batch_per_rank * world), (long long)o.batch_per_rank,
                (long long)o.accumulate, o.optimizer.c_str(), o.lr);
  // The placement plan this job runs under (with GPUs, or a topology file: LOOM_TOPOLOGY).
  if (rank == 0 && rt->plan()) std::printf("%s", loom::topo::explain(*rt->plan(), 64 << 20).c_str());

  double first_loss = 0, final_loss = 0, window_loss = 0;
  int64_t first_step = 1;
  std::unique_ptr<loom::Checkpointer> checkpointer;
  if (!o.checkpoint_dir.empty()) {
    loom::CheckpointOptions options;
    options.directory = o.checkpoint_dir;
    checkpointer = std::make_unique<loom::Checkpointer>(comm, options);
    checkpointer->model(ddp).optimizer(*opt).accumulator(accumulate);
    if (scaler) checkpointer->scaler(*scaler);
    if (o.resume) {
      if (auto info = checkpointer->load_latest()) {
        first_step = info->progress.step + 1;
        auto first = info->user.find("first_loss");
        if (first != info->user.end()) first_loss = std::stod(first->second);
        if (rank == 0)
          std::printf("resumed from %s at step %lld\n", info->path.c_str(), (long long)info->progress.step);
      } else if (rank == 0) {
        std::printf("no checkpoint in %s: starting fresh\n", o.checkpoint_dir.c_str());
      }
    }
  }

  int64_t window_steps = 0;
  const auto start = Clock::now();
  auto window_start = start;
  for (int64_t step = first_step; step <= o.steps; ++step) {
    Batch batch = shard(o, teacher, /*stream=*/0, step, rank, world);
    auto xs = batch.x.chunk(o.accumulate);
    auto ys = batch.y.chunk(o.accumulate);
    ddp.zero_grad();  // zeroes in place: gradients stay views into the reducer's buckets
    double step_loss = 0;
    for (int64_t m = 0; m < o.accumulate; ++m) {
      auto micro = accumulate.next();
      // Divided by the micro-batch count so the summed gradient is that of the whole batch's mean loss.
      torch::Tensor loss = torch::nn::functional::cross_entropy(ddp.forward(xs[m]), ys[m]) / double(o.accumulate);
      if (scaler)
        scaler->scale(loss).backward();
      else
        loss.backward();
      step_loss += loss.item<double>();
    }
    if (scaler) {
      scaler->step(*opt);
      scaler->update();
    } else {
      opt->step();
    }
    window_loss += step_loss;
    ++window_steps;

    // Every rank takes part in the loss all-reduce, so the decision to log depends on the step only.
    if (step == 1 || step % o.log_every == 0 || step == o.steps) {
      const double loss = average(*comm, window_loss / window_steps);
      const auto now = Clock::now();
      const double window_s = std::chrono::duration<double>(now - window_start).count();
      const double elapsed_s = std::chrono::duration<double>(now - start).count();
      if (step == 1) first_loss = loss;
      final_loss = loss;
      if (rank == 0) {
        const double samples_per_s = window_steps * o.batch_per_rank * world / window_s;
        const double done = double(step - first_step + 1);
        const double eta_s = elapsed_s / done * (o.steps - step);
        std::printf("step %5lld/%lld  loss %.*f  %9.0f samples/s  elapsed %s  eta %s\n", (long long)step,
                    (long long)o.steps, o.loss_digits, loss, samples_per_s, duration(elapsed_s).c_str(),
                    duration(eta_s).c_str());
        std::fflush(stdout);
      }
      window_loss = 0;
      window_steps = 0;
      window_start = Clock::now();
    }
    // In the background: the next steps run while the shards are written.
    if (checkpointer && ((o.save_every > 0 && step % o.save_every == 0) || step == o.steps)) {
      char first[32];
      std::snprintf(first, sizeof(first), "%.17g", first_loss);
      checkpointer->save({.step = step, .epoch = 0, .sample = step * o.batch_per_rank * world},
                         {{"first_loss", first}});
    }
  }
  if (checkpointer) checkpointer->wait();
  const double train_s = std::chrono::duration<double>(Clock::now() - start).count();

  // Held-out accuracy from a stream no training step used; each rank scores its shard.
  double correct = 0;
  {
    torch::NoGradGuard no_grad;
    Options eval = o;
    eval.batch_per_rank = o.eval_samples / world;
    Batch held_out = shard(eval, teacher, /*stream=*/1, 0, rank, world);
    correct = ddp.module()->forward(held_out.x).argmax(1).eq(held_out.y).sum().item<double>();
    correct = average(*comm, correct) * world / (eval.batch_per_rank * world);
  }
  const bool learned = final_loss < 0.5 * first_loss;
  if (rank == 0) {
    std::printf("first loss %.4f, final loss %.4f (%.1f%% of first), held-out accuracy %.1f%%, %s for %lld steps\n",
                first_loss, final_loss, 100 * final_loss / first_loss, 100 * correct, duration(train_s).c_str(),
                (long long)o.steps);
    std::printf("final loss %.17g\n", final_loss);
    std::printf("%s\n", learned ? "OK: the loss fell below half its start"
                                : "FAILED: the loss did not fall below half its start");
  }
  checkpointer.reset();
  comm.reset();
  rt.reset();
  return learned ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Data-parallel training of an MLP on a synthetic teacher-labelled task with loom::DistributedDataParallel"};
  Options o;
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch-per-rank", o.batch_per_rank, "samples per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--accumulate", o.accumulate, "micro-batches per step (gradient accumulation)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "learning rate")->check(CLI::PositiveNumber);
  app.add_option("--optimizer", o.optimizer, "adam or sgd (momentum 0.9)")->check(CLI::IsMember({"adam", "sgd"}));
  app.add_option("--log-every", o.log_every, "print every this many steps")->check(CLI::PositiveNumber);
  app.add_option("--hidden", o.hidden, "width of the two hidden layers")->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "seed of the teacher, the data and the initial weights");
  app.add_flag("--scaler", o.scaler, "scale the loss with loom::GradScaler");
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "save checkpoints here (every --save-every steps and at the end)");
  app.add_option("--save-every", o.save_every, "steps between checkpoints (0: only at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", o.resume, "continue from the newest complete checkpoint in --checkpoint-dir, if any");
  app.add_option("--loss-digits", o.loss_digits, "decimals of the logged loss")->check(CLI::Range(1, 17));
  CLI11_PARSE(app, argc, argv);
  if (o.resume && o.checkpoint_dir.empty()) {
    std::fprintf(stderr, "train_ddp: --resume needs --checkpoint-dir\n");
    return 2;
  }
  if (o.batch_per_rank % o.accumulate != 0) {
    std::fprintf(stderr, "train_ddp: --batch-per-rank %lld must be a multiple of --accumulate %lld\n",
                 (long long)o.batch_per_rank, (long long)o.accumulate);
    return 2;
  }

  // One intra-op thread per rank: ranks share the machine's cores, and more threads would only
  // make them compete (and make the all-reduce thread wait for a core).
  torch::set_num_threads(1);
  int status = 1;
  try {
    status = train(o);
  } catch (const std::exception& e) {
    // Leaving without finalizing makes mpirun end the other ranks instead of letting them hang;
    // exit code 1, as when torchloom ends the job itself (MPI_Abort), whichever rank reports first.
    std::fprintf(stderr, "train_ddp: %s\n", e.what());
    return 1;
  }
  loom::finalize();
  return status;
}
