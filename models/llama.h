// The llama-family forward (Llama 2/3, Mistral, SmolLM, TinyLlama; Qwen2 and Gemma 3 through the
// ModelConfig flags). Three steps a pipeline composes: embed() on the first stage,
// forward_layers() over each stage's layer range [begin, end), head() on the last stage.
#pragma once
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed.h"
#include "kernels/cpu/threadpool.h"
#include "runtime/batch.h"
#include "models/llama_forward.h"
#include "runtime/config.h"
#include "runtime/control_vector.h"
#include "runtime/lora.h"

namespace baton {

namespace gguf { class File; }
class KvCache;

using LayerWeights = LayerT<cpu::QMatrix>;

// Views into the mapped file except norm weights that need the +1 folded in, and the packed
// (row-interleaved) copies of the matrices whose type this process packs (kernels/cpu/packed.h).
struct ModelWeights {
  cpu::QMatrix tok_embd;       // bound when with_embed
  cpu::QMatrix output;         // bound when with_head (token_embd when tied)
  const float* output_norm = nullptr;
  std::vector<LayerWeights> layers;  // n_layer entries; only [begin, end) are bound
  std::vector<std::vector<float>> owned;
  std::vector<cpu::PackedBuffer> packed;
  uint64_t packed_bytes = 0;
  // LoRA pairs (runtime/lora.h) of the bound matrices as the forward multiplies them, by the `data`
  // of the matrix they adapt (a fused q/k/v or gate/up tensor's B split by rows the same way), and
  // the embedding's. A and B are F16 copies with the rank padded to lora_padded_rank() with zeros;
  // a CPU stage's are packed into the float tiles where this CPU packs F16 (the embedding's A stays
  // as mapped), a GPU stage's row-major (the embedding's A padded too: lora_embd_gpu_type).
  struct LoraMul {
    cpu::QMatrix a, b;  // y += scale · B·(A·x); token_embd: A's row of the token through B
    float scale = 1.f;
  };
  std::unordered_multimap<const void*, LoraMul> lora;
  std::vector<LoraMul> lora_embd;
  std::vector<cpu::PackedBuffer> lora_mem;
  uint64_t lora_bytes = 0;  // lora_cpu_bytes() of each bound pair
};
// Binds the tensors of layers [begin, end) (and the embedding / head when asked) of a file whose
// config was read by ModelConfig::from_gguf (which already checked names, shapes and types). With
// a pool, the layer matrices and the head are packed (using its threads) where this process packs
// their type; a tied embedding then reads its rows from the packed head. With adapters, the pairs
// of the bound tensors are attached (ModelWeights::lora): packed as the CPU multiplies them with a
// pool, row-major F16 (a GPU stage's binding) without.
// With control vectors, each steered layer's `control` is their sum over the residual scale (in
// ModelWeights::owned).
ModelWeights bind_weights(const gguf::File& f, const ModelConfig& c, int begin, int end,
                          bool with_embed, bool with_head, cpu::ThreadPool* pack_pool = nullptr,
                          const LoraAdapters* adapters = nullptr, const ControlVectors* control = nullptr);

// Packed copies of the matrices this process packs (the others are left as they are), in one
// buffer that w owns; each matrix's `packed` points into it, valid while w lives. With a file, the
// mapped pages of each matrix are given back once it is packed (gguf::File::release): only the
// packed copy stays resident.
void pack_matrices(ModelWeights& w, std::vector<cpu::QMatrix*> mats, cpu::ThreadPool& pool,
                   const gguf::File* file = nullptr);

// Activation buffers for up to n_batch tokens, allocated once. bytes() is the sizing function the
// constructor uses, so an estimate made with it equals the allocation.
class Scratch {
 public:
  Scratch(const ModelConfig& c, int n_batch, GgmlType kv_type);
  static size_t bytes(const ModelConfig& c, int n_batch, GgmlType kv_type);
  int n_batch() const { return n_batch_; }

