// Perplexity and KL divergence (runtime/perplexity.h, `baton perplexity`): the chunks scored as
// llama-perplexity scores them, checked against the same NLLs computed from whole-chunk logits;
// the same numbers from one slot, from several and from two stages; base files written, read,
// refused when they do not match; llama-perplexity's base files read as Baton's own; a stop
// between chunks. The command end to end on a generated model. (SmolLM2 on a real text against
// its words shuffled: tests/test_real_cli.cpp.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "quant/types.h"
#include "runtime/perplexity.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"
#include "tests/cli_helpers.h"
#include "tests/helpers.h"
#include "tests/model_helpers.h"

using namespace baton;

namespace {

std::unique_ptr<Pipeline> load(const std::string& path, int n_ctx, int n_seq, const std::string& devices = "cpu") {
  return test::load_pipeline(path, devices, n_seq, n_ctx);
}

std::vector<int32_t> random_tokens(int n, int n_vocab, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(g() % uint32_t(n_vocab - 10)) + 10;  // clear of the special tokens
  return t;
}

// The reference: every chunk evaluated whole with all its logits, the NLLs of the second half
// summed in double from those rows; optionally the KL divergence from a base's logits.
struct Direct {
  double nll = 0;
  int64_t count = 0;
  std::vector<std::vector<float>> rows;  // each scored row's logits, in order
};
Direct direct(Pipeline& p, const std::vector<int32_t>& tokens, int n_ctx, int n_chunks) {
  Direct d;
  const int V = p.n_vocab(), first = n_ctx / 2;
  const Tokenizer& tok = p.tokenizer();
  std::vector<float> logits(size_t(n_ctx) * size_t(V));
  for (int c = 0; c < n_chunks; ++c) {
    p.truncate_seq(0, 0);
    Batch b;
    for (int k = 0; k < n_ctx; ++k)
      b.add(k == 0 && tok.add_bos() ? tok.bos() : tokens[size_t(c * n_ctx + k)], k, 0, true);
    p.decode(b, logits.data());
    for (int j = first; j < n_ctx - 1; ++j) {
      const float* row = logits.data() + size_t(j) * size_t(V);
      d.nll += token_nll(row, V, tokens[size_t(c * n_ctx + j + 1)]);
      d.rows.emplace_back(row, row + V);
      ++d.count;
    }
  }
  return d;
}


// A Baton base file (runtime/perplexity.cpp has the layout) read back: its header, tokens and
// each scored row's log-probabilities.
struct BaseRead {
  int32_t n_ctx = 0, V = 0, n_chunks = 0;
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> rows;
};
BaseRead read_baton_base(const std::string& path) {
  const std::string f = test::slurp(path);
  BaseRead b;
  REQUIRE(f.size() >= 20);
  REQUIRE(f.compare(0, 8, "BATONKL1") == 0);
  std::memcpy(&b.n_ctx, f.data() + 8, 4);
  std::memcpy(&b.V, f.data() + 12, 4);
  std::memcpy(&b.n_chunks, f.data() + 16, 4);
  const size_t n_rows = size_t(b.n_ctx - 1 - b.n_ctx / 2), V = size_t(b.V);
  size_t at = 20;
  for (int c = 0; c < b.n_chunks; ++c) {
    REQUIRE(f.size() >= at + size_t(b.n_ctx) * 4 + n_rows * V * 2);
    const size_t t0 = b.tokens.size();
    b.tokens.resize(t0 + size_t(b.n_ctx));
    std::memcpy(b.tokens.data() + t0, f.data() + at, size_t(b.n_ctx) * 4);
    at += size_t(b.n_ctx) * 4;
    for (size_t r = 0; r < n_rows; ++r, at += V * 2) {
      std::vector<uint16_t> h(V);
      std::memcpy(h.data(), f.data() + at, V * 2);
      std::vector<float>& row = b.rows.emplace_back(V);
      for (size_t v = 0; v < V; ++v) row[v] = fp16_to_f32(h[v]);
    }
  }
  return b;
}

// The same rows in llama-perplexity's format, laid out as its --kl-divergence-base writes them
// (the layout: runtime/perplexity.cpp): "_logits_", n_ctx, n_vocab, n_chunks, all the tokens, then
// per row a float scale and floor and one uint16 per token (padded to an even count), spanning the
// row's top 16 nats in 65535 steps, anything below them 0.
template <class T>
void put(std::string& s, const T* v, size_t n) {
  s.append(reinterpret_cast<const char*>(v), n * sizeof(T));
}
std::string llama_base(const BaseRead& b) {
  std::string s = "_logits_";
  put(s, &b.n_ctx, 1);
  put(s, &b.V, 1);
  put(s, &b.n_chunks, 1);
  put(s, b.tokens.data(), b.tokens.size());
  for (const std::vector<float>& x : b.rows) {
    const float top = *std::max_element(x.begin(), x.end());
    const float low = std::max(*std::min_element(x.begin(), x.end()), top - 16);
    double z = 0;
    for (float v : x) z += std::exp(double(v) - double(top));
    const float scale = (top - low) / 65535, floor = float(double(low - top) - std::log(z));
    std::vector<uint16_t> q(2 * ((x.size() + 1) / 2));
    for (size_t v = 0; v < x.size(); ++v)
      if (x[v] > low) q[v] = uint16_t(std::min<long>(65535, std::lround((x[v] - low) / scale)));
    put(s, &scale, 1);
    put(s, &floor, 1);
    put(s, q.data(), q.size());
  }
  return s;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}
}  // namespace

