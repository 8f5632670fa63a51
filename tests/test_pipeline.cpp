// Pipeline stages on the CPU: 1, 2 and 3 stages (and pipelined micro-batches of several
// sequences) must give the same logits bit for bit; a plan that does not fit is refused before
// anything is loaded; every stage holds no more than the planner set aside for it.
#include <cstring>
#include <fstream>

#include "helpers.h"
#include "gguf/error.h"
#include "model_helpers.h"
#include "runtime/pipeline.h"
#include "runtime/synth.h"

using namespace baton;

namespace {


std::unique_ptr<Pipeline> load(const std::string& path, const std::string& devices, int n_seq = 1) {
  LoadOptions o;
  o.n_ctx = 128;
  o.n_seq = n_seq;
  o.n_batch = 64;
  o.n_threads = 2;
  o.devices = devices;
  return Pipeline::load(path, o);
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

std::string synth_model() {
  static const std::string path = [] {
    // Gemma 3 family: tied head, sliding-window layers (ring KV), 7 layers to cut three ways.
    const ShapePreset shape{"tiny-gemma3", "gemma3", "test", 7, 64, 2, 1, 64, 256, 1000, 2048, true, 16, 6,
                            1e6f, 1e-6f, false};
    SynthOptions o;
    o.type = GgmlType::Q8_0;
    o.seed = 5;
    const std::string p = test::temp_dir() + "/tiny-gemma3.gguf";
    synth_write(shape, o, p);
    return p;
  }();
  return path;
}

}  // namespace

TEST_CASE("1, 2 and 3 CPU stages give the same logits on the peer tiny model", "[pipeline]") {
  stages_agree(test::peer("logits/tiny-q4_0.gguf"), test::read_ids(test::peer("logits/tiny-q4_0.P1.tokens.txt")));
}

TEST_CASE("1, 2 and 3 CPU stages give the same logits on a generated model", "[pipeline]") {
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((3 + 37 * i) % 1000);  // past the window of 16
  stages_agree(synth_model(), ids);
}

TEST_CASE("pipelined micro-batches of six sequences equal one stage", "[pipeline]") {
  for (const std::string& path : {test::peer("logits/tiny-q4_0.gguf"), synth_model()}) {
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

TEST_CASE("the threads per stage do not change the logits", "[pipeline]") {
  const std::string path = test::peer("logits/tiny-q4_0.gguf");
  const auto ids = test::read_ids(test::peer("logits/tiny-q4_0.P1.tokens.txt"));
  auto a = load(path, "cpu,cpu");
  LoadOptions o;
  o.n_ctx = 128;
  o.n_batch = 64;
  o.devices = "cpu,cpu";
  o.threads_per_stage = 3;
  auto b = Pipeline::load(path, o);
  for (const auto& s : b->stages()) CHECK(s.n_threads == 3);
  for (const auto& s : a->stages()) CHECK(s.n_threads == 1);
  same_bits(run_prompt(*a, ids), run_prompt(*b, ids));
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
  try {
    load(test::peer("logits/tiny-q4_0.gguf"), "cuda:0,cpu");
    FAIL("loaded a CUDA stage");
  } catch (const Error& e) {
    CHECK((e.kind() == ErrorKind::Usage));
    CHECK(std::string(e.what()).find("cuda") != std::string::npos);
  }
}