  float* xb = nullptr;     // normed input / projected output, n_batch × n_embd
  float* xb2 = nullptr;    // attention output, n_batch × n_head × head_dim_v
  float* q = nullptr;      // n_batch × n_head × head_dim_k
  float* k = nullptr;      // n_batch × n_head_kv × head_dim_k
  float* v = nullptr;      // n_batch × n_head_kv × head_dim_v
  float* hb = nullptr;     // FFN gate, ffn_rows() floats
  float* hb2 = nullptr;    // FFN up, ffn_rows() floats
  uint8_t* k_new = nullptr;  // the batch's keys in the KV type (staging rows, see cpu::attention)
  uint8_t* v_new = nullptr;
  // Mixture of experts only (null otherwise): router logits (n_batch × n_expert), an expert's
  // gathered input rows (n_batch × n_embd), expert outputs (moe_expert_rows × n_embd) and their
  // weighted sum (n_batch × n_embd); per token its k experts and weights, and the same grouped by
  // expert (cpu::moe_group: expert e's tokens and weights from expert_first[e]).
  float* router = nullptr;
  float* xe = nullptr;
  float* ye = nullptr;
  float* acc = nullptr;
  std::vector<int32_t> route_ids, expert_first, expert_rows;
  std::vector<float> route_w, expert_w;
  // Floats of hb (and hb2): n_batch × n_ff, or for a mixture of experts the widest of
  // moe_expert_rows(n_batch, k) experts' rows and n_batch shared-expert rows.
  static size_t ffn_rows(const ModelConfig& c, int n_batch);
  std::vector<int32_t> first, row0, row;  // per token: its sequence's first position / staging rows

 private:
  struct Layout;
  static Layout layout(const ModelConfig& c, int n_batch, GgmlType kv_type);
  int n_batch_;
  std::vector<uint8_t> mem_;
};

// Staging rows of a batch for attention (cpu::AttentionArgs): each sequence's new tokens get
// consecutive rows in position order; per token its sequence's first position in the batch, the
// sequence's first row and its own row. Within the batch, every sequence's tokens must have
// consecutive positions in batch order (an Error otherwise).
void stage_rows(const Batch& batch, int n_seq, int32_t* first, int32_t* row0, int32_t* row);
// Per sequence slot (n_seq of them), its last position in the batch (-1: none). A token whose cell
// in a ring of n_cells a later token of its sequence takes (pos + n_cells <= last) needs no commit.
void last_positions(const Batch& batch, int n_seq, std::vector<int32_t>& last);

// x[i] = embedding of batch.token[i] (scaled as the family says), plus the adapters' rows (pool
// runs them); x is batch.size() × n_embd.
void embed(const ModelConfig& c, const ModelWeights& w, const Batch& batch, float* x, cpu::ThreadPool& pool);

// Runs layers [begin, end) on the hidden states x (batch.size() × n_embd, updated in place),
// writing each token's K/V at its position into the cache. Within the batch, every sequence's
// tokens must have consecutive positions in batch order, continuing what its cache holds.
void forward_layers(const ModelConfig& c, const ModelWeights& w, KvCache& kv, const Batch& batch,
                    int begin, int end, float* x, Scratch& s, cpu::ThreadPool& pool);

// A mixture of experts' routed experts for n rows of x (normed; x may be s.xb), each token's k
// experts and weights in s.route_ids / s.route_w (cpu::moe_route): their weighted sum into s.acc.
// One token runs its experts' gate and up matrices as one pool job and their down matrices as
// another; more run each chosen expert once over its gathered rows. Uses s.hb, hb2, xe, ye.
void moe_experts(const ModelConfig& c, const LayerWeights& L, const float* x, int n, Scratch& s, cpu::ThreadPool& pool);

// Final norm and output matmul for the tokens with batch.logits[i] set, in batch order:
// batch.n_logits() rows of n_vocab floats into `logits`. Overwrites scratch xb.
void head(const ModelConfig& c, const ModelWeights& w, const Batch& batch, const float* x,
          float* logits, Scratch& s, cpu::ThreadPool& pool);

}  // namespace baton
