// One validated, numbered operation as a backend receives it.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "loom/comm/types.h"

namespace loom {
class Communicator;
}

namespace loom::detail {

// What a split operation asks for, and what the backend hands back.
struct SplitRequest {
  int color = -1;
  int key = 0;
  std::string name;
  CommunicatorOptions options;
  std::shared_ptr<Communicator> result;  // set by the backend; nullptr for color < 0
};

struct Op {
  OpInfo info;
  std::vector<at::Tensor> inputs;   // read by the operation (none for in-place all_reduce and broadcast)
  std::vector<at::Tensor> outputs;  // written by it (all_reduce and broadcast: their one tensor, also read)
  std::vector<P2POp> batch;         // send/recv batch
  int tag = 0;                      // send/recv: matches a send with its receive (0..kMaxTag)
  bool list_output = false;         // all_gather into one tensor per rank rather than one flat tensor
  // Host backends: before the data moves, agree on the rolling fingerprint and the element count
  // (set for large collectives and every LOOM_FINGERPRINT_INTERVAL-th one).
  bool precheck = false;
  uint64_t fingerprint = 0;         // rolling fingerprint of every collective up to and including this one
  std::shared_ptr<SplitRequest> split;
  at::Tensor staging;               // a backend's own buffer for the operation (kept alive with it)
};

// MPI's guaranteed minimum of MPI_TAG_UB: the largest tag every backend accepts.
inline constexpr int kMaxTag = 32767;

// Checks the op's tensors and arguments against the communicator (group size, device).
// Throws loom::InvalidArgumentError before anything is sent.
void validate(const Op& op, const at::Device& device);

}  // namespace loom::detail
