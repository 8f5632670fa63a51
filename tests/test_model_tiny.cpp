// Generated tiny models (gguf::Writer, weights quantized with quantize_row) run through the fast path
// (Pipeline: matmul kernels, F16 KV cache, staged attention) and through a plain reference forward
// written here: weights dequantized once with the scalar oracle, all math in double, attention over
// the whole prefix with no cache. Three families: llama (adjacent RoPE, SwiGLU, separate output), a
// gemma3-shaped one (NeoX RoPE, GeGLU, q/k norms, post-norms, embedding scale, sliding-window layers
// with their own RoPE base, tied output) and a qwen3-shaped one (NeoX RoPE with base 1e6, SwiGLU, q/k
// norms before the rotation, heads wider than n_embd / n_head, tied output): per Qwen3's modeling code,
// q_norm/k_norm are RMSNorms over each head's head_dim values. And a phi3-shaped one, per Phi-3's
// modeling code: one qkv_proj whose output splits into q, k, v; one gate_up_proj whose output
// chunks into gate then up; LongRoPE (per-pair divisors, the long ones past the original context)
// with cos and sin multiplied by the attention factor. And a gemma2-shaped one, per Gemma 2's
// modeling code: Gemma 3's layer without q/k norms, one RoPE base, every other layer sliding, the
// attention scores (scaled) and the final logits soft-capped, cap·tanh(x / cap). And granite-shaped
// ones, per Granite's modeling code (transformers' GraniteForCausalLM, GraniteMoeForCausalLM): the
// embeddings times embedding_multiplier, q·k times attention_multiplier (not 1/√head_dim), each
// attention and FFN output times residual_multiplier before its residual add, the logits divided
// by logits_scaling; GraniteMoe's router softmaxes its top-k logits among themselves. And a
// smollm3-shaped one, per SmolLM3's modeling code: llama's layer where the layers whose index + 1 is
// a multiple of no_rope_layer_interval (4) use no rotary embedding at all (q and k as projected).
// And olmo2-shaped ones, per Olmo2's and Olmo3's modeling code: no input norms (the projections and
// the MLP read the residual stream), q_norm and k_norm RMSNorms over the whole projected q and k
// rows (not per head), the attention and MLP outputs RMS-normed before each residual add; Olmo3's
// sliding layers rotate with the plain frequencies, its full ones with YaRN's (and its magnitude).
// And an olmoe-shaped one, per Olmoe's: llama's pre-norm layer with the whole-row q/k norms and a
// mixture whose top-k softmax weights are not renormalized. And an ernie4_5-shaped one, per
// Ernie4_5's modeling code: llama's layer rotating interleaved pairs (x[2i], x[2i+1]) with a tied
// head, and use_bias's q/k/v and o_proj biases (optional in the files). And an exaone4-shaped one,
// per Exaone4's modeling code: Olmo2's norm placement (no input norms, post_attention_layernorm and
// post_feedforward_layernorm on each block's output) with q_norm/k_norm per head; with a sliding
// window ("global NoPE") only the sliding layers rotate, with the Llama 3-scaled frequencies. And a
// gemma-shaped one (Gemma 1), per Gemma's modeling code: the embeddings times sqrt(hidden_size),
// input_layernorm before the attention and post_attention_layernorm (the files' ffn_norm) before the
// MLP, no q/k norms and no norms on the blocks' outputs, GeGLU with the tanh GELU, rotate_half RoPE,
// one KV head here (the 2B's) with heads wider than n_embd / n_head (the 7B's), q·k times
// head_dim^-0.5, the head tied. Its norms' (1 + weight) is what the file stores (the converter adds
// the 1). And a glm4-shaped one (GLM-4-0414), per Glm4's modeling code: input_layernorm before the
// attention and post_attention_layernorm (the files' ffn_norm) before the MLP, plus
// post_self_attn_layernorm and post_mlp_layernorm (post_attention_norm, post_ffw_norm) on the
// attention and MLP outputs before each residual add; q/k/v biases; gate_up_proj's output chunked
// into gate, then up (one ffn_up tensor); the first half of each head rotated in interleaved pairs
// (x[2i], x[2i+1]), the second half passed through; an untied head.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "gguf/gguf.h"
#include "helpers.h"
#include "quant/quant.h"
#include "runtime/config.h"
#include "runtime/embed.h"
#include "runtime/pipeline.h"
#include "runtime/synth.h"

using namespace baton;