TEST_CASE("token_nll is the negative log-softmax of the token, also for logits far from zero") {
  std::mt19937 g(3);
  std::normal_distribution<float> n(0, 4);
  for (float shift : {0.f, 80.f, -200.f}) {
    std::vector<float> x(1000);
    for (auto& v : x) v = n(g) + shift;
    double z = 0;
    for (float v : x) z += std::exp(double(v) - double(shift));
    for (int t : {0, 17, 999}) CHECK(token_nll(x.data(), 1000, t) == Approx(std::log(z) + shift - x[size_t(t)]).epsilon(1e-9));
  }
  const float sure[3] = {0, 60, 0};
  CHECK(token_nll(sure, 3, 1) == Approx(2 * std::exp(-60.0)).margin(1e-20));
  CHECK(token_nll(sure, 3, 0) == Approx(60 + std::log1p(2 * std::exp(-60.0))).epsilon(1e-12));
}

TEST_CASE("perplexity scores each chunk's second half, as whole-chunk logits say, from one slot, several or two stages") {
  const std::string path = test::tiny_model_of(GgmlType::Q8_0);
  const int n_ctx = 64;
  auto p = load(path, n_ctx, 1);
  REQUIRE(p->tokenizer().add_bos());  // the first token of every chunk becomes BOS
  const auto tokens = random_tokens(n_ctx * 3 + 20, p->n_vocab(), 1);  // 3 chunks, 20 tokens left over
  PerplexityOptions o;
  o.n_ctx = n_ctx;
  REQUIRE(perplexity_chunks(tokens.size(), o) == 3);
  std::vector<double> running;
  const PerplexityStats st = perplexity(*p, tokens, o, [&](const PerplexityStats& s) { running.push_back(s.ppl()); });
  const Direct d = direct(*p, tokens, n_ctx, 3);
  CHECK(st.chunks == 3);
  CHECK(st.count == 3 * (n_ctx - 1 - n_ctx / 2));
  CHECK(st.count == d.count);
  CHECK(std::log(st.ppl()) == Approx(d.nll / double(d.count)).epsilon(1e-6));
  REQUIRE(running.size() == 3);
  CHECK(running.back() == st.ppl());
  CHECK(st.ppl() > 1);
  CHECK(st.ppl_error() > 0);
  CHECK(st.ppl_error() < st.ppl());

  // The chunk's first token is BOS, not the text's: scoring the text with another first token per
  // chunk changes nothing; changing a scored token does.
  auto other = tokens;
  other[0] = other[size_t(n_ctx)] = 77;
  CHECK(perplexity(*p, other, o, nullptr).nll == Approx(st.nll).epsilon(1e-12));
  other[size_t(n_ctx + n_ctx / 2 + 3)] = 78;
  CHECK(perplexity(*p, other, o, nullptr).nll != Approx(st.nll).epsilon(1e-9));

  o.max_chunks = 2;
  CHECK(perplexity(*p, tokens, o, nullptr).count == 2 * (n_ctx - 1 - n_ctx / 2));
  o.max_chunks = -1;

  auto slots = load(path, n_ctx, 3);  // one stage: one chunk in flight whatever the slots
  CHECK(perplexity(*slots, tokens, o, nullptr).nll == Approx(st.nll).epsilon(1e-9));
  auto stages = load(path, n_ctx, 2, "cpu,cpu");  // two chunks in flight, one per stage
  REQUIRE(stages->max_in_flight() == 2);
  std::vector<int> seen;
  const PerplexityStats two = perplexity(*stages, tokens, o, [&](const PerplexityStats& s) { seen.push_back(s.chunks); });
  CHECK(seen == std::vector<int>{1, 2, 3});
  CHECK(two.nll == Approx(st.nll).epsilon(1e-6));
}

