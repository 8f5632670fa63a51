// Constrained generation: GBNF grammars (the grammar format llama.cpp users write), compiled to a
// small pushdown recognizer that says, for any candidate token's bytes, whether the text generated
// so far can still become a sentence of the grammar.
//
//   root   ::= "{" ws pair ("," ws pair)* "}"      rules: name ::= alternatives, `root` starts
//   pair   ::= [a-z]+ ":" ws [0-9]{1,3}            "literal", [class], [^negated], . (any char)
//   ws     ::= [ \t\n]*                            ( ), |, * + ? {m} {m,} {m,n}, # comment
//
// Text is matched per code point (UTF-8); a token may end inside a character, and the state then
// remembers the partial character and only allows what can still complete it. Grammars are
// compiled once and shared (immutable); every generation owns a GrammarState.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace baton {

class Grammar {
 public:
  // Compiles GBNF text. Bad input (a syntax error, an undefined rule, no start rule, a rule that
  // can call itself before reading a character) throws Error(Usage) naming the line and the rule.
  static std::shared_ptr<const Grammar> parse(std::string_view text, std::string_view start = "root");

  // One element of an alternative: a set of code points, a call of another rule, or the end.
  struct Elem {
    enum Kind : uint8_t { End, Chars, Ref } kind = End;
    bool negated = false;  // Chars: matches the code points NOT in its ranges
    uint32_t a = 0;        // Chars: first range in ranges_; Ref: the rule
    uint32_t b = 0;        // Chars: number of ranges
  };
  struct Rule {
    std::string name;             // generated rules (groups, repetitions) are named parent_N
    std::vector<uint32_t> alts;   // first element of each alternative in elems()
  };

  const std::vector<Elem>& elems() const { return elems_; }
  const std::vector<Rule>& rules() const { return rules_; }
  uint32_t start() const { return start_; }
  // Elem e (Chars) matches code point cp; matches_some: at least one of lo..hi.
  bool matches(const Elem& e, uint32_t cp) const;
  bool matches_some(const Elem& e, uint32_t lo, uint32_t hi) const;

 private:
  friend class GrammarParser;
  std::vector<Elem> elems_;
  std::vector<std::pair<uint32_t, uint32_t>> ranges_;  // inclusive code point ranges
  std::vector<Rule> rules_;
  uint32_t start_ = 0;
};

// A vocabulary's token bytes sorted, so that tokens sharing a prefix are neighbours: a grammar
// walks the prefixes once for all the tokens under them (a trie without the nodes).
class TokenTrie {
 public:
  // pieces[id]: the bytes token id stands for; empty ones never match and are left out. The
  // views must outlive the trie.
  explicit TokenTrie(const std::vector<std::string_view>& pieces);
  const std::vector<std::pair<std::string_view, int32_t>>& entries() const { return entries_; }

 private:
  std::vector<std::pair<std::string_view, int32_t>> entries_;
};

// Where a generation stands in its grammar: every way the text so far can continue (a set of
// call stacks of element positions, each stopped at a set of characters, or empty once the
// start rule is complete) plus the bytes of an unfinished UTF-8 character.
class GrammarState {
 public:
  explicit GrammarState(std::shared_ptr<const Grammar> g);

  // Would the text so far followed by `bytes` still be a prefix of a sentence? (Empty bytes: no.)
  bool allows(std::string_view bytes) const;
  // Every token of the trie that allows() would accept (in trie order): one walk over the shared
  // prefixes, cheap where the grammar allows little, which is where asking token by token is not.
  void allowed(const TokenTrie& trie, std::vector<int32_t>& out) const;
  // Moves past `bytes`; returns false (and changes nothing) when allows(bytes) is false.
  bool accept(std::string_view bytes);
  // The text so far is a whole sentence (generation may end here).
  bool complete() const;
  // Complete and nothing may follow: generation must end here.
  bool finished() const;

  using Stack = std::vector<uint32_t>;
  // A UTF-8 character being read: its bits so far, continuation bytes still due, its length.
  struct Utf8 {
    uint32_t cp = 0;
    uint8_t left = 0, len = 0;
  };

 private:
  bool step(std::string_view bytes, std::vector<Stack>& stacks, Utf8& u) const;
  bool partial_ok(const std::vector<Stack>& stacks, const Utf8& u) const;
  void collect(const TokenTrie& trie, size_t lo, size_t hi, size_t depth, const std::vector<Stack>& stacks,
               const Utf8& u, std::vector<int32_t>& out) const;
  void advance(const std::vector<Stack>& in, uint32_t cp, std::vector<Stack>& out) const;
  void expand(Stack s, std::vector<Stack>& out) const;

  std::shared_ptr<const Grammar> g_;
  std::vector<Stack> stacks_;  // sorted, no duplicates
  Utf8 partial_;               // an unfinished character (left == 0: none)
  mutable std::vector<Stack> scratch_;
};

}  // namespace baton
