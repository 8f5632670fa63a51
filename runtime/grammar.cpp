#include "runtime/grammar.h"

#include <algorithm>
#include <unordered_map>

#include "gguf/error.h"
#include "runtime/unicode.h"

namespace baton {

namespace {
constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr int kMaxRepeat = 10000;         // {m,n}: larger bounds are refused (each copy is an element)
constexpr int kMaxNesting = 200;          // parentheses (the parser recurses on them)
constexpr size_t kMaxStacks = 4096;       // ways to continue; more means a hopelessly ambiguous grammar
constexpr size_t kMaxExpanded = 1 << 18;  // the same before duplicates are dropped

[[noreturn]] void too_ambiguous() {
  fail(ErrorKind::Usage, "grammar: more than {} ways to continue at once (the grammar is too ambiguous)", kMaxStacks);
}
// Sorted, without duplicates, and not too many.
void dedup(std::vector<GrammarState::Stack>& v) {
  if (v.size() > 1) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
  }
  if (v.size() > kMaxStacks) too_ambiguous();
}
}  // namespace

// ---- parsing ----

class GrammarParser {
 public:
  GrammarParser(std::string_view src, Grammar& g) : s_(src), g_(g) {}

  void run(std::string_view start) {
    skip_space();
    while (pos_ < s_.size()) {
      const size_t head = pos_;
      std::string name = read_name();
      if (name.empty()) error(head, "expected a rule name at '{}'", excerpt(head));
      skip_space();
      if (s_.substr(pos_, 3) != "::=") error(pos_, "expected '::=' after the rule name '{}'", name);
      pos_ += 3;
      const uint32_t id = rule_id(name, head);
      if (defined_[id]) error(head, "rule '{}' is defined twice", name);
      defined_[id] = true;
      bodies_[id] = parse_alts(id, /*nested=*/false);
      skip_space();
    }
    for (uint32_t r = 0; r < bodies_.size(); r++)
      if (!defined_[r]) error(used_at_[r], "rule '{}' is used but never defined", g_.rules_[r].name);
    auto it = ids_.find(std::string(start));
    if (it == ids_.end()) fail(ErrorKind::Usage, "grammar: no '{}' rule to start from", start);
    g_.start_ = it->second;
    check_left_recursion();
    for (uint32_t r = 0; r < bodies_.size(); r++)
      for (const Seq& alt : bodies_[r]) {
        g_.rules_[r].alts.push_back(uint32_t(g_.elems_.size()));
        g_.elems_.insert(g_.elems_.end(), alt.begin(), alt.end());
        g_.elems_.push_back(Grammar::Elem{});
      }
  }

 private:
  using Elem = Grammar::Elem;
  using Seq = std::vector<Elem>;
  using Alts = std::vector<Seq>;

