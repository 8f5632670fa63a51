// Engine over a toy pipeline: a deterministic "model" whose next-token logits are a hash of the
// whole cached sequence, so any mix-up of KV slots, positions or batch rows changes the output.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <deque>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "gguf/error.h"
#include "kernels/cpu/ops.h"
#include "runtime/engine.h"
#include "runtime/grammar.h"
#include "runtime/pipeline.h"

using namespace baton;

namespace {

constexpr int kVocab = 32;  // 0: end of generation; 1..31: one character each
const char kChars[] = "?abcdefghijklmnopqrstuvwxyz .,!";

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// The toy model's next-token logits after the sequence `c`. With copy_bias > 0 it tends to repeat
// itself: the token that followed the last token's latest earlier occurrence gets that much more
// (what prompt lookup drafts, right often but not always).
void toy_logits(const std::vector<int32_t>& c, float eog_bias, float* row, float copy_bias = 0) {
  uint64_t h = 1469598103934665603ull;
  for (size_t p = 0; p < c.size(); p++) h = mix(h ^ (uint64_t(c[p]) + 131 * p));
  for (int v = 0; v < kVocab; v++)
    row[v] = float(mix(h + uint64_t(v)) >> 40) / float(1 << 24) * 6.0f + (v == 0 ? eog_bias : 0.0f);
  if (copy_bias > 0 && c.size() >= 2)
    for (size_t i = c.size() - 1; i-- > 0;)
      if (c[i] == c.back()) {
        row[c[i + 1]] += copy_bias;
        break;
      }
}

class ToyPipeline : public Pipeline {
 public:
  ToyPipeline(int n_ctx, int n_seq, float eog_bias = -2.0f, int max_rewind = std::numeric_limits<int>::max())
      : n_ctx_(n_ctx), eog_bias_(eog_bias), max_rewind_(max_rewind), cache_(n_seq) {}

  const gguf::File& file() const override { panic(__FILE__, __LINE__, "toy pipeline has no file"); }
  const ModelConfig& config() const override { panic(__FILE__, __LINE__, "toy pipeline has no config"); }
  const Tokenizer& tokenizer() const override { panic(__FILE__, __LINE__, "toy pipeline has no tokenizer"); }
  int n_ctx() const override { return n_ctx_; }
  int n_seq() const override { return int(cache_.size()); }
  int n_vocab() const override { return kVocab; }

  void decode(const Batch& b, float* logits) override {
    steps++;
    for (const SeqCopy& c : b.copies) {
      REQUIRE(c.n <= int(cache_.at(c.src).size()));
      REQUIRE(int(cache_.at(c.src).size()) <= copy_limit_);
      cache_.at(c.dst).assign(cache_[c.src].begin(), cache_[c.src].begin() + c.n);
      copied += c.n;
    }
    int decoders = 0, prompt_tokens = 0;
    std::map<int, int> per_seq;
    for (int i = 0; i < b.size(); i++) per_seq[b.seq[i]]++;
    for (int i = 0; i < b.size(); i++) {
      auto& c = cache_.at(b.seq[i]);
      if (b.pos[i] != int(c.size()) || b.pos[i] >= n_ctx_)
        fail(ErrorKind::Usage, "bad position {} for seq {} holding {}", b.pos[i], b.seq[i], c.size());
      c.push_back(b.token[i]);
      if (per_seq[b.seq[i]] == 1 && b.logits[i]) decoders++; else prompt_tokens++;
      if (!b.logits[i]) continue;
      float* row = logits;
      toy_logits(c, eog_bias_, row, copy_bias);
      logits += kVocab;
      argmax_rows += b.logits[i] == kArgmaxOnly;
      top_k_rows += b.logits[i] == kTopK;
      reduce_output_row(b.logits[i], row, kVocab);  // the pipeline contract (runtime/batch.h)
    }
    max_seqs = std::max(max_seqs, int(per_seq.size()));
    tokens_per_step.push_back(per_seq);
    max_tokens = std::max(max_tokens, b.size());
    if (prompt_tokens > 0 && decoders > 0) mixed_steps++;
  }
  void truncate_seq(int seq, int from) override {
    const int len = int(cache_.at(seq).size());
    if (from > 0 && len - from > max_rewind_)  // as a model with sliding-window layers refuses it
      fail(ErrorKind::Usage, "seq {}: cannot rewind {} positions (at most {})", seq, len - from, max_rewind_);
    cache_.at(seq).resize(std::min<size_t>(from, cache_.at(seq).size()));
  }
  int max_rewind() const override { return max_rewind_; }
  int seq_len(int seq) const override { return int(cache_.at(seq).size()); }
  int copy_limit() const override { return copy_limit_; }

  int steps = 0, max_seqs = 0, max_tokens = 0, mixed_steps = 0, argmax_rows = 0, top_k_rows = 0;
  float copy_bias = 0;
  int copy_limit_ = std::numeric_limits<int>::max();  // 0: no copies (Pipeline::copy_limit)
  int copied = 0;                                      // positions copied between sequences
  std::vector<std::map<int, int>> tokens_per_step;     // each step: tokens per sequence

 private:
  int n_ctx_;
  float eog_bias_;
  int max_rewind_;
  std::vector<std::vector<int32_t>> cache_;
};

class ToyStream : public TokenStream {
 public:
  std::string push(int32_t id) override { return id > 0 && id < kVocab ? std::string(1, kChars[id]) : ""; }
  std::string flush() override { return ""; }
};
class ToyVocab : public Vocab {
 public:
  bool is_eog(int32_t id) const override { return id == 0; }
  std::unique_ptr<TokenStream> stream() const override { return std::make_unique<ToyStream>(); }
  std::string_view piece(int32_t id) const override {
    return id > 0 && id < kVocab ? std::string_view(kChars + id, 1) : std::string_view();
  }
};

std::vector<Request> make_requests(int n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<Request> out;
  for (int i = 0; i < n; i++) {
    Request r;
    int len = 1 + int(g() % 60);
    if (i % 5 == 0) len += 150;  // some prompts need several chunks
    for (int k = 0; k < len; k++) r.prompt.push_back(1 + int32_t(g() % (kVocab - 1)));
    r.sampling.temperature = 0.9f;
    r.sampling.top_k = 20;
    r.sampling.repeat_penalty = 1.1f;
    r.sampling.seed = 1000 + uint64_t(i);
    r.max_tokens = 5 + int(g() % 40);
    r.tag = uint64_t(i);
    out.push_back(std::move(r));
  }
  return out;
}

std::map<uint64_t, Result> run_all(Engine& e, std::vector<Request> reqs, int parallel, std::vector<uint64_t>* order = nullptr) {
  size_t next = 0;
  std::map<uint64_t, Result> out;
  e.run([&]() -> std::optional<Request> {
          if (next == reqs.size()) return std::nullopt;
          return std::move(reqs[next++]);
        },
        [&](Result&& r) {
          if (order) order->push_back(r.tag);
          REQUIRE(out.count(r.tag) == 0);
          out[r.tag] = std::move(r);
        },
        parallel);
  return out;
}

// A short first turn, and the next turn: the old prompt, the reply, and something new.
Request first_turn() {
  Request r;
  r.prompt = {1, 2, 3, 4, 5, 6, 7, 8};
  r.sampling.seed = 9;
  r.max_tokens = 10;
  return r;
}
Request next_turn(const Request& r, const Result& reply) {
  Request next = r;
  next.prompt.insert(next.prompt.end(), reply.tokens.begin(), reply.tokens.end());
  next.prompt.insert(next.prompt.end(), {9, 10, 11});
  return next;
}

}  // namespace

