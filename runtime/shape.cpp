#include "runtime/shape.h"

#include <algorithm>

#include "gguf/gguf.h"
#include "kernels/cpu/packed.h"
#include "kernels/cuda/layout.h"
#include "runtime/config.h"

namespace baton {

uint32_t ModelShape::max_head_kv() const {
  uint32_t m = 0;
  for (const auto& l : layers) m = std::max(m, l.n_head_kv);
  return m;
}

uint64_t ModelShape::layer_weight_bytes() const {
  uint64_t s = 0;
  for (const auto& l : layers) s += l.weight_bytes;
  return s;
}

uint64_t ModelShape::expert_bytes() const {
  uint64_t s = 0;
  for (const auto& l : layers) s += l.expert_bytes;
  return s;
}

uint64_t ModelShape::total_weight_bytes() const {
  return layer_weight_bytes() + embedding_bytes + (tied_output ? 0 : output_bytes) +
         output_norm_bytes + shared_bytes;
}

bool layer_is_global(uint32_t il, uint32_t swa_period) {
  return swa_period != 0 && (il + 1) % swa_period == 0;
}

namespace {

}  // namespace

// Bytes a weight takes where it is used, on whichever device: a matrix of a packable type fills
// whole groups of 16 rows in a CPU stage (kernels/cpu/packed.h); on a GPU each row is split into
// its quants and scales and padded to 16 bytes (kernels/cuda/layout.h: a Q8_0 row of 576 elements
// is 612 bytes in the file and 624 on the GPU). The larger of the two, so the plan never falls
// short of either kind of stage's allocation.
uint64_t weight_used_bytes(GgmlType type, int64_t ne0, int64_t rows, uint64_t nbytes) {
  if (rows <= 1) return nbytes;
  uint64_t used = nbytes;
  if (cpu::packable(type)) used = std::max<uint64_t>(used, cpu::packed_bytes(type, rows, ne0));
  const TypeTraits& tt = traits(type);
  const bool float_row = tt.block_elems == 1;
  if (cuda::cuda_supports(type) && ne0 % tt.block_elems == 0 && (!float_row || ne0 % 8 == 0))
    used = std::max<uint64_t>(used, uint64_t(cuda::packed_row_bytes(type, ne0)) * uint64_t(rows));
  return used;
}

uint32_t default_swa_period(const std::string& arch) {
  if (arch == "gemma3") return 6;
  if (arch == "gemma2" || arch == "gpt-oss") return 2;
  if (arch == "cohere2" || arch == "olmo2" || arch == "exaone4") return 4;  // (olmo2: OLMo 3's files, the only ones with a window)
  return 1;
}

namespace {

uint32_t get_u32(const gguf::File& f, const std::string& key) {
  const int64_t v = f.get<int64_t>(key);
  if (v <= 0 || v > int64_t(UINT32_MAX)) fail(ErrorKind::Model, "{}: metadata '{}' = {} is out of range", f.path(), key, v);
  return uint32_t(v);
}

// A key that holds either one integer or one integer per layer.
std::vector<int64_t> ints(const gguf::File& f, const std::string& key) {
  const gguf::Value* v = f.find(key);
  if (!v) fail(ErrorKind::Model, "{}: missing metadata key '{}'", f.path(), key);
  std::vector<int64_t> out = v->type == gguf::ValueType::ARRAY ? f.get_ints(key) : std::vector<int64_t>{f.get<int64_t>(key)};
  for (int64_t x : out)
    if (x < 0 || x > int64_t(UINT32_MAX)) fail(ErrorKind::Model, "{}: metadata '{}' holds {}, out of range", f.path(), key, x);
  if (out.empty()) fail(ErrorKind::Model, "{}: metadata '{}' is an empty array", f.path(), key);
  return out;
}

bool is_experts(std::string_view name) { return name.find("_exps.") != std::string_view::npos; }

// A layer tensor's elements one token multiplies: of the stacked experts, the k it is routed to.
uint64_t active_elems(const ModelShape& s, std::string_view name, uint64_t elems) {
  if (s.n_expert == 0 || !is_experts(name)) return elems;
  return elems / s.n_expert * s.n_expert_used;
}

}  // namespace

ModelShape shape_from_gguf(const gguf::File& f) {
  refuse_adapter_as_model(f);
  ModelShape s;
  s.architecture = f.architecture();
  s.name = f.get_or<std::string>("general.name", s.architecture);
  s.n_layer = get_u32(f, f.arch_key("block_count"));
  s.n_embd = get_u32(f, f.arch_key("embedding_length"));
  s.n_ff = 0;  // some files give one value per layer: the largest sizes the scratch buffers
  for (int64_t v : ints(f, f.arch_key("feed_forward_length"))) s.n_ff = std::max(s.n_ff, uint32_t(v));
  for (int64_t h : ints(f, f.arch_key("attention.head_count"))) s.n_head = std::max(s.n_head, uint32_t(h));
  if (s.n_head == 0) fail(ErrorKind::Model, "{}: '{}' is 0", f.path(), f.arch_key("attention.head_count"));
  s.n_ctx_train = f.get_or<uint32_t>(f.arch_key("context_length"), 0);
  s.head_dim_k = f.get_or<uint32_t>(f.arch_key("attention.key_length"), s.n_embd / s.n_head);
  s.head_dim_v = f.get_or<uint32_t>(f.arch_key("attention.value_length"), s.n_embd / s.n_head);
  s.n_expert = f.get_or<uint32_t>(f.arch_key("expert_count"), 0);
  if (s.n_expert > 0) {
    s.n_expert_used = std::min(s.n_expert, f.get_or<uint32_t>(f.arch_key("expert_used_count"), 1));
    s.n_ff_exp = f.get_or<uint32_t>(f.arch_key("expert_feed_forward_length"), s.n_ff);
    s.n_ff_shexp = f.get_or<uint32_t>(f.arch_key("expert_shared_feed_forward_length"), 0);
  }

  // Per-layer KV head counts: a scalar, or an array with one entry per layer.
  std::vector<uint32_t> kv(s.n_layer, s.n_head);
  if (const std::string key = f.arch_key("attention.head_count_kv"); f.has(key)) {
    const auto v = ints(f, key);
    if (v.size() == 1) std::fill(kv.begin(), kv.end(), uint32_t(v[0]));
    else if (v.size() == s.n_layer) for (size_t i = 0; i < v.size(); i++) kv[i] = uint32_t(v[i]);
    else fail(ErrorKind::Model, "{}: '{}' has {} entries for {} layers", f.path(), key, v.size(), s.n_layer);
  }

  // Sliding window and which layers use it. The pattern key, when present, is either a period
  // (every N-th layer global) or one flag per layer (true: sliding).
  uint32_t window = 0;
  if (const std::string key = f.arch_key("attention.sliding_window"); f.has(key)) window = f.get<uint32_t>(key);
  std::vector<bool> sliding(s.n_layer, false);
  if (window > 0) {
    const std::string key = f.arch_key("attention.sliding_window_pattern");
    const gguf::Value* pat = f.find(key);
    if (pat && pat->type == gguf::ValueType::ARRAY) {
      if (pat->size() != s.n_layer)
        fail(ErrorKind::Model, "{}: '{}' has {} entries for {} layers", f.path(), key, pat->size(), s.n_layer);
      for (size_t i = 0; i < pat->size(); i++) sliding[i] = pat->item(i).u != 0 || pat->item(i).i != 0;
    } else {
      const uint32_t period = pat ? f.get<uint32_t>(key) : default_swa_period(s.architecture);
      for (uint32_t i = 0; i < s.n_layer; i++) sliding[i] = !layer_is_global(i, period);
    }
  }

  s.layers.resize(s.n_layer);
  for (uint32_t i = 0; i < s.n_layer; i++) {
    s.layers[i].n_head_kv = kv[i];
    s.layers[i].sliding_window = sliding[i] ? window : 0;
  }

  // Bytes: every tensor is counted exactly once, by where it is used.
  bool have_output = false;
  for (const auto& t : f.tensors()) {
    const int64_t il = block_index(t.name);
    const uint64_t nbytes = weight_used_bytes(t.type, t.ne[0], t.nrows(), t.nbytes);
    if (il >= 0) {
      if (il >= int64_t(s.n_layer))
        fail(ErrorKind::Model, "{}: tensor '{}' belongs to layer {} but the model has {} layers", f.path(), t.name, il, s.n_layer);
      s.layers[size_t(il)].weight_bytes += nbytes;
      s.layers[size_t(il)].weight_elems += active_elems(s, t.name, uint64_t(t.nelements()));
      if (is_experts(t.name)) s.layers[size_t(il)].expert_bytes += nbytes;
    } else if (t.name == "token_embd.weight") {
      s.embedding_bytes += nbytes;
      s.n_vocab = uint32_t(t.ne[1]);
    } else if (t.name.rfind("output.", 0) == 0) {
      s.output_bytes += nbytes;
      s.output_elems += uint64_t(t.nelements());
      have_output = true;
    } else if (t.name.rfind("output_norm.", 0) == 0) {
      s.output_norm_bytes += nbytes;
    } else {
      s.shared_bytes += nbytes;
    }
  }
  if (s.embedding_bytes == 0) fail(ErrorKind::Model, "{}: no token_embd.weight tensor", f.path());
  if (!have_output) {
    s.tied_output = true;
    s.output_bytes = s.embedding_bytes;
    s.output_elems = uint64_t(f.require_tensor("token_embd.weight").nelements());
  }
  if (const std::string key = f.arch_key("vocab_size"); f.has(key)) {
    const uint32_t v = f.get<uint32_t>(key);
    if (v != s.n_vocab) fail(ErrorKind::Model, "{}: '{}' = {} but token_embd has {} rows", f.path(), key, v, s.n_vocab);
  }
  return s;
}

// ---- presets ----------------------------------------------------------------------------------

const std::vector<ShapePreset>& shape_presets() {
  // From the models' published config.json files (hidden_size, num_hidden_layers, heads, kv heads,
  // head_dim, intermediate_size, vocab_size, max_position_embeddings, tie_word_embeddings).
  static const std::vector<ShapePreset> k = {
    // name, arch, what, layers, embd, heads, kv heads, head_dim, ff, vocab, ctx, tied, window, period, rope, eps, bias
    {"smollm2-135m", "llama", "SmolLM2 135M (tied head)", 30, 576, 9, 3, 64, 1536, 49152, 8192, true, 0, 0, 100000.f, 1e-5f, false},
    {"gemma3-270m", "gemma3", "Gemma 3 270M (tied head, 262k vocab, window 512)", 18, 640, 4, 1, 256, 2048, 262144, 32768, true, 512, 6, 1000000.f, 1e-6f, false},
    {"gemma2-2b", "gemma2", "Gemma 2 2B (tied head, 256k vocab, every other layer window 4096, soft-capped)", 26, 2304, 8, 4, 256, 9216, 256000, 8192, true, 4096, 2, 10000.f, 1e-6f, false},
    {"gemma2-9b", "gemma2", "Gemma 2 9B (tied head, 256k vocab, every other layer window 4096, soft-capped)", 42, 3584, 16, 8, 256, 14336, 256000, 8192, true, 4096, 2, 10000.f, 1e-6f, false},
    {"gemma3-1b", "gemma3", "Gemma 3 1B (tied head, 262k vocab, window 512)", 26, 1152, 4, 1, 256, 6912, 262144, 32768, true, 512, 6, 1000000.f, 1e-6f, false},
    // Gemma 1 (google/gemma-2b's and gemma-7b's config.json; CodeGemma's are the same): no windows,
    // heads of 256 (the 7B's 16 are wider than n_embd / 16), the 2B with one KV head.
    {"gemma-2b", "gemma", "Gemma 2B (tied head, 256k vocab, one KV head)", 18, 2048, 8, 1, 256, 16384, 256000, 8192, true, 0, 0, 10000.f, 1e-6f, false},
    {"gemma-7b", "gemma", "Gemma 7B (tied head, 256k vocab, 16 heads of 256 on a 3072-wide residual)", 28, 3072, 16, 16, 256, 24576, 256000, 8192, true, 0, 0, 10000.f, 1e-6f, false},
    {"qwen2-7b", "qwen2", "Qwen2 7B (q/k/v bias)", 28, 3584, 28, 4, 128, 18944, 152064, 32768, false, 0, 0, 1000000.f, 1e-6f, true},
    {"qwen3-0.6b", "qwen3", "Qwen3 0.6B (tied head, q/k norms)", 28, 1024, 16, 8, 128, 3072, 151936, 40960, true, 0, 0, 1000000.f, 1e-6f, false},
    {"qwen3-8b", "qwen3", "Qwen3 8B (q/k norms)", 36, 4096, 32, 8, 128, 12288, 151936, 40960, false, 0, 0, 1000000.f, 1e-6f, false},
    {"llama3-8b", "llama", "Llama 3 8B", 32, 4096, 32, 8, 128, 14336, 128256, 8192, false, 0, 0, 500000.f, 1e-5f, false},
    {"llama3-70b", "llama", "Llama 3 70B", 80, 8192, 64, 8, 128, 28672, 128256, 8192, false, 0, 0, 500000.f, 1e-5f, false},
    {"phi3-mini", "phi3", "Phi-3 mini 4k (fused q/k/v and gate/up, head dim 96)", 32, 3072, 32, 32, 96, 8192, 32064, 4096, false, 0, 0, 10000.f, 1e-5f, false},
    {"phi3.5-mini", "phi3", "Phi-3.5 mini (LongRoPE to 128k from 4k)", 32, 3072, 32, 32, 96, 8192, 32064, 131072, false, 0, 0, 10000.f, 1e-5f, false, 4096},
    {"phi4-mini", "phi3", "Phi-4 mini (tied head, 200k vocab, 3/4 of each head rotated, LongRoPE from 4k)", 32, 3072, 24, 8, 128, 8192, 200064, 131072, true, 0, 0, 10000.f, 1e-5f, false, 4096, 96},
    {"phi4-14b", "phi3", "Phi-4 14B (fused, GQA 4:1)", 40, 5120, 40, 10, 128, 17920, 100352, 16384, false, 0, 0, 250000.f, 1e-5f, false},
    // Mixtures of experts (experts, used per token, expert FFN width, shared expert width last).
    {"mixtral-8x7b", "llama", "Mixtral 8x7B (top 2 of 8 experts)", 32, 4096, 32, 8, 128, 14336, 32000, 32768, false, 0, 0, 1000000.f, 1e-5f, false, 0, 0, 8, 2, 14336},
    {"qwen3-30b-a3b", "qwen3moe", "Qwen3 30B-A3B (top 8 of 128 experts, 3B active)", 48, 2048, 32, 4, 128, 6144, 151936, 40960, false, 0, 0, 1000000.f, 1e-6f, false, 0, 0, 128, 8, 768},
    {"gpt-oss-20b", "gpt-oss", "gpt-oss 20B (top 4 of 32 experts, 3.6B active; every other layer window 128; sinks)", 24, 2880, 64, 8, 64, 2880, 201088, 131072, false, 128, 2, 150000.f, 1e-5f, true, 0, 0, 32, 4, 2880},
    {"gpt-oss-120b", "gpt-oss", "gpt-oss 120B (top 4 of 128 experts, 5.1B active; every other layer window 128; sinks)", 36, 2880, 64, 8, 64, 2880, 201088, 131072, false, 128, 2, 150000.f, 1e-5f, true, 0, 0, 128, 4, 2880},
    // IBM Granite 3.1 (granite-3.1-*-instruct's config.json: embedding_multiplier, residual_multiplier,
    // attention_multiplier, logits_scaling last), and Granite 3.0's smaller mixture.
    {"granite-3-8b", "granite", "Granite 3.1 8B (tied head; embeddings x12, branches x0.22, q.k x1/128, logits /16)", 40, 4096, 32, 8, 128, 12800, 49155, 131072, true, 0, 0, 10000000.f, 1e-5f, false, 0, 0, 0, 0, 0, 0, 12.f, 0.22f, 0.0078125f, 16.f},
    {"granite-3-2b", "granite", "Granite 3.1 2B (tied head; embeddings x12, branches x0.22, q.k x1/64, logits /8)", 40, 2048, 32, 8, 64, 8192, 49155, 131072, true, 0, 0, 5000000.f, 1e-5f, false, 0, 0, 0, 0, 0, 0, 12.f, 0.22f, 0.015625f, 8.f},
    {"granite-3-1b-a400m", "granitemoe", "Granite 3.0 1B-A400M (top 8 of 32 experts; tied head; Granite's multipliers, logits /6)", 24, 1024, 16, 8, 64, 512, 49155, 4096, true, 0, 0, 10000.f, 1e-6f, false, 0, 0, 32, 8, 512, 0, 12.f, 0.22f, 0.015625f, 6.f},
    // SmolLM3 3B (HuggingFaceTB/SmolLM3-3B's config.json; no_rope_layer_interval 4: layers 3, 7, ..., 35
    // without RoPE).
    {"smollm3-3b", "smollm3", "SmolLM3 3B (tied head, GQA 4:1; every 4th layer without RoPE)", 36, 2048, 16, 4, 128, 11008, 128256, 65536, true, 0, 0, 5000000.f, 1e-6f, false},
    // AllenAI OLMo 2 (config.json of OLMo-2-0425-1B, -1124-7B, -1124-13B, -0325-32B; the embedding
    // padded to 100352 rows), OLMo 3 (Olmo-3-1025-7B, -1125-32B: 3 of every 4 layers a 4096-token
    // window; YaRN x8 from 8192 on the global layers, which synth writes for olmo2 with a window)
    // and OLMoE-1B-7B-0924 (top 8 of 64 experts, 1024 wide, not renormalized).
    {"olmo2-1b", "olmo2", "OLMo 2 1B (no pre-norms, whole-row q/k norms, post-norms)", 16, 2048, 16, 16, 128, 8192, 100352, 4096, false, 0, 0, 500000.f, 1e-6f, false},
    {"olmo2-7b", "olmo2", "OLMo 2 7B", 32, 4096, 32, 32, 128, 11008, 100352, 4096, false, 0, 0, 500000.f, 1e-6f, false},
    {"olmo2-13b", "olmo2", "OLMo 2 13B", 40, 5120, 40, 40, 128, 13824, 100352, 4096, false, 0, 0, 500000.f, 1e-6f, false},
    {"olmo2-32b", "olmo2", "OLMo 2 32B (8 KV heads)", 64, 5120, 40, 8, 128, 27648, 100352, 4096, false, 0, 0, 500000.f, 1e-6f, false},
    {"olmo3-7b", "olmo2", "OLMo 3 7B (3 of 4 layers window 4096; YaRN x8 on the others)", 32, 4096, 32, 32, 128, 11008, 100352, 65536, false, 4096, 4, 500000.f, 1e-6f, false},
    {"olmo3-32b", "olmo2", "OLMo 3 32B (8 KV heads; 3 of 4 layers window 4096; YaRN x8 on the others)", 64, 5120, 40, 8, 128, 27648, 100352, 65536, false, 4096, 4, 500000.f, 1e-6f, false},
    {"olmoe-1b-7b", "olmoe", "OLMoE 1B-7B (top 8 of 64 experts, 1.3B active; whole-row q/k norms)", 16, 2048, 16, 16, 128, 1024, 50304, 4096, false, 0, 0, 10000.f, 1e-5f, false, 0, 0, 64, 8, 1024},
    // Baidu ERNIE-4.5-0.3B (its config.json: no biases, tied head; the context as recalled, 128k).
    {"ernie4.5-0.3b", "ernie4_5", "ERNIE 4.5 0.3B (tied head, GQA 8:1)", 18, 1024, 16, 2, 128, 3072, 103424, 131072, true, 0, 0, 500000.f, 1e-5f, false},
    // LG EXAONE 4.0 (EXAONE-4.0-1.2B: tied head, no window, every layer rotating; EXAONE-4.0-32B: 3 of
    // every 4 layers a 4096-token window, the global ones NoPE; shapes as their config.json files were
    // recalled, not checked against a file here. The Llama 3 RoPE scaling, x16 from 8192, is not
    // written by synth).
    {"exaone4-1.2b", "exaone4", "EXAONE 4.0 1.2B (tied head, GQA 4:1; no pre-norms, per-head q/k norms)", 30, 2048, 32, 8, 64, 4096, 102400, 65536, true, 0, 0, 1000000.f, 1e-5f, false},
    {"exaone4-32b", "exaone4", "EXAONE 4.0 32B (3 of 4 layers window 4096, the others without RoPE)", 64, 5120, 40, 8, 128, 27392, 102400, 131072, false, 4096, 4, 1000000.f, 1e-5f, false},
    // Zhipu GLM-4-9B-0414 (its config.json: head_dim 128, partial_rotary_factor 0.5, q/k/v biases,
    // untied head, rms_norm_eps 1e-5, rope_theta 1e4, 32k context): 64 of each head's 128 dims rotated.
    {"glm4-9b", "glm4", "GLM-4-9B-0414 (GQA 16:1, q/k/v biases, post-norms, half of each head rotated)", 40, 4096, 32, 2, 128, 13696, 151552, 32768, false, 0, 0, 10000.f, 1e-5f, true, 0, 64},
    {"qwen1.5-moe-a2.7b", "qwen2moe", "Qwen1.5 MoE A2.7B (top 4 of 60 experts and a shared one)", 24, 2048, 16, 16, 128, 5632, 151936, 8192, false, 0, 0, 1000000.f, 1e-6f, true, 0, 0, 60, 4, 1408, 5632},
  };
  return k;
}

const ShapePreset& find_preset(std::string_view name) {
  std::string names;
  for (const auto& p : shape_presets()) {
    if (name == p.name) return p;
    names += std::string(names.empty() ? "" : ", ") + p.name;
  }
  fail(ErrorKind::Usage, "unknown shape '{}' (known shapes: {})", name, names);
}

bool ModelShape::layer_elems_known() const {
  if (layers.empty()) return false;
  for (const auto& l : layers)
    if (l.weight_elems == 0) return false;
  return true;
}

uint64_t TensorSpec::nbytes() const {
  int64_t rows = 1;
  for (size_t i = 1; i < dims.size(); i++) rows *= dims[i];
  return uint64_t(rows) * row_bytes(type, dims.at(0));
}

GgmlType weight_type_for_row(GgmlType wanted, int64_t row) {
  const uint32_t block = traits(wanted).block_elems;
  if (row % block == 0) return wanted;
  GgmlType alt = GgmlType::F16;
  switch (wanted) {
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::IQ4_XS: alt = GgmlType::IQ4_NL; break;
    case GgmlType::Q4_K: alt = GgmlType::Q5_0; break;
    case GgmlType::Q5_K: alt = GgmlType::Q5_1; break;
    case GgmlType::Q6_K: alt = GgmlType::Q8_0; break;
    default: break;
  }
  return row % traits(alt).block_elems == 0 ? alt : GgmlType::F16;
}

std::vector<TensorSpec> preset_tensors(const ShapePreset& p, GgmlType type) {
  const int64_t E = p.n_embd, F = p.n_ff, V = p.n_vocab;
  const int64_t q = int64_t(p.n_head) * p.head_dim, kv = int64_t(p.n_head_kv) * p.head_dim;
  std::vector<TensorSpec> out;
  // MXFP4 is what gpt-oss files keep their expert matrices in, every other matrix in Q8_0 (or
  // wider): with MXFP4 the experts get it (a model without experts: its FFN matrices), the rest Q8_0.
  const bool mx = type == GgmlType::MXFP4;
  const GgmlType dense = mx ? GgmlType::Q8_0 : type, ffn_type = mx && p.n_expert > 0 ? GgmlType::Q8_0 : type;
  auto mat = [&](std::string name, int64_t cols, int64_t rows) {
    out.push_back({std::move(name), weight_type_for_row(dense, cols), {cols, rows}});
  };
  auto ffn = [&](std::string name, int64_t cols, int64_t rows) {  // the dense FFN's matrices
    out.push_back({std::move(name), weight_type_for_row(ffn_type, cols), {cols, rows}});
  };
  auto vec = [&](std::string name, int64_t n) { out.push_back({std::move(name), GgmlType::F32, {n}}); };
  const std::string_view arch = p.architecture;
  const bool gemma = arch == "gemma3" || arch == "gemma2";  // post-norms (Gemma 1, "gemma", has none)
  const bool glm4 = arch == "glm4";  // pre-norms and post-norms, fused gate/up
  const bool olmo = arch == "olmo2" || arch == "olmoe";  // q/k norms over the whole q and k rows
  const bool qk_norm = arch == "gemma3" || arch == "qwen3" || arch == "qwen3moe" || olmo || arch == "exaone4";
  const bool pre_norms = arch != "olmo2" && arch != "exaone4";  // olmo2, exaone4: post-norms only
  const bool phi3 = arch == "phi3";  // fused q/k/v, fused gate/up
  const bool oai = arch == "gpt-oss";  // output bias, sinks, router and expert biases

  mat("token_embd.weight", E, V);
  if (p.rope_long_ctx) {
    const int64_t pairs = (p.rope_dim ? p.rope_dim : p.head_dim) / 2;
    vec("rope_factors_long.weight", pairs);
    vec("rope_factors_short.weight", pairs);
  }
  for (uint32_t i = 0; i < p.n_layer; i++) {
    const std::string b = "blk." + std::to_string(i) + ".";
    if (pre_norms) vec(b + "attn_norm.weight", E);
    if (phi3) {
      mat(b + "attn_qkv.weight", E, q + 2 * kv);
    } else {
      mat(b + "attn_q.weight", E, q);
      mat(b + "attn_k.weight", E, kv);
      mat(b + "attn_v.weight", E, kv);
    }
    if (p.qkv_bias) {
      vec(b + "attn_q.bias", q);
      vec(b + "attn_k.bias", kv);
      vec(b + "attn_v.bias", kv);
    }
    if (qk_norm) {
      vec(b + "attn_q_norm.weight", olmo ? q : p.head_dim);
      vec(b + "attn_k_norm.weight", olmo ? kv : p.head_dim);
    }
    mat(b + "attn_output.weight", q, E);
    if (oai || p.out_bias) vec(b + "attn_output.bias", E);
    if (oai) {
      vec(b + "attn_sinks.weight", p.n_head);
    }
    if (gemma || glm4 || oai || !pre_norms) vec(b + "post_attention_norm.weight", E);  // gpt-oss: the FFN's pre-norm
    if (!oai && pre_norms) vec(b + "ffn_norm.weight", E);
    if (p.n_expert > 0) {  // the router in F32 (as converters and quantizers leave it), the experts stacked
      const int64_t X = p.n_expert, FX = p.n_ff_exp;
      out.push_back({b + "ffn_gate_inp.weight", GgmlType::F32, {E, X}});
      out.push_back({b + "ffn_gate_exps.weight", weight_type_for_row(type, E), {E, FX, X}});
      out.push_back({b + "ffn_up_exps.weight", weight_type_for_row(type, E), {E, FX, X}});
      out.push_back({b + "ffn_down_exps.weight", weight_type_for_row(type, FX), {FX, E, X}});
      if (oai) {
        vec(b + "ffn_gate_inp.bias", X);
        out.push_back({b + "ffn_gate_exps.bias", GgmlType::F32, {FX, X}});
        out.push_back({b + "ffn_up_exps.bias", GgmlType::F32, {FX, X}});
        out.push_back({b + "ffn_down_exps.bias", GgmlType::F32, {E, X}});
      }
      if (p.n_ff_shexp > 0) {
        vec(b + "ffn_gate_inp_shexp.weight", E);
        mat(b + "ffn_gate_shexp.weight", E, p.n_ff_shexp);
        mat(b + "ffn_up_shexp.weight", E, p.n_ff_shexp);
        mat(b + "ffn_down_shexp.weight", p.n_ff_shexp, E);
      }
    } else if (phi3 || glm4) {
      ffn(b + "ffn_up.weight", E, 2 * F);
    } else {
      ffn(b + "ffn_gate.weight", E, F);
      ffn(b + "ffn_up.weight", E, F);
    }
    if (p.n_expert == 0) ffn(b + "ffn_down.weight", F, E);
    if (gemma || glm4 || !pre_norms) vec(b + "post_ffw_norm.weight", E);
  }
  vec("output_norm.weight", E);
  if (!p.tied) mat("output.weight", E, V);
  return out;
}

ModelShape shape_from_preset(const ShapePreset& p, GgmlType type) {
  ModelShape s;
  s.name = p.name;
  s.architecture = p.architecture;
  s.n_layer = p.n_layer;
  s.n_embd = p.n_embd;
  s.n_head = p.n_head;
  s.head_dim_k = s.head_dim_v = p.head_dim;
  s.n_ff = p.n_ff;
  s.n_vocab = p.n_vocab;
  s.n_ctx_train = p.n_ctx_train;
  s.n_expert = p.n_expert;
  s.n_expert_used = p.n_expert_used;
  s.n_ff_exp = p.n_ff_exp;
  s.n_ff_shexp = p.n_ff_shexp;
  s.layers.resize(p.n_layer);
  for (uint32_t i = 0; i < p.n_layer; i++) {
    s.layers[i].n_head_kv = p.n_head_kv;
    s.layers[i].sliding_window = p.sliding_window && !layer_is_global(i, p.swa_period) ? p.sliding_window : 0;
  }
  bool have_output = false;
  uint64_t embd_elems = 0;
  for (const TensorSpec& t : preset_tensors(p, type)) {
    int64_t rows = 1;
    for (size_t i = 1; i < t.dims.size(); i++) rows *= t.dims[i];
    const uint64_t n = weight_used_bytes(t.type, t.dims.at(0), rows, t.nbytes());
    const uint64_t elems = uint64_t(rows) * uint64_t(t.dims.at(0));
    if (t.name.rfind("blk.", 0) == 0) {
      LayerShape& l = s.layers[std::stoul(t.name.substr(4))];
      l.weight_bytes += n;
      l.weight_elems += active_elems(s, t.name, elems);
      if (is_experts(t.name)) l.expert_bytes += n;
    } else if (t.name == "token_embd.weight") {
      s.embedding_bytes += n;
      embd_elems = elems;
    } else if (t.name == "output.weight") {
      s.output_bytes += n;
      s.output_elems = elems;
      have_output = true;
    }
    else if (t.name == "output_norm.weight") s.output_norm_bytes += n;
    else s.shared_bytes += n;
  }
  s.tied_output = !have_output;
  if (s.tied_output) s.output_bytes = s.embedding_bytes, s.output_elems = embd_elems;
  return s;
}

}  // namespace baton
