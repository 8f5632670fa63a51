// ModelShape: everything the planner needs to know about a model, without any tensor data.
// Built from a GGUF file's metadata and tensor infos, or from a named preset (published configs)
// plus a quant type, so `baton plan --shape llama3-70b --type Q4_K` works with no file at all.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "quant/types.h"

namespace baton {
namespace gguf { class File; }

// One repeating block (blk.N.*).
struct LayerShape {
  uint32_t n_head_kv = 0;
  uint32_t sliding_window = 0;  // 0: global attention over the whole context; W: the last W tokens
  uint64_t weight_bytes = 0;    // sum of nbytes of every blk.N.* tensor
  uint64_t weight_elems = 0;    // their elements: the multiply-adds one token costs in the layer
                                // (of the experts, the share one token uses: k / n_expert)
  uint64_t expert_bytes = 0;    // of weight_bytes, the stacked experts' (blk.N.*_exps.*)

  bool operator==(const LayerShape&) const = default;
};

struct ModelShape {
  std::string name;          // preset name, or general.name of a file
  std::string architecture;  // general.architecture: llama, qwen2, gemma3, ...
  uint32_t n_layer = 0;
  uint32_t n_embd = 0;
  uint32_t n_head = 0;
  uint32_t head_dim_k = 0;   // attention.key_length (default n_embd / n_head)
  uint32_t head_dim_v = 0;   // attention.value_length (default n_embd / n_head)
  uint32_t n_ff = 0;
  uint32_t n_vocab = 0;
  uint32_t n_ctx_train = 0;  // context_length
  // Mixture of experts (n_expert 0: dense): experts per layer, used per token, their FFN width and
  // the shared expert's (qwen2moe; 0: none).
  uint32_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
  std::vector<LayerShape> layers;  // n_layer entries

  uint64_t embedding_bytes = 0;    // token_embd.weight
  bool tied_output = false;        // no output.weight: the head multiplies by token_embd
  uint64_t output_bytes = 0;       // output.weight, or token_embd's bytes when tied
  uint64_t output_elems = 0;       // its elements (multiply-adds per token with logits)
  uint64_t output_norm_bytes = 0;  // output_norm.weight (and its bias, if any)
  // Tensors outside blk.N.*, token_embd, output and output_norm (e.g. rope_freqs.weight): every
  // stage needs its own copy, so the planner charges them to each stage.
  uint64_t shared_bytes = 0;
  // LoRA adapters (runtime/lora.h, added by LoraAdapters::add_to): a GPU stage's buffer of their
  // products (0: no adapters).
  uint64_t lora_gpu_buffer = 0;

  uint32_t max_head_kv() const;
  uint64_t layer_weight_bytes() const;  // sum over layers
  uint64_t expert_bytes() const;        // of that, the stacked experts'
  bool layer_elems_known() const;       // every layer has weight_elems (shapes built by hand may not)
  // Every byte of weights counted once (what the file holds; a tied head is not counted twice).
  uint64_t total_weight_bytes() const;

  bool operator==(const ModelShape&) const = default;
};

// The bytes a weight tensor (ne0 elements per row, `rows` rows, nbytes in the file) takes on any
// device: the larger of a CPU stage's packed matrix and a GPU stage's padded rows. Every byte
// count of a shape is made of these.
uint64_t weight_used_bytes(GgmlType type, int64_t ne0, int64_t rows, uint64_t nbytes);

// From metadata and tensor infos only; never touches tensor data. Throws Error(Model) naming the
// missing key or the inconsistency.
ModelShape shape_from_gguf(const gguf::File& f);

// ---- presets: published configurations of real models --------------------------------------

struct ShapePreset {
  const char* name;          // what users type: --shape llama3-8b
  const char* architecture;  // llama, qwen2, qwen3, gemma3, phi3, granite, ...
  const char* what;          // one line for --help
  uint32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train;
  bool tied;                 // no output.weight
  uint32_t sliding_window;   // 0: none
  uint32_t swa_period;       // every swa_period-th layer is global (gemma3: 6); 0: all sliding
  float rope_base;
  float rms_eps;
  bool qkv_bias;             // qwen2: attn_{q,k,v}.bias
  uint32_t rope_long_ctx = 0;  // phi3: LongRoPE factors for contexts beyond this one (0: none)
  uint32_t rope_dim = 0;       // rotated dims per head (0: head_dim; Phi-4-mini rotates 3/4)
  uint32_t n_expert = 0;       // mixture of experts: experts per layer (0: a dense FFN),
  uint32_t n_expert_used = 0;  // used per token,
  uint32_t n_ff_exp = 0;       // their FFN width,
  uint32_t n_ff_shexp = 0;     // and the shared expert's (qwen2moe; 0: none)
  // granite, granitemoe: the multipliers the file states (0: synth writes Granite 3's own:
  // embedding 12, residual 0.22, attention 1/head_dim, logits 8)
  float embedding_scale = 0.f, residual_scale = 0.f, attention_scale = 0.f, logit_scale = 0.f;
  bool out_bias = false;  // attn_output.bias (ernie4_5's use_bias, with qkv_bias; optional in its files)
};
const std::vector<ShapePreset>& shape_presets();
const ShapePreset& find_preset(std::string_view name);  // Error(Usage) listing the known names

// The tensors of a model of this architecture: names, types and dims (ggml order, ne[0] first),
// in file order. 2-D weight matrices get `type` (or the nearest type whose block fits the row,
// see weight_type_for_row), norms and biases F32. Shared by the preset shapes and `baton synth`,
// so a synthetic file and its preset shape describe the same bytes.
struct TensorSpec {
  std::string name;
  GgmlType type;
  std::vector<int64_t> dims;
  uint64_t nbytes() const;
};
std::vector<TensorSpec> preset_tensors(const ShapePreset& p, GgmlType type);

// K-quants need rows that are a multiple of 256 elements, the other quants 32. When a row does not
// fit, use llama-quantize's substitute (Q2_K, Q3_K, IQ4_XS -> IQ4_NL, Q4_K -> Q5_0, Q5_K -> Q5_1,
// Q6_K -> Q8_0) and F16 as the last resort (also for a 32-element type whose blocks do not fit).
GgmlType weight_type_for_row(GgmlType wanted, int64_t row);

// The shape of a preset in a given weight type (exact bytes from preset_tensors).
ModelShape shape_from_preset(const ShapePreset& p, GgmlType type);

// Architectures whose files carry a sliding window but not its layer pattern: every period-th
// layer is global (gemma3 6, gemma2 2). An unknown architecture with a window and no pattern is
// treated as all-global (1): that over-counts its KV cache, which is the safe side.
uint32_t default_swa_period(const std::string& arch);

// Which layers of a sliding-window model are global. gemma3: every 6th layer (5 local, 1 global).
bool layer_is_global(uint32_t il, uint32_t swa_period);

}  // namespace baton
