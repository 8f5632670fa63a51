// JSON Schema → grammar: texts drawn at random from each schema's grammar must be JSON that a
// small validator written from the JSON Schema spec accepts; hand-written valid and invalid
// instances go the expected way; keywords the grammar cannot enforce are refused by name.
#include <catch2/catch.hpp>

#include <random>
#include <regex>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "runtime/grammar.h"
#include "runtime/json_schema.h"
#include "runtime/unicode.h"
#include "tests/helpers.h"

using namespace baton;
using nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {

// The subset of JSON Schema validation the converter claims, from the spec's definitions.
bool valid(const json& v, const json& s, const json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) return valid(v, root.at(json::json_pointer(s["$ref"].get<std::string>().substr(1))), root);
  if (s.contains("const") && v != s["const"]) return false;
  if (s.contains("enum") && std::find(s["enum"].begin(), s["enum"].end(), v) == s["enum"].end()) return false;
  if (s.contains("anyOf") &&
      std::none_of(s["anyOf"].begin(), s["anyOf"].end(), [&](const json& a) { return valid(v, a, root); }))
    return false;
  if (s.contains("allOf") &&
      !std::all_of(s["allOf"].begin(), s["allOf"].end(), [&](const json& a) { return valid(v, a, root); }))
    return false;
  if (s.contains("type")) {
    json types = s["type"].is_array() ? s["type"] : json::array({s["type"]});
    auto is = [&](const std::string& t) {
      if (t == "object") return v.is_object();
      if (t == "array") return v.is_array();
      if (t == "string") return v.is_string();
      if (t == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == double(int64_t(v.get<double>())));
      if (t == "number") return v.is_number();
      if (t == "boolean") return v.is_boolean();
      return t == "null" && v.is_null();
    };
    if (std::none_of(types.begin(), types.end(), [&](const json& t) { return is(t.get<std::string>()); })) return false;
  }
  if (v.is_number()) {
    if (s.contains("minimum") && v.get<double>() < s["minimum"].get<double>()) return false;
    if (s.contains("maximum") && v.get<double>() > s["maximum"].get<double>()) return false;
  }
  if (v.is_string()) {
    // Length in code points.
    size_t n = 0;
    for (const unsigned char c : v.get<std::string>()) n += (c & 0xC0) != 0x80;
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return false;
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return false;
  }
  if (v.is_array()) {
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return false;
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
    if (s.contains("items"))
      for (const json& x : v)
        if (!valid(x, s["items"], root)) return false;
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    if (s.contains("required"))
      for (const json& r : s["required"])
        if (!v.contains(r.get<std::string>())) return false;
    for (const auto& [k, x] : v.items()) {
      if (props.contains(k)) {
        if (!valid(x, props[k], root)) return false;
      } else if (s.contains("additionalProperties")) {
        if (!valid(x, s["additionalProperties"], root)) return false;
      }
    }
  }
  return true;
}

// A random walk through the grammar: each step appends a random piece the grammar allows, until
// it says the text is finished. Pieces: single characters, a two-byte character split in two,
// and a few multi-character chunks, as tokens would be.
std::string random_sentence(const std::shared_ptr<const Grammar>& g, std::mt19937& rng, bool& ok, int max_steps = 3000) {
  static const std::vector<std::string> pieces = [] {
    std::vector<std::string> p = {"\n", "\n  ", "\xC3", "\xA9", "é", "true", "false", "null", "\":", "\",", "20", "-0", "00"};
    for (char c = ' '; c <= '~'; c++) p.push_back(std::string(1, c));
    return p;
  }();
  GrammarState s(g);
  std::string out;
  ok = false;
  for (int step = 0; step < max_steps; step++) {
    if (s.finished()) { ok = true; return out; }
    std::vector<const std::string*> allowed;
    for (const auto& p : pieces)
      if (s.allows(p)) allowed.push_back(&p);
    if (allowed.empty()) return out;  // stuck: a dead end the grammar should never have
    // A quote whenever one fits, one time in four: strings end before they grow long.
    const std::string& p = s.allows("\"") && rng() % 4 == 0 ? pieces[size_t(std::find(pieces.begin(), pieces.end(), "\"") - pieces.begin())]
                                                             : *allowed[rng() % allowed.size()];
    REQUIRE(s.accept(p));
    out += p;
  }
  return out;
}

