// A typed model description read from GGUF metadata. Architectures differ by the flags below and
// by which tensors they carry (the tensor-name table), never by a second copy of the forward.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace baton {
namespace gguf { class File; }

enum class RopeStyle {
  Adjacent,  // rotate (x[2i], x[2i+1]): `llama` GGUF files (the converter permuted Q/K for this)
  NeoX,      // rotate (x[i], x[i + d/2]): gemma, qwen2, ...
};
// The FFN gate: down(act(gate·x) * up·x). SwiGluOai is gpt-oss's clamped SwiGLU:
// min(g, 7)·sigmoid(1.702·min(g, 7))·(clamp(u, −7, 7) + 1).
enum class Activation { SiLU, GeluTanh, SwiGluOai };

// Per-layer tensors of a transformer block. The GGUF names are shared by all families
// ("blk.N.<name>.weight"); a family decides which are required.
enum class LayerTensor : int {
  AttnNorm, Wq, Wk, Wv, Wo, Bq, Bk, Bv, QNorm, KNorm, PostAttnNorm,
  FfnNorm, Gate, Up, Down, PostFfnNorm,
  Wqkv,  // q, k and v rows in one matrix (phi3 files; any family may store them so)
  // Mixture of experts (instead of Gate, Up, Down): the router [n_embd, n_expert] and the experts'
  // matrices stacked in one 3-D tensor each ([n_embd, n_ff_exp, n_expert], down [n_ff_exp, n_embd,
  // n_expert]); qwen2moe adds one always-on shared expert scaled by sigmoid(gate_inp_shexp · x).
  GateInp, GateExps, UpExps, DownExps, GateInpShexp, GateShexp, UpShexp, DownShexp,
  GateUpExps,  // each expert's gate rows then its up rows in one stacked tensor (newer conversions)
  // gpt-oss: the output projection's bias, per-head attention sink logits [n_head], the router's
  // bias [n_expert] and the experts' biases, stacked ([n_ff_exp, n_expert], down [n_embd, n_expert]).
  Bo, Sinks, BGateInp, BGateExps, BUpExps, BDownExps,
  Count,
};
const char* layer_tensor_name(LayerTensor t);            // "attn_q" (weight and bias share it)
std::string layer_tensor_key(int layer, LayerTensor t);  // "blk.3.attn_q.weight", "blk.3.attn_q.bias"
int64_t block_index(std::string_view tensor_name);       // "blk.17.attn_q.weight" -> 17; -1 otherwise
// Error(Model) when f is a LoRA adapter (general.type "adapter"), not a model: it names --lora.
void refuse_adapter_as_model(const gguf::File& f);

struct ModelConfig {
  std::string arch;          // general.architecture
  std::string name;          // general.name (may be empty)
  int n_layer = 0;
  int n_embd = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim_k = 0;        // attention.key_length, default n_embd / n_head
  int head_dim_v = 0;        // attention.value_length, default head_dim_k
  int n_ff = 0;
  int n_vocab = 0;
  int n_ctx_train = 0;
  float rms_eps = 1e-5f;

  // RoPE. Frequencies are precomputed per rotated pair (rope_dim / 2 of them), scaling included.
  RopeStyle rope_style = RopeStyle::Adjacent;
  int rope_dim = 0;                 // rotated dims per head (<= head_dim_k)
  float rope_base = 10000.f;        // global layers
  float rope_base_local = 10000.f;  // sliding-window layers (gemma3)
  std::string rope_scaling = "none";  // none | linear | llama3 | yarn
  float rope_scale_factor = 1.f;
  std::vector<float> rope_freqs;        // theta_i per pair for global layers
  std::vector<float> rope_freqs_local;  // theta_i per pair for sliding-window layers
  // Phi-3's long-context RoPE: per-pair divisors for contexts beyond rope_long_ctx (the training
  // context before the extension); rope_freqs holds the short ones until use_context picks.
  std::vector<float> rope_freqs_long;
  int rope_long_ctx = 0;
  float rope_attn_factor = 1.f;     // rope.scaling.attn_factor (times YaRN's 1 + 0.1·ln(factor)):
                                    // rotated q and k are multiplied by it
  float rope_attn_factor_local = 1.f;  // the same for sliding-window layers (1 where they rotate
                                       // plainly: olmo2's OLMo 3 files; else rope_attn_factor)

