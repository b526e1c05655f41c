// The flagship: a GPT-style byte-level language model trained with tensor x pipeline x data
// parallelism, with everything torchloom does switched on.
//
//   bash scripts/run_demo.sh                   # set-up, build, and this program on 4 ranks (TP 2 x DP 2)
//   build/loomrun -np 4 --tp 2 -- build/examples/train_gpt --steps 600 --checkpoint-dir ckpt --save-every 100
//   build/loomrun -np 4 --tp 2 -- build/examples/train_gpt --checkpoint-dir ckpt --resume   # continues exactly
//
//   build/loomrun -np 4 --tp 2 --pp 2 -- build/examples/train_gpt --schedule 1f1b --micro-batches 8
//
// Pipeline parallelism (--pp, --schedule gpipe|1f1b|interleaved|zero-bubble, --virtual-stages):
// the blocks are cut into stages (the embedding on the first, the head and loss on the last) that
// a loom::pp::PipelineExecutor runs over the pipeline group; evaluation and the sample run forward
// only through the stages (docs/pipeline-parallel.md). The tensor-parallel layers compute their
// weight gradients with the input gradient, so zero-bubble runs its order without deferring them.
//
// Model: token embedding split over the vocabulary (VocabParallelEmbedding), learned positions, N
// ParallelTransformerBlocks (heads and MLP split over the TP group; optionally sequence-parallel
// and recomputed in backward), a final layernorm and a vocabulary-parallel head and loss. The
// data-parallel replicas average gradients with loom::GradientReducer (buckets overlapping
// backward) over the DP group, with gradient accumulation. The weights are created shard by shard
// on the device (ParallelInit's default), from the model-parallel RNG stream.
//
// Data: real text with no download. By default examples/data/licenses.txt (the free-software license
// texts every Debian system carries, 237 KB, fixed: see examples/data/SOURCES.md); --data FILE|DIR
// trains on a file or on every text file of a directory (sorted, up to --data-bytes). Bytes are the
// tokens (vocabulary 256); the last --held-out share of the text is never trained on. Its loss is
// reported over fixed contiguous windows, beside what unigram, bigram and trigram count models
// (Kneser-Ney) reach on the same bytes.
//
// Precision (--precision auto): on a CPU bf16 autocast where the CPU does bf16 arithmetic (AVX512-BF16,
// AMX), else fp32, as loom::cpu_bf16_support() finds and the first lines say; on a GPU fp16 autocast with loom::GradScaler (which skips
// steps whose gradients overflow). Checkpoints (loom::Checkpointer): every --save-every steps and
// at the end, written in the background; --resume continues from the newest complete one, and the
// losses continue bit for bit as if the run had not stopped. The timeline (--timeline PREFIX, or
// LOOM_TIMELINE) shows buckets, TP all-reduces and checkpoint writes per rank, in Perfetto.
//
// Output: a live progress line (step, loss, tokens/s, ETA), redrawn in place on a terminal, or one
// line per --log-every steps in a log (--progress); the held-out loss every --eval-every steps; at the end, where
// the time went (compute, exposed communication, checkpoint stall, data), a sample of generated
// text, and "final loss"; --loss-csv writes the loss curve. The exit status is non-zero when the
// training loss did not fall below 60% of its start (with --must-beat-trigram, as the main job runs
// it: when the held-out loss is not below the trigram count model's).
#include <ATen/CPUGeneratorImpl.h>
#include <malloc.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "loom/loom.h"
#include "loom/parallel/grad_clip.h"
#include "loom/parallel/recompute.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/parallel/fully_shard.h"
#include "loom/parallel/zero.h"
#include "loom/topology/placement.h"
#include "loom/trace.h"
#include "loom/train/accumulation.h"
#include "loom/train/checkpoint.h"
#include "loom/train/metrics.h"
#include "ngram_baseline.h"

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// train_gpt refusing what it was given, naming this rank: "[rank 1] train_gpt: --batch 15 must be ...".
loom::InvalidArgumentError refusal(const std::string& what) {
  return loom::InvalidArgumentError(loom::ErrorContext("train_gpt")(what));
}
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Options {
  int tp = 0;  // 0: 2 when the world size is even, else 1
  int pp = 0;  // pipeline stages; 0: LOOM_PP when set, else 1
  std::string schedule = "1f1b";  // gpipe, 1f1b, interleaved or zero-bubble
  int virtual_stages = 0;         // model chunks per pipeline rank; 0: 2 with interleaved, else 1
  int64_t steps = 300;
  int64_t batch = 16;  // global sequences per step, split over DP replicas
  int64_t seq = 64;
  int64_t hidden = 128;
  int64_t heads = 4;
  int64_t layers = 3;
  double dropout = 0.1;
  double lr = 2e-3;
  double clip_grad_norm = 0;  // clip the gradients' global norm to this (0: no clipping)
  double warmup = 0.05;  // share of the steps with a linearly rising learning rate
  int64_t log_every = 20;
  int64_t eval_every = 100;
  int64_t eval_batches = 4;
  double held_out = 0.1;
  int64_t sample_bytes = 240;
  uint64_t seed = 1234;
  std::string data;
  int64_t data_bytes = 4 << 20;
  int64_t accumulate = 2;
  std::string precision = "auto";  // auto, fp32, bf16, fp16
  bool scaler = false;
  bool sequence_parallel = false;
  bool recompute = false;
  int zero = 0;  // ZeRO stage over the DP group (0: plain data parallelism)
  bool zero_overlap = false;  // ZeRO's parameter all-gather overlapping the next forward
  int hsdp = 0;  // with --zero 3: shard within groups of this many DP ranks, replicate across (0: all)
  double bucket_cap_mb = 25;  // gradient buckets (PyTorch DDP's default); the first is 1 MB or this
  std::string checkpoint_dir;
  int64_t save_every = 0;
  bool resume = false;
  std::string timeline;
  bool all_ranks = false;
  bool deterministic = false;
  std::string progress = "auto";
  int loss_digits = 4;
  std::string score;  // a text file scored at the end (fp32, no dropout), e.g. against an export
  std::string loss_csv;           // step, training loss, held-out loss: for the loss-curve plot
  bool must_beat_trigram = false;  // exit status: held-out loss below the trigram count model's
  int64_t score_windows = 16;
};

// ---- data ----------------------------------------------------------------------------------

bool is_text_file(const fs::path& p) {
  static const std::vector<std::string> kinds = {".md", ".txt", ".rst", ".py", ".cpp", ".h", ".c"};
  return fs::is_regular_file(p) && std::find(kinds.begin(), kinds.end(), p.extension().string()) != kinds.end();
}

// The text of a file, or of a directory's text files in name order (recursively), up to `limit` bytes.
std::string read_text(const std::string& where, int64_t limit) {
  std::vector<fs::path> files;
  if (fs::is_directory(where)) {
    for (const auto& e : fs::recursive_directory_iterator(where, fs::directory_options::skip_permission_denied))
      if (is_text_file(e.path())) files.push_back(e.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(where);
  }
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw refusal("cannot read --data " + f.string());
    std::stringstream buffer;
    buffer << in.rdbuf();
    text += buffer.str();
    if (!text.empty() && text.back() != '\n') text += '\n';
    if (static_cast<int64_t>(text.size()) >= limit) break;
  }
  if (static_cast<int64_t>(text.size()) > limit) text.resize(static_cast<size_t>(limit));
  return text;
}

// Random windows [seq + 1, batch] of `corpus` (token ids), the same on every rank for (seed, step).
torch::Tensor windows(const torch::Tensor& corpus, int64_t seq, int64_t batch, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::Tensor starts = torch::randint(corpus.size(0) - seq - 1, {batch}, gen);
  return corpus.index({torch::arange(seq + 1).unsqueeze(1) + starts.unsqueeze(0)});
}

// ---- model ---------------------------------------------------------------------------------

// What one pipeline stage computes: blocks [first, end), after the embedding on the first stage
// and before the final layernorm and head on the last.
struct StageSpan {
  int first = 0, end = 0;
  bool embeds = false, heads = false;
};

