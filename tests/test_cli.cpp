// The command line's contract where it meets the system, through the built binary on a generated
// model (no fetched model needed): parse errors as one `error:` line, output that cannot be
// written, input files that are directories or start with a byte-order mark, an output that names
// an input, batch --resume's idea of a finished record, and chat's piped input (docs/CLI.md).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <chrono>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tests/cli_helpers.h"
#include "tests/helpers.h"
#include "tests/model_helpers.h"

using namespace baton;
using namespace baton::test;

namespace {

// The generated llama of tests/model_helpers.h: it has a tokenizer, and generates in milliseconds.
const std::string& tiny() {
  static const std::string path = tiny_model_of(GgmlType::Q8_0);
  return path;
}

int count_lines(const std::string& s) { return int(std::count(s.begin(), s.end(), '\n')); }

int count_of(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) n++;
  return n;
}

}  // namespace

TEST_CASE("parse errors are one line, error: ..., naming the flag and its rule") {
  struct Case {
    std::string args, says;
  };
  for (const Case& c : std::vector<Case>{
           {"run -m x -p hi --bogus", "error: The following argument was not expected: --bogus (see baton run --help)"},
           {"frobnicate", "error: unknown command 'frobnicate' (see baton --help)"},
           {"run -m x -p hi -b 0", "error: --batch-size: 0 is not allowed (must be at least 1)"},
           {"run -m x -p hi -c -5", "error: --ctx: -5 is not allowed (must be at least 0)"},
           {"run -m x -p hi -c abc", "error: --ctx: 'abc' is not a whole number"},
           {"run -m x -p hi -t 99999999999", "error: --threads: 99999999999 is too large"},
           {"run -m x -p hi --lookup 65", "error: --lookup: 65 is not allowed (must be 0 to 64)"},
           {"batch -m x -i a -o b --parallel 0", "error: --parallel: 0 is not allowed (must be 1 to 256)"},
           {"embed -m x -p a --parallel 300", "error: --parallel: 300 is not allowed (must be 1 to 256)"},
           {"perplexity -m x -f y --chunks -1", "error: --chunks: -1 is not allowed (must be at least 0)"},
           {"logits -m x -p a --out f --outputs 0", "error: --outputs: 0 is not allowed"},
           {"bench-kernels --reps 0", "error: --reps: 0 is not allowed (must be 1 to 100000)"},
           {"logits -m x -p a --tokens 1 --out f", "error: --prompt excludes --tokens"},
           {"run -p hi", "error: --model is required (see baton run --help)"},
           // An empty value (an unset shell variable) is no number, and no grammar or schema.
           {"run -m x -p hi -n ''", "error: --max-tokens: '' is not a whole number"},
           {"run -m x -p hi --temp ''", "error: --temp: '' is not a number"},
           {"run -m x -p hi --top-k ''", "error: --top-k: '' is not a whole number"},
           {"run -m x -p hi --min-p ''", "error: --min-p: '' is not a number"},
           {"chat -m x --repeat-last-n ''", "error: --repeat-last-n: '' is not a whole number"},
           {"run -m x -p hi --seed ''", "error: --seed: '' is not a whole number"},
           {"run -m x -p hi -ngl ''", "error: --n-gpu-layers: '' is not a whole number"},
           {"bench -m x -r ''", "error: --repetitions: '' is not a whole number"},
           {"synth --shape tiny --out x --n-embd ''", "error: --n-embd: '' is not a whole number"},
           {"run -m x -p hi --grammar ''", "error: --grammar: the grammar is empty"},
           {"batch -m x -i a -o b --json-schema ''", "error: --json-schema: the schema is empty"},
           {"run -m x -p hi --json-schema-file ''", "error: --json-schema-file: the path is empty"},
           // Sampling values name their flag and rule.
           {"run -m x -p hi --top-p 2", "error: --top-p: 2 is not allowed (must be in (0, 1])"},
           {"run -m x -p hi --temp nan", "error: --temp: nan is not allowed (must be at least 0)"},
           {"run -m x -p hi --temp 1e39", "error: --temp: 1e39 is too large"},
           {"chat -m x --min-p 1.5", "error: --min-p: 1.5 is not allowed (must be 0 to 1)"},
           {"batch -m x -i a -o b --repeat-penalty 0", "error: --repeat-penalty: 0 is not allowed (must be above 0)"},
           {"run -m x -p hi --top-k -1", "error: --top-k: -1 is not allowed (must be at least 0)"},
           {"run -m x -p hi --presence-penalty nan", "error: --presence-penalty: nan is not allowed (must be finite)"},
           {"batch -m x -i a -o b --frequency-penalty x", "error: --frequency-penalty: 'x' is not a number"},
           {"run -m x -p hi -l 5x", "error: --logit-bias: '5x' is not TOKEN+BIAS or TOKEN-BIAS (e.g. 15043+1.5, 15043-inf)"},
           {"chat -m x --logit-bias 5+inf", "error: --logit-bias: '5+inf': a bias must be finite or -inf"},
           {"run -m x -p hi --logit-bias 5+1 -l 9-y", "error: --logit-bias: '9-y': '-y' is not a number"},
           {"run -m x -p hi -l 99999999999+1", "error: --logit-bias: '99999999999+1': the token 99999999999 is too large"},
           {"batch -m x -i a -o b --logprobs 21", "error: --logprobs: 21 is not allowed (must be 0 to 20)"},
           {"run -m x -p hi --mirostat 3", "error: --mirostat: 3 is not allowed (must be 0 to 2)"},
           {"chat -m x --typical 0", "error: --typical: 0 is not allowed (must be in (0, 1])"},
           {"run -m x -p hi --mirostat-lr -1", "error: --mirostat-lr: -1 is not allowed (must be at least 0)"},
           {"run -m x -p hi --xtc-probability 2", "error: --xtc-probability: 2 is not allowed (must be 0 to 1)"},
           {"batch -m x -i a -o b --top-n-sigma inf", "error: --top-n-sigma: inf is too large"},
           {"run -m x -p hi --dry-base 0.5", "error: --dry-base: 0.5 is not allowed (must be at least 1)"},
           {"run -m x -p hi --dry-penalty-last-n -2", "error: --dry-penalty-last-n: -2 is not allowed"},
           {"chat -m x --dry-sequence-breaker ''", "error: --dry-sequence-breaker: the breaker is empty"},
           {"run -m x -p hi -n 99999999999", "error: --max-tokens: 99999999999 is too large"},
           // --seed: 0 to 2^64-1, or -1 (random); no wrapping.
           {"run -m x -p hi --seed -5", "error: --seed: -5 is not allowed (must be 0 to 18446744073709551615, or -1: random)"},
           {"run -m x -p hi --seed 18446744073709551616", "error: --seed: 18446744073709551616 is not allowed"},
           {"run -m x -p hi --seed abc", "error: --seed: 'abc' is not a whole number"},
           // A repeated flag takes its last value, but each value is still checked.
           {"run -m x -p hi -b 0 -b 8 -b 0", "error: --batch-size: 0 is not allowed"},
           {"run -m x -p hi -n abc -n 5", "error: --max-tokens: 'abc' is not a whole number"},
       }) {
    const Out o = run_baton(c.args);
    INFO(c.args << "\n" << o.err);
    CHECK(o.code == 1);
    CHECK(o.err.rfind(c.says, 0) == 0);
    CHECK(count_lines(o.err) == 1);
    CHECK(o.err.find("1797693") == std::string::npos);  // no DBL_MAX range
  }
  CHECK(run_baton("run --help").code == 0);
}

