// Sizes of the runtime's own buffers: KV cache and per-stage scratch. The planner and the runtime
// both call these functions (the planner to budget, the runtime to allocate), so the estimate
// cannot drift from the allocation. Changing a buffer in the forward means changing it here.
#pragma once
#include <cstdint>

#include "quant/types.h"
#include "runtime/shape.h"

namespace baton {

// Every scratch buffer starts on this boundary (and is padded to it), on every device.
inline constexpr uint64_t kBufferAlign = 256;
inline uint64_t align_buffer(uint64_t n) { return (n + kBufferAlign - 1) / kBufferAlign * kBufferAlign; }

// ---- KV cache ---------------------------------------------------------------------------------
// KV element types: F16 (2 bytes) or Q8_0 (34 bytes per 32 elements).
bool is_kv_type(GgmlType t);

// Cells (token slots) layer `il` keeps for n_parallel sequences of n_ctx tokens each. A global
// layer keeps n_ctx per sequence. A sliding-window layer keeps a ring of min(W, n_ctx) per
// sequence: the forward attends over the ring *plus the current batch's own k/v (held in
// scratch)*, and only then writes the batch into the ring, so W cells are enough for any batch.
uint64_t kv_cells(const ModelShape& s, uint32_t il, uint32_t n_ctx, uint32_t n_parallel);
// Bytes of layer il's K and V: cells × n_head_kv × (head_dim_k + head_dim_v) elements of kv_type,
// each cell's K row and V row rounded to whole blocks.
uint64_t kv_layer_bytes(const ModelShape& s, uint32_t il, uint32_t n_ctx, uint32_t n_parallel, GgmlType kv_type);

// ---- scratch ----------------------------------------------------------------------------------
// One stage's activation buffers for a step of up to n_batch tokens (all float32 unless noted).
// Each field is the byte size of one buffer, already padded to kBufferAlign.
struct ScratchLayout {
  uint64_t x = 0;       // residual stream, n_batch × n_embd (also the link's receive buffer)
  uint64_t xb = 0;      // normed input of attention / FFN, n_batch × n_embd
  uint64_t xb2 = 0;     // attention output before attn_output, n_batch × max(n_embd, n_head × head_dim_v)
  uint64_t q = 0;       // n_batch × n_head × head_dim_k
  uint64_t k = 0;       // n_batch × max n_head_kv × head_dim_k (the batch's new keys)
  uint64_t v = 0;       // n_batch × max n_head_kv × head_dim_v (the batch's new values)
  uint64_t att = 0;     // attention scores, n_head × n_batch × n_ctx (one row of n_ctx per head and token)
  uint64_t hb = 0;      // FFN gate, n_batch × n_ff
  uint64_t hb2 = 0;     // FFN up, n_batch × n_ff
  uint64_t xq = 0;      // activations quantized for integer dot products: n_batch rows of the widest
                        // input (max of n_embd, n_ff, n_head × head_dim_v), at Q8_K size (the largest 8-bit block)
  uint64_t logits = 0;  // last stage only: n_batch × n_vocab

  uint64_t total() const { return x + xb + xb2 + q + k + v + att + hb + hb2 + xq + logits; }
};

// n_batch: tokens per forward step; n_ctx: context per sequence (attention spans one sequence);
// on_last_stage: the stage that holds the output head (and so the logits).
ScratchLayout scratch_layout(const ModelShape& s, uint32_t n_batch, uint32_t n_ctx, bool on_last_stage);
inline uint64_t scratch_bytes(const ModelShape& s, uint32_t n_batch, uint32_t n_ctx, bool on_last_stage) {
  return scratch_layout(s, n_batch, n_ctx, on_last_stage).total();
}

}  // namespace baton