void check_schema(const ojson& schema, int walks = 200) {
  INFO("schema " << schema.dump());
  const std::string gbnf = json_schema_to_gbnf(schema);
  INFO(gbnf);
  auto g = Grammar::parse(gbnf);
  std::mt19937 rng(3);
  int finished = 0;
  for (int i = 0; i < walks; i++) {
    bool ok = false;
    const std::string text = random_sentence(g, rng, ok);
    if (!ok) continue;  // ran out of steps inside a long string
    finished++;
    INFO("generated " << text);
    const json v = json::parse(text, nullptr, false);
    REQUIRE_FALSE(v.is_discarded());
    const json plain = json::parse(schema.dump());
    CHECK(valid(v, plain, plain));
  }
  CHECK(finished > walks / 2);
}

bool accepts(const ojson& schema, const std::string& text) {
  GrammarState s(Grammar::parse(json_schema_to_gbnf(schema)));
  return s.accept(text) && s.complete();
}

std::string schema_error(const ojson& schema) {
  return test::usage_error([&] { json_schema_to_gbnf(schema); });
}

// Random bounds for trial t: both, only an upper (t % 4 == 1), only a lower (t % 4 == 2).
template <class Pick>
std::pair<std::optional<int64_t>, std::optional<int64_t>> random_bounds(int t, Pick&& pick) {
  std::optional<int64_t> lo, hi;
  if (t % 4 != 1) lo = pick();
  if (t % 4 != 2) hi = pick();
  if (lo && hi && *hi < *lo) std::swap(*lo, *hi);
  return {lo, hi};
}

}  // namespace

TEST_CASE("random texts of a schema's grammar are JSON the schema accepts") {
  check_schema(ojson::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 8},
      "age": {"type": "integer", "minimum": 0, "maximum": 150},
      "tags": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 3},
      "ok": {"type": "boolean"}}, "required": ["name", "age"]})"));
  check_schema(ojson::parse(R"({"type": "object", "properties": {
      "a": {"type": "number"}, "b": {"type": ["string", "null"]}, "c": {"enum": ["red", "green", 3, null]},
      "d": {"const": {"x": [1, 2]}}}})"));
  check_schema(ojson::parse(R"({"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 1},
      {"type": "object", "additionalProperties": {"type": "integer", "minimum": -5, "maximum": 5}}]}})"));
  check_schema(ojson::parse(R"({"$defs": {"node": {"type": "object", "properties": {
      "v": {"type": "integer", "exclusiveMinimum": -1, "maximum": 20},
      "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}},
      "$ref": "#/$defs/node"})"));
  check_schema(ojson::parse(R"({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
      "id": {"type": "string", "format": "uuid"}, "day": {"type": "string", "format": "date"}},
      "required": ["when", "day"], "additionalProperties": false})"));
  check_schema(ojson::parse(R"({"type": "object", "properties": {"p": {"type": "integer"}}, "additionalProperties": true})"));
  check_schema(ojson::parse(R"({"type": "object"})"));
  check_schema(ojson::parse(R"({})"));
  check_schema(ojson::parse(R"({"type": "string", "minLength": 2, "maxLength": 4})"));
}