TEST_CASE("continuous batching: each request's output is the same with 1 and 8 in parallel") {
  auto reqs = make_requests(40, 42);
  ToyPipeline p1(256, 1), p8(256, 8);
  ToyVocab vocab;
  EngineOptions opt;
  opt.prefill_chunk = 32;
  Engine e1(p1, vocab, opt), e8(p8, vocab, opt);
  auto r1 = run_all(e1, reqs, 1);
  std::vector<uint64_t> order;
  auto r8 = run_all(e8, reqs, 8, &order);
  REQUIRE(r1.size() == 40);
  REQUIRE(r8.size() == 40);
  int stopped = 0;
  for (auto& [tag, a] : r1) {
    const Result& b = r8.at(tag);
    INFO("request " << tag);
    CHECK(a.error.empty());
    CHECK(a.tokens == b.tokens);
    CHECK(a.text == b.text);
    CHECK(a.finish == b.finish);
    CHECK(a.prompt_tokens == b.prompt_tokens);
    CHECK(!a.tokens.empty());
    stopped += a.finish == FinishReason::Stop;
  }
  CHECK(stopped > 0);   // the toy model does end some replies by itself
  CHECK(stopped < 40);  // and others run to max_tokens
  // Real batching happened: many sequences per step, prompts next to decoders, fewer steps.
  CHECK(p1.max_seqs == 1);
  CHECK(p8.max_seqs == 8);
  CHECK(p8.mixed_steps > 0);
  CHECK(p8.steps * 3 < p1.steps);
  // Results arrive as requests finish, not in input order.
  CHECK(!std::is_sorted(order.begin(), order.end()));
}

TEST_CASE("a newcomer's prompt is chunked so decoders keep moving") {
  ToyPipeline p(1024, 4, -100.0f);  // no end-of-generation: everybody runs to max_tokens
  ToyVocab vocab;
  EngineOptions opt;
  opt.prefill_chunk = 16;
  Engine e(p, vocab, opt);
  std::vector<Request> reqs;
  for (int i = 0; i < 4; i++) {
    Request r;
    r.prompt.assign(i == 3 ? 200 : 4, 3);
    r.sampling.temperature = 0;
    r.max_tokens = 60;
    r.tag = uint64_t(i);
    reqs.push_back(std::move(r));
  }
  auto res = run_all(e, reqs, 4);
  for (auto& [tag, r] : res) CHECK(r.completion_tokens() == 60);
  // Never more than the chunk plus one token per decoder in a step.
  CHECK(p.max_tokens <= 16 + 3);
  // The 200-token prompt took >= 13 steps, and the short requests decoded during all of them.
  CHECK(p.mixed_steps >= 12);
  // Parallel requests with identical prompts and greedy sampling agree.
  CHECK(res[0].tokens == res[1].tokens);
  CHECK(res[1].tokens == res[2].tokens);
}

TEST_CASE("greedy requests take only the argmax from the pipeline, with the same tokens as full rows") {
  // The reference samples with top_k = 1: whatever the temperature, that is the argmax too, but
  // the engine must ask for the candidates (kTopK).
  auto make = [](bool greedy) {
    std::vector<Request> reqs;
    for (int i = 0; i < 6; i++) {
      Request r;
      r.prompt = {int32_t(1 + i), 7, int32_t(3 + 2 * i)};
      r.sampling.temperature = greedy ? 0.0f : 0.7f;
      r.sampling.top_k = 1;
      r.sampling.seed = 5;
      r.max_tokens = 12;
      r.tag = uint64_t(i);
      reqs.push_back(std::move(r));
    }
    return reqs;
  };
  ToyVocab vocab;
  ToyPipeline pa(256, 3, -100.0f), pf(256, 3, -100.0f);
  Engine ea(pa, vocab, {}), ef(pf, vocab, {});
  auto ra = run_all(ea, make(true), 3);
  auto rf = run_all(ef, make(false), 3);
  CHECK(pa.argmax_rows == 6 * 12);  // every sampled token came back as an id only
  CHECK(pf.argmax_rows == 0);
  REQUIRE(ra.size() == 6);
  for (auto& [tag, r] : ra) {
    CHECK(r.completion_tokens() == 12);
    CHECK(r.tokens == rf[tag].tokens);
  }
  CHECK(pf.top_k_rows == 6 * 12);  // the reference: a candidate row per token
  // A repetition penalty needs the rows even when greedy.
  SamplingParams sp;
  sp.temperature = 0;
  CHECK(Sampler(sp).argmax_only());
  sp.repeat_penalty = 1.1f;
  CHECK_FALSE(Sampler(sp).argmax_only());
  sp.repeat_last_n = 0;
  CHECK(Sampler(sp).argmax_only());
}

TEST_CASE("top-k requests take only the best candidates from the pipeline and draw what full rows give") {
  // K = 16 of the toy's 32 logits. Requests with top_k <= K and no penalty ask for candidate rows
  // (kTopK); the reference samples every token from the full row, one request at a time.
  const int K = top_k_candidates(kVocab);
  REQUIRE(K == 16);
  std::vector<Request> reqs;
  for (int i = 0; i < 8; i++) {
    Request r;
    r.prompt = {int32_t(1 + i), 9, int32_t(2 + 3 * i)};
    r.sampling.temperature = 0.5f + 0.25f * float(i % 4);
    r.sampling.top_k = i % 2 ? K : 1 + 2 * i;
    r.sampling.top_p = i % 3 ? 0.9f : 1.0f;
    r.sampling.min_p = i % 4 ? 0.05f : 0.0f;
    r.sampling.seed = 77 + uint64_t(i);
    r.max_tokens = 20;
    r.tag = uint64_t(i);
    reqs.push_back(std::move(r));
  }
  std::map<uint64_t, std::vector<int32_t>> want;
  for (const Request& r : reqs) {
    Sampler s(r.sampling);
    std::vector<int32_t> seq = r.prompt;
    std::vector<float> logits(kVocab);
    for (int t = 0; t < r.max_tokens; t++) {
      toy_logits(seq, -100.0f, logits.data());
      const int32_t id = s.sample(logits.data(), kVocab, seq);
      want[r.tag].push_back(id);
      seq.push_back(id);
    }
  }
  ToyVocab vocab;
  ToyPipeline p(256, 4, -100.0f);
  Engine e(p, vocab, {});
  auto got = run_all(e, reqs, 4);
  CHECK(p.top_k_rows == 8 * 20);
  CHECK(p.argmax_rows == 0);
  REQUIRE(got.size() == 8);
  int distinct = 0;
  for (auto& [tag, r] : got) {
    CHECK(r.tokens == want[tag]);
    distinct += std::set<int32_t>(r.tokens.begin(), r.tokens.end()).size() > 3;
  }
  CHECK(distinct >= 4);  // the draws are not all the argmax

  // What asks for the full row: top_k off, above K, or a repetition penalty.
  SamplingParams sp;
  sp.top_k = K;
  CHECK(Sampler(sp).top_k_suffices(K));
  sp.top_k = K + 1;
  CHECK_FALSE(Sampler(sp).top_k_suffices(K));
  sp.top_k = 0;
  CHECK_FALSE(Sampler(sp).top_k_suffices(K));
  sp.top_k = 5;
  sp.repeat_penalty = 1.1f;
  CHECK_FALSE(Sampler(sp).top_k_suffices(K));
  sp.repeat_penalty = 1.0f;
  sp.temperature = 0;
  CHECK_FALSE(Sampler(sp).top_k_suffices(K));  // greedy: kArgmaxOnly
}

TEST_CASE("stop strings end the reply and never leak a partial match into the stream") {
  ToyPipeline p(512, 1, -100.0f);
  ToyVocab vocab;
  Engine e(p, vocab);
  int checked = 0;
  for (uint64_t seed = 1; seed <= 20; seed++) {
    Request r;
    r.prompt = {5, 6, 7};
    r.sampling.seed = seed;
    r.sampling.temperature = 1.0f;
    r.sampling.top_k = 5;  // few letters: stop strings recur
    r.max_tokens = 120;
    Result full = e.generate(r);
    REQUIRE(full.text.size() == 120);
    std::string stop = full.text.substr(40, 3);
    size_t cut = full.text.find(stop);
    std::string streamed;
    r.stop = {stop, "~never~"};
    r.on_text = [&](std::string_view s) { streamed += s; };
    Result got = e.generate(r);
    INFO("seed " << seed << " stop '" << stop << "'");
    CHECK(got.finish == FinishReason::Stop);
    CHECK(got.text == full.text.substr(0, cut));
    CHECK(streamed == got.text);
    checked++;
  }
  CHECK(checked == 20);
}

