// The GPU stage (runtime/gpu_stage.cpp) on the host emulation of the CUDA ops
// (kernels/cuda_host/ops_host.cpp) against the CPU stage, on llama, Qwen2 (q/k/v bias) and
// Gemma 3 shapes (sliding-window rings, q/k norms, post-norms, GELU, tied head): two prompts in
// one batch, then decode steps of both sequences together, past Gemma's window; two GPU stages
// against one; a GPU stage feeding a CPU stage. Runs in the CPU build (BATON_CUDA_EMULATE=1 makes
// the emulation show one device); builds with real CUDA have no emulation and skip.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "helpers.h"
#include "model_helpers.h"

#if BATON_CUDA_HOST_EMULATION
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "kernels/cuda/ops.h"
#include "runtime/gpu_stage.h"
#include "runtime/pipeline.h"
#include "runtime/shape.h"
#include "runtime/stage.h"
#include "runtime/synth.h"

using namespace baton;

namespace {

struct Model {
  std::unique_ptr<gguf::File> file;
  ModelConfig cfg;
  explicit Model(const std::string& path) : file(gguf::File::open(path)), cfg(ModelConfig::from_gguf(*file)) {}
};

// A generated model of `shape` in a fresh temporary folder.
std::string synth(const ShapePreset& shape, GgmlType type) {
  SynthOptions o;
  o.type = type;
  o.seed = 11;
  const std::string p = test::temp_dir() + "/" + shape.name + ".gguf";
  synth_write(shape, o, p);
  return p;
}

// Beside the peer tiny model (llama, head size 32, Q4_0), generated models with head size 64: llama
// with Q4_0 weights, Qwen2 (q/k/v bias) with k-quants; and test::tiny_gemma3_model() (window 16,
// every 6th layer global, Q8_0).
const std::string& tiny_llama() {
  static const std::string p = synth({"tiny-llama", "llama", "test", 4, 256, 4, 2, 64, 768, 2000, 2048, false, 0, 0,
                                      10000.f, 1e-5f, false}, GgmlType::Q4_0);
  return p;
}
const std::string& tiny_qwen2() {
  static const std::string p = synth({"tiny-qwen2", "qwen2", "test", 3, 256, 4, 1, 64, 512, 1500, 2048, false, 0, 0,
                                      1e6f, 1e-6f, true}, GgmlType::Q4_K);
  return p;
}

constexpr int kCtx = 128, kSteps = 20;

StageOptions options(GgmlType kv) {
  StageOptions o;
  o.n_seq = 2;
  o.n_ctx = kCtx;
  o.n_batch = 64;
  o.kv_type = kv;
  o.n_threads = 2;
  return o;
}

Stage block(const ModelConfig& c, int begin, int end, const char* label) {
  Stage s;
  s.label = label;
  s.layer_begin = uint32_t(begin);
  s.layer_end = uint32_t(end);
  s.has_embedding = begin == 0;
  s.has_output = end == c.n_layer;
  return s;
}

using Chain = std::vector<std::unique_ptr<ModelStage>>;

// Stages over [0, cut) and [cut, n_layer) on the devices named ("cpu" or "gpu"); cut 0: one stage.
Chain chain(const Model& m, GgmlType kv, int cut, const char* first, const char* second = nullptr) {
  const int L = m.cfg.n_layer;
  Chain out;
  auto add = [&](const char* dev, int begin, int end) {
    const Stage st = block(m.cfg, begin, end, dev);
    if (std::string(dev) == "gpu") out.push_back(std::make_unique<GpuStage>(*m.file, m.cfg, st, options(kv), 0));
    else out.push_back(std::make_unique<CpuStage>(*m.file, m.cfg, st, options(kv)));
  };
  if (cut == 0) {
    add(first, 0, L);
  } else {
    add(first, 0, cut);
    add(second, cut, L);
  }
  return out;
}

// The logits rows of one batch through the stages in order (the hidden state on the host between).
std::vector<float> forward(Chain& stages, const ModelConfig& c, const Batch& b) {
  std::vector<float> x(size_t(b.size()) * size_t(c.n_embd)), logits(size_t(b.n_logits()) * size_t(c.n_vocab));
  for (auto& s : stages) s->forward(b, x.data(), logits.data());
  return logits;
}

struct Run {
  std::vector<float> logits;  // every logits row, in order
  std::vector<int32_t> fed;   // the decode tokens, two per step
};

int32_t argmax_row(const float* row, int V) { return int32_t(std::max_element(row, row + V) - row); }

// Two prompts in one batch (sequence 0: 40 tokens, sequence 1: 9, each contiguous, every row
// wanting logits), then kSteps decode steps of both sequences together. The decode tokens are
// `fed` when given, so that every run sees the same tokens, else each sequence's argmax.
Run run(Chain& stages, const ModelConfig& c, const std::vector<int32_t>* fed = nullptr) {
  const int V = c.n_vocab;
  Run r;
  Batch b;
  for (int i = 0; i < 40; ++i) b.add((3 + 7 * i) % V, i, 0, true);
  for (int i = 0; i < 9; ++i) b.add((11 + 5 * i) % V, i, 1, true);
  r.logits = forward(stages, c, b);
  int32_t next[2] = {argmax_row(r.logits.data() + 39 * size_t(V), V), argmax_row(r.logits.data() + 48 * size_t(V), V)};
  int len[2] = {40, 9};
  for (int step = 0; step < kSteps; ++step) {
    Batch d;
    for (int s = 0; s < 2; ++s) {
      const int32_t t = fed ? (*fed)[size_t(2 * step + s)] : next[s];
      r.fed.push_back(t);
      d.add(t, len[s]++, s, true);
    }
    const auto rows = forward(stages, c, d);
    r.logits.insert(r.logits.end(), rows.begin(), rows.end());
    for (int s = 0; s < 2; ++s) next[s] = argmax_row(rows.data() + size_t(s) * size_t(V), V);
  }
  return r;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::isnan(a[i] - b[i]) ? INFINITY : double(std::fabs(a[i] - b[i])));
  return m;
}

