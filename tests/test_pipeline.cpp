// Pipeline stages on the CPU: 1, 2 and 3 stages (and pipelined micro-batches of several
// sequences) must give the same logits bit for bit; a plan that does not fit is refused before
// anything is loaded; every stage holds no more than the planner set aside for it. The engine on
// real stages: prompt lookup, shared prompt starts, a draft model (at the end).
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>

#include <nlohmann/json.hpp>

#include "cli_helpers.h"
#include "helpers.h"
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "model_helpers.h"
#include "runtime/devices.h"
#include "runtime/buffers.h"
#include "runtime/draft_model.h"
#include "runtime/engine.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/packed.h"
#include "runtime/pipeline.h"
#include "runtime/synth.h"
#include "runtime/tokenizer.h"

using namespace baton;

namespace {


LoadOptions options(const std::string& devices, int n_seq = 1) {
  LoadOptions o;
  o.n_ctx = 128;
  o.n_seq = n_seq;
  o.n_batch = 64;
  o.n_threads = 2;
  o.devices = devices;
  return o;
}

std::unique_ptr<Pipeline> load(const std::string& path, const std::string& devices, int n_seq = 1) {
  return test::load_pipeline(path, devices, n_seq, 128, 64);
}

// Logits of the prompt in one batch (every row), then of the prompt token by token.
std::vector<float> run_prompt(Pipeline& p, const std::vector<int32_t>& ids) {
  const size_t V = size_t(p.n_vocab());
  std::vector<float> out(2 * ids.size() * V);
  Batch b;
  for (size_t i = 0; i < ids.size(); ++i) b.add(ids[i], int(i), 0, true);
  p.decode(b, out.data());
  p.truncate_seq(0, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    Batch one;
    one.add(ids[i], int(i), 0, true);
    p.decode(one, out.data() + (ids.size() + i) * V);
  }
  return out;
}

void check_memory(const Pipeline& p, size_t n_stages) {
  const auto st = p.stages();
  REQUIRE(st.size() == n_stages);
  for (const auto& s : st) {
    INFO("stage " << s.device << " layers [" << s.layer_begin << ", " << s.layer_end << ")");
    CHECK(s.measured_bytes > 0);
    CHECK(s.planned_bytes >= s.measured_bytes);
    const uint64_t slack = std::max<uint64_t>(s.planned_bytes * 3 / 100, uint64_t(64) << 20);
    CHECK(s.planned_bytes - s.measured_bytes <= slack);
  }
  // Every layer exactly once, in order.
  for (size_t k = 1; k < st.size(); ++k) CHECK(st[k].layer_begin == st[k - 1].layer_end);
  CHECK(st.front().layer_begin == 0);
}

void same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  CHECK(differ == 0);
}

void stages_agree(const std::string& path, const std::vector<int32_t>& ids) {
  auto one = load(path, "cpu");
  check_memory(*one, 1);
  const auto ref = run_prompt(*one, ids);
  // The two halves (batch, token by token) are different computations of the same logits.
  bool any_nonzero = false;
  for (float v : ref) any_nonzero |= v != 0.f;
  REQUIRE(any_nonzero);
  for (const char* devices : {"cpu,cpu", "cpu,cpu,cpu"}) {
    INFO("devices " << devices);
    const size_t n = std::string(devices) == "cpu,cpu" ? 2 : 3;
    auto p = load(path, devices);
    check_memory(*p, n);
    same_bits(ref, run_prompt(*p, ids));
  }
}

// Several sequences of different lengths in one batch, then a decode step for all of them.
std::vector<float> run_multi(Pipeline& p, int n_seq, int vocab) {
  Batch b;
  for (int s = 0; s < n_seq; ++s)
    for (int i = 0; i < 3 + s; ++i) b.add((7 + 31 * s + 13 * i) % vocab, i, s, i == 2 + s || i == 0);
  std::vector<float> out(size_t(b.n_logits() + n_seq) * size_t(p.n_vocab()));
  p.decode(b, out.data());
  Batch step;
  for (int s = n_seq - 1; s >= 0; --s) step.add((5 + 17 * s) % vocab, 3 + s, s, true);  // reversed order
  p.decode(step, out.data() + size_t(b.n_logits()) * size_t(p.n_vocab()));
  return out;
}

}  // namespace

TEST_CASE("1, 2 and 3 CPU stages give the same logits on the peer tiny model", "[pipeline]") {
  stages_agree(test::peer("logits/tiny-q4_0.gguf"), test::read_ids(test::peer("logits/tiny-q4_0.P1.tokens.txt")));
}

TEST_CASE("1, 2 and 3 CPU stages give the same logits on a generated model", "[pipeline]") {
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((3 + 37 * i) % 1000);  // past the window of 16
  stages_agree(test::tiny_gemma3_model(), ids);
}

