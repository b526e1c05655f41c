// Asking other ranks how far they have come, out of band, to name the culprit of a timeout.
//
// Every communicator registers its flight record under a key that is the same on all its members
// (its name, its members' job ranks, and how many communicators with that name and membership
// this process made before). When an operation stalls or times out, the rank asks each member
// "what is the last sequence number you called, and what did you call at this one?". The answers
// travel on the job's side channel (side_channel.h: the host backend's transport, served by the
// watchdog thread), so a rank busy computing or blocked inside another collective still answers;
// a rank that is stopped or dead does not, and is reported as such.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/fingerprint.h"

namespace loom::detail {

class FlightRecorder;

namespace peers {

using Clock = std::chrono::steady_clock;

struct Query {
  uint64_t key = 0;
  bool internal = false;
  uint64_t seq = 0;
};

struct Answer {
  bool known = false;        // the peer has this communicator
  int64_t last_called = -1;  // its last called sequence number of that numbering
  std::optional<SignatureWords> called;  // what it called at the asked sequence number
};

// A communicator's key on every member: name, members, and the ordinal of that pair here.
uint64_t register_communicator(const std::string& name, const std::vector<int>& members,
                               std::weak_ptr<FlightRecorder> recorder);
void unregister_communicator(uint64_t key);

// What this process answers.
Answer answer(const Query& query);

// How far one communicator's operations have ended on this rank (FlightRecorder::completed()).
struct Reached {
  uint64_t key = 0;
  int64_t collective = -1;
  int64_t internal = -1;
};
// Every live communicator's, for the departure notice this rank sends when it leaves.
std::vector<Reached> reached_by_communicator();

// The side channel: asks every job rank in `ranks` (this process answers itself locally); an
// answer missing at the deadline is nullopt. Installed by side_channel::install.
using Transport =
    std::function<std::vector<std::optional<Answer>>(const std::vector<int>& ranks, const Query&, Clock::time_point)>;
void set_transport(Transport transport);
void clear_transport();
// nullopt when no transport is installed.
std::optional<std::vector<std::optional<Answer>>> ask(const std::vector<int>& ranks, const Query& query,
                                                      Clock::time_point deadline);

// The peers that called another operation at `mine`'s sequence number, as "rank 3 called
// barrier(seq=7), rank 5 called ..."; empty when none did. Such a call can never be matched:
// waiting for the timeout cannot resolve it.
std::string conflicting_calls(const std::vector<int>& members, int self, const OpInfo& mine, uint64_t my_fingerprint,
                              const std::vector<std::optional<Answer>>& answers);

// "ranks not arrived: 1 (last called seq=76), 3 (no answer: stopped, dead or not in torchloom)";
// "rank 2 called broadcast(...) at seq=77" for a rank that called something else. `members` are
// job ranks by group rank; `self` is this process's group rank; `mine` is the stuck call.
std::string describe_laggards(const std::vector<int>& members, int self, const OpInfo& mine, uint64_t my_fingerprint,
                              const std::vector<std::optional<Answer>>& answers);

}  // namespace peers
}  // namespace loom::detail
