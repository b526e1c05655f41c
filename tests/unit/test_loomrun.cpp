// loomrun's argument checking and the exact mpirun argv it builds (single node, host list,
// hostfile, environment forwarding, binding from a plan). Real processes: tests/launcher/check_loomrun.py.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>

#include "launcher/host_probe.h"
#include "launcher/hosts.h"
#include "launcher/launcher_args.h"
#include "launcher/launcher_exec.h"
#include "launcher/mpirun_command.h"
#include "launcher/slurm.h"
#include "topology_test_util.h"
#include "../time_scale.h"

using namespace loom::launcher;
using Argv = std::vector<std::string>;

namespace {

Options parse(const Argv& args, const std::string& env_topology = "") {
  return parse_arguments(args, env_topology).options;
}

std::string usage_error(const Argv& args) {
  try {
    parse_arguments(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

LaunchContext context(bool root = false) {
  LaunchContext c;
  c.is_root = root;
  c.local_slots = 4;
  c.local_hostname = "here";
  c.environment = {
      {"PATH", "/usr/bin"},        {"HOME", "/root"},        {"NCCL_DEBUG", "INFO"},          {"NCCL_IB_HCA", "mlx5"},
      {"LOOM_LOG_LEVEL", "debug"}, {"OMP_NUM_THREADS", "1"}, {"CUDA_VISIBLE_DEVICES", "0,1"}, {"NCCLX", "no"},
      {"MY_LOOM_VAR", "no"}};
  return c;
}

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// CUDA_VISIBLE_DEVICES is set in the context but never forwarded by default (a login node's value
// would override each node's own).
const Argv kForwarded = {"-x", "LOOM_LOG_LEVEL",  "-x", "NCCL_DEBUG", "-x", "NCCL_IB_HCA",
                         "-x", "OMP_NUM_THREADS", "-x", "PATH"};

Argv concat(std::initializer_list<Argv> parts) {
  Argv out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace

TEST(Loomrun, SingleNodeDryRunArgv) {
  Options o = parse({"-np", "2", "--dry-run", "--", "./train", "--lr", "0.1"});
  EXPECT_TRUE(o.dry_run);
  Launch l = build_launch(o, context());
  EXPECT_EQ(l.argv, concat({{"mpirun", "-np", "2", "--map-by", "slot", "--bind-to", "none"},
                            kForwarded,
                            {"./train", "--lr", "0.1"}}));
  // As root mpirun needs --allow-run-as-root; more ranks than cores need --oversubscribe.
  Launch root = build_launch(parse({"-np", "6", "--", "./train"}), context(true));
  EXPECT_EQ(Argv(root.argv.begin(), root.argv.begin() + 5),
            (Argv{"mpirun", "-np", "6", "--allow-run-as-root", "--oversubscribe"}));
  EXPECT_EQ(root.notes.at(0), "-np 6 exceeds this machine's 4 cores: --oversubscribe");
}

TEST(Loomrun, HostListArgvAndOptionsBecomeEnvironment) {
  Options o = parse({"-np", "16", "-H", "node1:8,node2:8", "--tp", "2", "--timeline", "/tmp/tl", "--timeout", "30",
                     "--mpirun", "/opt/ompi/bin/mpirun", "--", "./train", "a b"});
  Launch l = build_launch(o, context());
  EXPECT_EQ(
      l.argv,
      concat({{"/opt/ompi/bin/mpirun", "-np", "16", "-H", "node1:8,node2:8", "--map-by", "slot", "--bind-to", "none"},
              kForwarded,
              {"-x", "LOOM_TIMELINE=/tmp/tl", "-x", "LOOM_TIMEOUT=30", "-x", "LOOM_TP=2", "./train", "a b"}}));
  EXPECT_TRUE(l.notes.empty());
  // --pp reaches the ranks as LOOM_PP.
  Launch piped = build_launch(parse({"-np", "8", "--tp", "2", "--pp", "2", "--", "./train"}), context());
  EXPECT_NE(std::find(piped.argv.begin(), piped.argv.end(), "LOOM_PP=2"), piped.argv.end());
  // Oversubscribed hosts.
  Launch over = build_launch(parse({"-np", "20", "-H", "a:8,b:8", "--", "x"}), context());
  EXPECT_NE(std::find(over.argv.begin(), over.argv.end(), "--oversubscribe"), over.argv.end());
  EXPECT_EQ(over.notes.at(0), "-np 20 exceeds the 16 slots of the hosts: --oversubscribe");
}

TEST(Loomrun, HostfileArgv) {
  const std::string path =
      write_temp("hosts.txt", "# two nodes\nnode1 slots=8\n\nnode2 slots=8 max_slots=8  # comment\n");
  Options o = parse({"-np", "16", "--hostfile", path, "--", "./train"});
  ASSERT_EQ(o.hosts.size(), 2u);
  EXPECT_EQ(o.hosts[1].name, "node2");
  EXPECT_EQ(o.hosts[1].slots, 8);
  Launch l = build_launch(o, context());
  EXPECT_EQ(l.argv, concat({{"mpirun", "-np", "16", "--hostfile", path, "--map-by", "slot", "--bind-to", "none"},
                            kForwarded,
                            {"./train"}}));
}

TEST(Loomrun, BadArgumentsSayWhatIsWrong) {
  EXPECT_EQ(usage_error({"-np", "0", "--", "x"}), "-np 0: expected at least 1 rank");
  EXPECT_EQ(usage_error({"-np", "-3", "--", "x"}), "-np -3: expected at least 1 rank");
  EXPECT_EQ(usage_error({"--", "x"}), "-np is missing: how many ranks to start (e.g. -np 4)");
  EXPECT_EQ(usage_error({"-np", "6", "--tp", "4", "--", "x"}),
            "-np 6 is not divisible by --tp 4: every rank belongs to one tensor-parallel group of 4");
  EXPECT_EQ(usage_error({"-np", "2", "--tp", "0", "--", "x"}), "--tp 0: expected at least 1");
  EXPECT_EQ(usage_error({"-np", "2", "--pp", "0", "--", "x"}), "--pp 0: expected at least 1");
  EXPECT_EQ(usage_error({"-np", "8", "--tp", "2", "--pp", "3", "--", "x"}),
            "-np 8 is not divisible by --tp 2 x --pp 3 = 6: every data-parallel replica holds 3 stages of 2 ranks");
  EXPECT_EQ(usage_error({"-np", "2", "-H", "host:abc", "--", "x"}),
            "-H 'host:abc': 'host:abc' is not host or host:slots (slots must be a positive integer, found 'abc')");
  EXPECT_EQ(usage_error({"-np", "2", "-H", ":4", "--", "x"}),
            "-H ':4': ':4' is not host or host:slots (the host name is empty)");
  EXPECT_EQ(usage_error({"-np", "2", "-H", "a:0", "--", "x"}),
            "-H 'a:0': 'a:0' is not host or host:slots (slots must be a positive integer, found '0')");
  EXPECT_EQ(usage_error({"-np", "2", "-H", "a:2,a:2", "--", "x"}),
            "-H 'a:2,a:2': host 'a' is listed twice; give it once with all its slots (a:N)");
  EXPECT_EQ(usage_error({"-np", "2", "--"}), "the program is missing after --");
  EXPECT_EQ(usage_error({"-np", "2"}), "the program is missing: put it after --, e.g. loomrun -np 2 -- ./train");
  EXPECT_EQ(
      usage_error({"-np", "2", "./train"}),
      "The following argument was not expected: ./train (put the program after --: loomrun -np 2 -- ./program args)");
  EXPECT_EQ(usage_error({"-np", "2", "--hostfile", "/nonexistent/hosts", "--", "x"}),
            "--hostfile /nonexistent/hosts: cannot read it (No such file or directory)");
  const std::string bad = write_temp("bad_hosts.txt", "node1 slots=8\nnode2 cpus=8\n");
  EXPECT_EQ(usage_error({"-np", "2", "--hostfile", bad, "--", "x"}),
            "--hostfile " + bad + ", line 2: 'cpus=8': expected slots=N or max_slots=N");
  EXPECT_EQ(usage_error({"-np", "2", "-H", "a", "--hostfile", bad, "--", "x"}),
            "give either -H or --hostfile, not both");
  EXPECT_EQ(usage_error({"-np", "2", "--json", "--", "x"}), "--json needs --plan");
  EXPECT_EQ(usage_error({"-np", "2", "--timeout", "soon", "--", "x"}),
            "--timeout soon: expected seconds between 0.001 and 86400");
  EXPECT_EQ(usage_error({"-np", "2", "--", "-x"}),
            "the program '-x' starts with '-': mpirun would read it as an option");
  EXPECT_EQ(usage_error({"-np", "2", "--frobnicate", "--", "x"}),
            "The following argument was not expected: --frobnicate");
  EXPECT_EQ(usage_error({"-np", "two", "--", "x"}), "-np two: expected an integer");
  EXPECT_EQ(usage_error({"-np", "2", "--tp", "2.5", "--", "x"}), "--tp 2.5: expected an integer");
  // After "--" everything belongs to the program, even what looks like loomrun's options.
  Options o = parse({"-np", "1", "--", "prog", "-np", "5", "--", "--tp"});
  EXPECT_EQ(o.program, (Argv{"prog", "-np", "5", "--", "--tp"}));
  EXPECT_EQ(o.np, 1);
  EXPECT_TRUE(parse_arguments({"--help"}).help.has_value());
}

TEST(Loomrun, SlotsAndTensorParallelGroupsMustFitHosts) {
  auto error = [](const Argv& args) {
    try {
      build_launch(parse(args), context());
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error({"-np", "8", "--no-oversubscribe", "--", "x"}),
            "-np 8 exceeds this machine's 4 cores and --no-oversubscribe was given: add hosts or slots, or drop "
            "--no-oversubscribe");
  EXPECT_EQ(error({"-np", "6", "-H", "a:3,b:3", "--tp", "2", "--", "x"}),
            "host 'a' has 3 slots, not a multiple of --tp 2: a tensor-parallel group would span two hosts");
  EXPECT_EQ(error({"-np", "4", "--no-oversubscribe", "--", "x"}), "");
}

TEST(Loomrun, TopologyBindsRanksThroughARankfile) {
  const std::string dgx = loom::topo::testing::fixture_path("dgx1_v100_1nic_oneflow.txt");
  LaunchContext c = context();
  c.environment["LOOM_TOPOLOGY"] = "/old.json";  // options win over the caller's variables: no duplicate -x
  LaunchContext with_tp = c;
  with_tp.environment["LOOM_TP"] = "4";
  Options o = parse({"-np", "16", "-H", "n1:8,n2:8", "--tp", "2", "--topology", dgx, "--", "./train"});
  Launch l = build_launch(o, with_tp);
  ASSERT_TRUE(l.plan);
  EXPECT_EQ(l.topology->nodes.size(), 2u);  // one described node stands for both hosts
  EXPECT_EQ(l.plan->hostnames, (std::vector<std::string>{"n1", "n2"}));
  EXPECT_EQ(l.notes.at(0), "the topology file describes one node; planned as 2 identical hosts");
  EXPECT_EQ(l.argv, concat({{"mpirun", "-np", "16", "-H", "n1:8,n2:8", "--rankfile", kRankfilePlaceholder, "--mca",
                             "rmaps_rank_file_physical", "1", "-x", "LOOM_RANKS_PER_NODE=8"},
                            kForwarded,
                            {"-x", "LOOM_TOPOLOGY=" + dgx, "-x", "LOOM_TP=2", "./train"}}));
  // One line per rank: its host and the CPUs next to its GPU.
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos < l.rankfile.size()) {
    size_t end = l.rankfile.find('\n', pos);
    lines.push_back(l.rankfile.substr(pos, end - pos));
    pos = end + 1;
  }
  ASSERT_EQ(lines.size(), 16u);
  for (int r = 0; r < 16; ++r) {
    const auto& p = l.plan->layout.ranks[r];
    EXPECT_EQ(lines[r], "rank " + std::to_string(r) + "=" + (p.node == 0 ? "n1" : "n2") +
                            " slot=" + loom::topo::format_cpu_list(p.cpus));
  }
  // Hosts with fewer slots than GPUs: that many ranks per host, the rest of the GPUs unused.
  Launch half = build_launch(parse({"-np", "8", "-H", "n1:4,n2:4", "--tp", "2", "--topology", dgx, "--", "x"}), c);
  EXPECT_EQ(half.plan->ranks_per_node, (std::vector<int>{4, 4}));
  // A local job: the local host name in the rankfile, no rank count to pass on.
  Launch local = build_launch(parse({"-np", "2", "--topology", dgx, "--", "x"}), c);
  EXPECT_EQ(local.rankfile.substr(0, 12), "rank 0=here ");
  EXPECT_EQ(std::count(local.argv.begin(), local.argv.end(), "-x"), 6);  // 5 forwarded (not CUDA_VISIBLE_DEVICES) + LOOM_TP
  // A topology with two nodes cannot describe three hosts.
  const std::string two =
      write_temp("two.json", loom::topo::testing::replicated_json("gtx1080ti_2gpu_phb_numa_na.txt", 2));
  try {
    build_launch(parse({"-np", "6", "-H", "a:2,b:2,c:2", "--topology", two, "--", "x"}), c);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--topology " + two + " describes 2 nodes but the job has 3 host(s): give one node, or one per host");
  }
  // Plan errors and unreadable topologies come through as their own types.
  EXPECT_THROW(build_launch(parse({"-np", "32", "--topology", dgx, "--", "x"}), c), loom::topo::PlanError);
  EXPECT_THROW(build_launch(parse({"-np", "2", "--topology", "/nonexistent.json", "--", "x"}), c),
               loom::topo::ParseError);
  // LOOM_TOPOLOGY from the environment is used when --topology is not given.
  EXPECT_EQ(parse({"-np", "2", "--", "x"}, dgx).topology, dgx);
}

TEST(Loomrun, ShellQuoteRoundTripsThroughASh) {
  const Argv words = {"mpirun",     "plain",       "a b",       "it's",      "$(echo x)", "*",   "",
                      "semi;colon", "back\\slash", "tab\there", "new\nline", "-x",        "K=V", "\"dq\""};
  const std::string line = shell_quote(words);
  // The shell splits the quoted line back into the same words (printed NUL-separated).
  std::string script = "for a in " + line + "; do printf '%s\\0' \"$a\"; done";
  FILE* p = popen(("/bin/sh -c " + shell_quote({script})).c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[256];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0);
  Argv back;
  for (size_t pos = 0; pos < out.size();) {
    size_t end = out.find('\0', pos);
    back.push_back(out.substr(pos, end - pos));
    pos = end + 1;
  }
  EXPECT_EQ(back, words);
  EXPECT_EQ(shell_quote({"mpirun", "-np", "2", "./a.out"}), "mpirun -np 2 ./a.out");
}

TEST(Loomrun, RunAndWaitReportsHowTheChildEnded) {
  std::string error;
  EXPECT_EQ(run_and_wait({"/bin/sh", "-c", "exit 3"}, error), 3);
  EXPECT_EQ(run_and_wait({"/bin/sh", "-c", "kill -TERM $$"}, error), 128 + 15);
  EXPECT_EQ(error, "");
  EXPECT_EQ(run_and_wait({"/nonexistent/mpirun"}, error), 127);
  EXPECT_EQ(error, "cannot run /nonexistent/mpirun: No such file or directory");
  // Arguments arrive verbatim (no shell in between).
  error.clear();
  EXPECT_EQ(run_and_wait({"/bin/sh", "-c", "test \"$1\" = 'a b;$(echo x)|*'", "sh", "a b;$(echo x)|*"}, error), 0);
}

namespace {

std::string launch_error(const Argv& args, const LaunchContext& c = context()) {
  try {
    build_launch(parse(args), c);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// The words of argv between "--bind-to none" (or the last mapping option) and the program.
Argv without(const Argv& argv, const Argv& prefix, const Argv& suffix) {
  return Argv(argv.begin() + static_cast<long>(prefix.size()), argv.end() - static_cast<long>(suffix.size()));
}

}  // namespace

TEST(Loomrun, VariablesMcaAndMpiArgumentsReachTheArgv) {
  LaunchContext c = context();
  c.environment["PYTHONPATH"] = "/py";
  c.environment["LD_LIBRARY_PATH"] = "/lib";
  c.environment["VIRTUAL_ENV"] = "/venv";
  c.environment["HOME"] = "/root";
  Options o = parse({"-np", "2", "-x", "HOME", "-x", "A=x, y=z", "-x", "EMPTY=", "--mca", "btl_tcp_if_include", "eth0",
                     "-mca", "plm_rsh_args", "-p 2222", "--mpi-arg", "--report-bindings", "--mpi-arg=--prefix=/opt/ompi",
                     "--", "./train"});
  ASSERT_EQ(o.variables.size(), 3u);
  EXPECT_FALSE(o.variables[0].value.has_value());
  EXPECT_EQ(*o.variables[1].value, "x, y=z");
  EXPECT_EQ(*o.variables[2].value, "");
  Launch l = build_launch(o, c);
  // Defaults (PATH, LD_LIBRARY_PATH, PYTHONPATH, VIRTUAL_ENV, NCCL_*, LOOM_*...) and -x NAME by
  // name, sorted; then the values.
  EXPECT_EQ(l.argv, concat({{"mpirun", "-np", "2", "--map-by", "slot", "--bind-to", "none", "--mca",
                             "btl_tcp_if_include", "eth0", "--mca", "plm_rsh_args", "-p 2222", "--report-bindings",
                             "--prefix=/opt/ompi"},
                            {"-x", "HOME", "-x", "LD_LIBRARY_PATH", "-x", "LOOM_LOG_LEVEL",
                             "-x", "NCCL_DEBUG", "-x", "NCCL_IB_HCA", "-x", "OMP_NUM_THREADS", "-x", "PATH", "-x",
                             "PYTHONPATH", "-x", "VIRTUAL_ENV", "-x", "A=x, y=z", "-x", "EMPTY="},
                            {"./train"}}));
  // -x NAME=VALUE wins over the forwarded variable of that name; an option's value cannot be contradicted.
  Launch over = build_launch(parse({"-np", "2", "--tp", "2", "-x", "PATH=/mine", "-x", "LOOM_TP=2", "--", "x"}), c);
  EXPECT_EQ(std::count(over.argv.begin(), over.argv.end(), "PATH"), 0);
  EXPECT_EQ(std::count(over.argv.begin(), over.argv.end(), "PATH=/mine"), 1);
  EXPECT_EQ(std::count(over.argv.begin(), over.argv.end(), "LOOM_TP=2"), 1);
  EXPECT_EQ(launch_error({"-np", "2", "--tp", "2", "-x", "LOOM_TP=4", "--", "x"}),
            "-x LOOM_TP=4 contradicts LOOM_TP=2, which loomrun sets from its options: drop one");
  EXPECT_EQ(launch_error({"-np", "2", "-x", "NOT_SET_ANYWHERE", "--", "x"}),
            "-x NOT_SET_ANYWHERE: NOT_SET_ANYWHERE is not set in loomrun's environment, so there is nothing to "
            "forward; set it, or give -x NOT_SET_ANYWHERE=VALUE");
  EXPECT_EQ(launch_error({"-np", "2", "-x", "A=1", "-x", "A=2", "--", "x"}), "-x A is given twice: give it once");
}

TEST(Loomrun, MpiArgumentsReplaceTheDefaultMapping) {
  Launch bind = build_launch(parse({"-np", "2", "--mpi-arg", "--bind-to", "--mpi-arg", "core", "--", "x"}), context());
  EXPECT_EQ(Argv(bind.argv.begin(), bind.argv.begin() + 7),
            (Argv{"mpirun", "-np", "2", "--map-by", "slot", "--bind-to", "core"}));
  EXPECT_EQ(std::count(bind.argv.begin(), bind.argv.end(), "--bind-to"), 1);
  Launch map = build_launch(parse({"-np", "2", "--mpi-arg=--map-by=node", "--", "x"}), context());
  EXPECT_EQ(Argv(map.argv.begin(), map.argv.begin() + 6),
            (Argv{"mpirun", "-np", "2", "--bind-to", "none", "--map-by=node"}));
  EXPECT_EQ(map.notes.at(0),
            "--mpi-arg --map-by replaces loomrun's --map-by slot: consecutive ranks (a TP group) may not share a host");
  const std::string dgx = loom::topo::testing::fixture_path("dgx1_v100_1nic_oneflow.txt");
  EXPECT_EQ(launch_error({"-np", "2", "--topology", dgx, "--mpi-arg", "--bind-to", "--mpi-arg", "core", "--", "x"}),
            "--mpi-arg --bind-to contradicts the rankfile loomrun writes from --topology's plan: drop one of them");
}

TEST(Loomrun, PassedOnArgumentsAreChecked) {
  EXPECT_EQ(usage_error({"-np", "2", "-x", "1A=b", "--", "x"}),
            "-x '1A=b': expected NAME or NAME=VALUE, NAME of letters, digits and '_' (at most 255, not starting with a "
            "digit); found the name '1A'");
  EXPECT_EQ(usage_error({"-np", "2", "-x", "=v", "--", "x"}).substr(0, 15), "-x '=v': expect");
  EXPECT_EQ(usage_error({"-np", "2", "-x", "A-B", "--", "x"}).substr(0, 16), "-x 'A-B': expect");
  EXPECT_NE(usage_error({"-np", "2", "-x", std::string(256, 'A'), "--", "x"}), "");
  EXPECT_EQ(usage_error({"-np", "2", "-x", std::string(255, 'A'), "--", "x"}), "");
  EXPECT_EQ(usage_error({"-np", "2", "-x"}), "-x needs NAME or NAME=VALUE (found nothing)");
  EXPECT_EQ(usage_error({"-np", "2", "-x", "--", "x"}), "-x needs NAME or NAME=VALUE (found '--')");
  EXPECT_EQ(usage_error({"-np", "2", "--mca", "btl", "--", "x"}), "--mca btl needs a VALUE (found '--')");
  EXPECT_EQ(usage_error({"-np", "2", "--mca", "btl-x", "tcp", "--", "x"}),
            "--mca 'btl-x' tcp: expected an MCA parameter name of letters, digits and '_' (as ompi_info lists them)");
  EXPECT_EQ(usage_error({"-np", "2", "--mca", "btl", ":", "--", "x"}),
            "--mca btl ':': mpirun would read ':' as the start of a second program (MPMD)");
  EXPECT_EQ(usage_error({"-np", "2", "--mpi-arg", ":", "--", "x"}),
            "--mpi-arg ':': mpirun would read it as the start of a second program (MPMD); not passed on");
  EXPECT_EQ(usage_error({"-np", "2", "--mpi-arg", "-np", "--", "x"}),
            "--mpi-arg -np: loomrun gives mpirun this option itself; use loomrun's -np");
  EXPECT_EQ(usage_error({"-np", "2", "--mpi-arg=--host=a", "--", "x"}),
            "--mpi-arg --host=a: loomrun gives mpirun this option itself; use loomrun's -H or --hostfile");
  EXPECT_EQ(usage_error({"-np", "2", "--mpi-arg", "--output-filename", "--", "x"}),
            "--mpi-arg --output-filename: loomrun gives mpirun this option itself; use loomrun's --output-dir");
  EXPECT_EQ(usage_error({"-np", "2", "--mpi-arg", "", "--", "x"}),
            "--mpi-arg '': expected an mpirun option or its value");
  EXPECT_EQ(usage_error({"-np", "2", "--max-restarts", "-1", "--", "x"}), "--max-restarts -1: expected 0 to 1000");
  EXPECT_EQ(usage_error({"-np", "2", "--max-restarts", "1001", "--", "x"}), "--max-restarts 1001: expected 0 to 1000");
  EXPECT_EQ(usage_error({"-np", "2", "--output-dir", "/tmp/a:nocopy", "--", "x"}),
            "--output-dir /tmp/a:nocopy: a ':' in the path would be read by mpirun as directives (DIR:nocopy); choose "
            "another path");
  EXPECT_EQ(usage_error({"-np", "2", "--output-dir", "", "--", "x"}), "--output-dir '': expected a directory");
  // Bounded: 10000 of each kind, not one more.
  Argv many = {"-np", "1"};
  for (int i = 0; i <= 10000; ++i) many.insert(many.end(), {"--mpi-arg", "--report-bindings"});
  many.insert(many.end(), {"--", "x"});
  EXPECT_EQ(usage_error(many), "more than 10000 --mpi-arg entries: exceeds the limit (docs/limits.md)");
}

TEST(Loomrun, OutputFilesTagsAndRestartCountPerAttempt) {
  Options o = parse({"-np", "2", "--output-dir", "logs", "--tag-output", "--max-restarts", "3", "--", "x"});
  ASSERT_EQ(o.output_dir.front(), '/');  // relative to where loomrun started: ranks on any host agree
  EXPECT_EQ(o.output_dir.substr(o.output_dir.size() - 5), "/logs");
  LaunchContext c = context();
  for (int attempt : {0, 2}) {
    c.attempt = attempt;
    Launch l = build_launch(o, c);
    const std::string k = std::to_string(attempt);
    EXPECT_EQ(without(l.argv, {"mpirun", "-np", "2", "--map-by", "slot", "--bind-to", "none"}, {"x"}),
              concat({{"--output-filename", o.output_dir + "/attempt_" + k, "--tag-output"},
                      kForwarded,
                      {"-x", "LOOM_RESTART_COUNT=" + k, "-x", "TORCHELASTIC_RESTART_COUNT=" + k}}));
  }
  // Without --max-restarts nothing about restarts is exported.
  Launch once = build_launch(parse({"-np", "2", "--", "x"}), context());
  EXPECT_EQ(std::count(once.argv.begin(), once.argv.end(), "LOOM_RESTART_COUNT=0"), 0);
}

TEST(Loomrun, SlurmNodeListsExpand) {
  auto expand = [](const std::string& text) { return expand_slurm_nodelist(text, "SLURM_JOB_NODELIST"); };
  using Names = std::vector<std::string>;
  EXPECT_EQ(expand("node[01-03,07],gpu5"), (Names{"node01", "node02", "node03", "node07", "gpu5"}));
  EXPECT_EQ(expand("a"), (Names{"a"}));
  EXPECT_EQ(expand("n[8-10]"), (Names{"n8", "n9", "n10"}));
  EXPECT_EQ(expand("n[098-101]"), (Names{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand("r[1-2]n[1-2]-ib"), (Names{"r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"}));
  EXPECT_EQ(expand("x[3],y"), (Names{"x3", "y"}));
  EXPECT_EQ(expand_slurm_counts("4(x3),2", "SLURM_TASKS_PER_NODE"), (std::vector<int>{4, 4, 4, 2}));
  EXPECT_EQ(expand_slurm_counts("72", "SLURM_JOB_CPUS_PER_NODE"), (std::vector<int>{72}));
  auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error([&] { expand("n[1-2"); }), "SLURM_JOB_NODELIST='n[1-2': '[' without ']'");
  EXPECT_EQ(error([&] { expand("n1-2]"); }), "SLURM_JOB_NODELIST='n1-2]': ']' without '['");
  EXPECT_EQ(error([&] { expand("n[[1]]"); }), "SLURM_JOB_NODELIST='n[[1]]': nested '[': expected name[ranges]");
  EXPECT_EQ(error([&] { expand("n[3-1]"); }),
            "SLURM_JOB_NODELIST='n[3-1]': '[3-1]': expected ranges like 01-03,07 (found '3-1')");
  EXPECT_EQ(error([&] { expand("n[a]"); }),
            "SLURM_JOB_NODELIST='n[a]': '[a]': expected ranges like 01-03,07 (found 'a')");
  EXPECT_EQ(error([&] { expand("a,,b"); }),
            "SLURM_JOB_NODELIST='a,,b': an empty entry: expected host or host[ranges] between commas");
  EXPECT_EQ(error([&] { expand("bad host"); }), "SLURM_JOB_NODELIST='bad host': 'bad host' is not a host name");
  EXPECT_EQ(error([&] { expand_slurm_counts("4(x0)", "SLURM_TASKS_PER_NODE"); }),
            "SLURM_TASKS_PER_NODE='4(x0)': '4(x0)': expected N or N(xM), N from 1 to 1000000");
  EXPECT_EQ(error([&] { expand_slurm_counts("four", "SLURM_TASKS_PER_NODE"); }),
            "SLURM_TASKS_PER_NODE='four': 'four': expected N or N(xM), N from 1 to 1000000");
  // Limits, counted before anything is built: a billion names, or a product of ranges, in no time.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(error([&] { expand("n[0-999999999]"); }),
            "SLURM_JOB_NODELIST='n[0-999999999]': more than 100000 hosts: exceeds the limit (docs/limits.md)");
  EXPECT_EQ(error([&] { expand("r[1-1000]n[1-1000]"); }),
            "SLURM_JOB_NODELIST='r[1-1000]n[1-1000]': more than 100000 hosts: exceeds the limit (docs/limits.md)");
  EXPECT_EQ(error([&] { expand_slurm_counts("1(x999999999)", "SLURM_TASKS_PER_NODE"); }),
            "SLURM_TASKS_PER_NODE='1(x999999999)': more than 100000 nodes: exceeds the limit (docs/limits.md)");
  EXPECT_EQ(expand("n[1-100000]").size(), 100000u);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), loom::test::time_bound(5.0))
      << loom::test::time_scale_note();
  EXPECT_NE(error([&] { expand(std::string(kMaxSlurmVariableBytes + 1, 'a')); }), "");
}

TEST(Loomrun, HostsComeFromASlurmAllocation) {
  LaunchContext c = context();
  c.environment["SLURM_JOB_NODELIST"] = "node[01-02],gpu5";
  c.environment["SLURM_JOB_CPUS_PER_NODE"] = "72(x3)";
  c.environment["SLURM_TASKS_PER_NODE"] = "2(x2),4";  // the tasks win over the CPUs, as in Open MPI
  Launch l = build_launch(parse({"-np", "8", "--tp", "2", "--", "x"}), c);
  EXPECT_EQ(Argv(l.argv.begin(), l.argv.begin() + 5), (Argv{"mpirun", "-np", "8", "-H", "node01:2,node02:2,gpu5:4"}));
  EXPECT_EQ(l.notes.at(0),
            "hosts from the Slurm allocation (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE): 3 host(s)");
  // The per-host checks apply: a TP group of 4 cannot sit on a 2-slot node.
  EXPECT_EQ(launch_error({"-np", "8", "--tp", "4", "--", "x"}, c),
            "host 'node01' has 2 slots, not a multiple of --tp 4: a tensor-parallel group would span two hosts");
  // -H wins over the allocation.
  Launch given = build_launch(parse({"-np", "2", "-H", "other:2", "--", "x"}), c);
  EXPECT_EQ(given.argv.at(4), "other:2");
  c.environment.erase("SLURM_TASKS_PER_NODE");
  EXPECT_EQ(build_launch(parse({"-np", "8", "--", "x"}), c).argv.at(4), "node01:72,node02:72,gpu5:72");
  c.environment["SLURM_JOB_CPUS_PER_NODE"] = "72(x2)";
  EXPECT_EQ(launch_error({"-np", "8", "--", "x"}, c),
            "SLURM_JOB_NODELIST names 3 host(s) but SLURM_JOB_CPUS_PER_NODE='72(x2)' gives slots for 2: expected one "
            "count per host");
  c.environment.erase("SLURM_JOB_CPUS_PER_NODE");
  EXPECT_EQ(launch_error({"-np", "8", "--", "x"}, c),
            "SLURM_JOB_NODELIST is set but neither SLURM_TASKS_PER_NODE nor SLURM_JOB_CPUS_PER_NODE is: cannot tell "
            "the slots of the allocation's hosts; give -H host:slots,...");
}

TEST(Loomrun, RunAndWaitSaysWhenLoomrunWasInterrupted) {
  std::string error;
  bool interrupted = true;
  EXPECT_EQ(run_and_wait({"/bin/sh", "-c", "exit 4"}, error, &interrupted), 4);
  EXPECT_FALSE(interrupted);
  // A SIGTERM to this process while the child runs: passed on, and reported.
  EXPECT_EQ(run_and_wait({"/bin/sh", "-c", "kill -TERM $PPID; sleep 5"}, error, &interrupted), 128 + 15);
  EXPECT_TRUE(interrupted);
}

TEST(Loomrun, DropDeadHostsShrinksTheJobToTheLiveHosts) {
  EXPECT_NE(usage_error({"-np", "4", "-H", "a:2,b:2", "--drop-dead-hosts", "--", "x"}).find("--max-restarts"),
            std::string::npos);
  EXPECT_NE(usage_error({"-np", "4", "--max-restarts", "1", "--drop-dead-hosts", "--", "x"}).find("-H or --hostfile"),
            std::string::npos);
  Options o = parse({"-np", "10", "-H", "a:4,b:4,c:2", "--tp", "2", "--max-restarts", "1", "--drop-dead-hosts", "--", "x"});
  std::string why;
  // b is gone: a and c hold 6 slots, so 6 ranks (3 TP groups), and mpirun gets the live hosts.
  auto next = without_dead_hosts(o, {true, false, true}, why);
  ASSERT_TRUE(next.has_value()) << why;
  EXPECT_EQ(next->np, 6);
  ASSERT_EQ(next->hosts.size(), 2u);
  EXPECT_EQ(next->hosts[0].name, "a");
  EXPECT_EQ(next->hosts[1].name, "c");
  Launch l = build_launch(*next, context());
  EXPECT_NE(std::find(l.argv.begin(), l.argv.end(), "a:4,c:2"), l.argv.end());
  // Only c is left at TP 4: 2 slots cannot hold one TP group.
  Options tp4 = parse({"-np", "8", "-H", "a:4,b:4,c:2", "--tp", "4", "--max-restarts", "1", "--drop-dead-hosts", "--", "x"});
  EXPECT_FALSE(without_dead_hosts(tp4, {false, false, true}, why).has_value());
  EXPECT_NE(why.find("fewer than one replica of 4 ranks (--tp 4 x --pp 1)"), std::string::npos) << why;
  // With pipelines a replica is tp x pp ranks: a and c hold 6 slots, one replica of 2 x 2 = 4 ranks.
  Options pp2 = parse({"-np", "8", "-H", "a:4,b:4,c:2", "--tp", "2", "--pp", "2", "--max-restarts", "1",
                       "--drop-dead-hosts", "--", "x"});
  auto shrunk = without_dead_hosts(pp2, {true, false, true}, why);
  ASSERT_TRUE(shrunk.has_value()) << why;
  EXPECT_EQ(shrunk->np, 4);
  EXPECT_FALSE(without_dead_hosts(tp4, {false, false, false}, why).has_value());
  EXPECT_EQ(why, "no host answered");
}