TEST_CASE("schema grammars: hand-written instances") {
  const ojson person = ojson::parse(R"({"type": "object", "properties": {
      "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
      "email": {"type": "string"}}, "required": ["name", "age"]})");
  CHECK(accepts(person, R"({"name": "Ada", "age": 36})"));
  CHECK(accepts(person, R"({"name":"Ada","age":36,"email":"a@b.c"})"));
  CHECK(accepts(person, "{\n  \"name\": \"Ada\",\n  \"age\": 150\n}"));
  CHECK_FALSE(accepts(person, R"({"name": "Ada"})"));                  // age is required
  CHECK_FALSE(accepts(person, R"({"age": 36, "name": "Ada"})"));       // the schema's order
  CHECK_FALSE(accepts(person, R"({"name": "Ada", "age": 151})"));      // above maximum
  CHECK_FALSE(accepts(person, R"({"name": "Ada", "age": -1})"));
  CHECK_FALSE(accepts(person, R"({"name": "Ada", "age": 036})"));
  CHECK_FALSE(accepts(person, R"({"name": "Ada", "age": 36, "x": 1})"));  // only listed keys
  CHECK_FALSE(accepts(person, R"({"name": 5, "age": 36})"));
  const ojson opt = ojson::parse(R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
      "c": {"type": "integer"}}})");
  for (const char* t : {"{}", R"({"a":1})", R"({"b":1})", R"({"c":1})", R"({"a":1,"c":2})", R"({"b":1,"c":2})",
                        R"({"a":1,"b":2,"c":3})"})
    CHECK(accepts(opt, t));
  for (const char* t : {R"({,"b":1})", R"({"a":1,})", R"({"a":1,,"c":2})", R"({"b":1,"a":2})"}) CHECK_FALSE(accepts(opt, t));
  const ojson arr = ojson::parse(R"({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3})");
  CHECK_FALSE(accepts(arr, "[1]"));
  CHECK(accepts(arr, "[1, 2]"));
  CHECK(accepts(arr, "[1,2,3]"));
  CHECK_FALSE(accepts(arr, "[1,2,3,4]"));
  CHECK(accepts(ojson::parse(R"({"enum": ["é", "e", "ée"]})"), "\"ée\""));
  CHECK_FALSE(accepts(ojson::parse(R"({"enum": ["é", "e"]})"), "\"ée\""));
  // Enum trees: characters sharing a first byte (é C3 A9, Ã C3 83), long shared runs, prefixes.
  const std::string long_a = std::string(20000, 'q') + "a", long_b = std::string(20000, 'q') + "b";
  ojson words = ojson::array({"é", "Ã", "éa", "shared prefix 1", "shared prefix 2", "shared", long_a, long_b, 7, 75});
  const ojson en = {{"enum", words}};
  for (const auto& w : words) CHECK(accepts(en, w.dump()));
  for (const char* t : {"\"\xC3\"", "\"shared prefix\"", "\"shared prefix 3\"", "\"éaa\"", "7.5", "757"})
    CHECK_FALSE(accepts(en, t));
  CHECK_FALSE(accepts(en, fmt::format("\"{}\"", std::string(20000, 'q'))));
  CHECK(accepts(ojson::parse(R"({"type": "integer", "minimum": 1})"), "12"));
  CHECK_FALSE(accepts(ojson::parse(R"({"type": "integer", "minimum": 1})"), "0"));
  CHECK(accepts(ojson::parse(R"({"type": "string", "format": "date"})"), "\"2026-12-06\""));
  CHECK_FALSE(accepts(ojson::parse(R"({"type": "string", "format": "date"})"), "\"2026-13-06\""));
  CHECK(accepts(ojson::parse(R"({"type": "string", "format": "email"})"), "\"anything\""));  // an annotation
  // A big integer range stays one path through a tree of digits: fast to build and to follow.
  const ojson big = ojson::parse(R"({"type": "integer", "minimum": -50000, "maximum": 50000})");
  CHECK(accepts(big, "-50000"));
  CHECK(accepts(big, "49999"));
  CHECK_FALSE(accepts(big, "50001"));
  CHECK_FALSE(accepts(big, "-0"));
}

