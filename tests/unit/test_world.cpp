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
std::string world_error_of(const Environment& env) {
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
  EXPECT_EQ(world_error_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}}),
            "launch environment (torchrun): RANK='one' is not a non-negative integer");
  EXPECT_EQ(world_error_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}),
            "launch environment (torchrun): RANK='-1' is not a non-negative integer");
  EXPECT_EQ(world_error_of({{"RANK", "2x"}, {"WORLD_SIZE", "2"}}),
            "launch environment (torchrun): RANK='2x' is not a non-negative integer");
  EXPECT_EQ(world_error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", ""}}),
            "launch environment (openmpi): OMPI_COMM_WORLD_SIZE='' is not a non-negative integer");
}

TEST(World, InconsistentValuesAreErrorsWithBothSides) {
  EXPECT_EQ(world_error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}),
            "launch environment (torchrun): RANK=4 is out of range for WORLD_SIZE=4 (expected 0..3)");
  EXPECT_EQ(world_error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}),
            "launch environment (torchrun): WORLD_SIZE=0, expected at least 1");
  EXPECT_EQ(world_error_of({{"RANK", "0"}}), "launch environment (torchrun): RANK is set but WORLD_SIZE is missing");
  EXPECT_EQ(world_error_of({{"WORLD_SIZE", "2"}}), "launch environment (torchrun): WORLD_SIZE is set but RANK is missing");
  EXPECT_EQ(world_error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
            "launch environment (torchrun): LOCAL_RANK is set but LOCAL_WORLD_SIZE is missing");
  EXPECT_EQ(world_error_of({{"OMPI_COMM_WORLD_RANK", "1"},
                      {"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
            "launch environment (openmpi): OMPI_COMM_WORLD_LOCAL_RANK=2 is out of range for "
            "OMPI_COMM_WORLD_LOCAL_SIZE=2 (expected 0..1)");
  EXPECT_EQ(world_error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}}),
            "launch environment (torchrun): 4 processes on this node but only 2 in the job");
}

TEST(World, SlurmTasksPerNodeMustDescribeTheNode) {
  Environment env = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},  {"SLURM_LOCALID", "0"},
                     {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"},  {"SLURM_STEP_ID", "0"},
                     {"SLURM_TASKS_PER_NODE", "2"}};
  EXPECT_EQ(world_error_of(env),
            "launch environment (slurm): SLURM_TASKS_PER_NODE='2' describes 1 nodes but SLURM_NODEID=1");
  env["SLURM_TASKS_PER_NODE"] = "2(y2)";
  EXPECT_EQ(world_error_of(env), "launch environment (slurm): SLURM_TASKS_PER_NODE='2(y2)' is not of the form 4(x2),2");
}

// Hostile counts: refused before anything is allocated ("1(x2000000000)" asked for 8 GB), and
// values beyond int are not truncated into range.
TEST(World, SlurmTasksPerNodeIsBounded) {
  Environment env = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                     {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "1"}, {"SLURM_STEP_ID", "0"}};
  for (const char* bad : {"1(x2000000000)", "4294967298", "2(x4294967297)", "1(x60000),1(x60000)"}) {
    env["SLURM_TASKS_PER_NODE"] = bad;
    EXPECT_NE(world_error_of(env).find("SLURM_TASKS_PER_NODE"), std::string::npos) << bad;
  }
  env["SLURM_TASKS_PER_NODE"] = "1(x60000),1(x60000)";
  EXPECT_NE(world_error_of(env).find("more than 100000 nodes"), std::string::npos) << world_error_of(env);
}

TEST(World, CurrentEnvironmentSeesVariables) {
  setenv("LOOM_WORLD_TEST_MARKER", "42", 1);
  auto env = loom::current_environment();
  EXPECT_EQ(env["LOOM_WORLD_TEST_MARKER"], "42");
  EXPECT_FALSE(loom::current_hostname().empty());
}

