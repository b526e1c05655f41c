#include "topology/text_lines.h"

namespace loom::topo::detail {

namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

}  // namespace

std::vector<TextLine> split_lines(std::string_view text) {
  std::vector<TextLine> lines;
  size_t pos = 0;
  int number = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    TextLine line;
    line.number = ++number;
    line.text = text.substr(pos, end - pos);
    while (!line.text.empty() && line.text.back() == '\r') line.text.remove_suffix(1);
    size_t i = 0;
    while (i < line.text.size()) {
      while (i < line.text.size() && is_space(line.text[i])) ++i;
      size_t start = i;
      while (i < line.text.size() && !is_space(line.text[i])) ++i;
      if (i > start) line.tokens.push_back({line.text.substr(start, i - start), static_cast<int>(start) + 1});
    }
    lines.push_back(std::move(line));
    pos = end + 1;
  }
  return lines;
}

}  // namespace loom::topo::detail