namespace {

struct Spec {
  std::string arch = "llama";
  GgmlType wtype = GgmlType::Q4_0;
  int n_layer = 2, n_embd = 256, n_head = 4, n_head_kv = 2, head_dim = 64, n_ff = 512, n_vocab = 300;
  int window = 0, swa_pattern = 0;  // gemma3/gemma2: sliding window and every Nth layer global
  float attn_softcap = 0.f, final_softcap = 0.f;  // gemma2
  int rope_dim = 0;                 // rotated dims per head (0: all; Phi-4-mini rotates 3/4)
  int rope_long_ctx = 0;            // phi3: LongRoPE factors past this context
  float rope_attn_factor = 1.f;     // phi3: rope.scaling.attn_factor
  // Mixture of experts (n_expert > 0): top n_expert_used of n_expert, each n_ff_exp wide; a shared
  // expert n_ff_shexp wide (qwen2moe).
  int n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
  bool merged_exps = false;  // gate and up experts in one ffn_gate_up_exps tensor
  // granite, granitemoe: embedding_scale, residual_scale, attention.scale, logit_scale. drop_key:
  // one of them left out of the file (the reference still applies it).
  float embd_mult = 1.f, residual_mult = 1.f, attn_mult = 0.f, logit_div = 1.f;
  std::string drop_key;
  bool rope_every_layer = false;  // smollm3: the reference rotates its NoPE layers too (do they matter?)
  float q_amp = 1.f;  // the q rows' amplitude times this: a sharper attention, where keys sit matters more
  // olmo2: a YaRN factor on the global layers (OLMo 3; 0: none), from this original context. And
  // what the reference gets wrong on purpose (do they matter?): q/k norms per head; the post-norms
  // used as pre-norms (llama's placement); the sliding layers rotated as the global ones.
  float yarn_factor = 0.f;
  int yarn_ctx = 0;
  bool olmo_per_head_norm = false, olmo_pre_norm = false, olmo_yarn_everywhere = false;
  // ernie4_5's use_bias: q/k/v and attn_output biases in the file, added by the reference but for
  // the kind ref_drop_bias names ("qkv" or "output": do they matter?).
  bool use_bias = false;
  std::string ref_drop_bias;
  bool ref_no_rope_freqs = false;  // exaone4: the reference rotates without rope_freqs.weight (does it matter?)
  // gemma (Gemma 1): the reference adds what the family does not have (do they matter?): per-head q/k
  // RMSNorms and RMSNorms on the blocks' outputs (Gemma 3's, with unit weights), or leaves the
  // embedding scale out.
  bool ref_qk_norm = false, ref_post_norms = false, ref_no_embd_scale = false;
  // glm4: the reference without the norms on the blocks' outputs, rotating the whole head instead
  // of its first half, or rotating NeoX's halves instead of interleaved pairs (do they matter?).
  bool ref_no_post_norms = false, ref_full_rope = false, ref_neox = false;
  // Control vectors: what the reference adds to each layer's output (empty: nothing; the file's
  // vectors are given to the fast path at load).
  std::vector<std::vector<float>> control;
  uint32_t seed = 7;
};

// The smallest gap, over every token and layer the reference saw, between the router logits of the
// last expert chosen and the first one left out: a fast path whose router is off by less than this
// picks the same experts.
double g_min_router_gap = 1e30;
// The fast path's router logits differ from the reference's by its 8-bit activations and F16 K/V
// upstream (~1e-2 here): random weights put some token's k-th and (k+1)-th experts closer than
// that now and then, and the two paths then pick different experts. MoE tests take the first
// seed whose routing is this decisive for their prompt (a property of the reference alone).
constexpr double kRouterMargin = 0.08;
// How many gate and up values the reference clamped (gpt-oss): the clamps must bite in its tests.
long g_clamped = 0;

// Random weights, the quantized bytes written to the file, and the dequantized floats the
// reference uses (so both paths see exactly the same numbers).
struct Model {
  Spec spec;
  std::string path;
  std::map<std::string, std::vector<float>> w;  // dequantized, row-major [rows][cols]
};

Model make_model(const Spec& s) {
  Model m;
  m.spec = s;
  std::mt19937 rng(s.seed);
  gguf::Writer wr;
  const std::string a = s.arch;
  wr.set("general.architecture", gguf::Value::of_str(a));
  wr.set("general.name", gguf::Value::of_str("tiny-" + a));
  wr.set(a + ".block_count", gguf::Value::of_u32(uint32_t(s.n_layer)));
  wr.set(a + ".embedding_length", gguf::Value::of_u32(uint32_t(s.n_embd)));
  wr.set(a + ".feed_forward_length", gguf::Value::of_u32(uint32_t(s.n_ff)));
  wr.set(a + ".attention.head_count", gguf::Value::of_u32(uint32_t(s.n_head)));
  wr.set(a + ".attention.head_count_kv", gguf::Value::of_u32(uint32_t(s.n_head_kv)));
  wr.set(a + ".attention.key_length", gguf::Value::of_u32(uint32_t(s.head_dim)));
  wr.set(a + ".attention.value_length", gguf::Value::of_u32(uint32_t(s.head_dim)));
  wr.set(a + ".context_length", gguf::Value::of_u32(128));
  // (smollm3: 1e4, not its 5e6, so that the rotation its NoPE layer leaves out turns far in a short prompt)
  wr.set(a + ".rope.freq_base",
         gguf::Value::of_f32(a == "llama" || a == "smollm3" || a == "exaone4" || a == "glm4" ? 10000.f : 1e6f));
  wr.set(a + ".attention.layer_norm_rms_epsilon", gguf::Value::of_f32(1e-6f));
  if (s.attn_softcap > 0) wr.set(a + ".attn_logit_softcapping", gguf::Value::of_f32(s.attn_softcap));
  if (s.final_softcap > 0) wr.set(a + ".final_logit_softcapping", gguf::Value::of_f32(s.final_softcap));
  if (s.rope_dim > 0) wr.set(a + ".rope.dimension_count", gguf::Value::of_u32(uint32_t(s.rope_dim)));
  if (s.rope_long_ctx > 0) {
    wr.set(a + ".rope.scaling.original_context_length", gguf::Value::of_u32(uint32_t(s.rope_long_ctx)));
    wr.set(a + ".rope.scaling.attn_factor", gguf::Value::of_f32(s.rope_attn_factor));
  }
  if (s.n_expert > 0) {
    wr.set(a + ".expert_count", gguf::Value::of_u32(uint32_t(s.n_expert)));
    wr.set(a + ".expert_used_count", gguf::Value::of_u32(uint32_t(s.n_expert_used)));
    if (a != "llama" && a != "granitemoe" && a != "olmoe")  // (their experts are n_ff wide)
      wr.set(a + ".expert_feed_forward_length", gguf::Value::of_u32(uint32_t(s.n_ff_exp)));
    if (s.n_ff_shexp > 0) wr.set(a + ".expert_shared_feed_forward_length", gguf::Value::of_u32(uint32_t(s.n_ff_shexp)));
  }
  if (s.window > 0) {
    wr.set(a + ".attention.sliding_window", gguf::Value::of_u32(uint32_t(s.window)));
    if (a == "olmo2" || a == "exaone4") {  // OLMo 3's and EXAONE 4's converters: one flag per layer, true = sliding
      std::vector<gguf::Value> flags;
      for (int l = 0; l < s.n_layer; ++l) flags.push_back(gguf::Value::of_bool((l + 1) % s.swa_pattern != 0));
      wr.set(a + ".attention.sliding_window_pattern", gguf::Value::of_array(gguf::ValueType::BOOL, std::move(flags)));
    } else {
      wr.set(a + ".attention.sliding_window_pattern", gguf::Value::of_u32(uint32_t(s.swa_pattern)));
    }
  }
  if (s.yarn_factor > 0) {
    wr.set(a + ".rope.scaling.type", gguf::Value::of_str("yarn"));
    wr.set(a + ".rope.scaling.factor", gguf::Value::of_f32(s.yarn_factor));
    wr.set(a + ".rope.scaling.original_context_length", gguf::Value::of_u32(uint32_t(s.yarn_ctx)));
  }
  const bool granite = a == "granite" || a == "granitemoe";
  if (granite)
    for (auto [key, v] : {std::pair{"embedding_scale", s.embd_mult}, {"residual_scale", s.residual_mult},
                          {"attention.scale", s.attn_mult}, {"logit_scale", s.logit_div}})
      if (key != s.drop_key) wr.set(a + "." + key, gguf::Value::of_f32(v));
  const bool oai = a == "gpt-oss";
  if (oai) {  // gpt-oss's YaRN: 32× from 4096 (pairs 6 to 15 of 32 on the ramp at this base)
    wr.set(a + ".rope.scaling.type", gguf::Value::of_str("yarn"));
    wr.set(a + ".rope.scaling.factor", gguf::Value::of_f32(32.f));
    wr.set(a + ".rope.scaling.original_context_length", gguf::Value::of_u32(4096));
  }

  // planes > 1: that many matrices of `rows` rows stacked in one 3-D tensor (the experts).
  // Returns the quantized bytes; write = false keeps them out of the file.
  // head_spread: row r's values times 1 + head_spread · (r / head_dim) (heads of unequal sizes).
  auto add = [&](const std::string& name, int rows, int cols, float amp, float center, bool quantized, int planes = 1,
                 bool write = true, float head_spread = 0.f) {
    std::uniform_real_distribution<float> u(-amp, amp);
    const int plane_rows = rows;
    rows *= planes;
    std::vector<float> x(size_t(rows) * cols);
    for (float& v : x) v = center + u(rng);
    if (head_spread != 0)
      for (size_t i = 0; i < x.size(); ++i) x[i] *= 1 + head_spread * float(i / size_t(cols) / size_t(s.head_dim));
    const GgmlType t = quantized ? s.wtype : GgmlType::F32;
    const size_t rb = row_bytes(t, cols);
    std::vector<uint8_t> bytes(rb * size_t(rows));
    std::vector<float>& deq = m.w[name];
    deq.resize(x.size());
    for (int r = 0; r < rows; ++r) {
      quantize_row(t, x.data() + size_t(r) * cols, bytes.data() + size_t(r) * rb, cols);
      dequantize_row(t, bytes.data() + size_t(r) * rb, deq.data() + size_t(r) * cols, cols);
    }
    std::vector<int64_t> dims{cols};
    if (rows > 1) dims.push_back(plane_rows);
    if (planes > 1) dims.push_back(planes);
    if (write) wr.add_tensor(name, t, dims, bytes.data(), bytes.size());
    return bytes;
  };
  const int E = s.n_embd, D = s.head_dim;
  const float we = 1.f / std::sqrt(float(E)) * 1.7f, wf = 1.f / std::sqrt(float(s.n_ff)) * 1.7f;
  // Gemma scales embeddings up by sqrt(n_embd): store them small, as real Gemma files do, so the
  // layers (not the embedding) dominate the residual stream and a wrong layer detail shows.
  // Granite's embeddings likewise small against its multiplier, and its tied head's logits large
  // enough before the division by logit_scale; SmolLM3's small too, so that its layers (the NoPE
  // one among them), not the token's own row, dominate the residual stream.
  const bool gemma = a == "gemma3" || a == "gemma2" || a == "gemma";
  const bool small_embd = granite || a == "smollm3" || a == "ernie4_5";
  add("token_embd.weight", s.n_vocab, E, gemma ? 4.f / float(E) : small_embd ? 0.1f : 1.0f, 0.f, true);
  // (and a large final norm, as in real Gemma files, so the tied head's logits are not tiny)
  add("output_norm.weight", 1, E, gemma || small_embd ? 2.f : 0.2f, gemma ? 12.f : small_embd ? 4.f * s.logit_div : 1.f, false);
  const bool phi3 = a == "phi3", glm4 = a == "glm4";
  const bool olmo = a == "olmo2" || a == "olmoe", post_only = a == "olmo2" || a == "exaone4";
  if (a == "llama" || phi3 || olmo || a == "exaone4" || glm4) add("output.weight", s.n_vocab, E, we, 0.f, true);
  if (a == "exaone4") add("rope_freqs.weight", 1, D / 2, 4.f, 5.f, false);  // Llama 3's per-pair divisors
  if (s.rope_long_ctx > 0) {
    const int R = s.rope_dim > 0 ? s.rope_dim : D;
    add("rope_factors_long.weight", 1, R / 2, 4.f, 5.f, false);
    add("rope_factors_short.weight", 1, R / 2, 0.2f, 1.1f, false);
  }
  for (int l = 0; l < s.n_layer; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    if (!post_only) add(b + "attn_norm.weight", 1, E, 0.2f, 1.f, false);
    if (phi3) {
      add(b + "attn_qkv.weight", (s.n_head + 2 * s.n_head_kv) * D, E, we, 0.f, true);
    } else {
      // OLMo: heads of unequal sizes, as trained ones are (a norm per head would even them out).
      add(b + "attn_q.weight", s.n_head * D, E, s.q_amp * we, 0.f, true, 1, true, olmo ? 0.6f : 0.f);
      add(b + "attn_k.weight", s.n_head_kv * D, E, we, 0.f, true, 1, true, olmo ? 0.6f : 0.f);
      add(b + "attn_v.weight", s.n_head_kv * D, E, we, 0.f, true);
    }
    add(b + "attn_output.weight", E, s.n_head * D, we, 0.f, true);
    // the output bias (gpt-oss, ernie4_5); sinks around the scores' size, so some heads give them most weight
    if (oai || s.use_bias) add(b + "attn_output.bias", 1, E, 0.3f, 0.f, false);
    if (oai) add(b + "attn_sinks.weight", 1, s.n_head, 2.f, 0.5f, false);
    if (!post_only) add(b + (oai ? "post_attention_norm.weight" : "ffn_norm.weight"), 1, E, 0.2f, 1.f, false);
    if (s.n_expert > 0) {  // the router in F32 (as converters leave it), a spread that routes decisively
      // gpt-oss: large gate and up biases, so its clamps at ±7 bite, and a smaller down projection.
      const float wx = 1.f / std::sqrt(float(s.n_ff_exp)) * (oai ? 0.05f : 1.7f);
      add(b + "ffn_gate_inp.weight", s.n_expert, E, (oai ? 6.f : 3.f) * we, 0.f, false);  // (3 of 6: wider)
      if (oai) {
        add(b + "ffn_gate_inp.bias", 1, s.n_expert, 0.5f, 0.f, false);
        add(b + "ffn_gate_exps.bias", s.n_expert, s.n_ff_exp, 6.5f, 0.f, false);
        add(b + "ffn_up_exps.bias", s.n_expert, s.n_ff_exp, 7.5f, 0.f, false);
        add(b + "ffn_down_exps.bias", s.n_expert, E, 0.3f, 0.f, false);
      }
      const auto gate = add(b + "ffn_gate_exps.weight", s.n_ff_exp, E, we, 0.f, true, s.n_expert, !s.merged_exps);
      const auto up = add(b + "ffn_up_exps.weight", s.n_ff_exp, E, we, 0.f, true, s.n_expert, !s.merged_exps);
      if (s.merged_exps) {  // ffn_gate_up_exps: per expert its gate rows, then its up rows
        const size_t slab = gate.size() / size_t(s.n_expert);
        std::vector<uint8_t> merged;
        for (int e = 0; e < s.n_expert; ++e)
          for (const auto* part : {&gate, &up}) merged.insert(merged.end(), part->begin() + e * slab, part->begin() + (e + 1) * slab);
        wr.add_tensor(b + "ffn_gate_up_exps.weight", s.wtype, {E, 2 * s.n_ff_exp, s.n_expert}, merged.data(), merged.size());
      }
      add(b + "ffn_down_exps.weight", E, s.n_ff_exp, wx, 0.f, true, s.n_expert);
      if (s.n_ff_shexp > 0) {
        add(b + "ffn_gate_inp_shexp.weight", 1, E, 2.f * we, 0.f, false);
        add(b + "ffn_gate_shexp.weight", s.n_ff_shexp, E, we, 0.f, true);
        add(b + "ffn_up_shexp.weight", s.n_ff_shexp, E, we, 0.f, true);
        add(b + "ffn_down_shexp.weight", E, s.n_ff_shexp, wf, 0.f, true);
      }
    } else if (phi3 || glm4) {  // gate rows, then up rows
      add(b + "ffn_up.weight", 2 * s.n_ff, E, we, 0.f, true);
    } else {
      add(b + "ffn_gate.weight", s.n_ff, E, we, 0.f, true);
      add(b + "ffn_up.weight", s.n_ff, E, we, 0.f, true);
    }
    if (s.n_expert == 0) add(b + "ffn_down.weight", E, s.n_ff, wf, 0.f, true);
    if (a == "qwen2moe" || oai || s.use_bias || glm4) {
      add(b + "attn_q.bias", 1, s.n_head * D, 0.3f, 0.f, false);
      add(b + "attn_k.bias", 1, s.n_head_kv * D, 0.3f, 0.f, false);
      add(b + "attn_v.bias", 1, s.n_head_kv * D, 0.3f, 0.f, false);
    }
    if (a == "gemma3" || a == "qwen3" || a == "qwen3moe" || a == "exaone4") {
      // (exaone4: q_amp scales the q norm's weights, the per-head norm undoing it in the projection)
      const float qn = a == "exaone4" ? s.q_amp : 1.f;
      add(b + "attn_q_norm.weight", 1, D, 0.2f * qn, qn, false);
      add(b + "attn_k_norm.weight", 1, D, 0.2f, 1.f, false);
    }
    if ((gemma && a != "gemma") || post_only || glm4) {  // (Gemma 1 has no post-norms)
      add(b + "post_attention_norm.weight", 1, E, 0.2f, 1.f, false);
      add(b + "post_ffw_norm.weight", 1, E, 0.2f, 1.f, false);
    }
    if (olmo) {  // over the whole q and k rows
      add(b + "attn_q_norm.weight", 1, s.n_head * D, 0.2f, 1.f, false);
      add(b + "attn_k_norm.weight", 1, s.n_head_kv * D, 0.2f, 1.f, false);
    }
  }
  m.path = test::temp_dir() + "/tiny.gguf";
  wr.write(m.path);
  return m;
}

// ---- the reference forward: plain loops, doubles, the whole prefix every time ----

using Vec = std::vector<double>;

Vec matvec(const std::vector<float>& W, int rows, int cols, const Vec& x) {
  Vec y(size_t(rows), 0.0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) y[size_t(r)] += double(W[size_t(r) * cols + c]) * x[size_t(c)];
  return y;
}

Vec rmsnorm(const Vec& x, const float* w, size_t off, size_t n, double eps) {
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += x[off + i] * x[off + i];
  const double inv = 1.0 / std::sqrt(ss / double(n) + eps);
  Vec y(n);
  for (size_t i = 0; i < n; ++i) y[i] = x[off + i] * inv * double(w[i]);
  return y;
}

// YaRN as gpt-oss's reference code computes it (the ramp's ends not rounded to whole pairs): per
// pair, the fraction of the original frequency kept; pairs below `lo` keep it all, pairs above `hi`
// are interpolated (divided by the factor).
struct Yarn {
  double factor = 0, lo = 0, hi = 0;
  Yarn() = default;
  // truncate: the ramp's ends rounded down and up to whole pairs (Hugging Face's default: Olmo3).
  Yarn(double factor, double original_ctx, double base, int R, bool truncate = false, double beta_fast = 32,
       double beta_slow = 1)
      : factor(factor) {
    const double two_pi = 2 * 3.14159265358979323846;
    auto pair = [&](double turns) { return R * std::log(original_ctx / (turns * two_pi)) / (2 * std::log(base)); };
    lo = std::max(0.0, truncate ? std::floor(pair(beta_fast)) : pair(beta_fast));
    hi = std::min(double(R - 1), truncate ? std::ceil(pair(beta_slow)) : pair(beta_slow));
  }
  double freq(double theta, int i) const {
    if (factor == 0) return theta;
    const double interp = std::clamp((i - lo) / std::max(hi - lo, 0.001), 0.0, 1.0);
    return theta / factor * interp + theta * (1 - interp);
  }
  double mscale() const { return factor == 0 ? 1.0 : 0.1 * std::log(factor) + 1.0; }
};

// The first R dims of each head rotate, the rest pass. div: LongRoPE's per-pair divisors of the
// frequency (or none); mscale multiplies cos and sin (the rotated dims only).
void rope_ref(Vec& v, int n_head, int D, int R, int pos, double base, bool neox, const float* div = nullptr,
              double mscale = 1.0, const Yarn& yarn = {}) {
  for (int h = 0; h < n_head; ++h)
    for (int i = 0; i < R / 2; ++i) {
      const double ang = pos * yarn.freq(std::pow(base, -2.0 * i / R), i) / (div ? double(div[i]) : 1.0);
      const size_t i0 = size_t(h * D + (neox ? i : 2 * i)), i1 = size_t(h * D + (neox ? i + R / 2 : 2 * i + 1));
      const double a = v[i0], b = v[i1], c = std::cos(ang) * mscale, sn = std::sin(ang) * mscale;
      v[i0] = a * c - b * sn;
      v[i1] = a * sn + b * c;
    }
}

// Logits for every position of `ids` (one sequence starting at position 0) with a context of n_ctx;
// `hidden`, when given, gets each position's final hidden state after the output norm.
std::vector<Vec> reference(const Model& m, const std::vector<int32_t>& ids, int n_ctx, std::vector<Vec>* hidden = nullptr) {
  const Spec& s = m.spec;
  const bool gemma3 = s.arch == "gemma3", gemma1 = s.arch == "gemma", gemma = gemma3 || gemma1 || s.arch == "gemma2";
  // Norms on the blocks' outputs: Gemma 2's and 3's (not Gemma 1's, unless its reference is wrong on purpose).
  const bool gemma_post = (gemma && !gemma1) || s.ref_post_norms;
  const std::vector<float> ones(size_t(std::max(s.n_embd, s.head_dim)), 1.f);  // (the norms a wrong reference adds)
  const bool qwen3 = s.arch == "qwen3" || s.arch == "qwen3moe", qwen2moe = s.arch == "qwen2moe";
  const bool phi3 = s.arch == "phi3";
  const bool oai = s.arch == "gpt-oss";
  const bool granite = s.arch == "granite" || s.arch == "granitemoe";
  const bool smollm3 = s.arch == "smollm3";
  const bool olmo = s.arch == "olmo2" || s.arch == "olmoe", olmoe = s.arch == "olmoe";
  const bool exaone4 = s.arch == "exaone4";
  const bool glm4 = s.arch == "glm4", glm4_post = glm4 && !s.ref_no_post_norms;
  const bool post_only = (s.arch == "olmo2" && !s.olmo_pre_norm) || exaone4;  // (olmo_pre_norm: the norms before the blocks)
  const bool olmo_pre = s.arch == "olmo2" && s.olmo_pre_norm;
  // (the llama, granite, smollm3 converters permute q/k; ERNIE 4.5 rotates adjacent pairs itself)
  // (GLM-4 too: its rotate_half pairs x[0::2] with x[1::2])
  const bool neox = (s.arch != "llama" && !granite && !smollm3 && s.arch != "ernie4_5" && !glm4) || s.ref_neox;
  const double res = granite ? s.residual_mult : 1.0;
  const float* rope_div = exaone4 ? (s.ref_no_rope_freqs ? nullptr : m.w.at("rope_freqs.weight").data())
                          : s.rope_long_ctx == 0 ? nullptr
                          : m.w.at(n_ctx > s.rope_long_ctx ? "rope_factors_long.weight" : "rope_factors_short.weight").data();
  const int E = s.n_embd, D = s.head_dim, T = int(ids.size()), rep = s.n_head / s.n_head_kv;
  const double eps = 1e-6;
  auto W = [&](const std::string& n) -> const std::vector<float>& { return m.w.at(n); };
  std::vector<Vec> x(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) {
    const float* e = W("token_embd.weight").data() + size_t(ids[size_t(t)]) * E;
    x[size_t(t)].assign(e, e + E);
    if (gemma && !s.ref_no_embd_scale) for (double& v : x[size_t(t)]) v *= std::sqrt(double(E));
    if (granite) for (double& v : x[size_t(t)]) v *= s.embd_mult;
  }
  for (int l = 0; l < s.n_layer; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    const bool local = s.window > 0 && (l + 1) % s.swa_pattern != 0;
    const double base =
        gemma3 ? (local ? 10000.0 : 1e6) : s.arch == "llama" || smollm3 || exaone4 || glm4 ? 10000.0 : 1e6;  // as make_model writes
    std::vector<Vec> q(static_cast<size_t>(T)), k(q), v(q);
    for (int t = 0; t < T; ++t) {
      const Vec h = post_only ? x[size_t(t)]
                    : rmsnorm(x[size_t(t)], W(b + (olmo_pre ? "post_attention_norm.weight" : "attn_norm.weight")).data(),
                              0, size_t(E), eps);
      if (phi3) {  // qkv_proj, then q, k and v split off its output in that order
        const Vec qkv = matvec(W(b + "attn_qkv.weight"), (s.n_head + 2 * s.n_head_kv) * D, E, h);
        const auto at = [&](int from, int n) { return Vec(qkv.begin() + from, qkv.begin() + from + n); };
        q[size_t(t)] = at(0, s.n_head * D);
        k[size_t(t)] = at(s.n_head * D, s.n_head_kv * D);
        v[size_t(t)] = at((s.n_head + s.n_head_kv) * D, s.n_head_kv * D);
      } else {
        q[size_t(t)] = matvec(W(b + "attn_q.weight"), s.n_head * D, E, h);
        k[size_t(t)] = matvec(W(b + "attn_k.weight"), s.n_head_kv * D, E, h);
        v[size_t(t)] = matvec(W(b + "attn_v.weight"), s.n_head_kv * D, E, h);
      }
      if (qwen2moe || oai || glm4 || (s.use_bias && s.ref_drop_bias != "qkv"))
        for (auto [y, name] : {std::pair{&q[size_t(t)], "attn_q.bias"}, {&k[size_t(t)], "attn_k.bias"},
                               {&v[size_t(t)], "attn_v.bias"}})
          for (size_t i = 0; i < y->size(); ++i) (*y)[i] += double(W(b + name)[i]);
      if (olmo && !s.olmo_per_head_norm) {  // over the whole rows
        q[size_t(t)] = rmsnorm(q[size_t(t)], W(b + "attn_q_norm.weight").data(), 0, size_t(s.n_head * D), eps);
        k[size_t(t)] = rmsnorm(k[size_t(t)], W(b + "attn_k_norm.weight").data(), 0, size_t(s.n_head_kv * D), eps);
      } else if (gemma3 || qwen3 || olmo || exaone4) {  // q/k norms per head (olmo: head h's slice of the weights), then the rotation
        const size_t wq = olmo ? size_t(D) : 0;
        for (int hh = 0; hh < s.n_head; ++hh) {
          const Vec n = rmsnorm(q[size_t(t)], W(b + "attn_q_norm.weight").data() + hh * wq, size_t(hh * D), size_t(D), eps);
          std::copy(n.begin(), n.end(), q[size_t(t)].begin() + hh * D);
        }
        for (int hh = 0; hh < s.n_head_kv; ++hh) {
          const Vec n = rmsnorm(k[size_t(t)], W(b + "attn_k_norm.weight").data() + hh * wq, size_t(hh * D), size_t(D), eps);
          std::copy(n.begin(), n.end(), k[size_t(t)].begin() + hh * D);
        }
      } else if (s.ref_qk_norm) {  // (wrong on purpose: per-head norms Gemma 1 does not have)
        for (auto [y, n_h] : {std::pair{&q[size_t(t)], s.n_head}, {&k[size_t(t)], s.n_head_kv}})
          for (int hh = 0; hh < n_h; ++hh) {
            const Vec n = rmsnorm(*y, ones.data(), size_t(hh * D), size_t(D), eps);
            std::copy(n.begin(), n.end(), y->begin() + hh * D);
          }
      }
      const int R = s.rope_dim > 0 && !s.ref_full_rope ? s.rope_dim : D;
      // gpt-oss: every layer, sliding or not; OLMo 3: the global layers only.
      const bool olmo_yarn = s.yarn_factor > 0 && (!local || s.olmo_yarn_everywhere);
      const Yarn yarn = oai ? Yarn(32, 4096, base, R) : olmo_yarn ? Yarn(s.yarn_factor, s.yarn_ctx, base, R, true) : Yarn();
      if (smollm3 && (l + 1) % 4 == 0 && !s.rope_every_layer) continue;  // a NoPE layer
      if (exaone4 && s.window > 0 && !local && !s.rope_every_layer) continue;  // exaone4's global NoPE
      rope_ref(q[size_t(t)], s.n_head, D, R, t, base, neox, rope_div, s.rope_attn_factor * yarn.mscale(), yarn);
      rope_ref(k[size_t(t)], s.n_head_kv, D, R, t, base, neox, rope_div, s.rope_attn_factor * yarn.mscale(), yarn);
    }
    for (int t = 0; t < T; ++t) {
      Vec o(size_t(s.n_head * D), 0.0);
      for (int hh = 0; hh < s.n_head; ++hh) {
        const int g = hh / rep;
        const int lo = local ? std::max(0, t - s.window + 1) : 0;
        Vec sc;
        for (int j = lo; j <= t; ++j) {
          double d = 0;
          for (int i = 0; i < D; ++i) d += q[size_t(t)][size_t(hh * D + i)] * k[size_t(j)][size_t(g * D + i)];
          d *= granite ? double(s.attn_mult) : 1.0 / std::sqrt(double(D));
          if (s.attn_softcap > 0) d = s.attn_softcap * std::tanh(d / s.attn_softcap);
          sc.push_back(d);
        }
        // gpt-oss: the head's sink joins the softmax as one more logit with no value.
        const double sink = oai ? double(W(b + "attn_sinks.weight")[size_t(hh)]) : -INFINITY;
        const double mx = std::max(*std::max_element(sc.begin(), sc.end()), sink);
        double sum = oai ? std::exp(sink - mx) : 0.0;
        for (double& z : sc) sum += (z = std::exp(z - mx));
        for (int j = lo; j <= t; ++j)
          for (int i = 0; i < D; ++i) o[size_t(hh * D + i)] += sc[size_t(j - lo)] / sum * v[size_t(j)][size_t(g * D + i)];
      }
      Vec att = matvec(W(b + "attn_output.weight"), E, s.n_head * D, o);
      if (oai || (s.use_bias && s.ref_drop_bias != "output")) for (int i = 0; i < E; ++i) att[size_t(i)] += double(W(b + "attn_output.bias")[size_t(i)]);
      if (gemma_post || post_only || glm4_post)
        att = rmsnorm(att, gemma1 ? ones.data() : W(b + "post_attention_norm.weight").data(), 0, size_t(E), eps);
      for (int i = 0; i < E; ++i) x[size_t(t)][size_t(i)] += res * att[size_t(i)];
    }
    auto act = [&](double z) {
      return gemma ? 0.5 * z * (1 + std::tanh(std::sqrt(2 / 3.14159265358979323846) * (z + 0.044715 * z * z * z)))
                   : z / (1 + std::exp(-z));
    };
    // gpt-oss's gate: the gate clamped above at 7, its sigmoid sharpened by 1.702, times the up
    // projection clamped to ±7, plus one.
    auto glu = [&](double g, double u) {
      if (!oai) return act(g) * u;
      g_clamped += (g > 7.0) + (std::fabs(u) > 7.0);
      g = std::min(g, 7.0);
      return g / (1 + std::exp(-1.702 * g)) * (std::clamp(u, -7.0, 7.0) + 1);
    };
    // Row e of a stacked bias tensor added to y (gpt-oss's experts), nothing otherwise.
    auto bias_row = [&](Vec& y, const std::string& name, int e) {
      if (!oai) return;
      for (size_t i = 0; i < y.size(); ++i) y[i] += double(W(b + name)[size_t(e) * y.size() + i]);
    };
    // One SwiGLU FFN n_f wide whose matrices start at row `r0` of the named tensors (an expert's
    // rows in the stacked ones).
    auto ffn = [&](const Vec& h, const std::string& gate, const std::string& up, const std::string& down, int n_f,
                   int r0) {
      const auto rows = [&](const std::string& name, int from, int n_rows, int cols) {
        const auto at = W(b + name).begin() + std::ptrdiff_t(from) * cols;
        return std::vector<float>(at, at + std::ptrdiff_t(n_rows) * cols);
      };
      Vec g = matvec(rows(gate, r0, n_f, E), n_f, E, h), u = matvec(rows(up, r0, n_f, E), n_f, E, h);
      const int e = r0 / n_f;
      bias_row(g, "ffn_gate_exps.bias", e);
      bias_row(u, "ffn_up_exps.bias", e);
      Vec a(static_cast<size_t>(n_f));
      for (size_t i = 0; i < a.size(); ++i) a[i] = glu(g[i], u[i]);
      Vec d = matvec(rows(down, e * E, E, n_f), E, n_f, a);
      bias_row(d, "ffn_down_exps.bias", e);
      return d;
    };
    for (int t = 0; t < T && s.n_expert > 0; ++t) {
      // Mixture of experts: softmax over the router's logits, the top k, their probabilities as
      // weights (renormalized to sum 1 except in qwen2moe), plus qwen2moe's shared expert scaled by
      // sigmoid(gate_inp_shexp · h).
      // (gpt-oss: the router has a bias, and the softmax over the k chosen logits is the same as the
      // renormalized top k of the softmax over all)
      const Vec h = rmsnorm(x[size_t(t)], W(b + (oai ? "post_attention_norm.weight" : "ffn_norm.weight")).data(), 0,
                            size_t(E), eps);
      Vec logit = matvec(W(b + "ffn_gate_inp.weight"), s.n_expert, E, h);
      if (oai) for (int e = 0; e < s.n_expert; ++e) logit[size_t(e)] += double(W(b + "ffn_gate_inp.bias")[size_t(e)]);
      std::vector<int> order(size_t(s.n_expert));
      for (int e = 0; e < s.n_expert; ++e) order[size_t(e)] = e;
      std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return logit[size_t(a)] > logit[size_t(c)]; });
      const int K = s.n_expert_used;
      g_min_router_gap = std::min(g_min_router_gap, logit[size_t(order[size_t(K - 1)])] - logit[size_t(order[size_t(K)])]);
      double z = 0, chosen = 0;
      for (int e = 0; e < s.n_expert; ++e) z += std::exp(logit[size_t(e)]);
      for (int i = 0; i < K; ++i) chosen += std::exp(logit[size_t(order[size_t(i)])]) / z;
      Vec out(size_t(E), 0.0);
      for (int i = 0; i < K; ++i) {
        const int e = order[size_t(i)];
        double w = std::exp(logit[size_t(e)]) / z;
        if (!qwen2moe && !olmoe) w /= chosen;
        const Vec d = ffn(h, "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", s.n_ff_exp, e * s.n_ff_exp);
        for (int j = 0; j < E; ++j) out[size_t(j)] += w * d[size_t(j)];
      }
      if (s.n_ff_shexp > 0) {
        double gz = 0;
        for (int j = 0; j < E; ++j) gz += double(W(b + "ffn_gate_inp_shexp.weight")[size_t(j)]) * h[size_t(j)];
        const Vec d = ffn(h, "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", s.n_ff_shexp, 0);
        for (int j = 0; j < E; ++j) out[size_t(j)] += d[size_t(j)] / (1 + std::exp(-gz));
      }
      for (int j = 0; j < E; ++j) x[size_t(t)][size_t(j)] += res * out[size_t(j)];
    }
    for (int t = 0; t < T && s.n_expert == 0; ++t) {
      const Vec h = post_only ? x[size_t(t)]
                    : rmsnorm(x[size_t(t)], W(b + (olmo_pre ? "post_ffw_norm.weight" : "ffn_norm.weight")).data(), 0,
                              size_t(E), eps);
      Vec g, u;
      if (phi3 || glm4) {  // gate_up_proj: its output chunks into gate, then up
        const Vec gu = matvec(W(b + "ffn_up.weight"), 2 * s.n_ff, E, h);
        g.assign(gu.begin(), gu.begin() + s.n_ff);
        u.assign(gu.begin() + s.n_ff, gu.end());
      } else {
        g = matvec(W(b + "ffn_gate.weight"), s.n_ff, E, h);
        u = matvec(W(b + "ffn_up.weight"), s.n_ff, E, h);
      }
      Vec a(size_t(s.n_ff));
      for (size_t i = 0; i < a.size(); ++i) a[i] = act(g[i]) * u[i];
      Vec d = matvec(W(b + "ffn_down.weight"), E, s.n_ff, a);
      if (gemma_post || post_only || glm4_post)
        d = rmsnorm(d, gemma1 ? ones.data() : W(b + "post_ffw_norm.weight").data(), 0, size_t(E), eps);
      for (int i = 0; i < E; ++i) x[size_t(t)][size_t(i)] += res * d[size_t(i)];
    }
    if (size_t(l) < s.control.size() && !s.control[size_t(l)].empty())
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < E; ++i) x[size_t(t)][size_t(i)] += s.control[size_t(l)][size_t(i)];
  }
  std::vector<Vec> logits;
  const std::string out = m.w.count("output.weight") ? "output.weight" : "token_embd.weight";  // else tied
  for (int t = 0; t < T; ++t) {
    const Vec normed = rmsnorm(x[size_t(t)], W("output_norm.weight").data(), 0, size_t(E), eps);
    if (hidden) hidden->push_back(normed);
    logits.push_back(matvec(W(out), s.n_vocab, E, normed));
    if (s.final_softcap > 0)
      for (double& z : logits.back()) z = s.final_softcap * std::tanh(z / s.final_softcap);
    if (granite)
      for (double& z : logits.back()) z /= s.logit_div;
  }
  return logits;
}