TEST_CASE("a grammar shapes every reply, streamed text included, and ends it") {
  // "the", a word of 2-6 letters, maybe a second word, a full stop: whatever the toy model wants.
  auto g = Grammar::parse("root ::= \"the \" [a-z]{2,6} (\" \" [a-z]+)? [.!]");
  ToyPipeline p(512, 4);
  ToyVocab vocab;
  Engine e(p, vocab);
  std::vector<Request> reqs = make_requests(24, 9);
  std::map<uint64_t, std::string> streamed;
  for (size_t i = 0; i < reqs.size(); i++) {
    Request& r = reqs[i];
    r.max_tokens = 60;
    if (i % 3 == 0) r.sampling.temperature = 0;  // greedy too
    if (i % 4 != 3) r.grammar = g;                // and neighbours without a grammar
    r.on_text = [&streamed, tag = r.tag](std::string_view s) { streamed[tag] += s; };
  }
  std::vector<Request> alone;
  for (size_t i = 3; i < reqs.size(); i += 4) alone.push_back(reqs[i]);
  auto res = run_all(e, reqs, 4);
  int shaped = 0;
  for (auto& [tag, r] : res) {
    INFO("request " << tag << ": " << r.text);
    CHECK(r.error.empty());
    CHECK(streamed[tag] == r.text);
    if (tag % 4 == 3) continue;
    GrammarState s(g);
    REQUIRE(s.accept(r.text));
    CHECK(s.finished());
    CHECK(r.finish == FinishReason::Stop);
    CHECK(r.tokens.size() == r.text.size());  // ended by the grammar, not by an end token
    shaped++;
  }
  CHECK(shaped == 18);
  // Requests without a grammar generate what they generate alone.
  ToyPipeline p1(512, 1);
  Engine e1(p1, vocab);
  for (auto& [tag, r] : run_all(e1, alone, 1)) CHECK(r.tokens == res.at(tag).tokens);
}

TEST_CASE("a grammar: the end token only where a sentence is complete; no way on is an error") {
  ToyPipeline p(512, 1, /*eog_bias=*/100.0f);  // the toy model wants to stop at once
  ToyVocab vocab;
  Engine e(p, vocab);
  Request r;
  r.prompt = {1, 2, 3};
  r.sampling.temperature = 0;
  r.grammar = Grammar::parse("root ::= [a-z] [a-z] [a-z]*");
  Result got = e.generate(r);
  CHECK(got.error.empty());
  CHECK(got.text.size() == 2);  // two letters, then the end token it wanted all along
  CHECK(got.finish == FinishReason::Stop);
  // A character the vocabulary does not have: nothing can be generated.
  r.grammar = Grammar::parse("root ::= \"ab\" \"X\"");
  got = e.generate(r);
  CHECK_THAT(got.error, Catch::Contains("no token of the vocabulary can continue"));
  CHECK(got.text == "ab");
  // A grammar too ambiguous to start is refused like any bad request.
  r.grammar = Grammar::parse("root ::= x{0,5000} \"b\"\nx ::= \"a\"?");
  got = e.generate(r);
  CHECK_THAT(got.error, Catch::Contains("too ambiguous"));
  CHECK(got.tokens.empty());
}

TEST_CASE("ignore_eos: the end token is never sampled, the reply runs to max_tokens; a complete grammar still ends it") {
  ToyPipeline p(512, 2, /*eog_bias=*/100.0f);  // the toy model wants to stop at once
  ToyVocab vocab;
  Engine e(p, vocab);
  // Greedy and top-k 8 draw from the pipeline's 16 candidates less the end token (kTopK rows);
  // top-k 16 and top-k off need the full row. Each reply is what a sampler with the end token
  // refused draws from the full rows.
  const int K = top_k_candidates(kVocab);
  for (const auto& [temp, top_k] : std::vector<std::pair<float, int>>{{0.0f, 40}, {0.8f, 8}, {0.8f, K}, {0.8f, 0}}) {
    INFO("temperature " << temp << ", top-k " << top_k);
    Request r;
    r.prompt = {1, 2, 3};
    r.sampling.temperature = temp;
    r.sampling.top_k = top_k;
    r.sampling.seed = 7;
    r.max_tokens = 12;
    CHECK(e.generate(r).tokens.empty());  // it stops at once
    r.ignore_eos = true;
    const int top_k_rows = p.top_k_rows;
    const Result got = e.generate(r);
    CHECK(got.error.empty());
    CHECK(got.tokens.size() == 12);
    CHECK(got.finish == FinishReason::Length);
    CHECK(p.top_k_rows - top_k_rows == (temp == 0.0f || top_k == 8 ? 12 : 0));
    Sampler ref(r.sampling);
    std::vector<int32_t> seq = r.prompt, want;
    std::vector<float> row(kVocab);
    for (int i = 0; i < 12; i++) {
      toy_logits(seq, 100.0f, row.data());
      want.push_back(ref.sample(row.data(), kVocab, seq, [&](int32_t id) { return !vocab.is_eog(id); }));
      seq.push_back(want.back());
    }
    CHECK(got.tokens == want);
  }
  // With a grammar: the end token once its sentence is complete, as without ignore_eos.
  Request g;
  g.prompt = {1, 2, 3};
  g.sampling.temperature = 0;
  g.ignore_eos = true;
  g.max_tokens = 12;
  g.grammar = Grammar::parse("root ::= [a-z] [a-z]");
  const Result got = e.generate(g);
  CHECK(got.text.size() == 2);
  CHECK(got.finish == FinishReason::Stop);
}

TEST_CASE("context: too long a prompt is rejected, the context end finishes with 'context'") {
  ToyPipeline p(32, 2, -100.0f);
  ToyVocab vocab;
  Engine e(p, vocab);
  Request r;
  r.sampling.temperature = 0;
  r.prompt.assign(33, 4);
  Result too_long = e.generate(r);
  CHECK(!too_long.error.empty());
  CHECK(too_long.error.find("33 tokens") != std::string::npos);
  CHECK(too_long.tokens.empty());

  r.prompt.assign(20, 4);
  Result full = e.generate(r);
  CHECK(full.error.empty());
  CHECK(full.finish == FinishReason::Context);
  CHECK(full.completion_tokens() == 13);  // positions 20..31 evaluated, plus the last one sampled
  CHECK(full.ctx_used == 32);
  CHECK(p.seq_len(0) == 32);

  r.prompt.assign(32, 4);  // exactly the context: one token, then the end
  Result edge = e.generate(r);
  CHECK(edge.error.empty());
  CHECK(edge.completion_tokens() == 1);
  CHECK(edge.finish == FinishReason::Context);

  // In a batch, a rejected request is answered and the others go on.
  std::vector<Request> reqs(3, r);
  reqs[0].prompt.assign(5, 4);
  reqs[1].prompt.assign(40, 4);
  reqs[2].prompt.clear();
  for (int i = 0; i < 3; i++) { reqs[i].tag = uint64_t(i); reqs[i].max_tokens = 4; }
  auto res = run_all(e, reqs, 2);
  CHECK(res[0].error.empty());
  CHECK(res[0].completion_tokens() == 4);
  CHECK(res[0].finish == FinishReason::Length);
  CHECK(!res[1].error.empty());
  CHECK(!res[2].error.empty());
}

TEST_CASE("max_tokens 0 evaluates the prompt and generates nothing") {
  ToyPipeline p(64, 2, -100.0f);
  ToyVocab vocab;
  Engine e(p, vocab);
  Request r;
  r.sampling.temperature = 0;
  r.prompt.assign(9, 4);
  r.max_tokens = 0;
  std::string streamed;
  r.on_text = [&](std::string_view s) { streamed += s; };
  Result res = e.generate(r);
  CHECK(res.error.empty());
  CHECK(res.finish == FinishReason::Length);
  CHECK(res.completion_tokens() == 0);
  CHECK(res.text.empty());
  CHECK(streamed.empty());
  CHECK(res.prompt_evaluated == 9);
  CHECK(p.seq_len(0) == 9);  // the prompt is in the cache, no generated token after it
}

