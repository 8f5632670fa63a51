// The GPU stage (runtime/gpu_stage.cpp) on the host emulation of the CUDA ops
// (kernels/cuda_host/ops_host.cpp) against the CPU stage, on llama, Qwen2 (q/k/v bias) and
// Gemma 3 shapes (sliding-window rings, q/k norms, post-norms, GELU, tied head): two prompts in
// one batch, then decode steps of both sequences together, past Gemma's window; two GPU stages
// against one; a GPU stage feeding a CPU stage. Runs in the CPU build (BATON_CUDA_EMULATE=1 makes
// the emulation show one device); builds with real CUDA have no emulation and skip.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "helpers.h"
#include "model_helpers.h"

#if BATON_CUDA_HOST_EMULATION
#include "gguf/error.h"
#include "gguf/gguf.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "runtime/embed.h"
#include "runtime/gpu_stage.h"
#include "runtime/link.h"
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
// with Q4_0 weights, Qwen2 (q/k/v bias) with k-quants, Qwen3 (q/k norms, heads of 128 on a
// 256-wide residual, tied head) with Q6_K; and test::tiny_gemma3_model() (window 16, every 6th layer
// global, Q8_0).
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

const std::string& tiny_qwen3() {
  static const std::string p = synth({"tiny-qwen3", "qwen3", "test", 3, 256, 4, 2, 128, 512, 1500, 2048, true, 0, 0,
                                      1e6f, 1e-6f, false}, GgmlType::Q6_K);
  return p;
}

constexpr int kCtx = 128, kSteps = 20;

