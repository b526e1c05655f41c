// One validated, numbered operation as a backend receives it.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "loom/comm/types.h"

namespace loom::detail {

struct Op {
  OpInfo info;
  std::vector<at::Tensor> inputs;   // read by the operation
  std::vector<at::Tensor> outputs;  // written by it (all_reduce and broadcast: the same tensor)
  int tag = 0;                      // send/recv: matches a send with its receive (0..32767)
  bool list_output = false;         // all_gather into one tensor per rank rather than one flat tensor
  bool internal = false;            // issued by the library itself (fingerprint exchange)
};

// Checks the op's tensors and arguments against the communicator (group size, device type).
// Throws loom::InvalidArgumentError before anything is sent.
void validate(const Op& op, c10::DeviceType device_type);

}  // namespace loom::detail
