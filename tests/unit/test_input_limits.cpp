// Hostile inputs to the topology parsers and the launcher's host lists, generated at their limits
// and far beyond: each is refused with a typed error naming the limit (docs/limits.md), in bounded
// time, before anything large is built. The three reproductions of issue 23 are here: a deeply
// nested JSON (a segmentation fault before), a 30,000-column nvidia-smi header (std::bad_alloc
// before: an n x n matrix), a 100,000-attribute XML element (quadratic duplicate check before).
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>

#include "launcher/hosts.h"
#include "launcher/launcher_args.h"
#include "loom/topology/topology.h"
#include "topology/limits.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;

namespace {

using Clock = std::chrono::steady_clock;

// The ParseError's message for `text` read as a topology file (the format by its first character,
// as load_topology_file does), with the time it took.
struct Outcome {
  std::string error;
  double seconds = 0;
};

Outcome parse(const std::string& text, const std::string& name) {
  const auto start = Clock::now();
  Outcome o;
  o.error = parse_error_of([&] {
    if (text[0] == '{') {
      topology_from_json(text, name);
    } else if (text[0] == '<') {
      parse_nccl_topology_xml(text, name);
    } else {
      parse_nvidia_smi_topo(text, name);
    }
  });
  o.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return o;
}

std::string repeat(const std::string& s, size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (size_t i = 0; i < n; ++i) out += s;
  return out;
}

#define EXPECT_REFUSED(outcome, needle)                                                        \
  do {                                                                                         \
    const Outcome o_ = (outcome);                                                              \
    EXPECT_NE(o_.error.find(needle), std::string::npos) << "error: " << o_.error;              \
    EXPECT_NE(o_.error.find("docs/limits.md"), std::string::npos) << "error: " << o_.error;   \
    EXPECT_LT(o_.seconds, time_bound(2.0)) << "refusing took " << o_.seconds << " s";          \
  } while (false)

std::string usage_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const loom::launcher::UsageError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(InputLimits, DeeplyNestedJsonIsRefusedNotACrash) {
  const size_t n = 1000000;  // issue 23's deep.json: a stack overflow in the error message's dump()
  EXPECT_REFUSED(parse("{\"nodes\":[" + std::string(n, '[') + std::string(n, ']') + "]}", "deep.json"),
                 "exceeds the limit of 32 levels");
  // The limit itself: 32 levels pass the scan (and fail the schema, as they should).
  const std::string at_limit = "{\"nodes\":[" + std::string(30, '[') + std::string(30, ']') + "]}";
  const Outcome ok = parse(at_limit, "d.json");
  EXPECT_EQ(ok.error.find("limit"), std::string::npos) << ok.error;
  EXPECT_NE(ok.error.find("expected an object"), std::string::npos) << ok.error;
  // Brackets inside strings are not nesting.
  const Outcome in_string =
      parse("{\"nodes\":[{\"gpus\":1,\"notes\":[\"" + std::string(100, '[') + "\\\"\"]}]}", "s.json");
  EXPECT_EQ(in_string.error, "");
}

TEST(InputLimits, AnErrorAboutAHugeValueDoesNotPrintIt) {
  // A wrong type holding a million-element array: the message says so in a few words.
  const Outcome o = parse("{\"nodes\":[{\"gpus\":1,\"hostname\":[" + repeat("1,", 1000000) + "1]}]}", "big.json");
  EXPECT_NE(o.error.find("an array of 1000001 values"), std::string::npos) << o.error.substr(0, 300);
  EXPECT_LT(o.error.size(), 400u);
  EXPECT_LT(o.seconds, time_bound(3.0));
}

TEST(InputLimits, TooManyJsonValuesAreRefusedBeforeParsing) {
  EXPECT_REFUSED(parse("{\"nodes\":[" + repeat("0,", limits::kJsonValues) + "0]}", "values.json"),
                 "JSON values");
}

TEST(InputLimits, ReplicatedCpuListsCannotAmplifyASmallFile) {
  // 100 bytes that asked for ~26 GB: 100000 copies of a node with 65536 CPU ids.
  EXPECT_REFUSED(parse("{\"nodes\":[{\"gpus\":1,\"replicate\":100000,\"numa_nodes\":[{\"id\":0,\"cpus\":\"0-65535\"}]}]}",
                       "amplify.json"),
                 "CPU ids and string bytes in all");
  // Many CPU lists in one node: refused while reading, before all of them are built.
  std::string sockets;
  for (int i = 0; i < 1000; ++i) sockets += std::string(i ? "," : "") + "{\"id\":" + std::to_string(i) + ",\"cpus\":\"0-65535\"}";
  EXPECT_REFUSED(parse("{\"nodes\":[{\"gpus\":1,\"sockets\":[" + sockets + "]}]}", "sockets.json"),
                 "CPU ids and string bytes in all");
  // Notes count too.
  EXPECT_REFUSED(parse("{\"nodes\":[{\"gpus\":1,\"replicate\":100000,\"notes\":[\"" + std::string(1000, 'n') +
                           "\"]}]}",
                       "notes.json"),
                 "CPU ids and string bytes in all");
  // A realistic replicated cluster is well inside: 4096 nodes of 8 GPUs, 2 x 56 cores.
  const Outcome ok = parse(
      "{\"nodes\":[{\"gpus\":8,\"links\":{\"default\":\"NV18\"},\"replicate\":4096,\"hostname\":\"n{i}\","
      "\"numa_nodes\":[{\"id\":0,\"cpus\":\"0-55,112-167\"},{\"id\":1,\"cpus\":\"56-111,168-223\"}]}]}",
      "cluster.json");
  EXPECT_EQ(ok.error, "");
}

TEST(InputLimits, TooManyNicsInJson) {
  std::string nics;
  for (int i = 0; i <= limits::kNicsPerNode; ++i) nics += std::string(i ? "," : "") + "\"n" + std::to_string(i) + "\"";
  EXPECT_REFUSED(parse("{\"nodes\":[{\"gpus\":1,\"nics\":[" + nics + "],\"nic_links\":{\"default\":\"SYS\"}}]}", "n.json"),
                 "NICs per node");
}

TEST(InputLimits, WideNvidiaSmiHeaderIsRefusedBeforeItsMatrix) {
  // Issue 23: 30,000 column titles asked for a 30,000 x 30,000 matrix (14 GB) before any row.
  std::string header = "GPU0";
  for (int i = 0; i < 30000; ++i) header += " n" + std::to_string(i);
  EXPECT_REFUSED(parse(header + "\n", "wide.txt"), "exceeds the limit of 256 NICs per node");
  std::string gpus;
  for (int i = 0; i <= limits::kGpusPerNode; ++i) gpus += "GPU" + std::to_string(i) + " ";
  EXPECT_REFUSED(parse(gpus + "\n", "gpus.txt"), "exceeds the limit of 512 GPUs per node");
}

TEST(InputLimits, NvidiaSmiLinesAndFieldsAreCounted) {
  EXPECT_REFUSED(parse("GPU0 X\n" + repeat("x\n", limits::kTextLines + 10), "lines.txt"), "lines");
  EXPECT_REFUSED(parse("GPU0 " + repeat("x ", limits::kTextFields + 10), "fields.txt"), "fields");
}

TEST(InputLimits, NvidiaSmiCpuAffinityListsAreBounded) {
  // 512 GPUs, each with 65536 CPU ids: 33.5 M ids from a megabyte of text.
  const int g = limits::kGpusPerNode;
  std::string text;
  for (int i = 0; i < g; ++i) text += "GPU" + std::to_string(i) + " ";
  text += "CPU Affinity\n";
  for (int r = 0; r < g; ++r) {
    text += "GPU" + std::to_string(r);
    for (int c = 0; c < g; ++c) text += c == r ? " X" : " SYS";
    text += " 0-65535\n";
  }
  EXPECT_REFUSED(parse(text, "affinity.txt"), "CPU ids in all");
}

TEST(InputLimits, XmlAttributesAreBoundedAndLinear) {
  // Issue 23: one element with n attributes cost n^2 / 2 string comparisons.
  std::string attributes;
  for (int i = 0; i < 100000; ++i) attributes += " a" + std::to_string(i) + "=\"\"";
  EXPECT_REFUSED(parse("<system" + attributes + "/>", "attrs.xml"), "attributes");
}

TEST(InputLimits, XmlGpusAndNicsAreBounded) {
  std::string gpus;
  for (int i = 0; i <= limits::kGpusPerNode; ++i)
    gpus += "<pci busid=\"0000:" + std::to_string(i) + ":00.0\"><gpu dev=\"" + std::to_string(i) + "\"/></pci>";
  EXPECT_REFUSED(parse("<system><cpu numaid=\"0\" affinity=\"ffffffff\">" + gpus + "</cpu></system>", "g.xml"),
                 "GPUs per node");
  std::string nics;
  for (int i = 0; i <= limits::kNicsPerNode; ++i) nics += "<nic><net name=\"n" + std::to_string(i) + "\"/></nic>";
  EXPECT_REFUSED(parse("<system><cpu numaid=\"0\">" + nics + "</cpu></system>", "n.xml"), "NICs per node");
}

TEST(InputLimits, XmlCpuListsPerGpuAreBounded) {
  // 512 GPUs under one <cpu> of 65536 CPUs: 33.5 M CPU ids in the model from 25 KB of XML.
  auto xml = [](int words) {
    std::string mask = "ffffffff";
    for (int i = 1; i < words; ++i) mask += ",ffffffff";
    std::string gpus;
    for (int i = 0; i < limits::kGpusPerNode; ++i)
      gpus += "<pci busid=\"0000:" + std::to_string(i) + ":00.0\"><gpu dev=\"" + std::to_string(i) + "\"/></pci>";
    return "<system><cpu numaid=\"0\" affinity=\"" + mask + "\">" + gpus + "</cpu></system>";
  };
  EXPECT_REFUSED(parse(xml(2048), "g.xml"), "CPU ids in all");
  // 512 GPUs of 4096 CPUs each: within the limits, accepted quickly.
  const Outcome o = parse(xml(128), "g.xml");
  EXPECT_EQ(o.error, "");
  EXPECT_LT(o.seconds, time_bound(5.0));
}

TEST(InputLimits, HostListsAreLinearAndBounded) {
  std::string list;
  for (size_t i = 0; i < loom::launcher::kMaxHosts; ++i) list += (i ? ",h" : "h") + std::to_string(i) + ":1";
  auto start = Clock::now();
  EXPECT_EQ(loom::launcher::parse_host_list(list).size(), loom::launcher::kMaxHosts);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), time_bound(2.0))
      << "duplicate check not linear";
  const std::string error = usage_error_of([&] { loom::launcher::parse_host_list(list + ",extra"); });
  EXPECT_NE(error.find("more than 100000 hosts: exceeds the limit"), std::string::npos) << error.substr(0, 200);
  EXPECT_LT(error.size(), 300u) << "the message repeats the whole list";
}

