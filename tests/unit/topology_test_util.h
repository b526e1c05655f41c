// Helpers shared by the topology, placement and launcher tests: fixture files and error capture.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "../time_scale.h"

#include "loom/topology/topology.h"

namespace loom::topo::testing {

std::string fixture_path(const std::string& name);  // tests/fixtures/topology/<name>
std::string read_file(const std::string& path);
std::string read_fixture(const std::string& name);

// Fixture names by kind: `nvidia-smi topo -m` / `-mp` matrices that must parse, `-p2p` matrices,
// NCCL XML files. The damaged h800 file is in none of them.
std::vector<std::string> topo_matrix_fixtures();
std::vector<std::string> p2p_fixtures();
std::vector<std::string> xml_fixtures();
inline const char* kMangledFixture = "h800_8gpu_10nic_gdr_stor_MANGLED_affinity.txt";

// A link from its nvidia-smi spelling: L("NV2"), L("PIX"), L("SYS").
Link L(const char* text);

// The ParseError's what() ("" when `f` did not throw); a different exception propagates.
std::string parse_error_of(const std::function<void()>& f);

// A simulated cluster: `nodes` copies of a fixture's node (hostnames node0..), as JSON text.
std::string replicated_json(const std::string& fixture, int nodes);

// The wall-clock bounds of these tests are the reference machine's, scaled to this one now and to
// the build (tests/time_scale.h).
using loom::test::time_bound;

}  // namespace loom::topo::testing
