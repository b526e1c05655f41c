#include "comm/mpi_in_band.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "comm/mpi_check.h"
#include "loom/error.h"

namespace loom::detail {
namespace {

// Open MPI's shared-memory transport sends a message of up to 4 KB (its eager limit, header
// included) at once; a larger one waits for the receiver's answer first (rendezvous). Between 4
// and 12 KB the data goes in pieces below the limit: 2 ranks, 4 KB took 2.0-2.6 us in pieces
// against 5.1-5.5 us as one message (MPI_Allreduce 2.6-2.8 us); at 16 KB and more one message is
// quicker again. A C prototype of the exchange, two runs of 300 iterations.
constexpr int kPieceBytes = 4000;
constexpr int64_t kPiecesUpToBytes = 12 << 10;
constexpr int kMaxPieces = (kPiecesUpToBytes + kPieceBytes - 1) / kPieceBytes;

}  // namespace

InBandChannel::InBandChannel(MPI_Comm comm, int64_t max_data_bytes)
    : comm_(comm),
      max_message_bytes_(static_cast<int>(
          std::max<int64_t>({max_data_bytes, int64_t{kPieceBytes}, static_cast<int64_t>(sizeof(SignatureWords))}))) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  int* tag_ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found);
  const int64_t upper = found && tag_ub ? *tag_ub : 32767;  // the standard's guaranteed minimum
  int bits = 0;
  while (bits < 31 && (int64_t{1} << (bits + 1)) - 1 <= upper) ++bits;
  hash_bits_ = bits - 2;  // two bits say the message's kind

  // Recursive doubling over the largest power of two; rank p2 + i folds into rank i.
  int p2 = 1;
  while (p2 * 2 <= size_) p2 *= 2;
  if (rank_ >= p2) {
    schedule_.push_back({rank_ - p2, true, false, false});
    schedule_.push_back({rank_ - p2, false, true, true});
    return;
  }
  const bool has_extra = rank_ + p2 < size_;
  if (has_extra) schedule_.push_back({rank_ + p2, false, true, false});
  for (int mask = 1; mask < p2; mask <<= 1) schedule_.push_back({rank_ ^ mask, true, true, false});
  if (has_extra) schedule_.push_back({rank_ + p2, true, false, false});
}

int InBandChannel::tag_of(uint64_t fingerprint, Kind kind) const {
  // Fold all 64 bits in: the low ones alone would miss a difference FNV-1a puts in the high ones.
  const uint64_t folded = fingerprint ^ (fingerprint >> 31) ^ (fingerprint >> 47);
  return static_cast<int>(((folded & ((uint64_t{1} << hash_bits_) - 1)) << 2) | static_cast<uint64_t>(kind));
}

void InBandChannel::agree(const Op& op, uint64_t fingerprint) {
  if (!exchange(op, fingerprint, nullptr, 0, MPI_BYTE, MPI_OP_NULL)) report(op, fingerprint);
}

void InBandChannel::all_reduce(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type,
                               MPI_Op reduce) {
  if (!exchange(op, fingerprint, data, count, type, reduce)) report(op, fingerprint);
}