TEST(InputLimits, AHostfileWithoutEndIsRefused) {
  // /dev/zero: no newline and no end; it used to grow one line until memory ran out.
  auto start = Clock::now();
  const std::string error = usage_error_of([] { loom::launcher::parse_hostfile("/dev/zero"); });
  EXPECT_NE(error.find("bytes: exceeds the limit"), std::string::npos) << error;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), time_bound(2.0));
  const std::string path = ::testing::TempDir() + "/long_line_hostfile";
  std::ofstream(path) << "h1 slots=2\n" << std::string(10000, 'a') << "\n";
  const std::string line = usage_error_of([&] { loom::launcher::parse_hostfile(path); });
  EXPECT_NE(line.find("line 2: longer than 4096 bytes"), std::string::npos) << line;
}

// Found by the fuzzers (tests/fuzz/regressions): nlohmann's exceptions other than parse_error
// escaped, and names that are not UTF-8 made to_json() (which init() all-gathers) throw.
TEST(InputLimits, FuzzFindingsStayFixed) {
  const std::string overflow = parse_error_of([] { topology_from_json("{\"nodes\":[{\"gpus\":1e400}]}", "n.json"); });
  EXPECT_NE(overflow.find("expected valid JSON"), std::string::npos) << overflow;
  const Topology t = parse_nccl_topology_xml(
      "<system><cpu numaid=\"0\"><pci busid=\"0000:01:00.0\"><gpu dev=\"0\"/></pci>"
      "<nic><net name=\"mlx\xff\xfe\"/></nic></cpu></system>",
      "u.xml");
  std::string json;
  EXPECT_NO_THROW(json = to_json(t));
  EXPECT_NE(json.find("mlx\xEF\xBF\xBD"), std::string::npos);
  EXPECT_EQ(topology_from_json(json, "again").nodes[0].nics.size(), 1u);
}
