// Where this process stands in the job: rank, world size, rank and size on its node, node index.
//
// loom::init() fills a World from the launcher's environment and checks it against MPI. The
// environment parser is exposed so a launcher's variables can be checked without starting a job:
//
//   loom::World w = loom::world_from_environment({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, "host-a");
//   // w.rank == 1, w.size == 2, w.launcher == "torchrun"
//
// Sources, first match wins (an mpirun inside a Slurm batch script sees both; the innermost,
// Open MPI, is the one that started this process):
//   openmpi   OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
//   pmix      PMIX_RANK with PMIX_SIZE / PMI_SIZE (size otherwise taken from MPI at init)
//   pmi       PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (MPICH Hydra)
//   slurm     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES, SLURM_TASKS_PER_NODE
//   torchrun  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK
//   single    none of the above: one process, world size 1
// A malformed or inconsistent value (not an integer, rank >= size, a rank without a size) is a
// loom::ConfigError naming the variable, its value and what was expected.
#pragma once

#include <map>
#include <string>

namespace loom {

struct World {
  int rank = 0;
  int size = 1;
  int local_rank = 0;   // rank among the processes on this node
  int local_size = 1;   // processes on this node
  int node_index = 0;   // index of this node among the job's nodes
  int num_nodes = 1;
  std::string hostname;
  std::string launcher = "single";  // which environment the values came from
  // True when a value was not given by the environment and must be filled in from MPI
  // (e.g. local rank under PMIx); loom::init() does that and cross-checks the rest.
  bool size_known = true;
  bool local_known = true;
  bool node_known = true;
};

using Environment = std::map<std::string, std::string>;

World world_from_environment(const Environment& env, const std::string& hostname);

// The calling process's environment variables and host name.
Environment current_environment();
std::string current_hostname();

}  // namespace loom
