#include "runtime/engine.h"

#include <algorithm>

#include "gguf/error.h"
#include "kernels/cpu/ops.h"
#include "runtime/batch.h"
#include "runtime/grammar.h"
#include "runtime/harmony.h"
#include "runtime/pipeline.h"
#include "runtime/stop.h"

namespace baton {

using Clock = std::chrono::steady_clock;
static double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

const char* to_string(FinishReason f) {
  switch (f) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Context: return "context";
    case FinishReason::Cancelled: return "cancelled";
  }
  return "?";
}

void lookup_draft(const std::vector<int32_t>& h, int ngram_min, int ngram_max, size_t max_len,
                  std::vector<int32_t>& out) {
  out.clear();
  const size_t len = h.size();
  for (int n = std::max(ngram_max, 1); n >= std::max(ngram_min, 1) && max_len > 0; n--) {
    if (len <= size_t(n)) continue;
    const int32_t* key = h.data() + (len - size_t(n));
    for (size_t i = len - size_t(n); i-- > 0;) {  // the latest occurrence first
      if (h[i] != key[0] || !std::equal(key, key + n, h.data() + i)) continue;
      // What followed it; past the history's end, the draft itself (from + m - len < m).
      const size_t from = i + size_t(n);
      for (size_t m = 0; m < max_len; m++) out.push_back(from + m < len ? h[from + m] : out[from + m - len]);
      return;
    }
  }
}

// A request while it holds a slot.
struct Engine::Active {
  Request req;
  Result res;
  Sampler sampler;
  StopMatcher stop;
  std::unique_ptr<TokenStream> text;
  std::optional<HarmonyParser> channels;  // harmony replies: reasoning apart from the answer
  std::optional<GrammarState> grammar;
  int slot = -1;
  std::vector<int32_t> history;  // prompt + generated: what the repetition penalty looks at
  size_t next_prompt = 0;        // first prompt token not yet evaluated
  bool looked_for_prefix = false;  // share_prefix has been tried (before its first prompt chunk)
  int32_t pending = -1;          // sampled, to be evaluated in the next step
  TokenLogprob logprob;          // Request::logprobs: the token take() returned, from its row
  std::vector<int32_t> draft;    // prompt lookup: drafted behind `pending` in the step in flight
  size_t step_row = 0;           // its rows of that step looked at so far
  int draft_len = 1;             // how many to draft next (end_step adapts it to how drafts fare)
  bool waiting = false;          // a token whose logits it needs is in the pipeline
  bool done = false;
  Clock::time_point t_admit, t_first;

