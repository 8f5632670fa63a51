// The tokenizers against llama.cpp's own test vectors (four vocabularies, every line), plus
// round trips, streaming detokenization and the pre-tokenizer splitters on their own.
#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "gguf/gguf.h"
#include <nlohmann/json.hpp>

#include "helpers.h"
#include "runtime/pretokenizer.h"
#include "runtime/string_table.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

using namespace baton;

namespace {

// `.inp`: inputs separated by "\n__ggml_vocab_test__\n" (the file ends with one); `.out`: one line
// of space-separated ids per input.
struct Vectors {
  std::vector<std::string> inputs;
  std::vector<std::vector<int32_t>> expected;
};

Vectors load_vectors(const std::string& name) {
  Vectors v;
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::string inp = test::read_all(test::peer("tokenizer/" + name + ".inp"));
  size_t pos = 0;
  while (pos < inp.size()) {
    size_t hit = inp.find(sep, pos);
    REQUIRE(hit != std::string::npos);
    v.inputs.push_back(inp.substr(pos, hit - pos));
    pos = hit + sep.size();
  }
  std::istringstream out(test::read_all(test::peer("tokenizer/" + name + ".out")));
  std::string line;
  while (std::getline(out, line)) {
    std::istringstream ls(line);
    std::vector<int32_t> ids;
    int32_t id;
    while (ls >> id) ids.push_back(id);
    v.expected.push_back(ids);
  }
  REQUIRE(v.inputs.size() == v.expected.size());
  return v;
}

std::string show(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

void check_vectors(const std::string& name) {
  auto file = gguf::File::open(test::peer("tokenizer/" + name));
  Tokenizer tok = Tokenizer::from_gguf(*file);
  Vectors v = load_vectors(name);
  size_t pass = 0, roundtrip = 0;
  for (size_t i = 0; i < v.inputs.size(); ++i) {
    const std::string& in = v.inputs[i];
    auto ids = tok.encode(in, /*add_special=*/false, /*parse_special=*/false);
    INFO(name << " input " << i << ": '" << in << "'");
    CHECK(show(ids) == show(v.expected[i]));
    pass += ids == v.expected[i];
    // Detokenizing gives the input back (SentencePiece: its added leading space is removed).
    std::string back = tok.decode(ids);
    CHECK(back == in);
    roundtrip += back == in;
  }
  std::printf("%s: %zu/%zu lines match, %zu/%zu round trips\n", name.c_str(), pass, v.inputs.size(), roundtrip,
              v.inputs.size());
  CHECK(pass == v.inputs.size());
  CHECK(v.inputs.size() >= 40);
}

}  // namespace

TEST_CASE("llama.cpp vectors: llama-spm (SentencePiece)") { check_vectors("ggml-vocab-llama-spm.gguf"); }
TEST_CASE("llama.cpp vectors: gpt-2 (byte-level BPE)") { check_vectors("ggml-vocab-gpt-2.gguf"); }
TEST_CASE("llama.cpp vectors: falcon") { check_vectors("ggml-vocab-falcon.gguf"); }
TEST_CASE("llama.cpp vectors: starcoder") { check_vectors("ggml-vocab-starcoder.gguf"); }

// Every pre-tokenizer against the same regexes run by an independent engine (Oniguruma through
// the `tokenizers` package; tools/gen_tokenizer_fixtures.py).
TEST_CASE("pre-tokenizers split like their regexes") {
  auto j = nlohmann::json::parse(test::read_all(std::string(BATON_TEST_DATA) + "/pretokenizer_splits.json"));
  const auto& inputs = j["inputs"];
  REQUIRE(inputs.size() > 60);
  for (const char* name : {"default", "gpt-2", "falcon", "starcoder", "llama3", "qwen2", "gpt-4o"}) {
    PreTokenizer p = pretokenizer_from_name(name);
    const auto& want = j["splits"][name];
    REQUIRE(want.size() == inputs.size());
    size_t pass = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::string in = inputs[i];
      std::vector<std::string> got;
      for (auto piece : pretokenize(p, in)) got.emplace_back(piece);
      std::vector<std::string> exp = want[i];
      INFO(name << " input " << i << ": '" << in << "'");
      CHECK(got == exp);
      pass += got == exp;
    }
    std::printf("pre-tokenizer %s: %zu/%zu inputs split as the regex does\n", name, pass, inputs.size());
  }
}

TEST_CASE("pre-tokenizer names") {
  CHECK(pretokenizer_from_name("smollm") == PreTokenizer::Starcoder);
  CHECK(pretokenizer_from_name("llama-bpe") == PreTokenizer::Llama3);
  CHECK_THROWS_WITH(pretokenizer_from_name("no-such-pre"), Catch::Contains("no-such-pre"));
  // Malformed UTF-8 is carried through: the pieces still cover the input exactly.
  std::string bad = "ab\xFF\xC3 cd\xE2\x82";
  std::string joined;
  for (auto piece : pretokenize(PreTokenizer::Llama3, bad)) joined += piece;
  CHECK(joined == bad);
}

