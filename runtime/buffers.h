// Sizes of the runtime's own buffers: KV cache and per-stage scratch. The planner and the runtime
// both call these functions (the planner to budget, the runtime to allocate), so the estimate
// cannot drift from the allocation. Changing a buffer in the forward means changing it here.
#pragma once
#include <algorithm>
#include <cstdint>

#include "quant/types.h"
#include "runtime/shape.h"

namespace baton {

// Every buffer is padded to this boundary (the CPU forward's Scratch uses the same).
inline constexpr uint64_t kBufferAlign = 64;
inline uint64_t align_buffer(uint64_t n) { return (n + kBufferAlign - 1) / kBufferAlign * kBufferAlign; }

// The CPU attention's buffers are per worker thread (cpu::attention_thread_bytes); a plan that is
// not told how many threads a stage has assumes at most this many.
inline constexpr uint32_t kPlanThreadsPerStage = 64;

// ---- KV cache ---------------------------------------------------------------------------------
// KV element types: F16 (2 bytes) or Q8_0 (34 bytes per 32 elements).
bool is_kv_type(GgmlType t);

// How far a sequence with sliding-window layers can be rewound (drafts the model did not confirm,
// a chat turn re-rendering the previous reply's end): its rings keep kRingRewind - 1 cells beyond
// the window.
inline constexpr uint32_t kRingRewind = 16;
// Cells one sequence keeps for a layer with this window (0: a global layer) — the planner's and
// the KV cache's count (kv_cells, KvCache::cells).
inline uint32_t kv_cells_per_seq(uint32_t window, uint32_t n_ctx) {
  return window > 0 && window + kRingRewind - 1 < n_ctx ? window + kRingRewind - 1 : n_ctx;
}
// Cells (token slots) layer `il` keeps for n_parallel sequences of n_ctx tokens each. A global
// layer keeps n_ctx per sequence. A sliding-window layer keeps a ring of min(W + kRingRewind - 1,
// n_ctx) per sequence: the forward attends over the ring *plus the current batch's own k/v (held
// in scratch)*, and only then writes the batch into the ring, so W cells would be enough for any
// batch; the kRingRewind - 1 more keep the positions a rewind may return to.
uint64_t kv_cells(const ModelShape& s, uint32_t il, uint32_t n_ctx, uint32_t n_parallel);
// Bytes of layer il's K and V: cells × n_head_kv × (head_dim_k + head_dim_v) elements of kv_type,
// each cell's K row and V row rounded to whole blocks.
uint64_t kv_layer_bytes(const ModelShape& s, uint32_t il, uint32_t n_ctx, uint32_t n_parallel, GgmlType kv_type);

// ---- scratch ----------------------------------------------------------------------------------
// One stage's activation buffers for a step of up to n_batch tokens (float32 unless noted), as the
// CPU forward allocates them: xb..v_new are models/llama.h Scratch (tests check Scratch::bytes
// equals their sum), x is the stage's hidden-state buffer, att and xq are the kernels' per-thread
// buffers, logits the output rows of the last stage. Each field is one buffer's padded byte size.
struct ScratchLayout {
  uint64_t x = 0;       // hidden states, n_batch × n_embd (also what a link delivers)
  uint64_t xb = 0;      // normed input / projected output, n_batch × n_embd
  uint64_t xb2 = 0;     // attention output, n_batch × n_head × head_dim_v
  uint64_t q = 0;       // n_batch × n_head × head_dim_k
  uint64_t k = 0;       // n_batch × n_head_kv × head_dim_k (largest n_head_kv of any layer)
  uint64_t v = 0;       // n_batch × n_head_kv × head_dim_v
  uint64_t hb = 0;      // FFN gate, n_batch × n_ff
  uint64_t hb2 = 0;     // FFN up, n_batch × n_ff
  uint64_t k_new = 0;   // the batch's keys in the KV type (staging rows), n_batch rows
  uint64_t v_new = 0;   // the batch's values in the KV type, n_batch rows
  uint64_t att = 0;     // the CPU attention's per-thread buffers: n_threads × cpu::attention_thread_bytes
                        // (n_head / n_head_kv, head dims; not the context); CPU stages only
  uint64_t xq = 0;      // activations quantized for the integer dot products: n_batch rows of the
                        // widest matmul input (n_embd, n_head × head_dim_v or n_ff) at 40 bytes per 32
  uint64_t logits = 0;  // last stage only: n_outputs × n_vocab
  uint64_t moe = 0;     // mixture of experts: router logits, gathered rows, expert outputs, their sum
                        // (models/llama.h Scratch router, xe, ye, acc); hb and hb2 then hold
                        // max(n_batch, k) experts' rows or n_batch shared-expert rows

