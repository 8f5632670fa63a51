// A batch of tokens to evaluate: any mix of sequences and positions (prefill chunks and decode
// steps of many sequences together). The unit of work passed from the engine to the pipeline.
#pragma once
#include <cstdint>
#include <vector>

namespace baton {

struct Batch {
  std::vector<int32_t> token;   // token id
  std::vector<int32_t> pos;     // position of the token in its sequence (0-based)
  std::vector<int32_t> seq;     // sequence slot (0 .. n_seq-1), selects the KV cache rows
  std::vector<uint8_t> logits;  // 1: produce a logits row for this token

  void add(int32_t t, int32_t p, int32_t s, bool want_logits) {
    token.push_back(t); pos.push_back(p); seq.push_back(s); logits.push_back(want_logits ? 1 : 0);
  }
  void clear() { token.clear(); pos.clear(); seq.clear(); logits.clear(); }
  int size() const { return int(token.size()); }
  int n_logits() const { int n = 0; for (auto l : logits) n += l; return n; }
};

}  // namespace baton