TEST_CASE("chunks of more than 128 scored rows go in pieces: the same NLLs, one stage or two, a base alike") {
  const std::string path = test::tiny_model_of(GgmlType::Q8_0);
  const int n_ctx = 300;  // 149 scored rows: a piece of 128 (with the unscored half), then one of 21
  auto p = load(path, n_ctx, 1);
  const auto tokens = random_tokens(n_ctx * 2 + 7, p->n_vocab(), 8);
  PerplexityOptions o;
  o.n_ctx = n_ctx;
  const std::string base = test::temp_dir() + "/pieces.bin";
  o.save_base = base;
  std::vector<int> seen;
  const std::string killed = base + ".killed";  // the file as a run killed after its first chunk leaves it
  const PerplexityStats st = perplexity(*p, tokens, o, [&](const PerplexityStats& s) {
    seen.push_back(s.chunks);
    if (s.chunks == 1) std::filesystem::copy_file(base, killed);
  });
  CHECK(seen == std::vector<int>{1, 2});  // once per chunk, not per piece
  CHECK(st.count == 2 * 149);
  const Direct d = direct(*p, tokens, n_ctx, 2);
  CHECK(std::log(st.ppl()) == Approx(d.nll / double(d.count)).epsilon(1e-6));
  auto stages = load(path, n_ctx, 2, "cpu,cpu");  // pieces of two chunks in flight on two slots
  o.save_base.clear();
  o.kl_base = base;
  const PerplexityStats two = perplexity(*stages, tokens, o, nullptr);
  CHECK(two.nll == Approx(st.nll).epsilon(1e-6));
  CHECK(two.kld_mean() < 1e-5);
  CHECK(two.same_top_fraction() == 1.0);
  // Its header counts the chunk that was complete: a base of that one chunk.
  o.kl_base = killed;
  const PerplexityStats one = perplexity(*p, tokens, o, nullptr);
  CHECK(one.count == 149);
  CHECK(one.kld_mean() < 1e-5);
}

TEST_CASE("perplexity of a sliding-window model over chunks longer than its window") {
  const std::string path = test::tiny_gemma3_model();  // window 16, 6 of 7 layers sliding
  auto p = load(path, 48, 1);
  const auto tokens = random_tokens(48 * 2, p->n_vocab(), 2);
  PerplexityOptions o;
  o.n_ctx = 48;
  const PerplexityStats st = perplexity(*p, tokens, o, nullptr);
  const Direct d = direct(*p, tokens, 48, 2);
  CHECK(std::log(st.ppl()) == Approx(d.nll / double(d.count)).epsilon(1e-6));
}