TEST_CASE("cancel stops the compute and keeps the partial reply") {
  ToyPipeline p(4096, 1, -100.0f);
  ToyVocab vocab;
  Engine e(p, vocab);
  std::atomic<bool> cancel{false};
  Request r;
  r.prompt = {1, 2, 3};
  r.sampling.temperature = 0;
  int chunks = 0;
  r.on_text = [&](std::string_view) { if (++chunks == 7) cancel = true; };
  Result res = e.generate(r, &cancel);
  CHECK(res.finish == FinishReason::Cancelled);
  CHECK(res.completion_tokens() == 7);
  CHECK(res.text.size() == 7);
  CHECK(p.steps <= 8);  // the prompt step and the decodes before the flag was seen
}

TEST_CASE("a slot reuses the cached prefix; the result matches a fresh evaluation") {
  ToyVocab vocab;
  ToyPipeline p(512, 1);
  Engine e(p, vocab);
  const Request r = first_turn();
  Result first = e.generate(r);
  REQUIRE(first.prompt_evaluated == 8);

  // The next turn: the old prompt, the reply, and something new.
  const Request next = next_turn(r, first);
  Result second = e.generate(next);
  // Everything cached is reused: the reply's last token was sampled but never evaluated.
  CHECK(second.prompt_evaluated == 3 + 1);

  ToyPipeline fresh_p(512, 1);
  Engine fresh(fresh_p, vocab);
  Result ref = fresh.generate(next);
  CHECK(ref.prompt_evaluated == int(next.prompt.size()));
  CHECK(ref.tokens == second.tokens);

  // A prompt that diverges early truncates the slot and re-evaluates from there.
  Request other = r;
  other.prompt[2] = 20;
  Result third = e.generate(other);
  CHECK(third.prompt_evaluated == 6);
  e.forget(0);
  CHECK(e.cached(0).empty());
  CHECK(p.seq_len(0) == 0);
}

TEST_CASE("a slot that cannot be rewound far (sliding-window rings) starts over for a new prompt") {
  ToyVocab vocab;
  ToyPipeline p(512, 1, -2.0f, /*max_rewind=*/1);
  Engine e(p, vocab);
  const Request r = first_turn();
  Result first = e.generate(r);
  REQUIRE(first.error.empty());

  // The next turn continues the cache (a rewind of at most the reply's last token).
  const Request next = next_turn(r, first);
  Result second = e.generate(next);
  REQUIRE(second.error.empty());
  CHECK(second.prompt_evaluated == 3 + 1);

  // A new request sharing only a prefix (as batch requests share the chat template's start): the
  // slot is evaluated from 0 instead of failing, and the reply is that of a fresh engine.
  Request other = r;
  other.prompt[4] = 20;
  Result third = e.generate(other);
  REQUIRE(third.error.empty());
  CHECK(third.prompt_evaluated == int(other.prompt.size()));
  ToyPipeline fresh_p(512, 1, -2.0f, 1);
  Engine fresh(fresh_p, vocab);
  CHECK(fresh.generate(other).tokens == third.tokens);

  // Several requests through one slot in a batch: every one is answered.
  std::vector<Request> reqs;
  for (int i = 0; i < 6; i++) {
    Request q = r;
    q.prompt.push_back(10 + i);
    q.tag = uint64_t(i);
    reqs.push_back(q);
  }
  auto out = run_all(e, reqs, 1);
  REQUIRE(out.size() == 6);
  for (auto& [tag, res] : out) CHECK(res.error.empty());
}

TEST_CASE("bad requests are answered with an error, not a crash") {
  ToyPipeline p(64, 1);
  ToyVocab vocab;
  Engine e(p, vocab);
  Request r;
  Result empty = e.generate(r);
  CHECK(empty.error.find("empty") != std::string::npos);
  r.prompt = {1, 99};
  CHECK(e.generate(r).error.find("vocabulary") != std::string::npos);
  r.prompt = {1};
  r.sampling.top_p = 2;
  CHECK(e.generate(r).error.find("top_p") != std::string::npos);
  r.sampling.top_p = 0.9f;
  r.max_tokens = -5;  // -1 is "no limit"; below it is a mistake, not a larger "no limit"
  CHECK(e.generate(r).error.find("max_tokens -5 must be >= -1") != std::string::npos);
  r.max_tokens = -1;
  CHECK(e.generate(r).error.empty());
  CHECK_THROWS_AS(e.run([] { return std::optional<Request>(); }, [](Result&&) {}, 2), Error);
}

namespace {

// The toy model behind an asynchronous interface: submit() only queues a batch, wait(t) evaluates
// the queue up to t in submission order, as a pipeline's stages would. It counts how many batches
// were in flight at once and refuses a batch that would need the result of one still queued. A
// truncation waits in the queue too: batches submitted before it (a copy from the sequence) still
// see the sequence as it was, as in the real pipelines, where truncate_seq only moves the length
// later batches continue from.
class AsyncToyPipeline : public ToyPipeline {
 public:
  AsyncToyPipeline(int n_ctx, int n_seq, int in_flight) : ToyPipeline(n_ctx, n_seq), in_flight_(in_flight) {}
  uint64_t submit(const Batch& b, float* logits) override {
    // What the real pipelines check at submission: a copy's source, as submitted so far, within
    // copy_limit (ModelPipeline::check_batch).
    sub_len_.resize(size_t(n_seq()), 0);
    for (const SeqCopy& c : b.copies) {
      REQUIRE(sub_len_[size_t(c.src)] <= copy_limit_);
      sub_len_[size_t(c.dst)] = c.n;
    }
    for (int i = 0; i < b.size(); i++) sub_len_[size_t(b.seq[i])] = b.pos[i] + 1;
    queue_.push_back({++last_, b, logits, false});
    max_queued = std::max(max_queued, int(std::count_if(queue_.begin(), queue_.end(), [](const Queued& q) { return !q.truncate; })));
    REQUIRE(max_queued <= in_flight_);
    return last_;
  }
  void wait(uint64_t ticket) override {
    while (!queue_.empty() && queue_.front().ticket <= ticket) {
      Queued q = std::move(queue_.front());
      queue_.pop_front();
      if (q.truncate) ToyPipeline::truncate_seq(q.batch.seq[0], q.batch.pos[0]);
      else decode(q.batch, q.logits);
    }
  }
  void truncate_seq(int seq, int from) override {
    sub_len_.resize(size_t(n_seq()), 0);
    sub_len_[size_t(seq)] = std::min(sub_len_[size_t(seq)], from);
    if (queue_.empty()) return ToyPipeline::truncate_seq(seq, from);
    Queued q{last_, {}, nullptr, true};
    q.batch.add(0, from, seq, false);
    queue_.push_back(std::move(q));
  }
  int max_in_flight() const override { return in_flight_; }
  int max_queued = 0;

 private:
  struct Queued {
    uint64_t ticket;
    Batch batch;
    float* logits;
    bool truncate;  // not a batch: the truncation of batch.seq[0] at batch.pos[0]
  };
  int in_flight_;
  std::vector<int> sub_len_;  // per sequence: its length as submitted
  uint64_t last_ = 0;
  std::deque<Queued> queue_;
};

}  // namespace

TEST_CASE("several batches in flight: each request's output is the same as one batch at a time") {
  auto reqs = make_requests(40, 7);
  ToyVocab vocab;
  EngineOptions opt;
  opt.prefill_chunk = 32;
  ToyPipeline sync(256, 16);
  Engine es(sync, vocab, opt);
  const auto ref = run_all(es, reqs, 16);
  REQUIRE(ref.size() == 40);
  for (int in_flight : {2, 3}) {
    INFO(in_flight << " in flight");
    AsyncToyPipeline p(256, 16, in_flight);
    Engine e(p, vocab, opt);
    const auto got = run_all(e, reqs, 16);
    REQUIRE(got.size() == 40);
    for (auto& [tag, a] : ref) {
      INFO("request " << tag);
      const Result& b = got.at(tag);
      CHECK(a.tokens == b.tokens);
      CHECK(a.text == b.text);
      CHECK(a.finish == b.finish);
    }
    // The pipeline was kept full: the requests were spread over in_flight rotating batches.
    CHECK(p.max_queued == in_flight);
    CHECK(p.steps > sync.steps);
  }
}