TEST_CASE("a mixture of experts in 1, 2 and 3 CPU stages: the same logits, memory as planned, --cpu-moe too",
          "[pipeline]") {
  std::vector<int32_t> ids;
  for (int i = 0; i < 20; ++i) ids.push_back((3 + 37 * i) % 1000);
  stages_agree(test::tiny_qwen3moe_model(), ids);
  for (const char* devices : {"cpu", "cpu,cpu"})  // (the shared expert and its gate matrix counted)
    check_memory(*load(test::tiny_qwen2moe_model(), devices), std::string(devices) == "cpu" ? 1 : 2);
  // --cpu-moe on the CPU alone: the experts are charged apart from the stages, which do not count them.
  const std::string path = test::tiny_qwen3moe_model();
  LoadOptions o = options("cpu,cpu", 1);
  auto plain = Pipeline::load(path, o);
  o.cpu_moe = true;
  auto apart = Pipeline::load(path, o);
  check_memory(*apart, 2);
  uint64_t planned = 0, plain_planned = 0;
  for (const auto& st : apart->stages()) planned += st.planned_bytes;
  for (const auto& st : plain->stages()) plain_planned += st.planned_bytes;
  CHECK(planned < plain_planned);
  same_bits(run_prompt(*plain, ids), run_prompt(*apart, ids));
}

TEST_CASE("pipelined micro-batches of six sequences equal one stage", "[pipeline]") {
  for (const std::string& path : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_gemma3_model()}) {
    INFO(path);
    auto one = load(path, "cpu", 6);
    const auto ref = run_multi(*one, 6, one->n_vocab());
    for (const char* devices : {"cpu,cpu", "cpu,cpu,cpu"}) {
      INFO("devices " << devices);
      auto p = load(path, devices, 6);
      same_bits(ref, run_multi(*p, 6, p->n_vocab()));
      for (int s = 0; s < 6; ++s) CHECK(p->seq_len(s) == 4 + s);
    }
  }
}

TEST_CASE("argmax-only and top-k rows hold what the full rows reduce to, in 1, 2 and 3 stages", "[pipeline]") {
  const std::string path = test::tiny_gemma3_model();
  for (const char* devices : {"cpu", "cpu,cpu", "cpu,cpu,cpu"}) {
    INFO("devices " << devices);
    auto p = load(path, devices, 4);
    const int V = p->n_vocab();
    // The same four prompts twice: full rows, then (caches emptied) the rows in turn argmax-only,
    // top-k candidates and full.
    auto make = [&](bool reduce) {
      Batch b;
      const LogitsMode cycle[3] = {kArgmaxOnly, kTopK, kLogitsRow};
      for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 5; ++i) {
          const bool out = i == 4 || i == 1;
          b.add((11 + 29 * s + 7 * i) % V, i, s, uint8_t(!out ? kNoLogits : reduce ? cycle[(2 * s + i) % 3] : kLogitsRow));
        }
      return b;
    };
    const Batch full = make(false), mixed = make(true);
    REQUIRE(full.n_logits() == 8);
    REQUIRE(mixed.n_logits() == 8);
    std::vector<float> a(size_t(8) * size_t(V)), b(a.size());
    p->decode(full, a.data());
    for (int s = 0; s < 4; ++s) p->truncate_seq(s, 0);
    p->decode(mixed, b.data());
    int n_mode[4] = {};
    for (size_t t = 0, r = 0; t < size_t(mixed.size()); ++t) {
      if (mixed.logits[t] == kNoLogits) continue;
      test::check_output_row(mixed.logits[t], a.data() + r * size_t(V), b.data() + r * size_t(V), V);
      n_mode[mixed.logits[t]]++;
      ++r;
    }
    CHECK(n_mode[kArgmaxOnly] >= 2);
    CHECK(n_mode[kTopK] >= 2);
    CHECK(n_mode[kLogitsRow] >= 2);
  }
}

