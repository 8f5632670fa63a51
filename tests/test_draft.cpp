// Speculative decoding with a draft model (runtime/draft_model.h, `--draft-model`): the replies are
// the target's alone, greedy and sampled, on one stage or two and with sliding-window rings; a
// draft model that is the target itself has every greedy guess kept; the draft cache keeps what it
// shares with the next history; vocabularies that differ are refused, naming how.
#include <catch2/catch.hpp>

#include <map>

#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/draft_model.h"
#include "runtime/engine.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"
#include "tests/cli_helpers.h"
#include "tests/helpers.h"
#include "tests/model_helpers.h"

using namespace baton;

namespace {

std::unique_ptr<Pipeline> load(const std::string& path, const std::string& devices, int n_seq, int n_ctx = 256) {
  return test::load_pipeline(path, devices, n_seq, n_ctx);
}

std::vector<Request> requests() {
  std::vector<Request> reqs;
  for (int i = 0; i < 4; ++i) {
    Request r;
    for (int k = 0; k < 12; ++k) r.prompt.push_back(int32_t(20 + 7 * k + 3 * i));
    r.max_tokens = 40;
    r.sampling.temperature = i % 2 ? 0.9f : 0.0f;
    r.sampling.seed = uint64_t(i);
    r.tag = uint64_t(i);
    reqs.push_back(r);
  }
  return reqs;
}

std::map<uint64_t, Result> run_requests(Pipeline& p, const std::vector<Request>& reqs, const EngineOptions& opt,
                                        int parallel) {
  return test::run_requests(p, *tokenizer_vocab(p.tokenizer()), reqs, opt, parallel);
}

EngineOptions with_draft(const std::string& draft_path, const Pipeline& target, int max_len) {
  EngineOptions o;
  o.lookup = max_len;
  o.drafter = std::make_shared<ModelDrafter>(load(draft_path, "cpu", target.n_seq(), target.n_ctx()), target.n_vocab());
  return o;
}

}  // namespace

TEST_CASE("a draft model's guesses are checked by the model: its replies, greedy and sampled, one stage or two") {
  const std::string target = test::tiny_model_of(GgmlType::Q8_0);
  const std::string twin = test::tiny_model_of(GgmlType::Q4_0);  // the same weights, rounded to 4 bits
  const auto reqs = requests();
  for (const char* devices : {"cpu", "cpu,cpu"}) {
    INFO("target on " << devices);
    auto p = load(target, devices, 2);
    const auto ref = run_requests(*p, reqs, {}, 2);
    {
      INFO("draft: the Q4_0 twin");
      const auto got = run_requests(*p, reqs, with_draft(twin, *p, 6), 2);
      int drafted = 0, kept = 0;
      for (const auto& [tag, r] : ref) {
        INFO("request " << tag);
        CHECK(got.at(tag).tokens == r.tokens);
        CHECK(got.at(tag).draft_accepted <= got.at(tag).drafted);
        drafted += got.at(tag).drafted;
        kept += got.at(tag).draft_accepted;
      }
      CHECK(kept > 0);  // the twin agrees at times (random weights: flat distributions, near ties)
      CHECK(kept < drafted);      // but not always
    }
    {
      INFO("draft: the model itself");
      const auto got = run_requests(*p, reqs, with_draft(target, *p, 6), 2);
      for (const auto& [tag, r] : ref) {
        INFO("request " << tag);
        CHECK(got.at(tag).tokens == r.tokens);
        CHECK(got.at(tag).drafted > 0);
        if (reqs[tag].sampling.temperature == 0) CHECK(got.at(tag).draft_accepted == got.at(tag).drafted);
      }
    }
  }
}

TEST_CASE("a sliding-window draft model rewinds its rings or starts the slot over; the replies do not change") {
  const std::string model = test::tiny_gemma3_model();  // window 16: the contexts below outgrow it
  auto p = load(model, "cpu", 2);
  const auto reqs = requests();
  const auto ref = run_requests(*p, reqs, {}, 2);
  const auto got = run_requests(*p, reqs, with_draft(model, *p, 8), 2);
  for (const auto& [tag, r] : ref) {
    INFO("request " << tag);
    CHECK(got.at(tag).tokens == r.tokens);
  }
}

