#include "comm/abort.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "loom/log.h"

namespace loom::detail {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<int, std::function<void(const std::string&)>> steps;
  std::function<void(const std::string&)> final_step;
  int next_handle = 0;
};

Registry& registry() {
  static Registry* r = new Registry();  // outlives static destruction: an abort may run at exit
  return *r;
}

std::atomic<bool> g_started{false};

}  // namespace

int register_abort_step(std::function<void(const std::string&)> step) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  int handle = r.next_handle++;
  r.steps[handle] = std::move(step);
  return handle;
}

void unregister_abort_step(int handle) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.steps.erase(handle);
}

void set_final_abort_step(std::function<void(const std::string&)> step) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.final_step = std::move(step);
}

bool abort_started() { return g_started.load(); }

namespace {

std::atomic<bool> g_final_started{false};

void run_final_step(const std::string& reason) {
  if (g_final_started.exchange(true)) return;  // the other thread is already ending the process
  std::function<void(const std::string&)> final_step;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    final_step = r.final_step;
  }
  if (final_step) final_step(reason);
  std::abort();  // nothing ended the process: never leave it hanging
}

}  // namespace

namespace {
std::atomic<bool> g_ending_normally{false};
}  // namespace

void note_ending_normally() { g_ending_normally.store(true); }

void abort_job_after(std::chrono::milliseconds grace, const std::string& reason,
                     std::chrono::milliseconds steps_bound) {
  if (g_ending_normally.load()) {
    LOOM_LOG(warn, "not ending the job for an error while it finalizes: " << reason);
    return;
  }
  if (g_started.exchange(true)) return;
  LOOM_LOG(error, "ending the job in " << grace.count() / 1000.0 << " s (LOOM_ON_ERROR=abort): " << reason);
  std::thread([grace, reason] {
    std::this_thread::sleep_for(grace);
    auto& r = registry();
    std::vector<std::function<void(const std::string&)>> steps;
    {
      std::lock_guard<std::mutex> lock(r.mutex);
      for (auto& [handle, step] : r.steps) steps.push_back(step);
    }
    for (auto& step : steps) {
      try {
        step(reason);
      } catch (const std::exception& e) {
        LOOM_LOG(error, "abort step failed: " << e.what());
      }
    }
    run_final_step(reason);
  }).detach();
  std::thread([grace, steps_bound, reason] {
    std::this_thread::sleep_for(grace + steps_bound);
    if (!g_final_started.load()) {
      LOOM_LOG(error, "abort steps did not finish within " << steps_bound.count() / 1000.0
                                                           << " s (e.g. ncclCommAbort hangs); ending the process");
      run_final_step(reason);
    }
    // The final step itself (MPI_Abort) did not end the process either.
    std::this_thread::sleep_for(steps_bound);
    std::abort();
  }).detach();
}

}  // namespace loom::detail