TEST_CASE("what the grammar cannot enforce is refused, naming the keyword and where") {
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "string", "format": "email", "pattern": "^a+$"})")),
             Catch::Contains("'pattern' together with") && Catch::Contains("at #"));
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "object", "properties": {"x": {"type": "number", "minimum": 0.5}}})")),
             Catch::Contains("#/properties/x") && Catch::Contains("'minimum' on a number must be a whole number"));
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "number", "exclusiveMaximum": 1})")),
             Catch::Contains("'exclusiveMaximum' on a number is not supported"));
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "integer", "minimum": 1e20})")), Catch::Contains("16 digits"));
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "integer", "minimum": 3, "maximum": 2})")), Catch::Contains("no integer"));
  CHECK_THAT(schema_error(ojson::parse(R"({"allOf": [{"type": "string"}, {"maxLength": 3}]})")), Catch::Contains("allOf"));
  CHECK_THAT(schema_error(ojson::parse(R"({"$ref": "#/$defs/missing"})")), Catch::Contains("points to nothing"));
  CHECK_THAT(schema_error(ojson::parse(R"({"$ref": "other.json#/a"})")), Catch::Contains("outside this schema"));
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "thing"})")), Catch::Contains("unknown type 'thing'"));
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "array", "minItems": 3, "maxItems": 2})")), Catch::Contains("below"));
  CHECK_THAT(schema_error(ojson::parse(R"({"type": "array", "prefixItems": []})")), Catch::Contains("'prefixItems'"));
  CHECK_THAT(schema_error(ojson::parse(R"({"enum": []})")), Catch::Contains("'enum'"));
  CHECK_THAT(schema_error(ojson::parse("false")), Catch::Contains("no value"));
  CHECK_THAT(schema_error(ojson::parse("[1]")), Catch::Contains("must be an object"));
  ojson deep = ojson::parse(R"({"type": "integer"})");
  for (int i = 0; i < 100; i++) deep = ojson{{"type", "array"}, {"items", deep}};
  CHECK_THAT(schema_error(deep), Catch::Contains("nested more than 64 deep"));
  // Annotations are fine.
  CHECK(schema_error(ojson::parse(R"({"title": "T", "description": "d", "type": "object", "properties":
      {"a": {"type": "string", "title": "A", "default": "x", "examples": ["y"]}}})")) == "");
}

TEST_CASE("a pydantic-style schema with $defs, titles and a nested model") {
  const ojson s = ojson::parse(R"({"$defs": {"Address": {"properties": {"city": {"title": "City", "type": "string"},
      "zip": {"title": "Zip", "type": "string", "maxLength": 5}}, "required": ["city", "zip"], "title": "Address",
      "type": "object"}, "Color": {"enum": ["red", "blue"], "title": "Color", "type": "string"}},
      "properties": {"name": {"title": "Name", "type": "string"}, "home": {"$ref": "#/$defs/Address"},
      "colors": {"items": {"$ref": "#/$defs/Color"}, "title": "Colors", "type": "array"},
      "nick": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null, "title": "Nick"}},
      "required": ["name", "home", "colors"], "title": "Person", "type": "object"})");
  check_schema(s);
  CHECK(accepts(s, R"({"name": "Ada", "home": {"city": "London", "zip": "N1"}, "colors": ["red"], "nick": null})"));
  CHECK_FALSE(accepts(s, R"({"name": "Ada", "home": {"city": "London", "zip": "N1234X"}, "colors": []})"));
  CHECK_FALSE(accepts(s, R"({"name": "Ada", "home": {"city": "London", "zip": "N1"}, "colors": ["green"]})"));
}