std::vector<int32_t> prompt(const Spec& s, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(int32_t(rng() % uint32_t(s.n_vocab)));
  return ids;
}

std::unique_ptr<Pipeline> load(const Model& m, int n_batch, int n_seq = 1, int n_ctx = 64,
                               const std::vector<ControlVectorFile>& control = {}, int control_first = -1,
                               int control_last = -1) {
  LoadOptions o;
  o.control_vectors = control;
  o.control_first = control_first;
  o.control_last = control_last;
  o.n_ctx = n_ctx;
  o.n_seq = n_seq;
  o.n_batch = n_batch;
  o.n_threads = 2;
  return Pipeline::load(m.path, o);
}

// Max and mean |fast - reference| over all logits, the reference's standard deviation, and how
// many positions' argmax agree.
struct Deviation {
  double max_d = 0, mean_d = 0, sd = 0;
  size_t agree = 0;
};
Deviation deviation(const Model& m, const std::vector<int32_t>& ids, const std::vector<float>& got, int n_ctx = 64) {
  const auto ref = reference(m, ids, n_ctx);
  const int V = m.spec.n_vocab;
  double max_d = 0, sum_d = 0, sum = 0, sum2 = 0;
  size_t agree = 0;
  for (size_t t = 0; t < ids.size(); ++t) {
    size_t best_ref = 0, best_got = 0;
    for (int i = 0; i < V; ++i) {
      const double r = ref[t][size_t(i)], g = got[t * size_t(V) + size_t(i)];
      max_d = std::max(max_d, std::fabs(r - g));
      sum_d += std::fabs(r - g);
      sum += r;
      sum2 += r * r;
      if (r > ref[t][best_ref]) best_ref = size_t(i);
      if (g > got[t * size_t(V) + best_got]) best_got = size_t(i);
    }
    agree += best_ref == best_got;
  }
  const double n = double(ids.size()) * V;
  return {max_d, sum_d / n, std::sqrt(sum2 / n - (sum / n) * (sum / n)), agree};
}

