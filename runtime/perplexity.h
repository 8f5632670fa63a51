// Perplexity of a text (`baton perplexity`), computed the way llama-perplexity computes it so the
// two compare number for number: the text's tokens are cut into chunks of n_ctx, each chunk is
// evaluated from an empty cache (its first token replaced by BOS when the model adds one), and the
// second half of each chunk is scored: the negative log-likelihood of token j + 1 under the logits
// at position j, for j in [n_ctx/2, n_ctx - 1). Perplexity is e^(mean NLL).
//
// A second run can compare itself with a first one token by token: the first writes every scored
// row's log-probabilities to a base file (`--save-base`), the second (usually a smaller quant of
// the same model) reads them (`--kl-base`) and reports the KL divergence of its distribution from
// the base's, and how often both rank the same token first.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace baton {

class Pipeline;

// Scored rows evaluated (and held as floats) at a time: a chunk goes through the pipeline in pieces
// of at most this many output rows, so a pipeline loaded with n_outputs = this needs no more.
constexpr int kPerplexityPieceRows = 128;

struct PerplexityOptions {
  int n_ctx = 512;       // tokens per chunk (the pipeline's context must hold them)
  int max_chunks = -1;   // at most this many chunks (-1: all the text has)
  int n_threads = 1;     // threads that score the logits rows (1 while several chunks are in flight)
  std::string save_base; // write the scored rows' log-probabilities (and the tokens) here
  std::string kl_base;   // compare with the rows of this base file
};

// Running totals over the scored tokens.
struct PerplexityStats {
  int chunks = 0;            // chunks evaluated so far
  int64_t count = 0;         // tokens scored
  double nll = 0, nll2 = 0;  // sums of -log p(token) and of its square
  // Against a base file (count rows each):
  double base_nll = 0, base_nll2 = 0, cross = 0;  // the base's NLL sums; Σ nll·base_nll (correlation)
  double kld = 0, kld2 = 0;                      // Σ KL(base ‖ this) and of its square
  int64_t same_top = 0;                          // rows whose most probable token is the base's
  std::vector<float> kld_values;                 // every row's KL divergence (for percentiles)

  double ppl() const;        // e^(nll / count)
  double ppl_error() const;  // its standard error (as llama-perplexity: ppl × the NLL's standard error)
  double base_ppl() const;
  double kld_mean() const;
  double kld_error() const;  // standard error of the mean
  double same_top_fraction() const;
  // Pearson correlation of the per-token NLLs of this run and the base's.
  double nll_correlation() const;
};

// The negative log-likelihood of `token` under a row of logits (log-softmax in double).
double token_nll(const float* logits, int n_vocab, int32_t token);

// How many chunks `n_tokens` tokens make at n_ctx per chunk (capped by max_chunks).
int perplexity_chunks(size_t n_tokens, const PerplexityOptions& opt);

// Scores `tokens` (the whole text, tokenized with the model's BOS) through the pipeline, one chunk
// per sequence slot, up to min(n_seq, max_in_flight) chunks in flight. `on_chunk` gets the totals
// after each chunk, in order. Error(Usage) before anything runs: fewer tokens than n_ctx, n_ctx
// below 4 or above the pipeline's context, an unreadable or mismatched base file (another n_ctx,
// vocabulary or text). With the cancel flag set, stops between chunks and returns what it has.
PerplexityStats perplexity(Pipeline& p, const std::vector<int32_t>& tokens, const PerplexityOptions& opt,
                           const std::function<void(const PerplexityStats&)>& on_chunk,
                           const std::atomic<bool>* cancel = nullptr);

}  // namespace baton