  Active(Request&& r, std::unique_ptr<TokenStream> ts)
      : req(std::move(r)), sampler(req.sampling), stop(req.stop), text(std::move(ts)) {}
  bool prefilling() const { return next_prompt < req.prompt.size(); }
  bool cancelled() const { return req.cancel && req.cancel->load(std::memory_order_relaxed); }
  // What its output rows hold: a greedy request takes only the argmax from the pipeline, a
  // top-k one only the best candidates (runtime/batch.h), the others the full row. With
  // ignore_eos the candidates less the n_eog end tokens must still decide the draw; a grammar
  // may refuse any number of them, so it takes the full row.
  uint8_t out_mode(int n_vocab, int n_eog) const {
    if (grammar || req.logprobs >= 0) return kLogitsRow;
    const int K = top_k_candidates(n_vocab);
    if (req.ignore_eos)
      return (sampler.argmax_only() && K > n_eog) || sampler.top_k_suffices(K - n_eog) ? kTopK : kLogitsRow;
    if (sampler.argmax_only()) return kArgmaxOnly;
    return sampler.top_k_suffices(K) ? kTopK : kLogitsRow;
  }
  // A token's bytes as the grammar sees them: the reply's text, so without the space a
  // SentencePiece reply's first token loses.
  std::string_view grammar_piece(const Vocab& vocab, int32_t t) const {
    std::string_view p = vocab.piece(t);
    if (res.tokens.empty() && vocab.strips_first_space() && !p.empty() && p[0] == ' ') p.remove_prefix(1);
    return p;
  }
  // The next token; -1 (with res.error set) when the grammar allows none. With Request::logprobs,
  // its logprob (and the best alternatives') from the row, for accept() to keep.
  int32_t take(const float* row, int n_vocab, Engine& e) {
    const int32_t t = pick(row, n_vocab, e);
    if (t >= 0 && req.logprobs >= 0) {
      const float lse = float(cpu::log_sum_exp(row, n_vocab));
      logprob.id = t;
      logprob.logprob = row[t] - lse;
      const int k = std::min(req.logprobs, n_vocab);
      std::vector<int32_t> ids(static_cast<size_t>(k));
      std::vector<float> vals(static_cast<size_t>(k));
      const int found = k > 0 ? cpu::top_k(row, n_vocab, k, ids.data(), vals.data()) : 0;
      logprob.top.clear();
      for (int i = 0; i < found; i++) logprob.top.push_back({ids[size_t(i)], vals[size_t(i)] - lse});
    }
    return t;
  }
  int32_t pick(const float* row, int n_vocab, Engine& e) {
    const uint8_t mode = out_mode(n_vocab, e.n_eog_);
    if (req.ignore_eos && mode == kTopK) {
      const int32_t t = sampler.sample_top_k(row, top_k_candidates(n_vocab), [&](int32_t id) { return !e.vocab_.is_eog(id); });
      if (t < 0) res.error = "every token of the vocabulary ends generation (--ignore-eos)";
      return t;
    }
    if (mode == kLogitsRow && (grammar || req.ignore_eos)) {
      const Vocab& vocab = e.vocab_;
      try {
        auto allow = [&](int32_t id) {
          if (vocab.is_eog(id)) return grammar && grammar->complete();  // (only a grammar asked for it)
          return !grammar || grammar->allows(grammar_piece(vocab, id));
        };
        auto all = [&](std::vector<int32_t>& ids) {
          grammar->allowed(e.trie(res.tokens.empty()), ids);
          if (grammar->complete()) ids.insert(ids.end(), e.eog_ids_.begin(), e.eog_ids_.end());
        };
        const int32_t t = sampler.sample(row, n_vocab, history, allow, grammar ? AllowedSet(all) : AllowedSet());
        if (t < 0) res.error = grammar ? "grammar: no token of the vocabulary can continue the reply"
                                       : "every token of the vocabulary ends generation (--ignore-eos)";
        return t;
      } catch (const Error& err) {
        res.error = err.what();
        return -1;
      }
    }
    switch (mode) {
      case kArgmaxOnly: return argmax_token(row);
      case kTopK: return sampler.sample_top_k(row, top_k_candidates(n_vocab));
      default: return sampler.sample(row, n_vocab, history);
    }
  }
  void emit(const std::string& s) {
    if (s.empty()) return;
    res.text += s;
    if (req.on_text) req.on_text(s);
  }
  // Reply text as it is decoded: a harmony reply's reasoning goes aside, the answer through the
  // stop strings to emit().
  void add_text(const std::string& s) {
    if (channels) route(channels->push(s));
    else emit(stop.push(s));
  }
  void route(const std::vector<ReplyChunk>& chunks) {
    for (const ReplyChunk& c : chunks) {
      if (c.part == ReplyPart::Answer) {
        emit(stop.push(c.text));
        continue;
      }
      res.reasoning += c.text;
      if (req.on_reasoning) req.on_reasoning(c.text);
    }
  }
};

Engine::Engine(Pipeline& pipe, const Vocab& vocab, EngineOptions opt)
    : pipe_(pipe), vocab_(vocab), opt_(opt), n_ctx_(pipe.n_ctx()), n_vocab_(pipe.n_vocab()) {
  BATON_CHECK(n_ctx_ > 0 && n_vocab_ > 0 && pipe.n_seq() > 0);
  if (opt_.prefill_chunk < 1) opt_.prefill_chunk = 1;
  cached_.resize(pipe.n_seq());
  for (int s = 0; s < pipe.n_seq(); s++) cached_[s].reserve(64);
  for (int32_t i = 0; i < n_vocab_; i++) n_eog_ += vocab_.is_eog(i);
}

