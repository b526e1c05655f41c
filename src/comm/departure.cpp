#include "comm/departure.h"

#include <atomic>
#include <map>
#include <mutex>

#include "comm/watchdog.h"
#include "loom/log.h"

namespace loom::detail::departures {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<int, Departure> departed;  // by job rank
  std::atomic<bool> any{false};
  std::string exit_reason;
  bool announced = false;  // this process has told the others it leaves
  Announcer announcer;
  int job_rank = -1;
  int job_size = 0;
};

Registry& registry() {
  static Registry* r = new Registry();  // used by the watchdog thread and exit handlers until the end
  return *r;
}

}  // namespace

std::string describe(const Departure& d) {
  std::string text = "rank " + std::to_string(d.rank);
  text += d.status == kUncaughtException ? " ended by an uncaught exception"
                                         : " exited with status " + std::to_string(d.status);
  if (!d.reason.empty()) text += " (" + d.reason + ")";
  return text;
}

void set_exit_reason(std::string reason) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.exit_reason = std::move(reason);
}

std::string exit_reason() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.exit_reason;
}

void announce(int status, const std::string& reason, std::chrono::milliseconds bound) {
  auto& r = registry();
  Announcer announcer;
  std::vector<int> ranks;
  Departure notice;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!r.announcer || r.announced) return;
    r.announced = true;
    announcer = r.announcer;
    notice = {r.job_rank, status, reason.substr(0, kMaxReasonBytes), {}};
    for (int rank = 0; rank < r.job_size; ++rank)
      if (rank != r.job_rank && !r.departed.count(rank)) ranks.push_back(rank);
  }
  if (ranks.empty()) return;
  notice.reached = peers::reached_by_communicator();
  if (notice.reached.size() > kMaxReached) notice.reached.resize(kMaxReached);
  try {
    announcer(ranks, notice, Clock::now() + bound);
  } catch (const std::exception& e) {
    LOOM_LOG(error, "telling the other ranks that this one leaves failed: " << e.what());
  }
}

void record(const Departure& departure) {
  auto& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!r.departed.emplace(departure.rank, departure).second) return;  // told twice
    r.any.store(true, std::memory_order_release);
  }
  Watchdog::instance().fail_members_of(departure.rank, describe(departure), departure.reached);
}

std::optional<Departure> find(const std::vector<int>& job_ranks) {
  auto& r = registry();
  if (!r.any.load(std::memory_order_acquire)) return std::nullopt;
  std::lock_guard<std::mutex> lock(r.mutex);
  for (int rank : job_ranks)
    if (auto it = r.departed.find(rank); it != r.departed.end()) return it->second;
  return std::nullopt;
}

void set_announcer(Announcer announcer, int job_rank, int job_size) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.announcer = std::move(announcer);
  r.job_rank = job_rank;
  r.job_size = job_size;
}

void clear_announcer() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.announcer = nullptr;
}

}  // namespace loom::detail::departures