// A deliberately wrong reference (or a file missing something) must miss the fast path's logits by
// far more than compare() allows (0.15 sd max, 0.035 sd mean): twice that. Prints the distance.
void check_misses(const Deviation& d, const std::string& what) {
  std::printf("%-58s max|d| %.4f mean|d| %.4f (logit sd %.2f)\n", what.c_str(), d.max_d, d.mean_d, d.sd);
  INFO(what);
  CHECK(d.max_d > 0.3 * d.sd);
  CHECK(d.mean_d > 0.07 * d.sd);
}

// Max |fast - reference| over all logits, relative to the reference's standard deviation.
void compare(const Model& m, const std::vector<int32_t>& ids, const std::vector<float>& got, const char* what,
             int n_ctx = 64) {
  const auto [max_d, mean_d, sd, agree] = deviation(m, ids, got, n_ctx);
  std::printf("%-7s %-5s %-22s max|d| %.4f mean|d| %.4f (logit sd %.2f), argmax agrees %zu/%zu\n",
              m.spec.arch.c_str(), type_name(m.spec.wtype), what, max_d, mean_d, sd, agree, ids.size());
  CHECK(sd > 0.5);  // the model is not degenerate
  if (m.spec.arch == "gpt-oss") {  // its clamped SwiGLU clamped some gate and up values
    INFO("values clamped " << g_clamped);
    CHECK(g_clamped > 0);
  }
  g_clamped = 0;
  if (m.spec.n_expert > 0) {  // every router decision is clear of the fast path's rounding
    INFO("smallest router margin " << g_min_router_gap);
    CHECK(g_min_router_gap > kRouterMargin);
    g_min_router_gap = 1e30;
  }
  // The fast path quantizes activations to 8 bits for its integer dot products and keeps K/V in
  // F16: a few percent of a standard deviation. A wrong RoPE, mask or norm costs a whole one.
  CHECK(max_d < 0.15 * sd);
  CHECK(mean_d < 0.035 * sd);
}

std::vector<float> run_prompt(Pipeline& p, const std::vector<int32_t>& ids, int seq = 0) {
  std::vector<float> out(ids.size() * size_t(p.n_vocab()));
  Batch b;
  for (size_t i = 0; i < ids.size(); ++i) b.add(ids[i], int32_t(i), seq, true);
  p.decode(b, out.data());
  return out;
}

