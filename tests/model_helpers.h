// Test helpers that run a loaded model: greedy decoding through the Pipeline, peer id files, the
// peer criteria for two runs' logits.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "gguf/gguf.h"
#include "helpers.h"
#include "runtime/embed.h"
#include "runtime/engine.h"
#include "runtime/pipeline.h"
#include "runtime/synth.h"
#include "runtime/tokenizer.h"

namespace baton::test {

// A pipeline of `path` on `devices` with two threads, n_seq slots of n_ctx positions.
inline std::unique_ptr<Pipeline> load_pipeline(const std::string& path, const std::string& devices, int n_seq, int n_ctx,
                                               int n_batch = 512) {
  LoadOptions o;
  o.n_ctx = n_ctx;
  o.n_seq = n_seq;
  o.n_batch = n_batch;
  o.n_threads = 2;
  o.devices = devices;
  return Pipeline::load(path, o);
}

// The requests through an engine with these options on `parallel` slots, each slot's cache then
// checked against what the engine counts (no draft left behind) and emptied for the next run.
inline std::map<uint64_t, Result> run_requests(Pipeline& p, const Vocab& vocab, const std::vector<Request>& reqs,
                                               const EngineOptions& opt, int parallel) {
  Engine e(p, vocab, opt);
  std::map<uint64_t, Result> out;
  size_t next = 0;
  e.run([&]() -> std::optional<Request> { return next < reqs.size() ? std::optional(reqs[next++]) : std::nullopt; },
        [&](Result&& r) { out[r.tag] = std::move(r); }, parallel);
  for (int s = 0; s < parallel; ++s) {
    CHECK(p.seq_len(s) == int(e.cached(s).size()));
    e.forget(s);
  }
  return out;
}

// Every input's pooled, normalized embedding (runtime/embed.h) from pipeline p, concatenated, in
// forwards of 16 tokens (a long input in two or more, the others beside it).
inline std::vector<float> embed_all(Pipeline& p, const std::vector<std::vector<int32_t>>& inputs, Pooling pool) {
  EmbedOptions eo;
  eo.pooling = pool;
  eo.batch_tokens = 16;
  std::vector<float> all;
  embed_sequences(p, inputs, eo, [&](Embedding&& e) { all.insert(all.end(), e.values.begin(), e.values.end()); });
  return all;
}

// Two runs' embeddings of n_inputs inputs (unit vectors, concatenated) from different devices:
// each pair's cosine above 0.998 and no value off by 0.02 (8-bit activations from other float
// arithmetic on each side; a wrong row's cosine is ~0).
inline void check_embeddings_close(const std::vector<float>& ref, const std::vector<float>& got, size_t n_inputs,
                                   const std::string& what) {
  REQUIRE(got.size() == ref.size());
  const size_t w = ref.size() / n_inputs;
  for (size_t i = 0; i < n_inputs; ++i) {
    double dot = 0, max_d = 0;
    for (size_t k = i * w; k < (i + 1) * w; ++k) {
      dot += double(ref[k]) * got[k];
      max_d = std::max(max_d, double(std::fabs(ref[k] - got[k])));
    }
    INFO(what << ", input " << i << ": cosine " << dot << ", max|d| " << max_d);
    CHECK(dot > 0.998);
    CHECK(max_d < 0.02);
  }
}

// Whitespace-separated token ids from a file (peer *.tokens.txt).
inline std::vector<int32_t> read_ids(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::vector<int32_t> ids;
  int32_t v;
  while (in >> v) ids.push_back(v);
  return ids;
}

// A file of little-endian float32 values (peer *.logits.f32).
inline std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  in.seekg(0, std::ios::end);
  const size_t n = size_t(in.tellg()) / sizeof(float);
  in.seekg(0);
  std::vector<float> v(n);
  in.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(float)));
  return v;
}

// Peer *.greedy32.top5.txt: one line per greedy step: "s id:logit id:logit ...".
inline std::vector<std::vector<std::pair<int, float>>> read_top5(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::vector<std::vector<std::pair<int, float>>> steps;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    int step;
    ls >> step;
    std::vector<std::pair<int, float>> top;
    std::string item;
    while (ls >> item) {
      const size_t colon = item.find(':');
      top.emplace_back(std::stoi(item.substr(0, colon)), std::stof(item.substr(colon + 1)));
    }
    steps.push_back(top);
  }
  return steps;
}

