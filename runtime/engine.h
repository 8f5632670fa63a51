// The engine under `run`, `chat` and `batch`: sequences, scheduling, sampling, stop handling and
// streaming over a Pipeline. Requests are token prompts; each owns a KV-cache slot while it runs.
// Up to N requests decode together in one batched Pipeline::decode per step; a finished request
// leaves at once and the next one joins, its prompt evaluated in chunks next to the decoders.
// A slot remembers what it has cached, so a later prompt that starts the same way (the next turn of
// a chat) only evaluates what is new.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/sampler.h"

namespace baton {

struct Batch;
class Grammar;
class Pipeline;
class TokenTrie;
class Tokenizer;

enum class FinishReason { Stop, Length, Context, Cancelled };
const char* to_string(FinishReason f);  // "stop", "length", "context", "cancelled"

// Text of generated ids, streamed: push returns what can be shown now (never half a character).
class TokenStream {
 public:
  virtual ~TokenStream() = default;
  virtual std::string push(int32_t id) = 0;
  virtual std::string flush() = 0;
};

// What the engine needs from a vocabulary. Tests supply a toy one; real models use tokenizer_vocab.
class Vocab {
 public:
  virtual ~Vocab() = default;
  virtual bool is_eog(int32_t id) const = 0;
  virtual std::unique_ptr<TokenStream> stream() const = 0;
  // The bytes a token adds to the reply's text ("" for tokens that show nothing), and whether a
  // reply's first token loses a leading space (SentencePiece): what a grammar is checked against.
  virtual std::string_view piece(int32_t id) const = 0;
  virtual bool strips_first_space() const { return false; }
  // Replies in OpenAI's harmony format (gpt-oss): the stream writes the format's markers out
  // (<|channel|>, <|message|>, ...) and the engine splits the reasoning from the answer with them.
  virtual bool harmony() const { return false; }
};
std::unique_ptr<Vocab> tokenizer_vocab(const Tokenizer& tok);

// The most alternatives a request may ask for with each token's logprob (OpenAI's top_logprobs limit).
constexpr int kMaxTopLogprobs = 20;

// A generated token's log-probability under the model: the log-softmax of its raw logits (before
// penalties, biases, temperature and truncation), and the most likely tokens' beside it.
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // (id, logprob), best first (ties: lower id first)
};

struct Request {
  std::vector<int32_t> prompt;
  SamplingParams sampling;            // sampling.seed is used as given
  int max_tokens = -1;                // < 0: until end of generation or the context end
  std::vector<std::string> stop;      // stop strings (not part of the returned text)
  std::shared_ptr<const Grammar> grammar;  // if set, the reply is a prefix of one of its sentences
                                           // and ends when the grammar allows nothing more
  bool ignore_eos = false;            // never sample an end-of-generation token (the reply runs to
                                      // max_tokens, a stop string or the context's end; a grammar
                                      // that is complete may still end it)
  int logprobs = -1;                  // >= 0: each generated token's logprob in Result::logprobs,
                                      // with this many alternatives (0..kMaxTopLogprobs); the
                                      // pipeline then hands back whole rows
  std::function<void(std::string_view)> on_text;  // streamed text, already stop-filtered
  std::function<void(std::string_view)> on_reasoning;  // harmony replies: the reasoning, streamed
  // Set from any thread: this request stops between steps (its compute too) and finishes as
  // Cancelled, the others go on (a server's client that went away). Null: only the engine's flag.
  std::shared_ptr<const std::atomic<bool>> cancel;
  uint64_t tag = 0;                   // caller's id, returned in the Result
};

struct Result {
  uint64_t tag = 0;
  std::string error;                  // non-empty: the request was rejected (nothing generated), or
                                      // its grammar let no token of the vocabulary go on
  std::string text;                   // the answer (harmony replies: the final channel)
  std::string reasoning;              // harmony replies: the analysis (and any other non-final channel)
  std::vector<int32_t> tokens;        // generated ids (an end-of-generation token not included)
  std::vector<TokenLogprob> logprobs; // Request::logprobs >= 0: one per token of `tokens`
  FinishReason finish = FinishReason::Stop;
  int prompt_tokens = 0;              // prompt length
  int prompt_evaluated = 0;           // of those, evaluated now (the rest was already cached)
  int ctx_used = 0;                   // tokens in the KV cache at the end (prompt + evaluated reply)
  int n_ctx = 0;
  uint64_t seed = 0;
  double prompt_ms = 0;               // admission → prompt evaluated
  double ttft_ms = 0;                 // admission → first token sampled
  double gen_ms = 0;                  // first token → finished
  double total_ms = 0;                // admission → finished
  int drafted = 0;                    // prompt lookup (EngineOptions::lookup): tokens drafted,
  int draft_accepted = 0;             // and of those, the ones the model confirmed
  int completion_tokens() const { return int(tokens.size()); }
  double prompt_tps() const { return prompt_ms > 0 ? prompt_evaluated * 1000.0 / prompt_ms : 0; }
  // Tokens after the first over the time after the first: the steady decode rate.
  double gen_tps() const { return gen_ms > 0 && tokens.size() > 1 ? (tokens.size() - 1) * 1000.0 / gen_ms : 0; }
};

