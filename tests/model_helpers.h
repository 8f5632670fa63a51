// Test helpers that run a loaded model: greedy decoding through the Pipeline, peer id files.
#pragma once
#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

namespace baton::test {

// Whitespace-separated token ids from a file (peer *.tokens.txt).
inline std::vector<int32_t> read_ids(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::vector<int32_t> ids;
  int32_t v;
  while (in >> v) ids.push_back(v);
  return ids;
}

// Greedy continuation of `ids` in sequence 0: the prompt in one batch, then one token per step
// through the KV cache, until an end-of-generation token or max_tokens.
inline std::string greedy(Pipeline& p, const std::vector<int32_t>& ids, int max_tokens) {
  const Tokenizer& tok = p.tokenizer();
  REQUIRE(!ids.empty());
  Batch b;
  for (size_t i = 0; i < ids.size(); ++i) b.add(ids[i], int32_t(i), 0, i + 1 == ids.size());
  std::vector<float> logits(size_t(p.n_vocab()));
  p.decode(b, logits.data());
  std::vector<int32_t> out;
  for (int step = 0; step < max_tokens; ++step) {
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    if (tok.is_eog(next)) break;
    out.push_back(next);
    Batch d;
    d.add(next, int32_t(ids.size() + out.size() - 1), 0, true);
    p.decode(d, logits.data());
  }
  return tok.decode(out);
}

}  // namespace baton::test