// Each family's tiny model: the llama defaults of Spec, changed where the family's layout differs.
Spec spec_of(const std::string& arch, GgmlType t) {
  Spec s;
  s.arch = arch;
  s.wtype = t;
  if (arch == "qwen3") {  // Qwen3 0.6B's proportions: heads twice as wide as n_embd / n_head, GQA 2:1
    s.n_head = 8;
    s.n_head_kv = 4;
  } else if (arch == "phi3") {  // fused q/k/v and gate/up; LongRoPE past 32 (the tests' 64: long factors)
    s.rope_long_ctx = 32;
    s.rope_attn_factor = 1.2f;
  } else if (arch == "mixtral") {  // a llama file with experts: top 2 of 4, renormalized
    s.arch = "llama";
    s.n_expert = 4;
    s.n_expert_used = 2;
    s.n_ff_exp = s.n_ff;
  } else if (arch == "qwen3moe") {  // Qwen3's attention; top 3 of 8 narrow experts, renormalized
    s.n_head = 8;
    s.n_head_kv = 4;
    s.n_expert = 8;
    s.n_expert_used = 3;
    s.n_ff_exp = 256;
  } else if (arch == "qwen3moe-merged") {  // the same in a newer conversion's layout
    s = spec_of("qwen3moe", t);
    s.merged_exps = true;
  } else if (arch == "qwen2moe") {  // q/k/v biases; top 2 of 6 as the softmax weighs them, a shared expert
    s.n_expert = 6;
    s.n_expert_used = 2;
    s.n_ff_exp = 256;
    s.n_ff_shexp = 512;
  } else if (arch == "gpt-oss") {  // layers 0 and 2 sliding (window 5); top 3 of 6 experts with biases
    s.n_layer = 3;
    s.window = 5;
    s.swa_pattern = 2;
    s.n_expert = 6;
    s.n_expert_used = 3;
    s.n_ff_exp = 256;
  } else if (arch == "granite") {  // Granite 3's embedding and residual multipliers; a q·k scale
    s.embd_mult = 12.f;            // above 1/√64 (Granite's own 1/64 flattens these tiny scores)
    s.residual_mult = 0.22f;       // and a division of the logits by 4
    s.attn_mult = 0.45f;
    s.logit_div = 4.f;
  } else if (arch == "granitemoe") {  // the same with top 2 of 6 experts n_ff wide, renormalized
    s = spec_of("granite", t);
    s.arch = "granitemoe";
    s.n_expert = 6;
    s.n_expert_used = 2;
    s.n_ff_exp = s.n_ff;
  } else if (arch == "smollm3") {  // layer 3 without RoPE
    s.n_layer = 4;
  } else if (arch == "olmo2") {  // OLMo 2: post-norms only, whole-row q/k norms, 2:1 GQA (as OLMo 2 32B's 5:1)
  } else if (arch == "olmo3") {  // OLMo 3 (an olmo2 file): layers 0-2 sliding (window 5), layer 3 global with
    s = spec_of("olmo2", t);     // YaRN x8 from a context of 64 (pairs 6 and up interpolated at this base)
    s.n_layer = 4;
    s.window = 5;
    s.swa_pattern = 4;
    s.yarn_factor = 8.f;
    s.yarn_ctx = 64;
  } else if (arch == "ernie4_5") {  // llama's layer with use_bias (q/k/v and o_proj biases), a tied head
    s.use_bias = true;
  } else if (arch == "exaone4") {  // post-norms only, q/k norms per head; layers 0-2 sliding (window 5) and
    s.n_layer = 4;                   // rotating (Llama 3 factors), layer 3 global without RoPE
    s.window = 5;
    s.swa_pattern = 4;
  } else if (arch == "olmoe") {  // whole-row q/k norms; top 2 of 6 experts n_ff wide, not renormalized
    s.n_ff = 256;
    s.n_expert = 6;
    s.n_expert_used = 2;
    s.n_ff_exp = s.n_ff;
  } else if (arch == "gemma3") {  // layers 0 and 1 sliding (window 5), layer 2 global
    s.n_layer = 3;
    s.n_head_kv = 1;
    s.window = 5;
    s.swa_pattern = 3;
  } else if (arch == "glm4") {  // GLM-4: 32 of each head's 64 dims rotated (partial_rotary_factor 0.5)
    s.rope_dim = s.head_dim / 2;
  } else if (arch == "gemma") {  // Gemma 1: one KV head (the 2B's), heads of 128 on a 256-wide residual
    s.n_head_kv = 1;               // (wider than n_embd / n_head, as the 7B's 16 heads of 256 on 3072)
    s.head_dim = 128;
  } else if (arch == "gemma2") {  // layers 0 and 2 sliding; caps small enough to bite here (Gemma 2's
    s.n_layer = 3;                // own 50 and 30 are above what these tiny scores and logits reach)
    s.window = 5;
    s.swa_pattern = 2;
    s.attn_softcap = 0.8f;
    s.final_softcap = 2.5f;
  }
  return s;
}

// A mixture-of-experts model (seed s.seed, s.seed + 1, ...) whose routing of `ids` is decisive
// (kRouterMargin).
Model decisive_model(Spec s, const std::vector<int32_t>& ids, int n_ctx = 64) {
  for (int tries = 0; tries < 50; ++tries, ++s.seed) {
    Model m = make_model(s);
    g_min_router_gap = 1e30;
    reference(m, ids, n_ctx);
    const bool ok = g_min_router_gap > kRouterMargin;
    g_min_router_gap = 1e30;
    g_clamped = 0;
    if (ok) return m;
  }
  FAIL("no seed routes the prompt decisively");
  return {};
}

}  // namespace

// The sanitizer build (CI's longest stage) runs the sweep on Q8_0 (and the mixtures on MXFP4, and
// on Q4_K two of them: Q4_K's 256-wide blocks through the expert matmuls): it checks memory, not
// numbers, and every type's kernels run under it in test_matmul. (The search for a decisive seed
// quantizes a whole model per try, ~1 s for Q4_K there: qwen3moe's took 22 tries, half a minute.)
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

TEST_CASE("tiny generated models: fast path matches the float reference for every weight type") {
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K,
                     GgmlType::IQ4_NL, GgmlType::IQ4_XS, GgmlType::MXFP4}) {
    if (kSanitized && t != GgmlType::Q8_0 && t != GgmlType::Q4_K && t != GgmlType::MXFP4) continue;
    for (const std::string arch : {"llama", "gemma3", "qwen3", "phi3", "gemma2", "mixtral", "qwen3moe", "qwen2moe",
                                   "qwen3moe-merged", "gpt-oss", "granite", "granitemoe", "smollm3", "olmo3", "olmoe", "ernie4_5",
                                   "exaone4", "gemma", "glm4"}) {
      // (olmo3: OLMo 2's layer with OLMo 3's windows and YaRN; plain OLMo 2 in the olmo2 test below)
      Spec s = spec_of(arch, t);
      // The routing does not depend on the weights' type: the mixtures take two, and MXFP4 (an
      // expert format: test_matmul has its kernels on every shape) runs in the mixtures only.
      const bool mx_moe = t == GgmlType::MXFP4 && (arch == "mixtral" || arch == "qwen3moe" || arch == "gpt-oss");
      if (t == GgmlType::MXFP4 && !mx_moe) continue;
      if (s.n_expert > 0 && t != GgmlType::Q8_0 && t != GgmlType::Q4_K && !mx_moe) continue;
      // Families whose difference is the layer's structure, not a tensor shape the types treat
      // differently, take two types too (the kernels are the llama's, gemma3's and qwen3's above).
      const bool structure_only =
          arch == "smollm3" || arch == "olmo3" || arch == "ernie4_5" || arch == "exaone4" || arch == "gemma" || arch == "glm4";
      if (structure_only && t != GgmlType::Q8_0 && (t != GgmlType::Q4_K || kSanitized)) continue;
      if (kSanitized && s.n_expert == 0 && t != GgmlType::Q8_0) continue;
      if (kSanitized && t == GgmlType::Q4_K && arch != "mixtral" && arch != "gpt-oss") continue;
      const auto ids = prompt(s, 12, 11);
      const Model m = s.n_expert > 0 ? decisive_model(s, ids) : make_model(s);
      auto p = load(m, 64);
      compare(m, ids, run_prompt(*p, ids), "one batch");
    }
  }
}

// The granite test above checks every multiplier: left out of the file (the forward then runs
// without it), each moves the logits far past the tolerance the comparison allows.
TEST_CASE("tiny generated models: each of granite's multipliers matters") {
  for (const std::string arch : {"granite", "granitemoe"}) {
    const Spec s = spec_of(arch, GgmlType::Q8_0);
    const auto ids = prompt(s, 12, 11);
    const Model m = s.n_expert > 0 ? decisive_model(s, ids) : make_model(s);
    compare(m, ids, run_prompt(*load(m, 64), ids), "all multipliers");  // (closed before the file is rewritten)
    for (const char* key : {"embedding_scale", "residual_scale", "attention.scale", "logit_scale"}) {
      Spec without = m.spec;
      without.drop_key = key;
      const Model w = make_model(without);  // (the same weights: the same seed)
      auto q = load(w, 64);
      const auto d = deviation(m, ids, run_prompt(*q, ids));
      g_min_router_gap = 1e30;
      check_misses(d, arch + " without " + key);
    }
  }
}

// Control vectors (runtime/control_vector.h, llama.cpp's --control-vector files): two files' scaled
// directions summed and added to each steered layer's output, as the reference adds them (granite:
// under its residual scale too), alone on the layers a range keeps; without them the logits are far
// off. The second file's model hint names another family (a warning, not an error).
TEST_CASE("tiny generated models: control vectors add to the layers' outputs") {
  for (const std::string arch : {"llama", "granite"}) {
    Spec s = spec_of(arch, GgmlType::Q8_0);
    s.n_layer = 3;
    const auto ids = prompt(s, 12, 11);
    const Model m = make_model(s);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.f, 0.6f);
    auto direction = [&] {
      std::vector<float> v(size_t(s.n_embd));
      for (float& x : v) x = normal(rng);
      return v;
    };
    const std::vector<float> a1 = direction(), a2 = direction(), b2 = direction();
    auto write = [&](const std::string& name, const std::string& hint, std::vector<std::pair<int, const std::vector<float>*>> dirs) {
      gguf::Writer w;
      w.set("general.architecture", gguf::Value::of_str("controlvector"));
      w.set("controlvector.model_hint", gguf::Value::of_str(hint));
      w.set("controlvector.layer_count", gguf::Value::of_u32(uint32_t(dirs.size())));
      for (auto [l, v] : dirs)
        w.add_tensor("direction." + std::to_string(l), GgmlType::F32, {int64_t(v->size())}, v->data(), v->size() * 4);
      const std::string path = test::temp_dir() + "/" + arch + "-" + name + ".gguf";
      w.write(path);
      return path;
    };
    const std::string fa = write("cv-a", arch, {{1, &a1}, {2, &a2}}), fb = write("cv-b", "qwen2", {{2, &b2}});
    const std::vector<ControlVectorFile> both = {{fa, 0.8f}, {fb, -0.5f}};
    auto sum = [&](const std::vector<float>& x, float sx, const std::vector<float>* y, float sy) {
      std::vector<float> r(x.size());
      for (size_t i = 0; i < r.size(); ++i) r[i] = sx * x[i] + (y ? sy * (*y)[i] : 0.f);
      return r;
    };
    Model with = m;
    with.spec.control = {{}, sum(a1, 0.8f, nullptr, 0), sum(a2, 0.8f, &b2, -0.5f)};
    const auto got = run_prompt(*load(m, 64, 1, 64, both), ids);
    compare(with, ids, got, "control vectors");
    check_misses(deviation(m, ids, got), arch + " against a reference without the control vectors");
    Model last = m;
    last.spec.control = {{}, {}, with.spec.control[2]};
    compare(last, ids, run_prompt(*load(m, 64, 1, 64, both, 2, 2), ids), "control range 2..2");
  }
}

// The smollm3 test above checks its NoPE layer: rotated in the reference as the other layers are,
// the fast path's logits (prompt and decode steps) leave the tolerance far behind.
TEST_CASE("tiny generated models: smollm3's layer without RoPE matters") {
  Spec s = spec_of("smollm3", GgmlType::Q8_0);
  // Random weights attend almost evenly, whatever the positions: a sharper attention (q·k times 3,
  // which also triples the 8-bit activations' error in the scores) makes the rotation count.
  s.q_amp = 3.f;
  const auto ids = prompt(s, 12, 11);
  const Model m = make_model(s);
  const auto got = run_prompt(*load(m, 64), ids);
  compare(m, ids, got, "layer 3 without RoPE");
  Spec rotated = s;
  rotated.rope_every_layer = true;
  Model r = m;
  r.spec = rotated;  // (the same file and weights; only the reference changes)
  const auto d = deviation(r, ids, got);
  check_misses(d, "smollm3 against a reference rotating layer 3");
}

