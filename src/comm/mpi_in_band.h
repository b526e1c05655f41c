// The MPI backend's in-band agreement: ranks check that they make the same collective call with
// the messages that carry it, before any of its data lands.
//
// Why: Open MPI writes past the smaller rank's buffer when ranks pass a collective different
// sizes (benchmarks/report/mpi_mismatch_probe.txt), so ranks must agree before the data moves.
// An agreement made as a separate collective costs a round trip: 20-30% of an all-reduce of
// 256 B-1 KB, 5-15% at 4-16 KB, 2-4% at 64 KB. Here every message's tag carries the sender's
// signature (a hash of the rolling fingerprint) and lands in a slot of the channel's own that
// fits the largest message the channel ever carries (or, probed first, in place: see halve());
// only once its tag and size are checked is it combined into the caller's buffer. A message of
// another call or size never touches that buffer.
//
// Messages follow recursive doubling up to 32 KB, and above it recursive halving (a reduce-scatter
// whose received halves land in the slot, then an all-gather whose halves are probed and received
// in place); ranks beyond the largest power of two fold into a partner first and get the result
// back last. A rank that finds a message it did not expect is "poisoned": it sends poison instead of data in its remaining rounds. Every rank's result
// depends on every other rank through a chain of later rounds, so a disagreement anywhere
// reaches every rank; all of them then gather each other's signature and raise the same
// MismatchError naming who called what. A rank making an unchecked call meanwhile (a collective
// other than all-reduce below LOOM_SIZE_CHECK_BYTES) is not part of the exchange: the others wait
// for it until the operation's timeout, whose warnings and report compare fingerprints.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "comm/fingerprint.h"
#include "comm/op.h"

namespace loom::detail {

class InBandChannel {
 public:
  // `comm` is the channel's own (a duplicate of the communicator's): nothing else is sent on it.
  // The caller keeps ownership and frees it. `max_data_bytes` bounds all_reduce's buffer.
  InBandChannel(MPI_Comm comm, int64_t max_data_bytes);

  // Returns when every rank passed the same signature (rolling fingerprint and element count);
  // otherwise raises MismatchError, on every rank. `fingerprint` is the one the signature carries.
  void agree(const Op& op, uint64_t fingerprint);

  // all_reduce(data) in place whose own messages make the agreement: no extra round trip. On
  // MismatchError the buffer's contents are unspecified (partly reduced), as after any failed
  // collective. `reduce` must be commutative (every loom reduce op is): each pair of ranks
  // combines the same two operands, so every rank ends with the same bits.
  void all_reduce(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type, MPI_Op reduce);

 private:
  // One step of this rank's schedule: send to and/or receive from one peer.
  struct Round {
    int peer = 0;
    bool send = false;
    bool receive = false;
    bool replace = false;  // the received message is the final result (a folded rank's last round)
  };
  enum Kind : int { kSignature = 0, kData = 1, kPoison = 2 };

  // Runs the schedule; `data` is null for a signature-only agreement. Returns true when every
  // rank agreed.
  bool exchange(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type, MPI_Op reduce);
  // all_reduce above 32 KB: recursive halving, same rounds and peers as exchange(). Returns true
  // when every rank agreed.
  bool halve(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type, MPI_Op reduce);
  int tag_of(uint64_t fingerprint, Kind kind) const;
  // The receive slots, allocated at first use: kMaxPieces of max_message_bytes_ each.
  char* slots();
  [[noreturn]] void report(const Op& op, uint64_t fingerprint);

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  int p2_ = 1;         // the largest power of two <= size_
  int hash_bits_ = 0;  // bits of the fingerprint a tag carries (MPI_TAG_UB, less the kind)
  std::vector<Round> schedule_;
  int max_message_bytes_;    // no message on the channel is larger: the size of a receive slot
  std::vector<char> slots_;  // receive slots, one per piece (3 x 256 KB, allocated at first use)
};

}  // namespace loom::detail
