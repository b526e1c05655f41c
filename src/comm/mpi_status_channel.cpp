#include "comm/mpi_status_channel.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <list>
#include <thread>
#include <vector>

#include "comm/departure.h"
#include "comm/peer_status.h"
#include "comm/side_channel.h"

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

// The transport: all of it is driven by the side channel's protocol, one call at a time.
class MpiTransport final : public side_channel::Transport {
 public:
  MpiTransport() {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
  }
  int rank() const { return rank_; }
  int size() const {
    int size = 0;
    MPI_Comm_size(comm_, &size);
    return size;
  }

  std::chrono::microseconds poll_interval() const override { return std::chrono::microseconds(500); }

  void serve() override {
    serve_departures();
    for (auto it = outgoing_.begin(); it != outgoing_.end();) {
      int done = 0;
      MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
      it = done ? outgoing_.erase(it) : std::next(it);
    }
    for (;;) {
      if (incoming_ == MPI_REQUEST_NULL)
        MPI_Irecv(query_.data(), 4, MPI_INT64_T, MPI_ANY_SOURCE, kQueryTag, comm_, &incoming_);
      int done = 0;
      MPI_Status status;
      MPI_Test(&incoming_, &done, &status);
      if (!done) return;
      incoming_ = MPI_REQUEST_NULL;
      outgoing_.push_back({MPI_REQUEST_NULL, encode(query_[0], peers::answer(to_query(query_)))});
      auto& out = outgoing_.back();
      MPI_Isend(out.words.data(), 12, MPI_INT64_T, status.MPI_SOURCE, kAnswerTag, comm_, &out.request);
    }
  }

  void post_question(const std::vector<int>& ranks, const peers::Query& query) override {
    question_id_ = next_id_++;
    question_words_ = {question_id_, static_cast<int64_t>(query.key), query.internal ? 1 : 0,
                       static_cast<int64_t>(query.seq)};
    asked_.assign(ranks.size(), Asked{});
    for (size_t i = 0; i < ranks.size(); ++i) {
      asked_[i].rank = ranks[i];
      MPI_Irecv(asked_[i].answer.data(), 12, MPI_INT64_T, ranks[i], kAnswerTag, comm_, &asked_[i].recv);
      MPI_Isend(question_words_.data(), 4, MPI_INT64_T, ranks[i], kQueryTag, comm_, &asked_[i].send);
    }
  }

  void poll_answers(std::vector<std::optional<peers::Answer>>& answers) override {
    for (size_t i = 0; i < asked_.size(); ++i) {
      Asked& a = asked_[i];
      if (a.recv == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&a.recv, &done, MPI_STATUS_IGNORE);
      if (!done) continue;
      if (a.answer[0] != question_id_) {  // a late answer to an earlier question: wait for this one's
        MPI_Irecv(a.answer.data(), 12, MPI_INT64_T, a.rank, kAnswerTag, comm_, &a.recv);
        continue;
      }
      answers[i] = decode(a.answer);
    }
  }

  void end_question() override {
    for (Asked& a : asked_) {
      if (a.recv != MPI_REQUEST_NULL) {
        MPI_Cancel(&a.recv);
        MPI_Wait(&a.recv, MPI_STATUS_IGNORE);
      }
      // A 32-byte send is buffered eagerly, so it completes locally even when the peer is gone.
      if (a.send != MPI_REQUEST_NULL) MPI_Request_free(&a.send);
    }
    asked_.clear();
  }

  void post_notice(const std::vector<int>& ranks, const departures::Departure& departure) override {
    // Heap-held: a notice to a rank that is stopped (alive, not reading) may never be sent, and its
    // request is then freed with the buffer still lent to MPI, which is left allocated (end_notice).
    notice_ = new Notice;
    LeavingWords& words = notice_->words;
    words.status = departure.status;
    words.length = static_cast<int64_t>(std::min(departure.reason.size(), sizeof(words.reason)));
    std::copy_n(departure.reason.data(), words.length, words.reason);
    words.reached_count = static_cast<int64_t>(std::min(departure.reached.size(), departures::kMaxReached));
    for (int64_t i = 0; i < words.reached_count; ++i) {
      const auto& r = departure.reached[static_cast<size_t>(i)];
      words.reached[i][0] = static_cast<int64_t>(r.key);
      words.reached[i][1] = r.collective;
      words.reached[i][2] = r.internal;
    }
    notice_->told.resize(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) {
      Told& t = notice_->told[i];
      MPI_Irecv(&t.word, 1, MPI_INT64_T, ranks[i], kLeavingAckTag, comm_, &t.ack);
      MPI_Isend(&words, kLeavingBytes, MPI_BYTE, ranks[i], kLeavingTag, comm_, &t.send);
    }
  }

  size_t acknowledged() override {
    size_t count = 0;
    for (Told& t : notice_->told) {
      if (!t.acknowledged) {
        int done = 0;
        MPI_Test(&t.ack, &done, MPI_STATUS_IGNORE);
        t.acknowledged = done != 0;
      }
      count += t.acknowledged ? 1 : 0;
    }
    return count;
  }