struct GptImpl : torch::nn::Module {
  GptImpl(const Options& o, int64_t vocab, loom::TensorParallelGroup group, const loom::ParallelInit& init) {
    loom::VocabParallelEmbeddingOptions tok_options;
    tok_options.sequence_parallel = o.sequence_parallel;
    tok_options.initialization = init;
    tok = register_module("tok", loom::VocabParallelEmbedding(vocab, o.hidden, group, tok_options));
    pos = register_parameter("pos", torch::randn({o.seq, 1, o.hidden}, torch::dtype(init.dtype).device(init.device)) *
                                        0.02);
    for (int64_t l = 0; l < o.layers; ++l) {
      loom::ParallelTransformerBlockOptions b;
      b.attention_dropout = o.dropout;
      b.hidden_dropout = o.dropout;
      b.sequence_parallel = o.sequence_parallel;
      b.recompute = o.recompute;
      b.initialization = init;
      blocks.push_back(register_module("block" + std::to_string(l), loom::ParallelTransformerBlock(o.hidden, o.heads, group, b)));
    }
    const auto replicated = torch::dtype(init.dtype).device(init.device);
    lnf_weight = register_parameter("lnf_weight", torch::ones({o.hidden}, replicated));
    lnf_bias = register_parameter("lnf_bias", torch::zeros({o.hidden}, replicated));
    loom::ColumnParallelLinearOptions head_options;
    head_options.bias = false;
    head_options.sequence_parallel = o.sequence_parallel;
    head_options.initialization = init;
    head = register_module("head", loom::ColumnParallelLinear(o.hidden, vocab, group, head_options));
    sequence_parallel = o.sequence_parallel;
    this->group = group;
    tp_rank = group ? group->rank() : 0;
  }
  // Under sequence parallelism each rank uses the replicated positions and final layernorm on its
  // own rows only, so their gradients are partial: copy_to_region sums them over the TP group.
  torch::Tensor replicated(const torch::Tensor& p) { return sequence_parallel ? loom::tp::copy_to_region(p, group) : p; }
  // ids [s, b] -> this rank's slice of the logits [s, b, vocab / tp]. Sequence-parallel: the
  // embedding's output is this rank's rows, and so is every activation up to the head.
  torch::Tensor forward(const torch::Tensor& ids) {
    const StageSpan whole{0, static_cast<int>(blocks.size()), true, true};
    if (fsdp) return fsdp->forward(*this, ids, [&](const torch::Tensor& ids) { return stage(whole, ids); });
    return stage(whole, ids);
  }
  // One pipeline stage: from the ids (first stage) or the previous stage's activation to the next
  // stage's activation or the logits (last stage).
  torch::Tensor stage(const StageSpan& span, const torch::Tensor& input) {
    torch::Tensor x = input;
    if (span.embeds) {
      ready(tok->parameters());
      x = tok(input);
      const int64_t rows = x.size(0), first = sequence_parallel ? tp_rank * rows : 0;
      ready({pos});
      x = x + replicated(pos).narrow(0, first, rows);
    }
    for (int l = span.first; l < span.end; ++l) {
      ready(blocks[l]->parameters());
      x = block(l, x);
    }
    if (!span.heads) return x;
    ready({lnf_weight, lnf_bias});
    ready(head->parameters());
    return head(torch::layer_norm(x, {x.size(-1)}, replicated(lnf_weight), replicated(lnf_bias)));
  }
  // The parameters stage `span` computes with.
  std::vector<torch::Tensor> parameters_of(const StageSpan& span) const {
    std::vector<torch::Tensor> params;
    auto add = [&](const std::vector<torch::Tensor>& more) { params.insert(params.end(), more.begin(), more.end()); };
    if (span.embeds) add(tok->parameters()), add({pos});
    for (int l = span.first; l < span.end; ++l) add(blocks[l]->parameters());
    if (span.heads) add({lnf_weight, lnf_bias}), add(head->parameters());
    return params;
  }
  // Under pipeline parallelism: drops every layer the rank's stages do not compute. Every rank
  // builds the whole model first, drawing the weights in one order, so that a layer starts from the
  // same weights at any pipeline size (and the uninterrupted PP 1 run is the reference).
  void keep_only(const std::vector<StageSpan>& spans) {
    auto held = [&](auto&& pred) { return std::any_of(spans.begin(), spans.end(), pred); };
    if (!held([](const StageSpan& s) { return s.embeds; })) {
      unregister_module("tok");
      tok = nullptr;
      parameters_.erase("pos");
      pos = torch::Tensor();
    }
    for (int l = 0; l < static_cast<int>(blocks.size()); ++l)
      if (!held([l](const StageSpan& s) { return s.first <= l && l < s.end; })) {
        unregister_module("block" + std::to_string(l));
        blocks[l] = nullptr;
      }
    if (!held([](const StageSpan& s) { return s.heads; })) {
      parameters_.erase("lnf_weight");
      parameters_.erase("lnf_bias");
      lnf_weight = lnf_bias = torch::Tensor();
      unregister_module("head");
      head = nullptr;
    }
  }
  // Called with each layer's parameters just before the layer reads them: ZeRO's wait for their
  // all-gather when it overlaps the forward (--zero-overlap).
  std::function<void(const std::vector<torch::Tensor>&)> before_use;
  void ready(const std::vector<torch::Tensor>& params) {
    if (before_use) before_use(params);
  }
  // Fully sharded (--zero 3): each block's forward runs as a unit, the whole forward as the root's.
  loom::FullyShardedDataParallel* fsdp = nullptr;
  torch::Tensor block(int l, const torch::Tensor& x) {
    if (!fsdp) return blocks[l](x);
    return fsdp->forward(*blocks[l], x, [&](const torch::Tensor& x) { return blocks[l](x); });
  }
  void set_recompute(bool on) {
    for (auto& block : blocks)
      if (block) block->options.recompute = on;
  }
  loom::VocabParallelEmbedding tok{nullptr};
  torch::Tensor pos;
  std::vector<loom::ParallelTransformerBlock> blocks;
  torch::Tensor lnf_weight, lnf_bias;
  loom::ColumnParallelLinear head{nullptr};
  loom::TensorParallelGroup group;
  bool sequence_parallel = false;
  int tp_rank = 0;
};
TORCH_MODULE(Gpt);

// Bytes of heap in use (glibc): what a forward pass keeps for backward shows up here on the CPU.
size_t heap_in_use() {
  struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

// Generated bytes as printable text: valid UTF-8 sequences kept, anything else (a byte-level model
// can emit half a character) and control characters other than newline and tab shown as '?'.
std::string printable(const std::string& bytes) {
  std::string out;
  for (size_t i = 0; i < bytes.size();) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool valid = n > 0 && i + n <= bytes.size();
    for (size_t k = 1; valid && k < n; ++k) valid = (static_cast<unsigned char>(bytes[i + k]) >> 6) == 0x2;
    if (!valid) {
      out += '?';
      ++i;
      continue;
    }
    if (n == 1 && c < 0x20 && c != '\n' && c != '\t')
      out += '?';
    else
      out.append(bytes, i, n);
    i += n;
  }
  return out;
}

// ---- progress ------------------------------------------------------------------------------

std::string duration_text(double s) {
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof(buf), "%dh%02dm", int(s / 3600), int(std::fmod(s, 3600) / 60));
  else if (s >= 60)
    std::snprintf(buf, sizeof(buf), "%dm%02ds", int(s / 60), int(std::fmod(s, 60)));
  else
    std::snprintf(buf, sizeof(buf), "%.1fs", s);
  return buf;
}

// Where each step's time went, summed over the steps of this run (this process).
struct TimeShares {
  double data = 0, step = 0, exposed_comm = 0, checkpoint = 0, eval = 0, pipeline_wait = 0;
};

// The text a run trains on, and the held-out tail it never trains on.
struct Corpus {
  std::string name;  // as the project names it, not by this machine's absolute path
  std::string text;
  int64_t train_bytes = 0, held_out_bytes = 0;
  torch::Tensor train_ids, held_ids;
};

Corpus read_corpus(Options& o) {
  Corpus c;
  c.name = o.data.empty() ? "examples/data/licenses.txt" : o.data;
  if (o.data.empty()) o.data = LOOM_EXAMPLE_DATA;
  c.text = read_text(o.data, o.data_bytes);
  c.held_out_bytes = static_cast<int64_t>(o.held_out * static_cast<double>(c.text.size()));
  c.train_bytes = static_cast<int64_t>(c.text.size()) - c.held_out_bytes;
  if (c.train_bytes < 4 * (o.seq + 1) || c.held_out_bytes < o.seq + 2)
    throw refusal("--data " + o.data + " has " + std::to_string(c.text.size()) +
                  " bytes; expected enough for training and held-out windows of --seq " +
                  std::to_string(o.seq) + " + 1");
  const torch::Tensor all_ids =
      torch::from_blob(const_cast<char*>(c.text.data()), {static_cast<int64_t>(c.text.size())}, torch::kUInt8)
          .to(torch::kLong);
  c.train_ids = all_ids.narrow(0, 0, c.train_bytes);
  c.held_ids = all_ids.narrow(0, c.train_bytes, c.held_out_bytes);
  return c;
}