  // Family flags.
  Activation act = Activation::SiLU;
  float embd_scale = 1.f;        // token embeddings are multiplied by this (gemma: sqrt(n_embd); granite:
                                 // embedding_scale)
  bool norm_add_one = false;     // RMSNorm weight is (1 + w) and the file did not fold the 1 in
  bool post_norms = false;       // RMSNorm on the attention and FFN outputs before the residual add
  bool qk_norm = false;          // per-head RMSNorm on q and k before RoPE
  bool qk_norm_full = false;     // with qk_norm: one RMSNorm over the whole q row (n_head·head_dim) and
                                 // one over the whole k row, not one per head (olmo2, olmoe)
  bool pre_norms = true;         // RMSNorm before attention and FFN (attn_norm, ffn_norm); olmo2 has none:
                                 // its blocks read the residual stream and norm their outputs (post_norms)
  bool attn_bias = false;        // q/k/v projections have biases (qwen2)
  float attn_scale = 0.f;        // multiplies q·k; default 1/sqrt(head_dim_k) (granite: attention.scale)
  // Granite's muP multipliers (1 for every other family): each branch's output (the attention's
  // output projection, the FFN's down projection or experts' sum) is multiplied by residual_scale
  // before it joins the residual stream, and the logits are divided by logit_scale.
  float residual_scale = 1.f;
  float logit_scale = 1.f;
  float final_softcap = 0.f;     // logits = c * tanh(logits / c) when > 0
  float attn_softcap = 0.f;      // attention scores (scaled q·k) = c * tanh(s / c) when > 0 (gemma2)
  bool tied_output = false;      // no output.weight: the head reuses token_embd
  bool fused_qkv = false;        // attn_qkv holds the q, k and v rows, in that order
  bool fused_gate_up = false;    // ffn_up holds the gate rows, then the up rows (phi3)
  // gpt-oss: the output projection has a bias; every head's softmax has a learned sink logit
  // (attn_sinks: takes probability mass, adds no value); the router and the experts have biases;
  // the FFN's pre-norm is stored as post_attention_norm.
  bool attn_out_bias = false;
  bool attn_sinks = false;
  bool moe_bias = false;
  bool ffn_norm_as_post_attention = false;
  // Mixture of experts: each token's FFN is the weighted sum of the n_expert_used experts the router
  // ranks highest (softmax over n_expert logits, top k, weights renormalized to sum 1 when
  // expert_weights_norm), plus the shared expert when n_ff_shexp > 0.
  int n_expert = 0;              // 0: a dense FFN
  int n_expert_used = 0;
  int n_ff_exp = 0;              // expert_feed_forward_length (default n_ff)
  int n_ff_shexp = 0;            // expert_shared_feed_forward_length (qwen2moe)
  bool expert_weights_norm = false;
  bool fused_gate_up_exps = false;  // ffn_gate_up_exps [n_embd, 2·n_ff_exp, n_expert] instead of two
  bool is_moe() const { return n_expert > 0; }
  int sliding_window = 0;        // tokens a local layer sees (itself included); 0: none
  std::vector<int> layer_window; // per layer: 0 = full attention, else the window
  // Per layer: true = no rotary embedding (NoPE): q and k reach the attention and the KV cache as
  // projected (smollm3: every 4th layer). Layers past its end rotate.
  std::vector<bool> layer_nope;

