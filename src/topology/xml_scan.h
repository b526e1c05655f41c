// A tiny, bounds-checked XML reader for the subset NCCL topology files use: elements, attributes
// in single or double quotes, the five predefined entities and numeric character references,
// comments, a <?xml?> declaration, and text between elements (ignored). No DTDs, no namespaces.
// Depth and element count are capped so hostile input costs bounded time and memory.
// Internal to the topology parsers (and used by tests to check generated SVG).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::topo::detail {

struct XmlElement {
  std::string name;
  std::vector<std::pair<std::string, std::string>> attributes;
  std::vector<XmlElement> children;
  int line = 0;  // where the start tag begins (1-based)
  int column = 0;

  // The attribute's value, or nullptr when absent.
  const std::string* attribute(std::string_view key) const;
};

inline constexpr int kMaxXmlDepth = 64;
inline constexpr int kMaxXmlElements = 100000;
inline constexpr int kMaxXmlAttributes = 64;             // per element (NCCL writes at most ~12)
inline constexpr int kMaxXmlAttributesTotal = 1000000;  // in the document

// The document's root element. Throws loom::topo::ParseError naming `source`, line and column.
XmlElement parse_xml(std::string_view text, const std::string& source);

}  // namespace loom::topo::detail
