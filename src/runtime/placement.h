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

// Collective over `world`. Without a plan when no GPU is described, when the GPUs found do not
// fit the job (more ranks on a node than GPUs: the ranks run on the CPU), or when ranks do not run
// on the nodes the plan numbers them on; `skipped` says why. Throws loom::ConfigError on every rank
// when a machine the user described (LOOM_TOPOLOGY, LOOM_RANKS_PER_NODE) cannot serve the job, or a
// topology file cannot be read.
Placement plan_placement(Communicator& world, const World& w, const Config& config);

// Without a plan: this rank's share of its node's CPUs (topo::cpu_only_share); nullopt when the
// node is not described or has one NUMA node.
std::optional<topo::CpuList> cpu_share_without_plan(const topo::Topology& topology, const World& w);

// Binds every thread of this process to `cpus` where they exist here and it is permitted (not when
// a launcher bound the rank already); says what it did (or why not) for the log.
std::string bind_to_planned_cpus(const topo::CpuList& cpus);

}  // namespace loom::detail