TEST_CASE("a batch asking more output rows than the pipeline holds goes in several forwards: the same rows", "[pipeline]") {
  const std::string path = test::tiny_gemma3_model();
  for (const char* devices : {"cpu", "cpu,cpu"}) {
    INFO("devices " << devices);
    auto all = Pipeline::load(path, options(devices, 4));
    LoadOptions o = options(devices, 4);
    o.n_outputs = 3;
    std::atomic<int> pieces{0}, most{0};  // on_stage runs on every stage's driver thread
    o.on_stage = [&](int k, const Batch& piece) {
      pieces += k == 0;
      for (int m = most.load(); piece.n_logits() > m && !most.compare_exchange_weak(m, piece.n_logits());) {}
    };
    auto few = Pipeline::load(path, o);
    // Four prompts of 6 tokens with rows at positions 0, 3 and 5 (every mode): 12 rows.
    const int V = all->n_vocab();
    Batch b;
    const LogitsMode cycle[3] = {kArgmaxOnly, kTopK, kLogitsRow};
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 6; ++i)
        b.add((11 + 29 * s + 7 * i) % V, i, s, uint8_t(i % 3 == 0 || i == 5 ? cycle[(s + i) % 3] : kNoLogits));
    REQUIRE(b.n_logits() == 12);
    std::vector<float> want(size_t(12) * size_t(V)), got(want.size());
    all->decode(b, want.data());
    few->decode(b, got.data());
    CHECK(most.load() == 3);
    CHECK(pieces.load() >= 4);
    same_bits(want, got);
    // The last stage holds 3 rows of logits, not 64, and no more than planned.
    check_memory(*few, std::string(devices) == "cpu" ? 1 : 2);
    CHECK(all->stages().back().measured_bytes - few->stages().back().measured_bytes == uint64_t(64 - 3) * uint64_t(V) * 4);
  }
}

// Kibibytes of `path`'s mapping resident in this process (/proc/self/smaps); -1 without procfs.
long mapped_rss_kib(const std::string& path) {
  std::ifstream in("/proc/self/smaps");
  if (!in) return -1;
  const std::string real = std::filesystem::canonical(path).string();
  long kib = 0;
  bool ours = false;
  for (std::string line; std::getline(in, line);) {
    if (line.find('-') < line.find(' ') && line.find(':') > line.find(' ')) {  // a mapping's header line
      ours = line.size() >= real.size() && line.compare(line.size() - real.size(), real.size(), real) == 0;
    } else if (ours && line.rfind("Rss:", 0) == 0) {
      kib += std::stol(line.substr(4));
    }
  }
  return kib;
}

TEST_CASE("the file's pages of packed weights are given back: the packed copies are what stays resident", "[pipeline]") {
  // Q8_0 matrices of 256 and 1024 (large beside the norms between them, which share their edge pages).
  const std::string path = test::synth_q8_model(
      {"rss-llama", "llama", "test", 2, 256, 4, 2, 64, 1024, 1000, 2048, false, 0, 0, 1e4f, 1e-5f, false}, 3);
  if (!cpu::packing_enabled(GgmlType::Q8_0)) {
    WARN("this CPU keeps Q8_0 unpacked: nothing to give back");
    return;
  }
  const long file_kib = long(std::filesystem::file_size(path) / 1024);
  for (const char* devices : {"cpu", "cpu,cpu"}) {
    INFO("devices " << devices);
    auto p = load(path, devices);
    Batch b;
    for (int i = 0; i < 8; ++i) b.add((3 + 11 * i) % p->n_vocab(), i, 0, i == 7);
    std::vector<float> out(size_t(p->n_vocab()));
    p->decode(b, out.data());
    const long kib = mapped_rss_kib(path);
    if (kib < 0) {
      WARN("no /proc/self/smaps");
      return;
    }
    // Loading read every page; what is mapped now is the header, the norms and the tokens' rows.
    INFO(kib << " KiB of the file's " << file_kib << " KiB resident");
    CHECK(kib < file_kib / 8);
  }
  // Matrices of a type this CPU does not pack are read from the mapping at every step: loading
  // leaves them mapped (giving them back would only make the first prompt fault them in again).
  if (cpu::packing_enabled(GgmlType::F16)) return;
  const std::string f16 = test::synth_model(
      {"rss-llama-f16", "llama", "test", 2, 256, 4, 2, 64, 1024, 1000, 2048, false, 0, 0, 1e4f, 1e-5f, false}, 3,
      GgmlType::F16);
  auto p = load(f16, "cpu");
  const long kib = mapped_rss_kib(f16), f16_kib = long(std::filesystem::file_size(f16) / 1024);
  INFO(kib << " KiB of the F16 file's " << f16_kib << " KiB resident");
  CHECK(kib > f16_kib * 3 / 4);
}