TEST_CASE("--logprobs and --logit-bias: the log-softmax of each token, a banned token gives way to the next best") {
  const std::string m = tiny();
  const std::string base = "run -m " + m + " -p 'once upon a time' --raw --temp 0 -n 6 --ignore-eos -t 2 --json ";
  const Out a = run_baton(base + "--logprobs 3");
  INFO(a.err);
  REQUIRE(a.code == 0);
  const auto j = nlohmann::json::parse(a.out);
  const auto& lps = j["logprobs"];
  REQUIRE(lps.size() == 6);
  for (const auto& t : lps) {
    REQUIRE(t["top_logprobs"].size() == 3);
    CHECK(t["id"] == t["top_logprobs"][0]["id"]);  // greedy: the best
    CHECK(t["logprob"].get<double>() <= 0);
    double mass = 0, last = 0;
    for (const auto& alt : t["top_logprobs"]) {
      const double lp = alt["logprob"].get<double>();
      if (&alt != &t["top_logprobs"][0]) CHECK(lp <= last);
      last = lp;
      mass += std::exp(lp);
      CHECK(alt["token"].is_string());
    }
    CHECK(mass <= 1.0 + 1e-5);
  }
  std::string text;
  for (const auto& t : lps) text += t["token"].get<std::string>();
  CHECK(text == j["text"].get<std::string>());
  // Banning the first token: the reply starts with what was second best.
  const int first = lps[0]["id"], second = lps[0]["top_logprobs"][1]["id"];
  const Out b = run_baton(base + "--logprobs 0 -l " + std::to_string(first) + "-inf");
  INFO(b.err);
  REQUIRE(b.code == 0);
  const auto jb = nlohmann::json::parse(b.out);
  CHECK(jb["logprobs"][0]["id"] == second);
  CHECK(jb["logprobs"][0]["top_logprobs"].empty());
  CHECK(std::abs(jb["logprobs"][0]["logprob"].get<double>() - lps[0]["top_logprobs"][1]["logprob"].get<double>()) < 1e-4);
  // Raising the third best past the best picks it.
  const int third = lps[0]["top_logprobs"][2]["id"];
  const double gap = lps[0]["logprob"].get<double>() - lps[0]["top_logprobs"][2]["logprob"].get<double>();
  const Out c = run_baton(base + "--logprobs 1 --logit-bias " + std::to_string(third) + "+" + std::to_string(gap + 0.01));
  REQUIRE(c.code == 0);
  CHECK(nlohmann::json::parse(c.out)["logprobs"][0]["id"] == third);
  // Errors: a token past the vocabulary, --logprobs without --json.
  const Out d = run_baton("run -m " + m + " -p hi -n 2 -t 2 -l 99999+1");
  CHECK(d.code == 1);
  CHECK_THAT(d.err, Catch::Contains("logit_bias: token 99999 is not in the vocabulary (0.."));
  const Out e = run_baton("run -m " + m + " -p hi -n 2 -t 2 --logprobs 2");
  CHECK(e.code == 1);
  CHECK_THAT(e.err, Catch::Contains("--logprobs needs --json"));
}

TEST_CASE("--logprobs on the peer model: llama.cpp's log-softmax at the first step, its logit gaps at the greedy steps") {
  // llama.cpp's logits for P1 (docs: ../shared/peer/README.md): the last prompt row in full, and
  // the five best logits of each greedy step. The logits agree within 0.35 (the peer test's bound),
  // so do log-softmax values (the normalizer moves by less than the largest logit error).
  const std::string base = peer("logits/tiny-q4_0.P1");
  const auto ids = read_ids(base + ".tokens.txt");
  const auto ref = read_f32(base + ".logits.f32");
  const auto greedy = read_ids(base + ".greedy32.txt");
  const auto top5 = read_top5(base + ".greedy32.top5.txt");
  const int V = 32000;
  REQUIRE(ref.size() == ids.size() * size_t(V));
  const Out o = run_baton("run -m " + peer("logits/tiny-q4_0.gguf") +
                          " --raw -p 'The quick brown fox jumps over the lazy dog.' --temp 0 -n 32 --ignore-eos -t 2 "
                          "--json --logprobs 5");
  INFO(o.err);
  REQUIRE(o.code == 0);
  const auto j = nlohmann::json::parse(o.out);
  REQUIRE(j["prompt_tokens"] == int(ids.size()));
  const auto& lps = j["logprobs"];
  REQUIRE(lps.size() == 32);
  const float* last = ref.data() + (ids.size() - 1) * size_t(V);
  double sum = 0;
  const float mx = *std::max_element(last, last + V);
  for (int v = 0; v < V; v++) sum += std::exp(double(last[v]) - mx);
  const double lse = mx + std::log(sum);
  double worst = 0;
  for (const auto& alt : lps[0]["top_logprobs"]) {
    const int id = alt["id"];
    worst = std::max(worst, std::abs(alt["logprob"].get<double>() - (last[id] - lse)));
  }
  std::printf("peer P1 step 0: top-5 logprobs within %.4f of llama.cpp's log-softmax\n", worst);
  CHECK(worst <= 0.35);
  int agreed = 0;
  double worst_gap = 0;
  for (size_t step = 0; step < 32; step++) {
    const auto& t = lps[step];
    const auto& r = top5[step];
    if (t["id"] != greedy[step]) {  // a near-tie, as the peer test tolerates it; the walk stops
      bool near_tie = false;
      for (auto [id, logit] : r) near_tie = near_tie || (id == t["id"].get<int>() && r[0].second - logit <= 0.1f);
      CHECK(near_tie);
      break;
    }
    agreed++;
    CHECK(t["id"] == t["top_logprobs"][0]["id"]);
    for (const auto& alt : t["top_logprobs"])
      for (auto [id, logit] : r)
        if (alt["id"] == id)
          worst_gap = std::max(worst_gap, std::abs((alt["logprob"].get<double>() - t["logprob"].get<double>()) -
                                                   double(logit - r[0].second)));
  }
  std::printf("peer P1: %d greedy steps agree; logprob gaps to the best within %.4f of llama.cpp's logit gaps\n", agreed,
              worst_gap);
  CHECK(agreed >= 4);  // (13 here: a near-tie at step 13)
  CHECK(worst_gap <= 0.35);
}

