#include "topology/xml_scan.h"

#include "loom/topology/topology.h"

namespace loom::topo::detail {

const std::string* XmlElement::attribute(std::string_view key) const {
  for (const auto& [k, v] : attributes)
    if (k == key) return &v;
  return nullptr;
}

namespace {

class XmlReader {
 public:
  XmlReader(std::string_view text, const std::string& source) : text_(text), source_(source) {}

  XmlElement document() {
    skip_misc();
    if (!starts_with("<") || starts_with("</")) fail("expected the root element (<system ...>), found " + found());
    XmlElement root = element(1);
    skip_misc();
    if (pos_ < text_.size()) fail("expected the end of the document after </" + root.name + ">, found " + found());
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const { fail_at(pos_, message); }

  [[noreturn]] void fail_at(size_t at, const std::string& message) const {
    // Line and column of `at`, computed on the error path only.
    int line = 1, column = 1;
    for (size_t i = 0; i < at && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw ParseError(source_, line, column, message);
  }

  std::string found() const {
    if (pos_ >= text_.size()) return "the end of the text";
    std::string s = "'";
    for (size_t i = pos_; i < text_.size() && i < pos_ + 20 && text_[i] != '\n'; ++i)
      s += (static_cast<unsigned char>(text_[i]) < 0x20) ? '?' : text_[i];
    return s + "'";
  }

  bool starts_with(std::string_view s) const { return text_.substr(pos_).substr(0, s.size()) == s; }
  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  static bool space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }
  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.' || c == ':';
  }
  void skip_space() {
    while (!at_end() && space(text_[pos_])) ++pos_;
  }

  // Whitespace, comments and the XML declaration between elements.
  void skip_misc() {
    for (;;) {
      skip_space();
      if (starts_with("<!--")) {
        size_t end = text_.find("-->", pos_ + 4);
        if (end == std::string_view::npos) fail("expected '-->' to close this comment, found the end of the text");
        pos_ = end + 3;
      } else if (starts_with("<?")) {
        size_t end = text_.find("?>", pos_ + 2);
        if (end == std::string_view::npos) fail("expected '?>' to close this declaration, found the end of the text");
        pos_ = end + 2;
      } else if (starts_with("<!")) {
        fail("expected an element, found a DTD or CDATA section (not supported)");
      } else {
        return;
      }
    }
  }

  std::string name() {
    size_t start = pos_;
    while (!at_end() && name_char(text_[pos_])) ++pos_;
    if (pos_ == start) fail("expected a name, found " + found());
    return std::string(text_.substr(start, pos_ - start));
  }

  std::string attribute_value() {
    char quote = peek();
    if (quote != '"' && quote != '\'') fail("expected a quoted attribute value, found " + found());
    ++pos_;
    std::string value;
    for (;;) {
      if (at_end()) fail("expected the closing quote of this attribute value, found the end of the text");
      char c = text_[pos_];
      if (c == quote) {
        ++pos_;
        return value;
      }
      if (c == '<') fail("expected the closing quote of this attribute value, found '<'");
      if (c == '&') {
        value += entity();
        continue;
      }
      value += c;
      ++pos_;
    }
  }

  std::string entity() {
    size_t end = text_.find(';', pos_);
    if (end == std::string_view::npos || end - pos_ > 10) fail("expected an entity such as &amp;, found " + found());
    std::string_view e = text_.substr(pos_ + 1, end - pos_ - 1);
    std::string out;
    if (e == "amp")
      out = "&";
    else if (e == "lt")
      out = "<";
    else if (e == "gt")
      out = ">";
    else if (e == "quot")
      out = "\"";
    else if (e == "apos")
      out = "'";
    else if (e.size() > 1 && e[0] == '#') {
      unsigned long code = 0;
      bool hex = e[1] == 'x';
      std::string_view digits = e.substr(hex ? 2 : 1);
      if (digits.empty()) fail("expected a character reference such as &#38;, found " + found());
      for (char c : digits) {
        int d = (c >= '0' && c <= '9')        ? c - '0'
                : hex && c >= 'a' && c <= 'f' ? c - 'a' + 10
                : hex && c >= 'A' && c <= 'F' ? c - 'A' + 10
                                              : -1;
        if (d < 0) fail("expected a character reference such as &#38;, found " + found());
        code = code * (hex ? 16 : 10) + d;
      }
      if (code == 0 || code > 0x7f) fail("expected an ASCII character reference, found " + found());
      out = std::string(1, static_cast<char>(code));
    } else {
      fail("expected an entity such as &amp;, found " + found());
    }
    pos_ = end + 1;
    return out;
  }

