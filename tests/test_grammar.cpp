// GBNF grammars: the parser's errors, what the recognizer accepts byte by byte (partial UTF-8
// characters included), and the built-in JSON grammar against a real JSON parser.
#include <catch2/catch.hpp>

#include <random>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "runtime/grammar.h"
#include "runtime/json_schema.h"
#include "tests/helpers.h"

using namespace baton;

namespace {

GrammarState state(const std::string& gbnf) { return GrammarState(Grammar::parse(gbnf)); }

// Does the grammar take `text` whole (fed in one piece), and is it then a complete sentence?
bool full(const std::string& gbnf, const std::string& text) {
  GrammarState s = state(gbnf);
  return s.accept(text) && s.complete();
}
bool prefix(const std::string& gbnf, const std::string& text) { return state(gbnf).allows(text); }

std::string parse_error(const std::string& gbnf) {
  return test::usage_error([&] { Grammar::parse(gbnf); });
}

}  // namespace

TEST_CASE("literals, alternatives and rule references") {
  const std::string g = "root ::= greeting \" \" name\ngreeting ::= \"hi\" | \"hello\"\nname ::= \"bob\" | \"al\"\n";
  CHECK(full(g, "hi bob"));
  CHECK(full(g, "hello al"));
  CHECK_FALSE(full(g, "hello"));       // a prefix, not a sentence
  CHECK(prefix(g, "hello"));
  CHECK(prefix(g, "hel"));
  CHECK_FALSE(prefix(g, "ha"));
  CHECK_FALSE(prefix(g, "hi  bob"));
  CHECK_FALSE(prefix(g, "hi bobby"));
  GrammarState s = state(g);
  CHECK_FALSE(s.complete());
  REQUIRE(s.accept("hi b"));
  REQUIRE(s.accept("ob"));
  CHECK(s.complete());
  CHECK(s.finished());  // nothing may follow
}

TEST_CASE("character classes, negation, any character and escapes") {
  CHECK(full("root ::= [a-c0-9_]", "b"));
  CHECK(full("root ::= [a-c0-9_]", "7"));
  CHECK(full("root ::= [a-c0-9_]", "_"));
  CHECK_FALSE(full("root ::= [a-c0-9_]", "d"));
  CHECK(full("root ::= [^a-c]", "d"));
  CHECK_FALSE(full("root ::= [^a-c]", "a"));
  CHECK(full("root ::= [^a-c]", "\xC3\xA9"));  // é: any code point outside the ranges
  CHECK(full("root ::= . .", "x\xE2\x82\xAC"));  // two characters, the second three bytes
  CHECK(full("root ::= \"\\n\\t\\\"\\\\\"", "\n\t\"\\"));
  CHECK(full("root ::= \"\\x41\\u00e9\\U0001F600\"", "A\xC3\xA9\xF0\x9F\x98\x80"));
  CHECK(full("root ::= [\\]\\-]+", "]-]"));
  CHECK(full("root ::= [-a]", "-"));
  CHECK(full("root ::= \"é\" [α-ω]", "\xC3\xA9\xCE\xB2"));
}

