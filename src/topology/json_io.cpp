// JSON topology files (schema: docs/topology.md) <-> Topology.
//
// Reading is strict: unknown keys, wrong types, inconsistent matrices are errors, because a typo in
// a hand-written cluster description would otherwise plan a different machine without a word.
// Errors carry the JSON pointer of the offending value and its line and column; the position is
// found by re-reading the text with a SAX parser only when there is an error.
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/topology/topology.h"
#include "topology/limits.h"

namespace loom::topo {

namespace {

using json = nlohmann::json;

constexpr int kMaxGpusPerNode = limits::kGpusPerNode;
constexpr long long kMaxNodes = limits::kNodes;
constexpr long long kMaxLinkCells = limits::kLinkCells;

// A semantic error at a JSON pointer; turned into a ParseError with line/column at the top.
struct JsonError {
  std::string pointer;
  std::string message;
};

constexpr const char* kNetInsideNode =
    "NET joins different nodes; inside a node expected X, NV#, PIX, PXB, PHB, NODE or SYS";

[[noreturn]] void error(const std::string& pointer, const std::string& message) {
  throw JsonError{pointer, message};
}

std::string type_name(const json& j) {
  return j.type_name();
}

// A value for a message: never the whole of a large array or object (dumping one would cost time
// and memory in proportion to it, and nlohmann's serializer recurses once per nesting level).
std::string shown(const json& j) {
  if (j.is_array()) return j.empty() ? "[]" : "an array of " + std::to_string(j.size()) + " values";
  if (j.is_object()) return j.empty() ? "{}" : "an object of " + std::to_string(j.size()) + " members";
  std::string s = j.is_string() && j.get_ref<const std::string&>().size() > 40
                      ? json(j.get_ref<const std::string&>().substr(0, 40)).dump(-1, ' ', false,
                                                                                 json::error_handler_t::replace)
                      : j.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 40 ? s.substr(0, 40) + "..." : s;
}

// What a node costs once expanded: CPU ids in its lists plus bytes of its strings. Counted as the
// reader goes, so a list of a million sockets each "0-65535" is refused before it is built.
struct Budget {
  long long items = 0;
  void add(long long n, const std::string& at) {
    items += n;
    if (items > limits::kExpandedItems)
      error(at, "the topology " + limits::exceeded(limits::kExpandedItems, "CPU ids and string bytes in all"));
  }
};

void allow_keys(const json& obj, const std::string& at, std::initializer_list<const char*> keys) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool ok = it.key() == "comment";
    for (const char* k : keys) ok = ok || it.key() == k;
    if (!ok) {
      std::string list;
      for (const char* k : keys) list += std::string(list.empty() ? "" : ", ") + k;
      error(at + "/" + it.key(), "unknown key '" + it.key() + "' (expected one of: " + list + ", comment)");
    }
  }
}

const json& require_object(const json& j, const std::string& at) {
  if (!j.is_object()) error(at, "expected an object, found " + type_name(j) + " " + shown(j));
  return j;
}

long long read_int(const json& j, const std::string& at, long long lo, long long hi) {
  if (!j.is_number_integer()) error(at, "expected an integer, found " + type_name(j) + " " + shown(j));
  long long v = j.get<long long>();
  if (v < lo || v > hi)
    error(at, "expected an integer from " + std::to_string(lo) + " to " + std::to_string(hi) + ", found " + shown(j));
  return v;
}

std::string read_string(const json& j, const std::string& at) {
  if (!j.is_string()) error(at, "expected a string, found " + type_name(j) + " " + shown(j));
  return j.get<std::string>();
}

double read_number(const json& j, const std::string& at, double lo) {
  if (!j.is_number()) error(at, "expected a number, found " + type_name(j) + " " + shown(j));
  double v = j.get<double>();
  if (!std::isfinite(v) || v < lo)
    error(at, "expected a finite number >= " + std::to_string(lo) + ", found " + shown(j));
  return v;
}

CpuList read_cpus(const json& j, const std::string& at) {
  if (j.is_string()) {
    std::string s = j.get<std::string>();
    if (s.empty()) return {};
    auto cpus = parse_cpu_list(s);
    if (!cpus) error(at, "expected a CPU list such as \"0-11,24-35\", found " + shown(j));
    return *cpus;
  }
  if (j.is_array()) {
    std::set<int> cpus;
    for (size_t i = 0; i < j.size(); ++i)
      cpus.insert(static_cast<int>(read_int(j[i], at + "/" + std::to_string(i), 0, kMaxCpu)));
    return CpuList(cpus.begin(), cpus.end());
  }
  error(at, "expected a CPU list (a string such as \"0-11,24-35\" or an array of ids), found " + type_name(j));
}

