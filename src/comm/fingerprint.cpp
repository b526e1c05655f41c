#include "comm/fingerprint.h"

#include <sstream>

#include "loom/comm/agreement.h"

namespace loom::detail {
namespace {

// FNV-1a a word at a time (a byte at a time was 2% of a 4-byte all_reduce's submission), with
// the high half folded back after each multiply: a product carries a difference only upward,
// and the in-band tags use the low bits.
uint64_t fold(uint64_t h, int64_t value) {
  h = (h ^ static_cast<uint64_t>(value)) * kFnvPrime;
  return h ^ (h >> 32);
}

// A split's color is not compared: ranks pass different colors by design.
int64_t root_of(const OpInfo& info) { return info.type == OpType::Broadcast ? info.peer : -1; }

int64_t reduce_of(const OpInfo& info) {
  return info.type == OpType::AllReduce || info.type == OpType::ReduceScatter ? static_cast<int64_t>(info.reduce) : -1;
}

}  // namespace

uint64_t fold_fingerprint(uint64_t rolling, const OpInfo& info) {
  uint64_t h = rolling ? rolling : kFnvOffsetBasis;
  h = fold(h, static_cast<int64_t>(info.type));
  h = fold(h, info.internal ? 1 : 0);
  h = fold(h, static_cast<int64_t>(info.dtype));
  h = fold(h, info.numel());
  h = fold(h, reduce_of(info));
  h = fold(h, root_of(info));
  return h;
}

SignatureWords signature_words(const OpInfo& info, uint64_t fingerprint) {
  return {static_cast<int64_t>(info.type), static_cast<int64_t>(info.seq), info.internal ? 1 : 0,
          static_cast<int64_t>(info.dtype), info.numel(), reduce_of(info), root_of(info),
          static_cast<int64_t>(fingerprint)};
}

OpInfo info_from_words(const SignatureWords& w) {
  OpInfo info;
  info.type = static_cast<OpType>(w[0]);
  info.seq = static_cast<uint64_t>(w[1]);
  info.internal = w[2] != 0;
  info.dtype = static_cast<c10::ScalarType>(w[3]);
  info.shape = {w[4]};
  info.reduce = w[5] >= 0 ? static_cast<ReduceOp>(w[5]) : ReduceOp::Sum;
  info.peer = static_cast<int>(w[6]);
  return info;
}

std::string mismatch_report(const OpInfo& mine, uint64_t my_fingerprint, const std::vector<SignatureWords>& all) {
  const SignatureWords own = signature_words(mine, my_fingerprint);
  std::ostringstream text;
  for (size_t r = 0; r < all.size(); ++r) {
    const SignatureWords& theirs = all[r];
    if (theirs == own) continue;
    const bool same_call = std::equal(own.begin(), own.end() - 1, theirs.begin());
    if (text.tellp() == 0) text << "collective mismatch: ";
    else text << "; ";
    if (!same_call) {
      text << "this rank called " << mine.signature() << " but rank " << r << " called "
           << info_from_words(theirs).signature();
    } else {
      // The same call now, but a different history: some earlier collective differed.
      text << "this rank and rank " << r << " both called " << mine.signature()
           << " but their earlier calls differed (the rolling fingerprints of every collective so far disagree: "
              "an earlier call differed in operation, dtype, size, reduce op or root)";
    }
  }
  return text.str();
}

}  // namespace loom::detail