TEST_CASE("batch: logprobs, top_logprobs, logit_bias and the penalties as JSONL fields, bad ones as error records") {
  const std::string m = tiny();
  const std::string dir = temp_dir();
  const Out first = run_baton("run -m " + m + " -p 'the cat' --raw --temp 0 -n 1 --ignore-eos -t 2 --json --logprobs 2");
  REQUIRE(first.code == 0);
  const auto f = nlohmann::json::parse(first.out)["logprobs"][0];
  const std::string ban = f["id"].dump(), next = f["top_logprobs"][1]["id"].dump();
  std::ofstream(dir + "/in.jsonl") << "{\"id\": 1, \"prompt\": \"the cat\", \"logprobs\": true, \"top_logprobs\": 2}\n"
                                   << "{\"id\": 2, \"prompt\": \"the cat\", \"logprobs\": true, \"logit_bias\": {\"" << ban
                                   << "\": -100}}\n"
                                   << "{\"id\": 3, \"prompt\": \"the cat\", \"logprobs\": true, \"logit_bias\": [[" << ban
                                   << ", false]], \"presence_penalty\": 0.5, \"frequency_penalty\": 0.25}\n"
                                   << "{\"id\": 4, \"prompt\": \"the cat\"}\n"
                                   << "{\"id\": 5, \"prompt\": \"x\", \"logit_bias\": {\"abc\": 1}}\n"
                                   << "{\"id\": 6, \"prompt\": \"x\", \"logit_bias\": {\"3\": \"up\"}}\n"
                                   << "{\"id\": 7, \"prompt\": \"x\", \"logit_bias\": 5}\n"
                                   << "{\"id\": 8, \"prompt\": \"x\", \"top_logprobs\": 2}\n"
                                   << "{\"id\": 9, \"prompt\": \"x\", \"logprobs\": true, \"top_logprobs\": 30}\n"
                                   << "{\"id\": 10, \"prompt\": \"x\", \"presence_penalty\": \"high\"}\n"
                                   << "{\"id\": 11, \"prompt\": \"x\", \"logit_bias\": {\"999999\": 1}}\n"
                                   << "{\"id\": 12, \"prompt\": \"x\", \"logprobs\": 1}\n"
                                   << "{\"id\": 13, \"prompt\": \"x\", \"temperature\": 1, \"mirostat\": 2, \"mirostat_tau\": 3, "
                                      "\"mirostat_eta\": 0.2, \"seed\": 4}\n"
                                   << "{\"id\": 14, \"prompt\": \"x\", \"temperature\": 1, \"typical_p\": 0.5, \"seed\": 4, "
                                      "\"top_n_sigma\": 1.5, \"xtc_probability\": 0.5, \"xtc_threshold\": 0.05, \"dry_multiplier\": 0.8, "
                                      "\"dry_base\": 2, \"dry_allowed_length\": 3, \"dry_penalty_last_n\": 64, "
                                      "\"dry_sequence_breakers\": [\"\\n\", \".\"]}\n"
                                   << "{\"id\": 15, \"prompt\": \"x\", \"mirostat\": 5}\n"
                                   << "{\"id\": 16, \"prompt\": \"x\", \"typical_p\": \"low\"}\n"
                                   << "{\"id\": 17, \"prompt\": \"x\", \"max_tokens\": 4294967301}\n"
                                   << "{\"id\": 18, \"prompt\": \"x\", \"dry_sequence_breakers\": \".\"}\n";
  const Out o = run_baton("batch -m " + m + " -i " + dir + "/in.jsonl -o " + dir + "/out.jsonl --raw --temp 0 -n 3 " +
                          "--ignore-eos -t 2 --parallel 3");
  INFO(o.err);
  REQUIRE(o.code == 0);
  std::map<int, nlohmann::json> by;
  for (const auto& r : jsonl(slurp(dir + "/out.jsonl"))) by[r["id"].get<int>()] = r;
  REQUIRE(by.size() == 18);
  CHECK(by[1]["logprobs"].size() == 3);
  CHECK(by[1]["logprobs"][0]["top_logprobs"].size() == 2);
  CHECK(by[1]["logprobs"][0]["id"].dump() == ban);
  CHECK(by[2]["logprobs"][0]["id"].dump() == next);  // -100: the next best
  CHECK(by[2]["logprobs"][0]["top_logprobs"].empty());
  CHECK(by[3]["logprobs"][0]["id"].dump() == next);  // false: banned
  CHECK_FALSE(by[4].contains("logprobs"));
  CHECK(by[4]["text"] == by[1]["text"]);
  CHECK(by[5]["error"] == "logit_bias: 'abc' is not a token id");
  CHECK(by[6]["error"] == "logit_bias: the bias of token 3 must be a number (or false: never)");
  CHECK_THAT(by[7]["error"].get<std::string>(), Catch::StartsWith("field 'logit_bias' must be an object of token ids"));
  CHECK(by[8]["error"] == "field 'top_logprobs' needs \"logprobs\": true");
  CHECK(by[9]["error"] == "field 'top_logprobs' must be 0 to 20");
  CHECK(by[10]["error"] == "field 'presence_penalty' must be a number");
  CHECK_THAT(by[11]["error"].get<std::string>(), Catch::StartsWith("logit_bias: token 999999 is not in the vocabulary (0.."));
  CHECK(by[12]["error"] == "field 'logprobs' must be true or false");
  CHECK(by[13]["completion_tokens"] == 3);
  CHECK(by[14]["completion_tokens"] == 3);
  CHECK(by[15]["error"] == "mirostat must be 0 (off), 1 or 2 (got 5)");
  CHECK(by[16]["error"] == "field 'typical_p' must be a number");
  CHECK(by[17]["error"] == "field 'max_tokens' is out of range");  // not 5, wrapped
  CHECK(by[18]["error"] == "field 'dry_sequence_breakers' must be an array of strings");
  CHECK_THAT(o.err, Catch::Contains("6 ok, 12 failed"));
}

TEST_CASE("quantize: a plan, a file that runs, and errors that name the problem") {
  const std::string m = tiny(), dir = temp_dir();
  // The tiny model is Q8_0: quantizing it again is refused unless asked.
  const Out refused = run_baton("quantize " + m + " " + dir + "/q.gguf Q4_K_M");
  CHECK(refused.code == 1);
  CHECK_THAT(refused.err, Catch::Contains("is already Q8_0") && Catch::Contains("--allow-requantize"));
  const Out dry = run_baton("quantize " + m + " Q4_0 --dry-run --allow-requantize -v");
  INFO(dry.err);
  CHECK(dry.code == 0);
  CHECK_THAT(dry.err, Catch::Contains("converted to Q4_0") && Catch::Contains("size "));
  CHECK_THAT(dry.err, Catch::Contains("blk.0.attn_q.weight") && Catch::Contains("Q8_0 -> Q4_0"));
  CHECK_FALSE(std::filesystem::exists(dir + "/q.gguf"));
  const Out ok = run_baton("quantize " + m + " " + dir + "/q.gguf q4_0 --allow-requantize -t 2");
  INFO(ok.err);
  REQUIRE(ok.code == 0);
  CHECK_THAT(ok.err, Catch::Contains("wrote " + dir + "/q.gguf"));
  const Out inspect = run_baton("inspect " + dir + "/q.gguf");
  CHECK_THAT(inspect.out, Catch::Contains("Q4_0"));
  const Out run = run_baton("run -m " + dir + "/q.gguf -p hi -n 3 --temp 0 -t 2 --ignore-eos --json");
  INFO(run.err);
  REQUIRE(run.code == 0);
  CHECK(nlohmann::json::parse(run.out)["tokens"] == 3);
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {m + " " + dir + "/x.gguf Q9_K", "unknown type 'Q9_K'"},
           {m + " " + m + " Q4_0", "is the input file"},
           {m + " " + dir + "/x.gguf", "give the type to write"},
           {m + " Q4_K_M", "give the file to write: baton quantize IN OUT Q4_K_M (or --dry-run"},
           {m + " " + dir + "/x.gguf Q4_0 --output-tensor-type q9", "--output-tensor-type 'q9' is not a tensor type"},
           {dir + "/missing.gguf " + dir + "/x.gguf Q4_0", "missing.gguf"},
       }) {
    const Out e = run_baton("quantize " + args);
    INFO(args << "\n" << e.err);
    CHECK(e.code != 0);
    CHECK_THAT(e.err, Catch::Contains(says));
    CHECK(count_lines(e.err) == 1);
  }
  CHECK_FALSE(std::filesystem::exists(dir + "/x.gguf"));
}

