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
// Above this size all_reduce halves instead of doubling (see halve()). 2 ranks, time over
// MPI_Allreduce's, C prototype, medians of 31 x 30 calls, two runs: 32 KB 1.00-1.01 either way;
// 64 KB doubling as one message 1.15 (every rank reduces the whole vector), halving 0.99-1.00;
// 128 KB 0.99-1.00; 256 KB 0.98-0.99 (an agreement before MPI_Allreduce: 1.02-1.03 at 64 KB,
// 1.01 at 128 KB). Halving with the received half cut in pipelined pieces was slower (1.09-1.40:
// each piece above the eager limit pays a handshake).
constexpr int64_t kDoublingUpToBytes = 32 << 10;

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
  while (p2_ * 2 <= size_) p2_ *= 2;
  if (rank_ >= p2_) {
    schedule_.push_back({rank_ - p2_, true, false, false});
    schedule_.push_back({rank_ - p2_, false, true, true});
    return;
  }
  const bool has_extra = rank_ + p2_ < size_;
  if (has_extra) schedule_.push_back({rank_ + p2_, false, true, false});
  for (int mask = 1; mask < p2_; mask <<= 1) schedule_.push_back({rank_ ^ mask, true, true, false});
  if (has_extra) schedule_.push_back({rank_ + p2_, true, false, false});
}

int InBandChannel::tag_of(uint64_t fingerprint, Kind kind) const {
  // Fold all 64 bits in: the low ones alone would miss a difference FNV-1a puts in the high ones.
  const uint64_t folded = fingerprint ^ (fingerprint >> 31) ^ (fingerprint >> 47);
  return static_cast<int>(((folded & ((uint64_t{1} << hash_bits_) - 1)) << 2) | static_cast<uint64_t>(kind));
}

char* InBandChannel::slots() {
  slots_.resize(static_cast<size_t>(kMaxPieces) * static_cast<size_t>(max_message_bytes_));
  return slots_.data();
}

void InBandChannel::agree(const Op& op, uint64_t fingerprint) {
  if (!exchange(op, fingerprint, nullptr, 0, MPI_BYTE, MPI_OP_NULL)) report(op, fingerprint);
}

void InBandChannel::all_reduce(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type,
                               MPI_Op reduce) {
  int type_size = 1;
  MPI_Type_size(type, &type_size);
  const bool agreed = int64_t{count} * type_size > kDoublingUpToBytes
                          ? halve(op, fingerprint, data, count, type, reduce)
                          : exchange(op, fingerprint, data, count, type, reduce);
  if (!agreed) report(op, fingerprint);
}

