// Runs mpirun as a child process: fork + execvp (no shell, so every argument arrives verbatim),
// forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT sent to loomrun, and reports how the child ended.
// Internal to the launcher.
#pragma once

#include <string>
#include <vector>

namespace loom::launcher {

// Starts argv[0] (looked up in PATH) with argv, waits for it and returns its exit status, or
// 128 + signal when a signal ended it (the shell convention); 127 when it could not be started
// (`error` says why).
//
// Signals: a signal another process sends to loomrun (kill, a scheduler, a test) is passed on to
// the child once; one typed at the terminal (Ctrl-C) already reached the child through the
// terminal's process group, so it is not sent twice (a second SIGINT makes mpirun skip its
// cleanup). The child also gets SIGTERM if loomrun itself dies, so no job outlives its launcher.
// `interrupted`, when given, is set when loomrun itself received one of those signals (from a
// process or the terminal): the job ended because someone asked, so --max-restarts must not start
// it again.
int run_and_wait(const std::vector<std::string>& argv, std::string& error, bool* interrupted = nullptr);

}  // namespace loom::launcher