TEST_CASE("a repeated flag takes its last value, as in llama.cpp; --seed -1 is a random seed") {
  const std::string m = tiny();
  const Out o = run_baton("run -m " + m + " -p hi --json --ignore-eos -n 9 -n 2 --temp 0.7 --temp 0 -t 1 -t 2 -c 64 -c 128 " +
                          "--seed 5 --seed 7 -p 'hello there'");
  INFO(o.err);
  REQUIRE(o.code == 0);
  const auto j = nlohmann::json::parse(o.out);
  CHECK(j["tokens"] == 2);
  CHECK(j["seed"] == 7);
  auto prompt_tokens = [&](const std::string& p) {
    return nlohmann::json::parse(run_baton("run -m " + m + " --json -n 1 -t 2 -p " + p).out)["prompt_tokens"];
  };
  CHECK(j["prompt_tokens"] == prompt_tokens("'hello there'"));
  CHECK(j["prompt_tokens"] != prompt_tokens("hi"));
  // -1: drawn afresh (a random seed is at most 2^32-1), as when --seed is left out; also as an override.
  for (const char* seed : {"--seed -1", "-s 7 --seed -1", "--seed=-1"}) {
    const Out r = run_baton("run -m " + m + " -p hi --json -n 1 -t 2 " + seed);
    INFO(seed << "\n" << r.err);
    REQUIRE(r.code == 0);
    const uint64_t s = nlohmann::json::parse(r.out)["seed"].get<uint64_t>();
    CHECK(s <= 0xffffffffull);
    CHECK(s != 7);
  }
  const Out max = run_baton("run -m " + m + " -p hi --json -n 1 -t 2 --seed 18446744073709551615");
  REQUIRE(max.code == 0);
  CHECK(nlohmann::json::parse(max.out)["seed"].get<uint64_t>() == 18446744073709551615ull);
  // Options of several values keep them all, repeated or not.
  const Out bk = run_baton("bench-kernels --types Q4_0 --types Q8_0 -t 1 2 -t 1 --read-mib 64 --gemv-mib 1 --gemm-rows 16 --json");
  INFO(bk.err);
  REQUIRE(bk.code == 0);
  std::set<std::string> types;
  std::set<int> threads;
  for (const auto& r : jsonl(bk.out)) {
    if (r["type"] != "-") types.insert(r["type"].get<std::string>());
    threads.insert(r["threads"].get<int>());
  }
  CHECK(types == std::set<std::string>{"Q4_0", "Q8_0"});
  CHECK(threads == std::set<int>{1, 2});
}

TEST_CASE("output that cannot be written fails the command: exit 2 and one error line") {
  const std::string m = tiny();
  for (const std::string& args : std::vector<std::string>{
           "tokenize -m " + m + " -p hello", "plan -m " + m, "inspect " + m, "devices --no-links",
        "run -m " + m + " -p hi -n 4 --temp 0 -t 2", "run -m " + m + " -p hi -n 4 --temp 0 -t 2 --json",
        "run -m " + m + " -p hi -n 2000 --ignore-eos -t 2",
        // Written at once, more than stdout's buffer (7 and 18 KB): the write that fails is fwrite's own.
        "inspect " + m + " --json", "logits -m " + m + " --tokens '1 2 3' -t 2 --out -",
        // Small sizes: the rows stop at the first failed write anyway.
        "bench-kernels --types Q4_0 -t 1 --read-mib 64 --gemv-mib 1 --gemm-rows 16",
        "bench-kernels --types Q4_0 -t 1 --read-mib 64 --gemv-mib 1 --gemm-rows 16 --json"}) {
    for (const char* redirect : {">/dev/full", ">&-"}) {
      const Out o = run_baton(args, "", redirect);
      INFO(args << " " << redirect << "\n" << o.err);
      CHECK(o.code == 2);
      // With the reason: the first failed flush keeps errno, later ones no longer know it.
      const std::string reason = std::string(redirect) == ">&-" ? "Bad file descriptor" : "No space left on device";
      CHECK_THAT(o.err, Catch::Contains("error: writing to standard output failed: " + reason));
      CHECK(count_of(o.err, "error:") == 1);
      CHECK(o.err.find("load ") == std::string::npos);  // no stats line as after a success
    }
  }
  // chat: the reply stops at the first failed write and the chat ends.
  const Out chat = run_baton("chat -m " + m + " -n 2000 --ignore-eos -t 2", "Hi\nHi again\n", ">/dev/full");
  INFO(chat.err);
  CHECK(chat.code == 2);
  CHECK_THAT(chat.err, Catch::Contains("error: writing to standard output failed: No space left on device"));
  // A reader that stops early still ends Baton by SIGPIPE (141 in the shell), not with an error.
  const std::string pipe = "bash -c '" + std::string(BATON_BINARY) + " run -m " + m +
                           " -p hi -n 3000 --ignore-eos -t 2 2>/dev/null | head -c 1 >/dev/null; exit ${PIPESTATUS[0]}'";
  const int st = std::system(pipe.c_str());
  CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 141));
}

TEST_CASE("an input file that is a directory or missing is a file problem (exit 2) naming it; stdin and pipes read") {
  const std::string m = tiny();
  const std::string dir = temp_dir();
  for (const std::string& args : std::vector<std::string>{
           "batch -m " + m + " -i " + dir + " -o " + dir + "/out.jsonl", "embed -m " + m + " -i " + dir,
        "tokenize -m " + m + " -f " + dir, "run -m " + m + " -f " + dir, "perplexity -m " + m + " -f " + dir,
        "run -m " + m + " -p hi --grammar-file " + dir, "run -m " + m + " -p hi --json-schema-file " + dir}) {
    const Out o = run_baton(args);
    INFO(args << "\n" << o.err);
    CHECK(o.code == 2);
    CHECK_THAT(o.err, Catch::Contains("'" + dir + "' is a directory"));
    CHECK(count_lines(o.err) == 1);
  }
  CHECK(!std::filesystem::exists(dir + "/out.jsonl"));  // refused before the output was opened
  for (const std::string& args : std::vector<std::string>{"batch -m " + m + " -i " + dir + "/none.jsonl -o -", "tokenize -m " + m + " -f " + dir + "/none",
                                  "run -m " + m + " -p hi --grammar-file " + dir + "/none.gbnf"}) {
    const Out o = run_baton(args);
    INFO(args << "\n" << o.err);
    CHECK(o.code == 2);
    CHECK_THAT(o.err, Catch::Contains("/none") && Catch::Contains("No such file or directory"));
  }
  const Out direct = run_baton("tokenize -m " + m + " -p 'hello world'");
  REQUIRE(direct.code == 0);
  CHECK(run_baton("tokenize -m " + m + " -f -", "hello world").out == direct.out);
  const std::string piped = "printf 'hello world' | " + std::string(BATON_BINARY) + " tokenize -m " + m +
                            " -f /dev/stdin > " + dir + "/piped.txt";
  REQUIRE(std::system(piped.c_str()) == 0);
  CHECK(slurp(dir + "/piped.txt") == direct.out);
}

TEST_CASE("a UTF-8 byte-order mark at the start of an input file is skipped") {
  const std::string m = tiny();
  const std::string dir = temp_dir();
  const std::string bom = "\xEF\xBB\xBF";
  std::ofstream(dir + "/text.txt", std::ios::binary) << bom << "hello world";
  const Out direct = run_baton("tokenize -m " + m + " -p 'hello world'");
  CHECK(run_baton("tokenize -m " + m + " -f " + dir + "/text.txt").out == direct.out);
  // batch: still JSONL, the line's own id and max_tokens.
  std::ofstream(dir + "/in.jsonl", std::ios::binary) << bom << R"({"id":"bom","prompt":"hi","max_tokens":2,"temperature":0})"
                                                     << "\n";
  const Out b = run_baton("batch -m " + m + " -t 2 --ignore-eos -i " + dir + "/in.jsonl -o -");
  INFO(b.err);
  REQUIRE(b.code == 0);
  const auto recs = jsonl(b.out);
  REQUIRE(recs.size() == 1);
  CHECK(recs[0]["id"] == "bom");
  CHECK(recs[0]["completion_tokens"] == 2);
}

