// libFuzzer target for grammars and JSON Schemas (scripts/test.sh runs it with
// tests/fuzz/corpus_grammar/ as seeds). Input: a grammar (or, when it starts with '{', a JSON
// Schema), a NUL byte, then text to feed. Any grammar or schema must compile or throw
// baton::Error; a schema that converts must give GBNF that compiles; feeding text must keep the
// recognizer's promises: allows() is what accept() does, a refused accept() changes nothing, and
// the trie walk lists exactly the pieces allows() accepts.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "runtime/grammar.h"
#include "runtime/json_schema.h"

using namespace baton;

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "fuzz_grammar: invariant broken: %s\n", what);
  std::abort();
}

void feed(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  GrammarState s(g);
  // The text cut into pieces of 1..4 bytes: the pieces also make a small vocabulary.
  std::vector<std::string_view> pieces;
  for (size_t at = 0; at < text.size();) {
    const size_t n = std::min(text.size() - at, size_t(1 + (uint8_t(text[at]) & 3)));
    pieces.push_back(text.substr(at, n));
    at += n;
  }
  const TokenTrie trie(pieces);
  std::vector<int32_t> listed;
  for (size_t i = 0; i < pieces.size() && i < 64; i++) {
    s.allowed(trie, listed);
    std::sort(listed.begin(), listed.end());
    for (size_t k = 0; k < pieces.size(); k++)
      if (std::binary_search(listed.begin(), listed.end(), int32_t(k)) != s.allows(pieces[k])) broken("trie walk");
    const bool allowed = s.allows(pieces[i]);
    const bool complete = s.complete(), finished = s.finished();
    if (s.accept(pieces[i]) != allowed) broken("allows() and accept() disagree");
    if (!allowed && (s.complete() != complete || s.finished() != finished)) broken("a refused accept() moved the state");
    if (s.finished() && !s.complete()) broken("finished but not complete");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  const std::string_view source = all.substr(0, nul), text = nul == std::string_view::npos ? "" : all.substr(nul + 1);
  if (source.size() > 4096) return 0;  // big grammars only make the fuzzer slow
  std::shared_ptr<const Grammar> g;
  try {
    if (!source.empty() && source[0] == '{') {
      const auto schema = nlohmann::ordered_json::parse(source, nullptr, /*allow_exceptions=*/false);
      if (schema.is_discarded()) return 0;
      std::string gbnf;
      try {
        gbnf = json_schema_to_gbnf(schema);
      } catch (const Error&) {
        return 0;
      }
      try {
        g = Grammar::parse(gbnf);
      } catch (const Error&) {
        broken("a converted schema's GBNF does not compile");
      }
    } else {
      g = Grammar::parse(source);
    }
    feed(g, text);
  } catch (const Error&) {
    // Bad grammars and grammars too ambiguous to follow are refused with a message: fine.
  }
  return 0;
}