Engine::~Engine() = default;

const TokenTrie& Engine::trie(bool first) {
  if (!trie_) {
    std::vector<std::string_view> pieces(static_cast<size_t>(n_vocab_));
    for (int32_t i = 0; i < n_vocab_; i++) {
      if (vocab_.is_eog(i)) eog_ids_.push_back(i);
      else pieces[size_t(i)] = vocab_.piece(i);
    }
    trie_ = std::make_unique<TokenTrie>(pieces);
    if (vocab_.strips_first_space()) {
      for (auto& p : pieces)
        if (!p.empty() && p[0] == ' ') p.remove_prefix(1);
      trie_first_ = std::make_unique<TokenTrie>(pieces);
    }
  }
  return first && trie_first_ ? *trie_first_ : *trie_;
}

std::shared_ptr<const std::vector<bool>> Engine::dry_breakers(const std::vector<std::string>& breakers) {
  for (const auto& [list, flags] : dry_breakers_)
    if (list == breakers) return flags;
  auto flags = std::make_shared<std::vector<bool>>(size_t(n_vocab_));
  for (int32_t t = 0; t < n_vocab_; t++) {
    const std::string_view p = vocab_.piece(t);
    (*flags)[size_t(t)] = std::any_of(breakers.begin(), breakers.end(),
                                      [&](const std::string& b) { return !b.empty() && p.find(b) != std::string_view::npos; });
  }
  dry_breakers_.push_back({breakers, flags});
  return flags;
}

void Engine::forget(int slot) {
  pipe_.truncate_seq(slot, 0);
  cached_.at(slot).clear();
}

Result Engine::generate(Request req, const std::atomic<bool>* cancel, int slot) {
  if (slot < 0 || slot >= n_seq()) fail(ErrorKind::Usage, "slot {} out of range (0..{})", slot, n_seq() - 1);
  std::optional<Request> one(std::move(req));
  Result out;
  run_slots([&]() { std::optional<Request> r; r.swap(one); return r; },
            [&](Result&& r) { out = std::move(r); }, {slot}, cancel);
  if (one) {  // cancelled before it was taken: nothing evaluated, nothing generated
    out.tag = one->tag;
    out.seed = one->sampling.seed;
    out.n_ctx = n_ctx_;
    out.prompt_tokens = int(one->prompt.size());
    out.finish = FinishReason::Cancelled;
  }
  return out;
}

static std::vector<int> first_slots(int parallel, int n_seq) {
  if (parallel < 1 || parallel > n_seq)
    fail(ErrorKind::Usage, "parallel must be 1..{} (the pipeline was loaded with {} sequence slots), got {}",
         n_seq, n_seq, parallel);
  std::vector<int> slots(static_cast<size_t>(parallel));
  for (int i = 0; i < parallel; i++) slots[size_t(i)] = i;
  return slots;
}

void Engine::run(const Source& next, const Sink& done, int parallel, const std::atomic<bool>* cancel) {
  run_slots(next, done, first_slots(parallel, n_seq()), cancel);
}

void Engine::serve(const Source& next, const Sink& done, int parallel, const std::atomic<bool>* cancel) {
  run_slots(next, done, first_slots(parallel, n_seq()), cancel, /*keep_open=*/true);
}