std::string name_of(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

// Before anything touches a device: the emulation shows one only when asked.
[[maybe_unused]] const bool kEmulate = [] { return setenv("BATON_CUDA_EMULATE", "1", 1) == 0; }();

}  // namespace

TEST_CASE("the emulation shows a device only with BATON_CUDA_EMULATE=1") {
  REQUIRE(cuda::device_count() == 1);
  unsetenv("BATON_CUDA_EMULATE");
  CHECK(cuda::device_count() == 0);
  int kind = 0;
  try {
    cuda::Context c(0);
  } catch (const Error& e) {
    kind = int(e.kind());
  }
  CHECK(kind == int(ErrorKind::Usage));
  setenv("BATON_CUDA_EMULATE", "1", 1);
  CHECK_THROWS_AS(cuda::Context(1), Error);
  CHECK_NOTHROW(cuda::Context(0));
}

TEST_CASE("the pipeline still refuses cuda devices in this build, emulated or not") {
  REQUIRE(cuda::device_count() == 1);
  LoadOptions o;
  o.n_ctx = 64;
  o.devices = "cuda:0";
  int kind = 0;
  try {
    Pipeline::load(test::tiny_gemma3_model(), o);
  } catch (const Error& e) {
    kind = int(e.kind());
  }
  CHECK(kind == int(ErrorKind::Usage));
}

TEST_CASE("a GPU stage refuses a head size the CUDA attention does not take") {
  const Model m(synth({"tiny-hd80", "llama", "test", 1, 160, 2, 2, 80, 256, 500, 2048, false, 0, 0, 10000.f, 1e-5f,
                       false}, GgmlType::Q8_0));
  REQUIRE(m.cfg.head_dim_k == 80);
  int kind = 0;
  try {
    GpuStage g(*m.file, m.cfg, block(m.cfg, 0, m.cfg.n_layer, "gpu"), options(GgmlType::F16), 0);
  } catch (const Error& e) {
    kind = int(e.kind());
    INFO(e.what());
    CHECK(std::string(e.what()).find("head") != std::string::npos);
  }
  CHECK(kind == int(ErrorKind::Usage));
}