StageOptions options(GgmlType kv, bool graphs = true) {
  StageOptions o;
  o.n_seq = 2;
  o.n_ctx = kCtx;
  o.n_batch = 64;
  o.kv_type = kv;
  o.n_threads = 2;
  o.cuda_graphs = graphs;
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

namespace {

// BATON_CUDA_EMULATE=2 (two emulated GPUs) and optionally no peer access, for one test.
struct TwoGpus {
  explicit TwoGpus(bool peer = true) {
    setenv("BATON_CUDA_EMULATE", "2", 1);
    if (!peer) setenv("BATON_CUDA_EMULATE_PEER", "0", 1);
  }
  ~TwoGpus() {
    setenv("BATON_CUDA_EMULATE", "1", 1);
    unsetenv("BATON_CUDA_EMULATE_PEER");
    unsetenv("BATON_P2P");
  }
};

LoadOptions gpu_options(const std::string& devices, const std::string& p2p = "auto") {
  LoadOptions o;
  o.n_ctx = 64;
  o.n_seq = 4;
  o.n_batch = 16;  // prompts of 4 sequences cross the links in several pieces
  o.n_threads = 2;
  o.devices = devices;
  o.p2p = p2p;
  return o;
}

// Prompts of 4 sequences (31 tokens: two pieces of 16), submitted together with three decode
// steps so that several pieces are in the links at once, then waited: every logits row.
std::vector<float> run_links(Pipeline& p) {
  const int V = p.n_vocab();
  std::vector<Batch> batches(4);
  for (int s = 0; s < 4; ++s)
    for (int i = 0; i < 6 + s; ++i) batches[0].add((7 + 31 * s + 13 * i) % V, i, s, i == 5 + s || i % 4 == 0);
  for (int step = 1; step < 4; ++step)
    for (int s = 0; s < 4; ++s) batches[size_t(step)].add((5 + 17 * s + step) % V, 5 + s + step, s, true);
  size_t rows = 0;
  for (const Batch& b : batches) rows += size_t(b.n_logits());
  std::vector<float> out(rows * size_t(V));
  std::vector<uint64_t> tickets;
  size_t at = 0;
  for (const Batch& b : batches) {
    tickets.push_back(p.submit(b, out.data() + at * size_t(V)));
    at += size_t(b.n_logits());
  }
  for (uint64_t t : tickets) p.wait(t);
  return out;
}

std::vector<std::string> links_of(const Pipeline& p) {
  std::vector<std::string> out;
  for (const StageInfo& s : p.stages()) out.push_back(s.link);
  return out;
}

}  // namespace

TEST_CASE("the pipeline runs emulated GPU stages only when the emulation shows GPUs") {
  unsetenv("BATON_CUDA_EMULATE");
  LoadOptions o = gpu_options("cuda:0");
  int kind = 0;
  try {
    Pipeline::load(test::tiny_gemma3_model(), o);
  } catch (const Error& e) {
    kind = int(e.kind());
  }
  CHECK(kind == int(ErrorKind::Usage));
  setenv("BATON_CUDA_EMULATE", "1", 1);
  CHECK_NOTHROW(Pipeline::load(test::tiny_gemma3_model(), o));
}

TEST_CASE("GPU stages hand over peer-to-peer or through pinned host memory with the one-stage logits") {
  TwoGpus gpus;
  for (const std::string& path : {tiny_llama(), test::tiny_gemma3_model()}) {
    INFO(name_of(path));
    auto one = Pipeline::load(path, gpu_options("cuda:0"));
    const std::vector<float> ref = run_links(*one);
    struct Case {
      const char* devices;
      const char* p2p;
      std::vector<std::string> links;
      std::vector<double> split;  // a GPU + CPU list fills the GPUs first: a split gives the CPU layers
    };
    const std::vector<Case> cases = {
        {"cuda:0,cuda:0", "on", {"cuda:0 -> cuda:0, peer-to-peer", ""}},
        {"cuda:0,cuda:0", "off", {"cuda:0 -> cuda:0, host-staged", ""}},
        {"cuda:0,cuda:1", "auto", {"cuda:0 -> cuda:1, peer-to-peer", ""}},
        {"cuda:0,cuda:1", "off", {"cuda:0 -> cuda:1, host-staged", ""}},
        {"cuda:0,cuda:1,cuda:0", "auto", {"cuda:0 -> cuda:1, peer-to-peer", "cuda:1 -> cuda:0, peer-to-peer", ""}},
        {"cuda:0,cuda:1,cpu", "auto", {"cuda:0 -> cuda:1, peer-to-peer", "host memory", ""}, {1, 1, 1}},
        {"cpu,cuda:0,cuda:1", "off", {"host memory", "cuda:0 -> cuda:1, host-staged", ""}, {1, 1, 1}},
    };
    for (const Case& c : cases) {
      INFO(c.devices << " --p2p " << c.p2p);
      LoadOptions o = gpu_options(c.devices, c.p2p);
      o.tensor_split = c.split;
      auto p = Pipeline::load(path, o);
      CHECK(links_of(*p) == c.links);
      for (const StageInfo& st : p->stages()) {  // the links' slots included, where they live
        INFO(st.device << " layers [" << st.layer_begin << ", " << st.layer_end << ")");
        CHECK(st.planned_bytes >= st.measured_bytes);
        CHECK(st.planned_bytes - st.measured_bytes <= std::max<uint64_t>(st.planned_bytes * 3 / 100, uint64_t(64) << 20));
      }
      const std::vector<float> got = run_links(*p);
      REQUIRE(got.size() == ref.size());
      if (std::string(c.devices).find("cpu") == std::string::npos) {
        // The same ops on the same rows, whichever way the rows travel.
        CHECK(std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)) == 0);
      } else {
        test::check_peer_close(ref, got, p->n_vocab(), std::string(c.devices) + ": GPU and CPU stages vs one GPU stage");
      }
    }
    // Output buffers of 3 rows: the batches asking more go in several forwards (the stage checks
    // each holds at most 3), the same rows; the plan and the stage hold 3 rows' buffers.
    for (const char* devices : {"cuda:0", "cuda:0,cuda:1"}) {
      INFO(devices << " --outputs 3");
      LoadOptions o = gpu_options(devices);
      o.n_outputs = 3;
      std::atomic<int> most{0};  // on_stage runs on every stage's driver thread
      o.on_stage = [&](int, const Batch& piece) {
        for (int m = most.load(); piece.n_logits() > m && !most.compare_exchange_weak(m, piece.n_logits());) {}
      };
      auto p = Pipeline::load(path, o);
      const std::vector<float> got = run_links(*p);
      CHECK(most.load() == 3);
      REQUIRE(got.size() == ref.size());
      test::check_peer_close(ref, got, p->n_vocab(), std::string(devices) + " with 3 output rows vs 16");
      const StageInfo last = p->stages().back(), last_ref = one->stages().back();
      CHECK(last.planned_bytes >= last.measured_bytes);
      CHECK(last_ref.measured_bytes - last.measured_bytes >= uint64_t(16 - 3) * uint64_t(p->n_vocab()) * 4);
    }
  }
}