// Greedy continuation of `ids` in sequence 0: the prompt in one batch, then one token per step
// through the KV cache, until an end-of-generation token or max_tokens.
inline std::string greedy(Pipeline& p, const std::vector<int32_t>& ids, int max_tokens) {
  const Tokenizer& tok = p.tokenizer();
  REQUIRE(!ids.empty());
  Batch b;
  for (size_t i = 0; i < ids.size(); ++i) b.add(ids[i], int32_t(i), 0, i + 1 == ids.size());
  std::vector<float> logits(size_t(p.n_vocab()));
  p.decode(b, logits.data());
  std::vector<int32_t> out;
  for (int step = 0; step < max_tokens; ++step) {
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    if (tok.is_eog(next)) break;
    out.push_back(next);
    Batch d;
    d.add(next, int32_t(ids.size() + out.size() - 1), 0, true);
    p.decode(d, logits.data());
  }
  return tok.decode(out);
}

// Batch::copies through a real pipeline (n_seq >= 3): a prompt evaluated in sequence 0, its first
// `shared` positions in one batch (next to two tokens of sequence 1) and the rest in another;
// sequence 1 then gets those positions copied from 0 (replacing what it held) and evaluates the
// rest in a batch of the same shape, and sequence 2 the same from 1. Returns the largest
// difference of their logits rows from sequence 0's: the same arithmetic on the same bits, so 0.
inline float seq_copy_max_diff(Pipeline& p, int len, int shared) {
  REQUIRE(p.copy_limit() >= len);
  REQUIRE((0 < shared && shared < len));
  const size_t V = size_t(p.n_vocab());
  std::vector<int32_t> ids;
  for (int i = 0; i < len; ++i) ids.push_back(int32_t(3 + (i * 37) % (p.n_vocab() - 3)));
  Batch a;
  for (int i = 0; i < shared; ++i) a.add(ids[size_t(i)], i, 0, false);
  a.add(7, 0, 1, false);  // something for the copy to replace
  a.add(8, 1, 1, false);
  p.decode(a, nullptr);
  auto rest = [&](int seq, const std::vector<SeqCopy>& copies) {
    Batch b;
    b.copies = copies;
    for (int i = shared; i < len; ++i) b.add(ids[size_t(i)], i, seq, true);
    std::vector<float> rows(size_t(len - shared) * V);
    p.decode(b, rows.data());
    REQUIRE(p.seq_len(seq) == len);
    return rows;
  };
  const std::vector<float> ref = rest(0, {});
  auto diff = [&](const std::vector<float>& got) {
    float d = 0;
    for (size_t k = 0; k < got.size(); ++k) d = std::max(d, std::fabs(got[k] - ref[k]));
    return d;
  };
  const float d1 = diff(rest(1, {{0, 1, shared}}));
  p.truncate_seq(1, shared);  // sequence 1 keeps just the shared start (its later cells stay written)
  const float d2 = diff(rest(2, {{1, 2, shared}}));
  return std::max(d1, d2);
}

// Two runs of a mixture of experts: where their activations differ by rounding (the CPU's and the
// GPU's 8-bit codes, the GPU's FP16 GEMM), a token whose router has two experts within that
// rounding takes a different one in each, and its row differs as two models' would. So: the mean
// |d| of check_peer_close, and most rows (`share`) within its max |d|. A broken gather, scatter
// or weighting moves every row.
inline void check_routed_close(const std::vector<float>& ref, const std::vector<float>& got, int V, const std::string& what,
                               double share = 0.8) {
  REQUIRE(ref.size() == got.size());
  const size_t rows = ref.size() / size_t(V);
  size_t close = 0;
  double sum = 0;
  for (size_t r = 0; r < rows; ++r) {
    double max_d = 0;
    for (size_t i = r * size_t(V); i < (r + 1) * size_t(V); ++i) {
      const double d = std::fabs(double(ref[i]) - double(got[i]));
      max_d = std::isnan(d) ? INFINITY : std::max(max_d, d);
      sum += d;
    }
    close += max_d <= 0.35;
  }
  std::printf("%s: %zu of %zu rows within 0.35, mean|d| %.5f\n", what.c_str(), close, rows, sum / double(ref.size()));
  INFO(what);
  CHECK(double(close) >= share * double(rows));
  CHECK(sum / double(ref.size()) <= 0.06);
}

