// ParallelState: checks the layout and the model's dimensions, then builds the TP and DP groups.
#include "loom/error.h"
#include "loom/comm/agreement.h"
#include "loom/parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_util.h"

namespace loom {

namespace {
ParallelConfig with_degree(int tensor_parallel) {
  ParallelConfig config;
  config.tensor_parallel = tensor_parallel;
  return config;
}
}  // namespace

ParallelState::ParallelState(std::shared_ptr<Communicator> world, int tensor_parallel)
    : ParallelState(std::move(world), with_degree(tensor_parallel)) {}

ParallelState::ParallelState(std::shared_ptr<Communicator> world, const ParallelConfig& config)
    : world_(std::move(world)) {
  if (!world_) throw InvalidArgumentError(ErrorContext("ParallelState")("the world communicator is null"));
  const std::string where = ErrorContext("ParallelState").prefix();
  const int t = config.tensor_parallel;
  // Every check is local and the same on every rank, so all ranks raise together before any
  // collective is entered: no rank is left waiting in make_parallel_groups.
  if (t < 1)
    throw InvalidArgumentError(where + ": the tensor-parallel degree must be at least 1; found " + std::to_string(t));
  if (world_->size() % t != 0)
    throw InvalidArgumentError(where + ": world size must be divisible by the tensor-parallel degree " +
                               std::to_string(t) + "; found " + std::to_string(world_->size()) + " ranks (" +
                               std::to_string(world_->size()) + " % " + std::to_string(t) + " = " +
                               std::to_string(world_->size() % t) + ")");
  // The layout checks the degrees against the world (on every rank alike) and names the dimension.
  const ParallelLayout layout = ParallelLayout::standard(world_->size(), t, config.pipeline_parallel, config.layout_order);
  if (config.hidden_size) detail::require_divisible(where, "hidden size", config.hidden_size, t);
  if (config.num_heads) detail::require_divisible(where, "number of attention heads", config.num_heads, t);
  if (config.ffn_hidden_size) detail::require_divisible(where, "MLP hidden size", config.ffn_hidden_size, t);
  if (config.vocab_size)
    detail::require_divisible(where, "vocabulary size (pad it with loom::padded_vocab_size)", config.vocab_size, t);
  if (config.hidden_size && config.num_heads && config.hidden_size % config.num_heads != 0)
    throw InvalidArgumentError(where + ": hidden size must be divisible by the number of attention heads " +
                               std::to_string(config.num_heads) + "; found " + std::to_string(config.hidden_size));
  agree_on_config(config);
  GroupRings rings;
  if (!config.dp_rings.empty()) rings[std::string(kDataParallelDim)] = config.dp_rings;
  groups_ = make_parallel_groups(*world_, layout, config.order, rings);
}

// Ranks built with different configurations would split into groups that do not match (and wait
// for each other until the timeout): one small exchange first names the difference.
void ParallelState::agree_on_config(const ParallelConfig& config) const {
  const int n = world_->size();
  if (n == 1) return;
  const uint64_t order_hash = fnv1a(config.order.data(), config.order.size() * sizeof(int));
  const uint64_t layout_hash = fnv1a(config.layout_order.data(), config.layout_order.size());
  const int64_t mine[] = {config.tensor_parallel,  config.pipeline_parallel,           config.hidden_size,
                          config.num_heads,        config.ffn_hidden_size,             config.vocab_size,
                          static_cast<int64_t>(layout_hash), static_cast<int64_t>(order_hash)};
  const char* names[] = {"tensor_parallel", "pipeline_parallel", "hidden_size", "num_heads",
                         "ffn_hidden_size", "vocab_size",        "layout_order", "order"};
  constexpr int kFields = 8;
  const std::vector<int64_t> words = all_gather_values(*world_, mine, {"ParallelState agreement"});
  for (int f = 0; f < kFields; ++f)
    for (int r = 0; r < n; ++r)
      if (words[r * kFields + f] != mine[f]) {
        // The last two are hashes: say what this rank has and that the other's differs.
        const std::string here = f == kFields - 1   ? std::string("a different permutation")
                                 : f == kFields - 2 ? "\"" + config.layout_order + "\""
                                                    : std::to_string(mine[f]);
        const std::string there = f >= kFields - 2 ? std::string("another") : std::to_string(words[r * kFields + f]);
        throw MismatchError(ErrorContext("ParallelState")(std::string("ranks were built with different configurations: ") +
                                                          names[f] + " is " + here + " on this rank but " + there +
                                                          " on rank " + std::to_string(r)));
      }
}

void ParallelState::seed(uint64_t seed, RngTracker& tracker) const { model_parallel_seed(seed, tp_rank(), tracker); }

void ParallelState::require_divisible(const std::string& what, int64_t value) const {
  detail::require_divisible(ErrorContext("ParallelState").prefix(), what, value, tp_degree());
}

int64_t padded_vocab_size(int64_t vocab, int tp_degree, int64_t multiple) {
  if (vocab <= 0 || tp_degree < 1 || multiple < 1)
    throw InvalidArgumentError(ErrorContext("padded_vocab_size")("expected vocab > 0, tp_degree >= 1, multiple >= 1; found ") +
                               std::to_string(vocab) + ", " + std::to_string(tp_degree) + ", " +
                               std::to_string(multiple));
  const int64_t step = tp_degree * multiple;
  return (vocab + step - 1) / step * step;
}

}  // namespace loom
