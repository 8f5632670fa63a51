// Test helpers that run a loaded model: greedy decoding through the Pipeline, peer id files.
#pragma once
#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "helpers.h"
#include "runtime/pipeline.h"
#include "runtime/synth.h"
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

// A generated Gemma 3-shaped model (tied head, sliding-window layers with a ring KV cache) with 7
// layers, to cut two and three ways; written once per test process.
inline std::string tiny_gemma3_model() {
  static const std::string path = [] {
    const ShapePreset shape{"tiny-gemma3", "gemma3", "test", 7, 64, 2, 1, 64, 256, 1000, 2048, true, 16, 6,
                            1e6f, 1e-6f, false};
    SynthOptions o;
    o.type = GgmlType::Q8_0;
    o.seed = 5;
    const std::string p = temp_dir() + "/tiny-gemma3.gguf";
    synth_write(shape, o, p);
    return p;
  }();
  return path;
}

}  // namespace baton::test