Link read_link(const json& j, const std::string& at) {
  std::string s = read_string(j, at);
  auto link = parse_link(s);
  if (!link) error(at, "expected a link class (X, NV#, PIX, PXB, PHB, NODE, SYS), found " + shown(j));
  return *link;
}

void read_cost(const json& j, const std::string& at, LinkCost& cost) {
  require_object(j, at);
  allow_keys(j, at, {"bandwidth_gbps", "latency_us"});
  if (j.contains("bandwidth_gbps")) {
    cost.bandwidth_gbps = read_number(j["bandwidth_gbps"], at + "/bandwidth_gbps", 0);
    if (cost.bandwidth_gbps <= 0) error(at + "/bandwidth_gbps", "expected a bandwidth above 0 GB/s, found 0");
  }
  if (j.contains("latency_us")) cost.latency_us = read_number(j["latency_us"], at + "/latency_us", 0);
}

LinkCosts read_costs(const json& j, const std::string& at) {
  require_object(j, at);
  allow_keys(j, at, {"NV", "PIX", "PXB", "PHB", "NODE", "SYS", "NET"});
  LinkCosts c;
  std::pair<const char*, LinkCost*> fields[] = {{"NV", &c.nv_per_link}, {"PIX", &c.pix},   {"PXB", &c.pxb},
                                                {"PHB", &c.phb},        {"NODE", &c.node}, {"SYS", &c.sys},
                                                {"NET", &c.net}};
  for (auto& [key, cost] : fields)
    if (j.contains(key)) read_cost(j[key], at + "/" + key, *cost);
  return c;
}

// A rows x cols matrix of link classes: an array of arrays, or {"default": class, "pairs": [[a, b, class]]}.
// `square`: GPU x GPU (diagonal X, pairs set both directions); otherwise GPU x NIC.
std::vector<std::vector<Link>> read_matrix(const json& j, const std::string& at, size_t rows, size_t cols,
                                           bool square) {
  std::vector<std::vector<Link>> m(rows, std::vector<Link>(cols));
  if (j.is_array()) {
    if (j.size() != rows)
      error(at, "expected " + std::to_string(rows) + " rows (one per GPU), found " + std::to_string(j.size()));
    for (size_t a = 0; a < rows; ++a) {
      const std::string row_at = at + "/" + std::to_string(a);
      if (!j[a].is_array()) error(row_at, "expected an array of link classes, found " + type_name(j[a]));
      if (j[a].size() != cols)
        error(row_at, "expected " + std::to_string(cols) + " entries (one per " + (square ? "GPU" : "NIC") +
                          "), found " + std::to_string(j[a].size()));
      for (size_t b = 0; b < cols; ++b) m[a][b] = read_link(j[a][b], row_at + "/" + std::to_string(b));
    }
  } else if (j.is_object()) {
    allow_keys(j, at, {"default", "pairs"});
    if (!j.contains("default")) error(at, "expected a \"default\" link class");
    Link def = read_link(j["default"], at + "/default");
    if (def.cls == LinkClass::Self) error(at + "/default", "expected a link class other than X as the default");
    if (def.cls == LinkClass::NET) error(at + "/default", kNetInsideNode);
    for (size_t a = 0; a < rows; ++a)
      for (size_t b = 0; b < cols; ++b) m[a][b] = (square && a == b) ? Link{LinkClass::Self, 0} : def;
    if (j.contains("pairs")) {
      const json& pairs = j["pairs"];
      if (!pairs.is_array()) error(at + "/pairs", "expected an array of [a, b, class], found " + type_name(pairs));
      for (size_t p = 0; p < pairs.size(); ++p) {
        const std::string pat = at + "/pairs/" + std::to_string(p);
        if (!pairs[p].is_array() || pairs[p].size() != 3)
          error(pat,
                "expected [" + std::string(square ? "gpu, gpu" : "gpu, nic") + ", class], found " + shown(pairs[p]));
        size_t a = static_cast<size_t>(read_int(pairs[p][0], pat + "/0", 0, static_cast<long long>(rows) - 1));
        size_t b = static_cast<size_t>(read_int(pairs[p][1], pat + "/1", 0, static_cast<long long>(cols) - 1));
        Link l = read_link(pairs[p][2], pat + "/2");
        if (square && a == b) error(pat, "expected two different GPUs, found " + std::to_string(a) + " twice");
        if (l.cls == LinkClass::Self) error(pat + "/2", "expected a link class other than X for a pair");
        if (l.cls == LinkClass::NET) error(pat + "/2", kNetInsideNode);
        m[a][b] = l;
        if (square) m[b][a] = l;
      }
    }
  } else {
    error(at, "expected a matrix (array of arrays) or {\"default\": ..., \"pairs\": [...]}, found " + type_name(j));
  }
  for (size_t a = 0; a < rows; ++a)
    for (size_t b = 0; b < cols; ++b) {
      const std::string cell = at + "/" + std::to_string(a) + "/" + std::to_string(b);
      const Link l = m[a][b];
      if (l.cls == LinkClass::NET) error(cell, kNetInsideNode);
      if (square && (a == b) != (l.cls == LinkClass::Self))
        error(cell, a == b ? "expected X on the diagonal, found " + to_string(l)
                           : "expected a link class other than X off the diagonal");
      if (!square && l.cls == LinkClass::Self)
        error(cell, "expected a link class other than X between a GPU and a NIC");
      if (square && b < a && !(m[a][b] == m[b][a]))
        error(cell, "expected " + to_string(m[b][a]) + " (the matrix is symmetric: entry [" + std::to_string(b) + "][" +
                        std::to_string(a) + "] says so), found " + to_string(l));
    }
  return m;
}

