// A model stage on a GPU against the CPU stage, through the pipeline: the peer tiny model (llama)
// and a generated Gemma 3-shaped model (sliding-window rings, q/k norms, post-norms, GELU, tied
// head); two stages on one GPU; a GPU stage spilling to a CPU stage. Prompts of two sequences in
// one batch, then decode steps of both, so the staging rows, the ring cells and the logits rows
// are all exercised. Exits with 77 (ctest: skipped) without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "helpers.h"
#include "model_helpers.h"
#include "gguf/gguf.h"
#include "runtime/config.h"
#include "runtime/devices.h"
#include "runtime/lora.h"
#include "runtime/pipeline.h"

using namespace baton;

namespace {

// Runs before Catch2's main: with no GPU there is nothing to test.
const int kGpus = [] {
  int gpus = 0;
  for (const auto& d : probe_devices()) gpus += d.kind == DeviceKind::Cuda;
  if (gpus == 0) {
    std::printf("no CUDA device: skipping the GPU stage tests (exit code 77)\n");
    std::fflush(stdout);
    std::exit(77);
  }
  return gpus;
}();

// The devices of a --devices list, in order.
std::vector<std::string> split_devices(const std::string& list) {
  std::vector<std::string> out;
  for (size_t b = 0; b <= list.size();) {
    const size_t e = std::min(list.find(',', b), list.size());
    out.push_back(list.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

std::unique_ptr<Pipeline> load(const std::string& path, const std::string& devices, const std::string& p2p = "auto",
                               bool graphs = true, bool cpu_moe = false, const std::vector<LoraFile>& lora = {}) {
  LoadOptions o;
  o.lora = lora;
  o.cpu_moe = cpu_moe;
  o.cuda_graphs = graphs;
  o.n_ctx = 128;
  o.n_seq = 2;
  o.n_batch = 64;
  o.n_threads = 2;
  o.devices = devices;
  o.p2p = p2p;
  const auto n_stages = std::count(devices.begin(), devices.end(), ',') + 1;
  if (n_stages > 1 && !cpu_moe) o.tensor_split.assign(size_t(n_stages), 1.0);
  return Pipeline::load(path, o);
}

// Every logits row of: two prompts in one batch (sequence 0: 40 tokens, sequence 1: 20), then 12
// decode steps of both sequences together. The decode tokens are fixed, not each run's argmax: a
// near tie that flips between devices would otherwise send the runs down different texts. Both
// prompts are longer than gemv_max_cols (16), so a pipeline's micro-batch of one sequence takes
// the same matmul path (GEMM) as the one-stage batch of both.
std::vector<float> run(Pipeline& p) {
  const int V = p.n_vocab();
  std::vector<float> all;
  Batch b;
  for (int i = 0; i < 40; ++i) b.add((3 + 7 * i) % V, i, 0, true);
  for (int i = 0; i < 20; ++i) b.add((11 + 5 * i) % V, i, 1, true);
  std::vector<float> out(size_t(b.n_logits()) * size_t(V));
  p.decode(b, out.data());
  all.insert(all.end(), out.begin(), out.end());
  int len[2] = {40, 20};
  for (int step = 0; step < 12; ++step) {
    Batch d;
    for (int s = 0; s < 2; ++s) d.add((17 + 13 * step + 5 * s) % V, len[s]++, s, true);
    std::vector<float> rows(2 * size_t(V));
    p.decode(d, rows.data());
    all.insert(all.end(), rows.begin(), rows.end());
  }
  return all;
}

}  // namespace

// (The simulator is slow: families that add no path of their own to the GPU stage — ERNIE 4.5's
// biases, EXAONE 4's NoPE and post-norms, Gemma 1's and GLM-4's layers — run on the host emulation only,
// test_gpu_stage_host.)
TEST_CASE("a GPU stage gives the CPU stage's logits (llama, Gemma 3, Phi-3, Qwen3-MoE, gpt-oss, Granite, OLMo 3, OLMoE and SmolLM3 shapes, Q3_K and IQ4_XS llamas)") {
  for (const std::string& path : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_gemma3_model(), test::tiny_phi3_model(),
                                  test::tiny_model_of(GgmlType::Q3_K), test::tiny_model_of(GgmlType::IQ4_XS),
                                  test::tiny_qwen3moe_model(), test::tiny_gpt_oss_model(), test::tiny_granite_model(),
                                  test::tiny_olmo3_model(), test::tiny_olmoe_model(), test::tiny_smollm3_model()}) {
    auto cpu = load(path, "cpu");
    auto gpu = load(path, "cuda:0");
    REQUIRE(gpu->stages().size() == 1);
    CHECK(gpu->stages()[0].device == "cuda:0");
    CHECK(gpu->stages()[0].planned_bytes >= gpu->stages()[0].measured_bytes);
    // Both meet the peer criteria against llama.cpp; between them the 8-bit activation codes come
    // from other float arithmetic (x * (127 / amax) on the CPU, x / (amax / 127) on the GPU) and
    // sums in another order, which this random model amplifies: on an H200 a top-1/top-2 gap of
    // 0.11 flipped (row 26 of the peer model, its two logits off by 0.09 and 0.04).
    if (cpu->config().is_moe()) test::check_routed_close(run(*cpu), run(*gpu), cpu->n_vocab(), path);
    else test::check_peer_close(run(*cpu), run(*gpu), cpu->n_vocab(), path, 0.25f);
  }
}

// Steps of up to kMoeDeviceTokens tokens route on the device (the 12-token prompt too);
// BATON_MOE_DEVICE=0 takes them to the host (a one-token step's experts four to a launch).
TEST_CASE("a mixture's decode steps on the GPU, routed on the device or the host, give the CPU's logits") {
  const std::string path = test::tiny_qwen3moe_model();
  auto steps = [&](Pipeline& p) {  // a 12-token prompt, then 16 steps of one token each
    const int V = p.n_vocab();
    std::vector<float> all(12 * size_t(V));
    Batch b;
    for (int i = 0; i < 12; ++i) b.add((5 + 13 * i) % V, i, 0, true);
    p.decode(b, all.data());
    std::vector<float> row(static_cast<size_t>(V));
    for (int step = 0; step < 16; ++step) {
      Batch d;
      d.add((7 + 29 * step) % V, 12 + step, 0, true);
      p.decode(d, row.data());
      all.insert(all.end(), row.begin(), row.end());
    }
    return all;
  };
  auto cpu = load(path, "cpu");
  const std::vector<float> want = steps(*cpu);
  for (const char* on_device : {"1", "0"}) {
    setenv("BATON_MOE_DEVICE", on_device, 1);
    auto gpu = load(path, "cuda:0");
    unsetenv("BATON_MOE_DEVICE");
    test::check_routed_close(want, steps(*gpu), cpu->n_vocab(), path + " steps, BATON_MOE_DEVICE=" + on_device);
  }
}

TEST_CASE("--cpu-moe: the experts in host memory under a GPU stage give the CPU's logits") {
  const std::string path = test::tiny_qwen3moe_model();
  auto cpu = load(path, "cpu");
  auto gpu = load(path, "cuda:0,cpu", "auto", true, true);
  REQUIRE(gpu->stages().size() == 1);
  CHECK(gpu->stages()[0].device == "cuda:0");
  CHECK(gpu->stages()[0].planned_bytes >= gpu->stages()[0].measured_bytes);
  test::check_routed_close(run(*cpu), run(*gpu), cpu->n_vocab(), path + " --cpu-moe");
  CHECK_THROWS_WITH(load(path, "cuda:0", "auto", true, true), Catch::Contains("--devices must list cpu"));
}

TEST_CASE("two stages on one GPU, and a GPU stage spilling to the CPU, give the one-stage logits") {
  for (const std::string& path : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_gemma3_model()}) {
    auto one = load(path, "cuda:0");
    const auto ref = run(*one);
    one.reset();
    // Both link kinds on one GPU (docs/GPU.md, "Links"), 2 and 3 stages; across two GPUs where
    // there are two (the CUDA simulator has two: BATON_CUDA=SIM). Every list and link kind on the
    // Gemma 3 shape; the peer model (six times slower on the simulator: its 32k vocabulary) takes
    // one list of each length, one link kind each.
    const bool every = path != test::peer("logits/tiny-q4_0.gguf");
    std::vector<std::string> lists = {"cuda:0,cuda:0", "cuda:0,cuda:0,cuda:0"};
    if (kGpus >= 2) lists.insert(lists.end(), {"cuda:0,cuda:1", "cuda:1,cuda:0,cuda:1"});
    if (!every) lists = {lists[lists.size() - 2], lists.back()};
    for (const std::string& devices : lists) {
      for (const char* p2p : {"on", "off"}) {
        if (!every && (devices == lists[0]) != (std::string(p2p) == "on")) continue;
        INFO(devices << " --p2p " << p2p);
        auto split = load(path, devices, p2p);
        const auto st = split->stages();
        const auto names = split_devices(devices);
        REQUIRE(st.size() == names.size());
        for (size_t k = 0; k + 1 < st.size(); ++k)
          CHECK(st[k].link == names[k] + " -> " + names[k + 1] + ", " + (std::string(p2p) == "on" ? "peer-to-peer" : "host-staged"));
        const auto got = run(*split);
        // The same kernels on the same rows: a split changes nothing but where the layers run.
        double max_d = 0;
        for (size_t i = 0; i < ref.size(); ++i) max_d = std::max(max_d, double(std::fabs(ref[i] - got[i])));
        std::printf("%s: 1 stage vs %s --p2p %s max|d| %.3g\n", path.c_str(), devices.c_str(), p2p, max_d);
        CHECK(max_d <= 1e-4);
      }
    }

    auto spill = load(path, "cuda:0,cpu");
    REQUIRE(spill->stages().size() == 2);
    CHECK(spill->stages()[1].device == "cpu");
    test::check_peer_close(ref, run(*spill), spill->n_vocab(), "GPU + CPU spill");
  }
}

TEST_CASE("decode steps replayed from CUDA graphs give the logits of steps launched op by op") {
  // (A llama with Granite's scales stands for the peer llama: the same ops, a fifth of the vocabulary.)
  for (const std::string& path : {test::tiny_gemma3_model(), test::tiny_granite_model()}) {
    const auto plain = run(*load(path, "cuda:0,cuda:0", "on", /*graphs=*/false));
    const auto graphed = run(*load(path, "cuda:0,cuda:0", "on", /*graphs=*/true));
    REQUIRE(plain.size() == graphed.size());
    // Only the attention's split count differs (a graph bounds the keys by n_ctx): the partial
    // sums merge in another order.
    double max_d = 0;
    for (size_t i = 0; i < plain.size(); ++i) max_d = std::max(max_d, double(std::fabs(plain[i] - graphed[i])));
    std::printf("%s: graphs vs no graphs max|d| %.3g\n", path.c_str(), max_d);
    CHECK(max_d <= 1e-3);
  }
}

namespace {

// f() with the environment variable name=value set (unset again however f ends).
template <class F>
auto with_env(const char* name, const char* value, F&& f) {
  struct Unset {
    const char* n;
    ~Unset() { unsetenv(n); }
  } unset{name};
  setenv(name, value, 1);
  return f();
}

// A knob of cuda::Context set through the environment: each good value gives the default's
// logits within the peer bounds, each bad value is refused at load, naming the variable.
void check_env_knob(const char* name, std::initializer_list<const char*> good, std::initializer_list<const char*> bad) {
  const std::string path = test::tiny_gemma3_model();
  auto one = load(path, "cuda:0");
  const auto ref = run(*one);
  const int V = one->n_vocab();
  one.reset();
  for (const char* value : good) {
    INFO(name << "=" << value);
    const auto got = with_env(name, value, [&] { return run(*load(path, "cuda:0")); });
    test::check_peer_close(ref, got, V, std::string(name) + "=" + value);
  }
  for (const char* value : bad)
    with_env(name, value, [&] {
      CHECK_THROWS_WITH(load(path, "cuda:0"), Catch::Contains(std::string(name) + "=" + value));
      return 0;
    });
}

}  // namespace

TEST_CASE("a GEMV/GEMM cut-over moved by BATON_GEMV_MAX_COLS gives the same logits; a bad value is refused") {
  // 64: the 60-token prompt step too takes the GEMV passes and a graph (split attention only).
  check_env_knob("BATON_GEMV_MAX_COLS", {"1", "64"}, {"0"});
}

TEST_CASE("BATON_GEMM_SLAB_MIB shrinks the GEMM's FP16 slab; a value past the planned slab is refused") {
  check_env_knob("BATON_GEMM_SLAB_MIB", {"1"}, {"0", "65", "8x"});
}

// BATON_GEMV_TUNE: a stage measures the GEMV forms at load and takes the fastest per launch (the
// simulator's times mean nothing, but the mechanics are the GPU's). 1: among the forms that keep
// the products' bits, so the same logits; 2: among all, so the logits within the peer bounds
// (Split and the one-warp forms sum a row in other partials).
TEST_CASE("BATON_GEMV_TUNE: the GEMV forms measured at load, a note per op and width, the logits") {
  const std::string path = test::tiny_gemma3_model();  // its head is the tied embedding
  auto plain = load(path, "cuda:0,cuda:0");
  CHECK(plain->stages()[0].notes.empty());
  const auto ref = run(*plain);
  plain.reset();
  for (const char* mode : {"1", "2"}) {
    INFO("BATON_GEMV_TUNE=" << mode);
    with_env("BATON_GEMV_TUNE", mode, [&] {
      auto tuned = load(path, "cuda:0,cuda:0");  // 2 sequences: 1 and 2 columns
      const auto st = tuned->stages();
      REQUIRE(st.size() == 2);
      CHECK(st[0].notes.size() == 2 * 4);  // q/k/v, output projection, gate/up, down
      CHECK(st[1].notes.size() == 2 * 5);  // and the head
      std::string all;
      for (const std::string& note : st[1].notes) all += note + "\n";
      INFO(all);
      CHECK(st[1].notes.back().find("GEMV forms, head (") == 0);
      CHECK(st[1].notes.back().find(", 2 columns: ") != std::string::npos);
      if (mode[0] == '1') CHECK(run(*tuned) == ref);
      else test::check_peer_close(ref, run(*tuned), tuned->n_vocab(), "BATON_GEMV_TUNE=2");
      return 0;
    });
  }
  with_env("BATON_GEMV_TUNE", "3", [&] {
    CHECK_THROWS_WITH(load(path, "cuda:0"), Catch::Contains("BATON_GEMV_TUNE=3"));
    return 0;
  });
}

TEST_CASE("greedy and top-k rows come back from the GPU as ids and candidates, as the full rows reduce") {
  for (const char* devices : {"cuda:0", "cuda:0,cuda:0", "cuda:0,cpu"}) {
    INFO(devices);
    auto p = load(test::tiny_gemma3_model(), devices);
    const int V = p->n_vocab();
    const auto [full, mixed] = test::output_mode_batches(V);
    std::vector<float> a(size_t(full.n_logits()) * size_t(V)), b(a.size());
    p->decode(full, a.data());
    p->decode(mixed, b.data());
    test::check_output_rows(mixed, a.data(), b.data(), V);
    // Decode steps (captured in graphs, with the argmax or top-k inside): each step feeds both
    // sequences the same token; sequence 0 asks for the full row, sequence 1 alternately for the
    // argmax and the candidates. Both columns run the same kernels on equal caches.
    for (int step = 0; step < 4; ++step) {
      Batch d;
      const int32_t tok = (7 + 31 * step) % V;
      d.add(tok, 12 + step, 0, uint8_t(kLogitsRow));
      d.add(tok, 12 + step, 1, uint8_t(step % 2 ? kTopK : kArgmaxOnly));
      std::vector<float> rows(2 * size_t(V));
      p->decode(d, rows.data());
      test::check_output_row(d.logits[1], rows.data(), rows.data() + V, V);
    }
  }
}

TEST_CASE("the fetched models on a GPU stage: every tensor type of their files, logits close to the CPU's") {
  // SmolLM2 is Q4_1 with a Q8_0 head; Gemma 3 270M's Q4_K_M file mixes Q4_K, Q5_0, Q6_K and Q8_0.
  for (const std::string& path : {test::smollm2(), test::gemma3()}) {
    if (path.empty()) continue;  // not fetched: scripts/fetch-model.sh (CI fetches both)
    std::vector<float> rows[2];
    const char* devices[2] = {"cpu", "cuda:0"};
    int V = 0;
    for (int k = 0; k < 2; ++k) {
      LoadOptions o;
      o.n_ctx = 64;
      o.n_batch = 64;
      o.n_threads = 2;
      o.devices = devices[k];
      auto p = Pipeline::load(path, o);
      V = p->n_vocab();
      const auto ids = p->tokenizer().encode("The capital of France is", /*add_special=*/true, /*parse_special=*/false);
      REQUIRE(ids.size() >= 4);
      Batch b;  // the prompt in one batch (at most gemv_max_cols tokens: the GEMV path), then 3 steps
      for (size_t i = 0; i < ids.size(); ++i) b.add(ids[i], int32_t(i), 0, true);
      std::vector<float> out(size_t(b.n_logits()) * size_t(V));
      p->decode(b, out.data());
      rows[k].insert(rows[k].end(), out.begin(), out.end());
      for (int step = 0; step < 3; ++step) {
        Batch d;
        d.add((1000 + 77 * step) % V, int32_t(ids.size()) + step, 0, true);
        std::vector<float> r(static_cast<size_t>(V));
        p->decode(d, r.data());
        rows[k].insert(rows[k].end(), r.begin(), r.end());
      }
    }
    // Real models are held to distributions, not raw logits: their 8-bit activations make them
    // discontinuous, so two correct orders of summation flip a few quantized activations and move
    // the logits by up to ~1 (the host emulation differs from the CPU as much). KL(cpu || gpu) per
    // row, and the same top token wherever the CPU's is clear.
    double sum_kl = 0, max_kl = 0;
    const size_t n_rows = rows[0].size() / size_t(V);
    for (size_t r = 0; r < n_rows; ++r) {
      const float* a = rows[0].data() + r * size_t(V);
      const float* g = rows[1].data() + r * size_t(V);
      const double kl = test::kl_divergence(a, g, V);
      sum_kl += kl;
      max_kl = std::max(max_kl, kl);
      std::vector<float> top(a, a + V);
      std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
      if (top[0] - top[1] > 0.5f) {
        INFO(path << " row " << r);
        CHECK(std::max_element(a, a + V) - a == std::max_element(g, g + V) - g);
      }
    }
    std::printf("%s: KL(cpu || cuda:0) mean %.2e max %.2e over %zu rows\n", path.c_str(), sum_kl / double(n_rows), max_kl, n_rows);
    INFO(path);
    CHECK(sum_kl / double(n_rows) <= 0.02);
    CHECK(max_kl <= 0.05);
  }
}

// LoRA adapters (runtime/lora.h) on a GPU stage: every layer matrix and the embedding of the peer
// model adapted (F16, rank 8 padded to 32; and an F32 one on a few), the prompts' products on the GEMM path and the decode
// steps' on the GEMV path (graphs replayed), against the CPU stage with the same adapter; the
// adapter itself moves the logits far past that bound.
TEST_CASE("LoRA adapters on a GPU stage give the CPU stage's logits") {
  const std::string base = test::peer("logits/tiny-q4_0.gguf");
  const auto f = gguf::File::open(base);
  LoraSynthOptions lo;
  lo.rank = 8;
  lo.alpha = 16;
  lo.type = GgmlType::F16;
  lo.seed = 9;
  lo.targets = {"token_embd.weight"};
  for (int l = 0; l < 4; ++l)
    for (LayerTensor t : {LayerTensor::Wq, LayerTensor::Wk, LayerTensor::Wv, LayerTensor::Wo, LayerTensor::Gate,
                          LayerTensor::Up, LayerTensor::Down})
      lo.targets.push_back(layer_tensor_key(l, t));
  const std::string adapter = test::temp_dir() + "/tiny-q4_0-lora.gguf";
  lora_synth_writer(*f, lo).write(adapter);
  // A second one, F32 and rank 4 (its embedding rows stay F32 on the device), scaled negatively.
  lo.rank = 4;
  lo.alpha = 0;
  lo.type = GgmlType::F32;
  lo.seed = 10;
  lo.targets = {"token_embd.weight", "blk.2.attn_output.weight", "blk.3.ffn_down.weight"};
  const std::string adapter2 = test::temp_dir() + "/tiny-q4_0-lora2.gguf";
  lora_synth_writer(*f, lo).write(adapter2);
  const std::vector<LoraFile> lora = {{adapter, 0.8f}, {adapter2, -1.2f}};
  auto gpu = load(base, "cuda:0", "auto", true, false, lora);
  CHECK(gpu->stages()[0].planned_bytes >= gpu->stages()[0].measured_bytes);
  const std::vector<float> want = run(*load(base, "cpu", "auto", true, false, lora)), got = run(*gpu);
  test::check_peer_close(want, got, gpu->n_vocab(), "LoRA on cuda:0", 0.25f);
  const std::vector<float> plain = run(*load(base, "cuda:0"));
  float moved = 0;
  for (size_t i = 0; i < got.size(); ++i) moved = std::max(moved, std::fabs(got[i] - plain[i]));
  CHECK(moved > 1.f);
}

// `baton embed` on a GPU (runtime/embed.h): kHidden rows from the GPU stage's head, pooled,
// against the CPU stage's; a dense llama and a mixture (its decode-sized forwards routed on the
// device).
TEST_CASE("embeddings from a GPU stage are the CPU stage's") {
  std::vector<std::vector<int32_t>> inputs;
  for (int len : {5, 23, 12, 1}) {
    inputs.emplace_back();
    for (int i = 0; i < len; ++i) inputs.back().push_back(int32_t((7 + 13 * i + 31 * len) % 200));
  }
  for (const std::string& path : {test::peer("logits/tiny-q4_0.gguf"), test::tiny_qwen3moe_model()})
    for (Pooling pool : {Pooling::Mean, Pooling::Last})
      test::check_embeddings_close(test::embed_all(*load(path, "cpu"), inputs, pool),
                                   test::embed_all(*load(path, "cuda:0"), inputs, pool), inputs.size(),
                                   path + ", pooling " + to_string(pool));
}

TEST_CASE("GPU stages copy a sequence's start (Batch::copies): the logits after are the evaluated ones") {
  // (The host emulation runs more models and device lists: test_gpu_stage_host.)
  for (const std::string& path : {test::tiny_gemma3_model()}) {
    std::vector<std::string> lists = {"cuda:0"};
    if (kGpus >= 2) lists.push_back("cuda:0,cuda:1");
    for (const std::string& devices : lists) {
      INFO(path << " on " << devices);
      LoadOptions o;
      o.n_ctx = 64;
      o.n_seq = 3;
      o.n_batch = 64;
      o.n_threads = 2;
      o.devices = devices;
      auto p = Pipeline::load(path, o);
      const float d = test::seq_copy_max_diff(*p, 28, 19);
      std::printf("%s on %s: rows after a copy vs evaluated max|d| %.3g\n", path.c_str(), devices.c_str(), d);
      CHECK(d == 0.0f);  // the same kernels on the same bits
    }
  }
}