TEST_CASE("a bad batch is refused naming the problem, and leaves the sequences as they were", "[pipeline]") {
  using Catch::Matchers::Equals;
  for (const char* devices : {"cpu", "cpu,cpu"}) {  // two stages: decode() splits by sequence first
    INFO("devices " << devices);
    auto p = load(test::peer("logits/tiny-q4_0.gguf"), devices, 2);
    const int V = p->n_vocab();
    std::vector<float> logits(size_t(200) * size_t(V));
    Batch first;
    first.add(1, 0, 0, true);
    p->decode(first, logits.data());
    // Each bad batch also holds a valid token of the other sequence.
    auto with = [](std::initializer_list<std::array<int, 3>> toks) {  // token, pos, seq
      Batch b;
      for (const auto& t : toks) b.add(t[0], t[1], t[2], true);
      return b;
    };
    Batch long_seq1;
    for (int i = 0; i <= 128; ++i) long_seq1.add(5, i, 1, false);
    Batch ragged = with({{5, 1, 0}, {5, 0, 1}});
    ragged.pos.pop_back();
    const std::vector<std::pair<Batch, std::string>> bad = {
        {with({{5, 1, 0}, {-1, 0, 1}}), "token id -1 is outside the vocabulary (0.." + std::to_string(V - 1) + ")"},
        {with({{5, 1, 0}, {V, 0, 1}}), "token id " + std::to_string(V) + " is outside the vocabulary (0.." + std::to_string(V - 1) + ")"},
        {with({{5, 1, 0}, {5, 0, 2}}), "sequence 2 does not exist (n_seq = 2)"},
        {with({{5, 0, 1}, {5, 0, 0}}), "sequence 0: token at position 0 does not continue the cache (expected position 1)"},
        {long_seq1, "sequence 1: position 128 is past the context length 128"},
        {ragged, "batch arrays differ in length"},
    };
    for (const auto& [b, message] : bad) {
      INFO(message);
      CHECK_THROWS_WITH(p->decode(b, logits.data()), Equals(message));
      CHECK_THROWS_WITH(p->submit(b, logits.data()), Equals(message));
      CHECK(p->seq_len(0) == 1);
      CHECK(p->seq_len(1) == 0);
    }
    p->decode(with({{5, 1, 0}, {5, 0, 1}}), logits.data());  // still usable
    CHECK(p->seq_len(0) == 2);
    CHECK(p->seq_len(1) == 1);
  }
}

TEST_CASE("the threads per stage do not change the logits", "[pipeline]") {
  const std::string path = test::peer("logits/tiny-q4_0.gguf");
  const auto ids = test::read_ids(test::peer("logits/tiny-q4_0.P1.tokens.txt"));
  auto a = load(path, "cpu,cpu");
  LoadOptions o = options("cpu,cpu");
  o.n_threads = 0;
  o.threads_per_stage = 3;
  auto b = Pipeline::load(path, o);
  for (const auto& s : b->stages()) CHECK(s.n_threads == 3);
  for (const auto& s : a->stages()) CHECK(s.n_threads == 1);
  same_bits(run_prompt(*a, ids), run_prompt(*b, ids));
}

TEST_CASE("a tensor split cuts the layers as asked, the logits stay the same, and stages report their work", "[pipeline]") {
  const std::string path = test::peer("logits/tiny-q4_0.gguf");
  const auto ids = test::read_ids(test::peer("logits/tiny-q4_0.P1.tokens.txt"));
  auto a = load(path, "cpu");
  LoadOptions o = options("cpu,cpu");
  o.tensor_split = {1, 3};
  auto b = Pipeline::load(path, o);
  const auto st = b->stages();
  REQUIRE(st.size() == 2);
  const int L = st[1].layer_end;
  CHECK(st[0].layer_end == (L + 2) / 4);  // a quarter of the layers, rounded as the planner rounds
  for (const auto& s : st) CHECK(s.busy_s == 0);
  same_bits(run_prompt(*a, ids), run_prompt(*b, ids));
  for (const auto& s : b->stages()) CHECK(s.busy_s > 0);  // both worked, and their time was counted
}

TEST_CASE("a verbose load prints the plan and what each stage holds", "[pipeline]") {
  // --verbose once dereferenced the per-stage timers before they existed (a crash at load).
  LoadOptions o = options("cpu,cpu");
  o.verbose = true;
  auto p = Pipeline::load(test::peer("logits/tiny-q4_0.gguf"), o);
  const auto st = p->stages();
  REQUIRE(st.size() == 2);
  CHECK(st[0].link == "host memory");
  CHECK(st[1].link.empty());
}

TEST_CASE("a budget that is too small is refused before loading", "[pipeline]") {
  const std::string path = test::peer("logits/tiny-q4_0.gguf");
  try {
    load(path, "cpu=1MiB,cpu=1MiB");
    FAIL("loaded with 2 MiB");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::OutOfMemory);
    CHECK(std::string(e.what()).find("short by") != std::string::npos);
  }
}

TEST_CASE("CUDA stages are refused with a clear message", "[pipeline]") {
  // Only where no GPU is visible (on a GPU, or the CUDA simulator, tests/test_cuda_stage loads them).
  for (const ProbedDevice& d : probe_devices())
    if (d.kind == DeviceKind::Cuda) return;
  try {
    load(test::peer("logits/tiny-q4_0.gguf"), "cuda:0,cpu");
    FAIL("loaded a CUDA stage");
  } catch (const Error& e) {
    CHECK((e.kind() == ErrorKind::Usage));
    CHECK(std::string(e.what()).find("cuda") != std::string::npos);
  }
}