// The peer criteria (../shared/peer/README.md) between two runs' logits rows of V floats: max |d|
// <= 0.35, mean |d| <= 0.06, the same argmax wherever the reference's top-1/top-2 gap exceeds 0.1
// (`tie`: another gap, for two backends that each meet the criteria against the peer).
// Prints both differences after `what`.
inline void check_peer_close(const std::vector<float>& ref, const std::vector<float>& got, int V, const std::string& what,
                             float tie = 0.1f) {
  REQUIRE(ref.size() == got.size());
  double max_d = 0, sum = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(double(ref[i]) - double(got[i]));
    max_d = std::isnan(d) ? INFINITY : std::max(max_d, d);
    sum += d;
  }
  std::printf("%s: max|d| %.4f mean|d| %.5f\n", what.c_str(), max_d, sum / double(ref.size()));
  INFO(what);
  CHECK(max_d <= 0.35);
  CHECK(sum / double(ref.size()) <= 0.06);
  for (size_t r = 0; r < ref.size() / size_t(V); ++r) {
    const float* a = ref.data() + r * size_t(V);
    const float* b = got.data() + r * size_t(V);
    std::vector<float> top(a, a + V);
    std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
    if (top[0] - top[1] <= tie) continue;
    const auto ia = std::max_element(a, a + V) - a, ib = std::max_element(b, b + V) - b;
    INFO("row " << r << ": reference top " << ia << " (" << a[ia] << "; got " << b[ia] << "), got top " << ib << " ("
                << b[ib] << "; reference " << a[ib] << ")");
    CHECK(ia == ib);
  }
}

// KL(softmax(p) || softmax(q)) in nats, for two logits rows of V floats.
inline double kl_divergence(const float* p, const float* q, int V) {
  const double mp = *std::max_element(p, p + V), mq = *std::max_element(q, q + V);
  double zp = 0, zq = 0;
  for (int i = 0; i < V; ++i) {
    zp += std::exp(double(p[i]) - mp);
    zq += std::exp(double(q[i]) - mq);
  }
  const double lzp = std::log(zp), lzq = std::log(zq);
  double kl = 0;
  for (int i = 0; i < V; ++i) {
    const double lp = double(p[i]) - mp - lzp, lq = double(q[i]) - mq - lzq;
    kl += std::exp(lp) * (lp - lq);
  }
  return kl;
}

// A generated model of `shape` in this process's temp folder, named after the shape.
inline std::string synth_model(const ShapePreset& shape, uint64_t seed, GgmlType type) {
  SynthOptions o;
  o.type = type;
  o.seed = seed;
  const std::string p = temp_dir() + "/" + shape.name + ".gguf";
  synth_write(shape, o, p);
  return p;
}
inline std::string synth_q8_model(const ShapePreset& shape, uint64_t seed) {
  return synth_model(shape, seed, GgmlType::Q8_0);
}

// A generated Gemma 3-shaped model (tied head, sliding-window layers with a ring KV cache) with 7
// layers, to cut two and three ways; written once per test process.
inline std::string tiny_gemma3_model() {
  static const std::string path = synth_q8_model(
      {"tiny-gemma3", "gemma3", "test", 7, 64, 2, 1, 64, 256, 1000, 2048, true, 16, 6, 1e6f, 1e-6f, false}, 5);
  return path;
}

// A generated Gemma 2-shaped model: every other layer sliding (window 16), the published soft-caps.
inline std::string tiny_gemma2_model() {
  static const std::string path = synth_q8_model(
      {"tiny-gemma2", "gemma2", "test", 4, 128, 2, 1, 64, 256, 1000, 2048, true, 16, 2, 1e4f, 1e-6f, false}, 9);
  return path;
}

// A generated Gemma 1-shaped model (gemma: pre-norms only, no q/k norms, GeGLU, embeddings times
// sqrt(n_embd), tied head): one KV head as the 2B's, heads of 256 (the real ones' size) on a 128-wide
// residual.
inline std::string tiny_gemma_model() {
  static const std::string path = synth_q8_model(
      {"tiny-gemma1", "gemma", "test", 3, 128, 2, 1, 256, 256, 1000, 2048, true, 0, 0, 1e4f, 1e-6f, false}, 20);
  return path;
}

