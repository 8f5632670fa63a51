// OpenAI's harmony format (gpt-oss): the channel parser on its own (every way a reply can be cut
// into pieces), the end-of-generation tokens of a harmony vocabulary, and the engine splitting a
// scripted reply into reasoning and answer.
#include <algorithm>
#include <map>

#include "helpers.h"
#include "gguf/gguf.h"
#include "runtime/engine.h"
#include "runtime/harmony.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

using namespace baton;

namespace {

const std::string kReply =
    "<|channel|>analysis<|message|>The user says hi. Answer briefly, naïvely 🦙.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! <b>How</b> can I help?";

// Everything the parser hands back for `pieces`, fed one after another, then flushed; checks
// that chunks never repeat a part back to back within one call and never show a marker.
SplitReply feed(const std::vector<std::string>& pieces) {
  HarmonyParser p;
  SplitReply r;
  auto take = [&](const std::vector<ReplyChunk>& chunks) {
    for (size_t i = 0; i < chunks.size(); i++) {
      if (i > 0) CHECK(chunks[i].part != chunks[i - 1].part);
      CHECK_FALSE(chunks[i].text.empty());
      (chunks[i].part == ReplyPart::Answer ? r.answer : r.reasoning) += chunks[i].text;
    }
  };
  for (const auto& s : pieces) take(p.push(s));
  take(p.flush());
  for (std::string_view m : kHarmonyMarkers) {
    CHECK(r.answer.find(m) == std::string::npos);
    CHECK(r.reasoning.find(m) == std::string::npos);
  }
  return r;
}

}  // namespace

TEST_CASE("harmony: reasoning and answer of a whole reply") {
  SplitReply r = split_harmony(kReply + "<|return|>");
  CHECK(r.reasoning == "The user says hi. Answer briefly, naïvely 🦙.");
  CHECK(r.answer == "Hello! <b>How</b> can I help?");
  // Text after the end of the reply is not part of it.
  HarmonyParser p;
  p.push(kReply + "<|return|>");
  CHECK(p.ended());
  CHECK(p.push("more").empty());
  CHECK(p.flush().empty());
}

TEST_CASE("harmony: the same result however the reply is cut into pieces") {
  const SplitReply whole = split_harmony(kReply);
  // Every cut into two pieces and into three (markers, UTF-8 characters and '<' of the answer cut too).
  for (size_t i = 0; i <= kReply.size(); i++) {
    SplitReply two = feed({kReply.substr(0, i), kReply.substr(i)});
    INFO("cut at " << i);
    CHECK(two.reasoning == whole.reasoning);
    CHECK(two.answer == whole.answer);
    for (size_t j = i; j <= kReply.size(); j += 7) {
      SplitReply three = feed({kReply.substr(0, i), kReply.substr(i, j - i), kReply.substr(j)});
      CHECK(three.reasoning == whole.reasoning);
      CHECK(three.answer == whole.answer);
    }
  }
  // One byte at a time.
  std::vector<std::string> bytes;
  for (char c : kReply) bytes.emplace_back(1, c);
  SplitReply one = feed(bytes);
  CHECK(one.reasoning == whole.reasoning);
  CHECK(one.answer == whole.answer);
}

TEST_CASE("harmony: text is released as soon as it cannot be a marker") {
  HarmonyParser p;
  CHECK(p.push("<|channel|>analysis<|message|>think").at(0) == ReplyChunk{ReplyPart::Reasoning, "think"});
  CHECK(p.push(" more <|").at(0) == ReplyChunk{ReplyPart::Reasoning, " more "});  // "<|" may be a marker
  CHECK(p.push("e").empty());                                                     // "<|e": <|end|>?
  CHECK(p.push("x|>").at(0) == ReplyChunk{ReplyPart::Reasoning, "<|ex|>"});      // no: plain text
  // Both parts in one piece, in order.
  auto chunks = p.push(".<|end|><|start|>assistant<|channel|>final<|message|>Hi");
  REQUIRE(chunks.size() == 2);
  CHECK(chunks[0] == ReplyChunk{ReplyPart::Reasoning, "."});
  CHECK(chunks[1] == ReplyChunk{ReplyPart::Answer, "Hi"});
}

