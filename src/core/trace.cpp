#include "loom/trace.h"

#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include <cerrno>
#include <cstring>
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
  std::atomic<bool> enabled{false};
  // Anchors steady-clock times to wall-clock microseconds, so ranks' files align.
  Clock::time_point steady_origin = Clock::now();
  double wall_origin_us = std::chrono::duration<double, std::micro>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();

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

static std::string file_of(const std::string& prefix, int rank) { return prefix + ".rank" + std::to_string(rank) + ".json"; }

static void write_file(const std::string& file, const std::string& text, const char* what) {
  errno = 0;
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (out) out << text;
  if (out) out.flush();
  if (!out)
    throw Error(ErrorContext("LOOM_TIMELINE")(std::string(what) + " " + file + " failed: " +
                                              (errno ? std::strerror(errno) : "write error")));
}

void configure(const std::string& path_prefix, int rank) {
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.rank = rank;
  r.path = path_prefix;
  r.enabled = !path_prefix.empty();
  // Checked now, so that an unwritable place is reported at start rather than after the run.
  if (r.enabled) write_file(file_of(r.path, rank), "{\"traceEvents\": []}\n", "creating");
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
  const std::string file = file_of(r.path, r.rank);
  // Names can carry bytes that are not UTF-8 (a checkpoint path in Latin-1): replaced by U+FFFD, so
  // the timeline is written and finalize() does not throw nlohmann's type_error (review finding 10).
  write_file(file,
             nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump(
                 -1, ' ', false, nlohmann::json::error_handler_t::replace) +
                 "\n",
             "writing");
  return file;
}

}  // namespace loom::trace