TEST_CASE("pattern: strings drawn from the grammar match the regular expression (std::regex, ECMAScript)") {
  const char* patterns[] = {
      "^[A-Z]{2}-\\d{3}$",      "^(foo|bar)+baz?$",           "\\d+",
      "^a.c$",                    "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,4}$",
      "^\\w+\\s\\w+$",      "^x{2,}y?$",                  "^(?:ab|cd){1,3}$",
      "^[^a-z]{1,3}$",            "^(q\"|\\\\)+$",           "^\\D\\S\\W$",
      "^(a|)b*?$",                "^[\\u00e9\\x41-\\x43]+$", "^a{2}b{0,1}c{1}$"};
  for (const char* pat : patterns) {
    INFO("pattern " << pat);
    const ojson schema = {{"type", "string"}, {"pattern", pat}};
    auto g = Grammar::parse(json_schema_to_gbnf(schema));
    // Wide strings: JSON Schema patterns work on characters, std::regex on char would on bytes.
    auto wide = [](const std::string& u) {
      std::wstring w;
      for (uint32_t cp : unicode::decode(u)) w += wchar_t(cp);
      return w;
    };
    const std::wregex re(wide(pat), std::regex::ECMAScript);
    std::mt19937 rng(9);
    int matched = 0;
    for (int i = 0; i < 40; i++) {
      bool ok = false;
      const std::string text = random_sentence(g, rng, ok, 800);
      if (!ok) continue;
      INFO("generated " << text);
      const json v = json::parse(text, nullptr, false);
      REQUIRE(v.is_string());
      CHECK(std::regex_search(wide(v.get<std::string>()), re));
      matched++;
    }
    CHECK(matched > 20);
  }
}