// The olmo2 tests above check OLMo's layer: the reference with q/k norms per head instead of over
// the whole rows, with the post-norms placed before the blocks (llama's layout), or (OLMo 3) with
// its sliding layers rotated by YaRN as the global one is, each leaves the tolerance far behind.
TEST_CASE("tiny generated models: olmo2's whole-row q/k norms, post-norm placement and OLMo 3's plain local RoPE matter") {
  for (const std::string arch : {"olmo2", "olmo3"}) {
    const Spec s = spec_of(arch, GgmlType::Q8_0);
    const auto ids = prompt(s, 12, 11);
    const Model m = make_model(s);
    const auto got = run_prompt(*load(m, 64), ids);
    compare(m, ids, got, arch == "olmo3" ? "OLMo 3 (window, YaRN)" : "OLMo 2");
    for (const char* wrong : {"per-head q/k norms", "pre-norm placement", "YaRN on sliding layers"}) {
      Spec w = s;
      w.olmo_per_head_norm = wrong[0] == 'p' && wrong[1] == 'e';
      w.olmo_pre_norm = wrong[0] == 'p' && wrong[1] == 'r';
      w.olmo_yarn_everywhere = wrong[0] == 'Y';
      if (w.olmo_yarn_everywhere && arch != "olmo3") continue;
      Model r = m;
      r.spec = w;  // (the same file and weights; only the reference changes)
      const auto d = deviation(r, ids, got);
      check_misses(d, arch + " against a reference with " + wrong);
    }
  }
}

// The ernie4_5 test above checks use_bias: a reference without the q/k/v biases, or without o_proj's,
// leaves the tolerance far behind.
TEST_CASE("tiny generated models: ernie4_5's q/k/v and output biases matter") {
  const Spec s = spec_of("ernie4_5", GgmlType::Q8_0);
  const auto ids = prompt(s, 12, 11);
  const Model m = make_model(s);
  const auto got = run_prompt(*load(m, 64), ids);
  compare(m, ids, got, "with its biases");
  for (const char* drop : {"qkv", "output"}) {
    Model r = m;
    r.spec.ref_drop_bias = drop;  // (the same file and weights; only the reference changes)
    const auto d = deviation(r, ids, got);
    check_misses(d, std::string("ernie4_5 against a reference without the ") + drop + " bias");
  }
}

// The exaone4 test above checks its hybrid layout: a reference that rotates the global layer too, or
// rotates the sliding layers without the Llama 3 factors, leaves the tolerance far behind.
TEST_CASE("tiny generated models: exaone4's global layer without RoPE and its sliding layers' RoPE factors matter") {
  Spec s = spec_of("exaone4", GgmlType::Q8_0);
  s.q_amp = 3.f;  // (a sharper attention, as for smollm3's NoPE test: where keys sit then matters)
  const auto ids = prompt(s, 12, 11);
  const Model m = make_model(s);
  const auto got = run_prompt(*load(m, 64), ids);
  compare(m, ids, got, "layer 3 global without RoPE");
  for (const char* wrong : {"the global layer rotated", "no RoPE factors"}) {
    Model r = m;
    r.spec.rope_every_layer = wrong[0] == 't';
    r.spec.ref_no_rope_freqs = wrong[0] == 'n';  // (the same file and weights; only the reference changes)
    const auto d = deviation(r, ids, got);
    check_misses(d, std::string("exaone4 against a reference with ") + wrong);
  }
}

// The gemma test above checks Gemma 1's layer: a reference that adds Gemma 3's per-head q/k norms or
// its norms on the blocks' outputs (unit weights: Gemma 1's files have none), adds Gemma's 1 to the
// stored norm weights once more, or leaves the embedding scale out, leaves the tolerance far behind.
TEST_CASE("tiny generated models: gemma (Gemma 1) has no q/k norms or post-norms, its stored norms hold the +1") {
  Spec s = spec_of("gemma", GgmlType::Q8_0);
  s.q_amp = 3.f;  // (a sharper attention: the magnitude a q norm would take away then matters)
  const auto ids = prompt(s, 12, 11);
  const Model m = make_model(s);
  const auto got = run_prompt(*load(m, 64), ids);
  compare(m, ids, got, "Gemma 1");
  for (const char* wrong : {"q/k norms", "post-norms", "the norms' +1 again", "no embedding scale"}) {
    Model r = m;  // (the same file and weights; only the reference changes)
    r.spec.ref_qk_norm = wrong[0] == 'q';
    r.spec.ref_post_norms = wrong[0] == 'p';
    r.spec.ref_no_embd_scale = wrong[0] == 'n';
    if (wrong[0] == 't')
      for (auto& [name, w] : r.w)
        if (name.size() > 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0)
          for (float& v : w) v += 1.f;
    const auto d = deviation(r, ids, got);
    check_misses(d, std::string("gemma against a reference with ") + wrong);
  }
}

// The glm4 test above checks GLM-4's layer: a reference without the norms on the attention and MLP
// outputs, rotating every dim of the head (not its first half), or rotating NeoX's halves (i, i + R/2)
// instead of interleaved pairs leaves the tolerance far behind.
TEST_CASE("tiny generated models: glm4's post-norms, its half-head RoPE and its interleaved pairs matter") {
  const Spec s = spec_of("glm4", GgmlType::Q8_0);
  const auto ids = prompt(s, 12, 11);
  const Model m = make_model(s);
  const auto got = run_prompt(*load(m, 64), ids);
  compare(m, ids, got, "GLM-4");
  for (const char* wrong : {"no post-norms", "every dim rotated", "NeoX halves"}) {
    Model r = m;  // (the same file and weights; only the reference changes)
    r.spec.ref_no_post_norms = wrong[0] == 'n' && wrong[1] == 'o';
    r.spec.ref_full_rope = wrong[0] == 'e';
    r.spec.ref_neox = wrong[0] == 'N';
    const auto d = deviation(r, ids, got);
    check_misses(d, std::string("glm4 against a reference with ") + wrong);
  }
}

TEST_CASE("tiny generated models: phi3's short RoPE factors up to the original context, long ones past it") {
  const Spec s = spec_of("phi3", GgmlType::Q8_0);
  const Model m = make_model(s);
  const auto ids = prompt(s, 12, 5);
  auto short_ctx = load(m, 64, 1, 32), long_ctx = load(m, 64, 1, 33);
  const auto a = run_prompt(*short_ctx, ids), b = run_prompt(*long_ctx, ids);
  compare(m, ids, a, "context 32 (short)", 32);
  compare(m, ids, b, "context 33 (long)", 33);
  double d = 0;  // and the choice matters: the two differ by far more than the tolerance
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::fabs(a[i] - b[i])));
  CHECK(d > 1.0);

  // Phi-4-mini rotates 3/4 of each head: the attention factor scales only the rotated dims.
  Spec p = s;
  p.rope_dim = 48;
  const Model pm = make_model(p);
  auto partial = load(pm, 64);
  compare(pm, ids, run_prompt(*partial, ids), "rotating 48 of 64");
}

TEST_CASE("tiny generated models: chunked prefill and token-by-token decode equal one batch") {
  for (const std::string arch : {"llama", "gemma3", "qwen2moe", "gpt-oss", "granite", "smollm3", "olmo3"}) {  // (experts: decode runs them as one job)
    const Spec s = spec_of(arch, GgmlType::Q8_0);
    const auto ids = prompt(s, 17, 3);  // longer than the sliding window: the rings wrap
    const Model m = s.n_expert > 0 ? decisive_model(s, ids) : make_model(s);
    auto one = load(m, 64);
    const auto a = run_prompt(*one, ids);
    compare(m, ids, a, "one batch (17 tokens)");

    auto chunked = load(m, 4);  // decode() splits into chunks of 4
    const auto b = run_prompt(*chunked, ids);
    auto single = load(m, 1);
    std::vector<float> c(a.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      Batch bt;
      bt.add(ids[i], int32_t(i), 0, true);
      single->decode(bt, c.data() + i * size_t(s.n_vocab));
    }
    double db = 0, dc = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      db = std::max(db, double(std::fabs(a[i] - b[i])));
      dc = std::max(dc, double(std::fabs(a[i] - c[i])));
    }
    INFO(s.arch << ": chunked " << db << ", token by token " << dc);
    CHECK(db < 1e-3);
    CHECK(dc < 1e-3);
  }
}

TEST_CASE("tiny generated models: a batch of two sequences equals each one alone") {
  for (const std::string arch : {"llama", "gemma3", "qwen3moe"}) {
    const Spec s = spec_of(arch, GgmlType::Q4_K);
    const auto x = prompt(s, 9, 21), y = prompt(s, 6, 22);
    const Model m = s.n_expert > 0 ? decisive_model(s, x) : make_model(s);
    auto alone = load(m, 64, 2);
    const auto ax = run_prompt(*alone, x, 0);
    const auto ay = run_prompt(*alone, y, 1);

    // Interleaved in one batch, in the other slots' order (sequence 1 first), logits for all.
    auto both = load(m, 64, 2);
    Batch b;
    size_t i = 0, j = 0;
    while (i < x.size() || j < y.size()) {
      if (j < y.size()) { b.add(y[j], int32_t(j), 1, true); ++j; }
      if (i < x.size()) { b.add(x[i], int32_t(i), 0, true); ++i; }
      if (i < x.size()) { b.add(x[i], int32_t(i), 0, true); ++i; }
    }
    const size_t V = size_t(s.n_vocab);
    std::vector<float> out(size_t(b.size()) * V);
    both->decode(b, out.data());
    double d = 0;
    for (int r = 0; r < b.size(); ++r) {
      const auto& ref = b.seq[size_t(r)] == 0 ? ax : ay;
      const float* want = ref.data() + size_t(b.pos[size_t(r)]) * V;
      for (size_t k = 0; k < V; ++k) d = std::max(d, double(std::fabs(out[size_t(r) * V + k] - want[k])));
    }
    INFO(s.arch << ": two sequences vs alone, max|d| " << d);
    CHECK(d < 1e-4);
    CHECK(both->seq_len(0) == int(x.size()));
    CHECK(both->seq_len(1) == int(y.size()));

    // Continue each with one more token in a shared decode step: still equals the single runs.
    Batch step;
    step.add(5, int32_t(x.size()), 0, true);
    step.add(7, int32_t(y.size()), 1, true);
    std::vector<float> two(2 * V), one(V);
    both->decode(step, two.data());
    Batch sx;
    sx.add(5, int32_t(x.size()), 0, true);
    alone->decode(sx, one.data());
    double dd = 0;
    for (size_t k = 0; k < V; ++k) dd = std::max(dd, double(std::fabs(two[k] - one[k])));
    CHECK(dd < 1e-4);
  }
}

