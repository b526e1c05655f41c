// Where each rank runs and how ranks are grouped: device and CPU set per rank, tensor-parallel (TP)
// groups on the best-connected GPUs of one node, data-parallel (DP) rings that cross nodes as few
// times as possible, and a cost model that says what that buys against the naive layout.
//
//   auto topo = loom::topo::load_topology_file("cluster.json");
//   loom::topo::Plan plan = loom::topo::plan(topo, {.world_size = 32, .tp_degree = 2});
//   plan.layout.ranks[5].device;                 // GPU index on plan.layout.ranks[5].node
//   plan.layout.tp_groups[0].ranks;              // {0, 1}: world ranks, in ring order
//   std::cout << loom::topo::explain(plan, 64 << 20);   // per group: devices, link, time vs naive
//
// Conventions (those of loom::make_parallel_groups over the request's loom::ParallelLayout, whose
// innermost dimension must be tp): TP groups are consecutive blocks of world ranks ({0..T-1},
// {T..2T-1}, ...); the other dimensions (dp, pp) group the blocks as the layout says. The plan
// chooses which GPU each rank gets, so the blocks land on well-connected GPUs; consecutive blocks
// follow the best ring through each node, so with the standard order "dp,pp,tp" pipeline
// neighbours are next to each other and a DP ring takes every P-th block. DP rings are given in
// ring order (Ring::ranks), which a communicator may use as its rank order; pipelines in stage order.
//
// Rules, in order of priority, for the GPUs of one node:
//   1. every TP group lies inside one node;
//   2. the slowest TP group is as fast as possible: maximise the smallest bottleneck (minimum
//      pairwise bandwidth within a group) over the node's groups; then the sum of the groups'
//      bottlenecks; then the sum of all pairwise bandwidths within groups; then NUMA locality (fewest
//      NUMA nodes per group);
//   3. when the job uses fewer GPUs than the node has, the unused ones are the worst connected: the
//      used set maximises its minimum pairwise bandwidth, then its total;
//   4. each DP ring visits the nodes in contiguous runs, so a ring spanning m >= 2 nodes crosses
//      between nodes exactly m times (the minimum: every node must be entered once), and inside a
//      node it follows the order with the widest bottleneck link.
// Nodes of up to 8 GPUs (and any node where the candidate count stays below 200,000) are searched
// exhaustively under these rules; larger nodes use a greedy start improved by pairwise swaps
// (polynomial, noted in Plan::notes). Time grows linearly with the number of nodes: 8,192 ranks on
// 1,024 nodes plan in well under a second.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "loom/parallel/layout.h"
#include "loom/topology/topology.h"

