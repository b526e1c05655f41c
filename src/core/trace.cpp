#include "loom/trace.h"

#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/env.h"
#include "loom/error.h"

namespace loom::trace {
namespace {

struct Event {
  std::string name, category, lane;
  char phase;
  Clock::time_point start, end;
};

struct Recorder {
  std::mutex mutex;
  std::vector<Event> events;
  int rank = 0;
  std::string path;
  bool enabled = false;
  // Anchors steady-clock times to wall-clock microseconds, so ranks' files align.
  Clock::time_point steady_origin = Clock::now();
  double wall_origin_us = std::chrono::duration<double, std::micro>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();

  Recorder() {
    auto value = env::raw("LOOM_TIMELINE");
    if (value) {
      path = *value;
      enabled = true;
    }
  }
  double to_us(Clock::time_point t) const {
    return wall_origin_us + std::chrono::duration<double, std::micro>(t - steady_origin).count();
  }
};

Recorder& recorder() {
  static Recorder* r = new Recorder();
  return *r;
}

}  // namespace

bool enabled() { return recorder().enabled; }

void span(const std::string& name, const std::string& category, Clock::time_point start, Clock::time_point end,
          const std::string& lane) {
  auto& r = recorder();
  if (!r.enabled) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.push_back({name, category, lane, 'X', start, end});
}

void instant(const std::string& name, const std::string& category, Clock::time_point at, const std::string& lane) {
  auto& r = recorder();
  if (!r.enabled) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.push_back({name, category, lane, 'i', at, at});
}

void set_rank(int rank) {
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.rank = rank;
}

std::string flush() {
  auto& r = recorder();
  if (!r.enabled) return "";
  std::lock_guard<std::mutex> lock(r.mutex);
  std::map<std::string, int> lane_ids;
  nlohmann::json events = nlohmann::json::array();
  for (const auto& e : r.events) {
    auto [it, inserted] = lane_ids.try_emplace(e.lane, static_cast<int>(lane_ids.size()));
    nlohmann::json event = {{"name", e.name}, {"cat", e.category}, {"ph", std::string(1, e.phase)},
                            {"ts", r.to_us(e.start)}, {"pid", r.rank}, {"tid", it->second}};
    if (e.phase == 'X') event["dur"] = std::chrono::duration<double, std::micro>(e.end - e.start).count();
    if (e.phase == 'i') event["s"] = "t";
    events.push_back(std::move(event));
  }
  for (const auto& [lane, id] : lane_ids)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r.rank}, {"tid", id}, {"args", {{"name", lane}}}});
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", r.rank}, {"args", {{"name", "rank " + std::to_string(r.rank)}}}});
  const std::string file = r.path + ".rank" + std::to_string(r.rank) + ".json";
  std::ofstream out(file);
  if (!out) throw Error("[rank " + std::to_string(r.rank) + "] LOOM_TIMELINE: cannot write " + file);
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  return file;
}

}  // namespace loom::trace