TEST_CASE("a base file compares two models token by token: itself ~0, another by its KL divergence") {
  const std::string a = test::tiny_model_of(GgmlType::Q8_0), b = test::tiny_model_of(GgmlType::Q4_0);
  const int n_ctx = 32;
  auto pa = load(a, n_ctx, 1), pb = load(b, n_ctx, 1);
  const auto tokens = random_tokens(n_ctx * 2, pa->n_vocab(), 4);
  const std::string base = test::temp_dir() + "/ppl-base.bin";
  PerplexityOptions o;
  o.n_ctx = n_ctx;
  o.save_base = base;
  const PerplexityStats sa = perplexity(*pa, tokens, o, nullptr);
  CHECK(sa.kld_values.empty());
  o.save_base.clear();
  o.kl_base = base;

  const PerplexityStats self = perplexity(*pa, tokens, o, nullptr);
  CHECK(self.kld_mean() < 1e-5);  // fp16 log-probabilities
  CHECK(self.same_top_fraction() == 1.0);
  CHECK(self.base_ppl() == Approx(sa.ppl()).epsilon(1e-3));
  CHECK(self.nll_correlation() > 0.9999);

  const PerplexityStats other = perplexity(*pb, tokens, o, nullptr);
  const Direct da = direct(*pa, tokens, n_ctx, 2), db = direct(*pb, tokens, n_ctx, 2);
  double kl = 0;
  int same = 0;
  for (size_t i = 0; i < da.rows.size(); ++i) {
    kl += test::kl_divergence(da.rows[i].data(), db.rows[i].data(), pa->n_vocab());
    same += std::max_element(da.rows[i].begin(), da.rows[i].end()) - da.rows[i].begin() ==
            std::max_element(db.rows[i].begin(), db.rows[i].end()) - db.rows[i].begin();
  }
  kl /= double(da.rows.size());
  REQUIRE(kl > 1e-4);  // Q4_0 is measurably another model
  CHECK(other.kld_mean() == Approx(kl).epsilon(0.02).margin(1e-5));
  CHECK(std::abs(double(other.same_top) - same) <= 1);  // an fp16 near-tie may rank differently
  CHECK(other.kld_values.size() == size_t(other.count));
  CHECK(other.base_ppl() == Approx(sa.ppl()).epsilon(1e-3));
  CHECK(other.ppl() == Approx(std::exp(db.nll / double(db.count))).epsilon(1e-6));
  CHECK(other.kld_error() > 0);

  // A base of fewer chunks than the text: the comparison covers the chunks it has.
  o.kl_base.clear();
  o.save_base = base;
  o.max_chunks = 1;
  perplexity(*pa, tokens, o, nullptr);
  o.save_base.clear();
  o.kl_base = base;
  o.max_chunks = -1;
  CHECK(perplexity(*pb, tokens, o, nullptr).chunks == 1);
}

TEST_CASE("perplexity refuses what it cannot score, naming the problem, before anything runs") {
  const std::string path = test::tiny_model_of(GgmlType::Q8_0);
  auto p = load(path, 64, 1);
  const auto tokens = random_tokens(64 * 2, p->n_vocab(), 5);
  PerplexityOptions o;
  auto refused = [&](const PerplexityOptions& opt, const std::vector<int32_t>& t, const std::string& says) {
    INFO(says);
    try {
      perplexity(*p, t, opt, nullptr);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::Usage);
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  o.n_ctx = 64;
  refused(o, std::vector<int32_t>(tokens.begin(), tokens.begin() + 63), "fewer than one chunk of 64");
  o.n_ctx = 128;
  refused(o, tokens, "do not fit the context of 64");
  o.n_ctx = 2;
  refused(o, tokens, "too short");
  o.n_ctx = 64;
  o.max_chunks = 0;
  refused(o, tokens, "nothing to score");
  o.max_chunks = -1;

  const std::string dir = test::temp_dir();
  // A base file that is missing or a directory is a file problem (exit 2), as any input file.
  for (const std::string& f : {dir + "/missing.bin", dir}) {
    o.kl_base = f;
    try {
      perplexity(*p, tokens, o, nullptr);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::Model);
      CHECK_THAT(e.what(), Catch::Contains(f == dir ? "is a directory" : "No such file or directory"));
    }
  }
  std::ofstream(dir + "/not-base.bin") << "GGUF and more bytes than a header";
  o.kl_base = dir + "/not-base.bin";
  refused(o, tokens, "is not a base file");

  PerplexityOptions save;
  save.n_ctx = 32;
  save.save_base = dir + "/c32.bin";
  perplexity(*p, tokens, save, nullptr);
  o.kl_base = save.save_base;
  refused(o, tokens, "written with -c 32, this run has -c 64");
  save.n_ctx = 64;
  save.save_base = dir + "/c64.bin";
  perplexity(*p, tokens, save, nullptr);
  auto shifted = tokens;
  shifted[70] += 1;
  o.kl_base = save.save_base;
  refused(o, shifted, "computed on other tokens (chunk 2 differs)");
  const std::string whole = test::slurp(save.save_base);
  std::ofstream(dir + "/cut.bin", std::ios::binary) << whole.substr(0, whole.size() - 100);
  o.kl_base = dir + "/cut.bin";
  refused(o, tokens, "ends early");
}

