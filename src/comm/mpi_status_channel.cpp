#include "comm/mpi_status_channel.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/departure.h"
#include "comm/peer_status.h"
#include "comm/watchdog.h"

namespace loom::detail::mpi_status {
namespace {

constexpr int kQueryTag = 1;
constexpr int kAnswerTag = 2;
constexpr int kLeavingTag = 3;     // a rank leaves the job (departure.h)
constexpr int kLeavingAckTag = 4;  // ... and a rank has taken note
// {status, reason length, reached count, {key, collective, internal} per communicator, reason
// bytes}: 1.3 KB, small enough to be sent eagerly (it completes even when the receiver never looks).
struct LeavingWords {
  int64_t status = 0;
  int64_t length = 0;
  int64_t reached_count = 0;
  int64_t reached[departures::kMaxReached][3] = {};
  char reason[departures::kMaxReasonBytes] = {};
};
constexpr int kLeavingBytes = static_cast<int>(sizeof(LeavingWords));
// {id, key, internal, seq}
using QueryWords = std::array<int64_t, 4>;
// {id, known, last_called, has_called, called[8]}
using AnswerWords = std::array<int64_t, 12>;

struct Channel {
  std::mutex mutex;  // one thread drives the channel at a time
  bool running = false;
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  MPI_Request incoming = MPI_REQUEST_NULL;
  QueryWords query{};
  struct Outgoing {
    MPI_Request request;
    AnswerWords words;
  };
  std::list<Outgoing> outgoing;  // answers being sent (their buffers must live until done)
  int64_t next_id = 1;
  MPI_Request leaving = MPI_REQUEST_NULL;  // the next departure notice from any rank
  LeavingWords notice{};
  std::list<std::pair<MPI_Request, int64_t>> acks;  // acknowledgements being sent
  // The requests of the question being asked (ask() sleeps with the mutex released): stop() ends
  // them, since after it the communicator is freed and MPI finalized, and an answer arriving later
  // would land in the asker's returned stack frame.
  std::vector<MPI_Request*> asking_receives, asking_sends;
};

Channel& channel() {
  static Channel* c = new Channel();  // the watchdog thread may serve until the process ends
  return *c;
}

AnswerWords encode(int64_t id, const peers::Answer& a) {
  AnswerWords w{};
  w[0] = id;
  w[1] = a.known;
  w[2] = a.last_called;
  w[3] = a.called.has_value();
  if (a.called) std::copy(a.called->begin(), a.called->end(), w.begin() + 4);
  return w;
}

peers::Answer decode(const AnswerWords& w) {
  peers::Answer a;
  a.known = w[1] != 0;
  a.last_called = w[2];
  if (w[3]) {
    SignatureWords s;
    std::copy(w.begin() + 4, w.end(), s.begin());
    a.called = s;
  }
  return a;
}

peers::Query to_query(const QueryWords& q) {
  return {static_cast<uint64_t>(q[1]), q[2] != 0, static_cast<uint64_t>(q[3])};
}

// Takes note of the departure notices that have arrived (failing the communicators with that rank)
// and acknowledges each; the caller holds the channel's mutex.
void serve_departures_locked(Channel& c) {
  for (auto it = c.acks.begin(); it != c.acks.end();) {
    int done = 0;
    MPI_Test(&it->first, &done, MPI_STATUS_IGNORE);
    it = done ? c.acks.erase(it) : std::next(it);
  }
  for (;;) {
    if (c.leaving == MPI_REQUEST_NULL)
      MPI_Irecv(&c.notice, kLeavingBytes, MPI_BYTE, MPI_ANY_SOURCE, kLeavingTag, c.comm, &c.leaving);
    int done = 0;
    MPI_Status status;
    MPI_Test(&c.leaving, &done, &status);
    if (!done) return;
    c.leaving = MPI_REQUEST_NULL;
    const size_t length = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(c.notice.length, 0)),
                                           sizeof(c.notice.reason));
    departures::Departure d{status.MPI_SOURCE, static_cast<int>(c.notice.status), std::string(c.notice.reason, length), {}};
    const auto count = std::clamp<int64_t>(c.notice.reached_count, 0, static_cast<int64_t>(departures::kMaxReached));
    for (int64_t i = 0; i < count; ++i)
      d.reached.push_back({static_cast<uint64_t>(c.notice.reached[i][0]), c.notice.reached[i][1], c.notice.reached[i][2]});
    departures::record(d);
    // Acknowledged only now, with the communicators failed and logged: the leaver may exit next.
    c.acks.push_back({MPI_REQUEST_NULL, 1});
    MPI_Isend(&c.acks.back().second, 1, MPI_INT64_T, status.MPI_SOURCE, kLeavingAckTag, c.comm, &c.acks.back().first);
  }
}