bool InBandChannel::halve(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type, MPI_Op reduce) {
  const SignatureWords mine = signature_words(op.info, fingerprint);
  int type_size = 1;
  MPI_Type_size(type, &type_size);
  const int64_t total_bytes = int64_t{count} * type_size;
  if (total_bytes > max_message_bytes_)
    throw InvalidArgumentError(op.info.describe() + ": " + std::to_string(total_bytes) +
                               " bytes exceed the in-band channel's " + std::to_string(max_message_bytes_));
  const int my_tag = tag_of(fingerprint, kData);
  const int poison_tag = tag_of(fingerprint, kPoison);
  char* bytes = static_cast<char*>(data);
  char* slot = slots();
  bool poisoned = false;
  // Sends this rank's part, or its signature under the poison tag once poisoned; blocking: a
  // peer always takes one message from this rank in each round.
  auto send = [&](const char* part, int64_t part_bytes, int peer, const char* call) {
    if (poisoned)
      check_mpi(MPI_Send(mine.data(), sizeof(mine), MPI_BYTE, peer, poison_tag, comm_), op, call);
    else
      check_mpi(MPI_Send(part, static_cast<int>(part_bytes), MPI_BYTE, peer, my_tag, comm_), op, call);
  };
  // Takes one message from `peer` into `into` when it is the expected one, into the slot otherwise
  // (which poisons this rank). The message is probed first: no byte of another call lands in the
  // caller's buffer, whatever its size.
  auto receive = [&](char* into, int64_t expected_bytes, int peer, const char* call) {
    MPI_Message message = MPI_MESSAGE_NULL;
    MPI_Status status;
    check_mpi(MPI_Mprobe(peer, MPI_ANY_TAG, comm_, &message, &status), op, call);
    int received = 0;
    MPI_Get_count(&status, MPI_BYTE, &received);
    // Every sender on the channel bounds its messages by the same maximum, the slot's size.
    if (received > max_message_bytes_)
      throw CommError(op.info.describe() + ": in-band message of " + std::to_string(received) +
                      " bytes exceeds the channel's " + std::to_string(max_message_bytes_));
    const bool expected = !poisoned && status.MPI_TAG == my_tag && received == expected_bytes;
    check_mpi(MPI_Mrecv(expected ? into : slot, received, MPI_BYTE, &message, MPI_STATUS_IGNORE), op, call);
    if (!expected) poisoned = true;
    return expected;
  };

  // Ranks beyond the largest power of two fold into a partner first and get the result back last.
  if (rank_ >= p2_) {
    send(bytes, total_bytes, rank_ - p2_, "MPI_Send (in-band all-reduce, fold)");
    receive(bytes, total_bytes, rank_ - p2_, "MPI_Mrecv (in-band all-reduce, result)");
    return !poisoned;
  }
  const bool has_extra = rank_ + p2_ < size_;
  if (has_extra && receive(slot, total_bytes, rank_ + p2_, "MPI_Mrecv (in-band all-reduce, fold)"))
    check_mpi(MPI_Reduce_local(slot, bytes, count, type, reduce), op, "MPI_Reduce_local");

  // Reduce-scatter by recursive halving: in each round the segment this rank owns halves; it
  // sends its peer the half the peer keeps and reduces the peer's copy of its own half into the
  // caller's buffer. The rounds pair ranks as the doubling schedule and the agreement do (masks 1,
  // 2, 4, ...), so a rank on another path meets the same peer in the same round.
  struct Segment {
    int64_t first = 0, count = 0;  // elements
  };
  // What each round kept and gave away: the all-gather walks them back.
  std::array<Segment, 32> kept{}, given{};
  Segment own{0, count};
  int rounds = 0;
  for (int mask = 1; mask < p2_; mask <<= 1, ++rounds) {
    const int peer = rank_ ^ mask;
    const Segment lower{own.first, own.count / 2};
    const Segment upper{own.first + lower.count, own.count - lower.count};
    const bool keep_lower = (rank_ & mask) == 0;
    const Segment keep = keep_lower ? lower : upper;
    const Segment give = keep_lower ? upper : lower;
    const int64_t keep_bytes = keep.count * type_size;
    MPI_Status status;
    if (poisoned)
      check_mpi(MPI_Sendrecv(mine.data(), sizeof(mine), MPI_BYTE, peer, poison_tag, slot, max_message_bytes_, MPI_BYTE,
                             peer, MPI_ANY_TAG, comm_, &status),
                op, "MPI_Sendrecv (in-band all-reduce)");
    else
      check_mpi(MPI_Sendrecv(bytes + give.first * type_size, static_cast<int>(give.count * type_size), MPI_BYTE, peer,
                             my_tag, slot, max_message_bytes_, MPI_BYTE, peer, MPI_ANY_TAG, comm_, &status),
                op, "MPI_Sendrecv (in-band all-reduce)");
    int received = 0;
    MPI_Get_count(&status, MPI_BYTE, &received);
    if (poisoned || status.MPI_TAG != my_tag || received != keep_bytes) {
      poisoned = true;
    } else {
      check_mpi(MPI_Reduce_local(slot, bytes + keep.first * type_size, static_cast<int>(keep.count), type, reduce), op,
                "MPI_Reduce_local");
    }
    kept[rounds] = keep;
    given[rounds] = give;
    own = keep;
  }
  // A disagreement anywhere among the first p2 ranks has reached every one of them by now: the
  // ranks that agreed within each group of 2^k exchanged with a whole other group in round k+1,
  // and every later round doubles the poisoned set (a rank on the doubling path, with as many
  // rounds, is poisoned as well). So either all of them skip the all-gather or none does.
  if (!poisoned) {
    // All-gather back along the same rounds: the peer owns the other half of the segment both
    // split in that round. It is received into place only when probed to be that half's size,
    // from the peer whose own copy of this rank's half was checked in the same round.
    for (int r = rounds - 1; r >= 0; --r) {
      const int peer = rank_ ^ (1 << r);
      MPI_Request sent = MPI_REQUEST_NULL;
      check_mpi(MPI_Isend(bytes + kept[r].first * type_size, static_cast<int>(kept[r].count * type_size), MPI_BYTE,
                          peer, my_tag, comm_, &sent),
                op, "MPI_Isend (in-band all-reduce)");
      receive(bytes + given[r].first * type_size, given[r].count * type_size, peer, "MPI_Mrecv (in-band all-reduce)");
      check_mpi(MPI_Wait(&sent, MPI_STATUS_IGNORE), op, "MPI_Wait (in-band all-reduce)");
    }
  }
  if (has_extra) send(bytes, total_bytes, rank_ + p2_, "MPI_Send (in-band all-reduce, result)");
  return !poisoned;
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
  char* area = slots();
  auto slot = [&](int i) { return area + static_cast<size_t>(i) * static_cast<size_t>(max_message_bytes_); };
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