  // Unacknowledged notices are withdrawn. Neither the cancel nor the send's completion is waited
  // for without a bound: a 1.3 KB send is eager, but to a stopped rank it can stay queued (Open MPI
  // does not cancel sends), and this runs in exit handlers that must not hang.
  void end_notice() override {
    if (!notice_) return;
    for (Told& t : notice_->told)
      if (t.ack != MPI_REQUEST_NULL) MPI_Cancel(&t.ack);
    const auto give_up = side_channel::Clock::now() + std::chrono::milliseconds(100);
    bool unfinished = true;
    while (unfinished) {
      unfinished = false;
      for (Told& t : notice_->told)
        for (MPI_Request* r : {&t.ack, &t.send}) {
          if (*r == MPI_REQUEST_NULL) continue;
          int done = 0;
          MPI_Test(r, &done, MPI_STATUS_IGNORE);  // sets *r to MPI_REQUEST_NULL when done
          unfinished = unfinished || !done;
        }
      if (!unfinished || side_channel::Clock::now() >= give_up) break;
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    if (!unfinished) {
      delete notice_;
    } else {
      for (Told& t : notice_->told)
        for (MPI_Request* r : {&t.ack, &t.send})
          if (*r != MPI_REQUEST_NULL) MPI_Request_free(r);
      // Left allocated: MPI may still write an acknowledgement into it or read the notice.
    }
    notice_ = nullptr;
  }

  void close() override {
    for (MPI_Request* request : {&incoming_, &leaving_})
      if (*request != MPI_REQUEST_NULL) {
        MPI_Cancel(request);
        MPI_Wait(request, MPI_STATUS_IGNORE);
      }
    for (auto& out : outgoing_) MPI_Request_free(&out.request);
    outgoing_.clear();
    for (auto& ack : acks_) MPI_Request_free(&ack.first);
    acks_.clear();
    end_question();  // a question in flight: its receives cancelled, its sends freed
    if (notice_) {   // a notice in flight: its requests freed, its buffers left to MPI
      for (Told& t : notice_->told)
        for (MPI_Request* r : {&t.ack, &t.send})
          if (*r != MPI_REQUEST_NULL) MPI_Request_free(r);
      notice_ = nullptr;
    }
    MPI_Comm_free(&comm_);
  }

 private:
  // Takes note of the departure notices that have arrived (failing the communicators with that
  // rank) and acknowledges each.
  void serve_departures() {
    for (auto it = acks_.begin(); it != acks_.end();) {
      int done = 0;
      MPI_Test(&it->first, &done, MPI_STATUS_IGNORE);
      it = done ? acks_.erase(it) : std::next(it);
    }
    for (;;) {
      if (leaving_ == MPI_REQUEST_NULL)
        MPI_Irecv(&arrived_, kLeavingBytes, MPI_BYTE, MPI_ANY_SOURCE, kLeavingTag, comm_, &leaving_);
      int done = 0;
      MPI_Status status;
      MPI_Test(&leaving_, &done, &status);
      if (!done) return;
      leaving_ = MPI_REQUEST_NULL;
      const size_t length = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(arrived_.length, 0)),
                                             sizeof(arrived_.reason));
      departures::Departure d{status.MPI_SOURCE, static_cast<int>(arrived_.status), std::string(arrived_.reason, length),
                              {}};
      const auto count = std::clamp<int64_t>(arrived_.reached_count, 0, static_cast<int64_t>(departures::kMaxReached));
      for (int64_t i = 0; i < count; ++i)
        d.reached.push_back(
            {static_cast<uint64_t>(arrived_.reached[i][0]), arrived_.reached[i][1], arrived_.reached[i][2]});
      departures::record(d);
      // Acknowledged only now, with the communicators failed and logged: the leaver may exit next.
      acks_.push_back({MPI_REQUEST_NULL, 1});
      MPI_Isend(&acks_.back().second, 1, MPI_INT64_T, status.MPI_SOURCE, kLeavingAckTag, comm_, &acks_.back().first);
    }
  }

  struct Outgoing {
    MPI_Request request;
    AnswerWords words;
  };
  struct Asked {
    int rank = -1;
    MPI_Request recv = MPI_REQUEST_NULL;
    MPI_Request send = MPI_REQUEST_NULL;
    AnswerWords answer{};
  };
  struct Told {
    MPI_Request send = MPI_REQUEST_NULL;
    MPI_Request ack = MPI_REQUEST_NULL;
    int64_t word = 0;
    bool acknowledged = false;
  };
  struct Notice {
    LeavingWords words;
    std::vector<Told> told;
  };

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  MPI_Request incoming_ = MPI_REQUEST_NULL;  // the next question from any rank
  QueryWords query_{};
  std::list<Outgoing> outgoing_;  // answers being sent (their buffers must live until done)
  int64_t next_id_ = 1;
  int64_t question_id_ = 0;
  QueryWords question_words_{};
  std::vector<Asked> asked_;  // this rank's open question, one entry per asked rank
  MPI_Request leaving_ = MPI_REQUEST_NULL;  // the next departure notice from any rank
  LeavingWords arrived_{};
  std::list<std::pair<MPI_Request, int64_t>> acks_;  // acknowledgements being sent
  Notice* notice_ = nullptr;                         // this rank's own notice, while it is out
};

std::atomic<bool> g_started{false};

}  // namespace

void start() {
  if (g_started.exchange(true)) return;
  auto transport = std::make_shared<MpiTransport>();
  const int rank = transport->rank(), size = transport->size();
  side_channel::install(std::move(transport), rank, size);
}

void stop() {
  if (!g_started.exchange(false)) return;
  side_channel::uninstall();
}

}  // namespace loom::detail::mpi_status