TEST_CASE("a GPU and the CPU: the GPU holds every layer it can; --n-gpu-layers, --reserve and --no-cpu-spill move the cut") {
  const std::string path = tiny_llama();  // 4 layers
  auto stages_of = [&](const LoadOptions& o) {
    std::vector<std::string> out;
    for (const StageInfo& st : Pipeline::load(path, o)->stages())
      out.push_back(st.device + " " + std::to_string(st.layer_begin) + "-" + std::to_string(st.layer_end));
    return out;
  };
  LoadOptions o = gpu_options("cuda:0,cpu");
  CHECK(stages_of(o) == std::vector<std::string>{"cuda:0 0-4"});
  o.n_gpu_layers = 1;
  CHECK(stages_of(o) == std::vector<std::string>{"cuda:0 0-1", "cpu 1-4"});
  o.n_gpu_layers = 0;
  CHECK(stages_of(o) == std::vector<std::string>{"cpu 0-4"});
  o.no_cpu_spill = true;
  CHECK_THROWS_WITH(Pipeline::load(path, o), Catch::Contains("--no-cpu-spill"));
  // A margin that leaves the GPU no room: everything on the CPU; refused when the CPU may not take it.
  o = gpu_options("cuda:0,cpu");
  o.reserve = {uint64_t(1) << 40, 0};
  CHECK(stages_of(o) == std::vector<std::string>{"cpu 0-4"});
  o.no_cpu_spill = true;
  CHECK_THROWS_WITH(Pipeline::load(path, o), Catch::Contains("does not fit"));
}

TEST_CASE("without peer access --p2p auto stages through host memory, --p2p on is refused, BATON_P2P=0 means off") {
  const std::string path = tiny_llama();
  {
    TwoGpus gpus(/*peer=*/false);
    auto p = Pipeline::load(path, gpu_options("cuda:0,cuda:1"));
    CHECK(links_of(*p) == std::vector<std::string>{"cuda:0 -> cuda:1, host-staged", ""});
    // Two stages on one GPU can always copy on the device.
    CHECK(links_of(*Pipeline::load(path, gpu_options("cuda:1,cuda:1")))[0] == "cuda:1 -> cuda:1, peer-to-peer");
    try {
      Pipeline::load(path, gpu_options("cuda:0,cuda:1", "on"));
      FAIL("--p2p on loaded without peer access");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::Usage);
      CHECK(std::string(e.what()).find("cuda:0 and cuda:1") != std::string::npos);
    }
  }
  {
    TwoGpus gpus;
    setenv("BATON_P2P", "0", 1);
    CHECK(links_of(*Pipeline::load(path, gpu_options("cuda:0,cuda:1")))[0] == "cuda:0 -> cuda:1, host-staged");
    // An explicit --p2p on wins over the environment.
    CHECK(links_of(*Pipeline::load(path, gpu_options("cuda:0,cuda:1", "on")))[0] == "cuda:0 -> cuda:1, peer-to-peer");
  }
  CHECK_THROWS_AS(Pipeline::load(path, gpu_options("cuda:0", "sometimes")), Error);
}

TEST_CASE("loading GPU stages reports the file read, then their weights uploaded, in one bar") {
  TwoGpus gpus;
  const std::string path = tiny_llama();
  for (const char* devices : {"cpu", "cuda:0,cuda:1"}) {
    INFO(devices);
    LoadOptions o = gpu_options(devices);
    std::vector<std::pair<uint64_t, uint64_t>> calls;
    o.progress = [&](uint64_t done, uint64_t total) { calls.emplace_back(done, total); };
    auto p = Pipeline::load(path, o);
    REQUIRE(calls.size() >= 2);
    const uint64_t total = calls.front().second, file = p->file().file_size() - p->file().data_offset();
    bool monotonic = true;
    for (size_t i = 0; i < calls.size(); ++i) {
      monotonic &= calls[i].second == total && calls[i].first <= total && (i == 0 || calls[i].first >= calls[i - 1].first);
    }
    CHECK(monotonic);
    CHECK(calls.back().first == total);
    if (std::string(devices) == "cpu") {
      CHECK(total == file);
    } else {
      CHECK(total > file);  // the uploads come after the file's pages
      size_t during_upload = 0;
      for (const auto& c : calls) during_upload += c.first > file && c.first < total;
      CHECK(during_upload >= 10);  // a report per matrix
    }
  }
}

