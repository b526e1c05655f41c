#include "launcher/host_probe.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

namespace loom::launcher {

namespace {

// mpirun -np 1 -H HOST:1 true, with the job's MCA parameters (its rsh agent among them).
std::vector<std::string> probe_command(const Options& o, const LaunchContext& ctx, const Host& host) {
  std::vector<std::string> argv = {o.mpirun, "-np", "1", "-H", host.name + ":1"};
  if (ctx.is_root) argv.push_back("--allow-run-as-root");
  for (const auto& [key, value] : o.mca) argv.insert(argv.end(), {"--mca", key, value});
  argv.push_back("true");
  return argv;
}

// Started in a process group of its own, output discarded, so a probe that overruns the bound can
// be ended with everything it started (mpirun and its rsh agent).
pid_t start(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    setpgid(0, 0);
    const int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
      dup2(null, STDIN_FILENO);
      dup2(null, STDOUT_FILENO);
      dup2(null, STDERR_FILENO);
    }
    execvp(argv[0], argv.data());
    _exit(127);
  }
  return child;
}

}  // namespace

std::vector<bool> probe_hosts(const Options& o, const LaunchContext& ctx, const std::vector<Host>& hosts,
                              std::chrono::milliseconds bound) {
  std::vector<pid_t> probes;
  for (const auto& h : hosts) probes.push_back(start(probe_command(o, ctx, h)));
  std::vector<bool> alive(hosts.size(), false);
  std::vector<bool> done(hosts.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + bound;
  size_t left = hosts.size();
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    for (size_t i = 0; i < probes.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (probes[i] <= 0) {
        done[i] = true;
        --left;
      } else if (waitpid(probes[i], &status, WNOHANG) == probes[i]) {
        alive[i] = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        done[i] = true;
        --left;
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < probes.size(); ++i) {
    if (done[i] || probes[i] <= 0) continue;
    kill(-probes[i], SIGKILL);  // the probe's whole group: mpirun and its agent
    waitpid(probes[i], nullptr, 0);
  }
  return alive;
}

std::optional<Options> without_dead_hosts(const Options& o, const std::vector<bool>& alive, std::string& why) {
  Options next = o;
  next.hosts.clear();
  int slots = 0;
  for (size_t i = 0; i < o.hosts.size(); ++i)
    if (alive[i]) {
      next.hosts.push_back(o.hosts[i]);
      slots += o.hosts[i].slots;
    }
  next.hostfile.clear();  // the live hosts go to mpirun as -H
  const int replica = o.tp * o.pp;  // the ranks of one data-parallel replica
  next.np = std::min(o.np, slots) / replica * replica;
  if (next.hosts.empty()) {
    why = "no host answered";
    return std::nullopt;
  }
  if (next.np < 1) {
    why = "the hosts that answered hold " + std::to_string(slots) + " slot(s), fewer than one replica of " +
          std::to_string(replica) + " ranks (--tp " + std::to_string(o.tp) + " x --pp " + std::to_string(o.pp) + ")";
    return std::nullopt;
  }
  return next;
}

}  // namespace loom::launcher
