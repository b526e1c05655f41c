// Plain types shared by every communicator: reduce operations, per-operation options (each with
// a timeout), and the description of a submitted operation that errors, logs and traces name.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/config.h"

namespace loom {

// "Use the communicator's default" (LOOM_TIMEOUT unless the communicator was built with another).
inline constexpr Timeout kDefaultTimeout{-1};

enum class ReduceOp { Sum, Avg, Min, Max, Product };
enum class OpType { AllReduce, Broadcast, AllGather, ReduceScatter, AllToAll, Send, Recv, Barrier, Split, SendRecvBatch };

const char* to_string(ReduceOp op);
const char* to_string(OpType op);

struct AllReduceOptions {
  ReduceOp op = ReduceOp::Sum;
  Timeout timeout = kDefaultTimeout;
};
struct BroadcastOptions {
  int root = 0;
  Timeout timeout = kDefaultTimeout;
};
struct AllGatherOptions {
  Timeout timeout = kDefaultTimeout;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::Sum;
  Timeout timeout = kDefaultTimeout;
};
struct AllToAllOptions {
  Timeout timeout = kDefaultTimeout;
};
struct SendRecvOptions {
  int tag = 0;
  Timeout timeout = kDefaultTimeout;
};
struct BarrierOptions {
  Timeout timeout = kDefaultTimeout;
};
struct SplitOptions {
  Timeout timeout = kDefaultTimeout;  // of the split itself
  // The new communicator's default operation timeout (torch's new_group(timeout=)); empty: this one's.
  std::optional<Timeout> group_timeout;
};

// Options of a communicator as a whole; unset fields come from the configuration
// (loom::config(), i.e. the LOOM_* variables: docs/environment.md).
struct CommunicatorOptions {
  std::optional<Timeout> timeout;          // LOOM_TIMEOUT
  std::optional<OnError> on_error;         // LOOM_ON_ERROR
  std::optional<bool> check_collectives;   // LOOM_CHECK_COLLECTIVES
  std::optional<int64_t> size_check_bytes;      // LOOM_SIZE_CHECK_BYTES
  std::optional<int64_t> fingerprint_interval;  // LOOM_FINGERPRINT_INTERVAL
};

// One send or receive of a batch (Communicator::batch_isend_irecv).
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind = Kind::Send;
  at::Tensor tensor;  // read (send) or written (recv)
  int peer = 0;       // rank in the communicator
  int tag = 0;
};

// One submitted operation, as error messages, logs and traces describe it.
struct OpInfo {
  OpType type = OpType::Barrier;
  uint64_t seq = 0;           // per communicator: collectives, point-to-point and internal counted apart
  bool internal = false;      // issued by torchloom itself (agreements, checks): never shifts user numbers
  std::string purpose;        // internal operations: what for, e.g. "configuration agreement"
  std::string group;          // communicator name, e.g. "world", "tp0"
  int rank = 0;               // rank in the group
  int group_size = 1;
  int job_rank = 0;           // rank in the job
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  ReduceOp reduce = ReduceOp::Sum;
  int peer = -1;              // root (broadcast), peer (send/recv), color (split)
  int operations = 0;         // send/recv batch: how many
  Timeout timeout{0};

  int64_t numel() const;
  // "all_reduce seq=78" or "internal all_gather #3 (configuration agreement)"
  std::string name() const;
  // "[rank 3] all_reduce seq=78 group=world (rank 3 of 8) shape=[80] dtype=Float op=sum"
  std::string describe() const;
  // "all_reduce(seq=78, dtype=Float, numel=80, op=sum)": what two ranks compare.
  std::string signature() const;
};

}  // namespace loom