std::string expand_hostname(const std::string& pattern, size_t node_index, long long replicate) {
  std::string name = pattern;
  size_t at = name.find("{i}");
  if (at != std::string::npos) {
    while (at != std::string::npos) {
      name.replace(at, 3, std::to_string(node_index));
      at = name.find("{i}", at);
    }
  } else if (replicate > 1) {
    name += "-" + std::to_string(node_index);
  }
  return name;
}

// The parts of one node of a topology file, each validated against its path `at`.
void read_notes(const json& j, const std::string& at, Node& node, Budget& budget) {
  if (j.contains("notes")) {
    if (!j["notes"].is_array()) error(at + "/notes", "expected an array of strings, found " + type_name(j["notes"]));
    for (size_t i = 0; i < j["notes"].size(); ++i) {
      const std::string nat = at + "/notes/" + std::to_string(i);
      node.notes.push_back(read_string(j["notes"][i], nat));
      budget.add(static_cast<long long>(node.notes.back().size()), nat);
    }
  }
}

// "sockets" or "numa_nodes": {"id", "cpus"} objects, each passed to `make`.
template <typename Make>
void read_places(const json& j, const char* key, const std::string& at, Budget& budget, Make make) {
  if (!j.contains(key)) return;
  const json& arr = j[key];
  const std::string kat = at + "/" + key;
  if (!arr.is_array()) error(kat, "expected an array of {\"id\", \"cpus\"}, found " + type_name(arr));
  std::set<int> ids;
  for (size_t i = 0; i < arr.size(); ++i) {
    const std::string eat = kat + "/" + std::to_string(i);
    require_object(arr[i], eat);
    allow_keys(arr[i], eat, {"id", "cpus"});
    if (!arr[i].contains("id")) error(eat, "expected an \"id\"");
    int id = static_cast<int>(read_int(arr[i]["id"], eat + "/id", 0, 65535));
    if (!ids.insert(id).second) error(eat + "/id", "id " + std::to_string(id) + " appears twice");
    CpuList cpus = arr[i].contains("cpus") ? read_cpus(arr[i]["cpus"], eat + "/cpus") : CpuList{};
    budget.add(static_cast<long long>(cpus.size()) + 1, eat);
    make(id, std::move(cpus));
  }
}

