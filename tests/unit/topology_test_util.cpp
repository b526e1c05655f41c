#include "topology_test_util.h"

#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace loom::topo::testing {

std::string fixture_path(const std::string& name) {
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/topology/" + name;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string read_fixture(const std::string& name) {
  return read_file(fixture_path(name));
}

Link L(const char* text) {
  return *parse_link(text);
}

namespace {

std::vector<std::string> list(const std::function<bool(const std::string&)>& keep) {
  std::vector<std::string> out;
  DIR* dir = opendir(fixture_path("").c_str());
  if (!dir) throw std::runtime_error("cannot list " + fixture_path(""));
  while (dirent* e = readdir(dir)) {
    std::string name = e->d_name;
    if (keep(name)) out.push_back(name);
  }
  closedir(dir);
  std::sort(out.begin(), out.end());
  return out;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool is_p2p(const std::string& name) {
  return name.find("_p2p") != std::string::npos;
}

}  // namespace

std::vector<std::string> topo_matrix_fixtures() {
  return list([](const std::string& n) { return ends_with(n, ".txt") && !is_p2p(n) && n != kMangledFixture; });
}

std::vector<std::string> p2p_fixtures() {
  return list([](const std::string& n) { return ends_with(n, ".txt") && is_p2p(n); });
}

std::vector<std::string> xml_fixtures() {
  return list([](const std::string& n) { return ends_with(n, ".xml"); });
}

std::string parse_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ParseError& e) {
    return e.what();
  }
  return "";
}

std::string replicated_json(const std::string& fixture, int nodes) {
  Topology one = load_topology_file(fixture_path(fixture));
  nlohmann::json j = nlohmann::json::parse(to_json(one));
  j["nodes"][0]["hostname"] = "node{i}";
  j["nodes"][0]["replicate"] = nodes;
  return j.dump();
}

}  // namespace loom::topo::testing
