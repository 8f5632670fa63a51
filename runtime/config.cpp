// ModelConfig from GGUF metadata: one pass that collects every problem, then one Error listing all.
#include "runtime/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>

#include <fmt/format.h>

#include "gguf/gguf.h"
#include "quant/quant.h"

namespace baton {

namespace {

struct TensorRow { LayerTensor t; const char* name; bool bias; };
constexpr TensorRow kLayerTensors[] = {
  {LayerTensor::AttnNorm, "attn_norm", false},  {LayerTensor::Wq, "attn_q", false},
  {LayerTensor::Wk, "attn_k", false},           {LayerTensor::Wv, "attn_v", false},
  {LayerTensor::Wo, "attn_output", false},      {LayerTensor::Bq, "attn_q", true},
  {LayerTensor::Bk, "attn_k", true},            {LayerTensor::Bv, "attn_v", true},
  {LayerTensor::QNorm, "attn_q_norm", false},   {LayerTensor::KNorm, "attn_k_norm", false},
  {LayerTensor::PostAttnNorm, "post_attention_norm", false},
  {LayerTensor::FfnNorm, "ffn_norm", false},    {LayerTensor::Gate, "ffn_gate", false},
  {LayerTensor::Up, "ffn_up", false},           {LayerTensor::Down, "ffn_down", false},
  {LayerTensor::PostFfnNorm, "post_ffw_norm", false},
  {LayerTensor::Wqkv, "attn_qkv", false},
  {LayerTensor::GateInp, "ffn_gate_inp", false},       {LayerTensor::GateExps, "ffn_gate_exps", false},
  {LayerTensor::UpExps, "ffn_up_exps", false},         {LayerTensor::DownExps, "ffn_down_exps", false},
  {LayerTensor::GateInpShexp, "ffn_gate_inp_shexp", false}, {LayerTensor::GateShexp, "ffn_gate_shexp", false},
  {LayerTensor::UpShexp, "ffn_up_shexp", false},       {LayerTensor::DownShexp, "ffn_down_shexp", false},
  {LayerTensor::GateUpExps, "ffn_gate_up_exps", false},
  {LayerTensor::Bo, "attn_output", true},              {LayerTensor::Sinks, "attn_sinks", false},
  {LayerTensor::BGateInp, "ffn_gate_inp", true},       {LayerTensor::BGateExps, "ffn_gate_exps", true},
  {LayerTensor::BUpExps, "ffn_up_exps", true},         {LayerTensor::BDownExps, "ffn_down_exps", true},
};
static_assert(std::size(kLayerTensors) == size_t(LayerTensor::Count));

// The families Baton knows. Everything not listed here is an Error, not a guess.
struct Family {
  const char* arch;
  RopeStyle rope;
  Activation act;
  bool embd_scale_sqrt;  // multiply embeddings by sqrt(n_embd)
  bool post_norms, qk_norm, attn_bias;
  int swa_pattern;       // every Nth layer is global, the others sliding-window (0: all global)
  bool fused_gate_up = false;  // ffn_up is [n_embd, 2 n_ff]: gate rows then up rows, no ffn_gate
  // Sliding-window layers: their RoPE base unless the file says (rope.freq_base_swa; 0: the global
  // base) and their window unless the file says (0: the file must say).
  float local_rope_base = 10000.f;
  int default_window = 0;
  // Mixture of experts: 1 = the file may say (expert_count), 2 = it must; whether the top-k
  // weights are renormalized (the file's expert_weights_norm overrides); a shared expert.
  int moe = 0;
  bool moe_norm = true;
  bool shared_expert = false;
  // gpt-oss's additions (ModelConfig: attn_out_bias, attn_sinks, moe_bias, ffn_norm_as_post_attention),
  // and its sliding-window layers rotate with the global layers' (scaled) frequencies.
  bool oai = false;
  // Granite's multipliers from the file (ModelConfig: embd_scale, residual_scale, attn_scale,
  // logit_scale); its biases (optional in llama.cpp, absent from every Granite 3 file) are refused.
  bool granite = false;
  // Every Nth layer ((l+1) % N == 0) has no rotary embedding (ModelConfig::layer_nope; 0: none).
  // The files carry no key for it (llama.cpp fixes SmolLM3's at 4, as its config.json says).
  int nope_period = 0;
  // OLMo's: no pre-norms (olmo2: the blocks read the residual stream, their outputs normed by the
  // post-norms), q/k norms over the whole q and k rows instead of per head (olmo2, olmoe), and
  // sliding-window layers that rotate plainly, with no YaRN scaling or magnitude (OLMo 3).
  bool pre_norms = true;
  bool qk_norm_full = false;
  bool local_rope_plain = false;
  // The q/k/v and output projections may carry biases (ERNIE's use_bias): each kind used when layer
  // 0 has it in the file, then required in every layer (ernie4_5).
  bool biases_optional = false;
  // EXAONE 4's hybrid attention: when the file has a window, its global layers use no rotary
  // embedding (NoPE) and its sliding ones rotate with the global frequencies, the file's Llama 3
  // factors (rope_freqs.weight) included.
  bool nope_global = false;
  bool local_rope_global = false;
};
// gemma3: the stored RMSNorm weights already include Gemma's +1 (norm_add_one stays false). Checked
// on gemma-3-270m Q4_K_M with a double-precision reference: as stored, "The capital of France is"
// ranks " the", " a", " Paris" on top; with another +1 added the predictions are garbage.
constexpr Family kFamilies[] = {
  // llama files with experts are Mixtral's: top-2 of 8, weights renormalized.
  {"llama", RopeStyle::Adjacent, Activation::SiLU, false, false, false, false, 0, false, 10000.f, 0, 1},
  {"qwen2", RopeStyle::NeoX, Activation::SiLU, false, false, false, true, 0},
  {"gemma3", RopeStyle::NeoX, Activation::GeluTanh, true, true, true, false, 6},
  // Gemma 2: Gemma 3 without q/k norms, every other layer sliding (window 4096 by default) with the
  // global RoPE base, attention scores soft-capped (attn_logit_softcapping) as well as the logits.
  {"gemma2", RopeStyle::NeoX, Activation::GeluTanh, true, true, false, false, 2, false, 0.f, 4096},
  // Gemma 1 (2B, 7B; CodeGemma, Gemma 1.1): Gemma 3's layer without q/k norms or post-norms, no
  // sliding windows or soft-caps. As for gemma3, its converter adds Gemma's +1 to every stored
  // norm weight, so norm_add_one stays false. Heads of attention.key_length (256, wider than
  // n_embd / n_head at 7B), q·k scaled by 1/sqrt(head_dim); no output.weight (the head is tied).
  {.arch = "gemma", .rope = RopeStyle::NeoX, .act = Activation::GeluTanh, .embd_scale_sqrt = true},
  {"qwen3", RopeStyle::NeoX, Activation::SiLU, false, false, true, false, 0},  // q/k norms, no biases
  // Phi-3, 3.5 and 4: fused q/k/v and gate/up matrices; the 128k files add long-context RoPE factors.
  {"phi3", RopeStyle::NeoX, Activation::SiLU, false, false, false, false, 0, true},
  // Qwen3 MoE (30B-A3B, 235B-A22B): Qwen3's attention, top-8 of 128 experts renormalized.
  {"qwen3moe", RopeStyle::NeoX, Activation::SiLU, false, false, true, false, 0, false, 10000.f, 0, 2},
  // Qwen1.5/Qwen2 MoE: Qwen2's attention (biases), top-k weights as the softmax gives them (not
  // renormalized), and a shared expert gated by a sigmoid.
  {"qwen2moe", RopeStyle::NeoX, Activation::SiLU, false, false, false, true, 0, false, 10000.f, 0, 2, false, true},
  // gpt-oss (20B, 120B): q/k/v/o biases, sinks, every other layer sliding (window from the file)
  // with the global RoPE (YaRN-scaled), top-4 experts with biases and the clamped SwiGLU. Its
  // router's softmax over the k chosen logits is the renormalized top-k of the softmax over all.
  {"gpt-oss", RopeStyle::NeoX, Activation::SwiGluOai, false, false, false, true, 2, false, 0.f, 0, 2, true, false, true},
  // IBM Granite 3.x: llama's layer (the converter permutes Q/K for adjacent pairs, as for llama)
  // with four multipliers from the file. granitemoe (Granite 3.0/3.1 1B-A400M, 3B-A800M): the FFN a
  // mixture, the router's top k softmaxed among themselves (= the renormalized top k); its
  // GraniteMoeShared variant's ungated shared expert is not supported.
  {"granite", RopeStyle::Adjacent, Activation::SiLU, false, false, false, false, 0, false, 10000.f, 0, 1, true, false, false, true},
  {"granitemoe", RopeStyle::Adjacent, Activation::SiLU, false, false, false, false, 0, false, 10000.f, 0, 2, true, false, false, true},
  // SmolLM3 (3B): llama's layer (the converter permutes Q/K for adjacent pairs, as for llama), every
  // 4th layer without RoPE (NoPE: layers 3, 7, ..., 35 of 36).
  {"smollm3", RopeStyle::Adjacent, Activation::SiLU, false, false, false, false, 0, false, 10000.f, 0, 0, true, false, false, false, 4},
  // AllenAI OLMo 2 (1B-32B) and OLMo 3 (same arch): no pre-norms, q and k each RMS-normed over their
  // whole row, NeoX RoPE (the converter does not permute), post-attention and post-FFN norms before
  // each residual add. OLMo 3's files add attention.sliding_window (and a per-layer pattern; else 3
  // sliding layers of every 4): those rotate plainly with the global base (or rope.freq_base_swa),
  // the global layers with the file's YaRN. A window of -1 here: the file may say, none if not.
  {"olmo2", RopeStyle::NeoX, Activation::SiLU, false, true, true, false, 4, false, 0.f, -1, 0, true, false, false, false, 0,
   false, true, true},
  // OLMoE (1B-7B): llama's pre-norm layer with OLMo's whole-row q/k norms, top-8 of 64 experts, the
  // chosen weights as the softmax over all gives them (not renormalized; llama.cpp ignores the key).
  {"olmoe", RopeStyle::NeoX, Activation::SiLU, false, false, true, false, 0, false, 10000.f, 0, 2, false, false, false, false, 0,
   true, true},
  // Baidu ERNIE 4.5 dense (0.3B): llama's layer with adjacent-pair RoPE (llama.cpp's rope type for
  // ernie4_5 is NORM; checked against it on synthetic files), optional q/k/v and output biases.
  // The mixture (ernie4_5-moe) is another architecture, not supported.
  {.arch = "ernie4_5", .rope = RopeStyle::Adjacent, .act = Activation::SiLU, .biases_optional = true},
  // LG EXAONE 4.0 (1.2B, 32B): OLMo 2's placement (no pre-norms; post_attention_norm and post_ffw_norm
  // on each block's output) with q/k norms per head, NeoX RoPE. With attention.sliding_window (32B:
  // 4096, one flag per layer, else 3 of every 4 sliding) the global layers are NoPE and the sliding
  // ones rotate (Llama 3 scaling from rope_freqs.weight); without one every layer is global and
  // rotates (1.2B). (llama.cpp decides the hybrid layout by n_layer == 64 instead of by the key.)
  {.arch = "exaone4", .rope = RopeStyle::NeoX, .act = Activation::SiLU, .post_norms = true, .qk_norm = true,
   .swa_pattern = 4, .local_rope_base = 0.f, .default_window = -1, .pre_norms = false, .nope_global = true,
   .local_rope_global = true},
  // Zhipu GLM-4-0414 (9B, 32B) and GLM-Z1 (arch glm4; not the older chatglm files): pre-norms plus
  // post-norms on the attention and FFN outputs before each residual add (post_self_attn_layernorm
  // and post_mlp_layernorm: post_attention_norm, post_ffw_norm), q/k/v biases, gate/up fused in
  // ffn_up (gate rows first), an untied head. RoPE on the first rope.dimension_count dims of each
  // head (partial_rotary_factor 0.5: half of them) in interleaved pairs (x[2i], x[2i+1]): llama.cpp's
  // rope type for glm4 is NORM and its converter does not permute Q/K. Sectioned (M-RoPE) files,
  // GLM-4.1V's text model, are refused below.
  {.arch = "glm4", .rope = RopeStyle::Adjacent, .act = Activation::SiLU, .post_norms = true, .attn_bias = true,
   .fused_gate_up = true},
};

}  // namespace

const char* layer_tensor_name(LayerTensor t) { return kLayerTensors[int(t)].name; }

std::string layer_tensor_key(int layer, LayerTensor t) {
  const TensorRow& r = kLayerTensors[int(t)];
  return fmt::format("blk.{}.{}.{}", layer, r.name, r.bias ? "bias" : "weight");
}

int64_t block_index(std::string_view name) {
  if (!name.starts_with("blk.")) return -1;
  const char* b = name.data() + 4;
  const char* e = name.data() + name.size();
  int64_t v = -1;
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p == b || p == e || *p != '.') return -1;
  return v;
}

