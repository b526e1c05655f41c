#include "launcher/launcher_args.h"

#include <CLI/CLI.hpp>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <unistd.h>

namespace loom::launcher {

std::string shown(const std::string& text) {
  std::string out;
  for (char c : text.substr(0, 60)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  return text.size() > 60 ? out + "..." : out;
}

namespace {

std::string absolute(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char* real = realpath(path.c_str(), nullptr);
  if (!real) return path;
  std::string out = real;
  free(real);
  return out;
}

// For a path that may not exist yet (an output directory): relative to the working directory.
std::string absolute_lexically(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char* cwd = getcwd(nullptr, 0);
  if (!cwd) return path;
  std::string out = std::string(cwd) + "/" + path;
  free(cwd);
  return out;
}

// A value as shown in a message: its start, control characters as '?'.
// --output-dir before anything starts: mpirun given a file, a dangling link or a directory it cannot
// write complains and hangs. It must be a writable directory, or not exist under one.
void check_output_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path path(dir);
  const auto link = fs::symlink_status(path, ec);
  if (!ec && fs::exists(link)) {
    const auto target = fs::status(path, ec);
    if (fs::is_symlink(link) && (ec || !fs::exists(target)))
      throw UsageError("--output-dir " + dir + ": a symbolic link to nothing; expected a directory");
    if (!fs::is_directory(target))
      throw UsageError("--output-dir " + dir + ": exists and is not a directory; expected a directory (or a new path)");
    if (::access(dir.c_str(), W_OK | X_OK) != 0)
      throw UsageError("--output-dir " + dir + ": cannot write there (" + std::strerror(errno) + ")");
    return;
  }
  // A new directory: mpirun creates it (and its missing parents) under the nearest existing one.
  fs::path parent = path.parent_path();
  while (!parent.empty() && !fs::exists(fs::symlink_status(parent, ec)) && parent != parent.parent_path())
    parent = parent.parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent, ec))
    throw UsageError("--output-dir " + dir + ": " + parent.string() + " is not a directory; expected a path under one");
  if (::access(parent.c_str(), W_OK | X_OK) != 0)
    throw UsageError("--output-dir " + dir + ": cannot create it in " + parent.string() + " (" +
                     std::strerror(errno) + ")");
}

