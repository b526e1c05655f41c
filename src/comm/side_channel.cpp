// The side channel's protocol over a backend's transport (see side_channel.h).
#include "comm/side_channel.h"

#include <condition_variable>
#include <mutex>
#include <thread>

#include "comm/watchdog.h"
#include "loom/log.h"

namespace loom::detail::side_channel {
namespace {

struct State {
  std::mutex mutex;
  std::condition_variable question_closed;
  std::shared_ptr<Transport> transport;  // null when none is installed
  int rank = 0;
  bool asking = false;  // a question is open (one at a time)
};

State& state() {
  static State* s = new State();  // used by the watchdog thread and exit handlers until the end
  return *s;
}

// A transport call that failed (a store that stopped answering): what was asked stays unanswered.
template <typename Call>
bool attempt(Call call) {
  try {
    call();
    return true;
  } catch (const std::exception& e) {
    LOOM_LOG(debug, "side channel: " << e.what());
    return false;
  }
}

std::vector<std::optional<peers::Answer>> ask(const std::vector<int>& ranks, const peers::Query& query,
                                              Clock::time_point deadline) {
  State& s = state();
  std::vector<std::optional<peers::Answer>> answers(ranks.size());
  std::unique_lock<std::mutex> lock(s.mutex);
  if (!s.question_closed.wait_until(lock, deadline, [&] { return !s.asking || !s.transport; })) return answers;
  const std::shared_ptr<Transport> transport = s.transport;
  if (!transport) return answers;
  std::vector<int> others;
  std::vector<size_t> index;  // of each other rank in `ranks`
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == s.rank) {
      answers[i] = peers::answer(query);
    } else {
      others.push_back(ranks[i]);
      index.push_back(i);
    }
  }
  if (others.empty()) return answers;
  std::vector<std::optional<peers::Answer>> theirs(others.size());
  s.asking = true;
  bool ok = attempt([&] { transport->post_question(others, query); });
  while (ok) {
    // A rank asking this one at the same time must not wait for this one's answer.
    ok = attempt([&] {
      transport->serve();
      transport->poll_answers(theirs);
    });
    bool all = true;
    for (const auto& a : theirs) all = all && a.has_value();
    if (all || Clock::now() >= deadline) break;
    lock.unlock();
    std::this_thread::sleep_for(transport->poll_interval());
    lock.lock();
    if (s.transport != transport) break;  // uninstalled: close() ended the question
  }
  if (s.transport == transport) attempt([&] { transport->end_question(); });
  s.asking = false;
  s.question_closed.notify_all();
  for (size_t k = 0; k < others.size(); ++k) answers[index[k]] = theirs[k];
  return answers;
}

void announce(const std::vector<int>& ranks, const departures::Departure& notice, departures::Clock::time_point deadline) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  const std::shared_ptr<Transport> transport = s.transport;
  if (!transport || ranks.empty()) return;
  bool ok = attempt([&] { transport->post_notice(ranks, notice); });
  while (ok) {
    size_t acknowledged = 0;
    ok = attempt([&] {
      transport->serve();  // two ranks may leave at once
      acknowledged = transport->acknowledged();
    });
    if (acknowledged >= ranks.size() || Clock::now() >= deadline) break;
    lock.unlock();
    std::this_thread::sleep_for(transport->poll_interval());
    lock.lock();
    if (s.transport != transport) return;  // uninstalled: close() ended the notice
  }
  attempt([&] { transport->end_notice(); });
}

}  // namespace

void install(std::shared_ptr<Transport> transport, int rank, int size) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.transport) return;
    s.transport = std::move(transport);
    s.rank = rank;
  }
  peers::set_transport(ask);
  departures::set_announcer(announce, rank, size);
  const std::weak_ptr<Transport> served = s.transport;
  Watchdog::instance().add_periodic([served] {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto transport = served.lock();
    if (!transport || s.transport != transport) return false;  // uninstalled (or replaced): stop serving
    attempt([&] { transport->serve(); });  // a failed poll is tried again at the next
    return true;
  });
}

void uninstall() {
  peers::clear_transport();
  departures::clear_announcer();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.transport) return;
  attempt([&] { s.transport->close(); });
  s.transport.reset();
  s.asking = false;
  s.question_closed.notify_all();
}

}  // namespace loom::detail::side_channel