TEST_CASE("batch: -o naming the input (also through a link) is refused before the model loads") {
  const std::string dir = temp_dir();
  const std::string in = dir + "/in.jsonl", request = R"({"id":"a","prompt":"Hi"})" "\n";
  std::ofstream(in) << request;
  std::filesystem::create_symlink(in, dir + "/sym.jsonl");
  std::filesystem::create_hard_link(in, dir + "/hard.jsonl");
  for (const std::string& out : std::vector<std::string>{in, dir + "/sym.jsonl", dir + "/hard.jsonl"}) {
    for (const char* resume : {"", " --resume"}) {
      // The model does not exist: the refusal comes before it would be loaded.
      const Out o = run_baton("batch -m /nonexistent.gguf -i " + in + " -o " + out + resume);
      INFO(out << resume << "\n" << o.err);
      CHECK(o.code == 1);
      CHECK_THAT(o.err, Catch::Contains("are the same file"));
      CHECK(slurp(in) == request);
    }
  }
  // embed likewise.
  const Out e = run_baton("embed -m /nonexistent.gguf -i " + in + " -o " + dir + "/sym.jsonl");
  CHECK(e.code == 1);
  CHECK_THAT(e.err, Catch::Contains("are the same file"));
  CHECK(slurp(in) == request);
}

TEST_CASE("batch --resume counts only records (a text or an error) as done, not request lines") {
  const std::string m = tiny(), dir = temp_dir();
  std::ofstream(dir + "/in.jsonl") << R"({"id":"a","prompt":"Hi"})" "\n" R"({"id":"b","prompt":"Hello"})" "\n";
  // OUT holds a's request line (copied there by mistake) and b's finished record.
  std::ofstream(dir + "/out.jsonl") << R"({"id":"a","prompt":"Hi"})" "\n"
                                    << R"({"id":"b","text":"done","finish_reason":"length"})" "\n";
  const Out o = run_baton("batch -m " + m + " -t 2 -n 2 --resume -i " + dir + "/in.jsonl -o " + dir + "/out.jsonl");
  INFO(o.err);
  REQUIRE(o.code == 0);
  const auto recs = jsonl(slurp(dir + "/out.jsonl"));
  REQUIRE(recs.size() == 3);
  CHECK(recs[2]["id"] == "a");
  CHECK(recs[2].contains("text"));
}

TEST_CASE("logits: --out and --tokens-out the same file refused; -p excludes --tokens; --out - is stdout") {
  const std::string m = tiny(), dir = temp_dir();
  const std::string f = dir + "/l.bin";
  std::filesystem::create_symlink(f, dir + "/link.bin");
  std::ofstream(f) << "keep";
  for (const std::string& other : std::vector<std::string>{f, dir + "/link.bin"}) {
    const Out o = run_baton("logits -m /nonexistent.gguf -p hi --out " + f + " --tokens-out " + other);
    INFO(o.err);
    CHECK(o.code == 1);
    CHECK_THAT(o.err, Catch::Contains("are the same file"));
    CHECK(slurp(f) == "keep");
  }
  const Out both = run_baton("logits -m " + m + " -p hi --tokens 1 --out " + f);
  CHECK(both.code == 1);
  CHECK_THAT(both.err, Catch::Contains("--prompt excludes --tokens"));

  const Out file = run_baton("logits -m " + m + " --tokens '1 2 3' -t 2 --out " + f);
  REQUIRE(file.code == 0);
  const std::string cwd = std::filesystem::current_path().string();
  const Out out = run_baton("logits -m " + m + " --tokens '1 2 3' -t 2 --out -");
  INFO(out.err);
  REQUIRE(out.code == 0);
  CHECK(out.out == slurp(f));
  CHECK_THAT(out.err, Catch::Contains("-> standard output"));
  CHECK(!std::filesystem::exists(cwd + "/-"));
}

TEST_CASE("chat, piped: an unclosed \"\"\" block at the end is sent with a note; /set names bad settings and values") {
  const std::string m = tiny();
  const Out o = run_baton("chat -m " + m + " -n 2 --temp 0 -t 2",
                          "/stats\nHi\n\"\"\"\nunterminated block\nmore");
  INFO(o.err);
  REQUIRE(o.code == 0);
  CHECK(count_of(o.err, "[prompt ") == 2);  // a stats line per reply: both messages were answered
  CHECK_THAT(o.err, Catch::Contains("the input ended inside a \"\"\" block"));

  const Out s = run_baton("chat -m " + m + " -n 2 -t 2",
                          "/set bogus 3\n/set seed 99999999999999999999999\n/set seed x\n/set top_k 5\n"
                          "/set presence_penalty 0.5\n/set frequency_penalty inf\n/set repeat_penalty 0\n"
                          "/set mirostat 2\n/set mirostat 7\n");
  INFO(s.err);
  CHECK(s.code == 0);
  CHECK_THAT(s.err, Catch::Contains("/set: 'bogus' is not a setting (temp, top_p, top_k, min_p, typical_p, top_n_sigma, "
                                    "xtc_probability, xtc_threshold, mirostat, mirostat_tau, mirostat_eta, repeat_penalty, "
                                    "presence_penalty, frequency_penalty, dry_multiplier, seed, max_tokens"));
  CHECK_THAT(s.err, Catch::Contains("(presence_penalty = 0.5)"));
  CHECK_THAT(s.err, Catch::Contains("/set: frequency_penalty must be a finite number (got inf)"));
  CHECK_THAT(s.err, Catch::Contains("/set: repeat_penalty must be > 0 (got 0)"));
  CHECK_THAT(s.err, Catch::Contains("(mirostat = 2)"));
  CHECK_THAT(s.err, Catch::Contains("/set: mirostat must be 0 (off), 1 or 2 (got 7)"));
  CHECK_THAT(s.err, Catch::Contains("/set seed: 99999999999999999999999 is not allowed"));
  CHECK_THAT(s.err, Catch::Contains("/set seed: 'x' is not a whole number"));
  CHECK_THAT(s.err, Catch::Contains("(top_k = 5)"));
}

namespace {

// `baton ARGS` with its stdin and stdout on pipes the test holds, its stderr in a file. stdout's
// pipe is as small as Linux allows (a page) and starts full of filler, so the first write waits for
// the test to read; read() and the others drop the filler.
struct Child {
  pid_t pid = -1;
  int in = -1, out = -1;  // the test's ends
  std::string err_path;
  size_t filler_ = 0;  // filler bytes not read yet

  explicit Child(const std::vector<std::string>& args) {
    int i[2], o[2];
    REQUIRE(pipe2(i, O_CLOEXEC) == 0);
    REQUIRE(pipe2(o, O_CLOEXEC) == 0);
    const int size = fcntl(o[1], F_SETPIPE_SZ, 4096);
    REQUIRE(size > 0);
    filler_ = size_t(size);
    err_path = temp_dir() + "/stderr";
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      const int e = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(i[0], 0);
      dup2(o[1], 1);
      dup2(e, 2);
      exec_baton(args);
    }
    REQUIRE(::write(o[1], std::string(filler_, '.').data(), filler_) == ssize_t(filler_));
    ::close(i[0]);
    ::close(o[1]);
    in = i[1];
    out = o[0];
  }
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (in >= 0) ::close(in);
    if (out >= 0) ::close(out);
  }
  // Waits (up to 60 s) until the main thread sits in a write to stdout (syscall 1 on fd 1) behind
  // the full pipe, with nothing of that write taken yet, for 100 ms.
  bool wait_blocked() {
    for (int i = 0, same = 0; i < 6000; i++) {
      const std::string call = slurp("/proc/" + std::to_string(pid) + "/syscall");
      same = call.rfind("1 0x1 ", 0) == 0 ? same + 1 : 0;
      if (same == 10) return true;
      usleep(10000);
    }
    return false;
  }

  // Ctrl-C, then time for the handler to run before the test reads: a write that finds room when
  // it wakes finishes as if nothing happened, and would hide a write cut by the press.
  void interrupt_blocked() {
    kill(pid, SIGINT);
    usleep(300000);
  }
  // A read of stdout past the filler.
  ssize_t take(char* buf, size_t size) {
    for (;;) {
      const ssize_t n = ::read(out, buf, size);
      if (n <= 0 || filler_ == 0) return n;
      const size_t drop = std::min(filler_, size_t(n));
      filler_ -= drop;
      std::memmove(buf, buf + drop, size_t(n) - drop);
      if (size_t(n) > drop) return n - ssize_t(drop);
    }
  }
  void send(const std::string& s) { REQUIRE(::write(in, s.data(), s.size()) == ssize_t(s.size())); }
  std::string err() const { return slurp(err_path); }
  // stdout until its end, or until stderr says `what` when given (up to 60 s).
  std::string read(const std::string& what = "") {
    std::string got;
    for (auto t0 = std::chrono::steady_clock::now(); std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60);) {
      if (!what.empty() && err().find(what) != std::string::npos) break;
      pollfd p{out, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      char buf[4096];
      const ssize_t n = take(buf, sizeof buf);
      if (n <= 0) break;
      got.append(buf, size_t(n));
    }
    return got;
  }
  // What stdout has until it stays quiet for 300 ms.
  std::string read_quiet() {
    std::string got;
    char buf[4096];
    for (pollfd p{out, POLLIN, 0}; poll(&p, 1, 300) > 0;) {
      const ssize_t n = take(buf, sizeof buf);
      if (n <= 0) break;
      got.append(buf, size_t(n));
    }
    return got;
  }
  int wait() {
    int st = 0;
    waitpid(pid, &st, 0);
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
};

}  // namespace