  template <class... Args>
  [[noreturn]] void error(size_t at, fmt::format_string<Args...> f, Args&&... args) const {
    const size_t line = size_t(std::count(s_.begin(), s_.begin() + std::min(at, s_.size()), '\n')) + 1;
    throw Error(ErrorKind::Usage, fmt::format("grammar line {}: {}", line, fmt::format(f, std::forward<Args>(args)...)));
  }
  std::string excerpt(size_t at) const {
    std::string_view v = s_.substr(at, 12);
    return std::string(v.substr(0, v.find('\n')));
  }

  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }
  std::string read_name() {
    const size_t b = pos_;
    while (pos_ < s_.size() && name_char(s_[pos_])) pos_++;
    return std::string(s_.substr(b, pos_ - b));
  }
  // Whitespace, newlines and # comments.
  void skip_space() {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        pos_++;
      } else if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') pos_++;
      } else {
        break;
      }
    }
  }
  // At `name ::=`: the sequence before it has ended.
  bool at_rule_head() {
    const size_t save = pos_;
    const bool head = !read_name().empty() && (skip_space(), s_.substr(pos_, 3) == "::=");
    pos_ = save;
    return head;
  }

  uint32_t add_rule(std::string name) {
    const uint32_t id = uint32_t(g_.rules_.size());
    g_.rules_.push_back({std::move(name), {}});
    bodies_.emplace_back();
    defined_.push_back(false);
    used_at_.push_back(0);
    generated_.push_back(0);
    parent_.push_back(-1);
    return id;
  }
  uint32_t rule_id(const std::string& name, size_t at) {
    auto [it, fresh] = ids_.try_emplace(name, 0);
    if (fresh) {
      it->second = add_rule(name);
      used_at_[it->second] = at;
    }
    return it->second;
  }
  // A rule for a group or a repetition inside `parent`, defined at once.
  uint32_t generated_rule(uint32_t parent, Alts body) {
    const uint32_t p = parent;  // add_rule may move the vectors
    std::string name = fmt::format("{}_{}", g_.rules_[p].name, ++generated_[p]);
    const uint32_t id = add_rule(std::move(name));
    bodies_[id] = std::move(body);
    defined_[id] = true;
    parent_[id] = int32_t(p);
    return id;
  }
  static Elem ref(uint32_t rule) { return Elem{Elem::Ref, false, rule, 0}; }
  Elem chars(std::vector<std::pair<uint32_t, uint32_t>> rs, bool negated) {
    Elem e{Elem::Chars, negated, uint32_t(g_.ranges_.size()), uint32_t(rs.size())};
    g_.ranges_.insert(g_.ranges_.end(), rs.begin(), rs.end());
    return e;
  }

  Alts parse_alts(uint32_t rule, bool nested) {
    Alts alts;
    alts.push_back(parse_seq(rule, nested));
    while (pos_ < s_.size() && s_[pos_] == '|') {
      pos_++;
      alts.push_back(parse_seq(rule, nested));
    }
    return alts;
  }

  Seq parse_seq(uint32_t rule, bool nested) {
    Seq seq;
    for (;;) {
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] == '|' || s_[pos_] == ')') break;
      if (at_rule_head()) {
        if (nested) error(pos_, "missing ')' before the next rule");
        break;
      }
      Seq atom = parse_atom(rule);
      while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t')) pos_++;
      if (pos_ < s_.size() && (s_[pos_] == '*' || s_[pos_] == '+' || s_[pos_] == '?' || s_[pos_] == '{'))
        atom = parse_repeat(rule, std::move(atom));
      seq.insert(seq.end(), atom.begin(), atom.end());
    }
    return seq;
  }

  Seq parse_atom(uint32_t rule) {
    const size_t at = pos_;
    const char c = s_[pos_];
    if (c == '"') {
      pos_++;
      Seq lit;
      for (;;) {
        if (pos_ >= s_.size()) error(at, "unterminated string literal");
        if (s_[pos_] == '"') { pos_++; break; }
        const uint32_t cp = read_char(at);
        lit.push_back(chars({{cp, cp}}, false));
      }
      return lit;
    }
    if (c == '[') {
      pos_++;
      bool negated = false;
      if (pos_ < s_.size() && s_[pos_] == '^') { negated = true; pos_++; }
      std::vector<std::pair<uint32_t, uint32_t>> rs;
      for (;;) {
        if (pos_ >= s_.size()) error(at, "unterminated character class");
        if (s_[pos_] == ']') { pos_++; break; }
        const uint32_t lo = read_char(at);
        uint32_t hi = lo;
        if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
          pos_++;
          hi = read_char(at);
          if (hi < lo) error(at, "character range {:#x}-{:#x} is backwards", lo, hi);
        }
        rs.push_back({lo, hi});
      }
      if (rs.empty() && !negated) error(at, "empty character class [] matches nothing");
      return {chars(std::move(rs), negated)};
    }
    if (c == '.') {
      pos_++;
      return {chars({}, true)};
    }
    if (c == '(') {
      pos_++;
      if (++depth_ > kMaxNesting) error(at, "parentheses nested more than {} deep", kMaxNesting);
      Alts body = parse_alts(rule, /*nested=*/true);
      depth_--;
      if (pos_ >= s_.size() || s_[pos_] != ')') error(at, "missing ')' for the '(' here");
      pos_++;
      return {ref(generated_rule(rule, std::move(body)))};
    }
    if (name_char(c)) return {ref(rule_id(read_name(), at))};
    error(at, "unexpected '{}'", excerpt(at));
  }

  // One character of a literal or a class: UTF-8 text or an escape.
  uint32_t read_char(size_t at) {
    if (s_[pos_] != '\\') {
      const uint8_t b = uint8_t(s_[pos_]);
      const size_t len = unicode::utf8_len(b);
      if (len > 1 && (pos_ + len > s_.size() || unicode::incomplete_utf8_tail(s_.substr(pos_, len)) != 0))
        error(at, "invalid UTF-8 in the grammar");
      return unicode::decode_one(s_, pos_);
    }
    if (++pos_ >= s_.size()) error(at, "a '\\' at the end of the grammar");
    const char e = s_[pos_++];
    auto hex = [&](int n) {
      uint32_t v = 0;
      for (int i = 0; i < n; i++, pos_++) {
        if (pos_ >= s_.size()) error(at, "\\{} needs {} hex digits", e, n);
        const char h = s_[pos_];
        int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
        if (d < 0) error(at, "\\{} needs {} hex digits", e, n);
        v = v * 16 + uint32_t(d);
      }
      if (v > kMaxCodePoint) error(at, "code point {:#x} is beyond U+10FFFF", v);
      return v;
    };
    switch (e) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case 'x': return hex(2);
      case 'u': return hex(4);
      case 'U': return hex(8);
      default:
        if (e == '\\' || e == '"' || e == '[' || e == ']' || e == '-' || e == '^' || e == '/' || e == '\'' || e == '.')
          return uint32_t(uint8_t(e));
        error(at, "unknown escape '\\{}'", e);
    }
  }

  // x*, x+, x?, x{m}, x{m,}, x{m,n}: rewritten as rules that call themselves on the right.
  Seq parse_repeat(uint32_t rule, Seq x) {
    const size_t at = pos_;
    if (x.size() != 1) x = {ref(generated_rule(rule, {x}))};  // a literal of several characters
    const Elem one = x[0];
    auto star = [&] {
      const uint32_t r = generated_rule(rule, {});
      bodies_[r] = {{one, ref(r)}, {}};
      return ref(r);
    };
    auto optional_chain = [&](int n) {  // up to n more: (x (x (x)?)?)?
      uint32_t inner = generated_rule(rule, {{one}, {}});
      for (int k = 1; k < n; k++) inner = generated_rule(rule, {{one, ref(inner)}, {}});
      return ref(inner);
    };
    const char c = s_[pos_++];
    if (c == '*') return {star()};
    if (c == '+') return {one, star()};
    if (c == '?') return {optional_chain(1)};
    auto number = [&] {
      while (pos_ < s_.size() && s_[pos_] == ' ') pos_++;
      const size_t b = pos_;
      long v = 0;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9' && v <= kMaxRepeat) v = v * 10 + (s_[pos_++] - '0');
      if (pos_ == b) error(at, "expected a number in {{m,n}}");
      if (v > kMaxRepeat) error(at, "repetition bound above {}", kMaxRepeat);
      while (pos_ < s_.size() && s_[pos_] == ' ') pos_++;
      return int(v);
    };
    const int m = number();
    int n = m;  // {m}
    if (pos_ < s_.size() && s_[pos_] == ',') {
      pos_++;
      while (pos_ < s_.size() && s_[pos_] == ' ') pos_++;
      n = pos_ < s_.size() && s_[pos_] == '}' ? -1 : number();  // {m,}: no upper bound
    }
    if (pos_ >= s_.size() || s_[pos_] != '}') error(at, "expected '}}' to close {{m,n}}");
    pos_++;
    if (n >= 0 && n < m) error(at, "repetition {{{},{}}} has its upper bound below the lower", m, n);
    Seq out(size_t(m), one);
    if (n < 0) out.push_back(star());
    else if (n > m) out.push_back(optional_chain(n - m));
    return out;
  }

  // A rule that can reach itself before reading a character would make the recognizer expand
  // forever (llama.cpp's format has the same limit): say which rule.
  void check_left_recursion() {
    const size_t n = bodies_.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; r++) {
        if (nullable[r]) continue;
        for (const Seq& alt : bodies_[r])
          if (std::all_of(alt.begin(), alt.end(), [&](const Elem& e) { return e.kind == Elem::Ref && nullable[e.a]; })) {
            nullable[r] = changed = true;
            break;
          }
      }
    }
    std::vector<std::vector<uint32_t>> first(n);  // rules called before any character is read
    for (size_t r = 0; r < n; r++)
      for (const Seq& alt : bodies_[r])
        for (const Elem& e : alt) {
          if (e.kind != Elem::Ref) break;
          first[r].push_back(e.a);
          if (!nullable[e.a]) break;
        }
    std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
    std::vector<std::pair<uint32_t, size_t>> path;  // (rule, next of its first[] to visit)
    for (uint32_t r0 = 0; r0 < n; r0++) {
      if (color[r0] != 0) continue;
      color[r0] = 1;
      path.push_back({r0, 0});
      while (!path.empty()) {
        auto& [r, next] = path.back();
        if (next == first[r].size()) {
          color[r] = 2;
          path.pop_back();
          continue;
        }
        const uint32_t t = first[r][next++];
        if (color[t] == 1 && parent_[t] >= 0)  // a rule the parser made for a group or a repetition
          fail(ErrorKind::Usage, "grammar: in rule '{}', a group or repetition can call itself before reading a "
                                 "character (left recursion; a repeated part that can match nothing, as ([a-z]*)*, "
                                 "does this): make each repeated part read at least one character",
               g_.rules_[size_t(parent_[t])].name);
        if (color[t] == 1)
          fail(ErrorKind::Usage, "grammar: rule '{}' can call itself before reading a character (left recursion); "
                                 "rewrite it to repeat on the right, e.g. list ::= item (\",\" item)*",
               g_.rules_[t].name);
        if (color[t] == 0) {
          color[t] = 1;
          path.push_back({t, 0});
        }
      }
    }
  }

  std::string_view s_;
  size_t pos_ = 0;
  Grammar& g_;
  std::unordered_map<std::string, uint32_t> ids_;
  std::vector<Alts> bodies_;
  std::vector<bool> defined_;
  std::vector<size_t> used_at_;    // where a rule was first named (for "never defined")
  std::vector<int> generated_;     // generated rules per parent so far (their names' suffix)
  std::vector<int32_t> parent_;    // the rule a generated rule was made in (-1: the user's own)
  int depth_ = 0;                  // parentheses open
};