// The precision: fp16 with the scaler on a GPU; on a CPU bf16 only where the hardware does bf16
// arithmetic (elsewhere bf16 autocast converts through fp32 and runs several times slower).
// Returns why, when the first lines should say it.
std::string choose_precision(Options& o, bool on_gpu) {
  const loom::CpuBf16Support cpu_bf16 = loom::cpu_bf16_support();
  if (o.precision == "auto") {
    o.precision = on_gpu ? "fp16" : cpu_bf16.native ? "bf16" : "fp32";
    return on_gpu ? "on a GPU: fp16 autocast with the grad scaler"
                  : (cpu_bf16.native ? "bf16: " : "fp32, not bf16: ") + cpu_bf16.reason;
  }
  if (o.precision == "bf16" && !on_gpu && !cpu_bf16.native)
    return "bf16 as asked, but " + cpu_bf16.reason +
           "; expect it to run about 5x slower than --precision fp32 (README: 5.1x on a 2-core AVX2 CPU)";
  return "";
}

// One training run, from the runtime's communicators to the verdict. Each step of the setup and
// of the loop is a member, in the order run() calls them (the order matters: the model's weights
// and the dropout streams come from generators each step draws from).
class GptRun {
 public:
  GptRun(Options o, std::shared_ptr<loom::Runtime> rt) : o_(std::move(o)), rt_(std::move(rt)) {}

  int run() {
    set_up_groups();
    build_model_and_optimizer();
    print_setup();
    prepare_evaluation();
    measure_recompute();
    open_checkpointer();
    train_steps();
    report_time();
    report_memory();
    const std::string sample = generate_sample();
    score_file();
    return verdict(sample);
  }

 private:
  void set_up_groups();
  void build_model_and_optimizer();
  void print_setup() const;
  void prepare_evaluation();
  void measure_recompute();
  void open_checkpointer();
  void train_steps();
  double train_step(int64_t step);  // the step's loss (this replica's)
  void report_progress(int64_t step, double step_loss);
  void evaluate(int64_t step);
  double save(int64_t step);  // the training stall, in seconds
  void report_time();
  void report_memory() const;
  std::string generate_sample();
  void score_file();
  int verdict(const std::string& sample) const;

  torch::Tensor loss_of(const torch::Tensor& ids);
  void build_pipeline();
  void refuse_what_fully_sharded_lacks() const;
  std::vector<std::vector<torch::Tensor>> chunk_parameters() const;
  std::vector<torch::Tensor> bucket_buffers() const;
  double accumulated_step(const torch::Tensor& batch);
  void clip_gradients();
  double pipeline_step(const torch::Tensor& batch);
  torch::Tensor output_of(const torch::Tensor& input);
  void autocast(std::optional<loom::AutocastGuard>& guard) const;
  double from_last_stage(double v);
  torch::Tensor from_last_stage(torch::Tensor t);
  double replica_mean(double v);
  double held_out_loss();
  uint64_t communicated() const {
    uint64_t bytes = loom::tp::comm_stats().total_bytes() + (zero_ ? zero_->stats().bytes_all_gathered : 0);
    if (fsdp_) bytes += fsdp_->stats().bytes_all_gathered + fsdp_->stats().bytes_reduce_scattered;
    for (const auto* reducer : reducers_) bytes += reducer->stats().bytes_reduced;
    return bytes;
  }
  double exposed() const {
    double seconds = loom::tp::comm_stats().wait_seconds;
    for (const auto* reducer : reducers_) seconds += reducer->stats().wait_seconds;
    return seconds;
  }

  Options o_;
  std::shared_ptr<loom::Runtime> rt_;
  std::shared_ptr<loom::Communicator> world_, comm_;
  c10::Device device_ = c10::Device(c10::kCPU);
  bool on_gpu_ = false, log_ = false, live_ = false;
  std::string precision_why_;
  Corpus corpus_;
  int64_t vocab_ = 0, per_replica_ = 0;
  std::optional<loom::ParallelState> ps_;
  loom::RngTracker* device_rng_ = nullptr;
  Gpt model_{nullptr};
  std::vector<StageSpan> spans_;  // this rank's pipeline stages, by chunk
  std::unique_ptr<loom::pp::PipelineExecutor> pipeline_;
  bool score_in_fp32_ = false;
  std::unique_ptr<loom::ZeroOptimizer> zero_;
  std::unique_ptr<loom::FullyShardedDataParallel> fsdp_;  // --zero 3
  std::vector<std::unique_ptr<loom::GradientReducer>> plain_reducers_;  // one per model chunk
  std::unique_ptr<torch::optim::AdamW> plain_opt_;
  std::vector<loom::GradientReducer*> reducers_;  // by model chunk (ZeRO: its one reducer)
  loom::GradientReducer* reducer_ = nullptr;      // the first: gradient accumulation's
  torch::optim::Optimizer* opt_ = nullptr;
  std::unique_ptr<loom::GradientAccumulator> accumulate_;
  std::unique_ptr<loom::GradScaler> scaler_;
  int64_t held_windows_ = 0;
  torch::Tensor held_batch_;
  std::vector<double> baselines_;  // unigram, bigram, trigram count models on the held-out bytes
  std::unique_ptr<loom::Checkpointer> checkpointer_;
  std::unique_ptr<loom::MetricsExporter> metrics_;
  std::unique_ptr<FILE, int (*)(FILE*)> curve_{nullptr, &std::fclose};
  int64_t first_step_ = 1, window_steps_ = 0;
  double first_ = 0, last_ = 0, window_ = 0, held_ = std::nan("");
  TimeShares time_;
  std::vector<double> bubbles_;  // per pipelined step: the share this rank waited on other stages
  Clock::time_point start_;
  double exposed_at_start_ = 0, total_ = 0;
};

void GptRun::set_up_groups() {
  world_ = rt_->world_comm();
  const int rank = world_->rank();
  if (!o_.timeline.empty()) loom::trace::configure(o_.timeline, rank);
  // The degrees the placement plan was made for (LOOM_TP and LOOM_PP: loomrun --tp, --pp) unless
  // --tp and --pp say otherwise.
  if (o_.pp == 0) o_.pp = std::getenv("LOOM_PP") ? rt_->config().pipeline_parallel : 1;
  if (o_.tp == 0)
    o_.tp = std::getenv("LOOM_TP") ? rt_->config().tensor_parallel : world_->size() / o_.pp % 2 == 0 ? 2 : 1;
  // CUDA tensors go over NCCL when every rank has a GPU; otherwise everything runs on the CPU.
  comm_ = rt_->device_comm() ? rt_->device_comm() : world_;
  device_ = comm_->device();
  on_gpu_ = device_.is_cuda();
  precision_why_ = choose_precision(o_, on_gpu_);
  log_ = rank == 0 || o_.all_ranks;
  corpus_ = read_corpus(o_);
  vocab_ = loom::padded_vocab_size(256, o_.tp);

  loom::ParallelConfig config;
  config.tensor_parallel = o_.tp;
  config.pipeline_parallel = o_.pp;
  config.hidden_size = o_.hidden;
  config.num_heads = o_.heads;
  config.vocab_size = vocab_;
  // DP groups in the plan's ring order when the plan was made for this degree.
  if (comm_->members() == world_->members()) config.dp_rings = loom::planned_dp_rings(o_.tp, o_.pp);
  ps_.emplace(comm_, config);
  if (o_.batch % (ps_->dp_degree() * o_.accumulate) != 0)
    throw refusal(
        "--batch " + std::to_string(o_.batch) + " must be divisible by the data-parallel degree " +
        std::to_string(ps_->dp_degree()) + " x --accumulate " + std::to_string(o_.accumulate));
  if (o_.sequence_parallel && o_.seq % ps_->tp_degree() != 0)
    throw refusal("--seq " + std::to_string(o_.seq) + " must be divisible by the tensor-parallel degree " +
                  std::to_string(ps_->tp_degree()) + " with --sequence-parallel");
  per_replica_ = o_.batch / ps_->dp_degree();
}

