#include "launcher/launcher_args.h"

#include <CLI/CLI.hpp>
#include <climits>
#include <cmath>
#include <cstdlib>

namespace loom::launcher {

namespace {

std::string absolute(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  char* real = realpath(path.c_str(), nullptr);
  if (!real) return path;
  std::string out = real;
  free(real);
  return out;
}

}  // namespace

Parsed parse_arguments(const std::vector<std::string>& raw, const std::string& env_topology) {
  Parsed parsed;
  Options& o = parsed.options;
  // Everything after the first "--" is the program, untouched (no option parsing, no shell).
  std::vector<std::string> args;
  bool have_separator = false;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] == "--") {
      have_separator = true;
      o.program.assign(raw.begin() + static_cast<long>(i) + 1, raw.end());
      break;
    }
    // mpirun spells it -np; CLI11 reads single-dash options as one letter.
    args.push_back(raw[i] == "-np" ? "--np" : raw[i]);
  }

  CLI::App app{"loomrun: starts a torchloom job through mpirun (see docs/launcher.md)", "loomrun"};
  app.footer("Example: loomrun -np 16 -H node1:8,node2:8 --tp 2 -- ./train --epochs 3");
  std::string host_list;
  app.add_option("-n,--np", o.np, "number of ranks (also -np)");
  app.add_option("-H,--host", host_list, "hosts and slots: host1:8,host2:8");
  app.add_option("--hostfile", o.hostfile, "Open MPI hostfile (host slots=N per line)");
  app.add_option("--tp", o.tp, "tensor-parallel degree (LOOM_TP)");
  app.add_option("--topology", o.topology, "topology file: JSON, nvidia-smi topo -m text or NCCL XML (LOOM_TOPOLOGY)");
  app.add_option("--timeline", o.timeline, "timeline path prefix (LOOM_TIMELINE)");
  app.add_option("--timeout", o.timeout, "operation timeout in seconds (LOOM_TIMEOUT)");
  app.add_flag("--dry-run", o.dry_run, "print the mpirun command and exit");
  app.add_flag("--plan", o.plan, "print the placement plan and exit");
  app.add_flag("--json", o.json, "with --plan: print the plan as JSON");
  app.add_option("--svg", o.svg, "with --plan: write a picture of the first node to this file");
  bool no_oversubscribe = false;
  app.add_flag("--no-oversubscribe", no_oversubscribe, "more ranks than slots is an error (default: --oversubscribe)");
  app.add_option("--mpirun", o.mpirun, "the mpirun to run (default: mpirun from PATH)");
  app.add_option("--message-bytes", o.message_bytes, "with --plan: message size of the modelled all-reduce");

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
    std::string what = e.what();
    // "Could not convert: --np = two" -> "-np two: expected an integer"
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
    throw UsageError(what);
  }
  o.allow_oversubscribe = !no_oversubscribe;
  o.tp_given = app.count("--tp") > 0;

  if (app.count("--np") == 0) throw UsageError("-np is missing: how many ranks to start (e.g. -np 4)");
  if (app.count("--np") > 0 && o.np < 1) throw UsageError("-np " + std::to_string(o.np) + ": expected at least 1 rank");
  if (o.tp < 1) throw UsageError("--tp " + std::to_string(o.tp) + ": expected at least 1");
  if (o.np >= 1 && o.np % o.tp != 0)
    throw UsageError("-np " + std::to_string(o.np) + " is not divisible by --tp " + std::to_string(o.tp) +
                     ": every rank belongs to one tensor-parallel group of " + std::to_string(o.tp));
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
  if (o.topology.empty()) o.topology = env_topology;
  o.topology = absolute(o.topology);
  return parsed;
}

}  // namespace loom::launcher
