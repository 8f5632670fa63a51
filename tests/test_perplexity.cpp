// Perplexity and KL divergence (runtime/perplexity.h, `baton perplexity`): the chunks scored as
// llama-perplexity scores them, checked against the same NLLs computed from whole-chunk logits;
// the same numbers from one slot, from several and from two stages; base files written, read,
// refused when they do not match; a stop between chunks. The command end to end on a generated
// model. (SmolLM2 on a real text against its words shuffled: tests/test_real_cli.cpp.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gguf/error.h"
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
  const PerplexityStats st = perplexity(*p, tokens, o, [&](const PerplexityStats& s) { seen.push_back(s.chunks); });
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
  o.kl_base = dir + "/missing.bin";
  refused(o, tokens, "cannot open the base file");
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
                       Bad{"perplexity -m " + m + " -f " + dir + "/nope.txt", "nope.txt"},
                       Bad{"perplexity" + common + " --save-base " + base + " --kl-base " + base, "the same file"},
                       Bad{"perplexity -m " + m + " -f " + text + " -c 32 --kl-base " + base, "written with -c 64"}}) {
    INFO(b.args);
    const test::Out e = run_baton(b.args);
    CHECK(e.code == 1);
    CHECK_THAT(e.err, Catch::Contains(b.says));
  }
}