TEST_CASE("serve: an open source's nothing-now keeps the run going; a request cancelled on its own stops alone") {
  auto reqs = make_requests(30, 11);
  ToyVocab vocab;
  EngineOptions opt;
  opt.prefill_chunk = 32;
  ToyPipeline ref_pipe(256, 8);
  Engine ref_engine(ref_pipe, vocab, opt);
  const auto ref = run_all(ref_engine, reqs, 8);
  REQUIRE(ref.size() == 30);
  for (int in_flight : {1, 2, 3}) {
    INFO(in_flight << " in flight");
    std::unique_ptr<ToyPipeline> p = in_flight == 1 ? std::make_unique<ToyPipeline>(256, 8)
                                                    : std::make_unique<AsyncToyPipeline>(256, 8, in_flight);
    Engine e(*p, vocab, opt);
    std::map<uint64_t, std::shared_ptr<std::atomic<bool>>> flags;
    std::vector<Request> mine = reqs;
    for (auto& r : mine) r.cancel = flags[r.tag] = std::make_shared<std::atomic<bool>>(false);
    flags[10]->store(true);  // cancelled before it is admitted: nothing generated
    // Request 5 has a prompt of several chunks: cancelled while they are in flight, from request
    // 1's first text; request 2 after three tokens of its own.
    mine[1].on_text = [&](std::string_view) { flags[5]->store(true); };
    int seen2 = 0;
    mine[2].on_text = [&](std::string_view) { if (++seen2 == 3) flags[2]->store(true); };
    size_t next = 0, calls = 0, idle_calls = 0;
    int outstanding = 0;
    std::map<uint64_t, Result> got;
    e.serve(
        [&]() -> std::optional<Request> {
          // Idle: the next request (the end after the last); busy: one call in three has one.
          if (outstanding == 0) {
            idle_calls++;
            if (next == mine.size()) return std::nullopt;
          } else if (++calls % 3 != 0 || next == mine.size()) {
            return std::nullopt;
          }
          outstanding++;
          return std::move(mine[next++]);
        },
        [&](Result&& r) {
          outstanding--;
          REQUIRE(got.count(r.tag) == 0);
          got[r.tag] = std::move(r);
        },
        8);
    REQUIRE(got.size() == 30);
    CHECK(outstanding == 0);
    CHECK(idle_calls >= 2);  // it ran dry in between and was handed more
    for (auto& [tag, a] : ref) {
      INFO("request " << tag);
      const Result& b = got.at(tag);
      if (tag == 10 || tag == 5 || tag == 2) {
        CHECK(b.finish == FinishReason::Cancelled);
        REQUIRE(b.tokens.size() <= a.tokens.size());
        CHECK(std::equal(b.tokens.begin(), b.tokens.end(), a.tokens.begin()));
        if (tag == 10) CHECK(b.tokens.empty());
        if (tag == 2) CHECK(b.tokens.size() == 3);
        continue;
      }
      CHECK(a.tokens == b.tokens);
      CHECK(a.text == b.text);
      CHECK(a.finish == b.finish);
    }
    CHECK(got.at(5).tokens.empty());  // its prompt was not finished when the flag went up
  }
}

TEST_CASE("a long prompt is evaluated in chunks that are in flight together") {
  ToyVocab vocab;
  EngineOptions opt;
  opt.prefill_chunk = 16;
  Request r;
  for (int i = 0; i < 100; i++) r.prompt.push_back(1 + i % 30);
  r.sampling.temperature = 0;
  r.max_tokens = 10;
  ToyPipeline sync(256, 1);
  AsyncToyPipeline p(256, 1, 2);
  Engine es(sync, vocab, opt), e(p, vocab, opt);
  const Result a = es.generate(r), b = e.generate(r);
  CHECK(a.tokens == b.tokens);
  CHECK(b.prompt_evaluated == 100);
  CHECK(p.max_queued == 2);  // the next chunk was submitted before the previous one came back
}

// ---- prompt lookup (speculative decoding with drafts from the sequence itself) ----

TEST_CASE("lookup_draft: what followed the latest occurrence of the longest matching n-gram") {
  std::vector<int32_t> d;
  // "1 2 3 9 | 4 2 3 7 | 1 2 3": the 3-gram 1 2 3 occurred at 0 (then 9); its 2-gram 2 3 later (then 7).
  lookup_draft({1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3}, 2, 3, 4, d);
  CHECK(d == std::vector<int32_t>{9, 4, 2, 3});
  lookup_draft({1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3}, 2, 2, 4, d);  // only 2-grams: the latest, at 5
  CHECK(d == std::vector<int32_t>{7, 1, 2, 3});
  lookup_draft({1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3}, 2, 3, 2, d);  // at most max_len
  CHECK(d == std::vector<int32_t>{9, 4});
  // A repeating stretch: the match reaches the end and the draft goes on repeating.
  lookup_draft({5, 6, 7, 6, 7}, 2, 4, 5, d);
  CHECK(d == std::vector<int32_t>{6, 7, 6, 7, 6});
  lookup_draft({4, 4, 4}, 1, 2, 3, d);
  CHECK(d == std::vector<int32_t>{4, 4, 4});
  // Nothing occurred before: no draft.
  lookup_draft({1, 2, 3, 4}, 1, 3, 4, d);
  CHECK(d.empty());
  lookup_draft({7}, 1, 3, 4, d);
  CHECK(d.empty());
  lookup_draft({1, 2, 1, 2}, 3, 4, 4, d);  // shorter than ngram_min matches do not count
  CHECK(d.empty());
  lookup_draft({1, 2, 1, 2}, 1, 2, 0, d);
  CHECK(d.empty());
}

namespace {

// Requests whose prompts repeat themselves, so that lookup finds drafts; greedy and sampled ones
// (penalty, top-k, top-p), stop strings, short and long limits.
std::vector<Request> repetitive_requests(int n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<Request> out;
  for (int i = 0; i < n; i++) {
    Request r;
    std::vector<int32_t> phrase;
    for (int k = 0, len = 3 + int(g() % 8); k < len; k++) phrase.push_back(1 + int32_t(g() % (kVocab - 1)));
    for (int rep = 0, reps = 2 + int(g() % 3); rep < reps; rep++) r.prompt.insert(r.prompt.end(), phrase.begin(), phrase.end());
    if (i % 3 == 0) {
      r.sampling.temperature = 0;
    } else {
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = i % 2 ? 20 : 0;
      r.sampling.top_p = 0.95f;
      r.sampling.repeat_penalty = i % 4 == 1 ? 1.1f : 1.0f;
    }
    r.sampling.seed = 77 + uint64_t(i);
    r.max_tokens = 8 + int(g() % 60);
    if (i % 5 == 2) r.stop = {"q"};
    r.tag = uint64_t(i);
    out.push_back(std::move(r));
  }
  return out;
}

void check_same_results(const std::map<uint64_t, Result>& ref, const std::map<uint64_t, Result>& got) {
  REQUIRE(got.size() == ref.size());
  for (const auto& [tag, a] : ref) {
    INFO("request " << tag);
    const Result& b = got.at(tag);
    CHECK(a.error == b.error);
    CHECK(a.tokens == b.tokens);
    CHECK(a.text == b.text);
    CHECK(a.finish == b.finish);
    CHECK(a.ctx_used == b.ctx_used);
  }
}

}  // namespace