TEST_CASE("repetitions: * + ? {m} {m,} {m,n}, on characters, literals and groups") {
  const std::string g = "root ::= \"a\"{2,3}";
  CHECK_FALSE(full(g, "a"));
  CHECK(prefix(g, "a"));
  CHECK(full(g, "aa"));
  CHECK(full(g, "aaa"));
  CHECK_FALSE(prefix(g, "aaaa"));
  GrammarState two = state(g);
  REQUIRE(two.accept("aa"));
  CHECK(two.complete());
  CHECK_FALSE(two.finished());  // a third "a" may follow
  REQUIRE(two.accept("a"));
  CHECK(two.finished());

  CHECK(full("root ::= [0-9]{3}", "123"));
  CHECK_FALSE(prefix("root ::= [0-9]{3}", "1234"));
  CHECK(full("root ::= \"x\"{2,}", "xxxxxxx"));
  CHECK_FALSE(full("root ::= \"x\"{2,}", "x"));
  CHECK(full("root ::= \"x\"{0,2} \"y\"", "y"));
  CHECK(full("root ::= \"ab\"* \"c\"", "ababc"));
  CHECK_FALSE(prefix("root ::= \"ab\"* \"c\"", "aba c"));
  CHECK(full("root ::= (\"ab\" | \"c\")+ \".\"", "cabc."));
  CHECK_FALSE(full("root ::= (\"ab\" | \"c\")+ \".\"", "."));
  CHECK(full("root ::= \"-\"? [0-9]+", "-12"));
  CHECK(full("root ::= \"-\"? [0-9]+", "12"));
  CHECK_FALSE(prefix("root ::= \"-\"? [0-9]+", "--"));
  CHECK(full("root ::= (\"a\" \"b\"?){2}", "aab"));
}

TEST_CASE("layout: comments, rules over several lines, any rule order") {
  const std::string g = R"(
# a list of numbers
root ::= "[" (
    num
    ("," num)*   # more
  )? "]"
num  ::=
  [0-9]+
)";
  CHECK(full(g, "[]"));
  CHECK(full(g, "[1,22,333]"));
  CHECK_FALSE(prefix(g, "[1,,"));
  CHECK(full("root ::= a b\nb ::= \"y\"\na ::= \"x\"", "xy"));
  CHECK(full("root ::= \"\" \"z\"", "z"));
  CHECK(state("root ::= \"z\" | ").complete());
}

TEST_CASE("grammar errors name the line and the problem") {
  CHECK_THAT(parse_error("root ::= item\n"), Catch::Contains("'item' is used but never defined"));
  CHECK_THAT(parse_error("root ::= \"a\"\nroot ::= \"b\"\n"), Catch::Contains("line 2") && Catch::Contains("defined twice"));
  CHECK_THAT(parse_error("start ::= \"a\"\n"), Catch::Contains("no 'root' rule"));
  CHECK_THAT(parse_error("root ::= expr\nexpr ::= expr \"+\" term | term\nterm ::= [0-9]\n"),
             Catch::Contains("'expr'") && Catch::Contains("left recursion"));
  CHECK_THAT(parse_error("root ::= a\na ::= b? a \"x\"\nb ::= \"y\"\n"), Catch::Contains("left recursion"));
  // The parser's own rules for groups and repetitions are not named; the user's rule is.
  const std::string nothing_repeated = parse_error("root ::= \"<\" ([a-z]* [a-z]*)* \">\"");
  CHECK_THAT(nothing_repeated, Catch::Contains("in rule 'root'") && Catch::Contains("left recursion"));
  CHECK_THAT(nothing_repeated, !Catch::Contains("root_"));
  CHECK_THAT(parse_error("root ::= \"abc\n"), Catch::Contains("unterminated string"));
  CHECK_THAT(parse_error("root ::= [abc\n"), Catch::Contains("unterminated character class"));
  CHECK_THAT(parse_error("root ::= \"\\q\""), Catch::Contains("unknown escape"));
  CHECK_THAT(parse_error("root ::= \"a\"{3,2}"), Catch::Contains("upper bound below"));
  CHECK_THAT(parse_error("root ::= \"a\"{1,99999}"), Catch::Contains("repetition bound"));
  CHECK_THAT(parse_error("root ::= (\"a\" | \"b\"\nx ::= \"c\""), Catch::Contains("missing ')'"));
  CHECK_THAT(parse_error("root ::= [z-a]"), Catch::Contains("backwards"));
  CHECK_THAT(parse_error("root = \"a\""), Catch::Contains("expected '::='"));
  CHECK_THAT(parse_error("\n\nroot ::= \"a\" @"), Catch::Contains("line 3") && Catch::Contains("unexpected '@'"));
  CHECK_THAT(parse_error("root ::= []"), Catch::Contains("matches nothing"));
  CHECK_THAT(parse_error(""), Catch::Contains("no 'root' rule"));
  CHECK_THAT(parse_error("root ::= " + std::string(100000, '(')), Catch::Contains("nested more than 200 deep"));
  // A long chain of rules, each first calling the next: no recursion in the checks either.
  std::string chain = "root ::= r0\n";
  for (int i = 0; i < 20000; i++) chain += fmt::format("r{} ::= r{} | \"x\"\n", i, i + 1);
  chain += "r20000 ::= \"y\" | r0\n";
  CHECK_THAT(parse_error(chain), Catch::Contains("left recursion"));
}

