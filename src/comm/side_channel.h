// The side channel of a job: how a rank asks the others how far they have come (peer_status.h) and
// tells them that it leaves (departure.h), apart from the communicators whose operations may be
// the ones stuck. Each host backend brings a transport for it (MPI: a duplicate of
// MPI_COMM_WORLD, mpi_status_channel.cpp; Gloo under torchrun: the rendezvous store,
// store_status_channel.cpp) and installs it here; this file runs the protocol over it, the same
// for every transport:
//   - the watchdog thread serves the transport every poll, so a rank busy computing or blocked in
//     a collective still answers questions and takes note of departures;
//   - an asker answers its own part, and serves while it waits, so two ranks asking each other at
//     once both get their answers; a leaver serves while it waits for acknowledgements (two ranks
//     may leave at once);
//   - every wait is bounded by its deadline, sleeping between polls with the lock released; one
//     question at a time (a second asker waits for the first, within its own deadline);
//   - uninstall() (before MPI_Finalize, or before the store goes) closes the transport under the
//     lock, ending a question or notice in flight: its state lives in the transport, never in a
//     waiting caller's stack frame.
//
//   side_channel::install(std::make_shared<MyTransport>(...), rank, size);   // at start-up
//   side_channel::uninstall();                                                 // before teardown
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "comm/departure.h"
#include "comm/peer_status.h"

namespace loom::detail::side_channel {

using Clock = std::chrono::steady_clock;

// What a backend provides. Every call comes from the protocol with its lock held, so one at a
// time; none blocks longer than a bounded local call.
class Transport {
 public:
  virtual ~Transport() = default;
  // How long a waiting asker or leaver sleeps between polls.
  virtual std::chrono::microseconds poll_interval() const = 0;
  // Takes note of the departure notices that arrived (departures::record, then acknowledges each)
  // and answers the questions that arrived (peers::answer).
  virtual void serve() = 0;
  // A question to `ranks` (never this rank); poll_answers sets answers[i] for ranks[i] once its
  // answer has come; end_question withdraws those that did not.
  virtual void post_question(const std::vector<int>& ranks, const peers::Query& query) = 0;
  virtual void poll_answers(std::vector<std::optional<peers::Answer>>& answers) = 0;
  virtual void end_question() = 0;
  // This rank's departure notice to `ranks`; how many acknowledged it so far; end_notice withdraws
  // it from those that did not (bounded: exit handlers call it).
  virtual void post_notice(const std::vector<int>& ranks, const departures::Departure& notice) = 0;
  virtual size_t acknowledged() = 0;
  virtual void end_notice() = 0;
  // The medium goes: ends whatever is in flight, a question or a notice included.
  virtual void close() = 0;
};

// Makes `transport` the job's side channel for job rank `rank` of `size` (peers::ask and
// departures::announce go through it; the watchdog serves it). A second install while one is
// installed is ignored.
void install(std::shared_ptr<Transport> transport, int rank, int size);
// Closes and removes it; a waiting asker or leaver returns with what it has.
void uninstall();

}  // namespace loom::detail::side_channel