namespace {

// Three batches: two sets of prompts, then the next chunk of sequence 0 next to a new prompt.
std::vector<Batch> three_batches(int vocab) {
  std::vector<Batch> out(3);
  auto prompt = [&](Batch& b, int s, int from, int n) {
    for (int i = from; i < from + n; ++i) b.add((11 + 29 * s + 7 * i) % vocab, i, s, i == from + n - 1 || i % 3 == 0);
  };
  prompt(out[0], 0, 0, 5);
  prompt(out[0], 1, 0, 6);
  prompt(out[1], 2, 0, 4);
  prompt(out[1], 3, 0, 7);
  prompt(out[2], 0, 5, 3);  // continues sequence 0, whose first chunk may still be in flight
  prompt(out[2], 4, 0, 2);
  return out;
}

}  // namespace

TEST_CASE("batches in flight together give the logits of one batch at a time", "[pipeline]") {
  const std::string path = test::peer("logits/tiny-q4_0.gguf");
  auto one = load(path, "cpu", 6);
  const auto batches = three_batches(one->n_vocab());
  const size_t V = size_t(one->n_vocab());
  std::vector<std::vector<float>> ref(3);
  for (size_t i = 0; i < 3; ++i) {
    ref[i].resize(size_t(batches[i].n_logits()) * V);
    one->decode(batches[i], ref[i].data());
  }
  for (const char* devices : {"cpu", "cpu,cpu", "cpu,cpu,cpu"}) {
    INFO("devices " << devices);
    auto p = load(path, devices, 6);
    CHECK(p->max_in_flight() == int(p->stages().size()));
    std::vector<std::vector<float>> got(3);
    std::vector<uint64_t> tickets;
    for (size_t i = 0; i < 3; ++i) {
      got[i].assign(size_t(batches[i].n_logits()) * V, -1.f);
      tickets.push_back(p->submit(batches[i], got[i].data()));
    }
    CHECK(p->seq_len(0) == 8);  // positions count what was submitted
    for (size_t i : {2, 0, 1}) p->wait(tickets[i]);  // any order
    for (size_t i = 0; i < 3; ++i) same_bits(ref[i], got[i]);
    CHECK_THROWS_AS(p->wait(tickets[0]), Error);  // each ticket once
  }
}

TEST_CASE("stage 0 works on the next batch while stage 1 finishes the previous one", "[pipeline]") {
  std::mutex mu;
  std::condition_variable cv;
  int stage0_pieces = 0;
  bool overlapped = false;
  LoadOptions o;
  o.n_ctx = 64;
  o.n_seq = 2;
  o.n_threads = 2;
  o.devices = "cpu,cpu";
  // Stage 1 holds its first piece until stage 0 has started the second one: a pipeline that
  // ran one batch at a time through all stages would never get there (and the wait times out).
  o.on_stage = [&](int stage, const Batch&) {
    std::unique_lock<std::mutex> lock(mu);
    if (stage == 0) {
      ++stage0_pieces;
      cv.notify_all();
    } else if (!overlapped) {
      overlapped = cv.wait_for(lock, std::chrono::seconds(20), [&] { return stage0_pieces >= 2; });
    }
  };
  auto p = Pipeline::load(test::peer("logits/tiny-q4_0.gguf"), o);
  Batch a, b;
  a.add(5, 0, 0, true);
  b.add(6, 0, 1, true);
  std::vector<float> la(size_t(p->n_vocab())), lb(size_t(p->n_vocab()));
  const uint64_t ta = p->submit(a, la.data()), tb = p->submit(b, lb.data());
  p->wait(ta);
  p->wait(tb);
  CHECK(overlapped);
}

