// The job's placement at start-up: every node leader describes its node (hwloc + NVML, or the
// LOOM_TOPOLOGY file), the descriptions are gathered over MPI and merged, and every rank computes
// the same plan (topology/placement.h): the device each rank drives, its CPUs, and the TP groups
// and DP rings that ParallelState then builds.
#pragma once

#include <optional>
#include <string>

#include "loom/comm/communicator.h"
#include "loom/config.h"
#include "loom/topology/placement.h"
#include "loom/world.h"

namespace loom::detail {

struct Placement {
  topo::Topology topology;
  std::optional<topo::Plan> plan;
  std::string source;   // where the description came from
  std::string skipped;  // why there is no plan ("" when there is one)
};

// Collective over `world`. Throws loom::ConfigError on every rank when the topology cannot serve the
// job (the planner's reason), or when a topology file cannot be read.
Placement plan_placement(Communicator& world, const World& w, const Config& config);

// Binds every thread of this process to the rank's planned CPUs where they exist here and it is
// permitted; says what it did (or why not) for the log.
std::string bind_to_planned_cpus(const topo::RankPlacement& rank);

}  // namespace loom::detail
