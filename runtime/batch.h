// A batch of tokens to evaluate: any mix of sequences and positions (prefill chunks and decode
// steps of many sequences together). The unit of work passed from the engine to the pipeline.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

namespace baton {

// What a token asks of the last stage (Batch::logits).
enum LogitsMode : uint8_t {
  kNoLogits = 0,
  kLogitsRow = 1,  // the full row of n_vocab logits
  // Only the row's argmax (ties: the lowest id, as the greedy sampler): the row slot still spans
  // n_vocab floats, but every pipeline writes just the token id, as an int32 in its first 4 bytes
  // (argmax_token). A greedy request then never moves a vocabulary row across a process link or
  // off a GPU.
  kArgmaxOnly = 2,
};

struct Batch {
  std::vector<int32_t> token;   // token id
  std::vector<int32_t> pos;     // position of the token in its sequence (0-based)
  std::vector<int32_t> seq;     // sequence slot (0 .. n_seq-1), selects the KV cache rows
  std::vector<uint8_t> logits;  // LogitsMode: which tokens produce an output row, and what it holds

  void add(int32_t t, int32_t p, int32_t s, uint8_t mode) {
    token.push_back(t); pos.push_back(p); seq.push_back(s); logits.push_back(mode);
  }
  void add(int32_t t, int32_t p, int32_t s, bool want_logits) { add(t, p, s, uint8_t(want_logits ? kLogitsRow : kNoLogits)); }
  void clear() { token.clear(); pos.clear(); seq.clear(); logits.clear(); }
  int size() const { return int(token.size()); }
  // Output rows (tokens with any LogitsMode but kNoLogits), in batch order.
  int n_logits() const { int n = 0; for (auto l : logits) n += l != kNoLogits; return n; }
};

// The token id a kArgmaxOnly row holds, and how a pipeline stores it.
inline int32_t argmax_token(const float* row) {
  int32_t id;
  std::memcpy(&id, row, sizeof id);
  return id;
}
inline void set_argmax_token(float* row, int32_t id) { std::memcpy(row, &id, sizeof id); }


}  // namespace baton