void GptRun::build_model_and_optimizer() {
  loom::ParallelState& ps = *ps_;
  ps.seed(o_.seed);  // replicated weights equal everywhere; shards and dropout per TP rank
  device_rng_ = &loom::rng_tracker(device_);
  if (on_gpu_) ps.seed(o_.seed, *device_rng_);
  if (o_.zero == 3) refuse_what_fully_sharded_lacks();
  loom::ParallelInit init;
  init.device = device_;
  init.rng = on_gpu_ ? device_rng_ : nullptr;
  model_ = Gpt(o_, vocab_, ps.tp_group(), init);
  for (auto& block : model_->blocks) block->options.rng = init.rng;
  build_pipeline();
  // Plain data parallelism (a reducer and AdamW over every parameter), or ZeRO (AdamW over this
  // rank's shard of the DP group's buckets, the reducer inside the ZeroOptimizer).
  const auto adamw = torch::optim::AdamWOptions(o_.lr).weight_decay(0.01);
  const size_t bucket_cap = static_cast<size_t>(o_.bucket_cap_mb * (1 << 20));
  if (o_.zero == 3) {
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    for (auto& block : model_->blocks) units.push_back(block.ptr());
    // Hybrid sharding: shards within groups of --hsdp consecutive DP ranks (a node's, as ranks are
    // placed), replicated across the groups (each unit's gradient shard all-reduced over them).
    std::shared_ptr<loom::Communicator> shard_group = ps.dp_group();
    loom::FullyShardOptions fsdp_options;
    if (o_.hsdp > 0) {
      if (ps.dp_degree() % o_.hsdp != 0)
        throw refusal("--hsdp " + std::to_string(o_.hsdp) + " must divide the data-parallel degree " +
                      std::to_string(ps.dp_degree()));
      shard_group = ps.dp_group()->split(ps.dp_rank() / o_.hsdp, ps.dp_rank(), "hsdp-shard");
      fsdp_options.replicate = ps.dp_group()->split(ps.dp_rank() % o_.hsdp, ps.dp_rank(), "hsdp-replicate");
    }
    fsdp_ = std::make_unique<loom::FullyShardedDataParallel>(
        *model_, units, shard_group,
        [&](std::vector<torch::Tensor> shards) { return std::make_unique<torch::optim::AdamW>(shards, adamw); },
        fsdp_options);
    model_->fsdp = fsdp_.get();
  } else if (o_.zero > 0) {
    loom::ZeroOptions zero_options;
    zero_options.stage = o_.zero;
    zero_options.overlap_param_gather = o_.zero_overlap;
    zero_options.bucket_cap_bytes = bucket_cap;
    zero_options.first_bucket_cap_bytes = std::min(zero_options.first_bucket_cap_bytes, bucket_cap);
    zero_ = std::make_unique<loom::ZeroOptimizer>(
        model_->parameters(), ps.dp_group(),
        [&](std::vector<torch::Tensor> shard) { return std::make_unique<torch::optim::AdamW>(shard, adamw); },
        zero_options);
    if (o_.zero_overlap)
      model_->before_use = [zero = zero_.get()](const std::vector<torch::Tensor>& params) { zero->wait_parameters(params); };
  } else {
    loom::ReducerOptions reducer_options;
    reducer_options.bucket_cap_bytes = bucket_cap;
    reducer_options.first_bucket_cap_bytes = std::min(reducer_options.first_bucket_cap_bytes, bucket_cap);
    // A reducer per model chunk: each finalizes after its chunk's last backward of the step (with
    // virtual stages a rank's chunks finish at different times).
    for (const auto& params : chunk_parameters())
      plain_reducers_.push_back(std::make_unique<loom::GradientReducer>(params, ps.dp_group(), reducer_options));
    plain_opt_ = std::make_unique<torch::optim::AdamW>(model_->parameters(), adamw);
  }
  if (zero_) reducers_.push_back(&zero_->reducer());
  for (const auto& reducer : plain_reducers_) reducers_.push_back(reducer.get());
  // Fully sharded: every backward reduce-scatters into the gradient shards; no reducer to hold off.
  reducer_ = reducers_.empty() ? nullptr : reducers_.front();
  opt_ = fsdp_ ? &fsdp_->optimizer() : zero_ ? &zero_->optimizer() : plain_opt_.get();
  if (reducer_) accumulate_ = std::make_unique<loom::GradientAccumulator>(*reducer_, static_cast<size_t>(o_.accumulate));
  if (o_.scaler || o_.precision == "fp16") {
    loom::GradScalerOptions scaler_options;
    // Gradients are split over the TP group and the pipeline stages: found-inf is agreed over both.
    scaler_options.sync_groups = {ps.tp_group(), ps.pp_group()};
    scaler_ = std::make_unique<loom::GradScaler>(scaler_options);
    // Only the last stage scales the loss; the others' gradients come from its scaled backward.
    if (pipeline_ && !pipeline_->holds_last_stage()) scaler_->scaled_by_another_rank(device_);
  }
}

// What --zero 3 does not do yet, refused by name before anything is built.
void GptRun::refuse_what_fully_sharded_lacks() const {
  if (o_.pp > 1)
    throw refusal("--zero 3 with --pp " + std::to_string(o_.pp) +
                  ": fully sharded units inside pipeline stages are not built yet; use --zero 1 or 2 with --pp");
}

// Pipeline parallelism (--pp): this rank keeps the stages it computes (global stage c x pp + its
// pipeline rank for chunk c, as Megatron-Core places virtual stages) and an executor runs the
// schedule over the pipeline group. The step's micro-batches are its gradient accumulation.
void GptRun::build_pipeline() {
  if (o_.pp == 1) return;
  const loom::pp::Schedule schedule = loom::pp::parse_schedule(o_.schedule);
  if (o_.virtual_stages == 0) o_.virtual_stages = schedule == loom::pp::Schedule::Interleaved1F1B ? 2 : 1;
  if (o_.clip_grad_norm > 0 && o_.zero > 0)
    throw refusal("--clip-grad-norm with --zero and --pp " + std::to_string(o_.pp) +
                  ": ZeRO's clip_grad_norm sums over its DP group, not over the stages");
  // A reducer finalizes after each synchronized backward: with several chunks on a rank each
  // needs its own (plain data parallelism builds one per chunk; ZeRO's optimizer holds one).
  if (o_.virtual_stages > 1 && o_.zero > 0)
    throw refusal("--zero " + std::to_string(o_.zero) + " with --virtual-stages " +
                  std::to_string(o_.virtual_stages) +
                  ": ZeRO's optimizer reduces every chunk of a rank at once, and a rank's chunks "
                  "finish backward at different times; use --schedule 1f1b or gpipe with --zero");
  const int stages = o_.pp * o_.virtual_stages, layers = static_cast<int>(o_.layers);
  for (int c = 0; c < o_.virtual_stages; ++c) {
    const int s = c * o_.pp + ps_->pp_rank();
    const auto [first, end] = loom::pp::stage_layers(layers, stages, s);
    spans_.push_back({first, end, s == 0, s == stages - 1});
  }
  model_->keep_only(spans_);
  std::vector<loom::pp::StageFunction> chunks;
  for (const StageSpan& span : spans_)
    chunks.push_back([this, span](const torch::Tensor& x) {
      std::optional<loom::AutocastGuard> guard;
      autocast(guard);
      return model_->stage(span, x);
    });
  loom::pp::PipelineOptions options{
      .schedule = schedule, .micro_batches = static_cast<int>(o_.accumulate), .device = device_};
  // A stage's gradient reduction starts with its last backward of the step.
  options.before_backward = [this](int stage, int, bool last) { reducers_[stage / o_.pp]->set_sync(last); };
  pipeline_ = std::make_unique<loom::pp::PipelineExecutor>(ps_->pp_group(), std::move(chunks), options);
}

// The parameters of each model chunk this rank holds (without a pipeline: one, the whole model).
std::vector<std::vector<torch::Tensor>> GptRun::chunk_parameters() const {
  if (spans_.empty()) return {model_->parameters()};
  std::vector<std::vector<torch::Tensor>> chunks;
  for (const StageSpan& span : spans_) chunks.push_back(model_->parameters_of(span));
  return chunks;
}

std::vector<torch::Tensor> GptRun::bucket_buffers() const {
  std::vector<torch::Tensor> buffers;
  for (const auto* reducer : reducers_)
    for (const auto& b : reducer->bucket_buffers()) buffers.push_back(b);
  return buffers;
}