// Embeddings (runtime/embed.h): the pipeline's kHidden rows, pooled and normalized, against the
// reference's final hidden states after the output norm, pooled and normalized in double. Four
// inputs over two slots in forwards of 8 tokens: the long one takes several forwards, the others
// share forwards with it.
TEST_CASE("tiny generated models: embeddings are the reference's normed final states, pooled") {
  for (const std::string arch : {"llama", "qwen3"}) {
    const Spec s = spec_of(arch, GgmlType::F32);
    const Model m = make_model(s);
    const std::vector<std::vector<int32_t>> inputs = {prompt(s, 5, 1), prompt(s, 19, 2), prompt(s, 1, 3), prompt(s, 9, 4)};
    std::vector<std::vector<Vec>> hidden(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) reference(m, inputs[i], 64, &hidden[i]);
    const auto p = load(m, /*n_batch=*/8, /*n_seq=*/2);
    const size_t E = size_t(s.n_embd);
    std::map<Pooling, std::vector<float>> first_of;  // each pooling's vector of input 0 (normalized)
    for (Pooling pool : {Pooling::Mean, Pooling::Last, Pooling::Cls, Pooling::None})
      for (int norm : {-1, 2}) {
        EmbedOptions o;
        o.pooling = pool;
        o.normalize = norm;
        o.batch_tokens = 8;
        std::vector<Embedding> got;
        embed_sequences(*p, inputs, o, [&](Embedding&& e) { got.push_back(std::move(e)); });
        REQUIRE(got.size() == inputs.size());
        double worst_cos = 1, worst_rel = 0;
        for (size_t i = 0; i < inputs.size(); ++i) {
          const Embedding& e = got[i];
          CHECK(e.index == i);  // in input order
          CHECK(e.n_tokens == int(inputs[i].size()));
          // The reference's vectors: one per token (none) or pooled, each normalized as asked.
          std::vector<Vec> want;
          const auto& h = hidden[i];
          if (pool == Pooling::None) want = h;
          if (pool == Pooling::Last) want = {h.back()};
          if (pool == Pooling::Cls) want = {h.front()};
          if (pool == Pooling::Mean) {
            Vec mean(E, 0.0);
            for (const Vec& r : h)
              for (size_t k = 0; k < E; ++k) mean[k] += r[k] / double(h.size());
            want = {mean};
          }
          REQUIRE(e.values.size() == want.size() * E);
          for (size_t r = 0; r < want.size(); ++r) {
            Vec& w = want[r];
            if (norm == 2) {
              double n2 = 0;
              for (double v : w) n2 += v * v;
              for (double& v : w) v /= std::sqrt(n2);
            }
            const float* g = e.values.data() + r * E;
            double dot = 0, gg = 0, ww = 0, max_d = 0, max_w = 0;
            for (size_t k = 0; k < E; ++k) {
              dot += g[k] * w[k], gg += double(g[k]) * g[k], ww += w[k] * w[k];
              max_d = std::max(max_d, std::fabs(g[k] - w[k]));
              max_w = std::max(max_w, std::fabs(w[k]));
            }
            if (norm == 2) CHECK(std::fabs(std::sqrt(gg) - 1.0) < 1e-5);  // unit length
            worst_cos = std::min(worst_cos, dot / std::sqrt(gg * ww));
            worst_rel = std::max(worst_rel, max_d / max_w);
          }
        }
        if (norm == 2) first_of[pool] = std::vector<float>(got[0].values.begin(), got[0].values.begin() + E);
        std::printf("%-5s embeddings, pooling %-4s normalize %2d: worst cosine %.7f, max|d| / max|v| %.5f\n",
                    arch.c_str(), to_string(pool), norm, worst_cos, worst_rel);
        // F32 weights (float activations) and F16 K/V: a few 1e-4 of the largest value. A missing
        // output norm (weights 1 ± 0.2) costs ~1e-2 of cosine, a row of the wrong token or the
        // wrong pooling whole vectors.
        CHECK(worst_cos > 0.99999);
        CHECK(worst_rel < 0.002);
      }
    // The poolings differ from each other here, so the checks above tell them apart.
    for (const auto& [a, va] : first_of)
      for (const auto& [b, vb] : first_of) {
        if (a >= b || (a == Pooling::None && b == Pooling::Cls)) continue;  // none's first row is cls
        double dot = 0;
        for (size_t k = 0; k < E; ++k) dot += double(va[k]) * vb[k];
        INFO(to_string(a) << " vs " << to_string(b));
        CHECK(dot < 0.99);
      }
  }
}

TEST_CASE("config: missing and inconsistent keys are all reported in one error") {
  gguf::Writer wr;
  wr.set("general.architecture", gguf::Value::of_str("llama"));
  wr.set("llama.embedding_length", gguf::Value::of_u32(100));
  wr.set("llama.attention.head_count", gguf::Value::of_u32(8));
  wr.set("llama.attention.head_count_kv", gguf::Value::of_u32(3));
  const auto bytes = wr.to_bytes();
  const auto f = gguf::File::parse(bytes.data(), bytes.size());
  try {
    ModelConfig::from_gguf(*f);
    FAIL("expected an error");
  } catch (const Error& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("llama.block_count") != std::string::npos);
    CHECK(msg.find("llama.feed_forward_length") != std::string::npos);
    CHECK(msg.find("llama.context_length") != std::string::npos);
    CHECK(msg.find("not a multiple of head_count_kv") != std::string::npos);
    CHECK(msg.find("not a multiple of head_count 8") != std::string::npos);
  }
}

