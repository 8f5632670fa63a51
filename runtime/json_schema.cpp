#include "runtime/json_schema.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "runtime/regex_gbnf.h"
#include "runtime/unicode.h"

namespace baton {

namespace {

using json = nlohmann::ordered_json;

// The JSON building blocks every schema grammar shares. Between tokens: nothing, one space, or a
// newline and some indentation (never runs of blank lines); numbers of at most 16 digits and
// exponents of two (so that every number fits a double); \u escapes of lone surrogates (D800-DFFF)
// are not JSON a strict parser takes, so there are none.
constexpr const char* kJsonRules = R"GBNF(ws ::= ( " " | "\n" [ \t]{0,24} )?
json-value ::= json-object | json-array | json-string | json-number | json-bool | json-null
json-object ::= "{" ws ( json-member ( "," ws json-member )* )? "}"
json-member ::= json-string ws ":" ws json-value ws
json-array ::= "[" ws ( json-value ws ( "," ws json-value ws )* )? "]"
json-string ::= "\"" json-char* "\""
json-char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" json-u4 )
json-u4 ::= [0-9a-cA-CefEF] json-hex3 | [dD] [0-7] [0-9a-fA-F]{2}
json-hex3 ::= [0-9a-fA-F]{3}
json-int ::= "-"? json-natural
json-natural ::= "0" | [1-9] [0-9]{0,15}
json-number ::= json-int ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,2} )?
json-bool ::= "true" | "false"
json-null ::= "null"
)GBNF";

// JSON text as a GBNF literal.
std::string literal(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto u = uint8_t(c);
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else if (u < 0x20) out += fmt::format("\\x{:02x}", u);
    else out += c;
  }
  return out + "\"";
}

// Alternatives of fixed texts as a tree on their common prefixes, so that reading a character
// never leaves more than one way on (an enum of 10,000 integers is one path, not 10,000). A run
// of characters all the words under a branch share is one literal: the recursion only goes as
// deep as the branch points, never as long as the words.
std::string trie(const std::vector<std::string>& sorted_words, size_t depth = 0) {
  std::vector<std::string> alts;
  bool may_end = false;
  for (size_t i = 0; i < sorted_words.size();) {
    const std::string& w = sorted_words[i];
    if (w.size() == depth) { may_end = true; i++; continue; }
    // The words starting with w's next character (whole: literals never split a character).
    const size_t clen = std::min(unicode::utf8_len(uint8_t(w[depth])), w.size() - depth);
    size_t j = i;
    while (j < sorted_words.size() && sorted_words[j].compare(depth, clen, w, depth, clen) == 0) j++;
    // What they all share: the first and the last agree on it (they are sorted).
    const std::string& last = sorted_words[j - 1];
    size_t shared = clen;
    for (;;) {
      if (depth + shared >= w.size() || depth + shared >= last.size()) break;
      const size_t n = unicode::utf8_len(uint8_t(w[depth + shared]));
      if (last.compare(depth + shared, n, w, depth + shared, n) != 0) break;
      shared = std::min(shared + n, w.size() - depth);
    }
    const std::vector<std::string> group(sorted_words.begin() + ptrdiff_t(i), sorted_words.begin() + ptrdiff_t(j));
    const std::string rest = trie(group, depth + shared);
    alts.push_back(literal(w.substr(depth, shared)) + (rest.empty() ? "" : " " + rest));
    i = j;
  }
  if (alts.empty()) return "";
  std::string body = alternation(alts);
  if (may_end) body = "( " + body + " )?";
  return body;
}

std::string trie_of(std::vector<std::string> words) {
  std::sort(words.begin(), words.end());
  words.erase(std::unique(words.begin(), words.end()), words.end());
  return trie(words);
}

const std::set<std::string> kAnnotations = {"title", "description", "default", "examples", "$comment", "$schema",
                                            "$id", "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
                                            "contentMediaType", "contentEncoding"};

class SchemaGrammar {
 public:
  explicit SchemaGrammar(const json& root) : root_(root) {}

  std::string run() {
    const std::string top = visit(root_, "#", "value");
    std::string out = "root ::= " + top + "\n";
    for (const auto& [name, body] : rules_) out += name + " ::= " + body + "\n";
    return out + kJsonRules;
  }

 private:
  template <class... Args>
  [[noreturn]] static void error(const std::string& at, fmt::format_string<Args...> f, Args&&... args) {
    throw Error(ErrorKind::Usage, fmt::format("JSON schema at {}: {}", at, fmt::format(f, std::forward<Args>(args)...)));
  }