TEST_CASE("prompt lookup: the same replies as without drafts, the unconfirmed drafts out of the cache") {
  ToyVocab vocab;
  const auto reqs = repetitive_requests(30, 3);
  for (int parallel : {1, 4}) {
    INFO("parallel " << parallel);
    ToyPipeline p0(256, 4);
    p0.copy_bias = 4.0f;
    Engine e0(p0, vocab);
    const auto ref = run_all(e0, reqs, parallel);
    for (int lookup : {1, 3, 8}) {
      INFO("lookup " << lookup);
      ToyPipeline p(256, 4);
      p.copy_bias = 4.0f;
      EngineOptions opt;
      opt.lookup = lookup;
      Engine e(p, vocab, opt);
      const auto got = run_all(e, reqs, parallel);
      check_same_results(ref, got);
      int drafted = 0, kept = 0;
      for (const auto& [tag, r] : got) drafted += r.drafted, kept += r.draft_accepted;
      // Both ways were taken: drafts confirmed and drafts thrown away.
      CHECK(kept > 0);
      CHECK(kept < drafted);
      CHECK(p.steps < p0.steps);  // confirmed drafts save steps
      // What each slot's cache holds is what the engine counts: no unconfirmed draft stayed.
      for (int s = 0; s < parallel; s++) {
        REQUIRE(p.seq_len(s) == int(e.cached(s).size()));
        if (parallel == 1) CHECK(p.seq_len(s) == p0.seq_len(s));  // (in parallel, slots serve in another order)
      }
    }
  }
}

TEST_CASE("prompt lookup: in-flight batches, the context's end, short rewinds, a grammar, a cancel") {
  ToyVocab vocab;
  auto reqs = repetitive_requests(24, 11);
  EngineOptions opt;
  opt.lookup = 6;
  opt.prefill_chunk = 16;
  {
    INFO("several batches in flight");
    ToyPipeline p0(256, 8);
    AsyncToyPipeline p(256, 8, 3);
    p0.copy_bias = p.copy_bias = 4.0f;
    Engine e0(p0, vocab), e(p, vocab, opt);
    check_same_results(run_all(e0, reqs, 8), run_all(e, reqs, 8));
  }
  {
    INFO("a context that ends mid-draft, and caches that rewind at most 2 positions");
    for (auto& r : reqs) r.max_tokens = -1;
    ToyPipeline p0(48, 4, -100.0f), p(48, 4, -100.0f, /*max_rewind=*/2);
    p0.copy_bias = p.copy_bias = 4.0f;
    Engine e0(p0, vocab), e(p, vocab, opt);
    const auto ref = run_all(e0, reqs, 4);
    int at_end = 0;
    for (const auto& [tag, r] : ref) at_end += r.finish == FinishReason::Context;
    CHECK(at_end > 12);
    check_same_results(ref, run_all(e, reqs, 4));  // the toy refuses a rewind further than 2
  }
  {
    INFO("a grammar: each row sampled under the grammar state the confirmed drafts left");
    const auto g = Grammar::parse(R"(root ::= ("ab" | "abc" | "c")+ ".")");
    std::vector<Request> greqs;
    for (int i = 0; i < 4; i++) {
      Request r;
      r.prompt = {1, 2, 3, 1, 2, 3, 1, 2};
      r.grammar = g;
      r.sampling.temperature = i == 0 ? 0.0f : 0.7f;
      r.sampling.seed = uint64_t(i);
      r.max_tokens = 40;
      r.tag = uint64_t(i);
      greqs.push_back(r);
    }
    ToyPipeline p0(256, 2), p(256, 2);
    p0.copy_bias = p.copy_bias = 4.0f;
    Engine e0(p0, vocab), e(p, vocab, opt);
    const auto got = run_all(e, greqs, 2);
    check_same_results(run_all(e0, greqs, 2), got);
    int drafted = 0;
    for (const auto& [tag, r] : got) drafted += r.drafted;
    CHECK(drafted > 0);
  }
  {
    INFO("a cancel with drafts in flight leaves each cache as the engine counts it");
    AsyncToyPipeline p(4096, 2, 2);
    p.copy_bias = 6.0f;
    Engine e(p, vocab, opt);
    std::atomic<bool> cancel{false};
    std::vector<Request> two;
    for (int i = 0; i < 2; i++) {
      Request r;
      r.prompt = {1, 2, 3, 4, 1, 2, 3, 4, 1, int32_t(2 + i)};
      r.sampling.temperature = 0;
      r.tag = uint64_t(i);
      two.push_back(r);
    }
    int chunks = 0;
    two[0].on_text = [&](std::string_view) { if (++chunks == 20) cancel = true; };
    size_t next = 0;
    std::map<uint64_t, Result> out;
    e.run([&]() -> std::optional<Request> { return next < two.size() ? std::optional(two[next++]) : std::nullopt; },
          [&](Result&& r) { out[r.tag] = std::move(r); }, 2, &cancel);
    REQUIRE(out.size() == 2);
    int kept = 0;
    for (const auto& [tag, res] : out) {
      CHECK(res.finish == FinishReason::Cancelled);
      CHECK(p.seq_len(int(tag)) == int(e.cached(int(tag)).size()));
      CHECK(res.ctx_used == int(e.cached(int(tag)).size()));
      kept += res.draft_accepted;
    }
    CHECK(kept > 0);
  }
}

// ---- shared prompt starts (Batch::copies) ----

namespace {

// Requests that share a long start (a system prompt, few-shot examples) and differ after it.
std::vector<Request> shared_start_requests(int n, int shared, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> start;
  for (int k = 0; k < shared; k++) start.push_back(1 + int32_t(g() % (kVocab - 1)));
  std::vector<Request> out;
  for (int i = 0; i < n; i++) {
    Request r;
    r.prompt = start;
    r.prompt.push_back(1 + i % (kVocab - 1));  // where the prompts part
    for (int k = 0, tail = int(g() % 12); k < tail; k++) r.prompt.push_back(1 + int32_t(g() % (kVocab - 1)));
    r.sampling.temperature = i % 2 ? 0.8f : 0.0f;
    r.sampling.seed = 5 + uint64_t(i);
    r.max_tokens = 4 + int(g() % 20);
    r.tag = uint64_t(i);
    out.push_back(std::move(r));
  }
  return out;
}

int evaluated(const std::map<uint64_t, Result>& res) {
  int n = 0;
  for (const auto& [tag, r] : res) n += r.prompt_evaluated;
  return n;
}

}  // namespace

TEST_CASE("a shared prompt start is evaluated once and copied to the other slots; replies unchanged") {
  ToyVocab vocab;
  const int shared = 100;
  const auto reqs = shared_start_requests(12, shared, 21);
  int tails = 0;
  for (const auto& r : reqs) tails += int(r.prompt.size()) - shared;
  EngineOptions off;
  off.share_prefixes = false;
  EngineOptions on;
  on.prefill_chunk = 50;  // the start in two chunks: the others wait for both
  off.prefill_chunk = 50;
  for (int parallel : {1, 4}) {
    INFO("parallel " << parallel);
    ToyPipeline p0(512, 4), p(512, 4);
    Engine e0(p0, vocab, off), e(p, vocab, on);
    const auto ref = run_all(e0, reqs, parallel);
    const auto got = run_all(e, reqs, parallel);
    check_same_results(ref, got);
    // Without copies each slot evaluates the start once; with them it is evaluated once in all,
    // the slots admitted with the first one waiting for it rather than evaluating it side by side.
    CHECK(evaluated(ref) == tails + parallel * shared);
    CHECK(evaluated(got) == tails + shared);
    CHECK(p.copied == (parallel - 1) * shared);
    for (int s = 0; s < parallel; s++) CHECK(p.seq_len(s) == int(e.cached(s).size()));
  }
  {
    INFO("several batches in flight; lookup drafts too");
    on.lookup = 4;
    ToyPipeline p0(512, 6);
    AsyncToyPipeline p(512, 6, 3);
    p0.copy_bias = p.copy_bias = 3.0f;
    Engine e0(p0, vocab, off), e(p, vocab, on);
    const auto got = run_all(e, reqs, 6);
    check_same_results(run_all(e0, reqs, 6), got);
    CHECK(evaluated(got) == tails + shared);
  }
}