namespace loom::topo {

struct PlanRequest {
  int world_size = 1;
  int tp_degree = 1;
  int ranks_per_node = 0;                     // 0: fill each node's GPUs (in node order) before the next
  std::uint64_t message_bytes = 64ull << 20;  // the message size explain() and plan_to_json() model
  int pp_degree = 1;                          // pipeline stages
  std::string layout_order = "dp,pp,tp";      // loom::ParallelLayout::arrange's order; tp innermost
  // ParallelLayout::standard(world_size, tp_degree, pp_degree, layout_order): what the plan groups.
  loom::ParallelLayout layout() const;
};

// A request the topology cannot serve (world not divisible by TP, not enough GPUs, TP larger than a
// node). The message says what was asked and what the topology offers.
class PlanError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct RankPlacement {
  int rank = 0;
  int node = 0;      // index into Topology::nodes
  int device = 0;    // GPU index on that node
  CpuList cpus;      // CPUs to bind to (empty: no binding known)
  int tp_group = 0;  // index into Layout::tp_groups
  int tp_index = 0;  // position in the TP group (= rank % tp_degree)
  int dp_group = 0;  // index into Layout::dp_groups (= tp_index without pipelines)
  int dp_index = 0;  // the rank's dp coordinate (= rank / tp_degree without pipelines)
  int pp_group = 0;  // index into Layout::pp_groups
  int pp_index = 0;  // the rank's pipeline stage
};

// A group as a ring: ranks in ring order, links[i] joins ranks[i] and ranks[(i + 1) % n].
struct Ring {
  std::vector<int> ranks;
  std::vector<Link> links;
};

struct Layout {
  std::vector<RankPlacement> ranks;  // indexed by world rank
  std::vector<Ring> tp_groups;       // TP group g holds ranks g*T .. g*T+T-1 (ring order)
  std::vector<Ring> dp_groups;       // in ParallelLayout::groups({"dp"}) order, members in ring order
                                     // (without pipelines: DP group j holds ranks j, T+j, 2T+j, ...)
  std::vector<Ring> pp_groups;       // in ParallelLayout::groups({"pp"}) order, members stage by stage
};

struct Plan {
  PlanRequest request;
  LinkCosts costs;
  std::vector<std::string> hostnames;         // per topology node ("node<i>" when the topology has none)
  std::vector<int> ranks_per_node;            // per topology node
  std::vector<std::vector<int>> unused_gpus;  // per topology node: GPU indices no rank uses
  Layout layout;                              // the plan
  Layout naive;                               // rank r -> r-th GPU slot in node order, same groups
  std::vector<std::string> notes;             // heuristics used, assumptions made
};

// Throws PlanError for a request the topology cannot serve; std::invalid_argument for an invalid
// topology (see validate()).
Plan plan(const Topology& topology, const PlanRequest& request);

// The CPUs of a rank that drives no GPU of the plan (a CPU job, or one whose GPUs do not fit):
// its node's NUMA nodes shared out in blocks among the node's ranks (local ranks 0..k-1 on the
// first NUMA node, and so on; with more NUMA nodes than ranks, each rank gets several), so that a
// rank's memory and threads stay on one NUMA node. Empty (do not bind) when the node has fewer
// than two NUMA nodes with known CPUs: there is nothing to choose between.
//   cpu_only_share(two_socket_node, /*local_rank=*/3, /*local_size=*/4);   // the second socket's CPUs
CpuList cpu_only_share(const Node& node, int local_rank, int local_size);

// Cost model. time(ring, bytes) = latency_sum + 2(n-1)/n * bytes / bottleneck_bandwidth, where the
// bottleneck is the slowest link between consecutive ring members and latency_sum adds the step
// latency over the 2(n-1) steps of a ring all-reduce (each step waits for the ring's slowest-latency
// link). 0 for a ring of one rank.
double allreduce_time_us(const Ring& ring, double bytes, const LinkCosts& costs);
// The ring's slowest link (highest latency among equals); Self for a ring of one.
Link bottleneck(const Ring& ring, const LinkCosts& costs);

struct ModelledTimes {
  double tp_allreduce_us = 0;  // slowest TP group
  double dp_allreduce_us = 0;  // slowest DP ring
  double naive_tp_allreduce_us = 0;
  double naive_dp_allreduce_us = 0;
};
ModelledTimes modelled_times(const Plan& plan, double bytes);

// Human-readable: the rank table, then per TP group and DP ring its members, devices, bottleneck
// link and modelled all-reduce time next to the naive layout's, and the ratio naive/planned; with
// pipelines, each pipeline's ranks stage by stage and its slowest hop between stages.
std::string explain(const Plan& plan, double bytes);

// {"world_size", "tp_degree", "pp_degree", "layout" ("dp=2,pp=2,tp=2"), "ranks": [{rank, node,
//  hostname, device, cpus}], "tp_groups", "dp_groups" (ascending ranks), "dp_rings" (ring order),
//  "pp_groups" (stage order), "pp_hops" (each pipeline's slowest hop), "unused_gpus",
//  "modelled": {tp_allreduce_us, dp_allreduce_us, naive_tp_allreduce_us, naive_dp_allreduce_us, message_bytes}}
std::string plan_to_json(const Plan& plan, int indent = 2);

// One node as a picture: GPUs as boxes coloured by TP group (unused ones grey), links drawn by class
// (NVLink thick, width by link count; PCIe thin; SYS dashed), and a legend. `node` indexes
// Topology::nodes.
std::string to_svg(const Plan& plan, const Topology& topology, int node);
// The same as a Graphviz graph (render with `dot -Tsvg` where Graphviz is installed).
std::string to_dot(const Plan& plan, const Topology& topology, int node);

}  // namespace loom::topo