bool ModelConfig::has(LayerTensor t) const {
  switch (t) {
    case LayerTensor::Bq: case LayerTensor::Bk: case LayerTensor::Bv: return attn_bias;
    case LayerTensor::QNorm: case LayerTensor::KNorm: return qk_norm;
    case LayerTensor::PostAttnNorm: return post_norms || ffn_norm_as_post_attention;
    case LayerTensor::PostFfnNorm: return post_norms;
    case LayerTensor::AttnNorm: return pre_norms;
    case LayerTensor::FfnNorm: return pre_norms && !ffn_norm_as_post_attention;
    case LayerTensor::Bo: return attn_out_bias;
    case LayerTensor::Sinks: return attn_sinks;
    case LayerTensor::BGateInp: case LayerTensor::BDownExps: return is_moe() && moe_bias;
    case LayerTensor::BGateExps: case LayerTensor::BUpExps: return is_moe() && moe_bias && !fused_gate_up_exps;
    case LayerTensor::Wq: case LayerTensor::Wk: case LayerTensor::Wv: return !fused_qkv;
    case LayerTensor::Wqkv: return fused_qkv;
    case LayerTensor::Gate: return !fused_gate_up && !is_moe();
    case LayerTensor::Up: case LayerTensor::Down: return !is_moe();
    case LayerTensor::GateInp: case LayerTensor::DownExps: return is_moe();
    case LayerTensor::GateExps: case LayerTensor::UpExps: return is_moe() && !fused_gate_up_exps;
    case LayerTensor::GateUpExps: return is_moe() && fused_gate_up_exps;
    case LayerTensor::GateInpShexp: case LayerTensor::GateShexp: case LayerTensor::UpShexp:
    case LayerTensor::DownShexp:
      return n_ff_shexp > 0;
    default: return true;
  }
}