// Binds a request to its slot: checks it fits, keeps the cached prefix it shares with the slot.
bool Engine::admit(Active& a) {
  auto& r = a.res;
  r.tag = a.req.tag;
  r.seed = a.req.sampling.seed;
  r.n_ctx = n_ctx_;
  r.prompt_tokens = int(a.req.prompt.size());
  if (a.req.prompt.empty()) {
    r.error = "empty prompt (no tokens to start from)";
    return false;
  }
  if (int(a.req.prompt.size()) > n_ctx_) {
    r.error = fmt::format("prompt is {} tokens but the context holds {} (use a larger --ctx or a shorter prompt)",
                          a.req.prompt.size(), n_ctx_);
    return false;
  }
  if (a.req.max_tokens < -1) {
    r.error = fmt::format("max_tokens {} must be >= -1 (-1: until the model stops or the context is full)",
                          a.req.max_tokens);
    return false;
  }
  if (a.req.logprobs > kMaxTopLogprobs) {
    r.error = fmt::format("top_logprobs {} is more than {}", a.req.logprobs, kMaxTopLogprobs);
    return false;
  }
  if (std::string e = a.req.sampling.validate(n_vocab_); !e.empty()) {
    r.error = e;
    return false;
  }
  for (int32_t t : a.req.prompt)
    if (t < 0 || t >= n_vocab_) {
      r.error = fmt::format("prompt token {} is outside the vocabulary (0..{})", t, n_vocab_ - 1);
      return false;
    }
  if (a.req.grammar) {
    try {
      a.grammar.emplace(a.req.grammar);
    } catch (const Error& e) {
      r.error = e.what();
      return false;
    }
  }
  auto& have = cached_[a.slot];
  size_t common = 0;
  while (common < have.size() && common < a.req.prompt.size() && have[common] == a.req.prompt[common]) common++;
  // The last prompt token is always evaluated again: its logits start the reply.
  common = std::min(common, a.req.prompt.size() - 1);
  // A cache that cannot be rewound that far (sliding-window rings) starts the slot over.
  if (common > 0 && have.size() - common > size_t(pipe_.max_rewind())) common = 0;
  if (common < have.size()) {
    pipe_.truncate_seq(a.slot, int(common));
    have.resize(common);
  }
  a.next_prompt = common;
  a.history = a.req.prompt;
  r.prompt_evaluated = int(a.req.prompt.size() - common);
  return true;
}

void Engine::finish(Active& a, FinishReason why) {
  if (a.done) return;
  // Text held back for a possible stop string or a split character is real text after all.
  if (!a.stop.stopped()) {
    a.add_text(a.text->flush());
    if (a.channels) a.route(a.channels->flush());
    a.emit(a.stop.flush());
  }
  auto now = Clock::now();
  a.res.finish = why;
  a.res.ctx_used = int(cached_[a.slot].size());
  a.res.total_ms = ms_between(a.t_admit, now);
  if (!a.res.tokens.empty()) a.res.gen_ms = ms_between(a.t_first, now);
  a.pending = -1;
  a.done = true;
}

// One sampled token: stop conditions, streaming, and whether it can be evaluated next.
void Engine::accept(Active& a, int32_t t) {
  if (a.req.max_tokens == 0) return finish(a, FinishReason::Length);  // the prompt only, as llama.cpp's -n 0
  if (a.res.tokens.empty() && !vocab_.is_eog(t)) a.t_first = Clock::now();
  if (vocab_.is_eog(t)) return finish(a, FinishReason::Stop);
  if (a.grammar) BATON_CHECK(a.grammar->accept(a.grammar_piece(vocab_, t)));  // sampled among allowed ones
  a.res.tokens.push_back(t);
  if (a.req.logprobs >= 0) a.res.logprobs.push_back(std::move(a.logprob));
  a.history.push_back(t);
  a.add_text(a.text->push(t));
  if (a.stop.stopped() || (a.channels && a.channels->ended())) return finish(a, FinishReason::Stop);
  if (a.grammar && a.grammar->finished()) return finish(a, FinishReason::Stop);
  if (a.req.max_tokens >= 0 && a.res.completion_tokens() >= a.req.max_tokens) return finish(a, FinishReason::Length);
  a.pending = t;
  // The token goes at position cached.size(); a full cache cannot take it.
  if (int(cached_[a.slot].size()) >= n_ctx_) return finish(a, FinishReason::Context);
}

