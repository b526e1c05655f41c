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

namespace {

// One round of InBandChannel::exchange in pieces: every receive posted first, so that the peer's
// pieces land directly in their slots, then the sends. Returns false at the first piece received
// that is not the expected one (another call's message, or poison): the peer sends no more
// pieces this rank expects, so their receives are withdrawn (pieces of another call may stay
// unreceived: the communicator is broken after this). The sends read the caller's data: they are
// complete when this returns, and only then may received values be combined into it.
template <typename Piece, typename SendBytes, typename Slot, typename Expected>
bool swap_pieces(MPI_Comm comm, const Op& op, int peer, int receiving, int sending, int send_tag, int slot_bytes,
                 Piece piece, SendBytes send_bytes, Slot slot, Expected expected) {
  std::array<MPI_Request, kMaxPieces> receives, sends;
  for (int i = 0; i < receiving; ++i)
    check_mpi(MPI_Irecv(slot(i), slot_bytes, MPI_BYTE, peer, MPI_ANY_TAG, comm, &receives[i]), op,
              "MPI_Irecv (in-band agreement)");
  for (int i = 0; i < sending; ++i)
    check_mpi(MPI_Isend(piece(i), send_bytes(i), MPI_BYTE, peer, send_tag, comm, &sends[i]), op,
              "MPI_Isend (in-band agreement)");
  bool agreed = true;
  for (int i = 0; i < receiving && agreed; ++i) {
    MPI_Status status;
    check_mpi(MPI_Wait(&receives[i], &status), op, "MPI_Wait (in-band agreement)");
    if (expected(status, i)) continue;
    agreed = false;
    for (int j = i + 1; j < receiving; ++j) {
      MPI_Cancel(&receives[j]);
      MPI_Wait(&receives[j], MPI_STATUS_IGNORE);
    }
  }
  if (sending > 0)
    check_mpi(MPI_Waitall(sending, sends.data(), MPI_STATUSES_IGNORE), op, "MPI_Waitall (in-band agreement)");
  return agreed;
}

// One recursive-halving all-reduce's messages (InBandChannel::halve): this rank's sends and
// receives, and whether it is poisoned (it found a message it did not expect).
class Halving {
 public:
  Halving(MPI_Comm comm, const Op& op, const SignatureWords& mine, int my_tag, int poison_tag, char* bytes, char* slot,
          int slot_bytes, MPI_Datatype type, int type_size, MPI_Op reduce)
      : comm_(comm), op_(op), mine_(mine), my_tag_(my_tag), poison_tag_(poison_tag), bytes_(bytes), slot_(slot),
        slot_bytes_(slot_bytes), type_(type), type_size_(type_size), reduce_(reduce) {}

  bool poisoned() const { return poisoned_; }
  char* slot() const { return slot_; }

  // Sends this rank's part, or its signature under the poison tag once poisoned; blocking: a
  // peer always takes one message from this rank in each round.
  void send(const char* part, int64_t part_bytes, int peer, const char* call) {
    if (poisoned_)
      check_mpi(MPI_Send(mine_.data(), sizeof(mine_), MPI_BYTE, peer, poison_tag_, comm_), op_, call);
    else
      check_mpi(MPI_Send(part, static_cast<int>(part_bytes), MPI_BYTE, peer, my_tag_, comm_), op_, call);
  }

  // Takes one message from `peer` into `into` when it is the expected one, into the slot otherwise
  // (which poisons this rank). The message is probed first: no byte of another call lands in the
  // caller's buffer, whatever its size.
  bool receive(char* into, int64_t expected_bytes, int peer, const char* call) {
    MPI_Message message = MPI_MESSAGE_NULL;
    MPI_Status status;
    check_mpi(MPI_Mprobe(peer, MPI_ANY_TAG, comm_, &message, &status), op_, call);
    int received = 0;
    MPI_Get_count(&status, MPI_BYTE, &received);
    // Every sender on the channel bounds its messages by the same maximum, the slot's size.
    if (received > slot_bytes_)
      throw CommError(op_.info.describe() + ": in-band message of " + std::to_string(received) +
                      " bytes exceeds the channel's " + std::to_string(slot_bytes_));
    const bool expected = !poisoned_ && status.MPI_TAG == my_tag_ && received == expected_bytes;
    check_mpi(MPI_Mrecv(expected ? into : slot_, received, MPI_BYTE, &message, MPI_STATUS_IGNORE), op_, call);
    if (!expected) poisoned_ = true;
    return expected;
  }