  bool is_local(int layer) const { return layer_window[layer] > 0; }
  bool is_nope(int layer) const { return size_t(layer) < layer_nope.size() && layer_nope[size_t(layer)]; }
  // The dims of each q/k head that layer rotates: rope_dim, or 0 on a NoPE layer.
  int rope_dims(int layer) const { return is_nope(layer) ? 0 : rope_dim; }
  const std::vector<float>& freqs(int layer) const { return is_local(layer) ? rope_freqs_local : rope_freqs; }
  float attn_factor(int layer) const { return is_local(layer) ? rope_attn_factor_local : rope_attn_factor; }
  // The width one q (k) norm covers: a head, or the whole row (qk_norm_full).
  int q_norm_width() const { return qk_norm_full ? n_embd_q() : head_dim_k; }
  int k_norm_width() const { return qk_norm_full ? n_embd_k() : head_dim_k; }
  int n_embd_q() const { return n_head * head_dim_k; }
  int n_embd_k() const { return n_head_kv * head_dim_k; }
  int n_embd_v() const { return n_head_kv * head_dim_v; }
  int n_embd_attn() const { return n_head * head_dim_v; }  // attention output width (wo input)
  // The tensor that holds the FFN's pre-norm weight (ffn_norm; gpt-oss: post_attention_norm).
  LayerTensor ffn_norm_tensor() const { return ffn_norm_as_post_attention ? LayerTensor::PostAttnNorm : LayerTensor::FfnNorm; }
  bool has(LayerTensor t) const;  // does this family carry the tensor in every layer?

  // Reads everything; every missing or inconsistent key is collected and reported in one Error.
  // Tensor shapes are checked against the dimensions as well.
  static ModelConfig from_gguf(const gguf::File& f);
  // Settles what depends on the context per sequence: Phi-3's long RoPE factors apply past
  // rope_long_ctx (as llama.cpp decides). Call once, before the weights are bound.
  void use_context(int n_ctx);
  std::string summary() const;  // one line for logs
};

// Per-pair RoPE frequencies theta_i = base^(-2i/dim), with optional scaling applied.
// llama3 scaling needs factor, low/high frequency factors and the original context length.
// yarn blends, per pair, the interpolated frequency (θ / factor) with the original one: pairs that
// turn fewer than beta_slow times over the original context are interpolated, those that turn more
// than beta_fast times kept, a linear ramp between; ext_factor scales the ramp. The ramp's ends
// are rounded down and up to whole pairs (yarn_truncate: Hugging Face's default, and what
// llama.cpp always does) except where the model says not to (gpt-oss: its reference code and
// config, "truncate": false). Its magnitude correction (yarn_mscale) multiplies the rotated dims.
struct RopeScaling {
  std::string type = "none";   // none | linear | llama3 | yarn
  float factor = 1.f;
  float low_freq_factor = 1.f;
  float high_freq_factor = 4.f;
  int original_ctx = 8192;
  float beta_fast = 32.f, beta_slow = 1.f, ext_factor = 1.f;  // yarn
  bool yarn_truncate = true;
};
std::vector<float> rope_frequencies(int dim, float base, const RopeScaling& s);
// YaRN's attention magnitude: 1 + 0.1·ln(factor) (1 for factor <= 1); with DeepSeek's
// yarn_log_multiplier m != 0, that divided by 1 + 0.1·m·ln(factor).
float yarn_mscale(float factor, float log_multiplier);

// What q·k is multiplied by: 1/sqrt(query_pre_attn_scalar). Training configs set that scalar to
// the head dimension, except Gemma 3 27B, which uses n_embd / n_head (5376 / 32 = 168, its head
// dimension being 128). GGUF files do not store the scalar, and no shape rule tells the 27B apart
// (n_embd / n_head is not the head dimension at any Gemma 3 size: 160, 288, 320, 240 against
// 256), so the 27B is recognised the way llama.cpp does, by its 62 layers. Gemma 2 27B likewise
// (46 layers, 4608 / 32 = 144 against a head dimension of 128).
float attention_scale(const std::string& arch, int n_layer, int n_embd, int n_head, int head_dim_k);

}  // namespace baton
