// `baton embed` (runtime/embed.h, cli/embed.cpp): normalization as llama-embedding's
// --embd-normalize, the file's pooling_type, and the command end to end on a generated qwen3
// file with a tokenizer (synth --pooling): flags, input sources, JSONL error records, output order,
// and the same vector whichever way an input comes in. The pooled vectors themselves are checked
// against a double-precision reference in tests/test_model_tiny.cpp.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gguf/gguf.h"
#include "runtime/embed.h"
#include "runtime/shape.h"
#include "runtime/synth.h"
#include "tests/cli_helpers.h"
#include "tests/helpers.h"

using namespace baton;
using test::Out;
using test::run_baton;
using test::slurp;
using test::jsonl;
using nlohmann::json;

namespace {

constexpr int kEmbd = 128;

// A generated qwen3 file (synthetic SentencePiece vocabulary) with the given pooling_type
// (-1: no key), written once per pooling.
std::string model(int pooling) {
  static std::map<int, std::string> made;
  auto it = made.find(pooling);
  if (it != made.end()) return it->second;
  ShapePreset p{"tiny-embed", "qwen3", "test", 2, kEmbd, 4, 2, 32, 256, 600, 512, false, 0, 0, 1e6f, 1e-6f, false};
  SynthOptions o;
  o.type = GgmlType::Q8_0;
  o.seed = 21;
  o.pooling = pooling;
  const std::string path = test::temp_dir() + "/embed.gguf";
  synth_write(p, o, path);
  return made[pooling] = path;
}

double norm2(const json& v) {
  double s = 0;
  for (const auto& x : v) s += x.get<double>() * x.get<double>();
  return std::sqrt(s);
}

double max_diff(const json& a, const json& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i].get<double>() - b[i].get<double>()));
  return d;
}

}  // namespace

TEST_CASE("embedding normalization: none, max-abs int16, taxicab, Euclidean, p-norm") {
  const std::vector<float> v = {3.f, -4.f, 0.f, 1.f};
  auto norm = [&](int n) {
    std::vector<float> x = v;
    normalize_embedding(x.data(), int(x.size()), n);
    return x;
  };
  CHECK(norm(-1) == v);
  const auto m = norm(0);  // the largest magnitude becomes 32760
  CHECK(m[1] == Approx(-32760.f));
  CHECK(m[0] == Approx(3.f * 32760.f / 4.f));
  const auto l1 = norm(1);
  CHECK(l1[0] == Approx(3.0 / 8.0));
  const auto l2 = norm(2);
  CHECK(l2[0] == Approx(3.0 / std::sqrt(26.0)));
  CHECK(l2[1] == Approx(-4.0 / std::sqrt(26.0)));
  const auto l3 = norm(3);
  CHECK(l3[1] == Approx(-4.0 / std::cbrt(27.0 + 64.0 + 1.0)));
  // A large p on large components: the p-norm tends to the largest magnitude, never overflows.
  std::vector<float> big = {27.3f, -3.f, 20.f, 0.5f};
  normalize_embedding(big.data(), 4, 500);
  CHECK(big[0] == Approx(1.0).epsilon(1e-3));
  CHECK(big[2] == Approx(20.0 / 27.3).epsilon(1e-3));
  std::vector<float> zero(4, 0.f);
  normalize_embedding(zero.data(), 4, 2);  // stays zero, no NaN
  CHECK(zero == std::vector<float>(4, 0.f));
  normalize_embedding(zero.data(), 4, 7);
  CHECK(zero == std::vector<float>(4, 0.f));
  CHECK(test::usage_error([] { check_normalize(-2); }).find("-2") != std::string::npos);
}

TEST_CASE("embedding normalization of a vector with NaN or infinity: all NaN (it has no size), not zeros") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, inf, -inf}) {
    for (int n : {0, 1, 2, 3, 500}) {
      std::vector<float> x = {3.f, bad, -4.f, 1.f};
      normalize_embedding(x.data(), int(x.size()), n);
      INFO("norm " << n << ", " << bad);
      for (float y : x) CHECK(std::isnan(y));  // (the finite values were zeros with 1 to 500, scaled with 0)
    }
    std::vector<float> raw = {3.f, bad, -4.f, 1.f};
    normalize_embedding(raw.data(), int(raw.size()), -1);  // none: the raw state, as it is
    CHECK(raw[0] == 3.f);
    CHECK(raw[2] == -4.f);
    CHECK(!std::isfinite(raw[1]));
  }
}

