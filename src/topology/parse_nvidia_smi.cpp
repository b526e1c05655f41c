// `nvidia-smi topo -m` / `topo -mp` text -> Topology (one node).
//
// The format is a header row of column titles (GPU0.. then NICs, then up to three affinity
// titles), one row per column with a link class per cell, then an optional legend. Real outputs
// differ in separators (tabs, aligned spaces), line endings, NIC naming (mlx5_* titles, or NICn
// with a "NIC Legend"), and which affinity columns exist; all of that is accepted. What is not
// accepted is text whose rows do not line up with the header (a field run into the next, a lost
// cell, a swapped row) or an asymmetric matrix: those would silently put ranks on the wrong CPUs
// or GPUs, so they are errors that point at the line and column.
#include <algorithm>
#include <map>
#include <set>

#include "loom/topology/topology.h"
#include "topology/limits.h"
#include "topology/text_lines.h"

namespace loom::topo {

namespace {

using detail::TextLine;
using detail::Token;

enum class Affinity { Cpu, Numa, GpuNuma };

const char* affinity_title(Affinity a) {
  switch (a) {
    case Affinity::Cpu:
      return "CPU Affinity";
    case Affinity::Numa:
      return "NUMA Affinity";
    case Affinity::GpuNuma:
      return "GPU NUMA ID";
  }
  return "?";
}

struct Column {
  std::string name;
  bool gpu = false;
};

struct Cell {
  Link link;
  int line = 0;
  int column = 0;
};

bool is_gpu_title(std::string_view t) {
  if (t.size() < 4 || t.substr(0, 3) != "GPU") return false;
  return std::all_of(t.begin() + 3, t.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool is_device_title(std::string_view t) {
  return !t.empty() && std::all_of(t.begin(), t.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.' || c == ':';
  });
}

bool is_p2p_status(std::string_view t) {
  for (std::string_view s : {"OK", "CNS", "GNS", "TNS", "NS", "DR", "U"})
    if (t == s) return true;
  return false;
}

std::string quoted(std::string_view t) {
  std::string out = "'";
  for (char c : t.substr(0, 40)) out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  if (t.size() > 40) out += "...";
  return out + "'";
}

class NvidiaSmiParser {
 public:
  NvidiaSmiParser(std::string_view text, std::string source) : source_(std::move(source)) {
    check_text_bounds(text);
    lines_ = detail::split_lines(text);
  }

  Topology parse() {
    size_t i = 0;
    while (i < lines_.size() && lines_[i].blank()) ++i;
    if (i == lines_.size())
      fail(lines_.empty() ? 1 : lines_.back().number, 1,
           "expected the header row of `nvidia-smi topo -m` (GPU0 GPU1 ... CPU Affinity ...), found no text");
    parse_header(lines_[i]);
    ++i;
    for (size_t r = 0; r < columns_.size(); ++r, ++i) {
      if (i >= lines_.size() || lines_[i].blank()) {
        int line = i < lines_.size() ? lines_[i].number : (lines_.empty() ? 1 : lines_.back().number + 1);
        fail(line, 1,
             "expected the row of '" + columns_[r].name + "' (the header on line " + std::to_string(header_line_) +
                 " has " + std::to_string(columns_.size()) + " device columns), found " +
                 (i >= lines_.size() ? "the end of the text" : "a blank line"));
      }
      parse_row(lines_[i], r);
    }
    check_symmetric();
    parse_trailer(i);
    return build();
  }

 private:
  [[noreturn]] void fail(int line, int column, const std::string& message) const {
    throw ParseError(source_, line, column, message);
  }

  // Lines and fields, counted before the text is split (the split keeps 24 bytes per field).
  void check_text_bounds(std::string_view text) const {
    size_t lines = 1, fields = 0;
    bool in_field = false;
    for (size_t i = 0; i < text.size(); ++i) {
      const char c = text[i];
      const bool space = c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f' || c == '\n';
      if (!space && !in_field && ++fields > limits::kTextFields)
        fail(static_cast<int>(lines), 1, "the text " + limits::exceeded(limits::kTextFields, "fields"));
      in_field = !space;
      if (c == '\n' && ++lines > limits::kTextLines)
        fail(static_cast<int>(lines), 1, "the text " + limits::exceeded(limits::kTextLines, "lines"));
    }
  }

  void parse_header(const TextLine& line) {
    header_line_ = line.number;
    const auto& t = line.tokens;
    std::set<std::string_view> seen;
    for (size_t k = 0; k < t.size();) {
      auto next = [&](size_t d) { return k + d < t.size() ? t[k + d].text : std::string_view(); };
      std::optional<Affinity> title;
      size_t width = 0;
      if (t[k].text == "CPU" && next(1) == "Affinity")
        title = Affinity::Cpu, width = 2;
      else if (t[k].text == "NUMA" && next(1) == "Affinity")
        title = Affinity::Numa, width = 2;
      else if (t[k].text == "GPU" && next(1) == "NUMA" && next(2) == "ID")
        title = Affinity::GpuNuma, width = 3;
      if (title) {
        if (std::find(affinity_.begin(), affinity_.end(), *title) != affinity_.end())
          fail(line.number, t[k].column, std::string("the header names '") + affinity_title(*title) + "' twice");
        affinity_.push_back(*title);
        k += width;
        continue;
      }
      if (!affinity_.empty())
        fail(line.number, t[k].column,
             "expected an affinity column title (CPU Affinity, NUMA Affinity, GPU NUMA ID) after '" +
                 std::string(affinity_title(affinity_.back())) + "', found " + quoted(t[k].text));
      const std::string_view name = t[k].text;
      if (columns_.empty() && !is_gpu_title(name))
        fail(line.number, t[k].column,
             "expected the header row of `nvidia-smi topo -m` to start with 'GPU0', found " + quoted(name));
      if (!is_device_title(name))
        fail(line.number, t[k].column, "expected a GPU or NIC column title, found " + quoted(name));
      if (is_gpu_title(name) ? gpu_count_ >= limits::kGpusPerNode
                             : static_cast<int>(columns_.size()) - gpu_count_ >= limits::kNicsPerNode)
        fail(line.number, t[k].column,
             "the header's " + std::string(is_gpu_title(name) ? "GPU" : "NIC") + " columns " +
                 limits::exceeded(is_gpu_title(name) ? limits::kGpusPerNode : limits::kNicsPerNode,
                                  is_gpu_title(name) ? "GPUs per node" : "NICs per node"));
      if (is_gpu_title(name)) {
        const std::string expected = "GPU" + std::to_string(gpu_count_);
        if (gpu_count_ != static_cast<int>(columns_.size()))
          fail(line.number, t[k].column,
               "expected GPU columns before the NIC columns, found " + quoted(name) + " after " +
                   quoted(columns_.back().name));
        if (name != expected) fail(line.number, t[k].column, "expected '" + expected + "', found " + quoted(name));
        ++gpu_count_;
      }
      if (!seen.insert(name).second) fail(line.number, t[k].column, "the header names " + quoted(name) + " twice");
      column_names_.insert(std::string(name));
      columns_.push_back({std::string(name), is_gpu_title(name)});
      ++k;
    }
    if (columns_.empty())
      fail(line.number, 1, "expected the header row of `nvidia-smi topo -m` to start with 'GPU0', found none");
    cells_.assign(columns_.size(), std::vector<Cell>(columns_.size()));
    gpu_cpus_.resize(gpu_count_);
    gpu_numa_.assign(gpu_count_, -1);
  }

  void parse_row(const TextLine& line, size_t r) {
    const auto& t = line.tokens;
    const Column& col = columns_[r];
    if (t[0].text != col.name)
      fail(line.number, t[0].column,
           "expected the row of '" + col.name + "' (rows follow the order of the header on line " +
               std::to_string(header_line_) + "), found " + quoted(t[0].text));
    parse_link_cells(line, r);
    const size_t n = columns_.size();
    const size_t rest = t.size() - 1 - n;
    if (!col.gpu || affinity_.empty()) {
      if (rest != 0)
        fail(line.number, t[1 + n].column,
             col.name + " row: expected " + std::to_string(n) + " link cells" +
                 (col.gpu ? "" : " and no affinity fields (NIC rows have none)") +
                 ", found more: " + quoted(t[1 + n].text));
      return;
    }
    check_affinity_count(line, r, rest);
    parse_affinity_fields(line, r);
  }

  // The row's n link cells: a link class each, 'X' on the diagonal only.
  void parse_link_cells(const TextLine& line, size_t r) {
    const auto& t = line.tokens;
    const Column& col = columns_[r];
    const size_t n = columns_.size();
    for (size_t j = 0; j < n; ++j) {
      if (1 + j >= t.size())
        fail(line.number, t.back().end_column(),
             col.name + " row: expected " + std::to_string(n) + " link cells (one per column of the header on line " +
                 std::to_string(header_line_) + "), found " + std::to_string(t.size() - 1));
      const Token& cell = t[1 + j];
      if (is_p2p_status(cell.text))
        fail(line.number, cell.column,
             "found the peer-to-peer status " + quoted(cell.text) +
                 " where a link class belongs: this is an `nvidia-smi topo -p2p` matrix, not `nvidia-smi topo -m`; "
                 "it says whether P2P works, not how the GPUs are connected. Give the output of `nvidia-smi topo -m`");
      auto link = parse_link(cell.text);
      if (!link || link->cls == LinkClass::NET) {
        std::string hint;
        if (parse_cpu_list(cell.text) || cell.text == "N/A")
          hint = " (the row has fewer link cells than the header has device columns)";
        fail(line.number, cell.column,
             col.name + " row, column " + columns_[j].name +
                 ": expected a link class (X, NV#, PIX, PXB, PHB, NODE, SYS), found " + quoted(cell.text) + hint);
      }
      if ((j == r) != (link->cls == LinkClass::Self))
        fail(line.number, cell.column,
             col.name + " row, column " + columns_[j].name + ": expected " +
                 (j == r ? "'X' on the diagonal" : "a link class other than 'X' off the diagonal") + ", found " +
                 quoted(cell.text));
      cells_[r][j] = {*link, line.number, cell.column};
    }
  }

  // The GPU row's affinity fields line up with the header's titles.
  void check_affinity_count(const TextLine& line, size_t r, size_t rest) const {
    const auto& t = line.tokens;
    const Column& col = columns_[r];
    const size_t n = columns_.size();
    if (rest == affinity_.size()) return;
    std::string titles, found;
    for (auto a : affinity_) titles += std::string(titles.empty() ? "" : ", ") + affinity_title(a);
    for (size_t k = 1 + n; k < t.size(); ++k) found += (found.empty() ? "" : " ") + quoted(t[k].text);
    fail(line.number, rest > 0 ? t[1 + n].column : t.back().end_column(),
         col.name + " row: expected " + std::to_string(affinity_.size()) + " affinity fields (" + titles +
             ") after the " + std::to_string(n) + " link cells, found " + std::to_string(rest) +
             (found.empty() ? "" : " (" + found + ")") + ": the fields do not line up with the header on line " +
             std::to_string(header_line_) + " (two fields run together, or one is missing)");
  }

  // CPU Affinity, NUMA Affinity and GPU NUMA ID of GPU r.
  void parse_affinity_fields(const TextLine& line, size_t r) {
    const auto& t = line.tokens;
    const Column& col = columns_[r];
    const size_t n = columns_.size();
    const int gpu = static_cast<int>(r);
    for (size_t a = 0; a < affinity_.size(); ++a) {
      const Token& f = t[1 + n + a];
      if (f.text == "N/A") continue;
      switch (affinity_[a]) {
        case Affinity::Cpu: {
          auto cpus = parse_cpu_list(f.text);
          if (!cpus)
            fail(line.number, f.column,
                 col.name + " CPU Affinity: expected a CPU list such as 0-11,24-35 or N/A, found " + quoted(f.text));
          cpu_ids_ += static_cast<long long>(cpus->size());
          if (cpu_ids_ > limits::kNodeCpuIds)
            fail(line.number, f.column,
                 "the CPU Affinity lists " + limits::exceeded(limits::kNodeCpuIds, "CPU ids in all"));
          gpu_cpus_[gpu] = std::move(*cpus);
          break;
        }
        case Affinity::Numa: {
          auto ids = parse_cpu_list(f.text);  // same syntax: "0" or "0,5-11"
          if (!ids)
            fail(line.number, f.column,
                 col.name + " NUMA Affinity: expected NUMA node ids such as 0 or 0,5-11, or N/A, found " +
                     quoted(f.text));
          // The first id is the CPU-side node; GH200 lists its GPU-memory nodes after it.
          gpu_numa_[gpu] = ids->front();
          break;
        }
        case Affinity::GpuNuma: {
          auto ids = parse_cpu_list(f.text);
          if (!ids || ids->size() != 1 || f.text.find_first_of(",-") != std::string_view::npos)
            fail(line.number, f.column,
                 col.name + " GPU NUMA ID: expected one NUMA node id or N/A, found " + quoted(f.text));
          break;
        }
      }
    }
  }

  void check_symmetric() const {
    for (size_t a = 0; a < columns_.size(); ++a)
      for (size_t b = a + 1; b < columns_.size(); ++b) {
        const Cell& x = cells_[a][b];
        const Cell& y = cells_[b][a];
        if (!(x.link == y.link))
          fail(y.line, y.column,
               columns_[b].name + " row, column " + columns_[a].name + ": expected " + to_string(x.link) + " (as " +
                   columns_[a].name + " row, column " + columns_[b].name + " on line " + std::to_string(x.line) +
                   " says: the matrix is symmetric), found " + to_string(y.link));
      }
  }

  void parse_trailer(size_t i) {
    enum { AfterMatrix, Legend, NicLegend } state = AfterMatrix;
    for (; i < lines_.size(); ++i) {
      const TextLine& line = lines_[i];
      if (line.blank()) continue;
      const auto& t = line.tokens;
      if (t.size() == 1 && t[0].text == "Legend:") {
        state = Legend;
        continue;
      }
      if (t.size() == 2 && t[0].text == "NIC" && t[1].text == "Legend:") {
        state = NicLegend;
        continue;
      }
      if (state == AfterMatrix)
        fail(line.number, t[0].column,
             "expected a blank line or 'Legend:' after the last matrix row ('" + columns_.back().name + "'), found " +
                 quoted(t[0].text));
      if (state == Legend) {
        if (line.text.find('=') == std::string_view::npos)
          fail(line.number, t[0].column, "expected a legend entry 'NAME = meaning', found " + quoted(t[0].text));
        continue;
      }
      // NIC Legend: "NIC3: mlx5_3"
      std::string_view key = t[0].text;
      if (t.size() != 2 || key.size() < 5 || key.substr(0, 3) != "NIC" || key.back() != ':')
        fail(line.number, t[0].column,
             "expected a NIC legend entry such as 'NIC0: mlx5_0', found " + quoted(line.text));
      std::string title(key.substr(0, key.size() - 1));
      if (!column_names_.count(title))
        fail(line.number, t[0].column,
             "the NIC legend names '" + title + "', which is not a column of the header on line " +
                 std::to_string(header_line_));
      if (!nic_names_.emplace(title, std::string(t[1].text)).second)
        fail(line.number, t[0].column, "the NIC legend names '" + title + "' twice");
    }
  }

  Topology build() const {
    Node node;
    node.source = source_ + " (nvidia-smi topo -m)";
    const int g = gpu_count_;
    for (int i = 0; i < g; ++i) node.gpus.push_back({i, "", "", gpu_numa_[i], gpu_cpus_[i]});
    for (size_t c = g; c < columns_.size(); ++c) {
      auto it = nic_names_.find(columns_[c].name);
      node.nics.push_back({it != nic_names_.end() ? it->second : columns_[c].name, ""});
    }
    node.gpu_links.assign(g, std::vector<Link>(g));
    node.nic_links.assign(g, std::vector<Link>(node.nics.size()));
    for (int a = 0; a < g; ++a) {
      for (int b = 0; b < g; ++b) node.gpu_links[a][b] = cells_[a][b].link;
      for (size_t k = 0; k < node.nics.size(); ++k) node.nic_links[a][k] = cells_[a][g + k].link;
    }
    const bool numa_known = std::any_of(gpu_numa_.begin(), gpu_numa_.end(), [](int n) { return n >= 0; });
    if (numa_known) {
      // Sorted vectors, not sets: memory stays that of the CPU lists themselves.
      std::map<int, CpuList> cpus;
      for (const auto& gpu : node.gpus)
        if (gpu.numa >= 0) cpus[gpu.numa].insert(cpus[gpu.numa].end(), gpu.cpus.begin(), gpu.cpus.end());
      for (auto& [id, list] : cpus) {
        std::sort(list.begin(), list.end());
        list.erase(std::unique(list.begin(), list.end()), list.end());
        node.numa_nodes.push_back({id, std::move(list)});
      }
    } else {
      // No NUMA column (older drivers) or N/A: GPUs with the same CPU affinity share a NUMA node.
      // A map finds equal lists in log time (a linear search was quadratic in the GPUs).
      std::map<CpuList, int> distinct;
      for (auto& gpu : node.gpus) {
        if (gpu.cpus.empty()) continue;
        auto [it, added] = distinct.emplace(gpu.cpus, static_cast<int>(distinct.size()));
        gpu.numa = it->second;
        if (added) node.numa_nodes.push_back({it->second, gpu.cpus});
      }
      if (!distinct.empty())
        node.notes.push_back("NUMA nodes inferred from the CPU Affinity column (no NUMA Affinity given)");
    }
    node.notes.push_back("sockets not described by nvidia-smi topo -m");
    for (size_t c = g; c < columns_.size(); ++c)
      if (columns_[c].name.rfind("NIC", 0) == 0 && !nic_names_.count(columns_[c].name)) {
        node.notes.push_back("NIC names not given (no NIC Legend): kept as NICn");
        break;
      }
    Topology topo;
    topo.nodes.push_back(std::move(node));
    return topo;
  }

  std::string source_;
  std::vector<TextLine> lines_;
  int header_line_ = 0;
  std::vector<Column> columns_;
  std::set<std::string> column_names_;
  long long cpu_ids_ = 0;
  int gpu_count_ = 0;
  std::vector<Affinity> affinity_;
  std::vector<std::vector<Cell>> cells_;
  std::vector<CpuList> gpu_cpus_;
  std::vector<int> gpu_numa_;
  std::map<std::string, std::string> nic_names_;
};

}  // namespace

Topology parse_nvidia_smi_topo(std::string_view text, std::string source_name) {
  return NvidiaSmiParser(text, std::move(source_name)).parse();
}

}  // namespace loom::topo
