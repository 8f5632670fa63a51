#include "runtime/buffers.h"

#include <algorithm>

#include "gguf/error.h"
#include "kernels/cpu/ops.h"
#include "runtime/batch.h"

namespace baton {

bool is_kv_type(GgmlType t) { return t == GgmlType::F16 || t == GgmlType::Q8_0; }

uint64_t kv_cells(const ModelShape& s, uint32_t il, uint32_t n_ctx, uint32_t n_parallel) {
  BATON_CHECK(il < s.layers.size());
  return uint64_t(kv_cells_per_seq(s.layers[il].sliding_window, n_ctx)) * n_parallel;
}

namespace {
// Bytes of a row of n elements, rounding a partial block up to a whole one.
uint64_t row_bytes_ceil(GgmlType t, uint64_t n) {
  const TypeTraits& tt = traits(t);
  return (n + tt.block_elems - 1) / tt.block_elems * tt.block_bytes;
}
}  // namespace

uint64_t kv_layer_bytes(const ModelShape& s, uint32_t il, uint32_t n_ctx, uint32_t n_parallel, GgmlType kv_type) {
  BATON_CHECK(is_kv_type(kv_type));
  const uint64_t heads = s.layers.at(il).n_head_kv;
  const uint64_t per_cell = row_bytes_ceil(kv_type, heads * s.head_dim_k) + row_bytes_ceil(kv_type, heads * s.head_dim_v);
  return kv_cells(s, il, n_ctx, n_parallel) * per_cell;
}

ScratchLayout scratch_layout(const ModelShape& s, uint32_t n_batch, bool on_last_stage,
                             GgmlType kv_type, uint32_t n_outputs, uint32_t n_threads) {
  BATON_CHECK(is_kv_type(kv_type));
  const uint64_t B = n_batch, f = sizeof(float);
  uint32_t kvh = 0, kvh_min = 0;
  for (const auto& l : s.layers) {
    kvh = std::max(kvh, l.n_head_kv);
    if (l.n_head_kv > 0) kvh_min = kvh_min == 0 ? l.n_head_kv : std::min(kvh_min, l.n_head_kv);
  }
  const uint64_t q_width = uint64_t(s.n_head) * s.head_dim_k, attn_width = uint64_t(s.n_head) * s.head_dim_v;
  const uint64_t widest = std::max<uint64_t>({s.n_embd, attn_width, s.n_ff, s.n_ff_exp, s.n_ff_shexp});
  const uint64_t n_rep = kvh_min > 0 ? (s.n_head + kvh_min - 1) / kvh_min : s.n_head;
  ScratchLayout L;
  L.x = align_buffer(B * s.n_embd * f);
  L.xb = align_buffer(B * s.n_embd * f);
  L.xb2 = align_buffer(B * attn_width * f);
  L.q = align_buffer(B * q_width * f);
  L.k = align_buffer(B * kvh * s.head_dim_k * f);
  L.v = align_buffer(B * kvh * s.head_dim_v * f);
  const uint64_t ffn = s.n_expert == 0 ? B * s.n_ff
                                       : std::max(moe_expert_rows(B, s.n_expert_used) * s.n_ff_exp, B * s.n_ff_shexp);
  L.hb = align_buffer(ffn * f);
  L.hb2 = align_buffer(ffn * f);
  L.k_new = align_buffer(B * row_bytes_ceil(kv_type, uint64_t(kvh) * s.head_dim_k));
  L.v_new = align_buffer(B * row_bytes_ceil(kv_type, uint64_t(kvh) * s.head_dim_v));
  const uint64_t threads = n_threads > 0 ? n_threads : kPlanThreadsPerStage;
  L.att = align_buffer(threads * cpu::attention_thread_bytes(int(n_rep), int(s.head_dim_k), int(s.head_dim_v)));
  L.xq = align_buffer(B * ((widest + 31) / 32) * 40);
  const uint64_t rows = output_rows(n_outputs, n_batch);
  L.logits = on_last_stage ? align_buffer(rows * s.n_vocab * f) : 0;
  if (s.n_expert > 0)
    L.moe = align_buffer(B * s.n_expert * f) + 2 * align_buffer(B * s.n_embd * f) +
            align_buffer(moe_expert_rows(B, s.n_expert_used) * s.n_embd * f);
  return L;
}

uint64_t gpu_ops_scratch_bytes(const ModelShape& s, uint32_t n_batch, bool on_last_stage, uint32_t n_outputs) {
  const uint64_t B = n_batch, attn_width = uint64_t(s.n_head) * s.head_dim_v;
  const uint64_t cols = std::max<uint64_t>({s.n_embd, attn_width, s.n_ff});  // widest matmul input
  uint64_t rows = std::max<uint64_t>({uint64_t(s.n_head) * s.head_dim_k, s.n_embd, s.n_ff});
  if (on_last_stage) rows = std::max<uint64_t>(rows, s.n_vocab);
  const uint64_t slab_limit = uint64_t(64) << 20;  // cuda::Context::gemm_slab_bytes
  const uint64_t slab = std::min(rows * cols * 2, std::max(slab_limit, 128 * cols * 2));  // slabs of >= 128 rows
  const uint64_t gemm = (B * cols * 2 + 255) / 256 * 256 + slab;
  const uint64_t gemv = 8 * (cols + (cols + 31) / 32 * 8 + 64);  // 8-bit activations of 8 columns
  const uint64_t d = std::max(s.head_dim_k, s.head_dim_v);
  // Split partials (tokens x heads x splits), after the output's 8-bit activations (cuda::attention).
  const uint64_t attention = (4 * kPlanMaxSms + B * s.n_head) * (d + 2) * 4 + (B * attn_width * 5 / 4 + 511) / 256 * 256;
  // Sampling on the device (kernels/cuda/sample.cu): the slices' candidates of long rows, for up to
  // Context::kCounters (64) rows: top_k's 16384-value slices (k ids and logits each), argmax's
  // 2048-value slices (one pair each).
  uint64_t sampling = 0;
  if (on_last_stage) {
    const uint64_t V = s.n_vocab, n = std::min<uint64_t>(output_rows(n_outputs, n_batch), 64);
    const uint64_t K = uint64_t(std::max(1, top_k_candidates(int(s.n_vocab))));
    const uint64_t split_k = (V + 16383) / 16384, split_a = (V + 2047) / 2048;
    if (split_k > 1 && split_k * K < V) sampling = split_k * n * K * 8;
    if (split_a > 1) sampling = std::max(sampling, split_a * n * 8);
  }
  // A mixture's experts routed on the device (kMoeDeviceTokens tokens, k pairs each, a column per
  // pair): the 8-bit activations of the down projections' input (cuda::gemv_experts).
  const uint64_t pairs = std::min<uint64_t>(B, kMoeDeviceTokens) * s.n_expert_used;
  const uint64_t moe = s.n_expert > 0 ? (pairs * s.n_ff_exp + 255) / 256 * 256 + s.n_ff_exp / 32 * pairs * 8 : 0;
  const uint64_t mib = uint64_t(1) << 20;
  return (std::max({gemm, gemv, attention, sampling, moe}) + mib - 1) / mib * mib;
}

uint64_t gpu_sampling_bytes(const ModelShape& s, uint32_t n_outputs) {
  auto buf = [](uint64_t b) { return std::max<uint64_t>(b, 16); };  // GpuStage allocates at least 16
  const uint64_t K = uint64_t(top_k_candidates(int(s.n_vocab)));
  return buf(uint64_t(n_outputs) * sizeof(int32_t)) + (K > 0 ? 2 * buf(uint64_t(n_outputs) * K * 4) : 0);
}

uint64_t gpu_link_bytes(const ModelShape& s, uint32_t n_batch) {
  return uint64_t(kGpuLinkSlots) * n_batch * s.n_embd * sizeof(float);
}

}  // namespace baton