TEST_CASE("pooling: names, the file's pooling_type, rank and unknown values refused") {
  CHECK(parse_pooling("mean") == Pooling::Mean);
  CHECK(parse_pooling("last") == Pooling::Last);
  CHECK(parse_pooling("cls") == Pooling::Cls);
  CHECK(parse_pooling("none") == Pooling::None);
  CHECK(test::usage_error([] { parse_pooling("rank"); }).find("not supported") != std::string::npos);
  CHECK(test::usage_error([] { parse_pooling("max"); }).find("unknown pooling 'max'") != std::string::npos);
  auto pooling_of = [](std::optional<uint32_t> v) {
    gguf::Writer w;
    w.set("general.architecture", gguf::Value::of_str("qwen3"));
    if (v) w.set("qwen3.pooling_type", gguf::Value::of_u32(*v));
    const auto bytes = w.to_bytes();
    return file_pooling(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  CHECK(!pooling_of(std::nullopt));
  CHECK(pooling_of(3) == Pooling::Last);
  CHECK(pooling_of(1) == Pooling::Mean);
  CHECK(pooling_of(4) == Pooling::Rank);
  CHECK_THROWS_WITH(pooling_of(7), Catch::Contains("qwen3.pooling_type") && Catch::Contains("not a pooling type"));
}

TEST_CASE("synth --pooling writes pooling_type, and add_eos_token for last") {
  const std::string dir = test::temp_dir();
  const std::string base = "synth --arch qwen3 --n-embd 64 --n-layer 1 --n-head 2 --n-ff 64 --n-vocab 300 --type Q8_0 ";
  Out last = run_baton(base + "--pooling last --out " + dir + "/last.gguf");
  INFO(last.err);
  REQUIRE(last.code == 0);
  auto f = gguf::File::open(dir + "/last.gguf");
  CHECK(f->get<uint32_t>("qwen3.pooling_type") == 3);
  CHECK(f->get<bool>("tokenizer.ggml.add_eos_token"));
  REQUIRE(run_baton(base + "--pooling mean --out " + dir + "/mean.gguf").code == 0);
  f = gguf::File::open(dir + "/mean.gguf");
  CHECK(f->get<uint32_t>("qwen3.pooling_type") == 1);
  CHECK(!f->get<bool>("tokenizer.ggml.add_eos_token"));
  Out rank = run_baton(base + "--pooling rank --out " + dir + "/rank.gguf");
  CHECK(rank.code == 1);
  CHECK(rank.err.find("not supported") != std::string::npos);
}

TEST_CASE("embed: bad flags, empty and too long inputs are usage errors (exit 1); a missing model or input is 2") {
  const std::string m = "embed -t 2 -m " + model(3);
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"", "give the input"},
           {"-p a -f /dev/null", "one of -p, -f and -i"},
           {"-p a --pooling rank", "not supported"},
           {"-p a --pooling max", "unknown pooling 'max'"},
           {"-p a --normalize -3", "normalization -3"},
           {"-p a --json --plain", "--json or --plain"},
           {"-p ''", "the input is empty"},
           {"-p a -p ''", "input 1 is empty"},
           {"--ctx 8 -p 'a rather long input that cannot fit in eight tokens'", "but the context is 8"},
       }) {
    Out o = run_baton(m + " " + c.args);
    INFO(c.args << "\n" << o.err);
    CHECK(o.code == 1);
    CHECK(o.err.find(c.message) != std::string::npos);
    CHECK(o.out.empty());
  }
  Out missing = run_baton("embed -m /nonexistent/model.gguf -p hi");
  CHECK(missing.code == 2);
  Out no_input = run_baton(m + " -i /nonexistent/in.jsonl");  // a file problem, as a missing model
  CHECK(no_input.code == 2);
  CHECK_THAT(no_input.err, Catch::Contains("cannot read '/nonexistent/in.jsonl'"));
}