// SIGINT is installed with SA_RESTART so a write that waits for the reader is not cut by Ctrl-C
// (stdio would mark stdout failed and the command end with "Interrupted system call", exit 2). CI
// once saw it on a terminal: a press that landed while chat was printing.
TEST_CASE("Ctrl-C while a write to stdout waits for the reader: the output goes on, the reply stops") {
  const std::string m = tiny();
  {
    Child run({"run", "-m", m, "-p", "hi", "-n", "2000", "--ignore-eos", "-t", "2"});
    ::close(run.in);
    run.in = -1;
    REQUIRE(run.wait_blocked());
    run.interrupt_blocked();
    const std::string out = run.read();
    const int code = run.wait();
    INFO(run.err());
    CHECK(code == 130);  // Ctrl-C's exit, not a failed write's 2
    CHECK(!out.empty());
    CHECK(run.err().find("failed") == std::string::npos);
  }
  {
    // Piped chat: the press stops the reply being written; the next message is answered in full.
    Child chat({"chat", "-m", m, "-n", "2000", "--ignore-eos", "-t", "2", "--temp", "0"});
    chat.send("Hi\n");
    REQUIRE(chat.wait_blocked());
    chat.interrupt_blocked();
    std::string first = chat.read("[interrupted]");
    CHECK(!first.empty());
    // The answer's end: the blank line, printed after the press was dealt with, then nothing more.
    auto ended = [&] { return first.size() >= 2 && first.compare(first.size() - 2, 2, "\n\n") == 0; };
    for (int i = 0; i < 200; i++) {
      const std::string more = chat.read_quiet();
      first += more;
      if (more.empty() && ended()) break;
    }
    // A press while chat waits for the next message (stdin open, nothing in it) is answered at once,
    // on stderr: stdout has answers only.
    kill(chat.pid, SIGINT);
    CHECK(chat.read("to leave").empty());
    CHECK_THAT(chat.err(), Catch::Contains("(to leave, type /exit or press Ctrl-D)"));
    chat.send("/reset\nHi\n");  // the same prompt again, from the start: the same reply, now whole
    ::close(chat.in);
    chat.in = -1;
    const std::string second = chat.read();
    const int code = chat.wait();
    INFO(chat.err());
    CHECK(code == 0);
    CHECK(count_of(chat.err(), "[interrupted]") == 1);  // the second reply ran to its end
    REQUIRE(first.size() > 2);
    CHECK(second.size() > first.size());
    CHECK(second.rfind(first.substr(0, first.size() - 2), 0) == 0);  // less the blank line that ended it
  }
}

TEST_CASE("an output file that names the model is refused before anything is written") {
  const std::string dir = temp_dir(), m = dir + "/m.gguf", link = dir + "/link.gguf";
  std::filesystem::copy_file(tiny(), m);
  std::filesystem::create_symlink(m, link);
  const std::string model = slurp(m);
  std::ofstream(dir + "/in.jsonl") << "{\"prompt\": \"hi\"}\n";
  std::string text;
  for (int i = 0; i < 200; i++) text += "the quick brown fox jumps over the lazy dog. ";
  std::ofstream(dir + "/t.txt") << text;
  const std::string t = " -t 2 -n 2";
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"batch -m " + m + " -i " + dir + "/in.jsonl -o " + m + t, "-o " + m + " is the model file"},
           {"batch -m " + m + " -i " + dir + "/in.jsonl -o " + link + t, "-o " + link + " is the model file"},
           {"batch -m " + dir + "/other.gguf --draft-model " + m + " -i " + dir + "/in.jsonl -o " + m + t,
            "is the draft model file"},
           {"embed -m " + m + " -p hi -o " + m + " -t 2", "-o " + m + " is the model file"},
           {"logits -m " + m + " -p hi -t 2 --out " + m, "--out " + m + " is the model file"},
           {"logits -m " + m + " -p hi -t 2 --out /dev/null --tokens-out " + link, "--tokens-out " + link + " is the model"},
           {"perplexity -m " + m + " -f " + dir + "/t.txt -c 64 --chunks 1 -t 2 --save-base " + m, "--save-base " + m + " is"},
           {"perplexity -m " + m + " -f " + dir + "/t.txt -c 64 --chunks 1 -t 2 --save-base " + dir + "/t.txt",
            "are the same file: the base would overwrite the text"}}) {
    const Out o = run_baton(args);
    INFO(args << "\n" << o.err);
    CHECK(o.code == 1);
    CHECK_THAT(o.err, Catch::Contains(says));
  }
  CHECK(slurp(dir + "/t.txt") == text);
  // chat's /save says so and goes on: both messages answered, the model intact.
  const Out chat = run_baton("chat -m " + m + t, "hi\n/save " + link + "\nhi again\n");
  INFO(chat.err);
  CHECK(chat.code == 0);
  CHECK_THAT(chat.err, Catch::Contains("/save: " + link + " is the model file"));
  CHECK(count_of(chat.out, "\n\n") >= 2);
  CHECK(slurp(m) == model);
}

TEST_CASE("batch: a run that fails before it starts leaves an earlier output; -o a directory with --resume") {
  const std::string dir = temp_dir(), prev = dir + "/prev.jsonl";
  std::ofstream(dir + "/in.jsonl") << "{\"prompt\": \"hi\"}\n";
  std::ofstream(dir + "/bad.gguf") << "GGUF" << std::string(5000, 'x');
  const std::string earlier = "{\"id\": 1, \"text\": \"an earlier answer\"}\n";
  for (const std::string& args : {"-m " + dir + "/bad.gguf", "-m " + tiny() + " --devices cpu=1KiB"}) {
    std::ofstream(prev) << earlier;
    const Out o = run_baton("batch " + args + " -t 2 -n 2 -i " + dir + "/in.jsonl -o " + prev);
    INFO(args << "\n" << o.err);
    CHECK(o.code >= 2);
    CHECK(slurp(prev) == earlier);
  }
  // Once the model is loaded the output starts over.
  const Out ok = run_baton("batch -m " + tiny() + " -t 2 -n 2 -i " + dir + "/in.jsonl -o " + prev);
  CHECK(ok.code == 0);
  CHECK(jsonl(slurp(prev)).size() == 1);
  CHECK(slurp(prev).find("earlier") == std::string::npos);

  std::filesystem::create_directory(dir + "/outdir");
  const Out d = run_baton("batch -m " + tiny() + " -t 2 -n 2 -i " + dir + "/in.jsonl --resume -o " + dir + "/outdir");
  INFO(d.err);
  CHECK(d.code == 2);
  CHECK_THAT(d.err, Catch::Contains("-o " + dir + "/outdir is a directory"));
  CHECK(d.err.find("basic_filebuf") == std::string::npos);
}

