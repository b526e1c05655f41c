#include "loom/env.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "loom/error.h"

namespace loom::env {

const std::vector<Variable>& all_variables() {
  // Never destroyed: read by threads that may outlive static destruction.
  static const auto& table = *new std::vector<Variable>{
      {"LOOM_LOG_LEVEL", "warn", "Log level: trace, debug, info, warn, error or off. Every line carries [rank r/n]."},
      {"LOOM_TIMEOUT", "600",
       "Default timeout of every communication operation, in seconds (0.001 to 86400). A per-call timeout in the "
       "options overrides it."},
      {"LOOM_ON_ERROR", "abort",
       "After an operation times out or fails, its error is raised to the waiter and logged; then abort ends the "
       "whole job (device communicators aborted, then MPI_Abort) so that no rank hangs, while raise breaks only the "
       "communicator (later calls on it raise loom::CommError at once; a device communicator is aborted so its "
       "stream is released)."},
      {"LOOM_ABORT_GRACE", "2",
       "Seconds between reporting a fatal error and aborting the job (0 to 600), so the waiting thread can raise and "
       "log it first."},
      {"LOOM_CHECK_COLLECTIVES", "0",
       "1: before every collective the ranks exchange a fingerprint (operation, sequence number, dtype, element "
       "count, reduce op, root) and raise loom::MismatchError showing both sides when they differ. One small "
       "all-gather per collective: for debugging."},
      {"LOOM_SIZE_CHECK_BYTES", "256",
       "Host (MPI) collectives that move at least this many bytes (the larger of input and output) first agree on "
       "the rolling fingerprint and element count (a 64-byte exchange), so ranks that pass different sizes get "
       "loom::MismatchError naming both: Open MPI writes past the smaller rank's buffer once a peer's messages pass "
       "its eager limit, even when that rank passed only 256 bytes; no write past a buffer was seen with every rank "
       "below 256 bytes. All-reduces up to 256 KB are checked at any size, in their own messages (as quick as "
       "unchecked), unless this is set above 256 KB (0 to 2^40; 0 checks every collective)."},
      {"LOOM_FINGERPRINT_INTERVAL", "1024",
       "Every this many collectives on a communicator the ranks compare their rolling fingerprint of every earlier "
       "call (operation, dtype, element count, reduce op, root), so a divergence is reported near where it began "
       "(0 to 2^31; 0: only before large host collectives and timeouts)."},
      {"LOOM_STALL_WARNING", "0.25",
       "Fraction of an operation's timeout after which a still-pending operation is logged as a warning naming the "
       "ranks that have not called it yet (again at twice and three times that; 0 to 1, 0: off)."},
      {"LOOM_FLIGHT_RECORD", "16",
       "Operations each communicator remembers for error reports: the last this many appear in the log with a "
       "timeout or failure, and peers answer questions about them (1 to 4096)."},
      {"LOOM_TIMELINE", "",
       "Path prefix of a timeline in Chrome trace JSON (open it in Perfetto): every rank writes <path>.rank<r>.json "
       "at loom::finalize(). Checked at loom::init() (the file must be writable); a failed write is reported."},
      {"LOOM_NCCL", "auto",
       "The device communicator loom::init() builds (Runtime::device_comm(): NCCL over all ranks): auto when every "
       "rank can use a GPU of its own, on always (loom::ConfigError on every rank when one cannot), off never. The "
       "log says why it was or was not built."},
      {"LOOM_DEVICE", "",
       "CUDA device index of this process (0 to 1023); may differ between ranks, and ranks given the same GPU share "
       "it. Unset: 0 when the process sees one GPU (CUDA_VISIBLE_DEVICES per rank, Slurm --gpus-per-task=1), else "
       "the GPU the placement plan gives the rank, else its local rank; ranks on a node with fewer GPUs than ranks "
       "run on the CPU.",
       /*per_process=*/true},
      {"LOOM_TOPOLOGY", "",
       "A topology file (JSON, nvidia-smi topo -m text or NCCL XML; docs/topology.md) describing the machine(s): "
       "loom::init() plans placement with it where NVML sees no GPU (on a machine without GPUs the ranks stand in "
       "for the described GPUs), and prints the plan."},
      {"LOOM_METRICS", "",
       "Where per-rank training metrics go in Prometheus' text format (loom::MetricsExporter): file:DIR writes DIR/torchloom_rank<r>.prom for node_exporter's textfile collector, port:N serves them over HTTP on 127.0.0.1, port N plus the local rank; port:ADDR:N, port:[ADDR]:N or port:*:N listens on a numeric IPv4 or IPv6 address or on every interface. Unset: off."},
      {"LOOM_METRICS_INTERVAL", "5",
       "Seconds between rewrites of the metrics file (0 to 3600; 0: on every recorded step)."},
      {"LOOM_TP", "1",
       "Tensor-parallel degree the placement plan groups ranks for (1 to 4096; loomrun --tp sets it). "
       "Pass `loom::planned_dp_rings(tp)` as `ParallelConfig::dp_rings` to build the planned DP rings."},
      {"LOOM_PP", "1",
       "Pipeline stages the placement plan groups ranks for (1 to 4096; loomrun --pp sets it): the layout is "
       "dp,pp,tp, outermost first, so each pipeline's stages are consecutive tensor-parallel blocks. Pass "
       "`loom::planned_dp_rings(tp, pp)` as `ParallelConfig::dp_rings` to build the planned DP rings."},
      {"LOOM_RANKS_PER_NODE", "",
       "Ranks on each node of the placement plan (1 to 4096; loomrun sets it). Unset: the ranks MPI finds on each "
       "node, or, with a topology file that describes more nodes than the job runs on, each node's GPUs in turn."},
  };
  return table;
}

static const Variable& lookup(const char* name) {
  for (const auto& v : all_variables())
    if (std::string(v.name) == name) return v;
  throw std::logic_error(std::string("torchloom reads undeclared environment variable ") + name);
}

std::optional<std::string> raw(const Environment& env, const char* name) {
  lookup(name);
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

static std::string value_or_default(const Environment& env, const char* name) {
  auto value = raw(env, name);
  return value ? *value : lookup(name).default_value;
}

static std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

// A value as a message shows it: at most 80 bytes, control characters as '?' (a value can be up to
// 128 KiB, and it goes into logs and terminals).
static std::string shown(const std::string& text) {
  std::string out;
  for (char c : text.substr(0, 80)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  return text.size() > 80 ? out + "... (" + std::to_string(text.size()) + " bytes)" : out;
}

static ConfigError malformed(const char* name, const std::string& text, const std::string& expected) {
  return ConfigError(
      ErrorContext("environment variable")(std::string(name) + "='" + shown(text) + "': expected " + expected));
}

std::chrono::milliseconds seconds(const Environment& env, const char* name, double min_seconds, double max_seconds) {
  std::string text = value_or_default(env, name);
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !std::isfinite(value) || !(value >= min_seconds && value <= max_seconds))
    throw malformed(name, text, "seconds between " + number_text(min_seconds) + " and " + number_text(max_seconds));
  return std::chrono::milliseconds(static_cast<long long>(value * 1000.0 + 0.5));
}

long long integer(const Environment& env, const char* name, long long min_value, long long max_value) {
  std::string text = value_or_default(env, name);
  char* end = nullptr;
  errno = 0;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || errno != 0 || value < min_value || value > max_value)
    throw malformed(name, text,
                    "an integer from " + std::to_string(min_value) + " to " + std::to_string(max_value));
  return value;
}

double real(const Environment& env, const char* name, double min_value, double max_value) {
  std::string text = value_or_default(env, name);
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !std::isfinite(value) || !(value >= min_value && value <= max_value))
    throw malformed(name, text, "a number from " + number_text(min_value) + " to " + number_text(max_value));
  return value;
}

