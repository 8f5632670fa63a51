// Token sampling: greedy, temperature, top-k, top-n-sigma, locally typical sampling, top-p, min-p, XTC,
// Mirostat (1 and 2), logit biases, repetition, presence and frequency penalties over the last N
// tokens, and DRY's penalty on tokens that would continue a repeated sequence. Each request owns a Sampler with its own RNG, so what it draws depends only on its seed,
// its settings and its own logits — never on which other requests share the batch.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace baton {

struct SamplingParams {
  float temperature = 0.8f;     // <= 0: greedy (argmax)
  int top_k = 40;               // <= 0: off
  float top_p = 0.95f;          // >= 1: off
  float min_p = 0.05f;          // <= 0: off
  float top_n_sigma = -1.0f;    // keep the logits within n standard deviations of the best (Tang et al. 2024); < 0: off
  float typical_p = 1.0f;       // locally typical sampling (Meister et al. 2022) after top-k; >= 1: off
  // XTC ("exclude top choices"): with this probability a step drops every token at or above
  // xtc_threshold but the least likely of them (when there are two or more). 0: off.
  float xtc_probability = 0.0f;
  float xtc_threshold = 0.1f;
  // Mirostat (Basu et al. 2021) instead of top-k and the other truncations: 1 or 2 (0: off). It steers
  // each token's surprise (-log2 p) towards tau, learning its cut-off at rate eta.
  int mirostat = 0;
  float mirostat_tau = 5.0f;
  float mirostat_eta = 0.1f;
  float repeat_penalty = 1.0f;  // 1: off
  // OpenAI's and llama.cpp's additive penalties: a token seen c > 0 times in the window loses
  // c · frequency_penalty + presence_penalty from its logit (after the repetition penalty). 0: off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int repeat_last_n = 64;       // tokens of history the penalties look at (0: none)
  // Added to these tokens' logits before anything else (-inf: never sampled), as llama.cpp's
  // --logit-bias and OpenAI's logit_bias. A token listed twice gets both.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // DRY ("don't repeat yourself", p-e-w 2024): when the last n tokens occurred before followed by
  // token t, and n >= dry_allowed_length, t loses dry_multiplier · dry_base^(n - allowed_length).
  // Sequences do not match across a breaker: a token whose text holds one of the strings (the
  // engine turns them into dry_breaker, a flag per token). dry_penalty_last_n: how far back it
  // looks (-1: the whole history; 0: off). dry_multiplier 0: off.
  float dry_multiplier = 0.0f;
  float dry_base = 1.75f;
  int dry_allowed_length = 2;
  int dry_penalty_last_n = -1;
  std::vector<std::string> dry_sequence_breakers = {"\n", ":", "\"", "*"};
  std::shared_ptr<const std::vector<bool>> dry_breaker;  // per token id (null: no breakers)
  uint64_t seed = 0;            // the RNG seed; resolved (never "random") by the time a Sampler exists

  bool greedy() const { return temperature <= 0.0f; }
  // Input check with a message naming the bad value; "" when everything is in range. With n_vocab,
  // the logit biases' tokens must be in the vocabulary.
  std::string validate(int n_vocab = 0) const;
};

// A seed from the system's entropy, for requests that did not ask for one.
uint64_t random_seed();

// Small, fast, portable PRNG (xoshiro256**, seeded by splitmix64): the same seed gives the same
// stream on every platform and standard library, which std::uniform_*_distribution does not promise.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t next();
  double uniform();  // [0, 1)

 private:
  uint64_t s_[4];
};

