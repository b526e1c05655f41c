#include "comm/mpi_status_channel.h"

#include <mpi.h>

#include <array>
#include <list>
#include <mutex>
#include <thread>

#include "comm/peer_status.h"
#include "comm/watchdog.h"

namespace loom::detail::mpi_status {
namespace {

constexpr int kQueryTag = 1;
constexpr int kAnswerTag = 2;
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

// Answers the questions that have arrived; the caller holds the channel's mutex.
void serve_locked(Channel& c) {
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
      if (!c.running) return answers;
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
  std::lock_guard<std::mutex> lock(c.mutex);
  if (!c.running) return;
  c.running = false;
  if (c.incoming != MPI_REQUEST_NULL) {
    MPI_Cancel(&c.incoming);
    MPI_Wait(&c.incoming, MPI_STATUS_IGNORE);
  }
  for (auto& out : c.outgoing) MPI_Request_free(&out.request);
  c.outgoing.clear();
  MPI_Comm_free(&c.comm);
}

}  // namespace loom::detail::mpi_status