std::vector<float> rope_frequencies(int dim, float base, const RopeScaling& s) {
  std::vector<float> f(size_t(dim / 2));
  const double pi = 3.14159265358979323846;
  for (int i = 0; i < dim / 2; ++i) {
    double theta = std::pow(double(base), -2.0 * i / dim);
    if (s.type == "linear") {
      theta /= s.factor;
    } else if (s.type == "llama3") {
      // Long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between.
      const double wavelen = 2 * pi / theta;
      const double lo_wavelen = s.original_ctx / s.low_freq_factor;
      const double hi_wavelen = s.original_ctx / s.high_freq_factor;
      if (wavelen > lo_wavelen) {
        theta /= s.factor;
      } else if (wavelen >= hi_wavelen) {
        const double smooth = (s.original_ctx / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        theta = (1 - smooth) * theta / s.factor + smooth * theta;
      }
    } else if (s.type == "yarn") {
      // The pair that turns r times over the original context: dim·ln(ctx / (2π·r)) / (2·ln base).
      auto pair_turning = [&](double r) { return dim * std::log(s.original_ctx / (2 * pi * r)) / (2 * std::log(double(base))); };
      double lo = pair_turning(s.beta_fast), hi = pair_turning(s.beta_slow);
      if (s.yarn_truncate) lo = std::floor(lo), hi = std::ceil(hi);
      lo = std::max(0.0, lo);
      hi = std::min(double(dim - 1), hi);
      const double keep = (1 - std::clamp((i - lo) / std::max(0.001, hi - lo), 0.0, 1.0)) * s.ext_factor;
      theta = theta / s.factor * (1 - keep) + theta * keep;
    }
    f[size_t(i)] = float(theta);
  }
  return f;
}

float yarn_mscale(float factor, float log_multiplier) {
  if (!(factor > 1)) return 1.f;
  const double m = 1 + 0.1 * std::log(double(factor));
  return float(log_multiplier != 0 ? m / (1 + 0.1 * log_multiplier * std::log(double(factor))) : m);
}

float attention_scale(const std::string& arch, int n_layer, int n_embd, int n_head, int head_dim_k) {
  const bool gemma_27b = ((arch == "gemma3" && n_layer == 62) || (arch == "gemma2" && n_layer == 46)) && n_head > 0;
  const int query_pre_attn_scalar = gemma_27b ? n_embd / n_head : head_dim_k;
  return 1.f / std::sqrt(float(query_pre_attn_scalar));
}

void refuse_adapter_as_model(const gguf::File& f) {
  if (f.get_or<std::string>("general.type", "") == "adapter")
    fail(ErrorKind::Model, "{}: a LoRA adapter, not a model: give the model with -m and this file with --lora", f.path());
}

ModelConfig ModelConfig::from_gguf(const gguf::File& f) {
  refuse_adapter_as_model(f);
  std::vector<std::string> problems;
  ModelConfig c;
  if (!f.has("general.architecture")) {
    fail(ErrorKind::Model, "{}: no general.architecture key: not a model file", f.path());
  }
  c.arch = f.get<std::string>("general.architecture");
  c.name = f.get_or<std::string>("general.name", "");
  const Family* fam = nullptr;
  for (const Family& x : kFamilies) if (c.arch == x.arch) fam = &x;
  if (!fam) {
    std::string known;
    for (const Family& x : kFamilies) known += fmt::format("{}{}", known.empty() ? "" : ", ", x.arch);
    fail(ErrorKind::Model, "{}: architecture '{}' is not supported (supported: {})", f.path(), c.arch, known);
  }

  // Typed reads that record a problem instead of throwing.
  auto get_int = [&](const char* suffix, bool required, int64_t dflt) -> int64_t {
    const std::string key = f.arch_key(suffix);
    const gguf::Value* v = f.find(key);
    if (!v) {
      if (required) problems.push_back(fmt::format("missing key {}", key));
      return dflt;
    }
    if (!v->is_int()) {
      problems.push_back(fmt::format("{} must be an integer, found {}", key, gguf::value_type_name(v->type)));
      return dflt;
    }
    try { return f.get<int64_t>(key); } catch (const Error& e) { problems.push_back(e.what()); }
    return dflt;
  };
  auto get_float = [&](const char* suffix, double dflt) -> double {
    const std::string key = f.arch_key(suffix);
    if (!f.has(key)) return dflt;
    try { return f.get<double>(key); } catch (const Error& e) { problems.push_back(e.what()); }
    return dflt;
  };
  // An out-of-range value is reported, and 1 stands in for it until all problems are listed:
  // the checks below divide by these counts.
  auto positive = [&](const char* what, int64_t v) {
    if (v > 0 && v <= (int64_t(1) << 24)) return int(v);
    problems.push_back(fmt::format("{} = {} is out of range", what, v));
    return 1;
  };

  c.n_layer = positive("block_count", get_int("block_count", true, 1));
  c.n_embd = positive("embedding_length", get_int("embedding_length", true, 1));
  c.n_head = positive("attention.head_count", get_int("attention.head_count", true, 1));
  c.n_head_kv = positive("attention.head_count_kv", get_int("attention.head_count_kv", false, c.n_head));
  c.n_ff = positive("feed_forward_length", get_int("feed_forward_length", true, 1));
  c.n_ctx_train = positive("context_length", get_int("context_length", true, 1));
  c.head_dim_k = positive("attention.key_length",
                          get_int("attention.key_length", false, c.n_head > 0 ? c.n_embd / c.n_head : 1));
  c.head_dim_v = positive("attention.value_length", get_int("attention.value_length", false, c.head_dim_k));
  c.rope_dim = positive("rope.dimension_count", get_int("rope.dimension_count", false, c.head_dim_k));
  c.rms_eps = float(get_float("attention.layer_norm_rms_epsilon", 1e-5));
  c.rope_base = float(get_float("rope.freq_base", 10000.0));
  if (c.n_head_kv > 0 && c.n_head % c.n_head_kv != 0)
    problems.push_back(fmt::format("head_count {} is not a multiple of head_count_kv {}", c.n_head, c.n_head_kv));
  if (!f.has(f.arch_key("attention.key_length")) && c.n_embd % c.n_head != 0)
    problems.push_back(fmt::format("embedding_length {} is not a multiple of head_count {}", c.n_embd, c.n_head));
  if (c.rope_dim > c.head_dim_k || c.rope_dim % 2 != 0)
    problems.push_back(fmt::format("rope.dimension_count {} must be even and <= head dim {}", c.rope_dim, c.head_dim_k));
  if (!(c.rms_eps > 0 && c.rms_eps < 1)) problems.push_back(fmt::format("rms epsilon {} is out of range", c.rms_eps));
  if (!(c.rope_base > 1)) problems.push_back(fmt::format("rope.freq_base {} is out of range", c.rope_base));

  // Vocabulary: the key, else the token list, else the embedding's rows.
  const gguf::TensorInfo* emb = f.tensor("token_embd.weight");
  if (f.has(f.arch_key("vocab_size"))) {
    c.n_vocab = positive("vocab_size", get_int("vocab_size", true, 1));
  } else if (const gguf::Value* toks = f.find("tokenizer.ggml.tokens")) {
    c.n_vocab = int(toks->size());
  } else if (emb) {
    c.n_vocab = int(emb->ne[1]);
  }

  // Family flags.
  c.rope_style = fam->rope;
  c.act = fam->act;
  c.embd_scale = fam->embd_scale_sqrt ? std::sqrt(float(c.n_embd)) : 1.f;
  c.post_norms = fam->post_norms;
  c.qk_norm = fam->qk_norm;
  c.qk_norm_full = fam->qk_norm_full;
  c.pre_norms = fam->pre_norms;
  c.attn_bias = fam->attn_bias;
  c.attn_scale = attention_scale(c.arch, c.n_layer, c.n_embd, c.n_head, c.head_dim_k);
  if (fam->granite) {  // a multiplier of 0 or a missing key means none (as llama.cpp reads them)
    auto multiplier = [&](const char* key, float dflt) {
      const double v = get_float(key, 0.0);
      if (!(std::isfinite(v) && v >= 0)) problems.push_back(fmt::format("{} = {} must be finite and >= 0", f.arch_key(key), v));
      return v > 0 ? float(v) : dflt;
    };
    c.embd_scale = multiplier("embedding_scale", 1.f);
    c.residual_scale = multiplier("residual_scale", 1.f);
    c.attn_scale = multiplier("attention.scale", c.attn_scale);
    c.logit_scale = multiplier("logit_scale", 1.f);
    for (const char* t : {"blk.0.attn_output.bias", "blk.0.ffn_gate.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias"})
      if (f.tensor(t)) problems.push_back(fmt::format("{}: Granite with biases is not supported", t));
    if (f.has(f.arch_key("expert_shared_feed_forward_length")))
      problems.push_back(fmt::format("{}: a shared expert (GraniteMoeShared) is not supported",
                                     f.arch_key("expert_shared_feed_forward_length")));
  }
  c.final_softcap = float(get_float("final_logit_softcapping", 0.0));
  c.attn_softcap = float(get_float("attn_logit_softcapping", 0.0));
  if (!(c.attn_softcap >= 0) || !(c.final_softcap >= 0))
    problems.push_back(fmt::format("soft-capping values {} / {} must be >= 0", c.attn_softcap, c.final_softcap));
  c.rope_base_local = float(get_float("rope.freq_base_swa", fam->local_rope_base > 0 ? fam->local_rope_base : c.rope_base));
  c.fused_qkv = f.tensor("blk.0.attn_qkv.weight") != nullptr;
  c.fused_gate_up = fam->fused_gate_up;
  c.attn_out_bias = c.attn_sinks = c.moe_bias = c.ffn_norm_as_post_attention = fam->oai;
  if (fam->biases_optional) {
    c.attn_bias = f.tensor("blk.0.attn_q.bias") != nullptr;
    c.attn_out_bias = f.tensor("blk.0.attn_output.bias") != nullptr;
  }
  if (f.has(f.arch_key("rope.dimension_sections")))  // (no family here rotates in sections)
    problems.push_back(fmt::format("{}: sectioned (multimodal) RoPE is not supported", f.arch_key("rope.dimension_sections")));
  if (get_int("nextn_predict_layers", false, 0) > 0)  // (GLM-OCR's glm4 files: block_count counts an MTP layer)
    problems.push_back(fmt::format("{}: next-token prediction (MTP) layers are not supported", f.arch_key("nextn_predict_layers")));
  if (c.fused_qkv && c.attn_bias) problems.push_back("a fused attn_qkv with q/k/v biases is not supported");
  if (c.moe_bias && f.tensor("blk.0.ffn_gate_up_exps.weight"))
    problems.push_back("expert biases with a fused ffn_gate_up_exps are not supported");

  // Mixture of experts.
  if (fam->moe == 2) c.n_expert = positive("expert_count", get_int("expert_count", true, 1));
  else if (fam->moe == 1) c.n_expert = int(get_int("expert_count", false, 0));
  if (c.n_expert > 0) {
    c.n_expert_used = int(get_int("expert_used_count", true, 1));
    c.n_ff_exp = positive("expert_feed_forward_length", get_int("expert_feed_forward_length", false, c.n_ff));
    if (fam->shared_expert)
      c.n_ff_shexp = positive("expert_shared_feed_forward_length",
                              get_int("expert_shared_feed_forward_length", true, c.n_ff));
    c.expert_weights_norm = fam->moe_norm;
    c.fused_gate_up_exps = f.tensor("blk.0.ffn_gate_up_exps.weight") != nullptr;
    if (const std::string key = f.arch_key("expert_weights_norm"); f.has(key)) {
      try { c.expert_weights_norm = f.get<bool>(key); } catch (const Error& e) { problems.push_back(e.what()); }
    }
    if (const std::string key = f.arch_key("expert_gating_func"); f.has(key) && get_int("expert_gating_func", false, 1) != 1)
      problems.push_back(fmt::format("{}: only softmax gating (1) is supported", key));
    if (c.n_expert > 4096 || c.n_expert_used < 1 || c.n_expert_used > c.n_expert)
      problems.push_back(fmt::format("expert_used_count {} must be in [1, expert_count {}] (at most 4096 experts)",
                                     c.n_expert_used, c.n_expert));
    if (!f.tensor("blk.0.ffn_gate_exps.weight") && !c.fused_gate_up_exps && f.tensor("blk.0.ffn_gate.0.weight"))
      problems.push_back("the experts are stored one tensor each (blk.N.ffn_gate.E.weight: an old Mixtral conversion); "
                         "convert the model again, to stacked ffn_gate_exps / ffn_up_exps / ffn_down_exps tensors");
  } else if (c.n_expert < 0) {
    problems.push_back(fmt::format("expert_count {} is out of range", c.n_expert));
  }

  c.layer_window.assign(size_t(std::max(c.n_layer, 0)), 0);
  // (default_window < 0: the window is optional, no sliding layers without it or with 0: olmo2.)
  const bool optional_window = fam->default_window < 0;
  if (fam->swa_pattern > 0 && (!optional_window || get_int("attention.sliding_window", false, 0) > 0)) {
    c.sliding_window = positive("attention.sliding_window", get_int("attention.sliding_window", fam->default_window == 0,
                                                                     fam->default_window));
    const gguf::Value* pv = f.find(f.arch_key("attention.sliding_window_pattern"));
    if (pv && pv->type == gguf::ValueType::ARRAY) {  // per layer: true = sliding (OLMo 3's converter)
      if (pv->elem != gguf::ValueType::BOOL || pv->size() != size_t(std::max(c.n_layer, 0)))
        problems.push_back(fmt::format("{} must be {} booleans", f.arch_key("attention.sliding_window_pattern"), c.n_layer));
      else
        for (int l = 0; l < c.n_layer; ++l) c.layer_window[size_t(l)] = pv->item(size_t(l)).u ? c.sliding_window : 0;
    } else {
      const int pattern = int(get_int("attention.sliding_window_pattern", false, fam->swa_pattern));
      for (int l = 0; l < c.n_layer; ++l)
        if (pattern <= 0 || (l + 1) % pattern != 0) c.layer_window[size_t(l)] = c.sliding_window;
    }
  }
  c.layer_nope.assign(size_t(std::max(c.n_layer, 0)), false);
  for (int l = 0; fam->nope_period > 0 && l < c.n_layer; ++l) c.layer_nope[size_t(l)] = (l + 1) % fam->nope_period == 0;
  for (int l = 0; fam->nope_global && c.sliding_window > 0 && l < c.n_layer; ++l)
    c.layer_nope[size_t(l)] = c.layer_window[size_t(l)] == 0;
  if (fam->local_rope_global && f.has(f.arch_key("rope.freq_base_swa")) &&
      float(get_float("rope.freq_base_swa", 0.0)) != c.rope_base)
    problems.push_back(fmt::format("{}: a RoPE base of the sliding layers' own is not supported for {}",
                                   f.arch_key("rope.freq_base_swa"), c.arch));

  // RoPE frequencies, with scaling for global layers only (local layers use the plain local base).
  RopeScaling rs;
  rs.type = f.get_or<std::string>(f.arch_key("rope.scaling.type"), "none");
  if (rs.type != "none") {
    rs.factor = float(get_float("rope.scaling.factor", 1.0));
    if (!(rs.factor > 0)) problems.push_back(fmt::format("rope.scaling.factor {} must be > 0", rs.factor));
  }
  if (rs.type == "llama3") {
    rs.low_freq_factor = float(get_float("rope.scaling.low_freq_factor", 1.0));
    rs.high_freq_factor = float(get_float("rope.scaling.high_freq_factor", 4.0));
    rs.original_ctx = int(get_int("rope.scaling.original_context_length", true, 8192));
    if (!(rs.high_freq_factor > rs.low_freq_factor))
      problems.push_back("rope scaling: high_freq_factor must exceed low_freq_factor");
  } else if (rs.type == "yarn") {
    rs.original_ctx = int(get_int("rope.scaling.original_context_length", true, 4096));
    rs.beta_fast = float(get_float("rope.scaling.yarn_beta_fast", 32.0));
    rs.beta_slow = float(get_float("rope.scaling.yarn_beta_slow", 1.0));
    rs.ext_factor = float(get_float("rope.scaling.yarn_ext_factor", 1.0));
    rs.yarn_truncate = !fam->oai;
    if (!(rs.beta_fast > 0)) problems.push_back(fmt::format("yarn: rope.scaling.yarn_beta_fast {} must be > 0", rs.beta_fast));
    if (!(rs.beta_slow > 0)) problems.push_back(fmt::format("yarn: rope.scaling.yarn_beta_slow {} must be > 0", rs.beta_slow));
    if (!(rs.original_ctx > 0))
      problems.push_back(fmt::format("yarn: rope.scaling.original_context_length {} must be > 0", rs.original_ctx));
    if (!(rs.ext_factor >= 0 && rs.ext_factor <= 1))
      problems.push_back(fmt::format("yarn: rope.scaling.yarn_ext_factor {} must be in [0, 1]", rs.ext_factor));
  } else if (rs.type != "none" && rs.type != "linear") {
    problems.push_back(fmt::format("rope.scaling.type '{}' is not supported (none, linear, llama3, yarn)", rs.type));
  }
  c.rope_scaling = rs.type;
  c.rope_scale_factor = rs.factor;
  if (c.rope_dim > 0 && c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim_k) {
    c.rope_freqs = rope_frequencies(c.rope_dim, c.rope_base, rs);
    c.rope_freqs_local = fam->oai ? c.rope_freqs : rope_frequencies(c.rope_dim, c.rope_base_local, RopeScaling{});
    // Per-pair divisors of the frequencies stored as tensors: Llama 3's scaling (rope_freqs.weight,
    // instead of keys), then Phi-3's LongRoPE factors for short and for long contexts (use_context
    // picks; rope.scaling.attn_factor below is their magnitude).
    auto divided = [&](const char* name, const std::vector<float>& from, std::vector<float>& out) {
      const gguf::TensorInfo* rf = f.tensor(name);
      if (!rf) return false;
      if (rf->type != GgmlType::F32 || rf->nelements() != c.rope_dim / 2) {
        problems.push_back(fmt::format("{} must be F32 [{}], found {} {}", name, c.rope_dim / 2, type_name(rf->type),
                                       rf->shape_str()));
        return false;
      }
      const float* d = reinterpret_cast<const float*>(rf->data);
      for (int i = 0; i < c.rope_dim / 2; ++i)
        if (!(d[i] > 0)) {
          problems.push_back(fmt::format("{}[{}] = {} must be > 0", name, i, d[i]));
          return false;
        }
      out = from;
      for (int i = 0; i < c.rope_dim / 2; ++i) out[size_t(i)] /= d[i];
      return true;
    };
    divided("rope_freqs.weight", c.rope_freqs, c.rope_freqs);
    const std::vector<float> unfactored = c.rope_freqs;
    divided("rope_factors_short.weight", unfactored, c.rope_freqs);
    if (divided("rope_factors_long.weight", unfactored, c.rope_freqs_long))
      c.rope_long_ctx = int(get_int("rope.scaling.original_context_length", false, c.n_ctx_train));
    if (fam->local_rope_global) c.rope_freqs_local = c.rope_freqs;  // (exaone4: its factors included)
  }
  c.rope_attn_factor = float(get_float("rope.scaling.attn_factor", 1.0));
  if (!(c.rope_attn_factor > 0 && c.rope_attn_factor < 100))
    problems.push_back(fmt::format("rope.scaling.attn_factor {} is out of range", c.rope_attn_factor));
  if (rs.type == "yarn" && rs.ext_factor != 0)
    c.rope_attn_factor *= yarn_mscale(rs.factor, float(get_float("rope.scaling.yarn_log_multiplier", 0.0)));
  c.rope_attn_factor_local = fam->local_rope_plain ? 1.f : c.rope_attn_factor;

  // Tensors: presence, shape and a type Baton computes with, all checked before any loading.
  auto check = [&](const std::string& name, bool required, const std::vector<int64_t>& dims, bool f32 = false) {
    const gguf::TensorInfo* t = f.tensor(name);
    if (!t) {
      if (required) problems.push_back(fmt::format("missing tensor {}", name));
      return;
    }
    bool ok = true;
    for (size_t i = 0; i < 4; ++i) ok = ok && t->ne[i] == (i < dims.size() ? dims[i] : 1);
    if (!ok) {
      std::string want = "[";
      for (size_t i = 0; i < dims.size(); ++i) want += fmt::format("{}{}", i ? ", " : "", dims[i]);
      problems.push_back(fmt::format("tensor {} has shape {}, expected {}]", name, t->shape_str(), want));
    }
    if (!traits(t->type).compute)
      problems.push_back(fmt::format("tensor {} has type {}, which Baton cannot compute with", name, type_name(t->type)));
    if ((dims.size() == 1 || f32) && t->type != GgmlType::F32)
      problems.push_back(fmt::format("tensor {} (a norm or bias) must be F32, found {}", name, type_name(t->type)));
  };
  if (problems.empty()) {  // shapes only make sense once the dimensions are known
    const int64_t E = c.n_embd, V = c.n_vocab;
    check("token_embd.weight", true, {E, V});
    check("output_norm.weight", true, {E});
    c.tied_output = f.tensor("output.weight") == nullptr;
    check("output.weight", false, {E, V});
    for (int l = 0; l < c.n_layer; ++l) {
      const int64_t dims[][2] = {
        {E, 0}, {E, c.n_embd_q()}, {E, c.n_embd_k()}, {E, c.n_embd_v()}, {c.n_embd_attn(), E},
        {c.n_embd_q(), 0}, {c.n_embd_k(), 0}, {c.n_embd_v(), 0}, {c.q_norm_width(), 0}, {c.k_norm_width(), 0},
        {E, 0}, {E, 0}, {E, c.n_ff}, {E, c.fused_gate_up ? 2 * c.n_ff : c.n_ff}, {c.n_ff, E}, {E, 0},
        {E, c.n_embd_q() + c.n_embd_k() + c.n_embd_v()},
        {E, c.n_expert}, {E, c.n_ff_exp}, {E, c.n_ff_exp}, {c.n_ff_exp, E},
        {E, 0}, {E, c.n_ff_shexp}, {E, c.n_ff_shexp}, {c.n_ff_shexp, E},
        {E, 2 * c.n_ff_exp},
        {E, 0}, {c.n_head, 0}, {c.n_expert, 0}, {c.n_ff_exp, c.n_expert}, {c.n_ff_exp, c.n_expert}, {E, c.n_expert},
      };
      static_assert(std::size(dims) == size_t(LayerTensor::Count));
      for (int t = 0; t < int(LayerTensor::Count); ++t) {
        const LayerTensor lt = LayerTensor(t);
        std::vector<int64_t> d{dims[t][0]};
        if (dims[t][1]) d.push_back(dims[t][1]);
        if (lt == LayerTensor::GateExps || lt == LayerTensor::UpExps || lt == LayerTensor::DownExps ||
            lt == LayerTensor::GateUpExps)
          d.push_back(c.n_expert);  // the experts stacked
        if (c.has(lt)) check(layer_tensor_key(l, lt), true, d, kLayerTensors[t].bias);
      }
    }
  }

  if (f.tensors().empty()) {  // a vocabulary-only file: one line for it, not a "missing tensor" per weight
    std::erase_if(problems, [](const std::string& p) { return p.rfind("missing tensor ", 0) == 0; });
    if (problems.empty())
      throw Error(ErrorKind::Model,
                  fmt::format("{}: the file has no tensors (a vocabulary-only GGUF?): nothing to run", f.path()));
    problems.insert(problems.begin(), "the file has no tensors (a vocabulary-only GGUF?)");
  }
  if (!problems.empty()) {
    std::string msg = fmt::format("{}: {} problem{} in the model description:", f.path(), problems.size(),
                                  problems.size() == 1 ? "" : "s");
    const size_t shown = std::min<size_t>(problems.size(), 40);
    for (size_t i = 0; i < shown; ++i) msg += "\n  - " + problems[i];
    if (shown < problems.size()) msg += fmt::format("\n  ... and {} more", problems.size() - shown);
    throw Error(ErrorKind::Model, msg);
  }
  return c;
}

void ModelConfig::use_context(int n_ctx) {
  if (!rope_freqs_long.empty() && n_ctx > rope_long_ctx) rope_freqs = rope_freqs_long;
}

std::string ModelConfig::summary() const {
  int n_local = 0;
  for (int w : layer_window) n_local += w > 0;
  const auto n_nope = std::count(layer_nope.begin(), layer_nope.end(), true);
  return fmt::format(
      "{} '{}': {} layers, n_embd {}, heads {}/{} (dim {}/{}), n_ff {}, vocab {}, ctx {}, rope {} base {} "
      "dim {} scaling {}, {}{}{}{}{}{}{}{}{}", arch, name, n_layer, n_embd, n_head, n_head_kv, head_dim_k, head_dim_v,
      n_ff, n_vocab, n_ctx_train, rope_style == RopeStyle::Adjacent ? "adjacent" : "neox", rope_base, rope_dim,
      rope_scaling, act == Activation::SiLU ? "SwiGLU" : act == Activation::GeluTanh ? "GeGLU" : "clamped SwiGLU", tied_output ? ", tied output" : "",
      fmt::format("{}{}", n_local ? fmt::format(", {} sliding-window layers (window {})", n_local, sliding_window) : "",
                  n_nope ? fmt::format(", {} layers without RoPE", n_nope) : ""),
      fmt::format("{}{}{}", pre_norms ? "" : ", no pre-norms",
                  qk_norm ? (qk_norm_full ? ", q/k norm (whole rows)" : ", q/k norm") : "",
                  attn_sinks ? ", attention sinks" : ""),
      attn_softcap > 0 || final_softcap > 0 ? fmt::format(", soft-caps {} / {}", attn_softcap, final_softcap) : "",
      fused_qkv || fused_gate_up || fused_gate_up_exps ? ", fused matrices" : "",
      is_moe() ? fmt::format(", {} of {} experts (n_ff {}{}{})", n_expert_used, n_expert, n_ff_exp,
                             n_ff_shexp ? fmt::format(", shared {}", n_ff_shexp) : "",
                             expert_weights_norm ? ", renormalized" : "") : "",
      rope_freqs_long.empty() ? "" : fmt::format(", LongRoPE factor {}, {} factors (long past {})", rope_attn_factor,
                                                 rope_freqs == rope_freqs_long ? "long" : "short", rope_long_ctx),
      residual_scale != 1 || logit_scale != 1
          ? fmt::format(", scales: embedding {} residual {} attention {} logits /{}", embd_scale, residual_scale,
                        attn_scale, logit_scale)
          : "");
}

}  // namespace baton