// Kubernetes: the variables each Kubeflow operator puts in a pod (examples/kubernetes/*.yaml,
// docs/kubernetes.md). The pod environments are the operators' (training-operator 1.7 to 1.9,
// pkg/controller.v1/pytorch/envvar.go and master.go; mpi-operator v2beta1,
// pkg/controller/mpi_job_controller.go); the per-process ones were captured from torchrun 2.15 and
// Open MPI 4.1 started with those pod environments on this machine (MASTER_ADDR given back its
// Service name, temporary paths shortened).
namespace {

// What the training operator sets in every container of a PyTorchJob pod, besides the image's own.
Environment pytorchjob_pod(int pod_index, int pods, int nproc_per_node, const std::string& nproc_text) {
  return {{"PYTHONUNBUFFERED", "1"},
          {"MASTER_PORT", "23456"},
          {"PET_MASTER_PORT", "23456"},
          {"MASTER_ADDR", "loom-gpt-master-0"},
          {"PET_MASTER_ADDR", "loom-gpt-master-0"},
          {"WORLD_SIZE", std::to_string(pods * nproc_per_node)},
          {"RANK", std::to_string(pod_index)},  // the pod's index, not a process rank
          {"PET_NODE_RANK", std::to_string(pod_index)},
          {"PET_NPROC_PER_NODE", nproc_text},
          {"PET_NNODES", std::to_string(pods)},
          // Kubernetes' own, in every pod.
          {"HOSTNAME", pod_index == 0 ? "loom-gpt-master-0" : "loom-gpt-worker-" + std::to_string(pod_index - 1)},
          {"KUBERNETES_SERVICE_HOST", "10.96.0.1"},
          {"KUBERNETES_SERVICE_PORT", "443"}};
}

// torchrun (static rendezvous, from the PET_ variables) starts each process with the pod's
// environment updated by these.
Environment torchrun_process(Environment env, int node, int local_rank, int nproc, int nodes) {
  const int rank = node * nproc + local_rank;
  const std::map<std::string, std::string> overlay = {
      {"RANK", std::to_string(rank)},
      {"GROUP_RANK", std::to_string(node)},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_NAME", "default"},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"WORLD_SIZE", std::to_string(nodes * nproc)},
      {"GROUP_WORLD_SIZE", std::to_string(nodes)},
      {"ROLE_WORLD_SIZE", std::to_string(nodes * nproc)},
      {"MASTER_ADDR", "loom-gpt-master-0"},
      {"MASTER_PORT", "23456"},
      {"OMP_NUM_THREADS", "1"},
      {"TORCHELASTIC_RESTART_COUNT", "0"},
      {"TORCHELASTIC_MAX_RESTARTS", "0"},
      {"TORCHELASTIC_RUN_ID", "none"},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"},
      {"TORCHELASTIC_ERROR_FILE", "/tmp/torchelastic_x/none_y/attempt_0/" + std::to_string(local_rank) + "/error.json"},
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}};
  for (const auto& [name, value] : overlay) env[name] = value;
  return env;
}

}  // namespace

TEST(WorldKubernetes, PyTorchJobPodStartedDirectlyIsOneRankPerPod) {
  // nprocPerNode left at its default, "auto": WORLD_SIZE is the number of pods (1 master + 2
  // workers) and RANK the pod's index, the env:// layout of one process per pod.
  for (int pod = 0; pod < 3; ++pod) {
    const Environment env = pytorchjob_pod(pod, 3, 1, "auto");
    auto w = world_from_environment(env, env.at("HOSTNAME"));
    EXPECT_EQ(w.launcher, "torchrun");  // env:// (MASTER_ADDR, MASTER_PORT): init() takes the Gloo bootstrap
    EXPECT_EQ(w.rank, pod);
    EXPECT_EQ(w.size, 3);
    EXPECT_EQ(w.hostname, env.at("HOSTNAME"));
    // No LOCAL_RANK or GROUP_RANK: init() derives them from the ranks' host names, one per pod.
    EXPECT_FALSE(w.local_known);
    EXPECT_FALSE(w.node_known);
  }
}

TEST(WorldKubernetes, PyTorchJobPodsUnderTorchrunWithNprocPerNode) {
  // examples/kubernetes/pytorchjob.yaml: Master + 1 Worker, nprocPerNode "2", torchrun --no-python.
  const int pods = 2, nproc = 2;
  for (int node = 0; node < pods; ++node) {
    for (int local = 0; local < nproc; ++local) {
      const Environment pod = pytorchjob_pod(node, pods, nproc, "2");
      auto w = world_from_environment(torchrun_process(pod, node, local, nproc, pods), pod.at("HOSTNAME"));
      SCOPED_TRACE("pod " + std::to_string(node) + " local rank " + std::to_string(local));
      EXPECT_EQ(w.launcher, "torchrun");
      EXPECT_EQ(w.rank, node * nproc + local);
      EXPECT_EQ(w.size, pods * nproc);
      EXPECT_EQ(w.local_rank, local);
      EXPECT_EQ(w.local_size, nproc);
      EXPECT_EQ(w.node_index, node);
      EXPECT_EQ(w.num_nodes, pods);
      EXPECT_TRUE(w.local_known);
      EXPECT_TRUE(w.node_known);
    }
  }
}