TEST_CASE("an error in a stage reaches wait() and the pipeline keeps working", "[pipeline]") {
  const std::string path = test::peer("logits/tiny-q4_0.gguf");
  for (int bad_stage : {0, 1, 2}) {
    INFO("failing stage " << bad_stage);
    LoadOptions o;
    o.n_ctx = 64;
    o.n_seq = 4;
    o.n_threads = 3;
    o.devices = "cpu,cpu,cpu";
    o.on_stage = [bad_stage](int stage, const Batch& piece) {
      if (stage == bad_stage && piece.seq[0] == 1) fail(ErrorKind::Model, "injected failure in stage {}", stage);
    };
    auto p = Pipeline::load(path, o);
    auto ref = load(path, "cpu", 4);
    const size_t V = size_t(p->n_vocab());
    std::vector<Batch> b(3);
    for (int s = 0; s < 3; ++s) b[size_t(s)].add(3 + s, 0, s, true);
    std::vector<float> got(3 * V), want(3 * V);
    std::vector<uint64_t> t;
    for (size_t i = 0; i < 3; ++i) t.push_back(p->submit(b[i], got.data() + i * V));
    p->wait(t[0]);
    try {
      p->wait(t[1]);
      FAIL("no error from the failing stage");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("injected failure in stage " + std::to_string(bad_stage)) != std::string::npos);
    }
    p->wait(t[2]);
    for (size_t i : {0, 2}) {
      ref->decode(b[i], want.data() + i * V);
      CHECK(std::memcmp(got.data() + i * V, want.data() + i * V, V * sizeof(float)) == 0);
    }
    // Later batches still run; decode() reports the error too.
    Batch next;
    next.add(9, 0, 3, true);
    std::vector<float> l(V), lr(V);
    p->decode(next, l.data());
    ref->decode(next, lr.data());
    CHECK(std::memcmp(l.data(), lr.data(), V * sizeof(float)) == 0);
    p->truncate_seq(1, 0);
    CHECK_THROWS_AS(p->decode(b[1], l.data()), Error);
  }
}

TEST_CASE("the engine's outputs are the same with 1, 2 and 3 stages for 16 sequences", "[pipeline]") {
  const std::string path = test::peer("logits/tiny-q4_0.gguf");
  const auto ids = test::read_ids(test::peer("logits/tiny-q4_0.P1.tokens.txt"));
  auto run = [&](const char* devices) {
    auto p = load(path, devices, 16);
    auto vocab = tokenizer_vocab(p->tokenizer());
    EngineOptions eo;
    eo.prefill_chunk = 24;
    Engine e(*p, *vocab, eo);
    std::vector<Request> reqs;
    for (int i = 0; i < 20; ++i) {
      Request r;
      for (size_t k = 0; k < 3 + size_t(i * 7) % ids.size(); ++k) r.prompt.push_back(ids[(k + size_t(i)) % ids.size()]);
      r.sampling.temperature = 0.8f;
      r.sampling.seed = 100 + uint64_t(i);
      r.max_tokens = 6 + i % 7;
      r.tag = uint64_t(i);
      reqs.push_back(std::move(r));
    }
    std::map<uint64_t, Result> out;
    size_t next = 0;
    e.run([&]() -> std::optional<Request> {
            if (next == reqs.size()) return std::nullopt;
            return std::move(reqs[next++]);
          },
          [&](Result&& r) { out[r.tag] = std::move(r); }, 16);
    return out;
  };
  const auto ref = run("cpu");
  REQUIRE(ref.size() == 20);
  size_t generated = 0;
  for (const auto& [tag, r] : ref) generated += r.tokens.size();
  CHECK(generated > 20);
  for (const char* devices : {"cpu,cpu", "cpu,cpu,cpu"}) {
    INFO("devices " << devices);
    const auto got = run(devices);
    REQUIRE(got.size() == 20);
    for (const auto& [tag, r] : ref) {
      INFO("request " << tag);
      CHECK(r.error.empty());
      CHECK(got.at(tag).tokens == r.tokens);
      CHECK(got.at(tag).finish == r.finish);
    }
  }
}

TEST_CASE("a model with sliding-window layers rewinds kRingRewind positions; new prompts in a used slot start over") {
  CHECK(load(test::peer("logits/tiny-q4_0.gguf"), "cpu")->max_rewind() == std::numeric_limits<int>::max());
  for (const char* devices : {"cpu", "cpu,cpu"}) {
    auto p = load(test::tiny_gemma3_model(), devices);
    CHECK(p->max_rewind() == int(kRingRewind));
    auto vocab = tokenizer_vocab(p->tokenizer());
    Engine e(*p, *vocab);
    // Requests sharing a prefix through one slot, as batch requests share the chat template's
    // start: each is answered, and as a fresh pipeline answers it.
    for (int i = 0; i < 3; ++i) {
      Request r;
      r.prompt = {5, 6, 7, 8, 9, int32_t(10 + i)};
      r.max_tokens = 6;
      r.sampling.temperature = 0;
      const Result got = e.generate(r);
      REQUIRE(got.error.empty());
      auto fresh_p = load(test::tiny_gemma3_model(), devices);
      Engine fresh(*fresh_p, *vocab);
      CHECK(fresh.generate(r).tokens == got.tokens);
    }
  }
}