TEST_CASE("harmony: replies that stop early or leave the format") {
  // No final channel: all reasoning, no answer (the model stopped after its analysis).
  SplitReply r = split_harmony("<|channel|>analysis<|message|>Only thinking.<|end|>");
  CHECK(r.reasoning == "Only thinking.");
  CHECK(r.answer.empty());
  // Cut by max tokens inside the next header: the header is dropped.
  r = split_harmony("<|channel|>analysis<|message|>Thinking<|end|><|start|>assistant<|chan");
  CHECK(r.reasoning == "Thinking");
  CHECK(r.answer.empty());
  // Cut inside the answer where a marker could have begun: what was held is answer text.
  r = split_harmony("<|channel|>final<|message|>1 <|");
  CHECK(r.answer == "1 <|");
  // Straight to the final channel; a constrained header; commentary counts as reasoning.
  CHECK(split_harmony("<|channel|>final<|message|>Yes.").answer == "Yes.");
  r = split_harmony("<|channel|>commentary<|message|>Plan.<|end|><|start|>assistant<|channel|>final "
                    "<|constrain|>json<|message|>{}");
  CHECK(r.reasoning == "Plan.");
  CHECK(r.answer == "{}");
  // A header without a channel is the answer; text between messages is no one's.
  r = split_harmony("<|start|>assistant<|message|>Plain.<|end|>stray");
  CHECK(r.answer == "Plain.");
  CHECK(r.reasoning.empty());
  // Not harmony at all: everything is the answer, unchanged.
  r = split_harmony("a < b, x <| y |> z");
  CHECK(r.answer == "a < b, x <| y |> z");
  CHECK(r.reasoning.empty());
}

namespace {

// A tiny byte-level BPE vocabulary: a few words, and control tokens named `specials`.
Tokenizer tiny_vocab(const std::vector<std::string>& specials, const std::map<std::string, std::string>& ids = {}) {
  std::vector<std::string> tokens = {"Think", "Hi", "analysis", "final", "assistant", "Ġ"};
  std::vector<int32_t> types(tokens.size(), 1);
  for (const auto& s : specials) {
    tokens.push_back(s);
    types.push_back(3);  // control
  }
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::of_str("gpt-oss"));
  w.set("tokenizer.ggml.model", gguf::Value::of_str("gpt2"));
  w.set("tokenizer.ggml.pre", gguf::Value::of_str("gpt-4o"));
  w.set("tokenizer.ggml.tokens", gguf::Value::of_strs(gguf::StringList(tokens)));
  w.set("tokenizer.ggml.token_type", gguf::Value::of_i32s(types));
  w.set("tokenizer.ggml.merges", gguf::Value::of_strs({}));
  for (const auto& [key, text] : ids) {
    auto at = std::find(tokens.begin(), tokens.end(), text);
    REQUIRE(at != tokens.end());
    w.set(key, gguf::Value::of_u32(uint32_t(at - tokens.begin())));
  }
  const auto bytes = w.to_bytes();
  return Tokenizer::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
}

const std::vector<std::string> kHarmonySpecials = {"<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                                                   "<|channel|>",     "<|start|>",     "<|end|>",    "<|message|>",
                                                   "<|call|>"};

int32_t id(const Tokenizer& t, const std::string& text) {
  auto i = t.find_token(text);
  REQUIRE(i);
  return *i;
}

}  // namespace

TEST_CASE("harmony vocabulary: <|return|> and <|call|> end generation, <|end|> does not") {
  // As gpt-oss files name them: EOS <|return|>; a file naming <|end|> as EOT changes nothing.
  for (const auto& ids : {std::map<std::string, std::string>{{"tokenizer.ggml.eos_token_id", "<|return|>"}},
                          std::map<std::string, std::string>{{"tokenizer.ggml.eos_token_id", "<|return|>"},
                                                             {"tokenizer.ggml.eot_token_id", "<|end|>"}}}) {
    const Tokenizer t = tiny_vocab(kHarmonySpecials, ids);
    CHECK(t.harmony());
    CHECK(t.is_eog(id(t, "<|return|>")));
    CHECK(t.is_eog(id(t, "<|call|>")));
    CHECK(t.is_eog(id(t, "<|endoftext|>")));
    CHECK_FALSE(t.is_eog(id(t, "<|end|>")));
    CHECK_FALSE(t.is_eog(id(t, "<|start|>")));
    CHECK(t.eog_ids().size() == 3);
  }
  // Without <|return|> and <|call|> (Phi-3's vocabulary has <|end|>) <|end|> ends a reply as before.
  const Tokenizer phi = tiny_vocab({"<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>"});
  CHECK_FALSE(phi.harmony());
  CHECK(phi.is_eog(id(phi, "<|end|>")));
  CHECK(phi.is_eog(id(phi, "<|endoftext|>")));
}