// A generated Phi-3-shaped model: fused q/k/v and gate/up, LongRoPE factors past a context of 64
// (with the attention factor that scales the rotated dims), 48 of 64 head dims rotated (Phi-4-mini).
inline std::string tiny_phi3_model() {
  static const std::string path = synth_model(
      {"tiny-phi3", "phi3", "test", 3, 256, 4, 2, 64, 512, 1000, 2048, false, 0, 0, 1e4f, 1e-5f, false, 64, 48}, 7,
      GgmlType::Q4_K);
  return path;
}

// Generated mixtures of experts: Qwen3-MoE-shaped (top 3 of 8 experts of width 64, Q4_K: the
// expert rows of 256 take Q4_K, the down rows of 64 its Q5_0 substitute) and Qwen2-MoE-shaped (top
// 2 of 6 and a shared expert, q/k/v biases, Q8_0).
inline std::string tiny_qwen3moe_model() {
  static const std::string path = synth_model(
      {"tiny-qwen3moe", "qwen3moe", "test", 3, 256, 4, 2, 64, 512, 1000, 2048, false, 0, 0, 1e6f, 1e-6f, false, 0, 0,
       8, 3, 64},
      3, GgmlType::Q4_K);
  return path;
}
inline std::string tiny_qwen2moe_model() {
  static const std::string path = synth_q8_model(
      {"tiny-qwen2moe", "qwen2moe", "test", 2, 128, 4, 4, 32, 256, 1000, 2048, false, 0, 0, 1e6f, 1e-6f, true, 0, 0,
       6, 2, 64, 128},
      4);
  return path;
}

// A generated gpt-oss-shaped model: q/k/v/o biases, attention sinks, every other layer sliding
// (window 16), YaRN, top 3 of 6 experts with biases and the clamped SwiGLU; as gpt-oss files, the
// experts MXFP4 and the other matrices Q8_0.
inline std::string tiny_gpt_oss_model() {
  static const std::string path = synth_model(
      {"tiny-gpt-oss", "gpt-oss", "test", 4, 128, 4, 2, 64, 256, 1000, 2048, false, 16, 2, 1.5e5f, 1e-5f, true, 0, 0,
       6, 3, 128},
      14, GgmlType::MXFP4);
  return path;
}

// A generated Granite-shaped model (tied head): embeddings ×12, each branch ×0.22 into the residual
// stream, q·k ×0.05, and logits divided by 0.5 (Granite's own 8 or 16 would leave random weights'
// logits too small for the GPU tests' absolute bounds to see a scale missed).
inline std::string tiny_granite_model() {
  static const std::string path = synth_q8_model(
      {"tiny-granite", "granite", "test", 3, 256, 4, 2, 64, 512, 1000, 2048, true, 0, 0, 1e4f, 1e-5f, false, 0, 0, 0,
       0, 0, 0, 12.f, 0.22f, 0.05f, 0.5f},
      12);
  return path;
}

// A generated OLMo 3-shaped model (an olmo2 file: no pre-norms, whole-row q/k norms, post-norms;
// layers 0-2 and 4 sliding with a window of 8 and plain RoPE, layer 3 global with YaRN).
inline std::string tiny_olmo3_model() {
  static const std::string path = synth_q8_model(
      {"tiny-olmo3", "olmo2", "test", 5, 128, 4, 2, 32, 256, 1000, 2048, false, 8, 4, 5e5f, 1e-6f, false}, 15);
  return path;
}
// A generated OLMoE-shaped model: pre-norms, whole-row q/k norms, top 2 of 6 experts n_ff wide.
inline std::string tiny_olmoe_model() {
  static const std::string path = synth_q8_model(
      {"tiny-olmoe", "olmoe", "test", 2, 128, 4, 4, 32, 128, 1000, 2048, false, 0, 0, 1e4f, 1e-5f, false, 0, 0,
       6, 2, 128},
      16);
  return path;
}

