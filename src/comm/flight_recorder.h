// The flight record: the last operations a communicator was asked to run, with their state and
// times, for error reports (logged with every timeout or failure) and for peers that ask what
// this rank called (the "ranks not arrived" part of a timeout message).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "comm/fingerprint.h"
#include "loom/comm/work.h"

namespace loom::detail {

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity);

  // Called at submission, in order.
  void record(const std::shared_ptr<Work>& work, uint64_t fingerprint);

  // The last sequence number this rank called, per numbering (-1: none yet).
  struct Progress {
    int64_t collective = -1;
    int64_t internal = -1;
    int64_t p2p = -1;
  };
  Progress progress() const;
  // The last sequence number whose operation has ended here, per numbering (-1: none remembered).
  // The operations of one numbering end in submission order, so it is the newest remembered entry
  // that is done or released (its backend holds a work until it ends, so a released one has ended).
  // A leaving rank sends it with its departure notice (departure.h).
  Progress completed() const;
  // What this rank called at that sequence number (collectives, user or internal), if remembered.
  std::optional<SignatureWords> find(bool internal, uint64_t seq) const;
  // One line per remembered operation, oldest first: "seq=3 all_reduce shape=[4] dtype=Float: done in 1.2 ms".
  std::string dump() const;

 private:
  // Kept small (no copy of the operation's description): recording is on every call's path.
  struct Entry {
    std::weak_ptr<Work> work;
    SignatureWords signature;  // what was called, even after the work is gone
    Work::Clock::time_point called;
  };
  const size_t capacity_;
  mutable std::mutex mutex_;
  std::deque<Entry> entries_;
  Progress progress_;
};

}  // namespace loom::detail
