// Splits text into numbered lines and whitespace-separated tokens that remember their column, so
// parsers can report "line 4, column 23". Internal to the topology parsers.
#pragma once

#include <string_view>
#include <vector>

namespace loom::topo::detail {

struct Token {
  std::string_view text;
  int column = 0;  // 1-based byte column in the line (a tab counts as one)
  int end_column() const { return column + static_cast<int>(text.size()); }
};

struct TextLine {
  int number = 0;         // 1-based
  std::string_view text;  // without the line ending (LF, CRLF or a lone CR)
  std::vector<Token> tokens;
  bool blank() const { return tokens.empty(); }
};

// Every line of `text`; tokens are runs of characters other than space, tab, CR, VT and FF.
std::vector<TextLine> split_lines(std::string_view text);

}  // namespace loom::topo::detail