TEST_CASE("embed: JSONL input, error records in line order, the same vector from -p, -f and JSONL") {
  const std::string m = "embed -t 2 -m " + model(3);
  const std::string dir = test::temp_dir();
  std::ofstream(dir + "/in.jsonl") << R"({"id": "a", "input": "the cat sat on the mat"})" "\n"
                                   << R"({"id": "b", "input": })" "\n"
                                   << "\n"
                                   << R"({"id": "c"})" "\n"
                                   << R"({"id": "d", "input": ""})" "\n"
                                   << R"({"id": "a", "input": "again"})" "\n"
                                   << R"([1, 2])" "\n"
                                   << R"({"id": 7, "input": "hello world"})" "\n"
                                   << R"({"input": "no id here, a longer one to share forwards with the others"})" "\n";
  Out o = run_baton(m + " -i " + dir + "/in.jsonl --parallel 3 -b 8");
  INFO(o.err);
  REQUIRE(o.code == 0);
  const auto rec = jsonl(o.out);
  REQUIRE(rec.size() == 8);  // one per non-blank line, in line order
  CHECK(rec[0]["id"] == "a");
  CHECK(rec[0]["embedding"].size() == size_t(kEmbd));
  CHECK(std::fabs(norm2(rec[0]["embedding"]) - 1.0) < 1e-5);  // L2 by default
  CHECK(rec[1] == json{{"line", 2}, {"error", "invalid JSON"}});  // (its id unread)
  CHECK(rec[2] == json{{"id", "c"}, {"line", 4}, {"error", "missing 'input'"}});
  CHECK(rec[3] == json{{"id", "d"}, {"line", 5}, {"error", "field 'input' is empty"}});
  CHECK(rec[4] == json{{"id", "a"}, {"line", 6}, {"error", "duplicate id (first on line 1)"}});
  CHECK(rec[5] == json{{"line", 7}, {"error", "expected a JSON object"}});
  CHECK(rec[6]["id"] == 7);
  CHECK(rec[7]["id"] == 9);  // no id: the line number
  CHECK(rec[7]["n_tokens"].get<int>() > 8);  // (longer than a forward of -b 8)
  CHECK(o.err.find("3 embedded, 5 failed") != std::string::npos);

  // The same inputs one at a time through -p and -f: the same vectors (up to the rounding of
  // other batch shapes), the same token counts.
  Out p = run_baton(m + " -p 'the cat sat on the mat' -p 'hello world' --parallel 1");
  INFO(p.err);
  REQUIRE(p.code == 0);
  const auto pr = jsonl(p.out);
  REQUIRE(pr.size() == 2);
  CHECK(pr[0]["index"] == 0);
  CHECK(pr[1]["index"] == 1);
  CHECK(pr[0]["n_tokens"] == rec[0]["n_tokens"]);
  CHECK(max_diff(pr[0]["embedding"], rec[0]["embedding"]) < 1e-4);
  CHECK(max_diff(pr[1]["embedding"], rec[6]["embedding"]) < 1e-4);
  CHECK(max_diff(pr[0]["embedding"], pr[1]["embedding"]) > 1e-2);  // different texts, different vectors
  std::ofstream(dir + "/one.txt") << "hello world\n";
  Out f = run_baton(m + " -f " + dir + "/one.txt");
  REQUIRE(f.code == 0);
  CHECK(max_diff(jsonl(f.out).at(0)["embedding"], pr[1]["embedding"]) < 1e-4);
  Out s = run_baton(m + " -p -", "hello world\n");
  REQUIRE(s.code == 0);
  CHECK(max_diff(jsonl(s.out).at(0)["embedding"], pr[1]["embedding"]) < 1e-4);
  // A UTF-8 byte-order mark (Notepad's files) is not text: JSONL stays JSONL, -f reads the text.
  std::ofstream(dir + "/bom.jsonl", std::ios::binary) << "\xEF\xBB\xBF" << R"({"id": "bom", "input": "hello world"})" "\n";
  Out bom = run_baton(m + " -i " + dir + "/bom.jsonl");
  REQUIRE(bom.code == 0);
  CHECK(jsonl(bom.out).at(0)["id"] == "bom");
  CHECK(max_diff(jsonl(bom.out).at(0)["embedding"], pr[1]["embedding"]) < 1e-4);
  std::ofstream(dir + "/bom.txt", std::ios::binary) << "\xEF\xBB\xBF" << "hello world\n";
  Out bomf = run_baton(m + " -f " + dir + "/bom.txt");
  REQUIRE(bomf.code == 0);
  CHECK(jsonl(bomf.out).at(0)["n_tokens"] == pr[1]["n_tokens"]);

  // Plain text input: one input per non-blank line, ids are line numbers.
  std::ofstream(dir + "/in.txt") << "the cat sat on the mat\n\nhello world\n";
  Out t = run_baton(m + " -i " + dir + "/in.txt -o " + dir + "/out.jsonl");
  REQUIRE(t.code == 0);
  CHECK(t.out.empty());  // the records went to -o
  const auto tr = jsonl(slurp(dir + "/out.jsonl"));
  REQUIRE(tr.size() == 2);
  CHECK(tr[1]["id"] == 3);
  CHECK(max_diff(tr[1]["embedding"], pr[1]["embedding"]) < 1e-4);
}

