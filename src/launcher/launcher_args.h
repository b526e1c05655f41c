// loomrun's command line: what the user asked for, checked, before anything is started.
//
//   loomrun -np N [-H host1:slots,host2:slots | --hostfile FILE] [--tp T] [--pp P] [--topology FILE]
//           [--timeline PATH] [--timeout S] [-x NAME[=VALUE]]... [--mca KEY VALUE]... [--mpi-arg ARG]...
//           [--output-dir DIR] [--tag-output] [--max-restarts N [--drop-dead-hosts]]
//           [--dry-run] [--plan [--json] [--svg FILE]] -- program args...
//
// parse_arguments() throws UsageError (loomrun exits 2) with a message that says which argument is
// wrong and what was expected. Internal to the launcher; docs/launcher.md is the user's page.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "launcher/hosts.h"

namespace loom::launcher {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a UsageError quotes of the user's input: its first 60 bytes, control bytes as '?', "..."
// after a longer text (a message stays one readable line whatever was passed).
std::string shown(const std::string& text);

// Limits on what loomrun passes on (docs/limits.md).
inline constexpr size_t kMaxPassedOn = 10000;     // -x, --mca and --mpi-arg entries, each kind
inline constexpr size_t kMaxVariableName = 255;   // -x NAME
inline constexpr int kMaxRestarts = 1000;

// -x NAME (forward NAME's value from loomrun's environment) or -x NAME=VALUE.
struct Variable {
  std::string name;
  std::optional<std::string> value;
};

struct Options {
  int np = 0;
  std::vector<Host> hosts;  // from -H or --hostfile; empty: this machine only
  std::string hostfile;     // the --hostfile path (passed on to mpirun)
  int tp = 1;
  bool tp_given = false;
  int pp = 1;
  bool pp_given = false;
  std::string topology;  // --topology, else LOOM_TOPOLOGY from the environment (absolute path)
  std::string timeline;
  std::string timeout;  // seconds, as given (checked: 0.001 to 86400)
  bool dry_run = false;
  bool plan = false;
  bool json = false;
  std::string svg;
  bool allow_oversubscribe = true;  // --no-oversubscribe: more ranks than slots is an error
  std::string mpirun = "mpirun";
  std::uint64_t message_bytes = 64ull << 20;
  std::vector<Variable> variables;                          // -x, in order
  std::vector<std::pair<std::string, std::string>> mca;     // --mca KEY VALUE, in order
  std::vector<std::string> mpi_args;                        // --mpi-arg ARG: mpirun options, verbatim
  std::string output_dir;                                   // --output-dir (absolute): one file per rank
  bool tag_output = false;                                  // --tag-output: rank-prefixed lines
  int max_restarts = 0;                                     // --max-restarts: start a failed job again
  bool drop_dead_hosts = false;                             // --drop-dead-hosts: restart without them
  std::vector<std::string> program;  // after "--": the program and its arguments, verbatim
};

struct Parsed {
  Options options;
  std::optional<std::string> help;  // set for --help: print it and exit 0
};

// `args` is argv without argv[0]. `env_topology` is LOOM_TOPOLOGY from the environment ("" if unset).
Parsed parse_arguments(const std::vector<std::string>& args, const std::string& env_topology = "");

}  // namespace loom::launcher
