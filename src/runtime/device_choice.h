// Which CUDA device a rank drives, decided from what it sees: a pure function of the rank's inputs
// (tested in one process), then one agreement across ranks that no two ranks of a node were given
// the same physical GPU unless they asked for it.
//
//   DeviceRequest in;                        // filled by loom::init() from LOOM_DEVICE, CUDA and the plan
//   DeviceChoice choice = choose_device(in);
//   if (choice.device) use *choice.device;   // else choice.problem says why this rank has none
//
// The placement plan names GPUs by their index on the node as NVML lists them, which is not the
// CUDA device number: CUDA_VISIBLE_DEVICES may hide or reorder GPUs, and CUDA numbers the fastest
// first unless CUDA_DEVICE_ORDER=PCI_BUS_ID. The PCI bus id is the same in both, so the plan's GPU
// is found among the visible devices by bus id.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace loom::detail {

struct DeviceRequest {
  std::optional<int> requested;              // LOOM_DEVICE: this process's CUDA device number
  std::vector<std::string> visible_bus_ids;  // by CUDA device number; "" where unknown
  // The plan's GPU for this rank, when there is a plan and it places the rank on this node.
  std::optional<std::string> planned_bus_id;
  int planned_index = -1;  // its index on the node (NVML's), for messages
  int local_rank = 0;
};

struct DeviceChoice {
  std::optional<int> device;  // the CUDA device number; nullopt: this rank runs on the CPU
  std::string why;            // how it was chosen ("LOOM_DEVICE", "the placement plan (GPU 2, 0000:87:00.0)")
  std::string problem;        // why there is none ("" when there is one)
  bool requested = false;     // chosen by LOOM_DEVICE: may be shared with other ranks on purpose
};

// LOOM_DEVICE first; then the plan's GPU, found by bus id among the visible devices; a process that
// sees one GPU uses it; else the device numbered like its local rank, when there is one.
DeviceChoice choose_device(const DeviceRequest& request);

// Every rank's choice, as the agreement gathers it: the node it runs on and the bus id of its GPU
// (or of its CUDA device number, when the bus id is unknown).
struct RankDevice {
  int node = 0;
  std::string gpu;  // "" without a device
  bool requested = false;
};

// Ranks whose GPU another rank of the same node also chose, where not every one of them asked for
// it with LOOM_DEVICE: per rank, "" or the problem ("shares GPU 0000:07:00.0 with rank 1 on its node
// (one GPU per rank, or LOOM_DEVICE on each to share it)").
std::vector<std::string> shared_gpu_problems(const std::vector<RankDevice>& ranks);

}  // namespace loom::detail
