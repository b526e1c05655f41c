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

void abort_job_after(std::chrono::milliseconds grace, const std::string& reason) {
  if (g_started.exchange(true)) return;
  LOOM_LOG(error, "ending the job in " << grace.count() / 1000.0 << " s (LOOM_ON_ERROR=abort): " << reason);
  std::thread([grace, reason] {
    std::this_thread::sleep_for(grace);
    auto& r = registry();
    std::vector<std::function<void(const std::string&)>> steps;
    std::function<void(const std::string&)> final_step;
    {
      std::lock_guard<std::mutex> lock(r.mutex);
      for (auto& [handle, step] : r.steps) steps.push_back(step);
      final_step = r.final_step;
    }
    for (auto& step : steps) step(reason);
    if (final_step) final_step(reason);
    std::abort();  // nothing ended the process: never leave it hanging
  }).detach();
}

}  // namespace loom::detail