bool identifier(const std::string& name, bool leading_digit_ok) {
  if (name.empty() || name.size() > kMaxVariableName) return false;
  if (!leading_digit_ok && std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

// "-x NAME" or "-x NAME=VALUE" (mpirun's syntax). The name is what a POSIX shell accepts, so the
// variable can be read back in the program's environment.
Variable parse_variable(const std::string& text) {
  const size_t eq = text.find('=');
  Variable v{text.substr(0, eq), std::nullopt};
  if (eq != std::string::npos) v.value = text.substr(eq + 1);
  if (!identifier(v.name, false))
    throw UsageError("-x '" + shown(text) + "': expected NAME or NAME=VALUE, NAME of letters, digits and '_' (at most " +
                     std::to_string(kMaxVariableName) + ", not starting with a digit); found the name '" +
                     shown(v.name) + "'");
  return v;
}

// mpirun options loomrun gives itself: passed again through --mpi-arg they would contradict it.
std::string managed_by_loomrun(const std::string& arg) {
  const std::string option = arg.substr(0, arg.find('='));
  static const std::set<std::string> ranks = {"-np", "--np", "-n", "-c"};
  static const std::set<std::string> hosts = {"-H", "-host", "--host", "-hostfile", "--hostfile", "-machinefile",
                                              "--machinefile"};
  static const std::set<std::string> output = {"-output-filename", "--output-filename"};
  if (ranks.count(option)) return "-np";
  if (hosts.count(option)) return "-H or --hostfile";
  if (output.count(option)) return "--output-dir";
  if (option == "-x") return "-x";
  if (option == "--app" || option == "-app") return "the program after --";
  return "";
}

void check_mpi_arg(const std::string& arg) {
  if (arg.empty()) throw UsageError("--mpi-arg '': expected an mpirun option or its value");
  if (arg == ":")
    throw UsageError("--mpi-arg ':': mpirun would read it as the start of a second program (MPMD); not passed on");
  if (std::string instead = managed_by_loomrun(arg); !instead.empty())
    throw UsageError("--mpi-arg " + shown(arg) + ": loomrun gives mpirun this option itself; use loomrun's " + instead);
}

}  // namespace

namespace {

// The words loomrun takes itself before CLI11 sees the rest: everything after the first "--" (the
// program, untouched: no option parsing, no shell), and the values of -x, --mca and --mpi-arg,
// which may start with '-' (--mpi-arg --bind-to) and would read as options. Returns the rest.
std::vector<std::string> take_own_words(const std::vector<std::string>& raw, Options& o, bool& have_separator) {
  std::vector<std::string> args;
  auto next = [&](size_t& i, const std::string& option, const std::string& what) -> const std::string& {
    if (i + 1 >= raw.size() || raw[i + 1] == "--")
      throw UsageError(option + " needs " + what + " (found " + (i + 1 < raw.size() ? "'--'" : "nothing") + ")");
    return raw[++i];
  };
  auto count_one_more = [](size_t size, const std::string& option) {
    if (size >= kMaxPassedOn)
      throw UsageError("more than " + std::to_string(kMaxPassedOn) + " " + option +
                       " entries: exceeds the limit (docs/limits.md)");
  };
  for (size_t i = 0; i < raw.size(); ++i) {
    const std::string& word = raw[i];
    if (word == "--") {
      have_separator = true;
      o.program.assign(raw.begin() + static_cast<long>(i) + 1, raw.end());
      break;
    }
    if (word == "-x") {
      count_one_more(o.variables.size(), "-x");
      o.variables.push_back(parse_variable(next(i, "-x", "NAME or NAME=VALUE")));
    } else if (word == "--mca" || word == "-mca") {
      count_one_more(o.mca.size(), "--mca");
      const std::string key = next(i, "--mca", "KEY VALUE");
      const std::string value = next(i, "--mca " + shown(key), "a VALUE");
      if (!identifier(key, true))
        throw UsageError("--mca '" + shown(key) + "' " + shown(value) +
                         ": expected an MCA parameter name of letters, digits and '_' (as ompi_info lists them)");
      if (value == ":")
        throw UsageError("--mca " + key + " ':': mpirun would read ':' as the start of a second program (MPMD)");
      o.mca.emplace_back(key, value);
    } else if (word == "--mpi-arg" || word.rfind("--mpi-arg=", 0) == 0) {
      count_one_more(o.mpi_args.size(), "--mpi-arg");
      const std::string arg = word == "--mpi-arg" ? next(i, "--mpi-arg", "an mpirun argument") : word.substr(10);
      check_mpi_arg(arg);
      o.mpi_args.push_back(arg);
    } else {
      // mpirun spells it -np; CLI11 reads single-dash options as one letter.
      args.push_back(word == "-np" ? "--np" : word);
    }
  }
  return args;
}

// What CLI11 parses into besides Options.
struct CliValues {
  std::string host_list;
  bool no_oversubscribe = false;
  std::vector<std::string> listed_only;  // -x, --mca, --mpi-arg: listed for --help, taken by take_own_words
};

void add_cli_options(CLI::App& app, Options& o, CliValues& cli) {
  // CLI11 converts an empty word to 0 for a number: `--max-restarts ''` must not mean 0.
  const CLI::Validator a_number(
      [](std::string& text) { return text.empty() ? std::string("'': expected an integer") : std::string(); }, "INT");
  app.add_option("-n,--np", o.np, "number of ranks (also -np)")->check(a_number);
  app.add_option("-H,--host", cli.host_list, "hosts and slots: host1:8,host2:8");
  app.add_option("--hostfile", o.hostfile, "Open MPI hostfile (host slots=N per line)");
  app.add_option("--tp", o.tp, "tensor-parallel degree (LOOM_TP)")->check(a_number);
  app.add_option("--pp", o.pp, "pipeline stages (LOOM_PP); the layout is dp,pp,tp, outermost first")->check(a_number);
  app.add_option("--topology", o.topology, "topology file: JSON, nvidia-smi topo -m text or NCCL XML (LOOM_TOPOLOGY)");
  app.add_option("--timeline", o.timeline, "timeline path prefix (LOOM_TIMELINE)");
  app.add_option("--timeout", o.timeout, "operation timeout in seconds (LOOM_TIMEOUT)");
  app.add_flag("--dry-run", o.dry_run, "print the mpirun command and exit");
  app.add_flag("--plan", o.plan, "print the placement plan and exit");
  app.add_flag("--json", o.json, "with --plan: print the plan as JSON");
  app.add_option("--svg", o.svg, "with --plan: write a picture of the first node to this file");
  app.add_flag("--no-oversubscribe", cli.no_oversubscribe, "more ranks than slots is an error (default: --oversubscribe)");
  app.add_option("--mpirun", o.mpirun, "the mpirun to run (default: mpirun from PATH)");
  app.add_option("--message-bytes", o.message_bytes, "with --plan: message size of the modelled all-reduce")
      ->check(a_number);
  // Listed for --help only: parse_arguments takes their values itself (above).
  app.add_option("-x", cli.listed_only, "NAME or NAME=VALUE: set or forward a variable to every rank (repeatable)");
  app.add_option("--mca", cli.listed_only, "KEY VALUE: an Open MPI MCA parameter for mpirun (repeatable)");
  app.add_option("--mpi-arg", cli.listed_only, "ARG: one word passed to mpirun verbatim, before the program (repeatable)");
  app.add_option("--output-dir", o.output_dir,
                 "one stdout and stderr file per rank under DIR/attempt_K/ (mpirun --output-filename)");
  app.add_flag("--tag-output", o.tag_output, "prefix each output line with its rank (mpirun --tag-output)");
  app.add_option("--max-restarts", o.max_restarts,
                 "start the job again when it fails, up to N times (LOOM_RESTART_COUNT tells the ranks)")
      ->check(a_number);
  app.add_flag("--drop-dead-hosts", o.drop_dead_hosts,
               "with --max-restarts: before a restart, leave out the hosts that no longer answer (mpirun cannot start "
               "`true` there within 15 s) and run at the ranks the others hold, a multiple of --tp x --pp");
}

// CLI11's message as loomrun says it: "Could not convert: --np = two" -> "-np two: expected an integer".
std::string usage_text(const CLI::ParseError& e, bool have_separator) {
  std::string what = e.what();
  const std::string convert = "Could not convert: ";
  if (what.rfind(convert, 0) == 0) {
    std::string rest = what.substr(convert.size());
    size_t eq = rest.find(" = ");
    if (eq != std::string::npos) {
      std::string name = rest.substr(0, eq);
      if (name == "--np") name = "-np";
      what = name + " " + rest.substr(eq + 3) + ": expected an integer";
    }
  }
  if (what.find("not expected") != std::string::npos && !have_separator)
    what += " (put the program after --: loomrun -np 2 -- ./program args)";
  return what;
}

// The job's shape: ranks, TP and PP degrees, hosts, timeout, restarts.
void check_shape(const CLI::App& app, Options& o, const std::string& host_list) {
  if (app.count("--np") == 0) throw UsageError("-np is missing: how many ranks to start (e.g. -np 4)");
  if (app.count("--np") > 0 && o.np < 1) throw UsageError("-np " + std::to_string(o.np) + ": expected at least 1 rank");
  if (o.tp < 1) throw UsageError("--tp " + std::to_string(o.tp) + ": expected at least 1");
  if (o.np >= 1 && o.np % o.tp != 0)
    throw UsageError("-np " + std::to_string(o.np) + " is not divisible by --tp " + std::to_string(o.tp) +
                     ": every rank belongs to one tensor-parallel group of " + std::to_string(o.tp));
  if (o.pp < 1) throw UsageError("--pp " + std::to_string(o.pp) + ": expected at least 1");
  if (o.np >= 1 && o.np % (static_cast<long long>(o.tp) * o.pp) != 0)
    throw UsageError("-np " + std::to_string(o.np) + " is not divisible by --tp " + std::to_string(o.tp) + " x --pp " +
                     std::to_string(o.pp) + " = " + std::to_string(static_cast<long long>(o.tp) * o.pp) +
                     ": every data-parallel replica holds " + std::to_string(o.pp) + " stages of " +
                     std::to_string(o.tp) + " ranks");
  if (!host_list.empty() && !o.hostfile.empty()) throw UsageError("give either -H or --hostfile, not both");
  if (!host_list.empty()) o.hosts = parse_host_list(host_list);
  if (app.count("-H") > 0 && host_list.empty()) throw UsageError("-H '': expected host or host:slots entries");
  if (!o.hostfile.empty()) {
    o.hosts = parse_hostfile(o.hostfile);
    o.hostfile = absolute(o.hostfile);
  }
  if (!o.timeout.empty()) {
    char* end = nullptr;
    double s = std::strtod(o.timeout.c_str(), &end);
    if (end == o.timeout.c_str() || *end != '\0' || !(s >= 0.001 && s <= 86400))
      throw UsageError("--timeout " + o.timeout + ": expected seconds between 0.001 and 86400");
  }
  if (o.max_restarts < 0 || o.max_restarts > kMaxRestarts)
    throw UsageError("--max-restarts " + std::to_string(o.max_restarts) + ": expected 0 to " +
                     std::to_string(kMaxRestarts));
  if (o.drop_dead_hosts && o.max_restarts == 0)
    throw UsageError("--drop-dead-hosts acts on restarts: give --max-restarts N too");
  if (o.drop_dead_hosts && o.hosts.empty())
    throw UsageError("--drop-dead-hosts needs the hosts listed (-H or --hostfile): there is none to leave out");
}

// Where the output goes and what is started.
void check_output_and_program(const CLI::App& app, Options& o, bool have_separator) {
  if (app.count("--output-dir") > 0) {
    if (o.output_dir.empty()) throw UsageError("--output-dir '': expected a directory");
    // Open MPI reads "DIR:nocopy" as DIR plus directives.
    if (o.output_dir.find(':') != std::string::npos)
      throw UsageError("--output-dir " + shown(o.output_dir) +
                       ": a ':' in the path would be read by mpirun as directives (DIR:nocopy); choose another path");
    o.output_dir = absolute_lexically(o.output_dir);
    if (!o.plan && !o.dry_run) check_output_dir(o.output_dir);
  }
  if ((o.json || !o.svg.empty()) && !o.plan)
    throw UsageError(std::string(o.json ? "--json" : "--svg") + " needs --plan");
  if (o.plan && o.dry_run) throw UsageError("give either --plan or --dry-run, not both");
  if (!o.plan && !have_separator)
    throw UsageError("the program is missing: put it after --, e.g. loomrun -np " + std::to_string(std::max(o.np, 1)) +
                     " -- ./train");
  if (!o.plan && o.program.empty()) throw UsageError("the program is missing after --");
  if (!o.program.empty() && !o.program[0].empty() && o.program[0][0] == '-')
    throw UsageError("the program '" + o.program[0] + "' starts with '-': mpirun would read it as an option");
  // mpirun reads a ':' anywhere on its command line as the start of another program (MPMD), even
  // after the first program's name: "-- ./train : -np 1 /bin/sh" would start /bin/sh too.
  for (size_t i = 0; i < o.program.size(); ++i)
    if (o.program[i] == ":")
      throw UsageError("program argument " + std::to_string(i) +
                       " is ':', which mpirun would read as the start of a second program; loomrun cannot pass "
                       "a lone ':' through mpirun (quote it into another argument, or read it from a file)");
}

}  // namespace

Parsed parse_arguments(const std::vector<std::string>& raw, const std::string& env_topology) {
  Parsed parsed;
  Options& o = parsed.options;
  bool have_separator = false;
  const std::vector<std::string> args = take_own_words(raw, o, have_separator);

  CLI::App app{"loomrun: starts a torchloom job through mpirun (see docs/launcher.md)", "loomrun"};
  app.footer("Example: loomrun -np 16 -H node1:8,node2:8 --tp 2 -- ./train --epochs 3");
  CliValues cli;
  add_cli_options(app, o, cli);
  std::vector<std::string> argv_storage{"loomrun"};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<const char*> argv;
  for (const auto& a : argv_storage) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::CallForHelp&) {
    parsed.help = app.help();
    return parsed;
  } catch (const CLI::ParseError& e) {
    throw UsageError(usage_text(e, have_separator));
  }
  o.allow_oversubscribe = !cli.no_oversubscribe;
  o.tp_given = app.count("--tp") > 0;
  o.pp_given = app.count("--pp") > 0;
  check_shape(app, o, cli.host_list);
  check_output_and_program(app, o, have_separator);
  if (o.topology.empty()) o.topology = env_topology;
  o.topology = absolute(o.topology);
  return parsed;
}

}  // namespace loom::launcher