  // Reduce-scatter by recursive halving over ranks [0, p2): in each round the segment this rank
  // owns halves; it sends its peer the half the peer keeps and reduces the peer's copy of its own
  // half into the caller's buffer. The rounds pair ranks as the doubling schedule and the
  // agreement do (masks 1, 2, 4, ...), so a rank on another path meets the same peer in the same
  // round. Returns the number of rounds.
  int reduce_scatter(int rank, int p2, int64_t count) {
    Segment own{0, count};
    int rounds = 0;
    for (int mask = 1; mask < p2; mask <<= 1, ++rounds) {
      const int peer = rank ^ mask;
      const Segment lower{own.first, own.count / 2};
      const Segment upper{own.first + lower.count, own.count - lower.count};
      const bool keep_lower = (rank & mask) == 0;
      const Segment keep = keep_lower ? lower : upper;
      const Segment give = keep_lower ? upper : lower;
      MPI_Status status;
      if (poisoned_)
        check_mpi(MPI_Sendrecv(mine_.data(), sizeof(mine_), MPI_BYTE, peer, poison_tag_, slot_, slot_bytes_, MPI_BYTE,
                               peer, MPI_ANY_TAG, comm_, &status),
                  op_, "MPI_Sendrecv (in-band all-reduce)");
      else
        check_mpi(MPI_Sendrecv(bytes_ + give.first * type_size_, static_cast<int>(give.count * type_size_), MPI_BYTE,
                               peer, my_tag_, slot_, slot_bytes_, MPI_BYTE, peer, MPI_ANY_TAG, comm_, &status),
                  op_, "MPI_Sendrecv (in-band all-reduce)");
      int received = 0;
      MPI_Get_count(&status, MPI_BYTE, &received);
      if (poisoned_ || status.MPI_TAG != my_tag_ || received != keep.count * type_size_)
        poisoned_ = true;
      else
        check_mpi(MPI_Reduce_local(slot_, bytes_ + keep.first * type_size_, static_cast<int>(keep.count), type_,
                                   reduce_),
                  op_, "MPI_Reduce_local");
      kept_[rounds] = keep;
      given_[rounds] = give;
      own = keep;
    }
    return rounds;
  }

  // All-gather back along the same rounds: the peer owns the other half of the segment both split
  // in that round. It is received into place only when probed to be that half's size, from the
  // peer whose own copy of this rank's half was checked in the same round.
  void all_gather(int rank, int rounds) {
    for (int r = rounds - 1; r >= 0; --r) {
      const int peer = rank ^ (1 << r);
      MPI_Request sent = MPI_REQUEST_NULL;
      check_mpi(MPI_Isend(bytes_ + kept_[r].first * type_size_, static_cast<int>(kept_[r].count * type_size_), MPI_BYTE,
                          peer, my_tag_, comm_, &sent),
                op_, "MPI_Isend (in-band all-reduce)");
      receive(bytes_ + given_[r].first * type_size_, given_[r].count * type_size_, peer, "MPI_Mrecv (in-band all-reduce)");
      check_mpi(MPI_Wait(&sent, MPI_STATUS_IGNORE), op_, "MPI_Wait (in-band all-reduce)");
    }
  }

 private:
  struct Segment {
    int64_t first = 0, count = 0;  // elements
  };
  MPI_Comm comm_;
  const Op& op_;
  const SignatureWords& mine_;
  const int my_tag_, poison_tag_;
  char* const bytes_;
  char* const slot_;
  const int slot_bytes_;
  const MPI_Datatype type_;
  const int type_size_;
  const MPI_Op reduce_;
  bool poisoned_ = false;
  // What each round kept and gave away: the all-gather walks them back.
  std::array<Segment, 32> kept_{}, given_{};
};

}  // namespace

bool InBandChannel::halve(const Op& op, uint64_t fingerprint, void* data, int count, MPI_Datatype type, MPI_Op reduce) {
  const SignatureWords mine = signature_words(op.info, fingerprint);
  int type_size = 1;
  MPI_Type_size(type, &type_size);
  const int64_t total_bytes = int64_t{count} * type_size;
  if (total_bytes > max_message_bytes_)
    throw InvalidArgumentError(op.info.describe() + ": " + std::to_string(total_bytes) +
                               " bytes exceed the in-band channel's " + std::to_string(max_message_bytes_));
  char* bytes = static_cast<char*>(data);
  Halving run(comm_, op, mine, tag_of(fingerprint, kData), tag_of(fingerprint, kPoison), bytes, slots(),
              max_message_bytes_, type, type_size, reduce);

  // Ranks beyond the largest power of two fold into a partner first and get the result back last.
  if (rank_ >= p2_) {
    run.send(bytes, total_bytes, rank_ - p2_, "MPI_Send (in-band all-reduce, fold)");
    run.receive(bytes, total_bytes, rank_ - p2_, "MPI_Mrecv (in-band all-reduce, result)");
    return !run.poisoned();
  }
  const bool has_extra = rank_ + p2_ < size_;
  if (has_extra && run.receive(run.slot(), total_bytes, rank_ + p2_, "MPI_Mrecv (in-band all-reduce, fold)"))
    check_mpi(MPI_Reduce_local(run.slot(), bytes, count, type, reduce), op, "MPI_Reduce_local");
  const int rounds = run.reduce_scatter(rank_, p2_, count);
  // A disagreement anywhere among the first p2 ranks has reached every one of them by now: the
  // ranks that agreed within each group of 2^k exchanged with a whole other group in round k+1,
  // and every later round doubles the poisoned set (a rank on the doubling path, with as many
  // rounds, is poisoned as well). So either all of them skip the all-gather or none does.
  if (!run.poisoned()) run.all_gather(rank_, rounds);
  if (has_extra) run.send(bytes, total_bytes, rank_ + p2_, "MPI_Send (in-band all-reduce, result)");
  return !run.poisoned();
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
    } else if (!swap_pieces(comm_, op, round.peer, round.receive ? messages : 0, round.send ? messages : 0, send_tag,
                            max_message_bytes_, [&](int i) { return payload + i * piece; }, send_bytes, slot,
                            expected)) {
      poisoned = true;
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
