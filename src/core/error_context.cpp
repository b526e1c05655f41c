// The one builder of message prefixes (see loom/error.h).
#include <atomic>

#include "loom/error.h"

namespace loom {
namespace {
std::atomic<int> g_job_rank{-1};

std::string rank_text() {
  const int rank = g_job_rank.load(std::memory_order_relaxed);
  return rank < 0 ? std::string("[rank ?]") : "[rank " + std::to_string(rank) + "]";
}
}  // namespace

ErrorContext::ErrorContext(std::string_view what) : prefix_(rank_text()) {
  if (!what.empty()) prefix_.append(" ").append(what);
}

ErrorContext::ErrorContext(std::string_view what, std::string_view group, int group_rank, int group_size)
    : ErrorContext(what) {
  prefix_.append(" group=").append(group);
  prefix_.append(" (rank ").append(std::to_string(group_rank)).append(" of ").append(std::to_string(group_size));
  prefix_.append(")");
}

std::string ErrorContext::operator()(std::string_view detail) const {
  std::string text = prefix_;
  text.append(": ").append(detail);
  return text;
}

int job_rank() { return g_job_rank.load(std::memory_order_relaxed); }

namespace detail {
void set_job_rank(int rank) { g_job_rank.store(rank, std::memory_order_relaxed); }
}  // namespace detail

}  // namespace loom