  // The buffers of models/llama.h Scratch (xb .. v_new, and the experts').
  uint64_t forward_scratch() const { return xb + xb2 + q + k + v + hb + hb2 + k_new + v_new + moe; }
  uint64_t total() const { return x + forward_scratch() + att + xq + logits; }
};

// Output rows a step holds for n_outputs asked (0: every token of a step) and steps of n_batch
// tokens: the one rule the planner, the scratch functions and the stages apply.
inline uint32_t output_rows(uint32_t n_outputs, uint32_t n_batch) {
  return n_outputs == 0 ? n_batch : std::min(n_outputs, n_batch);
}

// n_batch: tokens per forward step; on_last_stage: the stage that holds the output head (and so
// the logits); kv_type: the KV cache type (the staging rows use it); n_outputs: logit rows per
// step, 0 meaning n_batch (every token); n_threads: worker threads of a CPU stage (0:
// kPlanThreadsPerStage). Nothing here grows with the context.
ScratchLayout scratch_layout(const ModelShape& s, uint32_t n_batch, bool on_last_stage,
                             GgmlType kv_type = GgmlType::F16, uint32_t n_outputs = 0, uint32_t n_threads = 0);
inline uint64_t scratch_bytes(const ModelShape& s, uint32_t n_batch, bool on_last_stage,
                              GgmlType kv_type = GgmlType::F16, uint32_t n_outputs = 0, uint32_t n_threads = 0) {
  return scratch_layout(s, n_batch, on_last_stage, kv_type, n_outputs, n_threads).total();
}

// A CUDA stage's shared op scratch (kernels/cuda/ops.h: the GEMM's FP16 activations and weight
// slab, the GEMV's 8-bit activations, the attention's split partials: one buffer, so the largest),
// bounded for any step of up to n_batch tokens on a GPU of up to kPlanMaxSms multiprocessors and
// rounded up to whole MiB as the stage's Context reserves it. The planner charges it to every GPU
// stage and the GPU stage reserves this much at load. n_outputs: logit rows per step (0: n_batch),
// what the device sampling's candidates are kept for.
constexpr uint64_t kPlanMaxSms = 256;
uint64_t gpu_ops_scratch_bytes(const ModelShape& s, uint32_t n_batch, bool on_last_stage, uint32_t n_outputs = 0);

// What a CUDA stage holding the output head keeps besides the logits, for sampling on the device
// (runtime/batch.h): an argmax id per output row, and the top_k_candidates(n_vocab) best ids and
// logits, for each of n_outputs rows. The planner charges it to a GPU stage with the head, next to
// gpu_ops_scratch_bytes.
uint64_t gpu_sampling_bytes(const ModelShape& s, uint32_t n_outputs);

// The slots a peer-to-peer link (runtime/link.h) keeps on the receiving GPU: kGpuLinkSlots pieces of
// n_batch hidden states. The planner charges them to every GPU stage that does not start at layer 0
// (its input may come from a GPU stage); a host-staged link pins host memory instead.
constexpr int kGpuLinkSlots = 4;
uint64_t gpu_link_bytes(const ModelShape& s, uint32_t n_batch);

}  // namespace baton