TEST_CASE("shared starts: a ring's limit is kept, a pipeline without copies never gets one, a copy beats no reuse") {
  ToyVocab vocab;
  const auto reqs = shared_start_requests(8, 40, 4);
  int tails = 0;
  for (const auto& r : reqs) tails += int(r.prompt.size()) - 40;
  {
    INFO("no copies: each slot evaluates the start");
    ToyPipeline p(256, 4);
    p.copy_limit_ = 0;
    Engine e(p, vocab);
    CHECK(evaluated(run_all(e, reqs, 4)) == tails + 4 * 40);
    CHECK(p.copied == 0);
  }
  {
    INFO("sources longer than the ring are never copied from (the toy refuses them)");
    ToyPipeline p0(256, 4), p(256, 4);
    p.copy_limit_ = 60;  // prompts of 41-52 tokens, replies of up to 23
    EngineOptions off;
    off.share_prefixes = false;
    Engine e0(p0, vocab, off), e(p, vocab);
    const auto got = run_all(e, reqs, 4);
    check_same_results(run_all(e0, reqs, 4), got);
    CHECK(p.copied > 0);
    CHECK(evaluated(got) < tails + 4 * 40);
    // The same with batches in flight and drafts: a source grows in steps built before the copy's
    // is submitted (the toy checks each copy's source as submitted, as the pipelines do).
    EngineOptions drafts;
    drafts.lookup = 8;
    AsyncToyPipeline q(256, 4, 3);
    q.copy_limit_ = 60;
    q.copy_bias = 4.0f;
    ToyPipeline q0(256, 4);
    q0.copy_bias = 4.0f;
    Engine eq(q, vocab, drafts), eq0(q0, vocab, off);
    check_same_results(run_all(eq0, reqs, 4), run_all(eq, reqs, 4));
    CHECK(q.copied > 0);
  }
  {
    INFO("a slot that cannot rewind starts over, and copies the start from another slot");
    ToyPipeline p(256, 2, -2.0f, /*max_rewind=*/1);
    Engine e(p, vocab);
    Request a = reqs[0], b = reqs[1], c = reqs[2];
    a.tag = 0, b.tag = 1, c.tag = 2;
    const auto first = run_all(e, {a, b}, 2);  // slot 0 keeps a's, slot 1 b's
    CHECK(evaluated(first) == int(a.prompt.size() + b.prompt.size()) - 40);
    const Result r = e.generate(c, nullptr, 0);  // slot 0 cannot rewind to the start: it copies
    CHECK(r.prompt_evaluated == int(c.prompt.size()) - 40);
    ToyPipeline fresh_p(256, 1);
    Engine fresh(fresh_p, vocab);
    CHECK(fresh.generate(c).tokens == r.tokens);

    // The same where slot 1 has outgrown its ring: nothing to copy from, c evaluated in full.
    ToyPipeline q(256, 2, -2.0f, 1);
    q.copy_limit_ = int(b.prompt.size());
    Engine eq(q, vocab);
    run_all(eq, {a, b}, 2);
    REQUIRE(q.seq_len(1) > q.copy_limit_);
    const int copied = q.copied;  // (b copied the start from a's slot)
    const Result rq = eq.generate(c, nullptr, 0);
    CHECK(rq.prompt_evaluated == int(c.prompt.size()));
    CHECK(rq.tokens == r.tokens);
    CHECK(q.copied == copied);
  }
}

TEST_CASE("prompt lookup: drafts take at most half of a step's budget, a newcomer's prompt keeps moving") {
  ToyVocab vocab;
  EngineOptions opt;
  opt.prefill_chunk = 16;
  opt.lookup = 64;
  ToyPipeline p(1024, 4, -100.0f);
  p.copy_bias = 50.0f;  // the toy repeats itself: every draft is kept and drafts grow to the limit
  Engine e(p, vocab, opt);
  std::vector<Request> reqs;
  for (int i = 0; i < 4; i++) {
    Request r;
    for (int k = 0; k < (i == 3 ? 120 : 8); k++) r.prompt.push_back(1 + (k * 7 + i) % 30);
    r.sampling.temperature = 0;
    r.max_tokens = i == 3 ? 4 : 200;
    r.tag = uint64_t(i);
    reqs.push_back(r);
  }
  const auto res = run_all(e, reqs, 4);
  REQUIRE(res.size() == 4);
  // Slot 3 holds the 120-token prompt: in every step that carries part of it, before the last
  // chunk, it gets at least half of the 16 tokens whatever the three drafting decoders ask.
  int chunks = 0, prompt = 0;
  for (const auto& step : p.tokens_per_step) {
    if (!step.count(3) || prompt == 120) continue;  // (after it: request 3's decode steps)
    chunks++;
    prompt += step.at(3);
    INFO("chunk " << chunks << ": " << step.at(3) << " tokens");
    if (prompt < 120) CHECK(step.at(3) >= 8);  // (the last chunk: what was left)
  }
  CHECK(prompt == 120);
  CHECK(chunks <= 15);
  int drafted = 0;
  for (const auto& [tag, r] : res) drafted += r.drafted;
  CHECK(drafted > 100);
}

TEST_CASE("random workloads: drafts and copied starts never change a reply") {
  // Requests built from a few shared starts and random tails, random settings, on pipelines with
  // random limits (rings, rewinds, batches in flight): each reply equals the plain engine's.
  ToyVocab vocab;
  for (uint64_t seed = 1; seed <= 60; seed++) {
    INFO("seed " << seed);
    std::mt19937_64 g(seed);
    auto pick = [&](int lo, int hi) { return lo + int(g() % uint64_t(hi - lo + 1)); };
    std::vector<std::vector<int32_t>> starts(size_t(pick(1, 3)));
    for (auto& s : starts)
      for (int k = 0, n = pick(0, 50); k < n; k++) s.push_back(1 + int32_t(g() % (kVocab - 1)));
    std::vector<Request> reqs;
    for (int i = 0, n = pick(3, 10); i < n; i++) {
      Request r;
      r.prompt = starts[g() % starts.size()];
      for (int k = 0, tail = pick(1, 20); k < tail; k++) r.prompt.push_back(1 + int32_t(g() % (kVocab - 1)));
      r.sampling.temperature = g() % 3 ? 0.9f : 0.0f;
      r.sampling.top_k = pick(0, 1) ? 10 : 0;
      r.sampling.repeat_penalty = pick(0, 3) == 0 ? 1.2f : 1.0f;
      r.sampling.seed = g();
      r.max_tokens = pick(0, 40);
      if (pick(0, 4) == 0) r.stop = {std::string(1, kChars[pick(1, 26)])};
      r.tag = uint64_t(i);
      reqs.push_back(std::move(r));
    }
    const int parallel = pick(1, 4), in_flight = pick(1, 3);
    const int copy_limit = pick(0, 1) ? std::numeric_limits<int>::max() : pick(40, 120);
    const int max_rewind = copy_limit == std::numeric_limits<int>::max() ? std::numeric_limits<int>::max() : pick(1, 16);
    const float copy_bias = float(pick(0, 6));
    EngineOptions plain;
    plain.share_prefixes = false;
    ToyPipeline p0(160, 4);
    p0.copy_bias = copy_bias;
    Engine e0(p0, vocab, plain);
    const auto ref = run_all(e0, reqs, parallel);

    EngineOptions opt;
    opt.lookup = pick(0, 10);
    opt.prefill_chunk = pick(8, 64);
    std::unique_ptr<ToyPipeline> p;
    if (in_flight > 1) p = std::make_unique<AsyncToyPipeline>(160, 4, in_flight);
    else p = std::make_unique<ToyPipeline>(160, 4, -2.0f, max_rewind);
    p->copy_bias = copy_bias;
    p->copy_limit_ = copy_limit;
    Engine e(*p, vocab, opt);
    INFO("parallel " << parallel << ", in flight " << in_flight << ", lookup " << opt.lookup << ", copy limit "
                     << copy_limit << ", max rewind " << max_rewind);
    check_same_results(ref, run_all(e, reqs, parallel));
    for (int s = 0; s < parallel; s++) CHECK(p->seq_len(s) == int(e.cached(s).size()));
  }
}

