#include "comm/store_status_channel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/departure.h"
#include "comm/peer_status.h"
#include "comm/side_channel.h"
#include "loom/log.h"

namespace loom::detail::store_status {
namespace {

constexpr auto kPoll = std::chrono::milliseconds(2);  // an asker's or a leaver's polling

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
  d.reason = notice.substr(second + 1, departures::kMaxReasonBytes);  // as the MPI notice bounds it
  return d;
}

// The transport: all of it is driven by the side channel's protocol, one call at a time.
class StoreTransport final : public side_channel::Transport {
 public:
  StoreTransport(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
      : store_(std::move(store)), rank_(rank), seen_left_(static_cast<size_t>(size), false) {}

  std::chrono::microseconds poll_interval() const override { return kPoll; }

  // New departures are recorded and acknowledged, new questions answered; one small request when
  // nothing happened.
  void serve() override {
    const int64_t events = store_->add("events", 0);
    if (events == seen_events_) return;
    seen_events_ = events;
    for (int r = 0; r < static_cast<int>(seen_left_.size()); ++r) {
      if (r == rank_ || seen_left_[r] || !store_->check({key("left/", r)})) continue;
      seen_left_[r] = true;
      departures::record(decode_departure(r, text(store_->get(key("left/", r)))));
      store_->add(key("left/", r) + "/acks", 1);  // only now, with the communicators failed and logged
    }
    const int64_t last = store_->add("q/next", 0);
    // In id order, stopping at a question whose key is not written yet (its id is taken first).
    while (answered_ < last && store_->check({key("q/", answered_ + 1)})) {
      const int64_t id = ++answered_;
      const peers::Query q = decode_query(text(store_->get(key("q/", id))));
      store_->set(key("a/", id) + "/" + std::to_string(rank_), bytes(encode(peers::answer(q))));
    }
  }

  void post_question(const std::vector<int>& ranks, const peers::Query& query) override {
    asked_ = ranks;
    question_id_ = store_->add("q/next", 1);
    store_->set(key("q/", question_id_), bytes(encode(query)));
    store_->add("events", 1);
  }

  void poll_answers(std::vector<std::optional<peers::Answer>>& answers) override {
    for (size_t i = 0; i < asked_.size(); ++i) {
      const std::string k = key("a/", question_id_) + "/" + std::to_string(asked_[i]);
      if (answers[i] || !store_->check({k})) continue;
      answers[i] = decode_answer(text(store_->get(k)));
    }
  }

  void end_question() override { asked_.clear(); }  // answers written later are never read

  void post_notice(const std::vector<int>& ranks, const departures::Departure& notice) override {
    store_->set(key("left/", rank_), bytes(encode_departure(notice)));
    store_->add("events", 1);
  }

  size_t acknowledged() override {
    return static_cast<size_t>(std::max<int64_t>(store_->add(key("left/", rank_) + "/acks", 0), 0));
  }

  void end_notice() override {}  // the notice stays in the store, read by whoever comes later

  void close() override { store_.reset(); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::vector<bool> seen_left_;  // departures already recorded
  int64_t seen_events_ = 0;
  int64_t answered_ = 0;  // questions up to this id are answered
  int64_t question_id_ = 0;
  std::vector<int> asked_;
};

std::atomic<bool> g_started{false};

}  // namespace

void start(c10::intrusive_ptr<c10d::Store> store, int rank, int size) {
  if (g_started.exchange(true)) return;
  side_channel::install(std::make_shared<StoreTransport>(std::move(store), rank, size), rank, size);
}

void stop() {
  if (!g_started.exchange(false)) return;
  side_channel::uninstall();
}

}  // namespace loom::detail::store_status
