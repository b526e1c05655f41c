// Mutation fuzzing of every parser with a fixed seed: a few thousand damaged copies of every fixture
// (byte flips, insertions, deletions, line swaps, duplications, truncation). No input may crash a
// parser or make it throw anything but ParseError, and what a parser accepts must be a valid model
// that the planner can plan.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <random>

#include "loom/topology/placement.h"
#include "topology_test_util.h"

using namespace loom::topo;
using namespace loom::topo::testing;

namespace {

constexpr int kMutantsPerFixture = 2000;
const std::string kAlphabet = " \t\r\n0123456789,-XNVPIXSYODEHBUCAF/:<>\"'=&;#{}[]";

// Deterministic across platforms: raw engine output, no std distributions.
class Mutator {
 public:
  explicit Mutator(std::uint32_t seed) : rng_(seed) {}
  size_t below(size_t n) { return n == 0 ? 0 : rng_() % n; }

  std::string mutate(std::string s) {
    const int count = 1 + static_cast<int>(below(4));
    for (int i = 0; i < count; ++i) {
      switch (below(7)) {
        case 0:  // flip a byte to anything
          if (!s.empty()) s[below(s.size())] = static_cast<char>(below(256));
          break;
        case 1:  // insert an interesting character
          s.insert(s.begin() + below(s.size() + 1), kAlphabet[below(kAlphabet.size())]);
          break;
        case 2:  // delete a run of bytes
          if (!s.empty()) {
            size_t at = below(s.size());
            s.erase(at, 1 + below(8));
          }
          break;
        case 3:    // swap two lines
        case 4:    // duplicate a line
        case 5: {  // delete a line
          auto lines = split(s);
          if (lines.size() < 2) break;
          size_t a = below(lines.size()), b = below(lines.size());
          if (i % 3 == 0)
            std::swap(lines[a], lines[b]);
          else if (i % 3 == 1)
            lines.insert(lines.begin() + a, lines[b]);
          else
            lines.erase(lines.begin() + a);
          s = join(lines);
          break;
        }
        case 6:  // truncate
          s.resize(below(s.size() + 1));
          break;
      }
    }
    return s;
  }

 private:
  static std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> lines;
    size_t pos = 0;
    while (pos <= s.size()) {
      size_t end = s.find('\n', pos);
      if (end == std::string::npos) end = s.size();
      lines.push_back(s.substr(pos, end - pos));
      pos = end + 1;
    }
    return lines;
  }
  static std::string join(const std::vector<std::string>& lines) {
    std::string s;
    for (size_t i = 0; i < lines.size(); ++i) s += (i ? "\n" : "") + lines[i];
    return s;
  }

  std::mt19937 rng_;
};

struct Outcome {
  int accepted = 0;
  int rejected = 0;
};

// Runs `parse` on mutants of `text`; fails the test on anything but a ParseError.
template <typename Parse>
Outcome fuzz(const std::string& name, const std::string& text, std::uint32_t seed, Parse parse) {
  Mutator m(seed);
  Outcome out;
  for (int i = 0; i < kMutantsPerFixture; ++i) {
    const std::string mutant = m.mutate(text);
    try {
      Topology t = parse(mutant);
      ++out.accepted;
      validate(t);
      const Node& n = t.nodes.at(0);
      const int gpus = static_cast<int>(std::min<size_t>(n.gpus.size(), 8));
      if (gpus > 0) {
        Topology one;
        one.nodes.push_back(n);
        one.nodes[0].gpus.resize(gpus);
        one.nodes[0].gpu_links.resize(gpus);
        for (auto& row : one.nodes[0].gpu_links) row.resize(gpus);
        one.nodes[0].nic_links.resize(gpus);
        Plan p = plan(one, {gpus, 1, 0, 1 << 20});
        EXPECT_EQ(static_cast<int>(p.layout.ranks.size()), gpus);
      }
    } catch (const ParseError&) {
      ++out.rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << " mutant " << i << " (seed " << seed << "): " << typeid(e).name() << ": " << e.what();
    }
  }
  return out;
}

}  // namespace

TEST(TopologyFuzz, NvidiaSmiTextNeverCrashes) {
  std::vector<std::string> names = topo_matrix_fixtures();
  for (const auto& p : p2p_fixtures()) names.push_back(p);
  names.push_back(kMangledFixture);
  Outcome total;
  std::uint32_t seed = 1;
  for (const auto& name : names) {
    Outcome o =
        fuzz(name, read_fixture(name), seed++, [&](const std::string& s) { return parse_nvidia_smi_topo(s, name); });
    total.accepted += o.accepted;
    total.rejected += o.rejected;
  }
  std::printf("nvidia-smi mutants: %d accepted, %d rejected\n", total.accepted, total.rejected);
  // Most damage is caught; some mutations (inside the legend, a changed CPU id) are harmless.
  EXPECT_GT(total.rejected, total.accepted);
  EXPECT_EQ(total.accepted + total.rejected, static_cast<int>(names.size()) * kMutantsPerFixture);
}

TEST(TopologyFuzz, NcclXmlNeverCrashes) {
  std::uint32_t seed = 100;
  for (const auto& name : xml_fixtures())
    fuzz(name, read_fixture(name), seed++, [&](const std::string& s) { return parse_nccl_topology_xml(s, name); });
}

TEST(TopologyFuzz, JsonNeverCrashes) {
  std::uint32_t seed = 200;
  for (const char* name :
       {"dgx1_v100_1nic_oneflow.txt", "a100_sxm4_3nic_bond_k8s.txt", "gtx1080ti_2gpu_phb_numa_na.txt"}) {
    const std::string text = to_json(load_topology_file(fixture_path(name)), 1);
    fuzz(name, text, seed++, [&](const std::string& s) { return topology_from_json(s, name); });
  }
  fuzz("replicated", replicated_json("rtx5090_2gpu_phb_workstation.txt", 3), seed++,
       [](const std::string& s) { return topology_from_json(s, "replicated.json"); });
}