bool InBandChannel::exchange(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type,
                             MPI_Op reduce) {
  const SignatureWords mine = signature_words(op.info, fingerprint);
  const Kind kind = data ? kData : kSignature;
  int type_size = 1;
  MPI_Type_size(type, &type_size);
  const int64_t expected_bytes = data ? int64_t{count} * type_size : static_cast<int64_t>(sizeof(mine));
  if (expected_bytes > max_message_bytes_)
    throw InvalidArgumentError(op.info.describe() + ": " + std::to_string(expected_bytes) +
                               " bytes exceed the in-band channel's " + std::to_string(max_message_bytes_));
  const int my_tag = tag_of(fingerprint, kind);
  // A message above the eager limit goes in pieces (see kPieceBytes), each of a whole number of
  // elements (4000 is a multiple of every element size).
  const int64_t piece = data && expected_bytes <= kPiecesUpToBytes ? kPieceBytes : std::max<int64_t>(expected_bytes, 1);
  const int pieces = static_cast<int>(std::max<int64_t>((expected_bytes + piece - 1) / piece, 1));
  auto piece_bytes = [&](int i) { return static_cast<int>(std::min(piece, expected_bytes - i * piece)); };
  const char* payload = data ? static_cast<const char*>(data) : reinterpret_cast<const char*>(mine.data());
  // One slot per piece, each the size of the largest message this channel ever carries: a
  // receive is posted before its message is seen, and whatever arrives fits its slot.
  slots_.resize(static_cast<size_t>(kMaxPieces) * static_cast<size_t>(max_message_bytes_));
  auto slot = [&](int i) { return slots_.data() + static_cast<size_t>(i) * static_cast<size_t>(max_message_bytes_); };
  bool poisoned = false;
  for (const Round& round : schedule_) {
    const bool was_poisoned = poisoned;
    // Once poisoned, a rank sends its signature under the poison tag instead of its pieces: the
    // peer learns of the disagreement whatever it expected. And it still takes one message from
    // its peer, whatever it is: a large send (a rendezvous) completes only when received, and the
    // peer waits for its sends. (Pieces are all below the eager limit and complete without a
    // receiver.)
    const int messages = poisoned ? 1 : pieces;  // each way
    const void* send_buffer = poisoned ? static_cast<const void*>(mine.data()) : payload;
    const int send_tag = poisoned ? tag_of(fingerprint, kPoison) : my_tag;
    auto send_bytes = [&](int i) { return poisoned ? static_cast<int>(sizeof(mine)) : piece_bytes(i); };
    auto expected = [&](const MPI_Status& status, int i) {
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      return !was_poisoned && status.MPI_TAG == my_tag && bytes == piece_bytes(i);
    };
    if (messages == 1) {
      // One message each way, in one call: MPI_Sendrecv took 0.56-0.57 us at 4-256 B where
      // MPI_Allreduce took 0.67-0.68 and Irecv, Isend and two waits 0.69-0.71 (2 ranks, C).
      MPI_Status status;
      if (round.send && round.receive)
        check_mpi(MPI_Sendrecv(send_buffer, send_bytes(0), MPI_BYTE, round.peer, send_tag, slot(0), max_message_bytes_,
                               MPI_BYTE, round.peer, MPI_ANY_TAG, comm_, &status),
                  op, "MPI_Sendrecv (in-band agreement)");
      else if (round.send)
        check_mpi(MPI_Send(send_buffer, send_bytes(0), MPI_BYTE, round.peer, send_tag, comm_), op,
                  "MPI_Send (in-band agreement)");
      else
        check_mpi(MPI_Recv(slot(0), max_message_bytes_, MPI_BYTE, round.peer, MPI_ANY_TAG, comm_, &status), op,
                  "MPI_Recv (in-band agreement)");
      if (round.receive && !expected(status, 0)) poisoned = true;
    } else {
      // Pieces: every receive posted first, so that the peer's pieces land directly in their slots.
      std::array<MPI_Request, kMaxPieces> receives, sends;
      const int receiving = round.receive ? messages : 0;
      for (int i = 0; i < receiving; ++i)
        check_mpi(MPI_Irecv(slot(i), max_message_bytes_, MPI_BYTE, round.peer, MPI_ANY_TAG, comm_, &receives[i]), op,
                  "MPI_Irecv (in-band agreement)");
      const int sending = round.send ? messages : 0;
      for (int i = 0; i < sending; ++i)
        check_mpi(MPI_Isend(payload + i * piece, send_bytes(i), MPI_BYTE, round.peer, send_tag, comm_, &sends[i]), op,
                  "MPI_Isend (in-band agreement)");
      for (int i = 0; i < receiving; ++i) {
        MPI_Status status;
        check_mpi(MPI_Wait(&receives[i], &status), op, "MPI_Wait (in-band agreement)");
        if (expected(status, i)) continue;
        // Another call's message, or poison. The peer sends no more pieces that this rank
        // expects: withdraw their receives. (Pieces of another call may stay unreceived: the
        // communicator is broken after this.)
        poisoned = true;
        for (int j = i + 1; j < receiving; ++j) {
          MPI_Cancel(&receives[j]);
          MPI_Wait(&receives[j], MPI_STATUS_IGNORE);
        }
        break;
      }
      // The sends read `data`: only once they are done may the received values be combined into it.
      if (sending > 0)
        check_mpi(MPI_Waitall(sending, sends.data(), MPI_STATUSES_IGNORE), op, "MPI_Waitall (in-band agreement)");
    }
    if (round.receive && !poisoned && !data) {
      // The tag carries part of the fingerprint; the words carry all of it, and the count.
      SignatureWords theirs;
      std::memcpy(theirs.data(), slot(0), sizeof(theirs));
      poisoned = theirs[7] != mine[7] || theirs[4] != mine[4];
    }
    if (!round.receive || poisoned || !data) continue;
    for (int i = 0; i < pieces; ++i) {
      char* into = static_cast<char*>(data) + i * piece;
      if (round.replace)  // the final result, to a folded rank
        std::memcpy(into, slot(i), static_cast<size_t>(piece_bytes(i)));
      else
        check_mpi(MPI_Reduce_local(slot(i), into, piece_bytes(i) / type_size, type, reduce), op, "MPI_Reduce_local");
    }
  }
  return !poisoned;
}

void InBandChannel::report(const Op& op, uint64_t fingerprint) {
  // Every rank is poisoned by now (see the header): all of them gather who called what.
  const SignatureWords own = signature_words(op.info, fingerprint);
  std::vector<SignatureWords> all(static_cast<size_t>(size_));
  check_mpi(MPI_Allgather(own.data(), 8, MPI_INT64_T, all.data(), 8, MPI_INT64_T, comm_), op,
            "MPI_Allgather (in-band agreement)");
  std::string why = mismatch_report(op.info, fingerprint, all);
  if (why.empty()) why = "collective mismatch: the ranks' messages disagreed although their signatures agree";
  throw MismatchError(op.info.describe() + ": " + why);
}

}  // namespace loom::detail