TEST_CASE("batch: a line without an id whose line number is another line's id is told so") {
  const std::string dir = temp_dir();
  std::ofstream(dir + "/c.jsonl") << "{\"id\": 3, \"prompt\": \"first\"}\n{\"prompt\": \"second\"}\n{\"prompt\": \"third\"}\n";
  const Out o = run_baton("batch -m " + tiny() + " -t 2 -n 2 -i " + dir + "/c.jsonl -o -");
  INFO(o.err);
  CHECK(o.code == 0);
  const auto recs = jsonl(o.out);
  REQUIRE(recs.size() == 3);
  int texts = 0;
  for (const auto& r : recs) {
    if (r.contains("text")) texts++;
    if (r.contains("error")) {
      CHECK(r["line"] == 3);
      CHECK_THAT(r["error"].get<std::string>(), Catch::Contains("no id and its line number 3 is line 1's id"));
    }
  }
  CHECK(texts == 2);
}

TEST_CASE("chat: /load of a directory and /save to a full disk say why, and the chat goes on") {
  const std::string dir = temp_dir();
  const Out o = run_baton("chat -m " + tiny() + " -t 2 -n 2", "/load " + dir + "\n/save /dev/full\nhi\n");
  INFO(o.err);
  CHECK(o.code == 0);
  CHECK_THAT(o.err, Catch::Contains("/load: '" + dir + "' is a directory"));
  CHECK_THAT(o.err, Catch::Contains("/save: writing /dev/full failed: No space left on device"));
  CHECK(o.err.find("saved") == std::string::npos);
  CHECK(count_of(o.out, "\n\n") >= 1);  // "hi" was answered
}

TEST_CASE("a vocabulary-only GGUF is named as such, not as hundreds of missing tensors") {
  const std::string v = peer("tokenizer/ggml-vocab-llama-spm.gguf");
  const Out o = run_baton("run -m " + v + " -p hi -t 2");
  INFO(o.err);
  CHECK(o.code == 2);
  CHECK_THAT(o.err, Catch::Contains("the file has no tensors (a vocabulary-only GGUF?)"));
  CHECK(count_lines(o.err) == 1);
  CHECK(run_baton("tokenize -m " + v + " -p hi").code == 0);  // what such a file is for
}

TEST_CASE("chat: a message longer than the context says to shorten it, and the next one is answered") {
  std::string longer;
  for (int i = 0; i < 100; i++) longer += "many words here ";
  const Out o = run_baton("chat -m " + tiny() + " --ctx 64 -t 2 -n 2", longer + "\nhi\n");
  INFO(o.err);
  CHECK(o.code == 0);
  CHECK_THAT(o.err, Catch::Contains("the context holds 64: shorten it, or start with a larger --ctx"));
  CHECK(o.err.find("/reset") == std::string::npos);  // it would not help
  CHECK(count_of(o.out, "\n\n") >= 1);               // "hi" was answered
}

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitizer = true;
#else
constexpr bool kSanitizer = false;
#endif
#else
constexpr bool kSanitizer = false;
#endif

}  // namespace

TEST_CASE("threads the system cannot start are a usage error that says so; the ones started are stopped first") {
  // A sanitizer's runtime reserves terabytes of address space and cannot start under the limit.
  if (kSanitizer) return;
  // Thread limits vary, and root ignores RLIMIT_NPROC; but each thread's stack is a mapping of
  // RLIMIT_STACK bytes. With 2 GiB stacks in a 3 GiB address space the first worker of the pool
  // starts and the second cannot (the program and the tiny model take well under 1 GiB): the
  // pool is left half started, which crashed in the worker that had started.
  const Out o = run_command("bash -c 'ulimit -s 2097152 && ulimit -v 3145728 && exec " + std::string(BATON_BINARY) +
                          " run -m " + tiny() + " -p hi -n 2 -t 3 --devices cpu'");
  INFO(o.err);
  CHECK(o.code == 1);
  CHECK_THAT(o.err, Catch::StartsWith("error: cannot start 3 CPU threads: ") && Catch::Contains("(use fewer --threads)"));
  CHECK(count_lines(o.err) == 1);
  CHECK(o.out.empty());
  // Two stages of one thread each: no pool threads, but a driver thread per stage, the second of
  // which cannot start (that aborted: a joinable thread destroyed as the constructor unwound).
  const Out s = run_command("bash -c 'ulimit -s 2097152 && ulimit -v 3145728 && exec " + std::string(BATON_BINARY) +
                          " run -m " + tiny() + " -p hi -n 2 -t 2 --devices cpu,cpu'");
  INFO(s.err);
  CHECK(s.code == 1);
  CHECK_THAT(s.err, Catch::StartsWith("error: cannot start the pipeline's 2 stage threads: "));
  CHECK(count_lines(s.err) == 1);
}

TEST_CASE("work cut over threads of its own: a thread that cannot start is a usage error, the ones started joined") {
  if (kSanitizer) return;
  // As above, 2 GiB stacks: in 3 GiB one thread starts besides the main one. synth writes a
  // tensor's rows on a thread per core, the main one included (it started a thread per core, the
  // second of which failed, and the first, joinable, ended the program: exit 134).
  const std::string dir = temp_dir();
  const Out s = run_command("bash -c 'ulimit -s 2097152 && ulimit -v 3145728 && exec " + std::string(BATON_BINARY) +
                            " synth --arch llama --n-embd 64 --n-layer 1 --n-head 2 --n-ff 128 --n-vocab 300 --type Q8_0"
                            " --out " + dir + "/s.gguf'");
  INFO(s.err);
  if (s.code == 0) {  // one thread besides the main one was all it needed (two cores)
    CHECK(std::filesystem::file_size(dir + "/s.gguf") > 0);
  } else {
    CHECK(s.code == 1);
    CHECK_THAT(s.err, Catch::Contains("error: cannot start ") && Catch::Contains(" CPU threads: "));
  }
  // In 9.5 GiB four start: the pool's two workers and the stage's driver (-t 3), then one of the
  // two more that perplexity's scoring and bench's bandwidth probe ask for besides the main one.
  std::string text;
  for (int i = 0; i < 200; i++) text += "the quick brown fox jumps over the lazy dog. ";
  std::ofstream(dir + "/t.txt") << text;
  for (const std::string& args : {"perplexity -m " + tiny() + " -f " + dir + "/t.txt -c 64 --chunks 1 -t 3",
                                  "bench -m " + tiny() + " -p 0 -n 1 -r 1 -t 3"}) {
    const Out o = run_command("bash -c 'ulimit -s 2097152 && ulimit -v 9961472 && exec " + std::string(BATON_BINARY) +
                              " " + args + "'");
    INFO(args << "\n" << o.err);
    CHECK(o.code == 1);
    CHECK_THAT(o.err, Catch::Contains("error: cannot start 3 CPU threads: ") && Catch::Contains("(use fewer --threads)"));
    CHECK(count_of(o.err, "error:") == 1);
  }
}

TEST_CASE("a stage's threads that cannot start: the error counts the threads asked for, not the stage's share") {
  if (kSanitizer) return;
  // 2 GiB stacks in 3 GiB: the first stage's pool starts its worker, the second's cannot. It said
  // "cannot start 2 CPU threads" of -t 4.
  const std::string limit = "bash -c 'ulimit -s 2097152 && ulimit -v 3145728 && exec " + std::string(BATON_BINARY) +
                            " run -m " + tiny() + " -p hi -n 2 --devices cpu,cpu ";
  const Out o = run_command(limit + "-t 4'");
  INFO(o.err);
  CHECK(o.code == 1);
  CHECK_THAT(o.err, Catch::StartsWith("error: cannot start 4 CPU threads (2 per stage): ") &&
                        Catch::Contains("(use fewer --threads)"));
  CHECK(count_lines(o.err) == 1);
  const Out p = run_command(limit + "--threads-per-stage 2'");
  INFO(p.err);
  CHECK(p.code == 1);
  CHECK_THAT(p.err, Catch::StartsWith("error: cannot start 2 CPU threads per stage: ") &&
                        Catch::Contains("(use fewer --threads-per-stage)"));
}