TEST_CASE("a character split over tokens: partial bytes are held and only completions allowed") {
  const std::string g = "root ::= [α-ω]+";  // U+03B1..U+03C9: lead byte CE or CF
  GrammarState s = state(g);
  CHECK(s.allows("\xCE"));
  CHECK(s.allows("\xCF"));
  CHECK_FALSE(s.allows("\xC3"));      // é's lead byte: no completion is in the class
  CHECK_FALSE(s.allows("\xB1"));      // a continuation byte cannot start a character
  CHECK_FALSE(s.allows("a"));
  REQUIRE(s.accept("\xCE"));
  CHECK_FALSE(s.complete());          // half a character is not a sentence
  CHECK_FALSE(s.allows("\xCE"));      // a new lead byte where a continuation is due
  CHECK_FALSE(s.allows("\x80"));      // U+0380: outside α-ω
  REQUIRE(s.accept("\xB1\xCF"));      // α, then half of the next
  REQUIRE(s.accept("\x89"));          // ω
  CHECK(s.complete());
  // Three- and four-byte characters split anywhere.
  GrammarState e = state("root ::= \"€😀\"");
  for (const char* part : {"\xE2", "\x82", "\xAC\xF0\x9F", "\x98", "\x80"}) REQUIRE(e.accept(part));
  CHECK(e.finished());
  // Negated classes: a partial character is allowed when some completion lies outside the ranges.
  GrammarState n = state("root ::= [^\\u0080-\\u07ff] \"!\"");  // no two-byte characters
  CHECK_FALSE(n.allows("\xC3"));
  CHECK(n.allows("\xE2"));
  CHECK_FALSE(n.allows("\xFF"));      // never valid UTF-8
  CHECK_FALSE(n.allows("\xED\xA0\x80"));  // a surrogate
}

TEST_CASE("lead bytes of overlong or out-of-range forms allow nothing ASCII or small") {
  // E0 and F0 start three- and four-byte characters of U+0800 and U+10000 up: never "s".
  GrammarState s = state("root ::= \"s\"");
  for (const char* b : {"\xC0", "\xC1", "\xE0", "\xF0", "\xF5", "\xE0\x81"}) CHECK_FALSE(s.allows(b));
  GrammarState any = state("root ::= [^a]");
  CHECK_FALSE(any.allows("\xE0\x80"));      // would be an overlong U+0000..U+003F
  CHECK(any.allows("\xE0\xA0"));            // U+0800..U+083F
  CHECK_FALSE(any.allows("\xF4\x90"));      // beyond U+10FFFF
  CHECK(any.allows("\xF4\x8F"));
  CHECK_FALSE(any.accept("\xC1\xBF"));      // overlong "\x7F"
  CHECK(any.accept("\xC2\x80"));
}