std::shared_ptr<const Grammar> Grammar::parse(std::string_view text, std::string_view start) {
  auto g = std::make_shared<Grammar>();
  GrammarParser(text, *g).run(start);
  return g;
}

bool Grammar::matches(const Elem& e, uint32_t cp) const {
  bool in = false;
  for (uint32_t i = e.a; i < e.a + e.b && !in; i++) in = ranges_[i].first <= cp && cp <= ranges_[i].second;
  return in != e.negated;
}

bool Grammar::matches_some(const Elem& e, uint32_t lo, uint32_t hi) const {
  if (!e.negated) {
    for (uint32_t i = e.a; i < e.a + e.b; i++)
      if (ranges_[i].first <= hi && lo <= ranges_[i].second) return true;
    return false;
  }
  // Negated: some code point of lo..hi lies outside every range. Walk up from lo past ranges.
  for (uint32_t cp = lo;;) {
    bool moved = false;
    for (uint32_t i = e.a; i < e.a + e.b; i++)
      if (ranges_[i].first <= cp && cp <= ranges_[i].second) {
        if (ranges_[i].second >= hi) return false;
        cp = ranges_[i].second + 1;
        moved = true;
      }
    if (!moved) return true;
  }
}

// ---- recognizing ----

GrammarState::GrammarState(std::shared_ptr<const Grammar> g) : g_(std::move(g)) {
  for (uint32_t alt : g_->rules()[g_->start()].alts) expand(Stack{alt}, stacks_);
  dedup(stacks_);
}