// Which tokens may come next (a grammar's verdict); sample() draws only among those it allows.
using TokenFilter = std::function<bool(int32_t)>;
// The same verdict for the whole vocabulary at once (every allowed id, any order): optional, for
// filters that can list their tokens faster than they can be asked one by one.
using AllowedSet = std::function<void(std::vector<int32_t>&)>;

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks a token from one row of logits. `history` is the sequence so far (prompt and generated
  // tokens); only its last repeat_last_n entries matter. `logits` is not modified.
  int32_t sample(const float* logits, int n_vocab, std::span<const int32_t> history);
  // The same draw from the logits with every token `allow` refuses set to -inf, without asking it
  // about the whole vocabulary: candidates are asked best first until the draw is decided (all of
  // them only with top-k off, or all_allowed when it is given and few are allowed). -1 when it
  // allows none.
  int32_t sample(const float* logits, int n_vocab, std::span<const int32_t> history, const TokenFilter& allow,
                 const AllowedSet& all_allowed = {});
  // The same draw from a kTopK row (runtime/batch.h) of K candidates, when top_k_suffices(K) or
  // argmax_only(): given the candidates of the same logits, it returns what sample() returns from
  // the full row. With `allow`, what sample(..., allow) returns, provided the candidates hold
  // enough allowed ones (top_k of them; one when greedy): -1 when none of the K is allowed.
  int32_t sample_top_k(const float* row, int K, const TokenFilter& allow = {});
  const SamplingParams& params() const { return p_; }
  // sample() is the argmax of the raw logits (greedy, no repetition penalty): the pipeline may
  // hand back just the argmax of the row (kArgmaxOnly in runtime/batch.h).
  bool argmax_only() const { return p_.greedy() && !penalizes(); }
  // sample() needs only the K best logits of the row, sorted (kTopK in runtime/batch.h): it draws
  // among its top_k <= K and applies no repetition penalty.
  bool top_k_suffices(int K) const {
    return !p_.greedy() && !penalizes() && p_.mirostat == 0 && p_.top_k > 0 && p_.top_k <= K;
  }

 private:
  // The row is changed before the draw: biases, or penalties with a window to look at.
  bool penalizes() const {
    return !p_.logit_bias.empty() || dry() ||
           ((p_.repeat_penalty != 1.0f || p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f) && p_.repeat_last_n > 0);
  }
  bool dry() const { return p_.dry_multiplier > 0 && p_.dry_penalty_last_n != 0; }
  void dry_penalize(std::span<const int32_t> history, int n_vocab);  // on work_
  // The draw among cand_[0, k), sorted by logit, highest first (top-n-sigma already applied to
  // them when sigma_done: the whole row's deviation, not the candidates'). Unsorted only for
  // typical sampling (the whole row): its kept set is then put in logit order.
  int32_t draw(size_t k, bool sigma_done = false, bool sorted = true);
  // XTC: how many of the best tokens this step drops (0: it does not fire or finds fewer than two
  // at the threshold); prob(i) is the i-th best's probability, n how many there are.
  size_t xtc_drop(size_t n, const std::function<double(size_t)>& prob);
  int32_t sample_row(const float* logits, int n_vocab);  // top-k off: the whole row's softmax
  int32_t full_row(const float* logits, int n_vocab);    // top-k off or Mirostat: the draw from a whole row
  int32_t mirostat(const float* logits, int n_vocab);
  const float* penalized(const float* logits, int n_vocab, std::span<const int32_t> history);
  // cand_ = the best `want` tokens `allow` accepts, in top_k's order; false when there are none.
  bool allowed_best(const float* src, int n_vocab, size_t want, const TokenFilter& allow, const AllowedSet& all);

  SamplingParams p_;
  Rng rng_;
  std::vector<float> work_;               // penalised logits
  std::vector<int32_t> seen_;             // penalized(): the window's tokens
  std::vector<std::pair<int32_t, int>> dry_len_;  // DRY: (token, longest repeat it would continue)
  std::vector<float> masked_;             // top-k off with a filter: the refused tokens at -inf
  std::vector<int32_t> allowed_;          // AllowedSet's answer
  std::vector<float> prob_;               // sample_row(): the row's probabilities
  std::vector<std::pair<float, int32_t>> cand_;  // (logit or prob, token)
  std::vector<int32_t> top_idx_;                 // cpu::top_k's output
  std::vector<float> top_val_;
  std::vector<double> draw_prob_;               // draw(): the candidates' probabilities
  std::vector<size_t> typical_;                 // draw(): the typical set's candidates
  std::vector<std::pair<double, size_t>> typical_key_;  // draw(): (distance from the entropy, candidate)
  float mu_ = 0;                                // Mirostat's cut-off surprise (2 tau at the start)
  Rng xtc_rng_;                                 // XTC's coin, apart from the draws' stream
};

}  // namespace baton