// How many tokens a decoder may draft behind its pending one (already in `cached`): no further than
// the context's end, than it may still generate, than the caches can rewind (sliding-window
// rings), or than the step's budget allows.
size_t Engine::draft_room(const Active& a, size_t budget) const {
  if (opt_.lookup <= 0) return 0;
  size_t room = std::min(size_t(std::min(a.draft_len, opt_.lookup)), budget);
  room = std::min(room, size_t(n_ctx_) - cached_[a.slot].size());
  if (a.req.max_tokens >= 0) room = std::min(room, size_t(std::max(0, a.req.max_tokens - a.res.completion_tokens() - 1)));
  return std::min(room, size_t(std::max(0, pipe_.max_rewind())));
}

// A decoder's step ended at one of its rows: the drafts the model did not confirm leave the
// pipeline's caches (the engine never counted them in `cached_`).
void Engine::end_step(Active& a) {
  // The next draft: longer after one wholly confirmed (doubling up to the limit), else one more
  // than this one kept, so that a stretch the drafts miss costs little and a copied one soon runs
  // at the full length.
  if (!a.draft.empty() && a.step_row > 0) {
    const int kept = int(a.step_row) - 1;
    a.draft_len = kept == int(a.draft.size()) ? std::min(2 * a.draft_len, opt_.lookup) : kept + 1;
  }
  a.draft.clear();
  const int keep = int(cached_[a.slot].size());
  if (pipe_.seq_len(a.slot) > keep) pipe_.truncate_seq(a.slot, keep);
}

// Before a request's first prompt chunk: if another slot holds (from earlier steps) a longer start
// of its prompt than its own slot kept, that start is copied into its slot (Batch::copies) instead
// of evaluated again — batch requests sharing a system prompt or few-shot examples evaluate them
// once. While a request admitted before it is still evaluating a longer shared start, it waits
// (returns false) so that the start is evaluated once, not side by side.
bool Engine::share_prefix(const std::deque<std::unique_ptr<Active>>& active,
                          std::deque<std::unique_ptr<Active>>::const_iterator self, Batch& batch) {
  Active& a = **self;
  const auto& prompt = a.req.prompt;
  const size_t limit = prompt.size() - 1;  // the last prompt token is evaluated for its logits
  auto common = [&](const std::vector<int32_t>& v, size_t n) {
    n = std::min(n, limit);
    size_t c = 0;
    while (c < n && v[c] == prompt[c]) c++;
    return c;
  };
  const size_t copy_limit = size_t(std::max(0, pipe_.copy_limit()));
  size_t best = a.next_prompt;
  int from = -1;
  if (opt_.share_prefixes && copy_limit > 0) {
    // How long a slot may be when the copy reaches the stages: what the pipeline has been given,
    // or what this round's steps give it, drafts included (a ring must still hold position 0).
    const size_t drafts = opt_.lookup > 0 ? size_t(std::min(opt_.lookup, std::max(0, pipe_.max_rewind()))) : 0;
    for (size_t s = 0; s < cached_.size(); s++) {
      const size_t longest = std::max(size_t(pipe_.seq_len(int(s))), cached_[s].size() + drafts);
      if (int(s) == a.slot || longest > copy_limit) continue;
      const size_t c = common(cached_[s], submitted_[s]);
      if (c > best) best = c, from = int(s);
    }
    for (auto it = active.begin(); it != self; ++it) {
      const Active& b = **it;
      const size_t c = common(b.req.prompt, b.req.prompt.size());
      if (c >= best + kSharedWait && submitted_[size_t(b.slot)] < c && b.req.prompt.size() < copy_limit) return false;
    }
  }
  a.looked_for_prefix = true;
  if (from < 0) return true;
  batch.copies.push_back({from, a.slot, int32_t(best)});
  auto& mine = cached_[size_t(a.slot)];
  mine.assign(cached_[size_t(from)].begin(), cached_[size_t(from)].begin() + std::ptrdiff_t(best));
  submitted_[size_t(a.slot)] = best;
  a.next_prompt = best;
  a.res.prompt_evaluated = int(prompt.size() - best);
  return true;
}