TEST_CASE("embed: pooling from the file, --pooling over it, none without a key; --plain; --normalize") {
  const std::string text = " -t 2 -p 'the cat sat on the mat'";
  Out last = run_baton("embed -m " + model(3) + text);  // the file says last (and adds EOS)
  Out last2 = run_baton("embed -m " + model(3) + text + " --pooling last");
  Out mean = run_baton("embed -m " + model(3) + text + " --pooling mean");
  INFO(last.err << mean.err);
  REQUIRE((last.code == 0 && last2.code == 0 && mean.code == 0));
  const json vl = jsonl(last.out).at(0)["embedding"], vm = jsonl(mean.out).at(0)["embedding"];
  CHECK(max_diff(vl, jsonl(last2.out).at(0)["embedding"]) == 0);
  CHECK(max_diff(vl, vm) > 1e-2);
  CHECK(last.err.find("pooling last") != std::string::npos);

  // No pooling_type: one vector per token (llama.cpp's default), and a note saying so.
  Out none = run_baton("embed -m " + model(-1) + text);
  INFO(none.err);
  REQUIRE(none.code == 0);
  const json r = jsonl(none.out).at(0);
  CHECK(none.err.find("pooling none") != std::string::npos);
  CHECK(none.err.find("has no qwen3.pooling_type") != std::string::npos);
  REQUIRE(r["embedding"].size() == size_t(r["n_tokens"].get<int>()));
  for (const auto& row : r["embedding"]) {
    CHECK(row.size() == size_t(kEmbd));
    CHECK(std::fabs(norm2(row) - 1.0) < 1e-5);  // each token's vector normalized alone
  }

  // --plain: the numbers only, one line per vector; --normalize -1 keeps the raw state.
  Out plain = run_baton("embed -m " + model(3) + text + " --plain --normalize -1");
  REQUIRE(plain.code == 0);
  std::istringstream in(plain.out);
  std::vector<double> v;
  for (double x; in >> x;) v.push_back(x);
  REQUIRE(v.size() == size_t(kEmbd));
  CHECK(std::count(plain.out.begin(), plain.out.end(), '\n') == 1);
  double n2 = 0;
  for (double x : v) n2 += x * x;
  CHECK(std::fabs(std::sqrt(n2) - 1.0) > 0.1);  // not normalized
  for (size_t i = 0; i < v.size(); ++i) CHECK(v[i] / std::sqrt(n2) == Approx(vl[i].get<double>()).margin(1e-5));
}

TEST_CASE("embed: NaN in the model's output is written as null, every line stays JSON, and stderr says so once") {
  // The generated file with a NaN as the output norm's first weight: that dimension of every
  // token's state is NaN.
  const std::string path = test::temp_dir() + "/nan.gguf";
  std::filesystem::copy_file(model(1), path);
  uint64_t at = 0;
  {
    const auto f = gguf::File::open(path);
    const gguf::TensorInfo* t = f->tensor("output_norm.weight");
    REQUIRE(t != nullptr);
    REQUIRE(t->type == GgmlType::F32);
    at = f->data_offset() + t->offset;
  }
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    f.seekp(std::streamoff(at));
    f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
    REQUIRE(f.good());
  }
  for (const std::string& pooling : std::vector<std::string>{"mean", "none"}) {
    Out o = run_baton("embed -t 2 -m " + path + " --pooling " + pooling + " -p 'the cat sat' -p 'hello world'");
    INFO(pooling << "\n" << o.err << "\n" << o.out);
    REQUIRE(o.code == 0);
    std::istringstream lines(o.out);
    int n = 0;
    for (std::string l; std::getline(lines, l); ++n) CHECK(json::accept(l));
    CHECK(n == 2);
    const auto rec = jsonl(o.out);
    REQUIRE(rec.size() == 2);
    const json& first = pooling == "none" ? rec[0]["embedding"][0] : rec[0]["embedding"];
    REQUIRE(first.size() == size_t(kEmbd));
    // Normalized, a vector with a NaN in it has no size: all of it is null (its other values were
    // zeros, which looked like part of a vector).
    for (const json& x : first) CHECK(x.is_null());
    const size_t warned = o.err.find("non-finite values");
    CHECK(warned != std::string::npos);
    CHECK(o.err.find("non-finite values", warned + 1) == std::string::npos);  // once, not per input
  }
  // --normalize -1: the raw state, only the NaN dimension null.
  const Out raw = run_baton("embed -t 2 -m " + path + " --pooling mean --normalize -1 -p 'the cat sat'");
  INFO(raw.err);
  REQUIRE(raw.code == 0);
  const json e = jsonl(raw.out).at(0)["embedding"];
  CHECK(e[0].is_null());
  CHECK(std::count_if(e.begin(), e.end(), [](const json& x) { return x.is_null(); }) == 1);
  CHECK_THAT(raw.err, Catch::Contains("non-finite values"));
}