TEST_CASE("the trie walk finds exactly the tokens allows() accepts") {
  // A vocabulary of random pieces: JSON punctuation, letters, spaces, whole and split UTF-8
  // characters, stray bytes; states reached by random accepted text.
  std::mt19937 rng(21);
  const std::vector<std::string> atoms = {"{", "}", "[", "]", "\"", ",", ":", " ", "\n", "a", "b", "e", "n", "t",
                                          "r", "u", "l", "f", "s", "0", "1", "9", "-", ".", "\\", "é", "€", "😀",
                                          "\xC3", "\xA9", "\xE2", "\x82", "\xF0", "\x9F", "\xE0", "\xFF"};
  std::vector<std::string> vocab;
  for (int i = 0; i < 1500; i++) {
    std::string p;
    for (int k = int(1 + rng() % 4); k > 0; k--) p += atoms[rng() % atoms.size()];
    vocab.push_back(p);
  }
  vocab.push_back("");  // a token that shows nothing
  std::vector<std::string_view> views(vocab.begin(), vocab.end());
  TokenTrie trie(views);
  auto g = Grammar::parse(json_object_gbnf());
  int states = 0;
  for (int walk = 0; walk < 25; walk++) {
    GrammarState s(g);
    for (int step = 0; step < 30 && !s.finished(); step++) {
      std::vector<int32_t> got;
      s.allowed(trie, got);
      std::sort(got.begin(), got.end());
      std::vector<int32_t> want;
      for (int32_t id = 0; id < int32_t(vocab.size()); id++)
        if (s.allows(vocab[size_t(id)])) want.push_back(id);
      REQUIRE(got == want);
      states++;
      if (want.empty()) break;
      REQUIRE(s.accept(vocab[size_t(want[rng() % want.size()])]));
    }
  }
  CHECK(states > 250);
}

TEST_CASE("allows() never moves the state; a refused accept() changes nothing") {
  GrammarState s = state("root ::= \"ab\" \"c\"*");
  CHECK(s.allows("a"));
  CHECK(s.allows("ab"));
  CHECK_FALSE(s.allows("b"));
  CHECK_FALSE(s.allows(""));
  CHECK_FALSE(s.accept("ax"));  // "a" fits, "x" does not: nothing of it is taken
  CHECK(s.allows("ab"));
  REQUIRE(s.accept("a"));
  CHECK_FALSE(s.allows("a"));
  REQUIRE(s.accept("bccc"));
  CHECK(s.complete());
  CHECK_FALSE(s.finished());
}

TEST_CASE("long repetitions keep the recognizer's stacks flat") {
  // x* is a rule calling itself last: each repeat must replace its frame, not stack another.
  // 200k characters one by one take milliseconds flat and minutes if the stack grew.
  GrammarState s = state("root ::= \"<\" [a-z]* \">\"");
  REQUIRE(s.accept("<"));
  for (int i = 0; i < 200000; i++) REQUIRE(s.accept(std::string(1, char('a' + i % 26))));
  REQUIRE(s.accept(">"));
  CHECK(s.finished());
}

TEST_CASE("an ambiguous grammar is refused once its ways to continue explode") {
  // x nullable inside x{0,5000}: the first "a" can be read by any of the 5000 nested repeats.
  CHECK_THROWS_WITH(state("root ::= x{0,5000} \"b\"\nx ::= \"a\"?"), Catch::Contains("too ambiguous"));
  CHECK(full("root ::= x{0,500} \"b\"\nx ::= \"a\"?", "aaab"));  // 500 ways is fine
}

// ---- the built-in JSON grammar ----

namespace {

nlohmann::json random_json(std::mt19937& g, int depth) {
  const int pick = int(g() % (depth > 3 ? 5 : 7));
  switch (pick) {
    case 0: return nullptr;
    case 1: return bool(g() % 2);
    case 2: return int64_t(g() % 2000000) - 1000000;
    case 3: return double(int64_t(g() % 200000) - 100000) / 64.0;
    case 4: {
      const char* samples[] = {"", "plain", "quote \" and \\ slash", "tab\tnew\nline", "é€😀", "\x01"};
      return samples[g() % 6];
    }
    case 5: {
      nlohmann::json a = nlohmann::json::array();
      for (int i = int(g() % 4); i > 0; i--) a.push_back(random_json(g, depth + 1));
      return a;
    }
    default: {
      nlohmann::json o = nlohmann::json::object();
      for (int i = int(g() % 4); i > 0; i--) o[fmt::format("k{}", g() % 100)] = random_json(g, depth + 1);
      return o;
    }
  }
}

// Feeds `text` in random pieces (splitting UTF-8 characters too); false at the first refusal.
bool feed(GrammarState& s, const std::string& text, std::mt19937& g) {
  size_t at = 0;
  while (at < text.size()) {
    const size_t n = std::min(text.size() - at, size_t(1 + g() % 5));
    if (!s.accept(text.substr(at, n))) return false;
    at += n;
  }
  return true;
}

}  // namespace