// One batch in the pipeline: what was submitted and whose logits rows come back.
struct Engine::Step {
  uint64_t ticket = 0;
  Batch batch;
  std::vector<float> logits;
  std::vector<Active*> rows;                        // which request each logits row belongs to
  std::vector<std::pair<Active*, bool>> chunks;     // prompt chunks: (request, its last chunk)
  bool evaluated = false;                           // ran synchronously: nothing to wait for
  bool uses(const Active* a) const {
    return std::find(rows.begin(), rows.end(), a) != rows.end() ||
           std::any_of(chunks.begin(), chunks.end(), [&](const auto& c) { return c.first == a; });
  }
};

// Builds the next batch from requests that have something to evaluate: at most `cap` decoders
// whose last token is not still in flight, then prompt chunks up to the prefill budget (a prompt
// may have several chunks in flight, since the pipeline keeps each sequence's tokens in order).
// The tokens count as cached from here on: the next batch continues after them.
bool Engine::build_step(std::deque<std::unique_ptr<Active>>& active, size_t cap, Step& st) {
  st.batch.clear();
  st.rows.clear();
  st.chunks.clear();
  int budget = opt_.prefill_chunk;
  // Drafts take at most half of it, so that a newcomer's prompt keeps moving next to decoders
  // drafting at full length.
  int draft_budget = opt_.prefill_chunk / 2;
  // What each slot held before this step: a copy may only take positions earlier steps submitted.
  submitted_.resize(cached_.size());
  for (size_t s = 0; s < cached_.size(); s++) submitted_[s] = cached_[s].size();
  // The decoders first: each one's pending token, then what it drafts behind it (each draft with
  // its own output row; drafts join `cached` only once the model has confirmed them, end_step).
  // Prompt lookup drafts on the spot; a drafter gets every decoder's room at once, so that a draft
  // model guesses for all of them in shared forwards, and gives back what it did not use.
  std::vector<Active*> decoding;
  std::vector<Drafter::Job> jobs;
  for (auto& a : active) {
    if (a->pending < 0 || a->waiting || decoding.size() == cap || a->cancelled()) continue;
    decoding.push_back(a.get());
    cached_[a->slot].push_back(a->pending);
    a->draft.clear();
    const size_t room = draft_room(*a, size_t(std::max(draft_budget, 0)));
    if (room == 0) continue;
    if (opt_.drafter) {
      jobs.push_back({a->slot, &a->history, room, &a->draft});
      budget -= int(room);
      draft_budget -= int(room);
    } else {
      lookup_draft(a->history, opt_.lookup_ngram_min, opt_.lookup_ngram_max, room, a->draft);
      budget -= int(a->draft.size());
      draft_budget -= int(a->draft.size());
    }
  }
  if (!jobs.empty()) {
    opt_.drafter->draft_many(jobs);
    for (const Drafter::Job& j : jobs) {
      if (j.out->size() > j.max_len) j.out->resize(j.max_len);
      budget += int(j.max_len - j.out->size());
    }
  }
  for (Active* a : decoding) {
    const uint8_t mode = a->out_mode(n_vocab_, n_eog_);
    const size_t pos = cached_[a->slot].size() - 1;  // the pending token's
    st.batch.add(a->pending, int32_t(pos), a->slot, mode);
    st.rows.push_back(a);
    for (size_t i = 0; i < a->draft.size(); i++) {
      st.batch.add(a->draft[i], int32_t(pos + 1 + i), a->slot, mode);
      st.rows.push_back(a);
    }
    a->res.drafted += int(a->draft.size());
    a->step_row = 0;
    a->pending = -1;
    a->waiting = true;
  }
  for (auto it = active.begin(); it != active.end(); ++it) {
    auto& a = *it;
    if (!a->prefilling() || budget <= 0 || a->cancelled()) continue;
    if (!a->looked_for_prefix && !share_prefix(active, it, st.batch)) continue;  // waits for a shared start
    size_t take = std::min(a->req.prompt.size() - a->next_prompt, size_t(budget));
    size_t pos = cached_[a->slot].size();
    for (size_t i = 0; i < take; i++) {
      size_t k = a->next_prompt + i;
      bool last = k + 1 == a->req.prompt.size();
      st.batch.add(a->req.prompt[k], int32_t(pos + i), a->slot, last ? a->out_mode(n_vocab_, n_eog_) : uint8_t(kNoLogits));
      cached_[a->slot].push_back(a->req.prompt[k]);
      if (last) {
        st.rows.push_back(a.get());
        a->waiting = true;
      }
    }
    a->next_prompt += take;
    st.chunks.push_back({a.get(), !a->prefilling()});
    budget -= int(take);
  }
  if (st.batch.size() == 0) return false;
  st.logits.resize(size_t(st.batch.n_logits()) * size_t(n_vocab_));
  st.ticket = 0;
  st.evaluated = false;
  return true;
}

