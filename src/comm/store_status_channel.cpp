#include "comm/store_status_channel.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/departure.h"
#include "comm/peer_status.h"
#include "comm/watchdog.h"
#include "loom/log.h"

namespace loom::detail::store_status {
namespace {

constexpr auto kPoll = std::chrono::milliseconds(2);  // an asker's or a leaver's polling

struct Channel {
  std::mutex mutex;  // one thread uses the store connection at a time
  bool running = false;
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int size = 1;
  int64_t seen_events = 0;
  int64_t answered = 0;          // questions up to this id are answered
  std::vector<bool> seen_left;   // departures already recorded
};
Channel& channel() {
  static Channel* c = new Channel;  // used by exit handlers, after static destruction began
  return *c;
}

std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }
std::string text(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
std::string key(const char* prefix, int64_t a) { return prefix + std::to_string(a); }

std::string encode(const peers::Query& q) {
  return std::to_string(q.key) + " " + (q.internal ? "1" : "0") + " " + std::to_string(q.seq);
}
peers::Query decode_query(const std::string& s) {
  std::istringstream in(s);
  peers::Query q;
  int internal = 0;
  in >> q.key >> internal >> q.seq;
  q.internal = internal != 0;
  return q;
}
// "known last_called has_called w0 ... w7"
std::string encode(const peers::Answer& a) {
  std::string out = std::string(a.known ? "1" : "0") + " " + std::to_string(a.last_called) + " " +
                    (a.called ? "1" : "0");
  if (a.called)
    for (int64_t w : *a.called) out += " " + std::to_string(w);
  return out;
}
std::optional<peers::Answer> decode_answer(const std::string& s) {
  std::istringstream in(s);
  peers::Answer a;
  int known = 0, has_called = 0;
  if (!(in >> known >> a.last_called >> has_called)) return std::nullopt;
  a.known = known != 0;
  if (has_called) {
    SignatureWords words{};
    for (auto& w : words)
      if (!(in >> w)) return std::nullopt;
    a.called = words;
  }
  return a;
}

// "<status>\n<key>:<collective>:<internal> ...\n<reason>" (the reason last: it may hold newlines).
std::string encode_departure(const departures::Departure& d) {
  std::ostringstream out;
  out << d.status << "\n";
  for (const auto& r : d.reached) out << r.key << ":" << r.collective << ":" << r.internal << " ";
  out << "\n" << d.reason;
  return out.str();
}

departures::Departure decode_departure(int rank, const std::string& notice) {
  departures::Departure d;
  d.rank = rank;
  const size_t first = notice.find('\n');
  const size_t second = first == std::string::npos ? std::string::npos : notice.find('\n', first + 1);
  d.status = std::atoi(notice.substr(0, first).c_str());
  if (second == std::string::npos) return d;
  std::istringstream items(notice.substr(first + 1, second - first - 1));
  peers::Reached r;
  char colon1 = 0, colon2 = 0;
  while (d.reached.size() < departures::kMaxReached && items >> r.key >> colon1 >> r.collective >> colon2 >> r.internal)
    d.reached.push_back(r);
  d.reason = notice.substr(second + 1);
  return d;
}

// The watchdog's poll: new departures are recorded and acknowledged, new questions answered.
void serve_locked(Channel& c) {
  const int64_t events = c.store->add("events", 0);
  if (events == c.seen_events) return;
  c.seen_events = events;
  for (int r = 0; r < c.size; ++r) {
    if (r == c.rank || c.seen_left[r] || !c.store->check({key("left/", r)})) continue;
    c.seen_left[r] = true;
    departures::record(decode_departure(r, text(c.store->get(key("left/", r)))));
    c.store->add(key("left/", r) + "/acks", 1);
  }
  const int64_t last = c.store->add("q/next", 0);
  // In id order, stopping at a question whose key is not written yet (its id is taken first).
  while (c.answered < last && c.store->check({key("q/", c.answered + 1)})) {
    const int64_t id = ++c.answered;
    const peers::Query q = decode_query(text(c.store->get(key("q/", id))));
    c.store->set(key("a/", id) + "/" + std::to_string(c.rank), bytes(encode(peers::answer(q))));
  }
}

std::vector<std::optional<peers::Answer>> ask(const std::vector<int>& ranks, const peers::Query& query,
                                              peers::Clock::time_point deadline) {
  Channel& c = channel();
  std::vector<std::optional<peers::Answer>> answers(ranks.size());
  std::unique_lock<std::mutex> lock(c.mutex);
  if (!c.running) return answers;
  try {
    const int64_t id = c.store->add("q/next", 1);
    c.store->set(key("q/", id), bytes(encode(query)));
    c.store->add("events", 1);
    size_t open = 0;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == c.rank) answers[i] = peers::answer(query);
      else ++open;
    }
    while (open > 0 && peers::Clock::now() < deadline) {
      serve_locked(c);  // two ranks asking each other at once both get their answers
      for (size_t i = 0; i < ranks.size(); ++i) {
        const std::string k = key("a/", id) + "/" + std::to_string(ranks[i]);
        if (answers[i] || !c.store->check({k})) continue;
        answers[i] = decode_answer(text(c.store->get(k)));
        --open;
      }
      if (open == 0) break;
      lock.unlock();
      std::this_thread::sleep_for(kPoll);
      lock.lock();
      if (!c.running) break;
    }
  } catch (const std::exception& e) {  // the store stopped answering: the missing answers stay missing
    LOOM_LOG(debug, "status channel: " << e.what());
  }
  return answers;
}

void announce(const std::vector<int>& ranks, const departures::Departure& d, departures::Clock::time_point deadline) {
  Channel& c = channel();
  std::unique_lock<std::mutex> lock(c.mutex);
  if (!c.running) return;
  try {
    c.store->set(key("left/", c.rank), bytes(encode_departure(d)));
    c.store->add("events", 1);
    while (departures::Clock::now() < deadline &&
           c.store->add(key("left/", c.rank) + "/acks", 0) < static_cast<int64_t>(ranks.size())) {
      serve_locked(c);
      lock.unlock();
      std::this_thread::sleep_for(kPoll);
      lock.lock();
      if (!c.running) return;
    }
  } catch (const std::exception& e) {
    LOOM_LOG(debug, "status channel: " << e.what());
  }
}

}  // namespace

void start(c10::intrusive_ptr<c10d::Store> store, int rank, int size) {
  Channel& c = channel();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.running) return;
    c.store = std::move(store);
    c.rank = rank;
    c.size = size;
    c.seen_left.assign(static_cast<size_t>(size), false);
    c.running = true;
  }
  peers::set_transport(ask);
  departures::set_announcer(announce, rank, size);
  Watchdog::instance().add_periodic([] {
    Channel& c = channel();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (!c.running) return false;
    try {
      serve_locked(c);
    } catch (const std::exception& e) {  // bounded by the connection's timeout; tried again next poll
      LOOM_LOG(debug, "status channel: " << e.what());
    }
    return true;
  });
}

void stop() {
  peers::clear_transport();
  departures::clear_announcer();
  Channel& c = channel();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.running = false;
  c.store.reset();
}

}  // namespace loom::detail::store_status