// Where a decoder's drafts come from when not from prompt lookup: a draft model
// (runtime/draft_model.h), or a test's stand-in. Called from the engine's thread.
class Drafter {
 public:
  virtual ~Drafter() = default;
  // Up to max_len (> 0) tokens likely to follow `history` (the prompt and the reply so far, the
  // token about to be evaluated last) in KV slot `slot`, appended to `out` (empty on entry).
  virtual void draft(int slot, const std::vector<int32_t>& history, size_t max_len, std::vector<int32_t>& out) = 0;
  // The decoders of one step together (distinct slots): by default one draft() each; a draft model
  // guesses for all of them in shared forwards.
  struct Job {
    int slot;
    const std::vector<int32_t>* history;
    size_t max_len;
    std::vector<int32_t>* out;
  };
  virtual void draft_many(const std::vector<Job>& jobs) {
    for (const Job& j : jobs) draft(j.slot, *j.history, j.max_len, *j.out);
  }
};

struct EngineOptions {
  // Most prompt tokens evaluated in one step. Smaller keeps running decoders moving while a
  // newcomer's prompt is processed; larger evaluates long prompts faster.
  int prefill_chunk = 256;
  // Speculative decoding by prompt lookup: a decoder whose last few tokens (lookup_ngram_max down
  // to lookup_ngram_min of them) occurred earlier in its prompt or reply drafts the up to `lookup`
  // tokens that followed there, and its step evaluates them behind its sampled token. Each row is
  // sampled as it would have been one step at a time and the drafts are kept while they agree, so
  // the reply is the same as without drafts (sampled ones too, seed for seed); what disagrees
  // leaves the KV cache. A step then yields up to lookup + 1 tokens for about the weight traffic
  // of one. 0: off.
  int lookup = 0;
  int lookup_ngram_min = 2, lookup_ngram_max = 4;
  // Drafts from this instead of prompt lookup (a draft model: `--draft-model`); `lookup` is then
  // the most tokens it drafts a step. The same contract: replies do not change.
  std::shared_ptr<Drafter> drafter;
  // A request whose prompt starts as what another slot holds copies that start into its own slot
  // instead of evaluating it (Batch::copies; the pipeline must make copies, Pipeline::copy_limit).
  // The KV rows are copied bit for bit, so replies do not change.
  bool share_prefixes = true;
};

// Prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens of
// `history` (the longest n in [ngram_min, ngram_max] that occurred), at most max_len of them; a
// continuation that reaches the end of the history goes on with itself (a repeating stretch is
// drafted as repeating). Empty when the last tokens occurred nowhere before.
void lookup_draft(const std::vector<int32_t>& history, int ngram_min, int ngram_max, size_t max_len,
                  std::vector<int32_t>& out);

class Engine {
 public:
  Engine(Pipeline& pipe, const Vocab& vocab, EngineOptions opt = {});
  ~Engine();

  // One request on KV slot `slot`, reusing the longest prefix of its prompt the slot holds.
  // The cancel flag is read between steps: setting it stops the compute and returns what was
  // generated with finish = Cancelled.
  Result generate(Request req, const std::atomic<bool>* cancel = nullptr, int slot = 0);

  // Continuous batching: pulls requests from `next` until it returns nullopt and runs up to
  // `parallel` of them at once; `done` gets each result as soon as its request finishes (also
  // rejected ones). With the cancel flag set, running requests finish as Cancelled and no new
  // request is pulled.
  using Source = std::function<std::optional<Request>()>;
  using Sink = std::function<void(Result&&)>;
  void run(const Source& next, const Sink& done, int parallel, const std::atomic<bool>* cancel = nullptr);
  // The same for a source that stays open (a server): nullopt means "nothing now" while requests
  // are running, and ends the run only when none is (so `next` should wait for work, or for the
  // end, when every request it handed out has reached `done`).
  void serve(const Source& next, const Sink& done, int parallel, const std::atomic<bool>* cancel = nullptr);

  // What a slot holds in its KV cache; forget() empties it.
  const std::vector<int32_t>& cached(int slot) const { return cached_.at(slot); }
  void forget(int slot);
  int n_ctx() const { return n_ctx_; }
  int n_seq() const { return int(cached_.size()); }

 private:
  struct Active;
  struct Step;
  bool build_step(std::deque<std::unique_ptr<Active>>& active, size_t cap, Step& st);
  void run_slots(const Source& next, const Sink& done, std::vector<int> slots, const std::atomic<bool>* cancel,
                 bool keep_open = false);
  bool admit(Active& a);
  size_t draft_room(const Active& a, size_t budget) const;
  // A request waits for an earlier one evaluating a start they share when it is this much longer
  // than what it can copy now.
  static constexpr size_t kSharedWait = 16;
  bool share_prefix(const std::deque<std::unique_ptr<Active>>& active,
                    std::deque<std::unique_ptr<Active>>::const_iterator self, Batch& batch);
  void end_step(Active& a);
  void finish(Active& a, FinishReason why);
  void accept(Active& a, int32_t token);
  // The vocabulary's pieces for grammars (first: as a reply's first token shows them), built on
  // first use.
  const TokenTrie& trie(bool first);
  // DRY's breakers as a flag per token (a token whose piece holds one of the strings), built once
  // per list of strings.
  std::shared_ptr<const std::vector<bool>> dry_breakers(const std::vector<std::string>& breakers);

  Pipeline& pipe_;
  const Vocab& vocab_;
  EngineOptions opt_;
  int n_ctx_ = 0;
  int n_vocab_ = 0;
  int n_eog_ = 0;  // end-of-generation tokens in the vocabulary (what ignore_eos refuses)
  std::vector<std::vector<int32_t>> cached_;  // per slot: tokens in its KV cache, in order
  std::vector<size_t> submitted_;             // per slot: cached_'s length before the step being built
  std::unique_ptr<TokenTrie> trie_, trie_first_;
  std::vector<int32_t> eog_ids_;              // with trie_: the end-of-generation tokens
  std::vector<std::pair<std::vector<std::string>, std::shared_ptr<const std::vector<bool>>>> dry_breakers_;
};

}  // namespace baton
