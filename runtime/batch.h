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
  // Only the row's top_k_candidates(n_vocab) largest logits, sorted by value descending then id
  // ascending (the order of cpu::top_k and cuda::top_k): their ids as int32 in words [0, K), their
  // values in words [K, 2K) (top_k_row_*), NaN values after the last real candidate. A request
  // that samples with top_k <= K and no repetition penalty draws exactly what it would from the
  // full row, without the row leaving the GPU or crossing a process link.
  kTopK = 3,
  // The token's final hidden state after the output norm (what embedding models return), without
  // the output matmul: n_embd floats in the row's first words (the slot still spans n_vocab floats,
  // so a model must have n_embd <= n_vocab; check_batch refuses it otherwise). A batch's output
  // rows are all kHidden or none of them.
  kHidden = 4,
};

// K of a kTopK row: at most 256 (cuda::top_k's limit), and 2K words must fit in the row's slot.
constexpr int kMaxTopKCandidates = 256;
inline int top_k_candidates(int n_vocab) { return n_vocab / 2 < kMaxTopKCandidates ? n_vocab / 2 : kMaxTopKCandidates; }

// A GPU stage routes a mixture of experts on the device for steps of up to this many tokens (decode
// steps: no wait for the host, captured in graphs), each (token, expert) pair its own row of the
// experts' buffers. Rows of those buffers (hb, hb2, ye: Scratch, scratch_layout) for n_batch
// tokens and k experts per token: enough for that, for k experts of one token and for n_batch
// tokens of one expert.
constexpr int kMoeDeviceTokens = 16;
inline uint64_t moe_expert_rows(uint64_t n_batch, uint64_t k) {
  const uint64_t pairs = (n_batch < uint64_t(kMoeDeviceTokens) ? n_batch : uint64_t(kMoeDeviceTokens)) * k;
  const uint64_t one = n_batch > k ? n_batch : k;
  return pairs > one ? pairs : one;
}

// The 4-byte words an output row of this mode holds (its slot always spans n_vocab floats).
inline size_t output_words(uint8_t mode, size_t n_vocab, size_t n_embd) {
  switch (mode) {
    case kLogitsRow: return n_vocab;
    case kArgmaxOnly: return 1;
    case kTopK: return 2 * size_t(top_k_candidates(int(n_vocab)));
    case kHidden: return n_embd;
    default: return 0;
  }
}

// Before a batch's tokens: sequence `dst` becomes the first n positions of sequence `src` (their
// KV cache rows copied, whatever dst held dropped), so a prompt that starts as another slot's does
// not evaluate that start again (Engine). src's n positions must have been submitted in earlier
// batches; every stage makes the copy when the batch reaches it, so it sees them written.
struct SeqCopy {
  int32_t src = 0, dst = 0, n = 0;
};

struct Batch {
  std::vector<int32_t> token;   // token id
  std::vector<int32_t> pos;     // position of the token in its sequence (0-based)
  std::vector<int32_t> seq;     // sequence slot (0 .. n_seq-1), selects the KV cache rows
  std::vector<uint8_t> logits;  // LogitsMode: which tokens produce an output row, and what it holds
  std::vector<SeqCopy> copies;  // done first, in order (Pipeline::copy_limit)

  void add(int32_t t, int32_t p, int32_t s, uint8_t mode) {
    token.push_back(t); pos.push_back(p); seq.push_back(s); logits.push_back(mode);
  }
  void add(int32_t t, int32_t p, int32_t s, bool want_logits) { add(t, p, s, uint8_t(want_logits ? kLogitsRow : kNoLogits)); }
  void clear() { token.clear(); pos.clear(); seq.clear(); logits.clear(); copies.clear(); }
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

// The candidates of a kTopK row with K entries, and how a pipeline stores them.
inline int32_t top_k_row_id(const float* row, int i) {
  int32_t id;
  std::memcpy(&id, row + i, sizeof id);
  return id;
}
inline float top_k_row_value(const float* row, int K, int i) { return row[K + i]; }
inline void set_top_k_row(float* row, int K, const int32_t* ids, const float* vals) {
  std::memcpy(row, ids, size_t(K) * sizeof(int32_t));
  std::memcpy(row + K, vals, size_t(K) * sizeof(float));
}

// The CPU's reduction of a full row of n_vocab logits, in place, to what `mode` asks for
// (kArgmaxOnly, kTopK; other modes, kHidden included, leave the row as it is). The twin of the GPU
// stage's.
void reduce_output_row(uint8_t mode, float* row, int n_vocab);

}  // namespace baton
