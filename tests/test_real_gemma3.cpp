// Gemma 3 270M Q4_K_M (fetched by scripts/fetch-model.sh gemma3-270m), greedy through the Pipeline.
// The fetched file is the pretrained model ("Gemma 3 270m", no tokenizer.chat_template key), not the
// instruction-tuned one: wrapped in <start_of_turn> turns it repeats the question instead of
// answering, and llama.cpp's llama-simple does the same on this file. So the factual checks use plain
// completion prompts; the expected words are what llama.cpp's greedy continuation of the same file
// produces ("Question: ...\nAnswer: Paris", "... Tuesday, Wednesday, ...", "... eggs and bacon").
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "gguf/gguf.h"
#include "helpers.h"
#include "runtime/chat_template.h"
#include "model_helpers.h"
#include "runtime/config.h"
#include "runtime/engine.h"
#include "runtime/grammar.h"
#include "runtime/json_schema.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

using namespace baton;

namespace {


std::string complete(Pipeline& p, const std::string& prompt, int max_tokens) {
  return test::greedy(p, p.tokenizer().encode(prompt, /*add_special=*/true, /*parse_special=*/false), max_tokens);
}

std::unique_ptr<Pipeline> load_gemma(const std::string& path) {
  LoadOptions o;
  o.n_ctx = 512;
  o.n_threads = 2;
  return Pipeline::load(path, o);
}

}  // namespace

TEST_CASE("Gemma 3 270M: config read from the real file") {
  const std::string path = test::gemma3();
  if (path.empty()) return;
  auto p = load_gemma(path);
  const ModelConfig& c = p->config();
  CHECK(c.arch == "gemma3");
  CHECK(c.rope_style == RopeStyle::NeoX);
  CHECK(c.act == Activation::GeluTanh);
  CHECK(c.tied_output);
  CHECK(c.head_dim_k == 256);
  CHECK(c.n_embd_q() == 1024);  // 4 heads of 256 on a 640-wide residual
  CHECK(c.attn_scale == Approx(1.0 / 16.0));
  CHECK(c.final_softcap == 0.f);
  CHECK(!c.norm_add_one);  // the converter folded Gemma's +1 into the stored weights
  // Every 6th layer (5, 11, 17) is global, the rest see a window of 512.
  for (int l = 0; l < c.n_layer; ++l) CHECK(c.is_local(l) == ((l + 1) % 6 != 0));
  CHECK(c.rope_freqs[1] == Approx(std::pow(1e6, -2.0 / 256)));
  CHECK(c.rope_freqs_local[1] == Approx(std::pow(1e4, -2.0 / 256)));
}

TEST_CASE("Gemma 3 270M answers the capital of France with Paris") {
  const std::string path = test::gemma3();
  if (path.empty()) return;
  auto p = load_gemma(path);
  const std::string a = complete(*p, "Question: What is the capital of France?\nAnswer:", 6);
  std::printf("Gemma 3 answer: %s\n", a.c_str());
  CHECK(a.rfind(" Paris", 0) == 0);
}

TEST_CASE("Gemma 3 270M continues everyday prompts coherently") {
  const std::string path = test::gemma3();
  if (path.empty()) return;
  auto p = load_gemma(path);
  const std::string days = complete(*p, "The days of the week are Monday,", 12);
  std::printf("days: %s\n", days.c_str());
  CHECK(days.find("Tuesday") != std::string::npos);
  CHECK(days.find("Wednesday") != std::string::npos);
  // Prompts whose continuation has a clear margin on every ISA level, packed or not. ("My favourite
  // breakfast is" → "… eggs …" was a near-tie: the AVX2 kernels' rounding made it "a cup of coffee".)
  p = load_gemma(path);  // a fresh KV cache for the next prompt
  const std::string colours = complete(*p, "The colors of the rainbow are red, orange,", 12);
  std::printf("rainbow: %s\n", colours.c_str());
  CHECK(colours.find("yellow") != std::string::npos);
  CHECK(colours.find("green") != std::string::npos);
  p = load_gemma(path);
  const std::string months = complete(*p, "January, February, March,", 12);
  std::printf("months: %s\n", months.c_str());
  CHECK(months.find("April") != std::string::npos);
  CHECK(months.find("May") != std::string::npos);
}

TEST_CASE("Gemma 3 270M through its chat template: same turn as llama.cpp on this pretrained file") {
  const std::string path = test::gemma3();
  if (path.empty()) return;
  auto p = load_gemma(path);
  const Tokenizer& tok = p->tokenizer();
  const ChatTemplate tmpl = ChatTemplate::for_model(p->file(), tok);
  const std::string text = tmpl.render({{"user", "What is the capital of France?"}}, true);
  CHECK(text.find("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n") !=
        std::string::npos);
  const auto ids = tok.encode(text, /*add_special=*/!tmpl.starts_with_bos(), /*parse_special=*/true);
  CHECK(std::count(ids.begin(), ids.end(), tok.bos()) == 1);
  CHECK(ids.front() == tok.bos());
  // llama-simple on the same tokens: "What is the capital of France? mendatang\n..." (a pretrained
  // model echoing the turn). The echo is the part both forwards agree on to the token.
  const std::string a = test::greedy(*p, ids, 8);
  std::printf("Gemma 3 chat turn: %s\n", a.c_str());
  CHECK(a.rfind("What is the capital of France?", 0) == 0);
}

TEST_CASE("Gemma 3 270M under grammars: the first token's SentencePiece space, JSON objects") {
  const std::string path = test::gemma3();
  if (path.empty()) return;
  auto p = load_gemma(path);
  auto vocab = tokenizer_vocab(p->tokenizer());
  Engine e(*p, *vocab);
  Request r;
  r.prompt = p->tokenizer().encode("Question: What is the capital of France?\nAnswer:", true, false);
  r.sampling.temperature = 0;
  // The answer's first token is " Paris", shown as "Paris": the grammar sees what is shown.
  r.grammar = Grammar::parse("root ::= \"Paris\" | \"Rome\" | \"Lyon\"");
  Result got = e.generate(r);
  CHECK(got.error.empty());
  CHECK(got.text == "Paris");
  CHECK(got.finish == FinishReason::Stop);
  // Sampled JSON objects: 262k tokens, byte-fallback pieces, whatever the model wants to say.
  r.prompt = p->tokenizer().encode("Here is a JSON object describing a dog:\n", true, false);
  r.sampling.temperature = 1.0f;
  r.max_tokens = 300;
  r.grammar = Grammar::parse(json_object_gbnf());
  int objects = 0;
  // About half the seeds close their object within 300 tokens (which ones moves with the kernels'
  // rounding: 1 of seeds 1-4 and 6 of 1-12 since the AVX-512 Q6_K tile); 8 seeds make "at least 2"
  // a check of the grammar, not of luck.
  for (uint64_t seed = 1; seed <= 8; seed++) {
    r.sampling.seed = seed;
    got = e.generate(r);
    INFO(got.text);
    CHECK(got.error.empty());
    if (got.finish != FinishReason::Stop) continue;  // ran to max_tokens inside a long string
    CHECK(nlohmann::json::parse(got.text, nullptr, false).is_object());
    objects++;
  }
  CHECK(objects >= 2);
}