TEST_CASE("unicode classes") {
  using namespace unicode;
  CHECK(category('a') == Cat::Letter);
  CHECK(category(0x00E9) == Cat::Letter);   // é
  CHECK(category(0x65E5) == Cat::Letter);   // 日
  CHECK(category(0x0663) == Cat::Number);   // ٣
  CHECK(category(0x00BD) == Cat::Number);   // ½
  CHECK(category(0x3001) == Cat::Punct);    // 、
  CHECK(category(0x1F999) == Cat::Symbol);  // 🦙
  CHECK(category(0x0301) == Cat::Mark);     // combining acute
  CHECK(category(0x0378) == Cat::None);     // unassigned
  CHECK(is_whitespace(0x3000));
  CHECK(is_whitespace('\t'));
  CHECK_FALSE(is_whitespace(0x200B));  // zero-width space is not White_Space
  CHECK(incomplete_utf8_tail("ab\xE2\x82") == 2);
  CHECK(incomplete_utf8_tail("ab\xE2\x82\xAC") == 0);
  CHECK(incomplete_utf8_tail("\xF0\x9F\xA6") == 3);
  CHECK(incomplete_utf8_tail("abc") == 0);
}

TEST_CASE("a string table finds each text at its first place, empty and repeated texts too") {
  const std::vector<std::string> items = {"b", "", "a", "\xE2\x96\x81the", "b", std::string("x\0y", 3), "", "ab"};
  const StringTable t{gguf::StringList(items)};
  REQUIRE(t.size() == items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    CHECK(t[i] == items[i]);
    const size_t first = size_t(std::find(items.begin(), items.end(), items[i]) - items.begin());
    CHECK(t.find(items[i]) == int32_t(first));
  }
  CHECK_FALSE(t.find("c"));
  CHECK_FALSE(t.find("a "));
  CHECK_FALSE(t.find(std::string_view("x", 1)));
  CHECK_FALSE(StringTable().find(""));
  CHECK(StringTable().empty());
  // Many strings: every one found, none that is not there.
  std::vector<std::string> many;
  for (int i = 0; i < 70000; ++i) many.push_back(std::to_string(i * 7919));
  const StringTable m{gguf::StringList(many)};
  for (size_t i = 0; i < many.size(); ++i) REQUIRE(m.find(many[i]) == int32_t(i));
  CHECK_FALSE(m.find("1"));
  CHECK_FALSE(m.find("-7919"));
}

TEST_CASE("every token's text finds its lowest id (four vocabularies)") {
  for (const char* name : {"ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf", "ggml-vocab-falcon.gguf",
                           "ggml-vocab-starcoder.gguf"}) {
    auto file = gguf::File::open(test::peer(std::string("tokenizer/") + name));
    const Tokenizer tok = Tokenizer::from_gguf(*file);
    const auto& texts = file->get_strings("tokenizer.ggml.tokens");
    REQUIRE(tok.n_vocab() == int32_t(texts.size()));
    std::map<std::string, int32_t, std::less<>> first;  // found by string_view
    for (size_t i = 0; i < texts.size(); ++i) first.emplace(texts[i], int32_t(i));
    int mismatches = 0;
    for (int32_t id = 0; id < tok.n_vocab(); ++id) {
      mismatches += tok.token_text(id) != texts[size_t(id)];
      mismatches += tok.find_token(texts[size_t(id)]) != first.find(texts[size_t(id)])->second;
    }
    INFO(name);
    CHECK(mismatches == 0);
    CHECK_THROWS_WITH(tok.token_text(tok.n_vocab()), Catch::Contains("outside the vocabulary"));
    CHECK_THROWS_WITH(tok.token_text(-1), Catch::Contains("outside the vocabulary"));
  }
}

