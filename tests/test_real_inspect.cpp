// `baton inspect --json` on the two real models: the facts it reports match what the independent
// Python `gguf` package (GGUFReader) reads from the same files (checked by hand when this was written).
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tests/helpers.h"

namespace {

// Runs the command and returns its stdout and exit status.
std::pair<std::string, int> run(const std::string& cmd) {
  std::FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {out, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

struct Expected {
  const char* arch;
  uint64_t blocks, embedding, context, vocab, tensors, params, bytes;
  std::vector<std::pair<std::string, uint64_t>> types;  // type -> tensor count
};

void check(const std::string& path, const Expected& e) {
  auto [out, rc] = run(std::string(BATON_BINARY) + " inspect --json '" + path + "'");
  REQUIRE(rc == 0);
  const auto j = nlohmann::json::parse(out);
  const auto& m = j.at("model");
  CHECK(j.at("version") == 3);
  CHECK(m.at("architecture") == e.arch);
  CHECK(m.at("block_count") == e.blocks);
  CHECK(m.at("embedding_length") == e.embedding);
  CHECK(m.at("context_length") == e.context);
  CHECK(m.at("vocab_size") == e.vocab);
  CHECK(m.at("tensor_count") == e.tensors);
  CHECK(j.at("tensors").size() == e.tensors);
  CHECK(j.at("parameters") == e.params);
  CHECK(j.at("tensor_bytes") == e.bytes);
  CHECK(j.at("metadata").at("tokenizer.ggml.tokens").at("length") == e.vocab);
  REQUIRE(j.at("types").size() == e.types.size());
  for (size_t k = 0; k < e.types.size(); k++) {
    CHECK(j.at("types")[k].at("type") == e.types[k].first);
    CHECK(j.at("types")[k].at("tensors") == e.types[k].second);
  }
  // The text form tells the same story.
  auto [text, rc2] = run(std::string(BATON_BINARY) + " inspect '" + path + "'");
  CHECK(rc2 == 0);
  CHECK_THAT(text, Catch::Contains(fmt::format("{} blocks, embedding {}, context {}, vocab {}, {} tensors",
                                               e.blocks, e.embedding, e.context, e.vocab, e.tensors)));
}

}  // namespace

TEST_CASE("real: baton inspect SmolLM2-135M Q4_1", "[real]") {
  const std::string path = baton::test::smollm2();
  if (path.empty()) return;
  check(path, {"llama", 30, 576, 8192, 49152, 272, 134515008, 96576768, {{"F32", 61}, {"Q4_1", 210}, {"Q8_0", 1}}});
}

TEST_CASE("real: baton inspect Gemma 3 270M Q4_K_M", "[real]") {
  const std::string path = baton::test::gemma3();
  if (path.empty()) return;
  check(path, {"gemma3", 18, 640, 32768, 262144, 236, 268098176, 246587904,
               {{"F32", 109}, {"Q4_K", 27}, {"Q5_0", 81}, {"Q6_K", 9}, {"Q8_0", 10}}});
}