// Follows calls and returns from the top position until it stands at characters (or the stack is
// empty: the start rule is complete). A call whose continuation is the end of its alternative
// replaces its frame instead of stacking it, so `x*` keeps a flat stack however long it runs.
void GrammarState::expand(Stack s, std::vector<Stack>& out) const {
  const auto& elems = g_->elems();
  // The other alternatives of each call wait in a work list (not in recursion: a chain of nested
  // optional rules, x{0,5000} with x nullable, opens thousands of them at once).
  std::vector<Stack> work;
  for (;;) {
    for (;;) {
      if (s.empty()) break;
      const Grammar::Elem& e = elems[s.back()];
      if (e.kind == Grammar::Elem::Chars) break;
      if (e.kind == Grammar::Elem::End) {
        s.pop_back();
        continue;
      }
      const uint32_t cont = s.back() + 1;
      s.pop_back();
      if (elems[cont].kind != Grammar::Elem::End) s.push_back(cont);
      const auto& alts = g_->rules()[e.a].alts;
      for (size_t i = 0; i + 1 < alts.size(); i++) {
        work.push_back(s);
        work.back().push_back(alts[i]);
      }
      s.push_back(alts.back());
    }
    if (out.size() >= kMaxExpanded) too_ambiguous();
    out.push_back(std::move(s));
    if (work.empty()) return;
    s = std::move(work.back());
    work.pop_back();
  }
}