void read_gpus(const json& j, const std::string& at, Node& node, Budget& budget) {
  if (!j.contains("gpus")) error(at, "expected \"gpus\": a count or an array of GPU objects");
  const json& gpus = j["gpus"];
  if (gpus.is_number_integer()) {
    int n = static_cast<int>(read_int(gpus, at + "/gpus", 0, kMaxGpusPerNode));
    for (int i = 0; i < n; ++i) node.gpus.push_back({i, "", "", -1, {}});
  } else if (gpus.is_array()) {
    if (gpus.size() > static_cast<size_t>(kMaxGpusPerNode))
      error(at + "/gpus", "expected at most " + std::to_string(kMaxGpusPerNode) + " GPUs per node");
    for (size_t i = 0; i < gpus.size(); ++i) {
      const std::string gat = at + "/gpus/" + std::to_string(i);
      require_object(gpus[i], gat);
      allow_keys(gpus[i], gat, {"index", "name", "pci_bus_id", "numa", "cpus"});
      Gpu g;
      g.index = static_cast<int>(i);
      if (gpus[i].contains("index") && read_int(gpus[i]["index"], gat + "/index", 0, kMaxGpusPerNode) != g.index)
        error(gat + "/index", "expected index " + std::to_string(i) + " (GPUs are listed in device order)");
      if (gpus[i].contains("name")) g.name = read_string(gpus[i]["name"], gat + "/name");
      if (gpus[i].contains("pci_bus_id")) g.pci_bus_id = read_string(gpus[i]["pci_bus_id"], gat + "/pci_bus_id");
      if (gpus[i].contains("numa")) {
        g.numa = static_cast<int>(read_int(gpus[i]["numa"], gat + "/numa", -1, 65535));
        if (g.numa >= 0 && !node.numa_nodes.empty() && !node.numa_node(g.numa))
          error(gat + "/numa", "NUMA node " + std::to_string(g.numa) + " is not in this node's \"numa_nodes\"");
      }
      if (gpus[i].contains("cpus")) g.cpus = read_cpus(gpus[i]["cpus"], gat + "/cpus");
      budget.add(static_cast<long long>(g.cpus.size() + g.name.size() + g.pci_bus_id.size()) + 1, gat);
      node.gpus.push_back(std::move(g));
    }
  } else {
    error(at + "/gpus", "expected a GPU count or an array of GPU objects, found " + type_name(gpus));
  }
}

void read_nics(const json& j, const std::string& at, Node& node, Budget& budget) {
  if (j.contains("nics")) {
    const json& nics = j["nics"];
    if (!nics.is_array()) error(at + "/nics", "expected an array of NIC names or objects, found " + type_name(nics));
    if (nics.size() > static_cast<size_t>(limits::kNicsPerNode))
      error(at + "/nics", "the NIC count " + std::to_string(nics.size()) + " " +
                              limits::exceeded(limits::kNicsPerNode, "NICs per node"));
    for (size_t i = 0; i < nics.size(); ++i) {
      const std::string nat = at + "/nics/" + std::to_string(i);
      Nic n;
      if (nics[i].is_string()) {
        n.name = nics[i].get<std::string>();
      } else {
        require_object(nics[i], nat);
        allow_keys(nics[i], nat, {"name", "pci_bus_id"});
        if (!nics[i].contains("name")) error(nat, "expected a \"name\"");
        n.name = read_string(nics[i]["name"], nat + "/name");
        if (nics[i].contains("pci_bus_id")) n.pci_bus_id = read_string(nics[i]["pci_bus_id"], nat + "/pci_bus_id");
      }
      budget.add(static_cast<long long>(n.name.size() + n.pci_bus_id.size()) + 1, nat);
      node.nics.push_back(std::move(n));
    }
  }
}

void read_links(const json& j, const std::string& at, Node& node, long long& link_cells) {
  const size_t g = node.gpus.size();
  link_cells += static_cast<long long>(g * g + g * node.nics.size());
  if (link_cells > kMaxLinkCells)
    error(at, "the topology has more than " + std::to_string(kMaxLinkCells) + " link entries in all (too large)");
  if (j.contains("links")) {
    node.gpu_links = read_matrix(j["links"], at + "/links", g, g, true);
  } else if (g <= 1) {
    node.gpu_links.assign(g, std::vector<Link>(g, Link{LinkClass::Self, 0}));
  } else {
    error(at,
          "expected \"links\" (a matrix, or {\"default\": \"NV12\"}) for a node with " + std::to_string(g) + " GPUs");
  }
  if (!node.nics.empty()) {
    if (!j.contains("nic_links"))
      error(at, "expected \"nic_links\" (a GPU x NIC matrix, or {\"default\": \"SYS\"}) for a node with NICs");
    node.nic_links = read_matrix(j["nic_links"], at + "/nic_links", g, node.nics.size(), false);
  } else if (j.contains("nic_links")) {
    if (!(j["nic_links"].is_array() && j["nic_links"].size() == g &&
          std::all_of(j["nic_links"].begin(), j["nic_links"].end(),
                      [](const json& r) { return r.is_array() && r.empty(); })))
      error(at + "/nic_links", "expected no \"nic_links\" (or empty rows) for a node without \"nics\"");
    node.nic_links.assign(g, {});
  } else {
    node.nic_links.assign(g, {});
  }
}