TEST_CASE("pattern: hand-written strings, JSON escapes, and what is refused") {
  auto ok = [](const char* pat, const std::string& text) { return accepts(ojson{{"type", "string"}, {"pattern", pat}}, text); };
  CHECK(ok("^[A-Z]{2}-\\d{3}$", R"("AB-123")"));
  CHECK_FALSE(ok("^[A-Z]{2}-\\d{3}$", R"("AB-1234")"));
  CHECK_FALSE(ok("^[A-Z]{2}-\\d{3}$", R"("ab-123")"));
  CHECK(ok("\\d", R"("room 101, floor 1")"));  // not anchored: anywhere in the value
  CHECK_FALSE(ok("\\d", R"("no digits")"));
  CHECK(ok("^\"q\\\\$", R"("\"q\\")"));  // the value "q\ written as JSON writes it
  CHECK_FALSE(ok("^\"q\\\\$", R"(""q\")"));
  CHECK(ok("^a\\nb$", R"("a\nb")"));
  CHECK(ok("^[^a]$", R"("\\")"));
  CHECK_FALSE(ok("^[^a]$", R"("a")"));
  CHECK(ok("^é+$", R"("éé")"));
  for (const char* bad : {"(?=a)", "(?<n>a)", "\\1", "a\\bc", "a^b", "a$b", "\\p{L}", "[\\D]", "(a", "a)", "*a", "a**"}) {
    INFO(bad);
    CHECK_THAT(schema_error(ojson{{"type", "string"}, {"pattern", bad}}), Catch::Contains("not supported"));
  }
  CHECK_THAT(schema_error(ojson{{"type", "string"}, {"pattern", "a"}, {"maxLength", 3}}), Catch::Contains("together with"));
  CHECK_THAT(schema_error(ojson{{"type", "object"}, {"properties", {{"id", {{"type", "string"}, {"pattern", "(?!x)"}}}}}}),
             Catch::Contains("#/properties/id") && Catch::Contains("pattern /(?!x)/"));
}

TEST_CASE("integer bounds: exactly the integers in range, any bounds, either side open") {
  std::mt19937_64 rng(17);
  auto pick = [&]() -> int64_t {
    switch (rng() % 4) {
      case 0: return int64_t(rng() % 200) - 100;
      case 1: return int64_t(rng() % 2000000) - 1000000;
      case 2: return int64_t(rng() % 2000000000000ull) - 1000000000000ll;
      default: { const int64_t p = 1; int64_t v = p; for (int k = int(rng() % 12); k > 0; k--) v *= 10; return rng() % 2 ? v : v - 1; }
    }
  };
  for (int trial = 0; trial < 60; trial++) {
    const auto [lo, hi] = random_bounds(trial, pick);
    ojson schema = {{"type", "integer"}};
    if (lo) schema[trial % 3 == 0 ? "exclusiveMinimum" : "minimum"] = trial % 3 == 0 ? *lo - 1 : *lo;
    if (hi) schema["maximum"] = *hi;
    INFO(schema.dump());
    auto g = Grammar::parse(json_schema_to_gbnf(schema));
    std::vector<int64_t> probes = {0, 1, -1, 9, 10, -10, 99, 100, 999999999999999, -999999999999999};
    for (const auto& b : {lo, hi})
      if (b)
        for (int64_t d = -30; d <= 30; d++) probes.push_back(*b + d);
    for (int k = 0; k < 200; k++) probes.push_back(pick());
    for (int64_t v : probes) {
      if (v > 999999999999999 || v < -999999999999999) continue;
      const bool in = (!lo || v >= *lo) && (!hi || v <= *hi);
      GrammarState st(g);
      const bool took = st.accept(std::to_string(v)) && st.complete();
      INFO(v);
      REQUIRE(took == in);
    }
    GrammarState z(g);
    CHECK_FALSE((z.accept("-0") && z.complete()));
    GrammarState lead(g);
    CHECK_FALSE((lead.accept("007") && lead.complete()));
  }
  CHECK(accepts(ojson{{"type", "integer"}, {"minimum", 0.5}, {"maximum", 2.5}}, "1"));
  CHECK(accepts(ojson{{"type", "integer"}, {"minimum", 0.5}, {"maximum", 2.5}}, "2"));
  CHECK_FALSE(accepts(ojson{{"type", "integer"}, {"minimum", 0.5}, {"maximum", 2.5}}, "0"));
  CHECK_FALSE(accepts(ojson{{"type", "integer"}, {"minimum", 0.5}, {"maximum", 2.5}}, "3"));
}

TEST_CASE("number bounds: exactly the decimals in range, either side open") {
  std::mt19937_64 rng(23);
  const std::regex json_decimal("-?(0|[1-9][0-9]*)(\\.[0-9]+)?"), negative_zero("-0\\.0+");
  auto pick = [&]() -> int64_t { return rng() % 3 == 0 ? int64_t(rng() % 20) - 10 : int64_t(rng() % 20000) - 10000; };
  for (int trial = 0; trial < 40; trial++) {
    const auto [lo, hi] = random_bounds(trial, pick);
    ojson schema = {{"type", "number"}};
    if (lo) schema["minimum"] = *lo;
    if (hi) schema["maximum"] = *hi;
    INFO(schema.dump());
    auto g = Grammar::parse(json_schema_to_gbnf(schema));
    std::vector<std::string> probes = {"0", "-0", "0.0", "-0.0", "-0.5", "0.5", "1e3", "-1.25", "007", "1.", ".5"};
    for (const auto& b : {lo, hi})
      if (b)
        for (int64_t d = -3; d <= 3; d++)
          for (const char* f : {"", ".0", ".00", ".5", ".001", ".999", ".0000000001"})
            probes.push_back(fmt::format("{}{}", *b + d, f));
    for (int k = 0; k < 100; k++)
      probes.push_back(k % 2 ? fmt::format("{}.{}", pick(), rng() % 1000) : fmt::format("{}", pick()));
    for (const std::string& t : probes) {
      // JSON's number syntax (no "1.", ".5", "007", exponents here), then the value in range; "-0" and
      // "-0.0" are numbers but the grammar writes zero as "0".
      const bool syntax = std::regex_match(t, json_decimal) && t != "-0" && !std::regex_match(t, negative_zero);
      const double v = std::strtod(t.c_str(), nullptr);
      const bool in = syntax && (!lo || v >= double(*lo)) && (!hi || v <= double(*hi));
      GrammarState st(g);
      INFO(t);
      REQUIRE((st.accept(t) && st.complete()) == in);
    }
  }
}
