#include "runtime/regex_gbnf.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gguf/error.h"
#include "runtime/unicode.h"

namespace baton {

namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;
constexpr uint32_t kMax = 0x10FFFF;

// Sorted, merged ranges; the complement within 0..U+10FFFF.
Ranges normalized(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& x : r) {
    if (!out.empty() && x.first <= out.back().second + 1) out.back().second = std::max(out.back().second, x.second);
    else out.push_back(x);
  }
  return out;
}
Ranges complement(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (const auto& x : normalized(r)) {
    if (x.first > next) out.push_back({next, x.first - 1});
    next = x.second + 1;
  }
  if (next <= kMax) out.push_back({next, kMax});
  return out;
}

std::string class_char(uint32_t cp) {
  if ((cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return std::string(1, char(cp));
  return cp <= 0xFFFF ? fmt::format("\\u{:04x}", cp) : fmt::format("\\U{:08x}", cp);
}

std::string class_range(uint32_t a, uint32_t b) {
  return a == b ? class_char(a) : fmt::format("{}-{}", class_char(a), class_char(b));
}

// A set of code points as GBNF for JSON string content: plain characters in a class, the ones
// JSON escapes ('"', '\\', controls) as their escapes.
std::string json_chars(const Ranges& set) {
  std::string cls;
  std::vector<std::string> alts;
  for (const auto& [lo, hi] : normalized(set)) {
    for (uint32_t c = lo; c <= std::min(hi, 0x1Fu); c++) {
      static const char* named[] = {"\\\\b", "\\\\t", "\\\\n", nullptr, "\\\\f", "\\\\r"};
      if (c >= 8 && c <= 13 && named[c - 8]) alts.push_back(fmt::format("\"{}\"", named[c - 8]));
      else alts.push_back(fmt::format("\"\\\\u{:04x}\"", c));
    }
    // Plain characters: the range without the controls, '"' (0x22) and '\\' (0x5C).
    uint32_t a = std::max(lo, 0x20u);
    for (const uint32_t skip : {0x22u, 0x5Cu}) {
      if (skip < a || skip > hi) continue;
      if (skip > a) cls += class_range(a, skip - 1);
      alts.push_back(skip == 0x22 ? "\"\\\\\\\"\"" : "\"\\\\\\\\\"");
      a = skip + 1;
    }
    if (a <= hi) cls += class_range(a, hi);
  }
  if (!cls.empty()) alts.insert(alts.begin(), "[" + cls + "]");
  if (alts.empty()) return "";
  return alternation(alts);
}

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const Ranges kSpace = {{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                       {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};

class RegexParser {
 public:
  explicit RegexParser(std::string_view re) : re_(re) {}

  std::string run() {
    bool start = false, end = false;
    if (!re_.empty() && re_[0] == '^') { start = true; pos_ = 1; }
    std::string body = alternatives();
    if (pos_ < re_.size() && re_[pos_] == '$' && pos_ + 1 == re_.size()) { end = true; pos_++; }
    if (pos_ < re_.size()) unsupported(re_[pos_] == ')' ? "an unmatched ')'" : fmt::format("'{}' here", re_[pos_]));
    // Unanchored ends: anything may come before or after the match.
    if (!start) body = "json-char* " + body;
    if (!end) body += " json-char*";
    return body;
  }

 private:
  [[noreturn]] void unsupported(const std::string& what) const {
    fail(ErrorKind::Usage, "pattern /{}/: {} is not supported (at offset {})", re_, what, pos_);
  }
  bool at(char c) const { return pos_ < re_.size() && re_[pos_] == c; }

  std::string alternatives() {
    std::vector<std::string> alts = {sequence()};
    while (at('|')) {
      pos_++;
      alts.push_back(sequence());
    }
    if (alts.size() == 1) return alts[0].empty() ? "\"\"" : alts[0];
    for (auto& a : alts)
      if (a.empty()) a = "\"\"";
    return alternation(alts);
  }

  std::string sequence() {
    std::string out;
    while (pos_ < re_.size() && !at('|') && !at(')')) {
      if (at('$') && pos_ + 1 == re_.size()) break;  // the end anchor, taken by run()
      std::string a = atom();
      a = quantified(std::move(a));
      out += (out.empty() ? "" : " ") + a;
    }
    return out;
  }

  std::string quantified(std::string a) {
    if (pos_ >= re_.size()) return a;
    std::string q;
    const char c = re_[pos_];
    if (c == '*' || c == '+' || c == '?') {
      q = std::string(1, c);
      pos_++;
    } else if (c == '{') {
      const size_t close = re_.find('}', pos_);
      const std::string_view body = close == std::string_view::npos ? "" : re_.substr(pos_ + 1, close - pos_ - 1);
      const bool ok = !body.empty() && body.find_first_not_of("0123456789,") == std::string_view::npos &&
                      body[0] != ',' && std::count(body.begin(), body.end(), ',') <= 1;
      if (!ok) return a;  // ECMA reads a brace that is no quantifier as a literal; atom() will take it
      q = fmt::format("{{{}}}", body);
      pos_ = close + 1;
    } else {
      return a;
    }
    if (at('?')) pos_++;  // lazy: the same strings
    if (at('+') || at('*') || at('{')) unsupported("a quantifier after a quantifier");
    return "( " + a + " )" + q;
  }

  uint32_t read_code_point() {
    const size_t before = pos_;
    const uint8_t b = uint8_t(re_[pos_]);
    if (b < 0x80) { pos_++; return b; }
    const uint32_t cp = unicode::decode_one(re_, pos_);
    if (pos_ == before + 1) unsupported("invalid UTF-8");
    return cp;
  }

  uint32_t hex(int n) {
    uint32_t v = 0;
    for (int i = 0; i < n; i++, pos_++) {
      if (pos_ >= re_.size()) unsupported("a short hex escape");
      const char h = re_[pos_];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) unsupported("a short hex escape");
      v = v * 16 + uint32_t(d);
    }
    return v;
  }

  // After a backslash: one character, or a class (\d \w \s, \D \W \S when negation is allowed).
  Ranges escape(bool in_class) {
    if (pos_ >= re_.size()) unsupported("a '\\' at the end");
    const char e = re_[pos_++];
    switch (e) {
      case 'd': return kDigit;
      case 'w': return kWord;
      case 's': return kSpace;
      case 'D': case 'W': case 'S':
        if (in_class) unsupported(fmt::format("\\{} inside a class", e));
        return complement(e == 'D' ? kDigit : e == 'W' ? kWord : kSpace);
      case 'n': return {{'\n', '\n'}};
      case 't': return {{'\t', '\t'}};
      case 'r': return {{'\r', '\r'}};
      case 'f': return {{'\f', '\f'}};
      case 'v': return {{'\v', '\v'}};
      case '0': return {{0, 0}};
      case 'x': { const uint32_t v = hex(2); return {{v, v}}; }
      case 'u': { const uint32_t v = hex(4); return {{v, v}}; }
      default:
        if (std::string_view("\\^$.|?*+()[]{}/-").find(e) != std::string_view::npos) return {{uint32_t(e), uint32_t(e)}};
        unsupported(fmt::format("the escape \\{}", e));
    }
  }

  std::string atom() {
    const char c = re_[pos_];
    if (c == '(') {
      pos_++;
      if (at('?')) {
        if (re_.substr(pos_, 2) != "?:") unsupported("'(?' (lookaround, named groups)");
        pos_ += 2;
      }
      std::string inner = alternatives();
      if (!at(')')) unsupported("a '(' without its ')'");
      pos_++;
      return "( " + inner + " )";
    }
    if (c == '[') return char_class();
    if (c == '.') {
      pos_++;
      return json_chars(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
    }
    if (c == '\\') {
      pos_++;
      if (at('b') || at('B')) unsupported("a word boundary");
      if (pos_ < re_.size() && re_[pos_] >= '1' && re_[pos_] <= '9') unsupported("a backreference");
      if (at('p') || at('P')) unsupported("a Unicode property escape");
      return json_chars(escape(false));
    }
    if (c == '^' || c == '$') unsupported(fmt::format("'{}' inside the pattern", c));
    if (c == '*' || c == '+' || c == '?') unsupported(fmt::format("'{}' with nothing to repeat", c));
    const uint32_t cp = read_code_point();
    return json_chars({{cp, cp}});
  }

  std::string char_class() {
    pos_++;  // '['
    bool negated = false;
    if (at('^')) { negated = true; pos_++; }
    Ranges set;
    bool first = true;
    for (;;) {
      if (pos_ >= re_.size()) unsupported("a '[' without its ']'");
      if (at(']') && !first) { pos_++; break; }
      first = false;
      Ranges item;
      if (at('\\')) { pos_++; item = escape(true); }
      else item = {{read_code_point(), 0}}, item[0].second = item[0].first;
      if (item.size() == 1 && item[0].first == item[0].second && at('-') && pos_ + 1 < re_.size() && re_[pos_ + 1] != ']') {
        pos_++;
        Ranges hi_item;
        if (at('\\')) { pos_++; hi_item = escape(true); }
        else hi_item = {{read_code_point(), 0}}, hi_item[0].second = hi_item[0].first;
        if (hi_item.size() != 1 || hi_item[0].first != hi_item[0].second) unsupported("a range ending in a class");
        if (hi_item[0].first < item[0].first) unsupported("a backwards range");
        item[0].second = hi_item[0].first;
      }
      set.insert(set.end(), item.begin(), item.end());
    }
    if (negated) set = complement(set);
    const std::string g = json_chars(set);
    if (g.empty()) unsupported("a class that matches nothing");
    return g;
  }

  std::string_view re_;
  size_t pos_ = 0;
};

}  // namespace

std::string regex_to_gbnf(std::string_view pattern) { return RegexParser(pattern).run(); }

std::string alternation(const std::vector<std::string>& alts) {
  return alts.size() == 1 ? alts[0] : fmt::format("( {} )", fmt::join(alts, " | "));
}

}  // namespace baton