void GptRun::print_setup() const {
  if (!log_) return;
  int64_t parameters = 0;
  for (const auto& p : model_->parameters()) parameters += p.numel();
  const std::string pipeline = pipeline_ ? " x PP " + std::to_string(ps_->pp_degree()) : "";
  std::printf("train_gpt: %d ranks = TP %d%s x DP %d on %s; %s, %lld parameters on this rank\n", world_->size(),
              ps_->tp_degree(), pipeline.c_str(), ps_->dp_degree(), device_.str().c_str(), o_.precision.c_str(),
              (long long)parameters);
  if (!precision_why_.empty())
    std::printf("  precision %s%s\n", precision_why_.rfind("bf16 as asked", 0) == 0 ? "WARNING: " : "",
                precision_why_.c_str());
  std::printf("  data: %s, %zu bytes (%lld held out); %lld layers, hidden %lld, %lld heads, vocabulary %lld\n",
              corpus_.name.c_str(), corpus_.text.size(), (long long)corpus_.held_out_bytes, (long long)o_.layers,
              (long long)o_.hidden, (long long)o_.heads, (long long)vocab_);
  std::printf("  batch %lld x %lld bytes (%lld micro-batches per replica)%s%s\n", (long long)o_.batch,
              (long long)o_.seq, (long long)o_.accumulate, o_.sequence_parallel ? ", sequence-parallel" : "",
              o_.recompute ? ", blocks recomputed in backward" : "");
  if (pipeline_) {
    const auto& plan = pipeline_->plan();
    std::printf("  pipeline: %s over %d stages (%d per rank), %d micro-batches; the plan's bubble %.1f%% "
                "(a forward 1, a backward 2)\n",
                loom::pp::schedule_name(plan.schedule), plan.shape.stages(), plan.shape.virtual_stages,
                plan.shape.micro_batches, 100 * pipeline_->proof().bubble);
    for (int s = 0; s < plan.shape.stages(); ++s) {
      const auto [first, end] = loom::pp::stage_layers(static_cast<int>(o_.layers), plan.shape.stages(), s);
      std::printf("    stage %d (pipeline rank %d): %s%d block%s%s\n", s, plan.shape.rank_of_stage(s),
                  s == 0 ? "embedding, " : "", end - first, end - first == 1 ? "" : "s",
                  s + 1 == plan.shape.stages() ? ", final layernorm, head and loss" : "");
    }
  }
  // The placement plan the groups follow (with GPUs, or a topology file: LOOM_TOPOLOGY).
  if (rt_->plan()) std::printf("%s", loom::topo::explain(*rt_->plan(), 64 << 20).c_str());
  std::fflush(stdout);
}

// Autocast in the run's precision, for a forward pass (the chunks of a pipeline take it each).
void GptRun::autocast(std::optional<loom::AutocastGuard>& guard) const {
  if (o_.precision != "fp32" && !score_in_fp32_)
    guard.emplace(device_.type(), o_.precision == "fp16" ? at::kHalf : at::kBFloat16);
}

// The mean next-byte loss of windows `ids` [seq + 1, n]. On a pipeline: forward only through
// every stage; the loss is defined on the rank holding the last stage (elsewhere undefined).
torch::Tensor GptRun::loss_of(const torch::Tensor& ids) {
  torch::Tensor logits = output_of(ids.narrow(0, 0, o_.seq).to(device_));
  if (!logits.defined()) return logits;
  // (Sequence-parallel too: the head all-gathers the rows, so the logits cover the whole sequence.)
  torch::Tensor target = ids.narrow(0, 1, o_.seq);
  return loom::vocab_parallel_cross_entropy(logits.to(at::kFloat), target.to(device_), ps_->tp_group());
}

// The model's logits for `input`; on a pipeline only the last stage's rank has them.
torch::Tensor GptRun::output_of(const torch::Tensor& input) {
  if (!pipeline_) {
    std::optional<loom::AutocastGuard> guard;
    autocast(guard);
    return model_(input);
  }
  std::vector<torch::Tensor> outputs = pipeline_->forward_only({input});
  return outputs.empty() ? torch::Tensor() : outputs[0];
}

// What the rank holding the last pipeline stage computed, on every rank of the pipeline.
torch::Tensor GptRun::from_last_stage(torch::Tensor t) {
  if (!pipeline_) return t;
  const int last = ps_->pp_degree() - 1;  // the last stage's pipeline rank
  ps_->pp_group()->broadcast(t, {last})->wait();
  return t;
}
double GptRun::from_last_stage(double v) {
  return from_last_stage(torch::full({1}, v, torch::dtype(torch::kFloat64).device(device_))).item<double>();
}

// Mean over DP replicas of a value each computed on its share (on a pipeline, its last stage's).
double GptRun::replica_mean(double v) {
  torch::Tensor t = torch::full({1}, from_last_stage(v), torch::dtype(torch::kFloat64).device(device_));
  ps_->dp_group()->all_reduce(t, {loom::ReduceOp::Avg})->wait();
  return t.item<double>();
}

// Held-out loss: the first --eval-batches x --batch contiguous windows of the held-out text (the
// same bytes every time, and the ones the n-gram baselines are scored on), no dropout.
void GptRun::prepare_evaluation() {
  held_windows_ =
      std::max<int64_t>(1, std::min<int64_t>(o_.eval_batches * o_.batch, (corpus_.held_out_bytes - 1) / o_.seq));
  held_batch_ = corpus_.held_ids.index(
      {torch::arange(o_.seq + 1).unsqueeze(1) + torch::arange(held_windows_).unsqueeze(0) * o_.seq});
  // What count models reach on the same held-out bytes (rank 0 prints them).
  if (!log_ && !o_.must_beat_trigram) return;
  std::vector<size_t> targets;
  for (int64_t w = 0; w < held_windows_; ++w)
    for (int64_t i = 1; i <= o_.seq; ++i) targets.push_back(static_cast<size_t>(corpus_.train_bytes + w * o_.seq + i));
  const std::string_view training(corpus_.text.data(), static_cast<size_t>(corpus_.train_bytes));
  for (int order : {1, 2, 3}) baselines_.push_back(KneserNey(training, order).nats_per_byte(corpus_.text, targets));
  if (!log_) return;
  std::printf("  held-out baselines (Kneser-Ney count models, nats per byte on the same %lld bytes): unigram %.4f, "
              "bigram %.4f, trigram %.4f\n",
              (long long)(held_windows_ * o_.seq), baselines_[0], baselines_[1], baselines_[2]);
  std::fflush(stdout);
}

double GptRun::held_out_loss() {
  torch::NoGradGuard no_grad;
  model_->eval();
  double sum = 0;
  for (int64_t first = 0; first < held_windows_; first += o_.batch) {
    const int64_t n = std::min<int64_t>(o_.batch, held_windows_ - first);
    const torch::Tensor loss = loss_of(held_batch_.narrow(1, first, n));
    if (loss.defined()) sum += loss.item<double>() * static_cast<double>(n);
  }
  model_->train();
  return from_last_stage(sum) / static_cast<double>(held_windows_);  // every replica scores the same windows
}

// What recomputation saves: the heap a forward pass keeps for backward, with and without.
void GptRun::measure_recompute() {
  if (!o_.recompute || pipeline_) return;  // (a pipeline's stages keep what their schedule holds)
  torch::Tensor w = windows(corpus_.train_ids, o_.seq, per_replica_, o_.seed).to(device_);
  auto kept = [&](bool on) {
    model_->set_recompute(on);
    const size_t before = heap_in_use();
    torch::Tensor loss = loss_of(w);
    const size_t after = heap_in_use();
    return after > before ? after - before : 0;
  };
  const double without = kept(false) / 1e6, with = kept(true) / 1e6;
  model_->set_recompute(true);
  if (log_ && !on_gpu_)
    std::printf("  activations kept for backward: %.1f MB per rank without recomputation, %.1f MB with (%.0f%% less)\n",
                without, with, without > 0 ? 100 * (1 - with / without) : 0.0);
}