  // A fresh rule name from a hint (property names can be anything: keep letters and digits).
  std::string name(const std::string& hint) {
    std::string base;
    for (const char c : hint)
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) base += c;
      else if (!base.empty() && base.back() != '-') base += '-';
    while (!base.empty() && base.back() == '-') base.pop_back();
    if (base.empty() || base == "ws" || base.rfind("json", 0) == 0) base = "s-" + base;
    std::string n = base;
    for (int i = 2; taken_.count(n); i++) n = fmt::format("{}-{}", base, i);
    taken_.insert(n);
    return n;
  }
  std::string define(const std::string& hint, const std::string& body) {
    const std::string n = name(hint);
    rules_.emplace_back(n, body);
    return n;
  }

  // A rule for schema `s` (found at `at`); returns the rule's name or a primitive's.
  std::string visit(const json& s, const std::string& at, const std::string& hint) {
    struct Depth {
      int& d;
      explicit Depth(int& x) : d(++x) {}
      ~Depth() { d--; }
    } depth(depth_);
    if (depth_ > 64) error(at, "schemas nested more than 64 deep are not supported");
    if (s.is_boolean()) {
      if (!s.get<bool>()) error(at, "'false' accepts no value at all");
      return "json-value";
    }
    if (!s.is_object()) error(at, "a schema must be an object or a boolean");
    for (const auto& [key, v] : s.items()) {
      static const std::set<std::string> known = {
          "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum",
          "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "format", "minimum", "maximum",
          "exclusiveMinimum", "exclusiveMaximum", "pattern"};
      if (!known.count(key) && !kAnnotations.count(key)) error(at, "'{}' is not supported", key);
    }
    if (s.contains("$ref")) return ref(s, at);
    if (s.contains("const")) return define(hint, literal(s["const"].dump()));
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty()) error(at, "'enum' must be a non-empty array");
      std::vector<std::string> texts;
      for (const json& v : s["enum"]) texts.push_back(v.dump());
      return define(hint, trie_of(texts));
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (s.contains(key)) {
        if (!s[key].is_array() || s[key].empty()) error(at, "'{}' must be a non-empty array", key);
        std::vector<std::string> alts;
        for (size_t i = 0; i < s[key].size(); i++)
          alts.push_back(visit(s[key][i], fmt::format("{}/{}/{}", at, key, i), hint));
        return define(hint, fmt::format("{}", fmt::join(alts, " | ")));
      }
    if (s.contains("allOf")) {
      if (!s["allOf"].is_array() || s["allOf"].size() != 1) error(at, "'allOf' is supported with one schema only");
      return visit(s["allOf"][0], at + "/allOf/0", hint);
    }
    if (!s.contains("type")) {
      if (s.contains("properties") || s.contains("additionalProperties")) return object(s, at, hint);
      if (s.contains("items")) return array(s, at, hint);
      return "json-value";  // {}: anything
    }
    const json& t = s["type"];
    if (t.is_string()) return typed(t.get<std::string>(), s, at, hint);
    if (!t.is_array() || t.empty()) error(at, "'type' must be a string or a non-empty array of strings");
    std::vector<std::string> alts;
    for (const json& x : t) {
      if (!x.is_string()) error(at, "'type' must be a string or a non-empty array of strings");
      alts.push_back(typed(x.get<std::string>(), s, at, hint));
    }
    return define(hint, fmt::format("{}", fmt::join(alts, " | ")));
  }

  std::string typed(const std::string& type, const json& s, const std::string& at, const std::string& hint) {
    if (type == "object") return object(s, at, hint);
    if (type == "array") return array(s, at, hint);
    if (type == "string") return string(s, at, hint);
    if (type == "integer") return integer(s, at, hint);
    if (type == "number") return number(s, at, hint);
    if (type == "boolean") return "json-bool";
    if (type == "null") return "json-null";
    error(at, "unknown type '{}'", type);
  }

  std::string ref(const json& s, const std::string& at) {
    if (!s["$ref"].is_string()) error(at, "'$ref' must be a string");
    const std::string r = s["$ref"].get<std::string>();
    if (auto it = refs_.find(r); it != refs_.end()) return it->second;
    if (r.rfind("#", 0) != 0) error(at, "'$ref' {} points outside this schema", r);
    const json* target = &root_;
    try {
      target = &root_.at(json::json_pointer(r.substr(1)));
    } catch (const json::exception&) {
      error(at, "'$ref' {} points to nothing in this schema", r);
    }
    // Named before it is visited, so a schema that refers to itself calls its own rule.
    const std::string n = name(r.substr(r.rfind('/') + 1));
    refs_[r] = n;
    const size_t slot = rules_.size();
    rules_.emplace_back(n, "");
    const std::string body = visit(*target, r, n + "-body");
    rules_[slot].second = body;
    return n;
  }

  std::string object(const json& s, const std::string& at, const std::string& hint) {
    const json props = s.value("properties", json::object());
    if (!props.is_object()) error(at, "'properties' must be an object");
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) error(at, "'required' must be an array of names");
      for (const json& r : s["required"]) {
        if (!r.is_string()) error(at, "'required' must be an array of names");
        required.insert(r.get<std::string>());
      }
    }
    // More keys than the listed ones: additionalProperties true or a schema. Without `properties`,
    // any keys unless it says false.
    std::string extra;
    const json add = s.value("additionalProperties", json(props.empty()));
    if (add.is_object() || (add.is_boolean() && add.get<bool>())) {
      const std::string value = add.is_object() ? visit(add, at + "/additionalProperties", hint + "-value") : "json-value";
      extra = define(hint + "-extra", fmt::format("json-string ws \":\" ws {} ws", value));
    }
    if (props.empty() && required.empty()) {
      if (extra.empty()) return define(hint, "\"{\" ws \"}\"");
      if (!add.is_object()) return "json-object";
      return define(hint, fmt::format("\"{{\" ws ( {0} ( \",\" ws {0} )* )? \"}}\"", extra));
    }
    // One member per listed property (and required names without a schema), in order.
    std::vector<std::pair<std::string, bool>> members;  // (rule, required)
    std::vector<std::string> names;
    for (const auto& [key, sub] : props.items()) names.push_back(key);
    for (const std::string& r : required)
      if (!props.contains(r)) names.push_back(r);
    for (const std::string& key : names) {
      const std::string value = props.contains(key) ? visit(props[key], at + "/properties/" + key, hint + "-" + key)
                                                    : "json-value";
      members.push_back({define(hint + "-" + key + "-kv", fmt::format("{} ws \":\" ws {} ws", literal(json(key).dump()), value)),
                         required.count(key) > 0});
    }
    // head(i): nothing written yet, at member i; tail(i): something written. Optional members
    // may be skipped; commas go between what is written.
    const size_t n = members.size();
    const std::string more = extra.empty() ? "" : fmt::format("( \",\" ws {} )*", extra);
    std::vector<std::string> head(n + 1), tail(n + 1);
    tail[n] = more;
    head[n] = extra.empty() ? "" : fmt::format("( {} {} )?", extra, more);
    for (size_t i = n; i-- > 0;) {
      const auto& [kv, req] = members[i];
      const std::string t = tail[i + 1].empty() ? "" : " " + tail[i + 1];
      if (i > 0)  // tail(0) would follow nothing: never used
        tail[i] = define(fmt::format("{}-tail{}", hint, i), req ? fmt::format("\",\" ws {}{}", kv, t)
                                                                 : fmt::format("( \",\" ws {} )?{}", kv, t));
      const std::string h = req ? kv + t : fmt::format("{}{} | {}", kv, t, head[i + 1]);
      head[i] = define(fmt::format("{}-head{}", hint, i), h);
    }
    return define(hint, fmt::format("\"{{\" ws {} \"}}\"", head[0]));
  }

  static int count(const json& s, const char* key, const std::string& at) {
    if (!s.contains(key)) return -1;
    if (!s[key].is_number_integer() || s[key].get<int64_t>() < 0 || s[key].get<int64_t>() > 10000)
      error(at, "'{}' must be an integer from 0 to 10000", key);
    return s[key].get<int>();
  }

  std::string array(const json& s, const std::string& at, const std::string& hint) {
    const std::string item = s.contains("items") ? visit(s["items"], at + "/items", hint + "-item") : "json-value";
    const int lo = std::max(count(s, "minItems", at), 0), hi = count(s, "maxItems", at);
    if (hi >= 0 && hi < lo) error(at, "maxItems {} is below minItems {}", hi, lo);
    if (hi == 0) return define(hint, "\"[\" ws \"]\"");
    const std::string rest = hi < 0 ? fmt::format("{{{},}}", std::max(lo - 1, 0)) : fmt::format("{{{},{}}}", std::max(lo - 1, 0), hi - 1);
    const std::string items = fmt::format("{0} ws ( \",\" ws {0} ws ){1}", item, rest);
    return define(hint, lo > 0 ? fmt::format("\"[\" ws {} \"]\"", items) : fmt::format("\"[\" ws ( {} )? \"]\"", items));
  }

  std::string string(const json& s, const std::string& at, const std::string& hint) {
    const int lo = count(s, "minLength", at), hi = count(s, "maxLength", at);
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) error(at, "'pattern' must be a string");
      if (lo >= 0 || hi >= 0 || s.contains("format"))
        error(at, "'pattern' together with minLength, maxLength or format is not supported");
      std::string body;
      try {
        body = regex_to_gbnf(s["pattern"].get<std::string>());
      } catch (const Error& e) {
        error(at, "{}", e.what());
      }
      return define(hint, "\"\\\"\" " + body + " \"\\\"\"");
    }
    if (s.contains("format") && s["format"].is_string()) {
      const std::string f = s["format"].get<std::string>();
      const char* date = "[0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )";
      const char* time = "( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,9} )? "
                         "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )";
      std::string body;
      if (f == "date") body = date;
      else if (f == "time") body = time;
      else if (f == "date-time") body = fmt::format("{} \"T\" {}", date, time);
      else if (f == "uuid") body = "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{12}";
      if (!body.empty()) {
        if (lo >= 0 || hi >= 0) error(at, "minLength/maxLength with format '{}' is not supported", f);
        return define(hint, "\"\\\"\" " + body + " \"\\\"\"");
      }
    }
    if (lo < 0 && hi < 0) return "json-string";
    if (hi >= 0 && hi < std::max(lo, 0)) error(at, "maxLength {} is below minLength {}", hi, lo);
    const std::string rep = hi < 0 ? fmt::format("{{{},}}", lo) : fmt::format("{{{},{}}}", std::max(lo, 0), hi);
    return define(hint, "\"\\\"\" json-char" + rep + " \"\\\"\"");
  }

  std::string integer(const json& s, const std::string& at, const std::string& hint) {
    // Bounds may be fractional (minimum 0.5 on an integer means 1); past 16 digits they are refused.
    constexpr double kLimit = 1e15;
    auto bound = [&](const char* key, bool up) -> std::optional<int64_t> {
      if (!s.contains(key)) return std::nullopt;
      const json& v = s[key];
      if (!v.is_number()) error(at, "'{}' must be a number", key);
      const double x = v.get<double>();
      if (!(std::fabs(x) <= kLimit)) error(at, "'{}' {} is beyond the 16 digits the grammar writes", key, x);
      return int64_t(up ? std::ceil(x) : std::floor(x));
    };
    std::optional<int64_t> lo = bound("minimum", true), hi = bound("maximum", false);
    if (auto x = bound("exclusiveMinimum", false)) lo = std::max(lo.value_or(*x + 1), *x + 1);
    if (auto x = bound("exclusiveMaximum", true)) hi = std::min(hi.value_or(*x - 1), *x - 1);
    if (!lo && !hi) return "json-int";
    if (lo && hi && *hi < *lo) error(at, "no integer lies between the bounds ({} > {})", *lo, *hi);
    return define(hint, integer_range(lo, hi));
  }

  // Numbers between whole bounds: an integer part in range with any fraction, the top bound itself
  // only with a zero fraction; no exponent. Fractional or exclusive bounds are refused.
  std::string number(const json& s, const std::string& at, const std::string& hint) {
    for (const char* k : {"exclusiveMinimum", "exclusiveMaximum"})
      if (s.contains(k)) error(at, "'{}' on a number is not supported (minimum/maximum are, and all bounds on an integer)", k);
    auto bound = [&](const char* key) -> std::optional<int64_t> {
      if (!s.contains(key)) return std::nullopt;
      const json& v = s[key];
      const double x = v.is_number() ? v.get<double>() : NAN;
      if (!(std::fabs(x) <= 1e15) || x != std::floor(x))
        error(at, "'{}' on a number must be a whole number within ±10^15 (got {})", key, v.dump());
      return int64_t(x);
    };
    const std::optional<int64_t> lo = bound("minimum"), hi = bound("maximum");
    if (!lo && !hi) return "json-number";
    if (lo && hi && *hi < *lo) error(at, "no number lies between the bounds ({} > {})", *lo, *hi);
    const std::string frac = " ( \".\" [0-9]{1,16} )?", zero = " ( \".\" \"0\"{1,16} )?";
    std::vector<std::string> alts;
    // [from, to] with any fraction below `to`, `to` itself with a zero one (to < 0: open).
    auto part = [&](const std::string& sign, int64_t from, int64_t to) {
      if (to < 0) return alts.push_back(sign + naturals(from, -1) + frac);
      if (to - 1 >= from) alts.push_back(sign + naturals(from, to - 1) + frac);
      if (to >= from) alts.push_back(sign + naturals(to, to) + zero);
    };
    if (!hi || *hi >= 0) part("", std::max<int64_t>(lo.value_or(0), 0), hi.value_or(-1));
    if (!lo || *lo < 0) {  // v = -(m + f): m from -hi (or 0) up to -lo, -lo itself only whole
      const int64_t m_lo = hi && *hi < 0 ? -*hi : 0;
      if (m_lo == 0) alts.push_back("\"-0.\" [0-9]{0,15} [1-9]");  // -0.x, never -0 itself
      part("\"-\" ", std::max<int64_t>(m_lo, 1), lo ? -*lo : -1);
    }
    return define(hint, alternation(alts));
  }

  // The decimal numerals of lo..hi, both the same length (leading zeros allowed inside the
  // recursion): a digit both share, or a split into lo's first digit, the digits between, and
  // hi's first digit, each followed by the range its tail allows.
  static std::string digits(const std::string& lo, const std::string& hi) {
    const size_t n = lo.size();
    if (n == 0) return "";
    const bool lo_zeros = lo.find_first_not_of('0', 1) == std::string::npos;
    const bool hi_nines = hi.find_first_not_of('9', 1) == std::string::npos;
    const std::string any_tail = n > 1 ? fmt::format(" [0-9]{{{}}}", n - 1) : "";
    auto cls = [](char a, char b) { return a == b ? fmt::format("\"{}\"", a) : fmt::format("[{}-{}]", a, b); };
    if (lo_zeros && hi_nines) return cls(lo[0], hi[0]) + any_tail;
    if (lo[0] == hi[0]) return cls(lo[0], lo[0]) + " " + digits(lo.substr(1), hi.substr(1));
    std::vector<std::string> alts;
    char from = lo[0], to = hi[0];
    if (!lo_zeros) alts.push_back(cls(from, from) + " " + digits(lo.substr(1), std::string(n - 1, '9'))), from++;
    if (!hi_nines) to--;
    if (from <= to) alts.push_back(cls(from, to) + any_tail);
    if (!hi_nines) alts.push_back(cls(hi[0], hi[0]) + " " + digits(std::string(n - 1, '0'), hi.substr(1)));
    return alternation(alts);
  }

  // Non-negative lo..hi (hi < 0: no upper bound, up to 16 digits) as numerals without leading zeros.
  static std::string naturals(int64_t lo, int64_t hi) {
    const std::string a = std::to_string(lo);
    const size_t max_len = hi < 0 ? 16 : std::to_string(hi).size();
    std::vector<std::string> alts;
    for (size_t len = a.size(); len <= max_len; len++) {
      const std::string from = len == a.size() ? a : fmt::format("1{}", std::string(len - 1, '0'));
      const std::string to = hi >= 0 && len == max_len ? std::to_string(hi) : std::string(len, '9');
      alts.push_back(digits(from, to));
    }
    return alternation(alts);
  }

  // Integers lo..hi, either side open, as JSON writes them ("0", never "-0" or leading zeros).
  static std::string integer_range(std::optional<int64_t> lo, std::optional<int64_t> hi) {
    std::vector<std::string> alts;
    if (!lo || *lo < 0) {  // the negative part: "-" and the magnitudes max(1, -hi) .. -lo
      const int64_t mag_lo = hi && *hi < 0 ? -*hi : 1;
      alts.push_back("\"-\" " + naturals(mag_lo, lo ? -*lo : -1));
    }
    if (!hi || *hi >= 0) alts.push_back(naturals(lo && *lo > 0 ? *lo : 0, hi ? *hi : -1));
    return alternation(alts);
  }

  const json& root_;
  std::vector<std::pair<std::string, std::string>> rules_;
  std::set<std::string> taken_ = {"root"};
  std::map<std::string, std::string> refs_;
  int depth_ = 0;
};

}  // namespace

std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema) { return SchemaGrammar(schema).run(); }

std::string json_object_gbnf() { return std::string("root ::= json-object\n") + kJsonRules; }

}  // namespace baton