Node read_node(const json& j, const std::string& at, long long& link_cells, Budget& budget) {
  require_object(j, at);
  allow_keys(
      j, at,
      {"hostname", "replicate", "sockets", "numa_nodes", "gpus", "nics", "links", "nic_links", "source", "notes"});
  Node node;
  if (j.contains("source")) node.source = read_string(j["source"], at + "/source");
  budget.add(static_cast<long long>(node.source.size()), at + "/source");
  read_notes(j, at, node, budget);
  read_places(j, "sockets", at, budget, [&](int id, CpuList c) { node.sockets.push_back({id, std::move(c)}); });
  read_places(j, "numa_nodes", at, budget, [&](int id, CpuList c) { node.numa_nodes.push_back({id, std::move(c)}); });
  read_gpus(j, at, node, budget);
  read_nics(j, at, node, budget);
  read_links(j, at, node, link_cells);
  return node;
}

Topology read_topology(const json& root) {
  require_object(root, "");
  allow_keys(root, "", {"loom_topology", "link_costs", "nodes"});
  if (root.contains("loom_topology") && read_int(root["loom_topology"], "/loom_topology", 1, 1) != 1)
    error("/loom_topology", "expected version 1");
  Topology topo;
  if (root.contains("link_costs")) topo.costs = read_costs(root["link_costs"], "/link_costs");
  if (!root.contains("nodes")) error("", "expected \"nodes\": an array of node objects");
  const json& nodes = root["nodes"];
  if (!nodes.is_array() || nodes.empty())
    error("/nodes", "expected a non-empty array of node objects, found " + shown(nodes));
  long long link_cells = 0;
  Budget budget;
  std::set<std::string> hostnames;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const std::string at = "/nodes/" + std::to_string(i);
    const long long before = budget.items;
    Node node = read_node(nodes[i], at, link_cells, budget);
    long long replicate =
        nodes[i].contains("replicate") ? read_int(nodes[i]["replicate"], at + "/replicate", 1, kMaxNodes) : 1;
    if (static_cast<long long>(topo.nodes.size()) + replicate > kMaxNodes)
      error(at + "/replicate", "expected at most " + std::to_string(kMaxNodes) + " nodes in all");
    link_cells += (replicate - 1) * static_cast<long long>(node.gpus.size() * (node.gpus.size() + node.nics.size()));
    if (link_cells > kMaxLinkCells)
      error(at + "/replicate",
            "the topology has more than " + std::to_string(kMaxLinkCells) + " link entries in all (too large)");
    const std::string pattern =
        nodes[i].contains("hostname") ? read_string(nodes[i]["hostname"], at + "/hostname") : "";
    // Every copy costs what the node costs, and its hostname.
    const long long per_copy = budget.items - before + static_cast<long long>(pattern.size()) + 8;
    if (per_copy > 0 && replicate - 1 > (limits::kExpandedItems - budget.items) / per_copy)
      budget.add(limits::kExpandedItems, at + "/replicate");
    budget.add((replicate - 1) * per_copy + static_cast<long long>(pattern.size()), at + "/replicate");
    for (long long r = 0; r < replicate; ++r) {
      Node copy = node;
      copy.hostname = expand_hostname(pattern, topo.nodes.size(), replicate);
      if (!copy.hostname.empty() && !hostnames.insert(copy.hostname).second)
        error(at + "/hostname", "hostname '" + copy.hostname + "' is used by two nodes");
      topo.nodes.push_back(std::move(copy));
    }
  }
  return topo;
}

// Finds where the value at `pointer` starts, by re-reading the text with a SAX parser whose input
// iterator records how far the lexer has read.
class PositionFinder : public nlohmann::json_sax<json> {
 public:
  PositionFinder(std::string_view text, std::string target, const char** last)
      : text_(text), target_(std::move(target)), last_(last) {}
  std::optional<size_t> found;