TEST_CASE("special tokens, BOS/EOS and streaming detokenization (llama-spm vocab)") {
  auto file = gguf::File::open(test::peer("tokenizer/ggml-vocab-llama-spm.gguf"));
  Tokenizer tok = Tokenizer::from_gguf(*file);
  CHECK(tok.kind() == VocabKind::Spm);
  CHECK(tok.n_vocab() == 32000);
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);
  CHECK(tok.is_eog(2));
  CHECK_FALSE(tok.is_eog(1));
  CHECK(tok.token_text(1) == "<s>");

  auto plain = tok.encode("Hello", false, false);
  auto with_bos = tok.encode("Hello", true, false);
  REQUIRE(with_bos.size() == plain.size() + 1);
  CHECK(with_bos[0] == tok.bos());
  CHECK(std::equal(plain.begin(), plain.end(), with_bos.begin() + 1));

  // "</s>" as text: one control token only when parse_special is set.
  auto parsed = tok.encode("Hi</s>", false, true);
  CHECK(parsed.back() == 2);
  auto literal = tok.encode("Hi</s>", false, false);
  CHECK(std::find(literal.begin(), literal.end(), 2) == literal.end());
  CHECK(tok.decode(literal) == "Hi</s>");
  // Control tokens are hidden unless asked for.
  CHECK(tok.decode(parsed) == "Hi");
  CHECK(tok.decode(parsed, true) == "Hi</s>");

  // A character split over byte tokens comes out whole, never half.
  auto ids = tok.encode("a🦙b", false, false);
  Detokenizer d(tok, false, true);
  std::string streamed;
  for (int32_t id : ids) {
    std::string part = d.push(id);
    CHECK(unicode::incomplete_utf8_tail(part) == 0);
    streamed += part;
  }
  streamed += d.flush();
  CHECK(streamed == "a🦙b");
  CHECK_THROWS(tok.decode_piece(32000));
}

TEST_CASE("Phi-3's specials swallow the whitespace after them; <|endoftext|> and other models' do not") {
  // The llama-spm vocabulary with Phi-3's added control tokens, under a Phi-3 name or another.
  auto tokenizer_named = [](const std::string& name) {
    const auto peer = gguf::File::open(test::peer("tokenizer/ggml-vocab-llama-spm.gguf"));
    gguf::Writer w;
    w.set("general.architecture", gguf::Value::of_str("phi3"));
    w.set("general.name", gguf::Value::of_str(name));
    for (const auto& [k, v] : peer->metadata())
      if (k.rfind("tokenizer.", 0) == 0) w.set(k, v);
    std::vector<std::string> tokens = peer->get_strings("tokenizer.ggml.tokens").to_vector();
    std::vector<float> scores = peer->get_floats("tokenizer.ggml.scores");
    std::vector<int32_t> types;
    for (int64_t t : peer->get_ints("tokenizer.ggml.token_type")) types.push_back(int32_t(t));
    for (const char* added : {"<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"}) {
      tokens.push_back(added);
      scores.push_back(0.f);
      types.push_back(3);  // control
    }
    w.set("tokenizer.ggml.tokens", gguf::Value::of_strs(gguf::StringList(tokens)));
    w.set("tokenizer.ggml.scores", gguf::Value::of_f32s(scores));
    w.set("tokenizer.ggml.token_type", gguf::Value::of_i32s(types));
    const auto bytes = w.to_bytes();
    return Tokenizer::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  const Tokenizer phi = tokenizer_named("Phi-3-mini-4k-instruct"), other = tokenizer_named("Mistral 7B");
  const int32_t eot = 32000, assistant = 32001, end = 32002, user = 32003;
  auto concat = [](std::initializer_list<std::vector<int32_t>> parts) {
    std::vector<int32_t> v;
    for (const auto& p : parts) v.insert(v.end(), p.begin(), p.end());
    return v;
  };
  const std::string turn = "<|user|>\nHi there<|end|>\n<|assistant|>\n";
  CHECK(phi.encode(turn, false, true) == concat({{user}, phi.encode("Hi there", false, false), {end, assistant}}));
  // Elsewhere the newlines stay: each is a fragment of its own after a special.
  const std::vector<int32_t> got = other.encode(turn, false, true);
  CHECK(got.size() > phi.encode(turn, false, true).size());
  CHECK(std::count(got.begin(), got.end(), 13) == 3);  // <0x0A>
  // <|endoftext|> keeps what follows; </s> strips it, as llama.cpp marks them.
  CHECK(phi.encode("<|endoftext|> x", false, true) == concat({{eot}, phi.encode(" x", false, false)}));
  CHECK(phi.encode("</s> \t x", false, true) == concat({{2}, phi.encode("x", false, false)}));
  // Only parsed specials strip: the same text unparsed is plain text.
  CHECK(phi.encode(turn, false, false) == other.encode(turn, false, false));
}

TEST_CASE("byte-level BPE details (gpt-2 vocab)") {
  auto file = gguf::File::open(test::peer("tokenizer/ggml-vocab-gpt-2.gguf"));
  Tokenizer tok = Tokenizer::from_gguf(*file);
  CHECK(tok.kind() == VocabKind::Bpe);
  CHECK(tok.pre() == PreTokenizer::Gpt2);
  CHECK_FALSE(tok.add_bos());
  // " Hello" is one token spelled with GPT-2's space character.
  auto ids = tok.encode(" Hello", false, false);
  REQUIRE(ids.size() == 1);
  CHECK(tok.token_text(ids[0]) == "\xC4\xA0Hello");  // "ĠHello"
  CHECK(tok.decode_piece(ids[0]) == " Hello");
  // Every ASCII byte round-trips; one that is not UTF-8 on its own is read as U+FFFD (llama.cpp's
  // reading), and so is its token.
  for (int b = 0; b < 256; ++b) {
    std::string s(1, char(b));
    CHECK(tok.decode(tok.encode(s, false, false)) == (b < 0x80 ? s : std::string("\xEF\xBF\xBD")));
  }
  auto eot = tok.encode("x<|endoftext|>", false, true);
  CHECK(eot.back() == 50256);
  CHECK(tok.is_eog(50256));
}

TEST_CASE("baton tokenize prints the ids and pieces") {
  const std::string model = test::peer("tokenizer/ggml-vocab-llama-spm.gguf");
  auto run = [](const std::string& cmd) {
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    REQUIRE(p);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    CHECK(pclose(p) == 0);
    return out;
  };
  auto file = gguf::File::open(model);
  Tokenizer tok = Tokenizer::from_gguf(*file);
  std::string want;
  for (int32_t id : tok.encode("Hello world", true, false)) {
    if (!want.empty()) want += ' ';
    want += std::to_string(id);
  }
  CHECK(run(std::string(BATON_BINARY) + " tokenize -m " + model + " -p 'Hello world'") == want + "\n");
  CHECK(want.rfind("1 ", 0) == 0);  // BOS first, as the vocabulary asks
  std::string pieces = run(std::string(BATON_BINARY) + " tokenize -m " + model + " -p 'Hello world' --no-bos --pieces");
  CHECK(pieces == "  15043 ' Hello'\n   3186 ' world'\n");
}

// Text survives encode -> decode: SentencePiece exactly, malformed UTF-8 included, through its
// <0xNN> byte fallback; byte-level BPE with each byte that is not UTF-8 read as U+FFFD first, as
// llama.cpp reads it (the test above).
TEST_CASE("random text round-trips through every vocabulary") {
  const std::vector<std::string> alphabet = {"a", "Z", " ", "  ", "\n", "\t", "7", "'s", "é", "日本", "🦙", "\xCC\x81",
                                             "\xC3", "\x80", "\xE2\x82", "<", "|", "$", "..."};
  uint64_t state = 12345;
  auto next = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return uint32_t(state >> 33);
  };
  for (const char* name : {"ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf", "ggml-vocab-falcon.gguf",
                           "ggml-vocab-starcoder.gguf"}) {
    auto file = gguf::File::open(test::peer(std::string("tokenizer/") + name));
    Tokenizer tok = Tokenizer::from_gguf(*file);
    for (int trial = 0; trial < 200; ++trial) {
      std::string s;
      const uint32_t len = next() % 24;
      for (uint32_t i = 0; i < len; ++i) s += alphabet[next() % alphabet.size()];
      auto ids = tok.encode(s, false, false);
      INFO(name << ": '" << s << "'");
      std::string valid;
      CHECK(tok.decode(ids) == (tok.kind() == VocabKind::Spm ? s : std::string(unicode::with_invalid_replaced(s, valid))));
    }
  }
}