TEST_CASE("an empty output path is a usage error naming its flag, in every command that writes one") {
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"batch -m x -i a -o ''", "error: --output: the path is empty"},
           {"embed -m x -p a -o ''", "error: --output: the path is empty"},
           {"logits -m x -p a --out ''", "error: --out: the path is empty"},
           {"logits -m x -p a --out f --tokens-out ''", "error: --tokens-out: the path is empty"},
           {"perplexity -m x -f y --save-base ''", "error: --save-base: the path is empty"},
           {"perplexity -m x -f y --kl-base ''", "error: --kl-base: the path is empty"},  // (an input: '' was none)
           {"synth --shape smollm2-135m --type Q8_0 --out ''", "error: --out: the path is empty"}}) {
    const Out o = run_baton(args);
    INFO(args << "\n" << o.err);
    CHECK(o.code == 1);
    CHECK_THAT(o.err, Catch::StartsWith(says));
    CHECK(count_lines(o.err) == 1);
  }
}

TEST_CASE("devices: an empty --devices list, an empty entry and a size written with an exponent are usage errors saying so") {
  const std::string m = tiny();
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"plan -m " + m + " --devices ''", "error: --devices: the device list is empty"},
           {"run -m " + m + " -p hi -t 2 --devices ''", "error: --devices: the device list is empty"},  // (was: the CPU)
           {"run -m " + m + " -p hi -t 2 --draft-model " + m + " --draft-devices ''",
            "error: --draft-devices: the device list is empty"},
           {"plan -m " + m + " --devices cpu,", "error: --devices 'cpu,' has an empty entry"},  // (was: cpu)
           {"run -m " + m + " -p hi -t 2 --devices 'cpu, '", "error: --devices 'cpu,' has an empty entry"},
           {"plan -m " + m + " --devices cpu=1e30GiB", "error: budget of device 'cpu' '1e30GiB' is not a valid size (no "
                                                       "exponents)"},  // (was: unknown unit)
           {"plan -m " + m + " --devices cpu=99999999999GiB", "error: budget of device 'cpu' '99999999999GiB' is not a "
                                                              "valid size (too large)"}}) {
    const Out o = run_baton(args);
    INFO(args << "\n" << o.err);
    CHECK(o.code == 1);
    CHECK_THAT(o.err, Catch::StartsWith(says));
    CHECK(count_lines(o.err) == 1);
    CHECK(o.out.empty());
  }
}

TEST_CASE("seeds: chat's /set seed -1 is a random seed each reply, as --seed -1; synth refuses negative seeds") {
  const Out o = run_baton("chat -m " + tiny() + " -n 2 -t 2 --seed 5", "/set seed -1\n/stats\nhi\nhi\n/set seed -5\n");
  INFO(o.err);
  REQUIRE(o.code == 0);
  CHECK_THAT(o.err, Catch::Contains("(seed = -1: a random one each reply"));
  CHECK_THAT(o.err, Catch::Contains("/set seed: -5 is not allowed (must be 0 to 18446744073709551615, or -1: random)"));
  // Each reply's stats line: a seed drawn afresh (at most 2^32-1), not -1 wrapped to 2^64-1.
  std::vector<uint64_t> seeds;
  for (size_t at = o.err.find("| seed "); at != std::string::npos; at = o.err.find("| seed ", at + 1))
    seeds.push_back(std::stoull(o.err.substr(at + 7)));
  REQUIRE(seeds.size() == 2);
  for (uint64_t x : seeds) CHECK(x <= 0xffffffffull);
  // synth: its seed makes the file, and leaving it out is 0, so -1 is no "random" there.
  for (const char* seed : {"-1", "-5"}) {
    const Out s = run_baton("synth --shape smollm2-135m --type Q8_0 --out " + temp_dir() + "/x.gguf --seed " + seed);
    INFO(s.err);
    CHECK(s.code == 1);
    CHECK_THAT(s.err, Catch::StartsWith(std::string("error: --seed: ") + seed + " is not allowed (must be 0 to "
                                        "18446744073709551615: the weights follow from the seed)"));
  }
  CHECK_THAT(run_baton("synth --shape smollm2-135m --type Q8_0 --out x --seed abc").err,
             Catch::StartsWith("error: --seed: 'abc' is not a whole number"));
}

TEST_CASE("cpu-moe: --cpu-moe on a model without experts warns on one line, and the command runs") {
  const Out o = run_baton("run -m " + tiny() + " -p hi -n 2 -t 2 --devices cpu --cpu-moe");
  INFO(o.err);
  CHECK(o.code == 0);
  CHECK(count_of(o.err, "warning: --cpu-moe does nothing: the model has no experts") == 1);
  const Out p = run_baton("plan -m " + tiny() + " --devices cpu --cpu-moe");
  CHECK(p.code == 0);
  CHECK_THAT(p.out, Catch::Contains("warning: --cpu-moe does nothing"));
  // A mixture: no warning, its experts go to host memory.
  const Out moe = run_baton("plan --shape granite-3-1b-a400m --devices cpu --cpu-moe");
  INFO(moe.out << moe.err);
  CHECK(moe.code == 0);
  CHECK(moe.out.find("--cpu-moe does nothing") == std::string::npos);
  CHECK_THAT(moe.out, Catch::Contains("of experts in host memory"));
}

TEST_CASE("a FIFO as the model file is refused at once (exit 2) naming it, not waited on for a writer") {
  const std::string fifo = temp_dir() + "/model.gguf";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  for (const std::string& args : {"run -m " + fifo + " -p hi -t 2", "inspect " + fifo}) {
    // Through timeout(1): opening a FIFO for reading waits for a writer, and a regression must fail
    // this test (exit 124) rather than hang the test run.
    const Out o = run_command("timeout 20 " + std::string(BATON_BINARY) + " " + args);
    INFO(args << "\n" << o.err);
    CHECK(o.code == 2);
    CHECK_THAT(o.err, Catch::Contains("'" + fifo + "' is not a regular file"));
    CHECK(count_lines(o.err) == 1);
  }
}

TEST_CASE("help and plan: negated flags show no default, plan's counts state their rule") {
  for (const char* cmd : {"bench --help", "devices --help"}) {
    const Out h = run_baton(cmd);
    CHECK(h.code == 0);
    CHECK_THAT(h.out, !Catch::Contains("{false}"));
  }
  const Out p = run_baton("plan --shape smollm2-135m --devices cpu --parallel -1");
  CHECK(p.code == 1);
  CHECK_THAT(p.err, Catch::Contains("--parallel: -1 is not allowed (must be at least 1)"));
  CHECK_THAT(run_baton("plan --shape smollm2-135m --devices cpu --batch 0").err,
             Catch::Contains("--batch: 0 is not allowed (must be at least 1)"));
  CHECK_THAT(run_baton("synth --n-embd 64 --n-layer -2 --n-head 2 --n-ff 128 --n-vocab 300 --type F32 --out x").err,
             Catch::Contains("--n-layer: -2 is not allowed (must be at least 1)"));
  const Out run_help = run_baton("run --help");
  for (const char* shown : {"-b,--batch-size INT:>= 1=512", "--kv-type TEXT:{f16,q8_0}=f16", "-n,--max-tokens INT=-1"})
    CHECK_THAT(run_help.out, Catch::Contains(shown));
}