TEST_CASE("a mixture of experts gives a token the same logits alone and in a batch", "[pipeline]") {
  // A token's experts are summed in one order whether its step has one token (the decode path)
  // or many (the experts-grouped path): the bits must not depend on the batch around it.
  for (const std::string& model : {test::tiny_qwen3moe_model(), test::tiny_qwen2moe_model(), test::tiny_gpt_oss_model()}) {
    INFO(model);
    auto alone = load(model, "cpu", 4), batched = load(model, "cpu", 4);
    const size_t V = size_t(alone->n_vocab());
    int differ = 0;
    for (int pos = 0; pos < 6; ++pos) {
      Batch one, many;
      one.add(11 + 13 * pos, pos, 0, true);
      for (int sq = 0; sq < 4; ++sq) many.add(11 + 13 * pos + 101 * sq, pos, sq, true);
      std::vector<float> a(V), m(4 * V);
      alone->decode(one, a.data());
      batched->decode(many, m.data());
      differ += std::memcmp(a.data(), m.data(), V * sizeof(float)) != 0;
    }
    CHECK(differ == 0);
  }
}

TEST_CASE("prompt lookup on real stages: the same tokens as without drafts, rings and experts included",
          "[pipeline]") {
  // What makes the drafts exact: a row's logits do not depend on the rows evaluated with it (the
  // kernels' column invariance), so the drafted step's rows are the ones single steps would give.
  for (const std::string& model : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_gemma3_model(),
                                   test::tiny_qwen3moe_model()}) {
    for (const char* devices : {"cpu", "cpu,cpu"}) {
      INFO(model << " on " << devices);
      auto p = load(model, devices, 2);
      auto vocab = tokenizer_vocab(p->tokenizer());
      std::vector<Request> reqs;
      for (int i = 0; i < 4; ++i) {
        Request r;
        for (int rep = 0; rep < 3; ++rep)
          for (int k = 0; k < 6; ++k) r.prompt.push_back(int32_t(20 + 7 * k + i));
        r.max_tokens = 40;
        r.sampling.temperature = i % 2 ? 0.9f : 0.0f;
        r.sampling.seed = uint64_t(i);
        r.tag = uint64_t(i);
        reqs.push_back(r);
      }
      EngineOptions drafts;
      drafts.lookup = 6;
      const auto ref = test::run_requests(*p, *vocab, reqs, {}, 2), got = test::run_requests(*p, *vocab, reqs, drafts, 2);
      int drafted = 0, kept = 0;
      for (const auto& [tag, r] : ref) {
        INFO("request " << tag);
        CHECK(got.at(tag).tokens == r.tokens);
        drafted += got.at(tag).drafted;
        kept += got.at(tag).draft_accepted;
      }
      CHECK(kept > 0);  // (the random models fall into loops the drafts follow)
      CHECK(kept < drafted);
    }
  }
}

TEST_CASE("a sequence copied from another gives the same logits bit for bit, rings included", "[pipeline]") {
  for (const std::string& model : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_gemma3_model()}) {
    for (const char* devices : {"cpu", "cpu,cpu"}) {
      INFO(model << " on " << devices);
      auto p = load(model, devices, 3);
      CHECK(test::seq_copy_max_diff(*p, 28, 19) == 0.0f);
      // A source longer than a ring holds is refused, naming it.
      if (p->copy_limit() < p->n_ctx()) {
        Batch b;
        for (int i = 0; i <= p->copy_limit(); ++i) b.add(5, i, 0, false);
        p->truncate_seq(0, 0);
        p->decode(b, nullptr);
        Batch c;
        c.copies.push_back({0, 1, 4});
        c.add(5, 4, 1, true);
        std::vector<float> row(size_t(p->n_vocab()));
        CHECK_THROWS_WITH(p->decode(c, row.data()), Catch::Contains("more than its sliding-window rings keep"));
      }
    }
  }
}

TEST_CASE("requests sharing a prompt start through real stages: evaluated once, the same replies", "[pipeline]") {
  for (const std::string& model : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_gemma3_model()}) {
    for (const char* devices : {"cpu", "cpu,cpu"}) {
      INFO(model << " on " << devices);
      auto p = load(model, devices, 3);
      auto vocab = tokenizer_vocab(p->tokenizer());
      std::vector<Request> reqs;
      for (int i = 0; i < 6; ++i) {
        Request r;
        for (int k = 0; k < 20; ++k) r.prompt.push_back(int32_t(30 + 11 * k));  // the shared start
        r.prompt.push_back(int32_t(500 + i));
        r.max_tokens = 8;
        r.sampling.temperature = i % 2 ? 0.9f : 0.0f;
        r.sampling.seed = uint64_t(i);
        r.tag = uint64_t(i);
        reqs.push_back(r);
      }
      EngineOptions no_copies;
      no_copies.share_prefixes = false;
      const auto ref = test::run_requests(*p, *vocab, reqs, no_copies, 3), got = test::run_requests(*p, *vocab, reqs, {}, 3);
      int evaluated = 0, evaluated_ref = 0;
      for (const auto& [tag, r] : ref) {
        INFO("request " << tag);
        CHECK(got.at(tag).tokens == r.tokens);
        evaluated_ref += r.prompt_evaluated;
        evaluated += got.at(tag).prompt_evaluated;
      }
      CHECK(evaluated_ref == 6 + 3 * 20);  // each slot once
      CHECK(evaluated == 6 + 20);          // once in all
    }
  }
}