TEST_CASE("a llama-perplexity base is read as Baton's own: the same rows, the same statistics, in pieces too") {
  const std::string a = test::tiny_model_of(GgmlType::Q8_0), b = test::tiny_model_of(GgmlType::Q4_0);
  const int n_ctx = 300;  // 149 scored rows a chunk: the rows are read in pieces of 128 and 21
  auto pa = load(a, n_ctx, 1), pb = load(b, n_ctx, 2, "cpu,cpu");
  const auto tokens = random_tokens(n_ctx * 2, pa->n_vocab(), 10);
  const std::string dir = test::temp_dir(), ours = dir + "/ours.bin", theirs = dir + "/theirs.kld";
  PerplexityOptions o;
  o.n_ctx = n_ctx;
  o.save_base = ours;
  const PerplexityStats sa = perplexity(*pa, tokens, o, nullptr);
  write_file(theirs, llama_base(read_baton_base(ours)));
  o.save_base.clear();

  o.kl_base = theirs;
  const PerplexityStats self = perplexity(*pa, tokens, o, nullptr);
  CHECK(self.count == 2 * 149);
  CHECK(self.kld_mean() < 1e-5);  // the same rows, rounded twice (fp16, then 65535 steps)
  CHECK(self.same_top_fraction() == 1.0);
  CHECK(self.base_ppl() == Approx(sa.ppl()).epsilon(1e-3));
  CHECK(self.nll_correlation() > 0.9999);

  // Another model against either file: the same numbers up to the rounding.
  const PerplexityStats vs_theirs = perplexity(*pb, tokens, o, nullptr);
  o.kl_base = ours;
  const PerplexityStats vs_ours = perplexity(*pb, tokens, o, nullptr);
  REQUIRE(vs_ours.kld_mean() > 1e-4);
  CHECK(vs_theirs.kld_mean() == Approx(vs_ours.kld_mean()).epsilon(1e-3));
  CHECK(vs_theirs.kld_error() == Approx(vs_ours.kld_error()).epsilon(0.01));
  CHECK(vs_theirs.base_ppl() == Approx(vs_ours.base_ppl()).epsilon(1e-3));
  CHECK(vs_theirs.ppl() == vs_ours.ppl());
  CHECK(vs_theirs.nll_correlation() == Approx(vs_ours.nll_correlation()).epsilon(1e-4));
  CHECK(std::abs(double(vs_theirs.same_top) - double(vs_ours.same_top)) <= 1);
  REQUIRE(vs_theirs.kld_values.size() == vs_ours.kld_values.size());
  for (size_t i = 0; i < vs_ours.kld_values.size(); ++i) {
    INFO(i);
    CHECK(vs_theirs.kld_values[i] == Approx(vs_ours.kld_values[i]).epsilon(0.01).margin(1e-5));
  }
}