namespace {

// Levenshtein distance, stopping early: only "within two edits" matters.
size_t edit_distance(const std::string& a, const std::string& b) {
  if (a.size() > b.size() + 2 || b.size() > a.size() + 2) return 3;
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Set or read by torchloom's scripts, launcher and tests, not by the library.
bool tool_variable(const std::string& name) {
  static const std::vector<std::string> names = {"LOOM_MPIRUN_FLAGS", "LOOM_RESTART_COUNT", "LOOM_FUZZ_SEED"};
  return name.rfind("LOOM_TEST_", 0) == 0 || std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

std::vector<std::pair<std::string, std::string>> unknown_variables(const Environment& env) {
  std::vector<std::pair<std::string, std::string>> unknown;
  for (const auto& entry : env) {
    const std::string& name = entry.first;  // not a structured binding: clang 14 cannot capture one
    if (name.rfind("LOOM_", 0) != 0 || tool_variable(name)) continue;
    const auto& table = all_variables();
    if (std::any_of(table.begin(), table.end(), [&](const Variable& v) { return name == v.name; })) continue;
    std::string closest;
    size_t best = 3;
    for (const auto& v : table)
      if (const size_t d = edit_distance(name, v.name); d < best) best = d, closest = v.name;
    unknown.emplace_back(name.size() > 80 ? name.substr(0, 80) + "..." : name, closest);
    if (unknown.size() == 16) break;  // enough to make the point; the environment may be hostile
  }
  return unknown;
}

bool flag(const Environment& env, const char* name) { return choice(env, name, {"0", "1"}) == "1"; }

std::string choice(const Environment& env, const char* name, const std::vector<std::string>& accepted) {
  std::string text = value_or_default(env, name);
  for (const auto& a : accepted)
    if (a == text) return text;
  std::string list;
  for (const auto& a : accepted) list += (list.empty() ? "" : ", ") + a;
  throw malformed(name, text, "one of " + list);
}

}  // namespace loom::env