void GptRun::open_checkpointer() {
  if (o_.checkpoint_dir.empty()) return;
  loom::CheckpointOptions options;
  options.directory = o_.checkpoint_dir;
  checkpointer_ = std::make_unique<loom::Checkpointer>(world_, options);  // host-side agreement over MPI
  // The tracker the model draws from (on a GPU its device's: its dropout streams must resume too).
  // A ZeRO or fully sharded run's checkpoint is in the plain format: it resumes with or without
  // --zero, at any DP size.
  checkpointer_->model(model_).rng(on_gpu_ ? *device_rng_ : loom::rng_tracker()).accumulator(*accumulate_);
  if (fsdp_)
    checkpointer_->optimizer(*fsdp_);
  else if (zero_)
    checkpointer_->optimizer(*zero_);
  else
    checkpointer_->optimizer(*opt_);
  if (scaler_) checkpointer_->scaler(*scaler_);
  // Which stage (and TP and DP rank) wrote what: a checkpoint loads at another pipeline size.
  checkpointer_->parallel_layout(ps_->layout(), ps_->groups().position);
  if (!o_.resume) return;
  if (auto info = checkpointer_->load_latest()) {
    first_step_ = info->progress.step + 1;
    auto saved_first = info->user.find("first_loss");
    if (saved_first != info->user.end()) first_ = std::stod(saved_first->second);
    if (log_) std::printf("resumed from %s at step %lld\n", info->path.c_str(), (long long)info->progress.step);
  } else if (log_) {
    std::printf("no checkpoint in %s: starting fresh\n", o_.checkpoint_dir.c_str());
  }
}

void GptRun::train_steps() {
  // Prometheus metrics per rank where LOOM_METRICS asks for them (file:DIR or port:N).
  metrics_ = std::make_unique<loom::MetricsExporter>(
      loom::MetricsOptions{.world = rt_->world(), .cuda_device = rt_->cuda_device(), .target = rt_->config().metrics,
                           .interval_seconds = rt_->config().metrics_interval});
  // Ranks under mpirun write to a pseudo-terminal whatever mpirun writes to, so "auto" can be wrong
  // in a log: scripts/run_demo.sh passes --progress lines when its own output is not a terminal.
  live_ = log_ && (o_.progress == "live" || (o_.progress == "auto" && isatty(fileno(stdout))));
  exposed_at_start_ = exposed();
  start_ = Clock::now();
  // The loss curve (rank 0): training loss at every logged step, held-out loss at every evaluation.
  if (log_ && !o_.loss_csv.empty()) {
    curve_.reset(std::fopen(o_.loss_csv.c_str(), o_.resume ? "a" : "w"));
    if (!curve_) throw refusal("cannot write --loss-csv " + o_.loss_csv);
    if (!o_.resume || std::ftell(curve_.get()) == 0) std::fprintf(curve_.get(), "step,loss,held_out_loss\n");
  }
  for (int64_t step = first_step_; step <= o_.steps; ++step) {
    const auto step_start = Clock::now();
    const double exposed_before = exposed();
    const uint64_t communicated_before = communicated();
    const double step_loss = train_step(step);
    report_progress(step, step_loss);
    if ((o_.eval_every > 0 && step % o_.eval_every == 0) || step == o_.steps) evaluate(step);
    double checkpoint_stall = 0;
    if (checkpointer_ && ((o_.save_every > 0 && step % o_.save_every == 0) || step == o_.steps))
      checkpoint_stall = save(step);
    metrics_->record({.step = step,
                      .step_seconds = seconds_since(step_start),
                      .tokens = per_replica_ * o_.seq,
                      .loss = step_loss,
                      .exposed_communication_seconds = exposed() - exposed_before,
                      .bytes_communicated = communicated() - communicated_before,
                      .checkpoint_stall_seconds = checkpoint_stall});
  }
  metrics_->flush();
  if (checkpointer_) {
    const auto wait_start = Clock::now();
    checkpointer_->wait();
    time_.checkpoint += seconds_since(wait_start);
  }
  total_ = seconds_since(start_);
  time_.exposed_comm = exposed() - exposed_at_start_;
}

double GptRun::train_step(int64_t step) {
  const auto step_start = Clock::now();
  torch::Tensor batch = windows(corpus_.train_ids, o_.seq, o_.batch, o_.seed * 7919 + step)
                            .narrow(1, ps_->dp_rank() * per_replica_, per_replica_);
  time_.data += seconds_since(step_start);

  const double warm = std::max(1.0, o_.warmup * o_.steps);
  for (auto& group : opt_->param_groups())
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(o_.lr * std::min(1.0, step / warm));
  for (auto* reducer : reducers_) reducer->zero_grad();
  if (fsdp_) fsdp_->zero_grad();
  const double step_loss = pipeline_ ? pipeline_step(batch) : accumulated_step(batch);
  if (o_.clip_grad_norm > 0) clip_gradients();
  if (scaler_) {
    fsdp_ ? scaler_->step(*fsdp_) : zero_ ? scaler_->step(*zero_) : scaler_->step(*opt_);
    scaler_->update();
  } else if (fsdp_) {
    fsdp_->step();
  } else if (zero_) {
    zero_->step();
  } else {
    opt_->step();
  }
  window_ += step_loss;
  ++window_steps_;
  time_.step += seconds_since(step_start);
  return step_loss;
}

// Clipping by the global norm over every stage and TP slice (after unscaling: the norm is the true
// gradients'). ZeRO and FSDP clip their shards over the DP group and the TP slices over the TP
// group (one stage: refused with --pp).
void GptRun::clip_gradients() {
  if (fsdp_) {
    if (scaler_) scaler_->unscale_(*fsdp_);
    fsdp_->clip_grad_norm(o_.clip_grad_norm, *model_, ps_->tp_group());
    return;
  }
  if (zero_) {
    if (scaler_) scaler_->unscale_(*zero_);
    zero_->clip_grad_norm(o_.clip_grad_norm, *model_, ps_->tp_group());
    return;
  }
  if (scaler_) scaler_->unscale_(*opt_);
  loom::clip_grad_norm(*model_, o_.clip_grad_norm, ps_->tp_group(), ps_->pp_group());
}

// The step's micro-batches one after another (gradient accumulation): only the last one's backward
// reduces over the replicas.
double GptRun::accumulated_step(const torch::Tensor& batch) {
  double step_loss = 0;
  const auto micros = batch.chunk(o_.accumulate, 1);
  for (size_t m = 0; m < micros.size(); ++m) {
    const torch::Tensor& micro = micros[m];
    auto scope = accumulate_ ? std::optional(accumulate_->next()) : std::nullopt;
    // Fully sharded: the gradients stay whole until the last micro-batch reduces their sum, as
    // plain data parallelism adds them up (reducing each and adding the averages rounds otherwise).
    auto whole = fsdp_ && m + 1 < micros.size() ? std::optional(fsdp_->no_sync()) : std::nullopt;
    torch::Tensor loss = loss_of(micro) / double(o_.accumulate);
    if (scaler_)
      scaler_->scale(loss).backward();
    else
      loss.backward();
    step_loss += loss.item<double>();
  }
  return step_loss;
}

// One step through the pipeline: the micro-batches enter at the first stage, their losses (divided
// by their number, scaled when a scaler runs) start backward at the last. Returns this rank's share
// of the step's loss: the sum on the last stage, 0 elsewhere.
double GptRun::pipeline_step(const torch::Tensor& batch) {
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
  for (const auto& micro : batch.chunk(o_.accumulate, 1)) {
    inputs.push_back(micro.narrow(0, 0, o_.seq).to(device_));
    targets.push_back(micro.narrow(0, 1, o_.seq).to(device_));
  }
  double step_loss = 0;
  pipeline_->step(inputs, [&](const torch::Tensor& logits, int m) {
    torch::Tensor loss =
        loom::vocab_parallel_cross_entropy(logits.to(at::kFloat), targets[m], ps_->tp_group()) / double(o_.accumulate);
    step_loss += loss.item<double>();
    return scaler_ ? scaler_->scale(loss) : loss;
  });
  const auto& times = pipeline_->last_step();
  time_.pipeline_wait += times.communicate;
  bubbles_.push_back(times.seconds > 0 ? times.communicate / times.seconds : 0);
  return step_loss;
}

void GptRun::report_progress(int64_t step, double step_loss) {
  const bool log_step = step == first_step_ || step % o_.log_every == 0 || step == o_.steps;
  if (!log_step && !live_) return;
  // (A live line between logged steps shows this rank's loss: on a pipeline, the last logged mean
  // unless this rank holds the loss, since only logged steps bring the last stage's value over.)
  const double mean = log_step                                              ? replica_mean(window_ / window_steps_)
                      : pipeline_ && !pipeline_->holds_last_stage() ? last_
                                                                            : step_loss;
  if (step == 1) first_ = mean;
  if (log_step) last_ = mean;
  const double elapsed = seconds_since(start_);
  const double done = static_cast<double>(step - first_step_ + 1);
  const double tokens_per_s = done * o_.batch * o_.seq / elapsed;
  const double eta = elapsed / done * static_cast<double>(o_.steps - step);
  if (log_) {
    char line[256];
    std::snprintf(line, sizeof(line), "step %5lld/%lld  loss %.*f | %s tok/s | ETA %s", (long long)step,
                  (long long)o_.steps, o_.loss_digits, mean,
                  tokens_per_s >= 1e4 ? (std::to_string(int(tokens_per_s / 1e3)) + "k").c_str()
                                      : std::to_string(int(tokens_per_s)).c_str(),
                  duration_text(eta).c_str());
    if (live_)  // redrawn in place; a newline only on the logged steps
      std::printf("\r%s\x1b[K%s", line, log_step ? "\n" : "");
    else
      std::printf("%s\n", line);
    std::fflush(stdout);
  }
  if (log_step) {
    window_ = 0;
    window_steps_ = 0;
    if (curve_) std::fprintf(curve_.get(), "%lld,%.6f,\n", (long long)step, mean);
  }
}

