// The all-reduce cost model of placement.h: a ring of n members moves 2(n-1)/n of the message over
// its slowest link, in 2(n-1) steps that each wait for the ring's highest link latency.
#include <algorithm>

#include "loom/topology/placement.h"

namespace loom::topo {

Link bottleneck(const Ring& ring, const LinkCosts& costs) {
  Link worst{LinkClass::Self, 0};
  LinkCost worst_cost = costs.cost(worst);
  for (Link l : ring.links) {
    LinkCost c = costs.cost(l);
    if (c.bandwidth_gbps < worst_cost.bandwidth_gbps ||
        (c.bandwidth_gbps == worst_cost.bandwidth_gbps && c.latency_us > worst_cost.latency_us))
      worst = l, worst_cost = c;
  }
  return worst;
}

double allreduce_time_us(const Ring& ring, double bytes, const LinkCosts& costs) {
  const double n = static_cast<double>(ring.ranks.size());
  if (ring.ranks.size() < 2 || ring.links.empty()) return 0.0;
  double max_latency = 0.0;
  for (Link l : ring.links) max_latency = std::max(max_latency, costs.cost(l).latency_us);
  const double bandwidth = costs.cost(bottleneck(ring, costs)).bandwidth_gbps;  // GB/s = 1e3 bytes/us
  return 2.0 * (n - 1.0) * max_latency + 2.0 * (n - 1.0) / n * bytes / (bandwidth * 1e3);
}

ModelledTimes modelled_times(const Plan& plan, double bytes) {
  auto slowest = [&](const std::vector<Ring>& rings) {
    double t = 0.0;
    for (const auto& r : rings) t = std::max(t, allreduce_time_us(r, bytes, plan.costs));
    return t;
  };
  return {slowest(plan.layout.tp_groups), slowest(plan.layout.dp_groups), slowest(plan.naive.tp_groups),
          slowest(plan.naive.dp_groups)};
}

}  // namespace loom::topo