// A generated SmolLM3-shaped model (tied head): layers 3 and 7 of 8 without RoPE, base 1e4 (so
// that the rotation the NoPE layers leave out turns far over the tests' prompts).
inline std::string tiny_smollm3_model() {
  static const std::string path = synth_q8_model(
      {"tiny-smollm3", "smollm3", "test", 8, 128, 4, 2, 32, 256, 1000, 2048, true, 0, 0, 1e4f, 1e-5f, false}, 17);
  return path;
}

// A generated ERNIE 4.5-shaped model (tied head, adjacent-pair RoPE) with use_bias's optional
// q/k/v and output biases.
inline std::string tiny_ernie4_5_model() {
  static const std::string path = [] {
    ShapePreset p{"tiny-ernie4_5", "ernie4_5", "test", 3, 128, 4, 1, 32, 256, 1000, 2048, true, 0, 0, 5e5f, 1e-5f, true};
    p.out_bias = true;
    return synth_q8_model(p, 18);
  }();
  return path;
}

// A generated EXAONE 4.0 32B-shaped model: no pre-norms, per-head q/k norms, post-norms; layers 0-2
// and 4 sliding (window 8) and rotating, layer 3 global without RoPE.
inline std::string tiny_exaone4_model() {
  static const std::string path = synth_q8_model(
      {"tiny-exaone4", "exaone4", "test", 5, 128, 4, 2, 32, 256, 1000, 2048, false, 8, 4, 1e4f, 1e-5f, false}, 19);
  return path;
}

// A generated GLM-4-0414-shaped model: pre- and post-norms, q/k/v biases, gate/up fused in ffn_up,
// the first half of each head (16 of 32 dims) rotated in adjacent pairs, an untied head.
inline std::string tiny_glm4_model() {
  static const std::string path = synth_q8_model(
      {"tiny-glm4", "glm4", "test", 3, 128, 4, 2, 32, 256, 1000, 2048, false, 0, 0, 1e4f, 1e-5f, true, 0, 16}, 22);
  return path;
}

// A copy of a mixture-of-experts file with each layer's gate and up experts in one
// ffn_gate_up_exps tensor (per expert its gate rows, then its up rows), as newer conversions
// store them: the same model in the other layout.
inline std::string merged_gate_up_copy(const std::string& path) {
  const auto f = gguf::File::open(path);
  gguf::Writer w;
  for (const auto& [k, v] : f->metadata()) w.set(k, v);
  for (const gguf::TensorInfo& t : f->tensors()) {
    if (t.name.find(".ffn_up_exps.") != std::string::npos) continue;
    const auto* data = static_cast<const uint8_t*>(t.data);
    if (t.name.find(".ffn_gate_exps.") == std::string::npos) {
      w.add_tensor(t.name, t.type, std::vector<int64_t>(t.ne, t.ne + t.n_dims), data, t.nbytes);
      continue;
    }
    std::string up_name = t.name;
    up_name.replace(up_name.find("gate_exps"), 9, "up_exps");
    const auto* up = static_cast<const uint8_t*>(f->require_tensor(up_name).data);
    const size_t slab = t.nbytes / size_t(t.ne[2]);  // one expert's rows
    std::vector<uint8_t> merged;
    for (int64_t e = 0; e < t.ne[2]; ++e)
      for (const uint8_t* part : {data, up}) merged.insert(merged.end(), part + size_t(e) * slab, part + size_t(e + 1) * slab);
    std::string name = t.name;
    name.replace(name.find("gate_exps"), 9, "gate_up_exps");
    w.add_tensor(name, t.type, {t.ne[0], 2 * t.ne[1], t.ne[2]}, merged.data(), merged.size());
  }
  const std::string out = path.substr(0, path.size() - 5) + "-merged.gguf";
  w.write(out);
  return out;
}

// A generated llama whose every matrix has type t (rows of 256 and 768: any k-quant or IQ4 type),
// the embedding table included, in this process's temp folder as tiny-<type>.gguf.
inline std::string tiny_model_of(GgmlType t) {
  const std::string name = std::string("tiny-") + type_name(t);
  return synth_model({name.c_str(), "llama", "test", 2, 256, 4, 2, 64, 768, 1500, 2048, false, 0, 0, 10000.f, 1e-5f,
                      false}, 11, t);
}

}  // namespace baton::test