void GrammarState::advance(const std::vector<Stack>& in, uint32_t cp, std::vector<Stack>& out) const {
  out.clear();
  const auto& elems = g_->elems();
  for (const Stack& s : in) {
    if (s.empty() || !g_->matches(elems[s.back()], cp)) continue;
    Stack t = s;
    t.back()++;
    expand(std::move(t), out);
  }
  dedup(out);
}

namespace {
constexpr uint32_t kMinOfLength[5] = {0, 0, 0x80, 0x800, 0x10000};  // shorter forms are overlong

// One byte of UTF-8 into u: false when it cannot come here. u.left > 0 afterwards: the character
// is unfinished; u.left == 0: u.cp is a whole, valid code point.
bool utf8_byte(uint8_t b, GrammarState::Utf8& u) {
  if (u.left == 0) {
    if (b < 0x80) { u.cp = b; u.len = 1; return true; }
    if ((b & 0xE0) == 0xC0) { u.cp = b & 0x1Fu; u.len = 2; }
    else if ((b & 0xF0) == 0xE0) { u.cp = b & 0x0Fu; u.len = 3; }
    else if ((b & 0xF8) == 0xF0) { u.cp = b & 0x07u; u.len = 4; }
    else return false;  // a continuation byte or 0xF8..0xFF: not the start of a character
    u.left = uint8_t(u.len - 1);
  } else {
    if ((b & 0xC0) != 0x80) return false;
    u.cp = (u.cp << 6) | (b & 0x3Fu);
    u.left--;
  }
  if (u.left > 0) return true;
  return u.cp >= kMinOfLength[u.len] && u.cp <= kMaxCodePoint && !(u.cp >= 0xD800 && u.cp <= 0xDFFF);
}
}  // namespace

// An unfinished character is fine when something accepts one of its valid completions.
bool GrammarState::partial_ok(const std::vector<Stack>& stacks, const Utf8& u) const {
  if (u.left == 0) return true;
  const uint32_t lo = std::max(u.cp << (6 * u.left), kMinOfLength[u.len]);
  const uint32_t hi = std::min((u.cp << (6 * u.left)) | ((1u << (6 * u.left)) - 1), kMaxCodePoint);
  if (lo > hi) return false;
  const auto& elems = g_->elems();
  return std::any_of(stacks.begin(), stacks.end(),
                     [&](const Stack& s) { return !s.empty() && g_->matches_some(elems[s.back()], lo, hi); });
}

// Runs `bytes` through: `stacks` and the partial character are updated in place.
bool GrammarState::step(std::string_view bytes, std::vector<Stack>& stacks, Utf8& u) const {
  std::vector<Stack> next;
  for (const char ch : bytes) {
    if (!utf8_byte(uint8_t(ch), u)) return false;
    if (u.left > 0) continue;
    advance(stacks, u.cp, next);
    if (next.empty()) return false;
    stacks.swap(next);
  }
  return partial_ok(stacks, u);
}