  bool null() override { return scalar(); }
  bool boolean(bool) override { return scalar(); }
  bool number_integer(number_integer_t) override { return scalar(); }
  bool number_unsigned(number_unsigned_t) override { return scalar(); }
  bool number_float(number_float_t, const string_t&) override { return scalar(); }
  bool string(string_t&) override { return scalar(); }
  bool binary(binary_t&) override { return scalar(); }
  bool start_object(std::size_t) override { return open(false); }
  bool start_array(std::size_t) override { return open(true); }
  bool key(string_t& k) override {
    stack_.back().key = k;
    return true;
  }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  struct Frame {
    bool array;
    size_t index = 0;
    std::string key;
  };

  std::string pointer() const {
    std::string p;
    for (const auto& f : stack_) {
      p += "/";
      if (f.array) {
        p += std::to_string(f.index);
      } else {
        for (char c : f.key) p += c == '~' ? std::string("~0") : c == '/' ? std::string("~1") : std::string(1, c);
      }
    }
    return p;
  }
  size_t offset() const { return static_cast<size_t>(*last_ - text_.data()); }
  bool hit(size_t start) {
    if (pointer() != target_) return true;
    found = start;
    return false;  // stop parsing
  }
  bool open(bool array) {
    if (!hit(offset())) return false;
    stack_.push_back(Frame{array, 0, {}});
    return true;
  }
  bool close() {
    stack_.pop_back();
    advance();
    return true;
  }
  bool scalar() {
    // The lexer has read the whole token (a number also the character after it): walk back to its start.
    size_t e = offset();
    size_t start = e;
    if (text_[e] == '"') {
      size_t j = e;
      while (j > 0) {
        --j;
        if (text_[j] != '"') continue;
        size_t backslashes = 0;
        while (j >= 1 + backslashes && text_[j - 1 - backslashes] == '\\') ++backslashes;
        if (backslashes % 2 == 0) break;
      }
      start = j;
    } else {
      auto token_char = [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.';
      };
      if (!token_char(text_[e]) && e > 0) --e;
      start = e;
      while (start > 0 && token_char(text_[start - 1])) --start;
    }
    if (!hit(start)) return false;
    advance();
    return true;
  }
  void advance() {
    if (!stack_.empty() && stack_.back().array) ++stack_.back().index;
  }

  std::string_view text_;
  std::string target_;
  const char** last_;
  std::vector<Frame> stack_;
};

struct CountingIterator {
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;
  const char* p;
  const char** last;
  reference operator*() const {
    *last = p;
    return *p;
  }
  CountingIterator& operator++() {
    ++p;
    return *this;
  }
  CountingIterator operator++(int) {
    CountingIterator old = *this;
    ++p;
    return old;
  }
  bool operator==(const CountingIterator& o) const { return p == o.p; }
  bool operator!=(const CountingIterator& o) const { return p != o.p; }
};

std::pair<int, int> line_column(std::string_view text, size_t offset) {
  int line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

std::pair<int, int> locate(std::string_view text, const std::string& pointer) {
  if (text.empty()) return {1, 1};
  const char* last = text.data();
  PositionFinder finder(text, pointer, &last);
  try {
    json::sax_parse(CountingIterator{text.data(), &last}, CountingIterator{text.data() + text.size(), &last}, &finder);
  } catch (const std::exception&) {
  }
  size_t at = finder.found.value_or(0);
  // The pointer of a missing member names its parent: report the parent's position.
  if (!finder.found && !pointer.empty()) return locate(text, pointer.substr(0, pointer.rfind('/')));
  return line_column(text, at);
}

json links_json(const std::vector<std::vector<Link>>& m) {
  json rows = json::array();
  for (const auto& row : m) {
    json r = json::array();
    for (Link l : row) r.push_back(to_string(l));
    rows.push_back(std::move(r));
  }
  return rows;
}

json cost_json(const LinkCost& c) {
  return {{"bandwidth_gbps", c.bandwidth_gbps}, {"latency_us", c.latency_us}};
}

// Nesting depth and value count of the JSON text, by one linear scan before anything is built:
// nlohmann's parser is iterative, but its serializer and destructor of a deep value are not, and a
// 64 MB file of "[]," would become a gigabyte of json values.
void check_json_bounds(std::string_view text, const std::string& source_name) {
  int depth = 0;
  long long values = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
      continue;
    }
    auto fail = [&](const std::string& message) {
      auto [line, column] = line_column(text, i);
      throw ParseError(source_name, line, column, message);
    };
    switch (c) {
      case '"':
        in_string = true;
        ++values;
        break;
      case '[':
      case '{':
        if (++depth > limits::kJsonDepth)
          fail("the nesting " + limits::exceeded(limits::kJsonDepth, "levels of arrays and objects"));
        ++values;
        break;
      case ']':
      case '}':
        --depth;  // unbalanced text is the parser's to report
        break;
      case ',':
        ++values;
        break;
      default:
        break;
    }
    if (values > limits::kJsonValues) fail("the file " + limits::exceeded(limits::kJsonValues, "JSON values"));
  }
}

}  // namespace