// The requests are kept rotating through the pipeline in up to max_in_flight() batches: while
// the pipeline evaluates one batch, the results of another are sampled and its next step is
// submitted (stage 0 works on batch A's next token while stage 1 finishes batch B). Each request
// samples with its own sampler, so how requests are grouped never changes what they generate.
void Engine::run_slots(const Source& next, const Sink& done, std::vector<int> free_slots,
                       const std::atomic<bool>* cancel, bool keep_open) {
  std::deque<std::unique_ptr<Active>> active;  // admission order: earlier prompts are served first
  std::deque<Step> in_flight;
  std::vector<Step> spare;  // finished steps, reused for their buffers
  bool source_open = true;
  const size_t max_in_flight = size_t(std::max(1, pipe_.max_in_flight()));
  auto cancelled = [&] { return cancel && cancel->load(std::memory_order_relaxed); };
  // Waits for every batch still in flight, keeping the first error.
  auto drain = [&](std::exception_ptr& error) {
    for (auto& st : in_flight) {
      if (st.evaluated || st.ticket == 0) continue;
      try {
        pipe_.wait(st.ticket);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    in_flight.clear();
  };
  std::reverse(free_slots.begin(), free_slots.end());  // pop_back hands out the lowest slot first

  for (;;) {
    if (cancelled()) {
      std::exception_ptr error;
      drain(error);
      for (auto& a : active) {
        end_step(*a);
        finish(*a, FinishReason::Cancelled);
        done(std::move(a->res));
      }
      if (error) std::rethrow_exception(error);
      return;
    }
    // Requests cancelled on their own leave once nothing of theirs is in the pipeline (a step in
    // flight still writes their cache rows and logits); build_step gives them nothing more.
    for (auto it = active.begin(); it != active.end();) {
      Active& a = **it;
      if (!a.cancelled() || std::any_of(in_flight.begin(), in_flight.end(), [&](const Step& st) { return st.uses(&a); })) {
        ++it;
        continue;
      }
      end_step(a);
      finish(a, FinishReason::Cancelled);
      free_slots.push_back(a.slot);
      done(std::move(a.res));
      it = active.erase(it);
    }
    // Fill free slots. A rejected request is answered at once and does not take a slot.
    while (source_open && !free_slots.empty()) {
      std::optional<Request> r = next();
      if (!r) {
        // An open source has nothing now; it ends the run only when nothing is running.
        if (!keep_open || active.empty()) source_open = false;
        break;
      }
      // The vocabulary's tries, once per engine before the first grammar's timing starts (0.1 s
      // for 262k tokens): setup, not this request's prompt time, and never between two tokens.
      if (r->grammar) trie(false);
      if (r->sampling.dry_multiplier > 0 && !r->sampling.dry_breaker && !r->sampling.dry_sequence_breakers.empty())
        r->sampling.dry_breaker = dry_breakers(r->sampling.dry_sequence_breakers);
      auto a = std::make_unique<Active>(std::move(*r), vocab_.stream());
      if (vocab_.harmony()) a->channels.emplace();
      a->slot = free_slots.back();
      a->t_admit = Clock::now();
      if (!admit(*a)) {
        a->res.total_ms = ms_between(a->t_admit, Clock::now());
        done(std::move(a->res));
        continue;
      }
      free_slots.pop_back();
      active.push_back(std::move(a));
    }
    if (active.empty()) return;

    // Keep the pipeline full: the decoders are spread over max_in_flight batches. When there is
    // only one batch to evaluate and nothing in flight (one stream), decode() runs it without
    // handing it to the pipeline's threads. Logits rows come out in batch order, as rows[].
    const size_t cap = (active.size() + max_in_flight - 1) / max_in_flight;
    const size_t first_new = in_flight.size();
    while (in_flight.size() < max_in_flight) {
      Step st;
      if (!spare.empty()) { st = std::move(spare.back()); spare.pop_back(); }
      if (!build_step(active, cap, st)) {
        spare.push_back(std::move(st));
        break;
      }
      in_flight.push_back(std::move(st));
    }
    BATON_CHECK(!in_flight.empty());
    try {
      if (first_new == 0 && in_flight.size() == 1) {
        Step& st = in_flight.front();
        pipe_.decode(st.batch, st.logits.data());
        st.evaluated = true;
      } else {
        for (size_t i = first_new; i < in_flight.size(); i++)
          in_flight[i].ticket = pipe_.submit(in_flight[i].batch, in_flight[i].logits.data());
      }
    } catch (...) {
      // Steps that were built but not submitted leave the queue; what is in flight is waited
      // for, and the slots are emptied since their caches no longer match the engine's record.
      std::exception_ptr error = std::current_exception();
      while (in_flight.size() > first_new && in_flight.back().ticket == 0) in_flight.pop_back();
      drain(error);
      for (auto& a : active) forget(a->slot);
      std::rethrow_exception(error);
    }

    Step st = std::move(in_flight.front());
    in_flight.pop_front();
    try {
      if (!st.evaluated) pipe_.wait(st.ticket);
    } catch (...) {
      std::exception_ptr error = std::current_exception();
      drain(error);
      for (auto& a : active) forget(a->slot);
      std::rethrow_exception(error);
    }
    auto now = Clock::now();
    for (auto& [a, last] : st.chunks)
      if (last) a->res.prompt_ms = ms_between(a->t_admit, now);
    for (size_t r = 0; r < st.rows.size(); r++) {
      Active& a = *st.rows[r];
      const size_t j = a.step_row++;  // its row j: the logits after its token and j drafts
      if (j > 0 && (a.done || a.pending >= 0)) continue;  // it stopped at an earlier row
      a.waiting = false;
      if (a.cancelled()) {  // nothing more is sampled or shown; it leaves when its steps are back
        if (!a.draft.empty()) end_step(a);
        finish(a, FinishReason::Cancelled);
        continue;
      }
      const float* row = st.logits.data() + r * size_t(n_vocab_);
      const int32_t t = a.take(row, n_vocab_, *this);
      if (a.res.tokens.empty()) a.res.ttft_ms = ms_between(a.t_admit, Clock::now());
      if (t < 0) finish(a, FinishReason::Stop);  // a grammar with nowhere to go (res.error says so)
      else accept(a, t);
      if (a.draft.empty()) continue;
      if (!a.done && j < a.draft.size() && t == a.draft[j]) {
        // Drafted right: already in the cache, and the next row holds what follows it.
        cached_[a.slot].push_back(t);
        a.res.draft_accepted++;
        a.pending = -1;
        continue;
      }
      end_step(a);
    }
    spare.push_back(std::move(st));

    // Finished requests leave now, in admission order, and free their slots for the next ones.
    for (auto it = active.begin(); it != active.end();) {
      if (!(*it)->done) { ++it; continue; }
      free_slots.push_back((*it)->slot);
      done(std::move((*it)->res));
      it = active.erase(it);
    }
  }
}

}  // namespace baton
