#include "launcher/launcher_exec.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace loom::launcher {

namespace {

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

}  // namespace

int run_and_wait(const std::vector<std::string>& args, std::string& error, bool* interrupted) {
  if (interrupted) *interrupted = false;
  if (args.empty()) {
    error = "nothing to run";
    return 127;
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  // Signals are taken with sigwaitinfo, so they stay blocked from before fork: none is lost
  // between starting the child and waiting.
  // Children must stay waitable even if our parent left SIGCHLD ignored (auto-reaping).
  signal(SIGCHLD, SIG_DFL);
  sigset_t wanted, previous;
  sigemptyset(&wanted);
  for (int s : kForwarded) sigaddset(&wanted, s);
  sigaddset(&wanted, SIGCHLD);
  sigprocmask(SIG_BLOCK, &wanted, &previous);

  // exec failures come back through a close-on-exec pipe: EOF means exec succeeded.
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    error = std::string("pipe: ") + std::strerror(errno);
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    return 127;
  }
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    error = std::string("fork: ") + std::strerror(errno);
    close(report[0]);
    close(report[1]);
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    return 127;
  }
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the launcher died before prctl took effect
    for (int s : kForwarded) signal(s, SIG_DFL);
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    close(report[0]);
    execvp(argv[0], argv.data());
    int e = errno;
    (void)!write(report[1], &e, sizeof(e));
    _exit(127);
  }
  close(report[1]);
  int exec_errno = 0;
  ssize_t got;
  do got = read(report[0], &exec_errno, sizeof(exec_errno));
  while (got < 0 && errno == EINTR);
  close(report[0]);

  int status = 0;
  for (;;) {
    pid_t done = waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0 && errno != EINTR) {
      error = std::string("waitpid: ") + std::strerror(errno);
      sigprocmask(SIG_SETMASK, &previous, nullptr);
      return 1;
    }
    siginfo_t info;
    int sig = sigwaitinfo(&wanted, &info);
    if (sig < 0 || sig == SIGCHLD) continue;
    if (interrupted) *interrupted = true;
    // From a process (kill, sigqueue): pass it on. From the terminal (SI_KERNEL): mpirun, in the
    // same foreground process group, has it already.
    if (info.si_code == SI_USER || info.si_code == SI_QUEUE || info.si_code == SI_TKILL) kill(child, sig);
  }
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  if (got == static_cast<ssize_t>(sizeof(exec_errno))) {
    error = "cannot run " + args[0] + ": " + std::strerror(exec_errno);
    return 127;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace loom::launcher