void GptRun::evaluate(int64_t step) {
  const auto eval_start = Clock::now();
  held_ = held_out_loss();
  time_.eval += seconds_since(eval_start);
  if (log_) {
    std::printf("step %5lld/%lld  held-out loss %.4f\n", (long long)step, (long long)o_.steps, held_);
    std::fflush(stdout);
  }
  if (curve_) std::fprintf(curve_.get(), "%lld,,%.6f\n", (long long)step, held_);
}

double GptRun::save(int64_t step) {
  const auto save_start = Clock::now();
  char first_text[32];
  std::snprintf(first_text, sizeof(first_text), "%.17g", first_);
  // The model's shape rides along, so that an export need not be told it.
  checkpointer_->save({.step = step, .epoch = 0, .sample = step * o_.batch},
                      {{"first_loss", first_text},
                       {"gpt.layers", std::to_string(o_.layers)},
                       {"gpt.hidden", std::to_string(o_.hidden)},
                       {"gpt.heads", std::to_string(o_.heads)},
                       {"gpt.seq", std::to_string(o_.seq)},
                       {"gpt.vocab", std::to_string(vocab_)},
                       {"gpt.activation", "gelu"},
                       {"gpt.layernorm_eps", "1e-05"}});
  const double stall = seconds_since(save_start);
  time_.checkpoint += stall;
  return stall;
}

// Where the time went, averaged over the ranks.
void GptRun::report_time() {
  torch::Tensor shares =
      torch::tensor(
          {time_.data, time_.step, time_.exposed_comm, time_.checkpoint, time_.eval, total_, time_.pipeline_wait},
          torch::kFloat64)
          .to(device_);
  comm_->all_reduce(shares, {loom::ReduceOp::Avg})->wait();
  shares = shares.cpu();
  auto s = shares.accessor<double, 1>();
  const double compute = std::max(0.0, s[1] - s[0] - s[2] - s[6]);
  if (!log_ || first_step_ > o_.steps) return;
  const double n = static_cast<double>(o_.steps - first_step_ + 1);
  std::printf("where the time went (mean over ranks, %.1f s, %.0f ms per step):\n", s[5], 1e3 * s[5] / n);
  auto row = [&](const char* what, double v) {
    std::printf("  %-24s %8.2f s  %5.1f%%\n", what, v, s[5] > 0 ? 100 * v / s[5] : 0.0);
  };
  row("compute", compute);
  // On GPUs a wait orders the CUDA stream and returns at once: the host cannot time it.
  uint64_t unmeasured = loom::tp::comm_stats().unmeasured_waits;
  for (const auto* reducer : reducers_) unmeasured += reducer->stats().unmeasured_iterations;
  if (unmeasured > 0)
    std::printf("  %-24s   (not measured: NCCL waits are stream-ordered; in 'compute')\n", "exposed communication");
  else
    row("exposed communication", s[2]);
  if (pipeline_) {
    // Waiting in the pipeline's message groups: the schedule's bubble, and the transfers.
    row("pipeline bubble", s[6]);
    std::vector<double> b = bubbles_;
    std::nth_element(b.begin(), b.begin() + b.size() / 2, b.end());
    std::printf("  %-24s (rank 0: %.1f%% of its median step; the plan promises %.1f%% at equal stage costs)\n", "",
                b.empty() ? 0.0 : 100 * b[b.size() / 2], 100 * pipeline_->proof().bubble);
  }
  row("checkpoint stall", s[3]);
  row("data", s[0]);
  row("held-out evaluation", s[4]);
  row("other (logging, sync)", std::max(0.0, s[5] - compute - s[2] - s[3] - s[0] - s[4] - s[6]));
}

// Training state held per rank, counted from the live tensors' storages.
void GptRun::report_memory() const {
  if (fsdp_) fsdp_->reshard();  // the root stays gathered after the last evaluation's forward
  const loom::ZeroMemory m = fsdp_   ? fsdp_->memory()
                             : zero_ ? zero_->memory()
                                     : loom::count_training_memory(model_->parameters(), bucket_buffers(), opt_);
  int64_t numel = 0;
  for (const auto& p : model_->parameters()) numel += p.numel();
  if (log_)
    std::printf("training state per rank (%s over %d replicas, %.2f M parameters on this rank): parameters %.1f MB, "
                "gradients %.1f MB, optimizer state %.1f MB; %.2f bytes per parameter\n",
                fsdp_ && o_.hsdp > 0 ? ("hybrid sharded data parallelism (shards over " + std::to_string(o_.hsdp) +
                                         " ranks)").c_str()
                : fsdp_ ? "fully sharded data parallelism (ZeRO stage 3)"
                : zero_ ? ("ZeRO stage " + std::to_string(o_.zero)).c_str()
                        : "plain data parallelism",
                ps_->dp_degree(),
                numel / 1e6, m.parameters / 1e6, m.gradients / 1e6, m.optimizer_state / 1e6,
                double(m.parameters + m.gradients + m.optimizer_state) / double(numel));
}

// A sample: continue a held-out prompt, sampling at temperature 0.8 from a generator seeded the
// same on every rank (each needs the same next byte). The last position's logits are gathered
// over the TP group.
std::string GptRun::generate_sample() {
  model_->eval();
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o_.seed + 99);
  const int64_t prompt = std::min<int64_t>(o_.seq / 2, corpus_.held_out_bytes);
  const torch::Tensor& held = corpus_.held_ids;
  std::vector<int64_t> context(held.data_ptr<int64_t>(), held.data_ptr<int64_t>() + prompt);
  std::string sample(corpus_.text.begin() + corpus_.train_bytes, corpus_.text.begin() + corpus_.train_bytes + prompt);
  const int64_t step_rows = o_.sequence_parallel ? ps_->tp_degree() : 1;
  for (int64_t i = 0; i < o_.sample_bytes; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(context.size()), o_.seq) / step_rows * step_rows;
    torch::Tensor ids = torch::tensor(std::vector<int64_t>(context.end() - n, context.end())).unsqueeze(1).to(device_);
    torch::Tensor logits = output_of(ids), last = torch::zeros({256}, torch::dtype(torch::kFloat).device(device_));
    if (logits.defined())  // (on a pipeline, the last stage's ranks)
      last = loom::tp::gather_from_region(logits[n - 1][0].to(at::kFloat), ps_->tp_group()).narrow(0, 0, 256);
    logits = from_last_stage(last).cpu();
    const int64_t next = torch::multinomial(torch::softmax(logits / 0.8, 0), 1, false, gen).item<int64_t>();
    context.push_back(next);
    sample += static_cast<char>(next);
  }
  return sample;
}