TEST_CASE("JSON grammar: every object a JSON library writes is accepted, and ends the reply") {
  auto g = Grammar::parse(json_object_gbnf());
  std::mt19937 rng(7);
  for (int i = 0; i < 300; i++) {
    nlohmann::json o = nlohmann::json::object();
    for (int k = int(rng() % 5); k > 0; k--) o[fmt::format("f{}", k)] = random_json(rng, 1);
    for (int indent : {-1, 2}) {
      const std::string text = o.dump(indent);
      GrammarState s(g);
      INFO(text);
      REQUIRE(feed(s, text, rng));
      CHECK(s.finished());
    }
  }
}

TEST_CASE("JSON grammar: what it accepts as complete, a JSON parser parses") {
  // Mutations of valid objects (a byte dropped, doubled or replaced by JSON punctuation): when the
  // grammar takes the whole text as a sentence, it must be JSON; the valid originals always pass.
  auto g = Grammar::parse(json_object_gbnf());
  std::mt19937 rng(11);
  const std::string punct = "{}[],:\"\\ 0-.eE";
  int accepted_mutants = 0, refused = 0;
  for (int i = 0; i < 3000; i++) {
    nlohmann::json o = nlohmann::json::object();
    for (int k = int(rng() % 4); k > 0; k--) o[fmt::format("f{}", k)] = random_json(rng, 1);
    std::string text = o.dump(rng() % 2 ? -1 : 1);
    const size_t at = rng() % text.size();
    switch (rng() % 3) {
      case 0: text.erase(at, 1); break;
      case 1: text.insert(at, 1, text[at]); break;
      default: text[at] = punct[rng() % punct.size()]; break;
    }
    GrammarState s(g);
    if (s.accept(text) && s.complete()) {
      accepted_mutants++;
      INFO(text);
      CHECK_FALSE(nlohmann::json::parse(text, nullptr, false).is_discarded());
      CHECK(nlohmann::json::parse(text).is_object());
    } else {
      refused++;
    }
  }
  CHECK(accepted_mutants > 100);  // the check above has really run
  CHECK(refused > 1000);
  // Some texts a JSON library would take, that the grammar refuses on purpose.
  GrammarState s(g);
  CHECK_FALSE(s.allows("["));            // the reply is an object
  CHECK_FALSE(s.allows(" {"));           // nothing before it
  CHECK_FALSE(state(json_object_gbnf()).accept("{\"a\":1}\n"));  // nor after it
  CHECK_FALSE(state(json_object_gbnf()).accept("{\"a\":01}"));
  CHECK_FALSE(state(json_object_gbnf()).accept("{\"a\":1,}"));
  CHECK_FALSE(state(json_object_gbnf()).accept("{\n\n\"a\":1}"));  // one newline between tokens
  CHECK_FALSE(state(json_object_gbnf()).accept("{\"a\":12345678901234567}"));  // 17 digits: runaway numbers
  CHECK_FALSE(state(json_object_gbnf()).accept("{\"a\":\"\\ud800\"}"));  // a lone surrogate escape
  CHECK_FALSE(state(json_object_gbnf()).accept("{\"a\":\"\\uDFFF\"}"));
  CHECK(state(json_object_gbnf()).accept("{\"a\":\"\\u00e9\\uD7FF\\uE000\"}"));
}
