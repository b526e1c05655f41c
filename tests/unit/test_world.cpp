// The launch-environment parser: every launcher's variables, precedence, and clear errors for
// malformed or inconsistent values.
#include <gtest/gtest.h>

#include "loom/error.h"
#include "loom/world.h"

using loom::ConfigError;
using loom::Environment;
using loom::world_from_environment;

namespace {

// Runs the parser and returns the ConfigError's message ("" when it did not throw).
std::string error_of(const Environment& env) {
  try {
    world_from_environment(env, "host");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(World, NoLauncherIsASingleProcess) {
  auto w = world_from_environment({{"HOME", "/root"}}, "node-a");
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.local_rank, 0);
  EXPECT_EQ(w.local_size, 1);
  EXPECT_EQ(w.launcher, "single");
  EXPECT_EQ(w.hostname, "node-a");
}

TEST(World, OpenMpi) {
  auto w = world_from_environment({{"OMPI_COMM_WORLD_RANK", "5"},
                                   {"OMPI_COMM_WORLD_SIZE", "8"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}},
                                  "h");
  EXPECT_EQ(w.launcher, "openmpi");
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 4);
  EXPECT_TRUE(w.local_known);
  EXPECT_FALSE(w.node_known);  // filled in from MPI by init()
}

TEST(World, Torchrun) {
  auto w = world_from_environment({{"RANK", "3"},
                                   {"WORLD_SIZE", "4"},
                                   {"LOCAL_RANK", "1"},
                                   {"LOCAL_WORLD_SIZE", "2"},
                                   {"GROUP_RANK", "1"}},
                                  "h");
  EXPECT_EQ(w.launcher, "torchrun");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 4);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 2);
  EXPECT_EQ(w.node_index, 1);
  EXPECT_EQ(w.num_nodes, 2);
}

TEST(World, SlurmStepWithTasksPerNode) {
  // 3 nodes: 4, 4 and 2 tasks; this is node 2's second task.
  auto w = world_from_environment({{"SLURM_PROCID", "9"},
                                   {"SLURM_NTASKS", "10"},
                                   {"SLURM_LOCALID", "1"},
                                   {"SLURM_NODEID", "2"},
                                   {"SLURM_NNODES", "3"},
                                   {"SLURM_STEP_ID", "0"},
                                   {"SLURM_TASKS_PER_NODE", "4(x2),2"}},
                                  "h");
  EXPECT_EQ(w.launcher, "slurm");
  EXPECT_EQ(w.rank, 9);
  EXPECT_EQ(w.size, 10);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 2);
  EXPECT_EQ(w.node_index, 2);
  EXPECT_EQ(w.num_nodes, 3);
}

TEST(World, PmiHydra) {
  auto w = world_from_environment(
      {{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "2"}}, "h");
  EXPECT_EQ(w.launcher, "pmi");
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.size, 4);
  EXPECT_EQ(w.local_size, 2);
}

TEST(World, PmixWithoutSizeLeavesItToMpi) {
  auto w = world_from_environment({{"PMIX_RANK", "3"}}, "h");
  EXPECT_EQ(w.launcher, "pmix");
  EXPECT_EQ(w.rank, 3);
  EXPECT_FALSE(w.size_known);
}

TEST(World, MpirunInsideASlurmBatchScriptUsesOpenMpi) {
  // sbatch exports SLURM_PROCID=0 to the script; mpirun's own variables describe this process.
  auto w = world_from_environment({{"SLURM_PROCID", "0"},
                                   {"SLURM_NTASKS", "1"},
                                   {"OMPI_COMM_WORLD_RANK", "3"},
                                   {"OMPI_COMM_WORLD_SIZE", "4"}},
                                  "h");
  EXPECT_EQ(w.launcher, "openmpi");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 4);
}

TEST(World, SlurmBatchShellWithoutStepIsNotALaunch) {
  auto w = world_from_environment({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}, "h");
  EXPECT_EQ(w.launcher, "single");
}

TEST(World, MalformedValuesAreErrorsNamingTheVariable) {
  EXPECT_EQ(error_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}}),
            "launch environment (torchrun): RANK='one' is not a non-negative integer");
  EXPECT_EQ(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}),
            "launch environment (torchrun): RANK='-1' is not a non-negative integer");
  EXPECT_EQ(error_of({{"RANK", "2x"}, {"WORLD_SIZE", "2"}}),
            "launch environment (torchrun): RANK='2x' is not a non-negative integer");
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", ""}}),
            "launch environment (openmpi): OMPI_COMM_WORLD_SIZE='' is not a non-negative integer");
}

TEST(World, InconsistentValuesAreErrorsWithBothSides) {
  EXPECT_EQ(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}),
            "launch environment (torchrun): RANK=4 is out of range for WORLD_SIZE=4 (expected 0..3)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}),
            "launch environment (torchrun): WORLD_SIZE=0, expected at least 1");
  EXPECT_EQ(error_of({{"RANK", "0"}}), "launch environment (torchrun): RANK is set but WORLD_SIZE is missing");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "2"}}), "launch environment (torchrun): WORLD_SIZE is set but RANK is missing");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
            "launch environment (torchrun): LOCAL_RANK is set but LOCAL_WORLD_SIZE is missing");
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "1"},
                      {"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
            "launch environment (openmpi): OMPI_COMM_WORLD_LOCAL_RANK=2 is out of range for "
            "OMPI_COMM_WORLD_LOCAL_SIZE=2 (expected 0..1)");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}}),
            "launch environment (torchrun): 4 processes on this node but only 2 in the job");
}

TEST(World, SlurmTasksPerNodeMustDescribeTheNode) {
  Environment env = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},  {"SLURM_LOCALID", "0"},
                     {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"},  {"SLURM_STEP_ID", "0"},
                     {"SLURM_TASKS_PER_NODE", "2"}};
  EXPECT_EQ(error_of(env),
            "launch environment (slurm): SLURM_TASKS_PER_NODE='2' describes 1 nodes but SLURM_NODEID=1");
  env["SLURM_TASKS_PER_NODE"] = "2(y2)";
  EXPECT_EQ(error_of(env), "launch environment (slurm): SLURM_TASKS_PER_NODE='2(y2)' is not of the form 4(x2),2");
}

// Hostile counts: refused before anything is allocated ("1(x2000000000)" asked for 8 GB), and
// values beyond int are not truncated into range.
TEST(World, SlurmTasksPerNodeIsBounded) {
  Environment env = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                     {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "1"}, {"SLURM_STEP_ID", "0"}};
  for (const char* bad : {"1(x2000000000)", "4294967298", "2(x4294967297)", "1(x60000),1(x60000)"}) {
    env["SLURM_TASKS_PER_NODE"] = bad;
    EXPECT_NE(error_of(env).find("SLURM_TASKS_PER_NODE"), std::string::npos) << bad;
  }
  env["SLURM_TASKS_PER_NODE"] = "1(x60000),1(x60000)";
  EXPECT_NE(error_of(env).find("more than 100000 nodes"), std::string::npos) << error_of(env);
}

TEST(World, CurrentEnvironmentSeesVariables) {
  setenv("LOOM_WORLD_TEST_MARKER", "42", 1);
  auto env = loom::current_environment();
  EXPECT_EQ(env["LOOM_WORLD_TEST_MARKER"], "42");
  EXPECT_FALSE(loom::current_hostname().empty());
}