TEST_CASE("a link's self-test catches a path that corrupts the hidden state") {
  TwoGpus gpus;
  cuda::Context a(0), b(1);
  for (LinkKind kind : {LinkKind::Peer, LinkKind::Staged}) {
    GpuLink ok(kind, a, b, 4096);
    CHECK_NOTHROW(ok.self_test());
  }
  GpuLink bad(LinkKind::Staged, a, b, 4096);
  bad.tamper = [](void* slot, size_t bytes) { static_cast<uint8_t*>(slot)[bytes / 2] ^= 0x10; };
  try {
    bad.self_test();
    FAIL("a corrupting link passed its self-test");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("cuda:0 -> cuda:1, host-staged failed its self-test: word 512 of 1024") !=
          std::string::npos);
  }
}

TEST_CASE("pieces that fail between GPU stages give their link slots back") {
  TwoGpus gpus;
  const std::string path = tiny_llama();
  for (int bad_stage : {1, 2}) {
    INFO("failing stage " << bad_stage);
    LoadOptions o = gpu_options("cuda:0,cuda:1,cuda:0");
    o.on_stage = [bad_stage](int stage, const Batch& piece) {
      if (stage == bad_stage && piece.seq[0] == 1) fail(ErrorKind::Model, "injected failure in stage {}", stage);
    };
    auto p = Pipeline::load(path, o);
    const size_t V = size_t(p->n_vocab());
    std::vector<float> l(V);
    // Many more failures than a link has slots: a slot that is not given back would hang here.
    for (int i = 0; i < 12; ++i) {
      Batch b;
      b.add(3 + i, 0, 1, true);
      CHECK_THROWS_AS(p->decode(b, l.data()), Error);
      p->truncate_seq(1, 0);
      std::vector<uint64_t> t;
      std::vector<float> many(3 * V);
      for (int s : {0, 1, 2}) {
        Batch c;
        c.add(5 + i, 0, s, true);
        t.push_back(p->submit(c, many.data() + size_t(s) * V));
      }
      p->wait(t[0]);
      CHECK_THROWS_AS(p->wait(t[1]), Error);
      p->wait(t[2]);
      for (int s : {0, 1, 2}) p->truncate_seq(s, 0);
    }
  }
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

TEST_CASE("a GPU stage gives the CPU stage's logits (llama, Qwen2, Qwen3, Gemma 3, Phi-3, Gemma 2, Qwen3-MoE, Qwen2-MoE, gpt-oss, Granite, OLMo 3, OLMoE, SmolLM3, ERNIE 4.5, EXAONE 4, Gemma 1, GLM-4 shapes, IQ4_XS; F16 and Q8_0 KV)") {
  for (const std::string& path :
       {test::peer("logits/tiny-q4_0.gguf"), tiny_llama(), tiny_qwen2(), tiny_qwen3(), test::tiny_gemma3_model(),
        test::tiny_phi3_model(), test::tiny_gemma2_model(), test::tiny_model_of(GgmlType::IQ4_XS),
        test::tiny_qwen3moe_model(), test::tiny_qwen2moe_model(), test::tiny_gpt_oss_model(), test::tiny_granite_model(),
        test::tiny_olmo3_model(), test::tiny_olmoe_model(), test::tiny_smollm3_model(), test::tiny_ernie4_5_model(),
        test::tiny_exaone4_model(), test::tiny_gemma_model(), test::tiny_glm4_model()}) {
    const Model m(path);
    for (GgmlType kv : {GgmlType::F16, GgmlType::Q8_0}) {
      // The peer model's logits are large (llama.cpp's own bounds are met with an F16 cache, and
      // the GPU's FP16 GEMM and the CPU's 8-bit activations each sit on one side of them): F16 only.
      if (kv == GgmlType::Q8_0 && path == test::peer("logits/tiny-q4_0.gguf")) continue;
      // Families that differ by the layer's structure alone meet the Q8_0 cache's kernels in the
      // others: F16 only (CI time).
      const bool structure_only = path == test::tiny_smollm3_model() || path == test::tiny_ernie4_5_model() ||
                                  path == test::tiny_exaone4_model() || path == test::tiny_gemma_model() ||
                                  path == test::tiny_glm4_model();
      if (kv == GgmlType::Q8_0 && structure_only) continue;
      Chain cpu = chain(m, kv, 0, "cpu"), gpu = chain(m, kv, 0, "gpu");
      CHECK(gpu[0]->max_rewind() == cpu[0]->max_rewind());
      const Run ref = run(cpu, m.cfg);
      const Run got = run(gpu, m.cfg, &ref.fed);
      // Two approximations of the same model, not one against llama.cpp: their 8-bit activation
      // codes come from other float arithmetic and their sums run in another order, and the CPU's
      // order depends on its ISA. So the top-1 must hold only where the gap exceeds 0.25, as in
      // test_cuda_stage (on an AVX2 machine tiny-llama's Q8_0 cache flipped a 0.12-0.15 gap at row
      // 88: logits off by -0.13 and +0.03, within the peer bounds; AVX-512 kept it).
      const std::string what = name_of(path) + " " + type_name(kv) + " KV, CPU vs GPU";
      if (m.cfg.is_moe()) test::check_routed_close(ref.logits, got.logits, m.cfg.n_vocab, what);
      else test::check_peer_close(ref.logits, got.logits, m.cfg.n_vocab, what, 0.25f);
    }
  }
}

// Steps of up to kMoeDeviceTokens tokens route on the device (moe_on_device); BATON_MOE_DEVICE=0
// takes them to the host (per expert, a one-token step's experts four to a launch).
TEST_CASE("a mixture's decode steps, routed on the device or the host, give the CPU stage's logits") {
  for (const std::string& path : {test::tiny_qwen3moe_model(), test::tiny_qwen2moe_model(), test::tiny_gpt_oss_model()})
  for (const char* on_device : {"1", "0"}) {
    INFO("BATON_MOE_DEVICE=" << on_device);
    setenv("BATON_MOE_DEVICE", on_device, 1);
    const Model m(path);
    const int V = m.cfg.n_vocab;
    auto decode_alone = [&](Chain& stages) {  // a 12-token prompt, then 24 steps of one token each
      Batch b;
      for (int i = 0; i < 12; ++i) b.add((5 + 13 * i) % V, i, 0, true);
      std::vector<float> all = forward(stages, m.cfg, b);
      for (int step = 0; step < 24; ++step) {
        Batch d;
        d.add((7 + 29 * step) % V, 12 + step, 0, true);
        const auto row = forward(stages, m.cfg, d);
        all.insert(all.end(), row.begin(), row.end());
      }
      return all;
    };
    Chain cpu = chain(m, GgmlType::F16, 0, "cpu"), gpu = chain(m, GgmlType::F16, 0, "gpu");
    unsetenv("BATON_MOE_DEVICE");
    test::check_routed_close(decode_alone(cpu), decode_alone(gpu), V, name_of(path) + " one-token steps, CPU vs GPU");
    // Routed on the device, the prompt (12 tokens) and the one-token steps are two graphs, the
    // steps replay theirs; routed on the host, nothing is captured.
    const GpuStage::Stats gs = static_cast<const GpuStage&>(*gpu[0]).stats();
    CHECK(gs.captured == (on_device[0] == '1' ? 2u : 0u));
    CHECK(gs.launched == (on_device[0] == '1' ? 25u : 0u));
  }
}

TEST_CASE("--cpu-moe: a GPU stage with its experts in host memory gives the CPU stage's logits, without their bytes") {
  for (const std::string& path : {test::tiny_qwen3moe_model(), test::tiny_qwen2moe_model(), test::tiny_gpt_oss_model()}) {
    const Model m(path);
    const Stage st = block(m.cfg, 0, m.cfg.n_layer, "gpu");
    StageOptions o = options(GgmlType::F16);
    Chain cpu = chain(m, GgmlType::F16, 0, "cpu"), on_gpu, host_experts;
    on_gpu.push_back(std::make_unique<GpuStage>(*m.file, m.cfg, st, o, 0));
    o.cpu_moe = true;
    host_experts.push_back(std::make_unique<GpuStage>(*m.file, m.cfg, st, o, 0));
    const Run ref = run(cpu, m.cfg);
    test::check_routed_close(ref.logits, run(host_experts, m.cfg, &ref.fed).logits, m.cfg.n_vocab,
                             name_of(path) + " --cpu-moe GPU stage vs CPU");
    // The device holds everything but the experts: their padded rows are what it saves.
    uint64_t experts = 0;
    for (const auto& t : m.file->tensors())
      if (t.name.find("_exps.") != std::string::npos) experts += weight_used_bytes(t.type, t.ne[0], t.nrows(), t.nbytes);
    const uint64_t full = on_gpu[0]->measured_bytes(), lean = host_experts[0]->measured_bytes();
    INFO(name_of(path) << ": device bytes " << full << " vs " << lean << ", experts " << experts);
    CHECK(full - lean >= experts * 95 / 100);
    CHECK(full - lean <= experts + (uint64_t(1) << 20));
  }
}

TEST_CASE("experts stored as one ffn_gate_up_exps tensor: the same logits on the CPU, the GPU's as before") {
  const std::string path = test::tiny_qwen3moe_model(), merged = test::merged_gate_up_copy(path);
  const Model m(path), mm(merged);
  REQUIRE(mm.cfg.fused_gate_up_exps);
  REQUIRE_FALSE(m.cfg.fused_gate_up_exps);
  Chain cpu = chain(m, GgmlType::F16, 0, "cpu"), cpu_merged = chain(mm, GgmlType::F16, 0, "cpu");
  const Run ref = run(cpu, m.cfg);
  const Run same = run(cpu_merged, mm.cfg, &ref.fed);
  CHECK(std::memcmp(same.logits.data(), ref.logits.data(), ref.logits.size() * sizeof(float)) == 0);
  Chain gpu = chain(m, GgmlType::F16, 0, "gpu"), gpu_merged = chain(mm, GgmlType::F16, 0, "gpu");
  const Run g = run(gpu, m.cfg, &ref.fed);
  const Run gm = run(gpu_merged, mm.cfg, &ref.fed);
  CHECK(std::memcmp(gm.logits.data(), g.logits.data(), g.logits.size() * sizeof(float)) == 0);
}

TEST_CASE("two GPU stages give the one-stage logits, and a GPU stage feeding a CPU stage the CPU's") {
  for (const std::string& path : {tiny_llama(), tiny_qwen2(), tiny_qwen3(), test::tiny_gemma3_model(), test::tiny_phi3_model(),
                                  test::tiny_gemma2_model(), test::tiny_qwen3moe_model(), test::tiny_granite_model(),
                                  test::tiny_olmo3_model(), test::tiny_smollm3_model()}) {
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
    const std::string what = name_of(path) + " GPU + CPU vs CPU";  // two approximations, as above
    if (m.cfg.is_moe()) test::check_routed_close(ref.logits, run(spill, m.cfg, &ref.fed).logits, m.cfg.n_vocab, what);
    else test::check_peer_close(ref.logits, run(spill, m.cfg, &ref.fed).logits, m.cfg.n_vocab, what, 0.25f);
  }
}

TEST_CASE("decode steps replayed from CUDA graphs give the logits of steps launched op by op") {
  for (const std::string& path : {tiny_llama(), test::tiny_gemma3_model(), test::tiny_granite_model(), test::tiny_olmo3_model()}) {
    INFO(name_of(path));
    const Model m(path);
    const int L = m.cfg.n_layer, cut = L / 2;
    auto make = [&](bool graphs) {
      Chain c;
      c.push_back(std::make_unique<GpuStage>(*m.file, m.cfg, block(m.cfg, 0, cut, "gpu"), options(GgmlType::F16, graphs), 0));
      c.push_back(std::make_unique<GpuStage>(*m.file, m.cfg, block(m.cfg, cut, L, "gpu"), options(GgmlType::F16, graphs), 0));
      return c;
    };
    Chain plain = make(false), graphed = make(true);
    const Run ref = run(plain, m.cfg);
    const Run got = run(graphed, m.cfg, &ref.fed);
    // The prompt (49 tokens) is launched op by op, every decode step (2 tokens: past Gemma's
    // window, at new positions each time) replays one graph per stage, captured at the first.
    CHECK(std::memcmp(got.logits.data(), ref.logits.data(), ref.logits.size() * sizeof(float)) == 0);
    for (const auto& st : graphed) {
      const auto gs = static_cast<const GpuStage&>(*st).stats();
      CHECK(gs.captured == 1);
      CHECK(gs.launched == uint64_t(kSteps));
    }
    for (const auto& st : plain) {
      const auto gs = static_cast<const GpuStage&>(*st).stats();
      CHECK(gs.launched == 0);
      // The 40-token prompt of sequence 0 took the tiled prefill attention in every layer (the
      // 9-token one the split attention); decode steps never do.
      CHECK(gs.prefill_runs == uint64_t(st->layer_end() - st->layer_begin()));
    }
    // A new shape (one token, argmax only) is a second graph; the first stays.
    Batch one;
    one.add(5, 40 + kSteps, 0, kArgmaxOnly);
    forward(graphed, m.cfg, one);
    auto& last = static_cast<GpuStage&>(*graphed[1]);
    CHECK(last.stats().captured == 2);
    // Once the scratch has moved, every graph holds a stale address: the same shape is captured
    // again instead of replayed.
    one.pos[0]++;
    last.context().reserve(last.context().scratch_size() + 1);
    forward(graphed, m.cfg, one);
    CHECK(last.stats().captured == 3);
    one.pos[0]++;
    forward(graphed, m.cfg, one);
    CHECK(last.stats().captured == 3);  // and replayed from then on
  }
}

TEST_CASE("a GPU stage answers argmax-only and top-k rows with what its full rows reduce to") {
  const Model m(tiny_llama());
  const int V = m.cfg.n_vocab;
  Chain one = chain(m, GgmlType::F16, 0, "gpu");
  const auto [full, mixed] = test::output_mode_batches(V);
  REQUIRE(top_k_candidates(V) > 1);
  const std::vector<float> a = forward(one, m.cfg, full), b = forward(one, m.cfg, mixed);
  test::check_output_rows(mixed, a.data(), b.data(), V);
}

// Embeddings (runtime/embed.h): kHidden rows from a GPU stage's head (the normed rows packed on
// the device and spread to their rows on the way back), from a CPU head after a GPU stage, and
// from two CPU stages (the pipeline regrouping the sequences per stage), against one CPU stage.
TEST_CASE("embeddings from GPU stages and from two CPU stages are the one CPU stage's") {
  const std::string& path = tiny_qwen3();
  std::vector<std::vector<int32_t>> inputs;
  for (int len : {5, 23, 12, 1}) {
    inputs.emplace_back();
    for (int i = 0; i < len; ++i) inputs.back().push_back(int32_t((7 + 13 * i + 31 * len) % 1500));
  }
  auto embed = [&](const std::string& devices, Pooling pool) {
    LoadOptions o = gpu_options(devices);
    o.n_seq = 2;
    if (devices == "cuda:0,cpu") o.n_gpu_layers = 1;  // the head on the CPU
    return test::embed_all(*Pipeline::load(path, o), inputs, pool);
  };
  for (Pooling pool : {Pooling::Mean, Pooling::Last}) {
    const std::vector<float> ref = embed("cpu", pool);
    REQUIRE(ref.size() == inputs.size() * 256);
    CHECK(embed("cpu,cpu", pool) == ref);  // the same ops on the same rows
    for (const std::string devices : {"cuda:0", "cuda:0,cpu"})
      test::check_embeddings_close(ref, embed(devices, pool), inputs.size(), devices + ", pooling " + to_string(pool));
  }
}

TEST_CASE("the emulated attention with sinks and clamped SwiGLU gate give the CPU ops' results") {
  // 40 staged tokens of one sequence, 4 query heads over 2 KV heads, a window of 9: the prefill
  // and the split attention of the emulation against cpu::attention, sinks below, among and far
  // above the scores. (Device memory is host memory here: the CPU's arrays serve as device arrays.)
  const int n = 40, n_head = 4, n_kv = 2, d = 32, n_cells = 64;
  std::mt19937 rng(5);
  auto randoms = [&](size_t m, float lo, float hi) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(m);
    for (float& x : v) x = u(rng);
    return v;
  };
  const size_t row = size_t(n_kv * d) * 2;  // F16
  const std::vector<float> q = randoms(size_t(n * n_head * d), -2.f, 2.f);
  const std::vector<float> k = randoms(size_t(n * n_kv * d), -1.f, 1.f), v = randoms(k.size(), -1.f, 1.f);
  std::vector<uint8_t> k_new(row * n), v_new(row * n), cache(row * n_cells, 0);
  for (int t = 0; t < n; ++t) {
    cpu::kv_convert(GgmlType::F16, k.data() + size_t(t * n_kv * d), k_new.data() + row * size_t(t), n_kv * d);
    cpu::kv_convert(GgmlType::F16, v.data() + size_t(t * n_kv * d), v_new.data() + row * size_t(t), n_kv * d);
  }
  std::vector<int32_t> pos(n), seq(n, 0), first(n, 0), row0(n, 0);
  for (int t = 0; t < n; ++t) pos[size_t(t)] = t;
  const std::vector<float> sinks = {-3.f, 0.f, 1.5f, 25.f};
  std::vector<float> want(size_t(n * n_head * d)), got(want.size());
  cpu::AttentionArgs a;
  a.n_tokens = n, a.q = q.data(), a.q_stride = size_t(n_head * d), a.out = want.data(), a.out_stride = a.q_stride;
  a.pos = pos.data(), a.seq = seq.data(), a.first = first.data(), a.row0 = row0.data();
  a.k_new = k_new.data(), a.v_new = v_new.data(), a.n_head = n_head, a.scale = 1.f / std::sqrt(float(d));
  a.window = 9, a.sinks = sinks.data();
  a.kv = {GgmlType::F16, cache.data(), cache.data(), row, row, n_cells, n_kv, d, d};
  cpu::ThreadPool pool(2);
  cpu::attention(a, pool);
  cuda::Context ctx(0);
  cuda::AttentionArgs g;
  g.n_tokens = n, g.q = q.data(), g.q_stride = a.q_stride, g.out = got.data(), g.out_stride = a.out_stride;
  g.pos = pos.data(), g.seq = seq.data(), g.first = first.data(), g.row0 = row0.data();
  g.k_new = k_new.data(), g.v_new = v_new.data(), g.n_head = n_head, g.scale = a.scale, g.window = 9;
  g.sinks = sinks.data();
  g.kv = {GgmlType::F16, cache.data(), cache.data(), row, row, n_cells, n_kv, d};
  // Relative to each head's largest value: head 3's outputs are about e^-24 of the others.
  auto check = [&](const char* what) {
    INFO(what);
    int bad = 0;
    for (size_t r = 0; r < want.size(); r += size_t(d)) {
      float size = 0;
      for (size_t i = r; i < r + size_t(d); ++i) size = std::max(size, std::fabs(want[i]));
      for (size_t i = r; i < r + size_t(d); ++i) bad += !(std::fabs(got[i] - want[i]) <= 1e-5f * size);
    }
    CHECK(bad == 0);
  };
  cuda::attention_prefill(ctx, g, 0, 0, 0);
  check("attention_prefill");
  std::fill(got.begin(), got.end(), NAN);
  cuda::attention(ctx, g, n);
  check("attention");

  const std::vector<float> gate = randoms(1000, -10.f, 10.f), up = randoms(1000, -9.f, 9.f);
  std::vector<float> y_cpu(gate.size()), y_emu(gate.size());
  cpu::swiglu_oai_gate(gate.data(), up.data(), y_cpu.data(), int(gate.size()));
  cuda::swiglu_oai_gate(ctx, gate.data(), up.data(), y_emu.data(), int64_t(gate.size()));
  CHECK(y_emu == y_cpu);
}

TEST_CASE("GPU stages copy a sequence's start (Batch::copies) as the CPU does: the same logits after") {
  for (const std::string& model : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_gemma3_model()}) {
    for (const char* devices : {"cuda:0", "cuda:0,cpu", "cuda:0,cuda:0"}) {
      INFO(model << " on " << devices);
      auto p = Pipeline::load(model, gpu_options(devices));
      const float d = test::seq_copy_max_diff(*p, 28, 19);
      INFO("max |d| " << d);
      CHECK(d == 0.0f);  // the same kernels on the same bits
    }
  }
}

#else  // a build with the real CUDA backend: no emulation to run on

TEST_CASE("GPU stage on the host emulation: skipped") {
  WARN("this build has the CUDA backend, not its host emulation: tests/test_cuda_stage.cpp runs the GPU stage");
}

#endif

