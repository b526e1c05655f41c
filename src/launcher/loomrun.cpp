// loomrun: starts a torchloom job through mpirun (docs/launcher.md).
//
//   loomrun -np 16 -H node1:8,node2:8 --tp 2 --topology dgx.txt -- ./train --epochs 3
//   loomrun -np 8 --tp 2 --topology dgx.txt --plan            # where each rank would run, and why
//   loomrun -np 2 --dry-run -- ./train                         # the exact mpirun command
//   loomrun -np 4 --max-restarts 3 --output-dir logs -- ./train --checkpoint-dir ckpt --resume
//
// Exit status: the job's (mpirun's; with --max-restarts, the last attempt's), 128 + signal when mpirun died of one, 2 for bad arguments or
// inputs (and for any unexpected error: a message, never an abort with a core dump), 127 when
// mpirun cannot be started.
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include "launcher/host_probe.h"
#include "launcher/hosts.h"
#include "launcher/launcher_args.h"
#include "launcher/launcher_exec.h"
#include "launcher/mpirun_command.h"

extern char** environ;

namespace {

using namespace loom::launcher;

constexpr int kUsageExit = 2;

std::string hostname() {
  char name[HOST_NAME_MAX + 1] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

int usage_error(const std::string& message) {
  std::cerr << "loomrun: " << message << "\nRun loomrun --help for the options.\n";
  return kUsageExit;
}

int print_plan(const Options& o, const Launch& launch) {
  if (!launch.plan) return usage_error("--plan needs a topology: give --topology FILE (or set LOOM_TOPOLOGY)");
  if (o.json) {
    std::cout << loom::topo::plan_to_json(*launch.plan) << "\n";
  } else {
    for (const auto& note : launch.notes) std::cout << "Note: " << note << "\n";
    std::cout << loom::topo::explain(*launch.plan, static_cast<double>(o.message_bytes));
  }
  if (!o.svg.empty()) {
    std::ofstream out(o.svg);
    out << loom::topo::to_svg(*launch.plan, *launch.topology, 0);
    if (!out) {
      std::cerr << "loomrun: cannot write " << o.svg << "\n";
      return 1;
    }
  }
  return 0;
}

std::string describe(int status) {
  if (status > 128 && status < 128 + 65)
    return "exit status " + std::to_string(status) + " (128 + signal " + std::to_string(status - 128) + ")";
  return "exit status " + std::to_string(status);
}

// --drop-dead-hosts, before a restart: the hosts that still answer, and the job that fits on them.
// false (the job is not started again) when none is left.
bool leave_out_dead_hosts(Options& o, const LaunchContext& ctx) {
  const auto probed = std::chrono::steady_clock::now();
  const std::vector<bool> alive = probe_hosts(o, ctx, o.hosts, std::chrono::seconds(15));
  std::string dead;
  for (size_t i = 0; i < o.hosts.size(); ++i)
    if (!alive[i]) dead += (dead.empty() ? "" : ", ") + o.hosts[i].name;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - probed).count();
  char took[32];
  std::snprintf(took, sizeof(took), "%.1f", seconds);
  if (dead.empty()) {
    std::cerr << "loomrun: every host answered (" << took << " s)\n";
    return true;
  }
  std::string why;
  std::optional<Options> next = without_dead_hosts(o, alive, why);
  if (!next) {
    std::cerr << "loomrun: " << dead << " did not answer (" << took << " s) and " << why << ": not starting again\n";
    return false;
  }
  std::string live;
  for (const auto& h : next->hosts) live += (live.empty() ? "" : ",") + h.name + ":" + std::to_string(h.slots);
  std::cerr << "loomrun: " << dead << " did not answer (" << took << " s); starting again without it: -np " << next->np
            << " -H " << live << "\n";
  o = std::move(*next);
  return true;
}

// The command line and this machine, as the launch they ask for; the exit status instead when
// there is nothing to launch (--help) or the command line is refused.
std::optional<int> prepare(int argc, char** argv, Options& o, LaunchContext& ctx, Launch& launch) {
  try {
    const char* env_topology = std::getenv("LOOM_TOPOLOGY");
    Parsed parsed = parse_arguments(std::vector<std::string>(argv + 1, argv + argc), env_topology ? env_topology : "");
    if (parsed.help) {
      std::cout << *parsed.help;
      return 0;
    }
    o = parsed.options;
    ctx.is_root = geteuid() == 0;
    ctx.local_slots = local_core_count();
    ctx.local_hostname = hostname();
    ctx.local_cpus = local_cpu_ids();
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      size_t eq = kv.find('=');
      if (eq != std::string::npos) ctx.environment[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    launch = build_launch(o, ctx);
    return std::nullopt;
  } catch (const UsageError& e) {
    return usage_error(e.what());
  } catch (const loom::topo::ParseError& e) {
    return usage_error(std::string("cannot read the topology: ") + e.what());
  } catch (const loom::topo::PlanError& e) {
    return usage_error(std::string("cannot place the job: ") + e.what());
  }
}

// The rankfile of a launch placed from --topology, in a private /tmp directory made on first use
// and rewritten before each attempt (the same file unless dead hosts were left out).
class Rankfile {
 public:
  ~Rankfile() {
    if (dir_.empty()) return;
    std::remove(path_.c_str());
    rmdir(dir_.c_str());
  }
  // Writes the launch's rankfile (if it has one) and puts its path into the command; false when
  // the directory cannot be made.
  bool write(Launch& launch, bool dry_run) {
    if (!dry_run && !launch.rankfile.empty()) {
      if (dir_.empty()) {
        char pattern[] = "/tmp/loomrun-XXXXXX";
        if (!mkdtemp(pattern)) {
          std::perror("loomrun: mkdtemp");
          return false;
        }
        dir_ = pattern;
        path_ = dir_ + "/rankfile";
      }
      std::ofstream(path_) << launch.rankfile;
    }
    for (auto& arg : launch.argv)
      if (arg == kRankfilePlaceholder) arg = path_;
    return true;
  }

 private:
  std::string dir_;
  std::string path_ = "/tmp/loomrun-XXXXXX/rankfile";
};

int print_dry_run(const Options& o, const Launch& launch) {
  for (const auto& note : launch.notes) std::cout << "# " << note << "\n";
  std::cout << shell_quote(launch.argv) << "\n";
  if (!launch.rankfile.empty())
    std::cout << "# rankfile (written to a new /tmp/loomrun-* directory):\n" << launch.rankfile;
  if (o.max_restarts > 0)
    std::cout << "# when it fails, started again up to " << o.max_restarts
              << " time(s), with LOOM_RESTART_COUNT=1, 2, ..." << (o.drop_dead_hosts ? ", without hosts that no longer answer" : "")
              << "\n";
  return 0;
}

// --max-restarts: a failed job (non-zero status) starts again; the program resumes from its own
// newest complete checkpoint. Not after a signal to loomrun (someone asked the job to end) nor
// when mpirun could not be started.
int run_with_restarts(Options& o, LaunchContext& ctx, Launch& launch, Rankfile& rankfile) {
  int status = 0;
  std::string error;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      ctx.attempt = attempt;
      if (o.drop_dead_hosts && !leave_out_dead_hosts(o, ctx)) break;
      try {
        launch = build_launch(o, ctx);  // the same command, the new restart count (and hosts)
      } catch (const std::exception& e) {
        std::cerr << "loomrun: cannot start the job again: " << e.what() << "\n";
        break;
      }
      if (!rankfile.write(launch, /*dry_run=*/false)) break;
    }
    const auto started = std::chrono::steady_clock::now();
    bool interrupted = false;
    status = run_and_wait(launch.argv, error, &interrupted);
    if (status == 0 || interrupted || !error.empty() || o.max_restarts == 0) break;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    char ran[32];
    std::snprintf(ran, sizeof(ran), "%.1f", seconds);
    if (attempt >= o.max_restarts) {
      std::cerr << "loomrun: the job failed again (" << describe(status) << " after " << ran << " s); "
                << "--max-restarts " << o.max_restarts << " reached, giving up\n";
      break;
    }
    std::cerr << "loomrun: the job failed (" << describe(status) << " after " << ran << " s); starting it again: "
              << "restart " << attempt + 1 << " of " << o.max_restarts << ", LOOM_RESTART_COUNT=" << attempt + 1
              << "\n";
  }
  if (!error.empty()) std::cerr << "loomrun: " << error << "\n";
  return status;
}

int run(int argc, char** argv) {
  Options o;
  LaunchContext ctx;
  Launch launch;
  if (auto done = prepare(argc, argv, o, ctx, launch)) return *done;
  if (o.plan) return print_plan(o, launch);
  Rankfile rankfile;
  if (!rankfile.write(launch, o.dry_run)) return 1;
  if (o.dry_run) return print_dry_run(o, launch);
  return run_with_restarts(o, ctx, launch, rankfile);
}

}  // namespace

int main(int argc, char** argv) {
  // Anything the handlers in run() did not expect (an allocation refused, a filesystem error, a
  // bug) still ends with a message and the usage status, not std::terminate.
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::cerr << "loomrun: out of memory (an input larger than loomrun can hold?)\n";
  } catch (const std::exception& e) {
    std::cerr << "loomrun: " << e.what() << "\n";
  } catch (...) {
    std::cerr << "loomrun: unexpected error\n";
  }
  return kUsageExit;
}