TEST_CASE("a GPU stage gives the CPU stage's logits (llama, Qwen2 and Gemma 3 shapes; F16 and Q8_0 KV)") {
  for (const std::string& path : {test::peer("logits/tiny-q4_0.gguf"), tiny_llama(), tiny_qwen2(), test::tiny_gemma3_model()}) {
    const Model m(path);
    for (GgmlType kv : {GgmlType::F16, GgmlType::Q8_0}) {
      // The peer model's logits are large (llama.cpp's own bounds are met with an F16 cache, and
      // the GPU's FP16 GEMM and the CPU's 8-bit activations each sit on one side of them): F16 only.
      if (kv == GgmlType::Q8_0 && path == test::peer("logits/tiny-q4_0.gguf")) continue;
      Chain cpu = chain(m, kv, 0, "cpu"), gpu = chain(m, kv, 0, "gpu");
      CHECK(gpu[0]->max_rewind() == cpu[0]->max_rewind());
      const Run ref = run(cpu, m.cfg);
      const Run got = run(gpu, m.cfg, &ref.fed);
      test::check_peer_close(ref.logits, got.logits, m.cfg.n_vocab, name_of(path) + " " + type_name(kv) + " KV, CPU vs GPU");
    }
  }
}

TEST_CASE("two GPU stages give the one-stage logits, and a GPU stage feeding a CPU stage the CPU's") {
  for (const std::string& path : {tiny_llama(), tiny_qwen2(), test::tiny_gemma3_model()}) {
    const Model m(path);
    const int cut = m.cfg.n_layer / 2;
    Chain cpu = chain(m, GgmlType::F16, 0, "cpu");
    const Run ref = run(cpu, m.cfg);
    Chain one = chain(m, GgmlType::F16, 0, "gpu");
    const Run gpu1 = run(one, m.cfg, &ref.fed);
    Chain two = chain(m, GgmlType::F16, cut, "gpu", "gpu");
    const Run gpu2 = run(two, m.cfg, &ref.fed);
    // The same ops on the same rows: a split changes nothing but where the layers run.
    const double d = max_abs_diff(gpu1.logits, gpu2.logits);
    std::printf("%s: 1 vs 2 GPU stages max|d| %.3g\n", name_of(path).c_str(), d);
    CHECK(d <= 1e-4);
    Chain spill = chain(m, GgmlType::F16, cut, "gpu", "cpu");
    test::check_peer_close(ref.logits, run(spill, m.cfg, &ref.fed).logits, m.cfg.n_vocab, name_of(path) + " GPU + CPU vs CPU");
  }
}

TEST_CASE("a GPU stage answers argmax-only rows with the argmax of its full rows") {
  const Model m(tiny_llama());
  const int V = m.cfg.n_vocab;
  Chain one = chain(m, GgmlType::F16, 0, "gpu");
  Batch full, mixed;
  for (int i = 0; i < 12; ++i) {
    const bool out = i % 3 == 2;
    full.add((5 + 9 * i) % V, i, 0, out);
    mixed.add((5 + 9 * i) % V, i, 1, uint8_t(!out ? kNoLogits : i % 2 ? kArgmaxOnly : kLogitsRow));
  }
  const std::vector<float> a = forward(one, m.cfg, full), b = forward(one, m.cfg, mixed);
  int n_argmax = 0;
  for (size_t t = 0, r = 0; t < size_t(mixed.size()); ++t) {
    if (mixed.logits[t] == kNoLogits) continue;
    if (mixed.logits[t] == kArgmaxOnly) {
      CHECK(argmax_token(b.data() + r * size_t(V)) == argmax_row(a.data() + r * size_t(V), V));
      n_argmax++;
    } else {
      CHECK(std::memcmp(a.data() + r * size_t(V), b.data() + r * size_t(V), size_t(V) * sizeof(float)) == 0);
    }
    ++r;
  }
  CHECK(n_argmax == 2);
}

#else  // a build with the real CUDA backend: no emulation to run on

TEST_CASE("GPU stage on the host emulation: skipped") {
  WARN("this build has the CUDA backend, not its host emulation: tests/test_cuda_stage.cpp runs the GPU stage");
}

#endif