  XmlElement element(int depth) {
    if (depth > kMaxXmlDepth)
      fail("elements nested deeper than " + std::to_string(kMaxXmlDepth) + ": exceeds the limit (docs/limits.md)");
    if (++elements_ > kMaxXmlElements)
      fail("more than " + std::to_string(kMaxXmlElements) + " elements: exceeds the limit (docs/limits.md)");
    XmlElement e;
    // Where the start tag is, for later messages: counted incrementally (start tags only move forward).
    for (; line_scan_pos_ < pos_; ++line_scan_pos_) {
      if (text_[line_scan_pos_] == '\n') {
        ++line_at_;
        column_at_ = 1;
      } else {
        ++column_at_;
      }
    }
    e.line = line_at_;
    e.column = column_at_;
    ++pos_;  // '<'
    e.name = name();
    for (;;) {
      size_t before = pos_;
      skip_space();
      if (starts_with("/>")) {
        pos_ += 2;
        return e;
      }
      if (peek() == '>') {
        ++pos_;
        break;
      }
      if (pos_ == before) fail("expected whitespace, '>' or '/>' in <" + e.name + ">, found " + found());
      const size_t key_at = pos_;
      std::string key = name();
      skip_space();
      if (peek() != '=') fail("expected '=' after attribute '" + key + "', found " + found());
      ++pos_;
      skip_space();
      // Bounded per element, so the duplicate check (a scan of the element's attributes) stays linear.
      if (e.attributes.size() >= static_cast<size_t>(kMaxXmlAttributes))
        fail_at(key_at, "<" + e.name + "> has more than " + std::to_string(kMaxXmlAttributes) +
                            " attributes: exceeds the limit (docs/limits.md)");
      if (++attributes_ > kMaxXmlAttributesTotal)
        fail_at(key_at, "the document has more than " + std::to_string(kMaxXmlAttributesTotal) +
                            " attributes: exceeds the limit (docs/limits.md)");
      if (e.attribute(key)) fail_at(key_at, "attribute '" + key + "' given twice in <" + e.name + ">");
      e.attributes.emplace_back(std::move(key), attribute_value());
    }
    // Content: child elements, comments, ignored text, then the matching end tag.
    for (;;) {
      while (!at_end() && text_[pos_] != '<') ++pos_;
      if (at_end()) fail("expected </" + e.name + ">, found the end of the text");
      if (starts_with("<!--") || starts_with("<?") || starts_with("<!")) {
        skip_misc();
        continue;
      }
      if (starts_with("</")) {
        const size_t tag_at = pos_;
        pos_ += 2;
        std::string closing = name();
        if (closing != e.name) fail_at(tag_at, "expected </" + e.name + ">, found </" + closing + ">");
        skip_space();
        if (peek() != '>') fail("expected '>' to end </" + e.name + ">, found " + found());
        ++pos_;
        return e;
      }
      e.children.push_back(element(depth + 1));
    }
  }

  std::string_view text_;
  const std::string& source_;
  size_t pos_ = 0;
  int elements_ = 0;
  int attributes_ = 0;
  size_t line_scan_pos_ = 0;
  int line_at_ = 1;
  int column_at_ = 1;
};

}  // namespace

XmlElement parse_xml(std::string_view text, const std::string& source) {
  return XmlReader(text, source).document();
}

}  // namespace loom::topo::detail