namespace {

// A pipeline that answers any prompt with a fixed reply: each logits row puts the next token of
// `script` on top (greedy requests take exactly the script).
class ScriptPipeline : public Pipeline {
 public:
  ScriptPipeline(int n_vocab, std::vector<int32_t> script) : n_vocab_(n_vocab), script_(std::move(script)) {}
  const gguf::File& file() const override { panic(__FILE__, __LINE__, "no file"); }
  const ModelConfig& config() const override { panic(__FILE__, __LINE__, "no config"); }
  const Tokenizer& tokenizer() const override { panic(__FILE__, __LINE__, "no tokenizer"); }
  int n_ctx() const override { return 256; }
  int n_seq() const override { return 1; }
  int n_vocab() const override { return n_vocab_; }
  void decode(const Batch& b, float* logits) override {
    for (int i = 0; i < b.size(); i++) {
      len_ = b.pos[i] + 1;
      if (!b.logits[i]) continue;
      const size_t k = size_t(len_ - prompt_len);  // tokens of the reply so far
      std::fill(logits, logits + n_vocab_, 0.0f);
      logits[k < script_.size() ? script_[k] : 0] = 1.0f;
      reduce_output_row(b.logits[i], logits, n_vocab_);
      logits += n_vocab_;
    }
  }
  void truncate_seq(int, int from) override { len_ = std::min(len_, from); }
  int seq_len(int) const override { return len_; }

  int prompt_len = 0;

 private:
  int n_vocab_;
  std::vector<int32_t> script_;
  int len_ = 0;
};

}  // namespace

TEST_CASE("harmony: the engine streams the reasoning apart and returns the answer as the text") {
  const Tokenizer t = tiny_vocab(kHarmonySpecials, {{"tokenizer.ggml.eos_token_id", "<|return|>"}});
  std::vector<int32_t> script;
  for (const char* s : {"<|channel|>", "analysis", "<|message|>", "Think", "<|end|>", "<|start|>", "assistant",
                        "<|channel|>", "final", "<|message|>", "Hi", "Ġ", "Hi", "<|return|>"})
    script.push_back(id(t, s));
  ScriptPipeline pipe(t.n_vocab(), script);
  const auto vocab = tokenizer_vocab(t);
  REQUIRE(vocab->harmony());
  Engine engine(pipe, *vocab);

  auto ask = [&](int max_tokens, std::vector<std::string> stop, std::string* streamed_text,
                 std::string* streamed_reasoning) {
    Request r;
    r.prompt = {id(t, "<|start|>"), id(t, "assistant")};
    pipe.prompt_len = int(r.prompt.size());
    engine.forget(0);
    r.sampling.temperature = 0;
    r.max_tokens = max_tokens;
    r.stop = std::move(stop);
    r.on_text = [=](std::string_view s) { *streamed_text += s; };
    r.on_reasoning = [=](std::string_view s) { *streamed_reasoning += s; };
    return engine.generate(std::move(r));
  };
  std::string text, reasoning;
  Result r = ask(-1, {}, &text, &reasoning);
  CHECK(r.error.empty());
  CHECK(r.finish == FinishReason::Stop);  // at <|return|>, not at <|end|>
  CHECK(r.completion_tokens() == int(script.size()) - 1);
  CHECK(r.text == "Hi Hi");
  CHECK(r.reasoning == "Think");
  CHECK(text == r.text);
  CHECK(reasoning == r.reasoning);

  // Cut by max tokens after the analysis: reasoning only.
  text.clear(), reasoning.clear();
  r = ask(6, {}, &text, &reasoning);
  CHECK(r.finish == FinishReason::Length);
  CHECK(r.reasoning == "Think");
  CHECK(r.text.empty());
  CHECK(text.empty());

  // Stop strings look at the answer only: "Think" in the reasoning does not stop it.
  text.clear(), reasoning.clear();
  r = ask(-1, {"Think", " "}, &text, &reasoning);
  CHECK(r.finish == FinishReason::Stop);
  CHECK(r.reasoning == "Think");
  CHECK(r.text == "Hi");
  CHECK(text == "Hi");
}