TEST_CASE("logprobs: each token's log-softmax and its best alternatives, from whole rows; replies do not change") {
  // Greedy, top-k and top-k-off requests, some with prompt lookup drafting (rows of drafts the
  // model refuses must not leave logprobs behind), asking 0, 1, 3 or 20 alternatives.
  auto make = [](bool logprobs) {
    std::vector<Request> reqs;
    for (int i = 0; i < 8; i++) {
      Request r;
      r.prompt = {int32_t(1 + i), 9, 4, 9, int32_t(2 + 3 * i), 9, 4};
      r.sampling.temperature = i % 3 == 0 ? 0.0f : 0.9f;
      r.sampling.top_k = i % 2 ? 5 : 0;
      r.sampling.seed = 300 + uint64_t(i);
      r.max_tokens = 16;
      r.tag = uint64_t(i);
      if (logprobs) r.logprobs = std::vector<int>{0, 1, 3, 20}[size_t(i % 4)];
      reqs.push_back(std::move(r));
    }
    return reqs;
  };
  for (int lookup : {0, 4}) {
    INFO("lookup " << lookup);
    ToyVocab vocab;
    EngineOptions opt;
    opt.lookup = lookup;
    ToyPipeline pl(256, 4, -3.0f), pn(256, 4, -3.0f);
    pl.copy_bias = pn.copy_bias = 3.0f;
    Engine el(pl, vocab, opt), en(pn, vocab, opt);
    auto with = run_all(el, make(true), 4);
    auto without = run_all(en, make(false), 4);
    CHECK(pl.argmax_rows + pl.top_k_rows == 0);  // whole rows only
    CHECK(pn.argmax_rows + pn.top_k_rows > 0);
    REQUIRE(with.size() == 8);
    int checked = 0;
    for (auto& [tag, r] : with) {
      const Request want = make(true)[tag];
      CHECK(r.tokens == without[tag].tokens);
      CHECK(without[tag].logprobs.empty());
      REQUIRE(r.logprobs.size() == r.tokens.size());
      std::vector<int32_t> seq = want.prompt;
      std::vector<float> row(kVocab);
      for (size_t p = 0; p < r.tokens.size(); p++) {
        toy_logits(seq, -3.0f, row.data(), 3.0f);
        double sum = 0;
        const float mx = *std::max_element(row.begin(), row.end());
        for (float x : row) sum += std::exp(double(x) - mx);
        const double lse = mx + std::log(sum);
        const TokenLogprob& lp = r.logprobs[p];
        CHECK(lp.id == r.tokens[p]);
        CHECK(std::abs(lp.logprob - (row[size_t(lp.id)] - lse)) < 1e-5);
        std::vector<int32_t> order(kVocab);
        for (int v = 0; v < kVocab; v++) order[size_t(v)] = v;
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[size_t(a)] > row[size_t(b)]; });
        REQUIRE(int(lp.top.size()) == want.logprobs);
        for (size_t k = 0; k < lp.top.size(); k++) {
          CHECK(lp.top[k].first == order[k]);
          CHECK(std::abs(lp.top[k].second - (row[size_t(order[k])] - lse)) < 1e-5);
        }
        seq.push_back(r.tokens[p]);
        checked++;
      }
    }
    CHECK(checked > 60);
    if (lookup) CHECK(std::accumulate(with.begin(), with.end(), 0, [](int s, auto& kv) { return s + kv.second.drafted; }) > 0);
  }
  // More alternatives than the limit: refused with a message.
  ToyVocab vocab;
  ToyPipeline p(64, 1);
  Engine e(p, vocab);
  Request r;
  r.prompt = {1, 2};
  r.logprobs = kMaxTopLogprobs + 1;
  CHECK(e.generate(std::move(r)).error == "top_logprobs 21 is more than 20");
}

TEST_CASE("logit biases and presence/frequency penalties: the engine draws what the sampler draws from whole rows") {
  // The toy's greedy reply, then the same prompt with its first token banned, another favoured,
  // and penalties: each equals a reference sampled token by token with Sampler from toy_logits.
  std::vector<Request> reqs;
  for (int i = 0; i < 6; i++) {
    Request r;
    r.prompt = {int32_t(3 + i), 7, 11};
    r.sampling.temperature = i < 3 ? 0.0f : 0.7f;
    r.sampling.top_k = 8;
    r.sampling.seed = 50 + uint64_t(i);
    r.max_tokens = 24;
    r.tag = uint64_t(i);
    if (i % 3 == 0) r.sampling.logit_bias = {{5, -INFINITY}, {6, -INFINITY}, {12, 2.5f}};
    if (i % 3 == 1) r.sampling.presence_penalty = 1.5f, r.sampling.frequency_penalty = 0.5f;
    if (i % 3 == 2) r.sampling.logit_bias = {{int32_t(i), 1.0f}}, r.sampling.frequency_penalty = -0.3f;
    reqs.push_back(std::move(r));
  }
  ToyVocab vocab;
  ToyPipeline p(256, 3, -100.0f);
  Engine e(p, vocab);
  auto got = run_all(e, reqs, 3);
  CHECK(p.argmax_rows + p.top_k_rows == 0);
  for (const Request& r : reqs) {
    Sampler s(r.sampling);
    std::vector<int32_t> seq = r.prompt, want;
    std::vector<float> row(kVocab);
    for (int t = 0; t < r.max_tokens; t++) {
      toy_logits(seq, -100.0f, row.data());
      want.push_back(s.sample(row.data(), kVocab, seq));
      seq.push_back(want.back());
    }
    INFO("request " << r.tag);
    CHECK(got[r.tag].tokens == want);
    if (r.tag % 3 == 0) {
      CHECK(std::count(want.begin(), want.end(), 5) + std::count(want.begin(), want.end(), 6) == 0);
      CHECK(std::count(want.begin(), want.end(), 12) > 0);
    }
  }
  // The same prompt without the biases does pick the banned tokens: the bans were not idle.
  Request plain = reqs[0];
  plain.sampling.logit_bias.clear();
  plain.tag = 99;
  ToyPipeline p2(256, 1, -100.0f);
  Engine e2(p2, vocab);
  const Result r2 = e2.generate(std::move(plain));
  CHECK(std::count(r2.tokens.begin(), r2.tokens.end(), 5) + std::count(r2.tokens.begin(), r2.tokens.end(), 6) > 0);
  // A bias on a token outside the vocabulary is refused at admission.
  Request bad = reqs[1];
  bad.sampling.logit_bias = {{kVocab, 1.0f}};
  CHECK(e2.generate(std::move(bad)).error == "logit_bias: token 32 is not in the vocabulary (0..31)");
}

TEST_CASE("DRY: the engine flags the tokens whose text holds a breaker and draws what the sampler draws") {
  // The toy repeats itself (copy bias); DRY with '.' and ' ' as breakers, against a reference
  // sampled from toy_logits with those tokens flagged by hand (27 ' ', 28 '.').
  auto reference = [](const Request& r, std::shared_ptr<const std::vector<bool>> breaker) {
    SamplingParams sp = r.sampling;
    sp.dry_breaker = std::move(breaker);
    Sampler s(sp);
    std::vector<int32_t> seq = r.prompt, out;
    std::vector<float> row(kVocab);
    for (int t = 0; t < r.max_tokens; t++) {
      toy_logits(seq, -100.0f, row.data(), 3.0f);
      out.push_back(s.sample(row.data(), kVocab, seq));
      seq.push_back(out.back());
    }
    return out;
  };
  Request r;
  r.prompt = {3, 1, 20, 27, 3, 1, 20, 28, 3, 1};
  r.sampling.temperature = 0;
  r.sampling.dry_multiplier = 1.5f;
  r.sampling.dry_allowed_length = 1;
  r.sampling.dry_sequence_breakers = {".", " "};
  r.max_tokens = 40;
  auto flags = std::make_shared<std::vector<bool>>(kVocab, false);
  (*flags)[27] = (*flags)[28] = true;
  const std::vector<int32_t> want = reference(r, flags);
  ToyVocab vocab;
  ToyPipeline p(256, 1, -100.0f);
  p.copy_bias = 3.0f;
  Engine e(p, vocab);
  const Result got = e.generate(r);
  CHECK(got.tokens == want);
  CHECK(p.argmax_rows == 0);  // DRY needs the whole row
  // The breakers changed the reply, and so did DRY itself.
  CHECK(reference(r, nullptr) != want);
  Request plain = r;
  plain.sampling.dry_multiplier = 0;
  CHECK(reference(plain, nullptr) != want);
}
