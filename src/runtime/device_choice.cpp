#include "runtime/device_choice.h"

#include <algorithm>
#include <map>

namespace loom::detail {

DeviceChoice choose_device(const DeviceRequest& in) {
  DeviceChoice out;
  const int visible = static_cast<int>(in.visible_bus_ids.size());
  if (visible == 0) {
    out.problem = "no CUDA device is visible";
    return out;
  }
  if (in.requested) {
    out.requested = true;
    if (*in.requested >= visible) {
      out.problem = "LOOM_DEVICE=" + std::to_string(*in.requested) + " is not among the " + std::to_string(visible) +
                    " visible CUDA devices";
      return out;
    }
    out.device = *in.requested;
    out.why = "LOOM_DEVICE";
    return out;
  }
  std::string plan_note;
  if (in.planned_bus_id) {
    const auto it = std::find(in.visible_bus_ids.begin(), in.visible_bus_ids.end(), *in.planned_bus_id);
    const std::string gpu = "GPU " + std::to_string(in.planned_index) + ", " + *in.planned_bus_id;
    if (it != in.visible_bus_ids.end()) {
      out.device = static_cast<int>(it - in.visible_bus_ids.begin());
      out.why = "the placement plan (" + gpu + ")";
      return out;
    }
    plan_note = " (the plan's " + gpu + " is not visible to this process)";
  }
  if (visible == 1) {
    out.device = 0;
    out.why = "the one GPU this process sees" + plan_note;
  } else if (in.local_rank < visible) {
    out.device = in.local_rank;
    out.why = "the local rank" + plan_note;
  } else {
    out.problem = "local rank " + std::to_string(in.local_rank) + " has no GPU of its own: " + std::to_string(visible) +
                  " visible CUDA devices" + plan_note;
  }
  return out;
}

std::vector<std::string> shared_gpu_problems(const std::vector<RankDevice>& ranks) {
  std::map<std::pair<int, std::string>, std::vector<int>> holders;  // (node, gpu) -> ranks
  for (size_t r = 0; r < ranks.size(); ++r)
    if (!ranks[r].gpu.empty()) holders[{ranks[r].node, ranks[r].gpu}].push_back(static_cast<int>(r));
  std::vector<std::string> problems(ranks.size());
  for (const auto& [key, sharing] : holders) {
    if (sharing.size() < 2) continue;
    const bool all_asked = std::all_of(sharing.begin(), sharing.end(), [&](int r) { return ranks[r].requested; });
    if (all_asked) continue;
    for (int r : sharing) {
      std::string others;
      for (int o : sharing)
        if (o != r) others += (others.empty() ? "" : ", ") + std::to_string(o);
      problems[r] = "shares GPU " + key.second + " with rank" + (sharing.size() > 2 ? "s " : " ") + others +
                    " on its node (one GPU per rank, or LOOM_DEVICE on each rank to share it)";
    }
  }
  return problems;
}

}  // namespace loom::detail