TEST_CASE("the draft cache keeps what the next history shares with it and evaluates only the rest") {
  const std::string model = test::tiny_model_of(GgmlType::Q8_0);
  ModelDrafter d(load(model, "cpu", 1), 1 << 20);
  std::vector<int32_t> h;
  for (int k = 0; k < 20; ++k) h.push_back(int32_t(30 + 11 * k));
  std::vector<int32_t> out;
  d.draft(0, h, 4, out);
  REQUIRE(out.size() == 4);  // (a random model: no end-of-generation guess this early)
  CHECK(d.evaluated() == h.size() + 3);  // the history, then each guess but the last
  // The model kept two guesses and then sampled another token: one token is new to the draft cache.
  auto h2 = h;
  h2.push_back(out[0]);
  h2.push_back(out[1]);
  h2.push_back(out[2] == 5 ? 6 : 5);
  std::vector<int32_t> out2;
  d.draft(0, h2, 4, out2);
  CHECK(out2.size() == 4);
  CHECK(d.evaluated() == h.size() + 3 + 1 + 3);
  // The same history again: only its last token is evaluated again (for its logits).
  std::vector<int32_t> out3;
  const uint64_t before = d.evaluated();
  d.draft(0, h2, 2, out3);
  CHECK(d.evaluated() == before + 1 + 1);
  CHECK(std::vector<int32_t>(out2.begin(), out2.begin() + 2) == out3);
  // Another history in the slot: it starts over.
  std::vector<int32_t> other = {40, 41, 42};
  std::vector<int32_t> out4;
  d.draft(0, other, 1, out4);
  CHECK(d.evaluated() == before + 2 + 3);
  CHECK(d.pipeline().seq_len(0) == 3);
}

TEST_CASE("a draft model must share the model's tokenizer") {
  auto tok = [](const std::string& path) { return Tokenizer::from_gguf(*gguf::File::open(path)); };
  const Tokenizer llama = tok(test::tiny_model_of(GgmlType::Q8_0)), twin = tok(test::tiny_model_of(GgmlType::Q4_0));
  CHECK_NOTHROW(check_draft_vocab(llama, twin));
  const Tokenizer gemma = tok(test::tiny_gemma3_model());
  REQUIRE(std::abs(gemma.n_vocab() - llama.n_vocab()) > 128);
  CHECK_THROWS_WITH(check_draft_vocab(llama, gemma), Catch::Contains("vocabulary has 1000 tokens, the model's 1500"));
  const Tokenizer smol = tok(test::peer("logits/tiny-q4_0.gguf"));
  INFO("peer model: " << smol.n_vocab() << " tokens");
  CHECK_THROWS_AS(check_draft_vocab(llama, smol), Error);
}

TEST_CASE("baton run --draft-model: the same reply; with --lookup or another tokenizer, a usage error") {
  using test::run_baton;
  const std::string target = test::tiny_model_of(GgmlType::Q8_0), twin = test::tiny_model_of(GgmlType::Q4_0);
  const std::string common = "run -m " + target + " -p 'tell me about the sea' --temp 0 -n 30 -t 2 --raw";
  const test::Out a = run_baton(common + " --json"), b = run_baton(common + " --draft-model " + twin + " --draft-max 4 --json");
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  INFO(b.out);
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  CHECK(jb["text"] == ja["text"]);
  CHECK(jb["tokens"] == 30);
  CHECK(jb["draft"]["drafted"].get<int>() > 0);
  CHECK(jb["draft"]["accepted"].get<int>() > 0);
  // (The generated model has no chat template: a raw prompt does not need one, so no warning.)
  CHECK_THAT(a.err, !Catch::Contains("chat template"));
  CHECK_THAT(run_baton("run -m " + target + " -p hi -n 2 -t 2").err, Catch::Contains("no chat template; using chatml"));
  const test::Out both = run_baton(common + " --draft-model " + twin + " --lookup 4");
  CHECK(both.code == 1);
  CHECK_THAT(both.err, Catch::Contains("--lookup or --draft-model"));
  const test::Out other = run_baton(common + " --draft-model " + test::tiny_gemma3_model());
  CHECK(other.code == 1);
  CHECK_THAT(other.err, Catch::Contains("must share the model's tokenizer"));
}
