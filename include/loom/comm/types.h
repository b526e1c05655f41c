// Plain types shared by every communicator: reduce operations, per-operation options (each with
// a timeout), and the description of a submitted operation that errors and traces name.
#pragma once

#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

using Timeout = std::chrono::milliseconds;
// "Use the communicator's default" (LOOM_TIMEOUT unless the communicator was built with another).
inline constexpr Timeout kDefaultTimeout{-1};

enum class ReduceOp { Sum, Avg, Min, Max, Product };
enum class OpType { AllReduce, Broadcast, AllGather, ReduceScatter, AllToAll, Send, Recv, Barrier };

const char* to_string(ReduceOp op);
const char* to_string(OpType op);

// What a communicator does after a collective times out or fails, once the error is raised.
enum class OnError {
  Abort,  // end the whole job (after LOOM_ABORT_GRACE), so that no rank is left hanging
  Raise,  // only mark the communicator broken: later operations on it raise at once
};

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

// Options of a communicator as a whole; unset fields come from the environment (docs/environment.md).
struct CommunicatorOptions {
  Timeout timeout = kDefaultTimeout;  // LOOM_TIMEOUT
  int on_error = -1;                  // -1: LOOM_ON_ERROR; else static_cast<int>(OnError)
  int check_collectives = -1;         // -1: LOOM_CHECK_COLLECTIVES; 0 or 1
};

// One submitted operation, as error messages, logs and traces describe it.
struct OpInfo {
  OpType type = OpType::Barrier;
  uint64_t seq = 0;          // per communicator; collectives and point-to-point counted separately
  std::string group;         // communicator name, e.g. "world", "tp0"
  int rank = 0;              // rank in the group
  int group_size = 1;
  int world_rank = 0;        // rank in the job, for messages
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  ReduceOp reduce = ReduceOp::Sum;
  int peer = -1;             // root (broadcast) or peer (send/recv)
  Timeout timeout{0};

  // "[rank 3] all_reduce seq=78 group=world shape=[80] dtype=float32"
  std::string describe() const;
};

}  // namespace loom