TEST_CASE("a llama-perplexity base of an odd vocabulary: rows padded to an even count") {
  const std::string m = test::synth_q8_model(
      {"tiny-odd-vocab", "llama", "test", 1, 64, 2, 1, 32, 128, 1001, 2048, false, 0, 0, 10000.f, 1e-5f, false}, 12);
  auto p = load(m, 32, 1);
  REQUIRE(p->n_vocab() == 1001);
  const auto tokens = random_tokens(32 * 3, p->n_vocab(), 11);
  const std::string dir = test::temp_dir();
  PerplexityOptions o;
  o.n_ctx = 32;
  o.save_base = dir + "/odd.bin";
  const PerplexityStats st = perplexity(*p, tokens, o, nullptr);
  write_file(dir + "/odd.kld", llama_base(read_baton_base(o.save_base)));
  o.save_base.clear();
  o.kl_base = dir + "/odd.kld";
  const PerplexityStats self = perplexity(*p, tokens, o, nullptr);
  CHECK(self.chunks == 3);
  CHECK(self.kld_mean() < 1e-5);  // a row read one value off would be another distribution
  CHECK(self.same_top_fraction() == 1.0);
  CHECK(self.base_ppl() == Approx(st.ppl()).epsilon(1e-3));
}

TEST_CASE("a llama-perplexity base that does not match, or is cut short or corrupt, is refused by name") {
  const std::string path = test::tiny_model_of(GgmlType::Q8_0);
  auto p = load(path, 64, 1);
  const auto tokens = random_tokens(64 * 2, p->n_vocab(), 12);
  const std::string dir = test::temp_dir(), kld = dir + "/bad.kld";
  PerplexityOptions o;
  o.n_ctx = 64;
  o.save_base = dir + "/good.bin";
  perplexity(*p, tokens, o, nullptr);
  const std::string good = llama_base(read_baton_base(o.save_base));
  o.save_base.clear();
  o.kl_base = kld;
  auto refused = [&](const std::string& bytes, const PerplexityOptions& opt, const std::vector<int32_t>& t,
                     const std::string& says) {
    INFO(says);
    write_file(kld, bytes);
    try {
      perplexity(*p, t, opt, nullptr);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::Usage);
      CHECK_THAT(e.what(), Catch::Contains(kld));
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  auto with_int = [&](size_t at, int32_t v) {
    std::string s = good;
    std::memcpy(s.data() + at, &v, 4);
    return s;
  };
  write_file(kld, good);
  CHECK(perplexity(*p, tokens, o, nullptr).kld_mean() < 1e-5);  // the file as written is fine

  PerplexityOptions c32 = o;
  c32.n_ctx = 32;
  refused(good, c32, tokens, "written with -c 64, this run has -c 32");
  refused(with_int(12, 1499), o, tokens, "has a vocabulary of 1499 tokens, this model 1500");
  refused(with_int(16, 0), o, tokens, "holds no chunks");
  auto shifted = tokens;
  shifted[70] += 1;
  refused(good, o, shifted, "computed on other tokens (chunk 2 differs)");
  refused(good.substr(0, good.size() - 100), o, tokens, "ends early");
  refused(good.substr(0, 20 + 64 * 4 + 10), o, tokens, "ends early");  // inside the tokens
  refused(good.substr(0, 14), o, tokens, "ends early");                  // inside the header
  refused(with_int(16, 0x7fffffff), o, tokens, "ends early");          // a count no file could hold
  // A row's scale not a number: found when its chunk is scored (chunk 2, position 32 + 5).
  const size_t row_bytes = (4 + 1500) * 2, rows_at = 20 + 2 * 64 * 4;
  std::string nan_scale = good;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan_scale.data() + rows_at + (31 + 5) * row_bytes, &nan, 4);
  refused(nan_scale, o, tokens, "row for position 37 of chunk 2 is no distribution");
}

TEST_CASE("a stop between chunks returns what was scored, and a base written so far is usable") {
  const std::string path = test::tiny_model_of(GgmlType::Q8_0);
  auto p = load(path, 32, 1);
  const auto tokens = random_tokens(32 * 4, p->n_vocab(), 6);
  std::atomic<bool> stop{false};
  PerplexityOptions o;
  o.n_ctx = 32;
  const std::string base = test::temp_dir() + "/stopped.bin";
  o.save_base = base;
  const PerplexityStats st = perplexity(*p, tokens, o, [&](const PerplexityStats& s) { stop = s.chunks == 2; }, &stop);
  CHECK(st.chunks == 2);
  o.save_base.clear();
  o.kl_base = base;
  const PerplexityStats again = perplexity(*p, tokens, o, nullptr);
  CHECK(again.chunks == 2);
  CHECK(again.kld_mean() < 1e-5);
}