TEST(WorldKubernetes, PyTorchJobPodWithSeveralProcessesStartedDirectlyIsRefusedAtOnce) {
  // nprocPerNode "2" but the container runs the program itself: WORLD_SIZE=4 counts processes
  // torchrun would have started, RANK is the pod index. Refused before any rendezvous (which
  // would otherwise wait for ranks 2 and 3 until it gave up).
  const Environment env = pytorchjob_pod(1, 2, 2, "2");
  try {
    world_from_environment(env, env.at("HOSTNAME"));
    FAIL() << "not refused";
  } catch (const ConfigError& e) {
    const std::string text = e.what();
    EXPECT_NE(text.find("PET_NPROC_PER_NODE=2"), std::string::npos) << text;
    EXPECT_NE(text.find("no LOCAL_RANK"), std::string::npos) << text;
    EXPECT_NE(text.find("torchrun --no-python"), std::string::npos) << text;
  }
  // "1" (like "auto", the test above) is one process per pod: accepted.
  EXPECT_NO_THROW(world_from_environment(pytorchjob_pod(1, 2, 1, "1"), "pod"));
}

TEST(WorldKubernetes, MpiJobRankReadsOpenMpiNotTheLauncherExtras) {
  // Rank 3 of examples/kubernetes/mpijob.yaml (2 workers x slotsPerWorker 2), started by loomrun
  // --max-restarts in the launcher pod: Open MPI's variables, the operator's OMPI_MCA_ settings
  // forwarded by mpirun, PMIx's (Open MPI 4 starts ranks through PMIx), and loomrun's
  // TORCHELASTIC_RESTART_COUNT, which must not make it look like a torchrun launch.
  const Environment env = {{"OMPI_COMM_WORLD_RANK", "3"},
                           {"OMPI_COMM_WORLD_SIZE", "4"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                           {"OMPI_COMM_WORLD_NODE_RANK", "1"},
                           {"OMPI_UNIVERSE_SIZE", "6"},
                           {"OMPI_MCA_orte_default_hostfile", "/etc/mpi/hostfile"},
                           {"OMPI_MCA_orte_keep_fqdn_hostnames", "true"},
                           {"OMPI_MCA_orte_set_default_slots", "2"},
                           {"OMPI_MCA_plm_rsh_args", "-o ConnectionAttempts=10"},
                           {"PMIX_RANK", "3"},
                           {"PMIX_HOSTNAME", "loom-gpt-mpi-worker-1"},
                           {"K_MPI_JOB_ROLE", "launcher"},
                           {"NVIDIA_VISIBLE_DEVICES", ""},
                           {"LOOM_TP", "2"},
                           {"LOOM_RESTART_COUNT", "0"},
                           {"TORCHELASTIC_RESTART_COUNT", "0"},
                           {"KUBERNETES_SERVICE_HOST", "10.96.0.1"}};
  auto w = world_from_environment(env, "loom-gpt-mpi-worker-1.loom-gpt-mpi.default.svc");
  EXPECT_EQ(w.launcher, "openmpi");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 4);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 2);
  EXPECT_FALSE(w.node_known);  // init() takes the node from MPI: worker-1 is node 1
}

TEST(WorldKubernetes, MpiJobLauncherPodItselfIsNotARank) {
  // The launcher pod's own environment (where loomrun runs): the operator's OMPI_MCA_ settings
  // describe the job to mpirun, not a rank; a program run there directly is a world of one.
  auto w = world_from_environment({{"K_MPI_JOB_ROLE", "launcher"},
                                   {"OMPI_MCA_orte_default_hostfile", "/etc/mpi/hostfile"},
                                   {"OMPI_MCA_orte_keep_fqdn_hostnames", "true"},
                                   {"OMPI_MCA_orte_set_default_slots", "2"},
                                   {"OMPI_MCA_plm_rsh_args", "-o ConnectionAttempts=10"},
                                   {"NVIDIA_VISIBLE_DEVICES", ""}},
                                  "loom-gpt-mpi-launcher");
  EXPECT_EQ(w.launcher, "single");
  EXPECT_EQ(w.size, 1);
}
