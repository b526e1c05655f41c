// Fingerprints of collective calls, for checking that every rank makes the same calls.
//
// Each communicator folds every collective it issues (operation, dtype, element count, reduce op,
// root, internal or not) into a rolling 64-bit fingerprint. Ranks that have made the same calls
// hold the same value, so comparing it (one tiny all-reduce, or a peer's answer before a timeout
// is reported) catches a divergence that happened anywhere earlier, not only in this call.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm/types.h"

namespace loom::detail {

// The rolling fingerprint after `info` is called (FNV-1a over the signature fields).
uint64_t fold_fingerprint(uint64_t rolling, const OpInfo& info);

// What ranks exchange to say what they called (type, seq, internal, dtype, numel, op, root, fp).
using SignatureWords = std::array<int64_t, 8>;
SignatureWords signature_words(const OpInfo& info, uint64_t fingerprint);
OpInfo info_from_words(const SignatureWords& words);

// "collective mismatch: this rank called X but rank 1 called Y" (every differing rank), from the
// words every rank contributed (rank r's at all[r]). Empty when they all agree.
std::string mismatch_report(const OpInfo& mine, uint64_t my_fingerprint, const std::vector<SignatureWords>& all);

}  // namespace loom::detail
