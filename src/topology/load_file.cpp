#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "loom/topology/topology.h"

namespace loom::topo {

namespace {

constexpr std::streamoff kMaxFileBytes = 64LL * 1024 * 1024;

}  // namespace

Topology load_topology_file(const std::string& path) {
  // (An ifstream opens a directory, and its size reads as the largest offset.)
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::is_directory(status))
    throw ParseError(path, 0, 0, "the topology file is a directory: expected a JSON, nvidia-smi topo -m or NCCL XML file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ParseError(path, 0, 0, std::string("cannot open the topology file: ") + std::strerror(errno));
  in.seekg(0, std::ios::end);
  std::streamoff size = in.tellg();
  if (size < 0) throw ParseError(path, 0, 0, "cannot read the topology file (is it a directory?)");
  if (size > kMaxFileBytes)
    throw ParseError(
        path, 0, 0,
        "the topology file has " + std::to_string(size) + " bytes, expected at most " + std::to_string(kMaxFileBytes));
  in.seekg(0);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), size)) throw ParseError(path, 0, 0, "cannot read the topology file");
  // The format by its first character: '{' JSON, '<' NCCL XML, anything else nvidia-smi text.
  size_t first = text.find_first_not_of(" \t\r\n");
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) first = text.find_first_not_of(" \t\r\n", 3);
  if (first != std::string::npos && text[first] == '{') return topology_from_json(text, path);
  if (first != std::string::npos && text[first] == '<') return parse_nccl_topology_xml(text, path);
  return parse_nvidia_smi_topo(text, path);
}

}  // namespace loom::topo