// Speculative decoding with a draft model (runtime/draft_model.h, `--draft-model`): the replies are
// the target's alone, greedy and sampled, on one stage or two and with sliding-window rings; a
// draft model that is the target itself has every greedy guess kept; the draft cache keeps what it
// shares with the next history; vocabularies that differ are refused, naming how.
namespace {

std::vector<Request> draft_requests() {
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

std::map<uint64_t, Result> run_drafted(Pipeline& p, const std::vector<Request>& reqs, const EngineOptions& opt,
                                       int parallel) {
  return test::run_requests(p, *tokenizer_vocab(p.tokenizer()), reqs, opt, parallel);
}

EngineOptions with_draft(const std::string& draft_path, const Pipeline& target, int max_len) {
  EngineOptions o;
  o.lookup = max_len;
  o.drafter = std::make_shared<ModelDrafter>(test::load_pipeline(draft_path, "cpu", target.n_seq(), target.n_ctx()),
                                              target.n_vocab());
  return o;
}

}  // namespace

TEST_CASE("a draft model's guesses are checked by the model: its replies, greedy and sampled, one stage or two") {
  const std::string target = test::tiny_model_of(GgmlType::Q8_0);
  const std::string twin = test::tiny_model_of(GgmlType::Q4_0);  // the same weights, rounded to 4 bits
  const auto reqs = draft_requests();
  for (const char* devices : {"cpu", "cpu,cpu"}) {
    INFO("target on " << devices);
    auto p = load(target, devices, 2);
    const auto ref = run_drafted(*p, reqs, {}, 2);
    {
      INFO("draft: the Q4_0 twin");
      const auto got = run_drafted(*p, reqs, with_draft(twin, *p, 6), 2);
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
      const auto got = run_drafted(*p, reqs, with_draft(target, *p, 6), 2);
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
  const auto reqs = draft_requests();
  const auto ref = run_drafted(*p, reqs, {}, 2);
  const auto got = run_drafted(*p, reqs, with_draft(model, *p, 8), 2);
  for (const auto& [tag, r] : ref) {
    INFO("request " << tag);
    CHECK(got.at(tag).tokens == r.tokens);
  }
}

TEST_CASE("the draft cache keeps what the next history shares with it and evaluates only the rest") {
  const std::string model = test::tiny_model_of(GgmlType::Q8_0);
  ModelDrafter d(test::load_pipeline(model, "cpu", 1, 128), 1 << 20);
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

  // --draft-devices: the draft on its own devices, the reply unchanged; without a draft model, or
  // on a device that is not there, a usage error naming it.
  const test::Out cpu = run_baton(common + " --draft-model " + twin + " --draft-max 4 --draft-devices cpu --verbose --json");
  CHECK(cpu.code == 0);
  CHECK_THAT(cpu.err, Catch::Contains("draft model " + twin + " on cpu"));
  if (cpu.code == 0) CHECK(nlohmann::json::parse(cpu.out)["text"] == ja["text"]);
  const test::Out alone = run_baton(common + " --draft-devices cpu");
  CHECK(alone.code == 1);
  CHECK_THAT(alone.err, Catch::Contains("--draft-devices cpu needs --draft-model"));
  const test::Out missing = run_baton(common + " --draft-model " + twin + " --draft-devices cuda:9");
  CHECK(missing.code == 1);
  CHECK_THAT(missing.err, Catch::Contains("--draft-devices cuda:9: ") && Catch::Contains("'cuda:9'"));
  // With the host emulation's GPU (a CPU build; BATON_CUDA_EMULATE): the model on the CPU, its draft on cuda:0.
#if BATON_CUDA_HOST_EMULATION
  setenv("BATON_CUDA_EMULATE", "1", 1);
  const test::Out gpu = run_baton(common + " --devices cpu --draft-model " + twin + " --draft-max 4 --draft-devices cuda:0 --verbose --json");
  unsetenv("BATON_CUDA_EMULATE");
  CHECK(gpu.code == 0);
  CHECK_THAT(gpu.err, Catch::Contains("draft model " + twin + " on cuda:0"));
  if (gpu.code == 0) CHECK(nlohmann::json::parse(gpu.out)["text"] == ja["text"]);
#endif
}