TEST_CASE("config: smollm3's every 4th layer without RoPE (no key in its files); its preset") {
  ShapePreset p{"t", "smollm3", "test", 9, 64, 2, 1, 32, 64, 300, 128, true, 0, 0, 1e4f, 1e-5f, false};
  auto config = [](const ShapePreset& s) {
    const auto bytes = synth_writer(s, {}).to_bytes();
    return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  const ModelConfig c = config(p);
  CHECK(c.rope_style == RopeStyle::Adjacent);
  for (int l = 0; l < 9; ++l) {
    INFO("layer " << l);
    CHECK(c.is_nope(l) == (l == 3 || l == 7));
    CHECK(c.rope_dims(l) == (c.is_nope(l) ? 0 : 32));
  }
  CHECK_THAT(c.summary(), Catch::Contains("2 layers without RoPE"));
  p.architecture = "llama";  // the same tensors rotate in every layer
  const ModelConfig l = config(p);
  for (int i = 0; i < 9; ++i) CHECK_FALSE(l.is_nope(i));
  const ShapePreset& s3 = find_preset("smollm3-3b");  // HuggingFaceTB/SmolLM3-3B's config.json
  CHECK((s3.n_layer == 36 && s3.n_embd == 2048 && s3.n_head == 16 && s3.n_head_kv == 4 && s3.head_dim == 128 &&
         s3.n_ff == 11008 && s3.n_vocab == 128256 && s3.tied && s3.rope_base == 5e6f));
}

TEST_CASE("config: granite's multipliers from the file (0 or absent: none); its biases and a shared expert refused") {
  ShapePreset p{"t", "granite", "test", 1, 64, 2, 1, 32, 64, 300, 128, true, 0, 0, 1e4f, 1e-5f, false};
  auto config = [](gguf::Writer& w) {
    const auto bytes = w.to_bytes();
    return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  gguf::Writer w = synth_writer(p, {});  // a custom shape: Granite 3's own multipliers
  ModelConfig c = config(w);
  CHECK(c.rope_style == RopeStyle::Adjacent);
  CHECK(c.embd_scale == 12.f);
  CHECK(c.residual_scale == 0.22f);
  CHECK(c.attn_scale == 1.f / 32);
  CHECK(c.logit_scale == 8.f);
  w.set("granite.residual_scale", gguf::Value::of_f32(0.f));
  w.set("granite.attention.scale", gguf::Value::of_f32(0.f));
  c = config(w);
  CHECK(c.residual_scale == 1.f);
  CHECK(c.attn_scale == Approx(1 / std::sqrt(32.0)));
  // The 8B preset's published values, and the same keys ignored by a family without them.
  const ShapePreset& g8 = find_preset("granite-3-8b");
  CHECK(g8.head_dim == 128);
  CHECK((g8.embedding_scale == 12.f && g8.residual_scale == 0.22f && g8.attention_scale == 0.0078125f && g8.logit_scale == 16.f));
  p.architecture = "llama";
  gguf::Writer l = synth_writer(p, {});
  l.set("llama.logit_scale", gguf::Value::of_f32(16.f));
  CHECK(config(l).logit_scale == 1.f);
  // A mixture: top k of the experts renormalized; GraniteMoeShared's shared expert is refused.
  ShapePreset m = p;
  m.architecture = "granitemoe";
  m.n_expert = 4, m.n_expert_used = 2, m.n_ff_exp = m.n_ff;
  gguf::Writer mw = synth_writer(m, {});
  c = config(mw);
  CHECK((c.n_expert == 4 && c.n_ff_exp == 64 && c.expert_weights_norm && c.logit_scale == 8.f));
  mw.set("granitemoe.expert_shared_feed_forward_length", gguf::Value::of_u32(64));
  CHECK_THROWS_WITH(config(mw), Catch::Contains("GraniteMoeShared"));
}

TEST_CASE("config: olmo2 (no pre-norms, whole-row q/k norms; OLMo 3's per-layer windows and YaRN on the global layers) and olmoe") {
  ShapePreset p{"t", "olmo2", "test", 4, 64, 2, 1, 32, 64, 300, 128, false, 0, 4, 5e5f, 1e-6f, false};
  auto config = [](gguf::Writer& w) {
    const auto bytes = w.to_bytes();
    return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  gguf::Writer w = synth_writer(p, {});  // OLMo 2: no window, no YaRN
  ModelConfig c = config(w);
  CHECK((c.rope_style == RopeStyle::NeoX && !c.pre_norms && c.post_norms && c.qk_norm && c.qk_norm_full));
  CHECK((c.q_norm_width() == 64 && c.k_norm_width() == 32 && c.rope_scaling == "none"));
  CHECK(c.layer_window == std::vector<int>{0, 0, 0, 0});
  p.sliding_window = 8;  // OLMo 3: layers 0-2 sliding (the flags synth writes), plain RoPE there
  w = synth_writer(p, {});
  c = config(w);
  CHECK(c.layer_window == std::vector<int>{8, 8, 8, 0});
  CHECK(c.rope_scaling == "yarn");
  CHECK(c.attn_factor(3) == Approx(1 + 0.1 * std::log(8.0)));
  CHECK(c.attn_factor(0) == 1.f);
  CHECK(c.freqs(0).back() == Approx(std::pow(5e5, -30.0 / 32)));       // the plain frequency
  CHECK(c.freqs(3).back() == Approx(std::pow(5e5, -30.0 / 32) / 8));   // interpolated
  std::vector<gguf::Value> flags;
  for (bool b : {false, true, true, false}) flags.push_back(gguf::Value::of_bool(b));
  w.set("olmo2.attention.sliding_window_pattern", gguf::Value::of_array(gguf::ValueType::BOOL, flags));
  CHECK(config(w).layer_window == std::vector<int>{0, 8, 8, 0});
  flags.pop_back();
  w.set("olmo2.attention.sliding_window_pattern", gguf::Value::of_array(gguf::ValueType::BOOL, flags));
  CHECK_THROWS_WITH(config(w), Catch::Contains("4 booleans"));
  // OLMoE: pre-norms, the whole-row norms, top-k weights not renormalized.
  ShapePreset m = p;
  m.architecture = "olmoe";
  m.sliding_window = 0;
  m.n_expert = 4, m.n_expert_used = 2, m.n_ff_exp = m.n_ff;
  gguf::Writer mw = synth_writer(m, {});
  c = config(mw);
  CHECK((c.pre_norms && c.qk_norm_full && c.n_expert == 4 && c.n_ff_exp == 64 && !c.expert_weights_norm));
  const ShapePreset& o7 = find_preset("olmo3-7b");
  CHECK((o7.n_layer == 32 && o7.n_embd == 4096 && o7.n_ff == 11008 && o7.sliding_window == 4096 && o7.swa_period == 4));
}

TEST_CASE("config: ernie4_5 (adjacent pairs, biases when the file has them, no sectioned RoPE); its preset") {
  ShapePreset p{"t", "ernie4_5", "test", 2, 64, 2, 1, 32, 64, 300, 128, true, 0, 0, 5e5f, 1e-5f, false};
  auto config = [](gguf::Writer& w) {
    const auto bytes = w.to_bytes();
    return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  gguf::Writer w = synth_writer(p, {});
  ModelConfig c = config(w);
  CHECK((c.rope_style == RopeStyle::Adjacent && c.pre_norms && !c.post_norms && !c.qk_norm && !c.attn_bias));
  CHECK((c.tied_output && !c.attn_out_bias && !c.has(LayerTensor::Bo) && !c.has(LayerTensor::Bq)));
  p.out_bias = true;  // the output bias alone, then with q/k/v biases
  w = synth_writer(p, {});
  c = config(w);
  CHECK((c.attn_out_bias && c.has(LayerTensor::Bo) && !c.attn_bias && !c.attn_sinks));
  p.qkv_bias = true;
  w = synth_writer(p, {});
  c = config(w);
  CHECK((c.attn_out_bias && c.attn_bias && c.has(LayerTensor::Bq) && c.has(LayerTensor::Bv)));
  w.set("ernie4_5.rope.dimension_sections", gguf::Value::of_array(gguf::ValueType::INT32,
        {gguf::Value::of_i32(8), gguf::Value::of_i32(4), gguf::Value::of_i32(4), gguf::Value::of_i32(0)}));
  CHECK_THROWS_WITH(config(w), Catch::Contains("sectioned"));
  const ShapePreset& e = find_preset("ernie4.5-0.3b");  // baidu/ERNIE-4.5-0.3B-PT's config.json
  CHECK((e.n_layer == 18 && e.n_embd == 1024 && e.n_head == 16 && e.n_head_kv == 2 && e.head_dim == 128 &&
         e.n_ff == 3072 && e.n_vocab == 103424 && e.tied && e.rope_base == 5e5f && e.rms_eps == 1e-5f && !e.out_bias));
}

TEST_CASE("config: exaone4 (post-norms only, per-head q/k norms; with a window the global layers NoPE, the sliding ones with the RoPE factors)") {
  ShapePreset p{"t", "exaone4", "test", 4, 64, 2, 1, 32, 64, 300, 128, true, 0, 4, 1e6f, 1e-5f, false};
  auto config = [](gguf::Writer& w) {
    const auto bytes = w.to_bytes();
    return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  gguf::Writer w = synth_writer(p, {});  // the 1.2B's layout: no window, every layer global and rotating
  ModelConfig c = config(w);
  CHECK((c.rope_style == RopeStyle::NeoX && !c.pre_norms && c.post_norms && c.qk_norm && !c.qk_norm_full));
  CHECK((c.q_norm_width() == 32 && c.k_norm_width() == 32));
  CHECK(c.layer_window == std::vector<int>{0, 0, 0, 0});
  for (int l = 0; l < 4; ++l) CHECK_FALSE(c.is_nope(l));
  p.sliding_window = 8;  // the 32B's: layers 0-2 sliding and rotating, layer 3 global without RoPE
  w = synth_writer(p, {});
  const std::vector<float> div(16, 4.f);  // Llama 3's factors: every layer that rotates uses them
  w.add_tensor("rope_freqs.weight", GgmlType::F32, {16}, div.data(), div.size() * sizeof(float));
  c = config(w);
  CHECK(c.layer_window == std::vector<int>{8, 8, 8, 0});
  for (int l = 0; l < 4; ++l) CHECK(c.rope_dims(l) == (l == 3 ? 0 : 32));
  CHECK(c.freqs(0).back() == Approx(std::pow(1e6, -30.0 / 32) / 4));
  CHECK(c.freqs(0) == c.freqs(3));
  CHECK_THAT(c.summary(), Catch::Contains("1 layers without RoPE"));
  w.set("exaone4.rope.freq_base_swa", gguf::Value::of_f32(1e4f));
  CHECK_THROWS_WITH(config(w), Catch::Contains("freq_base_swa"));
  const ShapePreset& e1 = find_preset("exaone4-1.2b");
  CHECK((e1.n_layer == 30 && e1.n_embd == 2048 && e1.head_dim == 64 && e1.tied && e1.sliding_window == 0));
  const ShapePreset& e32 = find_preset("exaone4-32b");
  CHECK((e32.n_layer == 64 && e32.sliding_window == 4096 && e32.swa_period == 4 && !e32.tied));
}

TEST_CASE("config: gemma (Gemma 1: pre-norms only, no q/k norms, GeGLU, embeddings x sqrt(n_embd), key_length heads, tied); its presets") {
  // As Gemma's converter writes a file: key_length and value_length, no rope.dimension_count, no
  // vocab_size, no output.weight; heads of 64 on a 64-wide residual with 2 heads (not 32 wide).
  const ShapePreset p{"t", "gemma", "test", 2, 64, 2, 1, 64, 128, 300, 128, true, 0, 0, 1e4f, 1e-6f, false};
  const auto bytes = synth_writer(p, {}).to_bytes();
  const auto f = gguf::File::parse(bytes.data(), bytes.size());
  CHECK_FALSE(f->has("gemma.rope.dimension_count"));
  const ModelConfig c = ModelConfig::from_gguf(*f);
  CHECK((c.rope_style == RopeStyle::NeoX && c.act == Activation::GeluTanh && c.embd_scale == 8.f));
  CHECK((c.pre_norms && !c.post_norms && !c.qk_norm && !c.attn_bias && !c.norm_add_one && c.tied_output));
  CHECK((c.has(LayerTensor::AttnNorm) && c.has(LayerTensor::FfnNorm) && !c.has(LayerTensor::QNorm) &&
         !c.has(LayerTensor::PostAttnNorm) && !c.has(LayerTensor::PostFfnNorm)));
  CHECK((c.head_dim_k == 64 && c.rope_dim == 64 && c.n_embd_q() == 128 && c.n_head_kv == 1));
  CHECK(c.attn_scale == Approx(1 / 8.0));
  CHECK((c.attn_softcap == 0.f && c.final_softcap == 0.f && c.rope_base == 1e4f));
  CHECK(c.layer_window == std::vector<int>{0, 0});
  // google/gemma-2b's and gemma-7b's config.json; q·k scaled by 1/sqrt(head_dim) at both (the 7B's
  // n_embd / n_head, 192, is not its head size).
  const ShapePreset& g2 = find_preset("gemma-2b");
  CHECK((g2.n_layer == 18 && g2.n_embd == 2048 && g2.n_head == 8 && g2.n_head_kv == 1 && g2.head_dim == 256 &&
         g2.n_ff == 16384 && g2.n_vocab == 256000 && g2.tied && g2.sliding_window == 0));
  const ShapePreset& g7 = find_preset("gemma-7b");
  CHECK((g7.n_layer == 28 && g7.n_embd == 3072 && g7.n_head == 16 && g7.n_head_kv == 16 && g7.head_dim == 256 &&
         g7.n_ff == 24576 && g7.n_vocab == 256000 && g7.tied));
  CHECK(attention_scale("gemma", 28, 3072, 16, 256) == 1.f / 16);
}

TEST_CASE("config: glm4 (pre- and post-norms, q/k/v biases, fused gate/up, half of each head in adjacent pairs); its preset") {
  // As `baton synth --arch glm4` writes one (GLM-4's converter: rope.dimension_count half the head).
  ShapePreset p{"t", "glm4", "test", 2, 64, 2, 1, 64, 128, 300, 128, false, 0, 0, 1e4f, 1e-5f, true, 0, 32};
  auto config = [](gguf::Writer& w) {
    const auto bytes = w.to_bytes();
    return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  gguf::Writer w = synth_writer(p, {});
  ModelConfig c = config(w);
  CHECK((c.rope_style == RopeStyle::Adjacent && c.act == Activation::SiLU && c.embd_scale == 1.f));
  CHECK((c.pre_norms && c.post_norms && !c.qk_norm && c.attn_bias && !c.attn_out_bias && c.fused_gate_up));
  CHECK((!c.fused_qkv && !c.tied_output && !c.norm_add_one));
  CHECK((c.has(LayerTensor::AttnNorm) && c.has(LayerTensor::FfnNorm) && c.has(LayerTensor::PostAttnNorm) &&
         c.has(LayerTensor::PostFfnNorm) && c.has(LayerTensor::Bq) && c.has(LayerTensor::Bv) &&
         !c.has(LayerTensor::Gate) && c.has(LayerTensor::Up) && !c.has(LayerTensor::Bo)));
  CHECK((c.head_dim_k == 64 && c.rope_dim == 32 && c.rope_dims(0) == 32 && c.freqs(0).size() == 16));
  CHECK(c.freqs(0).back() == Approx(std::pow(1e4, -30.0 / 32)));
  CHECK(c.attn_scale == Approx(1 / 8.0));
  CHECK(c.layer_window == std::vector<int>{0, 0});
  p.qkv_bias = false;  // (GLM-4's attention_bias is true: synth refuses a glm4 without the biases)
  CHECK_THROWS_WITH(synth_writer(p, {}), Catch::Contains("biases"));
  w.set("glm4.rope.dimension_sections", gguf::Value::of_array(gguf::ValueType::INT32,
        {gguf::Value::of_i32(8), gguf::Value::of_i32(4), gguf::Value::of_i32(4), gguf::Value::of_i32(0)}));
  CHECK_THROWS_WITH(config(w), Catch::Contains("sectioned"));  // GLM-4.1V's M-RoPE
  w = synth_writer((p.qkv_bias = true, p), {});
  w.set("glm4.nextn_predict_layers", gguf::Value::of_u32(1));  // GLM-OCR's MTP layer
  CHECK_THROWS_WITH(config(w), Catch::Contains("nextn_predict_layers"));
  const ShapePreset& g = find_preset("glm4-9b");  // zai-org/GLM-4-9B-0414's config.json
  CHECK((g.n_layer == 40 && g.n_embd == 4096 && g.n_head == 32 && g.n_head_kv == 2 && g.head_dim == 128 &&
         g.n_ff == 13696 && g.n_vocab == 151552 && !g.tied && g.qkv_bias && g.rope_dim == 64 && g.rope_base == 1e4f &&
         g.rms_eps == 1e-5f && g.sliding_window == 0));
}

TEST_CASE("config: llama3 rope scaling keeps short wavelengths and slows long ones") {
  RopeScaling s;
  s.type = "llama3";
  s.factor = 8;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_ctx = 8192;
  const auto plain = rope_frequencies(128, 500000.f, RopeScaling{});
  const auto scaled = rope_frequencies(128, 500000.f, s);
  CHECK(scaled[0] == plain[0]);                             // wavelength 2π: untouched
  CHECK(scaled[63] == Approx(plain[63] / 8).epsilon(1e-6));  // longest wavelength: divided by factor
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(scaled[i] <= plain[i]);
    CHECK(scaled[i] >= plain[i] / 8 * (1 - 1e-6));
  }
}

TEST_CASE("config: yarn keeps the fast pairs, interpolates the slow ones, a ramp between; its magnitude") {
  // gpt-oss's numbers: 64 rotated dims, base 150000, 32× from 4096. The pair that turns r times over
  // 4096 tokens is 64·ln(4096 / (2π·r)) / (2·ln 150000): 8.09 for r = 32, 17.40 for r = 1.
  RopeScaling s;
  s.type = "yarn";
  s.factor = 32;
  s.original_ctx = 4096;
  const auto plain = rope_frequencies(64, 150000.f, RopeScaling{});
  const auto rounded = rope_frequencies(64, 150000.f, s);  // ramp from pair 8 to pair 18
  s.yarn_truncate = false;
  const auto exact = rope_frequencies(64, 150000.f, s);  // from 8.09 to 17.40
  const double pi = 3.14159265358979323846, lo = 64 * std::log(4096 / (2 * pi * 32)) / (2 * std::log(150000.0)),
               hi = 64 * std::log(4096 / (2 * pi)) / (2 * std::log(150000.0));
  REQUIRE(lo == Approx(8.09).margin(0.01));
  REQUIRE(hi == Approx(17.40).margin(0.01));
  for (int i = 0; i < 32; ++i) {
    const double t = plain[size_t(i)];
    const double keep_rounded = 1 - std::clamp((i - 8.0) / 10.0, 0.0, 1.0);
    const double keep_exact = 1 - std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
    CHECK(rounded[size_t(i)] == Approx(t * keep_rounded + t / 32 * (1 - keep_rounded)).epsilon(1e-6));
    CHECK(exact[size_t(i)] == Approx(t * keep_exact + t / 32 * (1 - keep_exact)).epsilon(1e-6));
  }
  CHECK(exact[0] == plain[0]);
  CHECK(exact[31] == Approx(plain[31] / 32).epsilon(1e-6));
  CHECK(exact[12] != Approx(rounded[12]).epsilon(1e-3));  // the rounding moves the ramp
  CHECK(yarn_mscale(32, 0) == Approx(1 + 0.1 * std::log(32.0)));
  CHECK(yarn_mscale(1, 0) == 1.f);
}
