// cpu_only_share(): the CPU part of placement for ranks that drive no planned GPU.
#include <algorithm>

#include "loom/topology/placement.h"

namespace loom::topo {

CpuList cpu_only_share(const Node& node, int local_rank, int local_size) {
  std::vector<const NumaNode*> numa;
  for (const auto& n : node.numa_nodes)
    if (!n.cpus.empty()) numa.push_back(&n);
  const int count = static_cast<int>(numa.size());
  if (count < 2 || local_size < 1 || local_rank < 0 || local_rank >= local_size) return {};
  // Rank r takes NUMA nodes [r*count/size, (r+1)*count/size) when there are enough to go round,
  // else the one its block of ranks falls on.
  int first = static_cast<int>(static_cast<long long>(local_rank) * count / local_size);
  int last = static_cast<int>(static_cast<long long>(local_rank + 1) * count / local_size);
  if (last <= first) last = first + 1;
  CpuList cpus;
  for (int i = first; i < last; ++i) cpus.insert(cpus.end(), numa[i]->cpus.begin(), numa[i]->cpus.end());
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

}  // namespace loom::topo