// Answers the questions that have arrived; the caller holds the channel's mutex.
void serve_locked(Channel& c) {
  serve_departures_locked(c);
  for (auto it = c.outgoing.begin(); it != c.outgoing.end();) {
    int done = 0;
    MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
    it = done ? c.outgoing.erase(it) : std::next(it);
  }
  for (;;) {
    if (c.incoming == MPI_REQUEST_NULL)
      MPI_Irecv(c.query.data(), 4, MPI_INT64_T, MPI_ANY_SOURCE, kQueryTag, c.comm, &c.incoming);
    int done = 0;
    MPI_Status status;
    MPI_Test(&c.incoming, &done, &status);
    if (!done) return;
    c.incoming = MPI_REQUEST_NULL;
    c.outgoing.push_back({MPI_REQUEST_NULL, encode(c.query[0], peers::answer(to_query(c.query)))});
    auto& out = c.outgoing.back();
    MPI_Isend(out.words.data(), 12, MPI_INT64_T, status.MPI_SOURCE, kAnswerTag, c.comm, &out.request);
  }
}

std::vector<std::optional<peers::Answer>> ask(const std::vector<int>& ranks, const peers::Query& query,
                                              peers::Clock::time_point deadline) {
  Channel& c = channel();
  std::vector<std::optional<peers::Answer>> answers(ranks.size());
  std::unique_lock<std::mutex> lock(c.mutex);
  if (!c.running) return answers;
  const int64_t id = c.next_id++;
  const QueryWords words{id, static_cast<int64_t>(query.key), query.internal ? 1 : 0, static_cast<int64_t>(query.seq)};
  struct Pending {
    size_t index;
    MPI_Request recv = MPI_REQUEST_NULL;
    MPI_Request send = MPI_REQUEST_NULL;
    AnswerWords answer{};
  };
  std::vector<Pending> pending;
  pending.reserve(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == c.rank) {
      answers[i] = peers::answer(query);
      continue;
    }
    pending.push_back({i});
    auto& p = pending.back();
    MPI_Irecv(p.answer.data(), 12, MPI_INT64_T, ranks[i], kAnswerTag, c.comm, &p.recv);
    MPI_Isend(words.data(), 4, MPI_INT64_T, ranks[i], kQueryTag, c.comm, &p.send);
  }
  // (`pending` does not grow any more: the addresses stay valid until this function returns.)
  for (auto& p : pending) {
    c.asking_receives.push_back(&p.recv);
    c.asking_sends.push_back(&p.send);
  }
  struct Forget {  // whichever way this returns, stop() no longer sees this question's requests
    Channel& c;
    ~Forget() {
      c.asking_receives.clear();
      c.asking_sends.clear();
    }
  } forget{c};
  size_t open = pending.size();
  while (open > 0 && peers::Clock::now() < deadline) {
    serve_locked(c);  // a rank asking us at the same time must not wait for our answer
    for (auto& p : pending) {
      if (p.recv == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&p.recv, &done, MPI_STATUS_IGNORE);
      if (!done) continue;
      if (p.answer[0] != id) {  // a late answer to an earlier question: wait for ours
        MPI_Irecv(p.answer.data(), 12, MPI_INT64_T, ranks[p.index], kAnswerTag, c.comm, &p.recv);
        continue;
      }
      answers[p.index] = decode(p.answer);
      --open;
    }
    if (open > 0) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(500));
      lock.lock();
      if (!c.running) return answers;  // stop() ended this question's requests
    }
  }
  for (auto& p : pending) {
    if (p.recv != MPI_REQUEST_NULL) {
      MPI_Cancel(&p.recv);
      MPI_Wait(&p.recv, MPI_STATUS_IGNORE);
    }
    // A 32-byte send is buffered eagerly, so it completes locally even when the peer is gone.
    if (p.send != MPI_REQUEST_NULL) MPI_Request_free(&p.send);
  }
  return answers;
}