TokenTrie::TokenTrie(const std::vector<std::string_view>& pieces) {
  // Sorted by bytes (unsigned, as char_traits<char> compares). A vocabulary of 262k tokens sorts
  // ~4x faster on the first 8 bytes as one big-endian integer, the rest only on ties: a smaller
  // key means a smaller string, zero padding included.
  struct Keyed {
    uint64_t key;
    std::string_view piece;
    int32_t id;
  };
  std::vector<Keyed> keyed;
  keyed.reserve(pieces.size());
  for (size_t i = 0; i < pieces.size(); i++) {
    if (pieces[i].empty()) continue;
    uint64_t key = 0;
    for (size_t k = 0; k < 8; k++) key = key << 8 | (k < pieces[i].size() ? uint8_t(pieces[i][k]) : 0u);
    keyed.push_back({key, pieces[i], int32_t(i)});
  }
  std::sort(keyed.begin(), keyed.end(), [](const Keyed& a, const Keyed& b) {
    if (a.key != b.key) return a.key < b.key;
    return a.piece != b.piece ? a.piece < b.piece : a.id < b.id;
  });
  entries_.reserve(keyed.size());
  for (const Keyed& k : keyed) entries_.push_back({k.piece, k.id});
}

// entries [lo, hi) share their first `depth` bytes, which leave the grammar at (stacks, cp, left);
// the ones exactly `depth` long come first and are whole tokens the grammar accepts.
void GrammarState::collect(const TokenTrie& trie, size_t lo, size_t hi, size_t depth, const std::vector<Stack>& stacks,
                           const Utf8& u, std::vector<int32_t>& out) const {
  const auto& e = trie.entries();
  for (; lo < hi && e[lo].first.size() == depth; lo++) out.push_back(e[lo].second);
  std::vector<Stack> next;
  while (lo < hi) {
    const uint8_t b = uint8_t(e[lo].first[depth]);
    const size_t end = size_t(std::partition_point(e.begin() + ptrdiff_t(lo), e.begin() + ptrdiff_t(hi), [&](const auto& x) {
                                return uint8_t(x.first[depth]) == b;
                              }) - e.begin());
    Utf8 u2 = u;
    if (utf8_byte(b, u2)) {
      if (u2.left > 0) {
        if (partial_ok(stacks, u2)) collect(trie, lo, end, depth + 1, stacks, u2, out);
      } else {
        advance(stacks, u2.cp, next);
        if (!next.empty()) collect(trie, lo, end, depth + 1, next, u2, out);
      }
    }
    lo = end;
  }
}

void GrammarState::allowed(const TokenTrie& trie, std::vector<int32_t>& out) const {
  out.clear();
  collect(trie, 0, trie.entries().size(), 0, stacks_, partial_, out);
}

bool GrammarState::allows(std::string_view bytes) const {
  if (bytes.empty()) return false;
  // Most candidates fail on their first character: test it before copying anything.
  const uint8_t b0 = uint8_t(bytes[0]);
  if (partial_.left == 0 && b0 < 0x80) {
    const auto& elems = g_->elems();
    if (std::none_of(stacks_.begin(), stacks_.end(),
                     [&](const Stack& s) { return !s.empty() && g_->matches(elems[s.back()], b0); }))
      return false;
  }
  scratch_ = stacks_;
  Utf8 u = partial_;
  return step(bytes, scratch_, u);
}

bool GrammarState::accept(std::string_view bytes) {
  if (bytes.empty()) return false;
  std::vector<Stack> stacks = stacks_;
  Utf8 u = partial_;
  if (!step(bytes, stacks, u)) return false;
  stacks_.swap(stacks);
  partial_ = u;
  return true;
}

bool GrammarState::complete() const {
  return partial_.left == 0 && std::any_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

bool GrammarState::finished() const { return partial_.left == 0 && stacks_.size() == 1 && stacks_[0].empty(); }

}  // namespace baton
