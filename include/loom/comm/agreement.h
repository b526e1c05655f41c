// Small agreements over a communicator: every rank contributes a few integers or a string and
// every rank gets everyone's, in rank order. They are the library's control plane (start-up
// checks, the model check of data parallelism, checkpoint plans and verdicts) and are written
// once here, so that each caller does not decide alone how to size, pad, move and decode.
//
// Each call is a collective: every rank of the group calls it, in the same order as its other
// collectives. The operations run as internal ones (loom::detail::InternalOperations) named by
// `purpose`, so errors and timeouts say what was being agreed and the user's sequence numbers do
// not move. Values travel on the communicator's own device (a CUDA tensor for an NCCL group) and
// come back to the host.
//
//   // every rank learns which ranks could not open their file
//   std::vector<int> failed = loom::ranks_reporting(*comm, !opened, "opening the data file");
//   // every rank's host name
//   std::vector<std::string> hosts = loom::all_gather_strings(*comm, hostname, "host names");
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/comm/communicator.h"

namespace loom {

// 64-bit FNV-1a, the hash every agreement compares when the values themselves are too long to
// exchange (a configuration's text, a permutation, a tensor's full shape).
inline constexpr uint64_t kFnvOffsetBasis = 14695981039346656037ull;
inline constexpr uint64_t kFnvPrime = 1099511628211ull;
uint64_t fnv1a(const void* data, size_t bytes, uint64_t hash = kFnvOffsetBasis);
inline uint64_t fnv1a(std::string_view text, uint64_t hash = kFnvOffsetBasis) {
  return fnv1a(text.data(), text.size(), hash);
}

// Limits of one agreement: its purpose (named in errors) and how long it may wait.
struct AgreementOptions {
  const char* purpose = "agreement";
  Timeout timeout = kDefaultTimeout;  // kDefaultTimeout: the communicator's own
};

// Every rank's `mine` (the same length on every rank), concatenated in rank order:
// result[r * mine.size() + i] is rank r's i-th value.
std::vector<int64_t> all_gather_values(Communicator& comm, c10::ArrayRef<int64_t> mine, const AgreementOptions& options);

// The element-wise reduction of every rank's `mine` (the same length on every rank).
std::vector<int64_t> all_reduce_values(Communicator& comm, c10::ArrayRef<int64_t> mine, ReduceOp op,
                                       const AgreementOptions& options);

// `root`'s values on every rank (every rank passes a vector of the same length; only root's
// contents matter).
std::vector<int64_t> broadcast_values(Communicator& comm, c10::ArrayRef<int64_t> values, int root,
                                      const AgreementOptions& options);

// Every rank's string, in rank order (two all-gathers: the lengths, then the bytes padded to the
// longest).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine, const AgreementOptions& options);

// `root`'s string on every rank (two broadcasts: the length, then the bytes).
std::string broadcast_string(Communicator& comm, const std::string& from_root, int root,
                             const AgreementOptions& options);

// The ranks (group ranks, ascending) that passed `has_problem` = true; empty when none did. The
// usual way for every rank to raise together when any one of them cannot go on.
std::vector<int> ranks_reporting(Communicator& comm, bool has_problem, const AgreementOptions& options);

// "rank 3", "ranks 0, 2".
std::string ranks_text(const std::vector<int>& ranks);

}  // namespace loom
