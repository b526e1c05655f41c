#include "comm/flight_recorder.h"

#include <sstream>

#include "comm/durations.h"

namespace loom::detail {

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

void FlightRecorder::record(const std::shared_ptr<Work>& work, uint64_t fingerprint) {
  const OpInfo& info = work->info();
  std::lock_guard<std::mutex> lock(mutex_);
  const bool p2p = info.type == OpType::Send || info.type == OpType::Recv || info.type == OpType::SendRecvBatch;
  int64_t& last = info.internal ? progress_.internal : p2p ? progress_.p2p : progress_.collective;
  last = static_cast<int64_t>(info.seq);
  entries_.push_back(Entry{work, signature_words(info, fingerprint), Work::Clock::now()});
  if (entries_.size() > capacity_) entries_.pop_front();
}

FlightRecorder::Progress FlightRecorder::progress() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return progress_;
}

FlightRecorder::Progress FlightRecorder::completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Progress done;
  bool found_collective = false, found_internal = false, found_p2p = false;
  for (auto e = entries_.rbegin(); e != entries_.rend(); ++e) {
    const auto type = static_cast<OpType>(e->signature[0]);
    const bool p2p = type == OpType::Send || type == OpType::Recv || type == OpType::SendRecvBatch;
    const bool internal = e->signature[2] != 0;
    bool& found = internal ? found_internal : p2p ? found_p2p : found_collective;
    if (found) continue;
    auto work = e->work.lock();
    // Not state(): a look at a queued operation would hand it to its backend's thread.
    if (work && !work->finished_at_time()) continue;  // queued, running or failed
    found = true;
    (internal ? done.internal : p2p ? done.p2p : done.collective) = e->signature[1];
  }
  return done;
}

std::optional<SignatureWords> FlightRecorder::find(bool internal, uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : entries_) {
    const auto type = static_cast<OpType>(e.signature[0]);
    const bool p2p = type == OpType::Send || type == OpType::Recv || type == OpType::SendRecvBatch;
    if (!p2p && (e.signature[2] != 0) == internal && static_cast<uint64_t>(e.signature[1]) == seq) return e.signature;
  }
  return std::nullopt;
}

std::string FlightRecorder::dump() const {
  std::vector<Entry> entries;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entries.assign(entries_.begin(), entries_.end());
  }
  std::ostringstream text;
  const auto now = Work::Clock::now();
  for (const auto& e : entries) {
    auto work = e.work.lock();
    if (!work) {
      text << "\n    " << info_from_words(e.signature).signature() << ": done (released), called "
           << seconds_text(now - e.called) << " s ago";
      continue;
    }
    const OpInfo& info = work->info();
    text << "\n    " << info.name();
    if (info.type != OpType::Barrier && info.type != OpType::Split && info.type != OpType::SendRecvBatch) {
      text << " shape=[";
      for (size_t i = 0; i < info.shape.size(); ++i) text << (i ? ", " : "") << info.shape[i];
      text << "] dtype=" << c10::toString(info.dtype);
    }
    text << ": ";
    const auto started = work->started_at_time();
    switch (work->state()) {
      case Work::State::Queued: text << "queued for " << seconds_text(now - e.called) << " s"; break;
      case Work::State::Running: text << "running for " << seconds_text(now - *started) << " s"; break;
      case Work::State::Done: {
        auto finished = work->finished_at_time();
        text << "done";
        if (started && finished) text << " in " << seconds_text(*finished - *started) << " s";
        break;
      }
      case Work::State::Failed: text << "failed"; break;
    }
  }
  return text.str();
}

}  // namespace loom::detail