TEST_CASE("BPE: bytes that are not UTF-8 are read as U+FFFD, one per byte, never dropped or <unk>") {
  const std::string fffd = "\xEF\xBF\xBD";
  // Each bad input and the same text as llama.cpp reads it.
  const std::pair<std::string, std::string> cases[] = {
      {"x \xFF y", "x " + fffd + " y"},
      {"\xFF\xFE", fffd + fffd},
      {"a\x80" "b", "a" + fffd + "b"},                 // a stray continuation byte
      {"\xC3" "A", fffd + "A"},                        // a 2-byte lead without its continuation
      {"end \xE2\x82", "end " + fffd + fffd},          // cut short at the end: each byte
      {"\xF0\x9F\x98" "x\xF0\x9F\x98\x80", fffd + fffd + fffd + "x\xF0\x9F\x98\x80"},
      {"caf\xC3\xA9 \xE2\x82\xAC", "caf\xC3\xA9 \xE2\x82\xAC"},  // valid: unchanged
  };
  for (const char* name : {"ggml-vocab-gpt-2.gguf", "ggml-vocab-falcon.gguf", "ggml-vocab-starcoder.gguf"}) {
    auto file = gguf::File::open(test::peer(std::string("tokenizer/") + name));
    const Tokenizer tok = Tokenizer::from_gguf(*file);
    for (const auto& [bad, read_as] : cases) {
      INFO(name << ": " << read_as);
      const auto ids = tok.encode(bad, false, false);
      CHECK(ids == tok.encode(read_as, false, false));
      CHECK(tok.decode(ids) == read_as);  // every byte accounted for
    }
  }
}
