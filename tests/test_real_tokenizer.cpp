// Tokenizers of the real models against independent implementations (tools/gen_tokenizer_fixtures.py:
// HF `tokenizers` for SmolLM2's byte-level BPE, SentencePiece for Gemma 3), plus special tokens.
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gguf/gguf.h"
#include "helpers.h"
#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

using namespace baton;

namespace {

nlohmann::json load_fixture(const std::string& name) {
  std::ifstream f(std::string(BATON_TEST_DATA) + "/" + name);
  REQUIRE(f.good());
  return nlohmann::json::parse(f);
}

void check_fixture(const Tokenizer& tok, const std::string& fixture, bool strip_space) {
  auto j = load_fixture(fixture);
  size_t pass = 0, n = j["inputs"].size();
  REQUIRE(n > 50);
  for (size_t i = 0; i < n; ++i) {
    std::string in = j["inputs"][i];
    std::vector<int32_t> want = j["ids"][i];
    auto got = tok.encode(in, false, false);
    INFO(fixture << " input " << i << ": '" << in << "'");
    CHECK(got == want);
    pass += got == want;
    std::string back = tok.decode(got);
    if (!strip_space) CHECK(back == in);
  }
  std::printf("%s: %zu/%zu inputs match the reference ids\n", fixture.c_str(), pass, n);
}

}  // namespace

TEST_CASE("SmolLM2 tokenizer (gpt2 BPE, pre smollm)") {
  std::string path = test::smollm2();
  if (path.empty()) return;
  auto file = gguf::File::open(path);
  Tokenizer tok = Tokenizer::from_gguf(*file);
  CHECK(tok.kind() == VocabKind::Bpe);
  CHECK(tok.pre() == PreTokenizer::Starcoder);
  CHECK(tok.n_vocab() == 49152);
  CHECK_FALSE(tok.add_bos());
  check_fixture(tok, "smollm2_ids.json", false);

  // ChatML markers are one token each when special parsing is on, and plain text otherwise.
  auto ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n", false, true);
  REQUIRE(ids.size() >= 4);
  CHECK(ids.front() == 1);
  CHECK(tok.token_text(1) == "<|im_start|>");
  CHECK(std::count(ids.begin(), ids.end(), 2) == 1);
  CHECK(tok.is_eog(2));  // <|im_end|> is SmolLM2's EOS
  CHECK(tok.is_eog(0));  // <|endoftext|>
  CHECK_FALSE(tok.is_eog(1));
  auto literal = tok.encode("<|im_start|>", false, false);
  CHECK(literal.size() > 1);
  CHECK(tok.decode(literal) == "<|im_start|>");
  CHECK(tok.decode(ids) == "user\nHi\n");  // control tokens hidden
}

TEST_CASE("Gemma 3 tokenizer (SentencePiece, 262k vocabulary)") {
  std::string path = test::gemma3();
  if (path.empty()) return;
  auto file = gguf::File::open(path);
  Tokenizer tok = Tokenizer::from_gguf(*file);
  CHECK(tok.kind() == VocabKind::Spm);
  CHECK(tok.n_vocab() == 262144);
  CHECK(tok.add_bos());
  CHECK_FALSE(tok.add_space_prefix());
  check_fixture(tok, "gemma3_ids.json", false);

  auto ids = tok.encode("<start_of_turn>user\nHello<end_of_turn>\n", true, true);
  REQUIRE(ids.size() >= 5);
  CHECK(ids[0] == tok.bos());
  CHECK(ids[1] == 105);  // <start_of_turn>
  CHECK(std::count(ids.begin(), ids.end(), 106) == 1);
  CHECK(tok.is_eog(106));  // <end_of_turn> ends a reply
  CHECK(tok.is_eog(tok.eos()));
  // "\n" is a user-defined token in Gemma's vocabulary: cut out even without special parsing.
  auto nl = tok.encode("a\nb", false, false);
  CHECK(std::find(nl.begin(), nl.end(), 107) != nl.end());
}

TEST_CASE("chat templates of the real models") {
  SECTION("SmolLM2: ChatML from tokenizer.chat_template, with its own default system prompt") {
    std::string path = test::smollm2();
    if (path.empty()) return;
    auto file = gguf::File::open(path);
    Tokenizer tok = Tokenizer::from_gguf(*file);
    std::string warning;
    ChatTemplate t = ChatTemplate::for_model(*file, tok, "", &warning);
    CHECK(warning.empty());
    CHECK(t.family() == ChatFamily::ChatML);
    CHECK(t.default_system() == "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
    std::string text = t.render({{"user", "What is the capital of France?"}}, true);
    auto ids = tok.encode(text, false, true);
    CHECK(std::count(ids.begin(), ids.end(), 1) == 3);  // <|im_start|> system, user, assistant
    CHECK(std::count(ids.begin(), ids.end(), 2) == 2);  // <|im_end|>
    CHECK(ids.front() == 1);
    CHECK(tok.decode(ids, true) == text);
    // --chat-template overrides; a bad name is a usage error naming the known ones.
    CHECK(ChatTemplate::for_model(*file, tok, "zephyr").family() == ChatFamily::Zephyr);
    CHECK_THROWS_WITH(ChatTemplate::for_model(*file, tok, "nope"), Catch::Contains("chatml"));
  }
  SECTION("Gemma 3: no template in the file, the vocabulary's turn markers say Gemma") {
    std::string path = test::gemma3();
    if (path.empty()) return;
    auto file = gguf::File::open(path);
    REQUIRE_FALSE(file->has("tokenizer.chat_template"));
    Tokenizer tok = Tokenizer::from_gguf(*file);
    std::string warning;
    ChatTemplate t = ChatTemplate::for_model(*file, tok, "", &warning);
    CHECK(warning.empty());
    CHECK(t.family() == ChatFamily::Gemma);
    CHECK(t.starts_with_bos());
    std::string text = t.render({{"system", "Be brief."}, {"user", "Hi"}}, true);
    CHECK(text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
    auto ids = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
    REQUIRE(ids.size() > 6);
    CHECK(ids[0] == tok.bos());
    CHECK(ids[1] == 105);
    CHECK(std::count(ids.begin(), ids.end(), 105) == 2);
    CHECK(std::count(ids.begin(), ids.end(), 106) == 1);
  }
}

TEST_CASE("streaming SmolLM2's byte tokens never splits a character") {
  std::string path = test::smollm2();
  if (path.empty()) return;
  auto file = gguf::File::open(path);
  Tokenizer tok = Tokenizer::from_gguf(*file);
  const std::string text = "Llamas 🦙 and ünïcödé, 日本語.";
  auto ids = tok.encode(text, false, false);
  Detokenizer d(tok);
  std::string out;
  size_t held = 0;
  for (int32_t id : ids) {
    std::string part = d.push(id);
    if (part.empty()) ++held;  // a token that ended inside a character
    CHECK(unicode::incomplete_utf8_tail(part) == 0);
    out += part;
  }
  out += d.flush();
  CHECK(out == text);
  CHECK(held > 0);  // the emoji is spread over several byte tokens
}