// This rank leaves: one notice to each of `ranks`, then serve (two ranks may leave at once) until
// each has acknowledged or the deadline has passed.
void announce(const std::vector<int>& ranks, const departures::Departure& departure,
              departures::Clock::time_point deadline) {
  Channel& c = channel();
  std::unique_lock<std::mutex> lock(c.mutex);
  if (!c.running) return;
  // Heap-held: a notice to a rank that is stopped (alive, not reading) may never be sent, and its
  // request is then freed with the buffer still lent to MPI, which is left allocated (below).
  struct Pending {
    int rank;
    MPI_Request send = MPI_REQUEST_NULL;
    MPI_Request ack = MPI_REQUEST_NULL;
    int64_t word = 0;
  };
  struct Outgoing {
    LeavingWords notice;
    std::vector<Pending> pending;
  };
  auto* out = new Outgoing;
  LeavingWords& notice = out->notice;
  notice.status = departure.status;
  notice.length = static_cast<int64_t>(std::min(departure.reason.size(), sizeof(notice.reason)));
  std::copy_n(departure.reason.data(), notice.length, notice.reason);
  notice.reached_count = static_cast<int64_t>(std::min(departure.reached.size(), departures::kMaxReached));
  for (int64_t i = 0; i < notice.reached_count; ++i) {
    const auto& r = departure.reached[static_cast<size_t>(i)];
    notice.reached[i][0] = static_cast<int64_t>(r.key);
    notice.reached[i][1] = r.collective;
    notice.reached[i][2] = r.internal;
  }
  std::vector<Pending>& pending = out->pending;
  pending.resize(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    pending[i].rank = ranks[i];
    MPI_Irecv(&pending[i].word, 1, MPI_INT64_T, ranks[i], kLeavingAckTag, c.comm, &pending[i].ack);
    MPI_Isend(&notice, kLeavingBytes, MPI_BYTE, ranks[i], kLeavingTag, c.comm, &pending[i].send);
  }
  size_t open = pending.size();
  while (open > 0 && departures::Clock::now() < deadline) {
    serve_locked(c);
    for (auto& p : pending) {
      if (p.ack == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&p.ack, &done, MPI_STATUS_IGNORE);
      if (done) --open;
    }
    if (open == 0) break;
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    lock.lock();
    if (!c.running) return;  // `out` stays allocated: its requests may still be live
  }
  // Unacknowledged notices are withdrawn. Neither the cancel nor the send's completion is waited
  // for without a bound: a 1.3 KB send is eager, but to a stopped rank it can stay queued
  // (Open MPI does not cancel sends), and this runs in exit handlers that must not hang.
  for (auto& p : pending)
    if (p.ack != MPI_REQUEST_NULL) MPI_Cancel(&p.ack);
  const auto give_up = departures::Clock::now() + std::chrono::milliseconds(100);
  bool unfinished = true;
  while (unfinished) {
    unfinished = false;
    for (auto& p : pending)
      for (MPI_Request* r : {&p.ack, &p.send}) {
        if (*r == MPI_REQUEST_NULL) continue;
        int done = 0;
        MPI_Test(r, &done, MPI_STATUS_IGNORE);  // sets *r to MPI_REQUEST_NULL when done
        unfinished = unfinished || !done;
      }
    if (!unfinished || departures::Clock::now() >= give_up) break;
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    lock.lock();
    if (!c.running) return;
  }
  if (!unfinished) {
    delete out;
    return;
  }
  for (auto& p : pending)
    for (MPI_Request* r : {&p.ack, &p.send})
      if (*r != MPI_REQUEST_NULL) MPI_Request_free(r);
  // `out` is left allocated: MPI may still write an acknowledgement into it or read the notice.
}

}  // namespace

void start() {
  Channel& c = channel();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.running) return;
  MPI_Comm_dup(MPI_COMM_WORLD, &c.comm);
  MPI_Comm_set_errhandler(c.comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(c.comm, &c.rank);
  c.running = true;
  peers::set_transport(ask);
  int size = 0;
  MPI_Comm_size(c.comm, &size);
  departures::set_announcer(announce, c.rank, size);
  Watchdog::instance().add_periodic([] {
    Channel& c = channel();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (!c.running) return false;
    serve_locked(c);
    return true;
  });
}

void stop() {
  Channel& c = channel();
  peers::clear_transport();
  departures::clear_announcer();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (!c.running) return;
  c.running = false;
  for (MPI_Request* request : {&c.incoming, &c.leaving})
    if (*request != MPI_REQUEST_NULL) {
      MPI_Cancel(request);
      MPI_Wait(request, MPI_STATUS_IGNORE);
    }
  for (auto& out : c.outgoing) MPI_Request_free(&out.request);
  c.outgoing.clear();
  for (auto& ack : c.acks) MPI_Request_free(&ack.first);
  c.acks.clear();
  // A question in flight (its asker waits for the mutex): its receives cancelled, its sends freed.
  for (MPI_Request* request : c.asking_receives)
    if (*request != MPI_REQUEST_NULL) {
      MPI_Cancel(request);
      MPI_Wait(request, MPI_STATUS_IGNORE);
    }
  for (MPI_Request* request : c.asking_sends)
    if (*request != MPI_REQUEST_NULL) MPI_Request_free(request);
  c.asking_receives.clear();
  c.asking_sends.clear();
  MPI_Comm_free(&c.comm);
}

}  // namespace loom::detail::mpi_status