TEST_CASE("baton perplexity: the running estimates, the final line, --json, a base compared, bad input named") {
  using test::run_baton;
  const std::string m = test::tiny_model_of(GgmlType::Q8_0);
  const std::string dir = test::temp_dir(), text = dir + "/text.txt", base = dir + "/base.bin";
  {
    std::ofstream f(text);
    std::mt19937 g(9);
    const char* words[] = {"the", "model", "reads", "a", "long", "text", "and", "scores", "every", "token", "of", "it"};
    for (int i = 0; i < 1500; ++i) f << words[g() % 12] << (i % 13 == 12 ? ".\n" : " ");
  }
  const std::string common = " -m " + m + " -f " + text + " -c 64 -t 2";
  test::Out o = run_baton("perplexity" + common + " --chunks 3 --save-base " + base);
  REQUIRE(o.code == 0);
  INFO(o.err);
  CHECK_THAT(o.out, Catch::StartsWith("[1]"));
  CHECK_THAT(o.out, Catch::Contains(",[3]"));
  CHECK_THAT(o.out, !Catch::Contains("[4]"));
  const size_t at = o.out.find("Final estimate: PPL = ");
  REQUIRE(at != std::string::npos);
  const double ppl = std::stod(o.out.substr(at + 22));
  CHECK_THAT(o.err, Catch::Contains("3 chunks, 93 tokens scored"));
  CHECK_THAT(run_baton("perplexity" + common + " --chunks 1").err, Catch::Contains("\n1 chunk, 31 tokens scored |"));

  test::Out j = run_baton("perplexity" + common + " --json --kl-base " + base);
  REQUIRE(j.code == 0);
  const auto r = nlohmann::json::parse(j.out);
  CHECK(r["chunks"] == 3);  // the base holds 3 of the text's chunks
  CHECK(r["tokens_scored"] == 93);
  CHECK(r["ppl"].get<double>() == Approx(ppl).epsilon(1e-4));
  CHECK(r["kl"]["kld_mean"].get<double>() < 1e-5);
  CHECK(r["kl"]["same_top"] == 1.0);
  CHECK(r["kl"]["ppl_ratio"].get<double>() == Approx(1).epsilon(1e-3));

  test::Out k = run_baton("perplexity -m " + test::tiny_model_of(GgmlType::Q4_0) + " -f " + text + " -c 64 -t 2 --kl-base " + base);
  REQUIRE(k.code == 0);
  CHECK_THAT(k.out, Catch::Contains("Mean KLD"));
  CHECK_THAT(k.out, Catch::Contains("Same top token"));

  std::ofstream(dir + "/empty.txt").flush();
  std::ofstream(dir + "/short.txt") << "the model reads";
  struct Bad {
    std::string args, says;
  };
  for (const Bad& b : {Bad{"perplexity -m " + m, "--file is required"},
                       Bad{"perplexity -m " + m + " -f " + dir + "/empty.txt", "is empty"},
                       Bad{"perplexity -m " + m + " -f " + dir + "/short.txt -c 64", "fewer than one chunk of 64"},
                       Bad{"perplexity" + common + " --save-base " + base + " --kl-base " + base, "the same file"},
                       Bad{"perplexity -m " + m + " -f " + text + " -c 32 --kl-base " + base, "written with -c 64"}}) {
    INFO(b.args);
    const test::Out e = run_baton(b.args);
    CHECK(e.code == 1);
    CHECK_THAT(e.err, Catch::Contains(b.says));
  }
  const test::Out missing = run_baton("perplexity -m " + m + " -f " + dir + "/nope.txt");  // a file problem
  CHECK(missing.code == 2);
  CHECK_THAT(missing.err, Catch::Contains("nope.txt"));
}