Topology topology_from_json(std::string_view text, std::string source_name) {
  check_json_bounds(text, source_name);
  json root;
  try {
    root = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    auto [line, column] = line_column(text, e.byte > 0 ? e.byte - 1 : 0);
    std::string what = e.what();
    size_t colon = what.find(": ", what.find("parse error"));
    throw ParseError(source_name, line, column,
                     "expected valid JSON: " + (colon == std::string::npos ? what : what.substr(colon + 2)));
  } catch (const json::exception& e) {
    // Not a syntax error but still the text's fault, e.g. out_of_range for a number beyond a
    // double (1e400) (found by tests/fuzz/fuzz_topology_json.cpp): no position is known.
    throw ParseError(source_name, 0, 0, std::string("expected valid JSON: ") + e.what());
  }
  try {
    Topology topo = read_topology(root);
    validate(topo);  // the reader already checks each entry; this guards the invariants as a whole
    return topo;
  } catch (const JsonError& e) {
    auto [line, column] = locate(text, e.pointer);
    throw ParseError(source_name, line, column, (e.pointer.empty() ? "/" : e.pointer) + ": " + e.message);
  } catch (const std::invalid_argument& e) {
    throw ParseError(source_name, 0, 0, e.what());
  }
}

std::string to_json(const Topology& topology, int indent) {
  json root;
  root["loom_topology"] = 1;
  const LinkCosts& c = topology.costs;
  root["link_costs"] = {{"NV", cost_json(c.nv_per_link)}, {"PIX", cost_json(c.pix)},   {"PXB", cost_json(c.pxb)},
                        {"PHB", cost_json(c.phb)},        {"NODE", cost_json(c.node)}, {"SYS", cost_json(c.sys)},
                        {"NET", cost_json(c.net)}};
  json nodes = json::array();
  for (const Node& n : topology.nodes) {
    json node;
    node["hostname"] = n.hostname;
    node["source"] = n.source;
    node["notes"] = n.notes;
    node["sockets"] = json::array();
    for (const auto& s : n.sockets) node["sockets"].push_back({{"id", s.id}, {"cpus", format_cpu_list(s.cpus)}});
    node["numa_nodes"] = json::array();
    for (const auto& s : n.numa_nodes) node["numa_nodes"].push_back({{"id", s.id}, {"cpus", format_cpu_list(s.cpus)}});
    node["gpus"] = json::array();
    for (const auto& g : n.gpus)
      node["gpus"].push_back({{"index", g.index},
                              {"name", g.name},
                              {"pci_bus_id", g.pci_bus_id},
                              {"numa", g.numa},
                              {"cpus", format_cpu_list(g.cpus)}});
    node["nics"] = json::array();
    for (const auto& k : n.nics) node["nics"].push_back({{"name", k.name}, {"pci_bus_id", k.pci_bus_id}});
    node["links"] = links_json(n.gpu_links);
    if (!n.nics.empty()) node["nic_links"] = links_json(n.nic_links);
    nodes.push_back(std::move(node));
  }
  root["nodes"] = std::move(nodes);
  // Names read from other formats can hold bytes that are not UTF-8 (an XML attribute, an
  // nvidia-smi title): replaced by U+FFFD rather than thrown (found by tests/fuzz/fuzz_nccl_xml.cpp;
  // init() all-gathers this text).
  return root.dump(indent, ' ', false, json::error_handler_t::replace);
}

}  // namespace loom::topo