// The mean next-byte loss over the first --score-windows contiguous windows of a file, in fp32
// without dropout: the number an exported model (export --format hf-gpt2) must reproduce.
void GptRun::score_file() {
  if (o_.score.empty()) return;
  std::ifstream in(o_.score, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t count = std::min<int64_t>(o_.score_windows, (static_cast<int64_t>(bytes.size()) - 1) / o_.seq);
  if (count < 1)
    throw refusal("--score " + o_.score + " holds " + std::to_string(bytes.size()) +
                  " bytes; expected at least --seq + 1 = " + std::to_string(o_.seq + 1));
  torch::Tensor ids = torch::empty({o_.seq + 1, count}, torch::kLong);
  for (int64_t w = 0; w < count; ++w)
    for (int64_t i = 0; i <= o_.seq; ++i) ids[i][w] = static_cast<int64_t>(static_cast<unsigned char>(bytes[w * o_.seq + i]));
  torch::NoGradGuard no_grad;
  model_->eval();
  score_in_fp32_ = true;
  const torch::Tensor loss = loss_of(ids);
  score_in_fp32_ = false;
  const double score = from_last_stage(loss.defined() ? loss.item<double>() : 0.0);
  if (log_)
    std::printf("score %s: %lld windows of %lld bytes, loss %.9f\n", o_.score.c_str(), (long long)count,
                (long long)o_.seq, score);
}

// The exit status: 0 when the model learned (below the trigram baseline with --must-beat-trigram,
// else a final loss under 60% of the first).
int GptRun::verdict(const std::string& sample) const {
  const bool beat_trigram = baselines_.size() == 3 && held_ < baselines_[2];
  const bool learned = o_.must_beat_trigram ? beat_trigram : last_ < 0.6 * first_;
  if (!log_) return learned ? 0 : 1;
  std::printf("sample (prompt from the held-out text, then generated):\n----\n%s\n----\n", printable(sample).c_str());
  if (baselines_.size() == 3)
    std::printf("held-out loss %.4f (count models: unigram %.4f, bigram %.4f, trigram %.4f)\n", held_, baselines_[0],
                baselines_[1], baselines_[2]);
  else
    std::printf("held-out loss %.4f\n", held_);
  std::printf("final loss %.17g\n", last_);
  if (o_.must_beat_trigram)
    std::printf("first loss %.4f, final loss %.4f; held-out loss %.4f against the trigram count model's %.4f: %s\n",
                first_, last_, held_, baselines_.empty() ? std::nan("") : baselines_[2],
                learned ? "OK, below the trigram baseline" : "FAILED, not below the trigram baseline");
  else
    std::printf("first loss %.4f, final loss %.4f (%.1f%% of first): %s\n", first_, last_, 100 * last_ / first_,
                learned ? "OK, the loss fell below 60% of its start" : "FAILED, the loss did not fall below 60%");
  return learned ? 0 : 1;
}

int train(Options o) { return GptRun(std::move(o), loom::init()).run(); }

}  // namespace

namespace {

// The model's shape and the optimisation: what a run trains.
void add_model_options(CLI::App& app, Options& o) {
  app.add_option("--tp", o.tp, "tensor-parallel degree (default: LOOM_TP when set, else 2 on an even world, else 1)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "global batch (sequences per step, split over DP replicas)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "bytes per sequence")->check(CLI::PositiveNumber);
  app.add_option("--hidden", o.hidden, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", o.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--dropout", o.dropout, "attention and hidden dropout")->check(CLI::Range(0.0, 0.9));
  app.add_option("--lr", o.lr, "AdamW learning rate")->check(CLI::PositiveNumber);
  app.add_option("--clip-grad-norm", o.clip_grad_norm,
                 "clip the gradients' global norm (over every stage and TP slice) to this; 0: no clipping")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--log-every", o.log_every, "log a line every this many steps")->check(CLI::PositiveNumber);
  app.add_option("--eval-every", o.eval_every, "held-out loss every this many steps (0: only at the end)")
      ->check(CLI::NonNegativeNumber);
}

// Everything else: the data, precision and parallelism, checkpoints and output.
void add_run_options(CLI::App& app, Options& o) {
  app.add_option("--loss-csv", o.loss_csv, "write the loss curve (step, training loss, held-out loss) to this CSV");
  app.add_flag("--must-beat-trigram", o.must_beat_trigram,
               "exit status 0 only when the final held-out loss is below the trigram count model's (the main job)");
  app.add_option("--score", o.score, "at the end, print the fp32 loss over contiguous windows of this file");
  app.add_option("--score-windows", o.score_windows, "windows of --seq bytes scored")->check(CLI::PositiveNumber);
  app.add_option("--data", o.data,
                 "text file, or directory of text files (default: examples/data/licenses.txt, see its SOURCES.md)");
  app.add_option("--data-bytes", o.data_bytes, "read at most this many bytes of --data")->check(CLI::PositiveNumber);
  app.add_option("--held-out", o.held_out, "share of the text kept for the held-out loss")->check(CLI::Range(0.01, 0.5));
  app.add_option("--seed", o.seed, "seed of the batches, the weights and dropout");
  app.add_option("--accumulate,--micro-batches", o.accumulate,
                 "micro-batches per step (gradient accumulation; with --pp, the pipeline's micro-batches)")
      ->check(CLI::PositiveNumber);
  app.add_option("--pp", o.pp, "pipeline stages (default: LOOM_PP when set, else 1)")->check(CLI::NonNegativeNumber);
  app.add_option("--schedule", o.schedule, "pipeline schedule with --pp: gpipe, 1f1b, interleaved or zero-bubble")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zero-bubble"}));
  app.add_option("--virtual-stages", o.virtual_stages,
                 "model chunks per pipeline rank (interleaved: 2 or more; default 2 with it, else 1)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--precision", o.precision,
                 "auto (fp16 + GradScaler on a GPU; on a CPU bf16 where it has bf16 arithmetic, else fp32), fp32, bf16 "
                 "or fp16")
      ->check(CLI::IsMember({"auto", "fp32", "bf16", "fp16"}));
  app.add_flag("--scaler", o.scaler, "scale the loss with loom::GradScaler whatever the precision");
  app.add_option("--zero", o.zero,
                 "ZeRO over the data-parallel group: 1 shards the optimizer state, 2 the gradients too, 3 the "
                 "parameters too (loom::FullyShardedDataParallel, a unit per block)")
      ->check(CLI::Range(0, 3));
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "gradient bucket size (the first bucket: 1 MB or this)")
      ->check(CLI::Range(0.001, 1024.0));
  app.add_option("--hsdp", o.hsdp,
                 "with --zero 3: hybrid sharding, each parameter sharded over groups of this many data-parallel "
                 "ranks (a node's) and replicated across the groups; 0: sharded over all")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--zero-overlap", o.zero_overlap,
               "with --zero: step() leaves the parameter all-gathers running; each layer waits for its own in forward");
  app.add_flag("--sequence-parallel", o.sequence_parallel, "layernorm and dropout on sequence shards");
  app.add_flag("--recompute", o.recompute, "recompute each block in backward (less activation memory)");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "save checkpoints here (every --save-every steps and at the end)");
  app.add_option("--save-every", o.save_every, "steps between checkpoints (0: only at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", o.resume, "continue from the newest complete checkpoint in --checkpoint-dir, if any");
  app.add_option("--timeline", o.timeline, "write a Chrome-trace timeline per rank to PREFIX.rank<r>.json");
  app.add_flag("--all-ranks", o.all_ranks, "every rank prints, not only rank 0");
  app.add_option("--progress", o.progress, "live (one line redrawn in place), lines (a line per --log-every) or auto")
      ->check(CLI::IsMember({"auto", "live", "lines"}));
  app.add_option("--sample-bytes", o.sample_bytes, "bytes of text to generate at the end")->check(CLI::NonNegativeNumber);
  app.add_option("--loss-digits", o.loss_digits, "decimals of the logged loss")->check(CLI::Range(1, 17));
  app.add_flag("--deterministic", o.deterministic,
               "deterministic kernels only (bit-for-bit repeatable on GPU, where some kernels add atomically)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPT-style byte-level language model with tensor x pipeline x data parallelism (torchloom)"};
  Options o;
  add_model_options(app, o);
  add_run_options(app, o);
  CLI11_PARSE(app, argc, argv);
  if (o.resume && o.checkpoint_dir.empty()) {
    std::fprintf(stderr, "train_gpt: --resume needs --checkpoint-dir\n");
    return 2;
  }
  if (o.hsdp > 0 && o.zero != 3) {
    std::fprintf(stderr, "train_gpt: --hsdp needs --zero 3\n");
    return 2;
  }
  if (o.zero_overlap && (o.zero == 0 || o.zero == 3)) {
    std::fprintf(stderr, "train_gpt: --zero-overlap needs --zero 1 or 2\n");
    return 2;
  }

  torch::set_num_threads(1);  // ranks share the cores
  if (o.deterministic) {
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);  // before cuBLAS starts: its deterministic mode
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  }
  int status = 1;
  try {
    status = train(o);
  } catch (const std::exception& e) {
    // Leaving without finalizing makes mpirun end the other ranks instead of letting them hang;
    // exit code 1, as when torchloom ends the job itself (MPI_Abort), whichever rank reports first.
    const std::string what = e.what();  // train_gpt's own refusals name it already ("[rank 1] train_gpt: ...")
    std::fprintf(stderr, "%s%s\n", what.find("train_gpt: ") != std::string::npos ? "" : "train_gpt: ", what.c_str());
    return 1;
  }
  loom::finalize();
  return status;
}
