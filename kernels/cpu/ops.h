// The non-matmul operations of a transformer forward on the CPU: norms, RoPE, activations,
// embedding lookup and attention over a quantized KV cache. Rows are contiguous float vectors.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/threadpool.h"
#include "kernels/swiglu_oai.h"
#include "quant/types.h"

namespace baton::cpu {

// y[r] = x[r] / rms(x[r]) * w for `rows` rows of n (x and y may alias). w == nullptr: no weight.
void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps);

// Rotates the first rope_dim dims of each of n_head heads (head_dim apart) of one token at `pos`.
// freqs[i] is the angle per position of pair i. neox=false: pairs (2i, 2i+1); true: (i, i+rope_dim/2).
// mscale multiplies cos and sin: LongRoPE's attention factor (1 for every other model).
void rope(float* x, int n_head, int head_dim, int rope_dim, int pos, const float* freqs, bool neox, float mscale = 1.f);
// rope() in two steps, so that the angles of a position are computed once for q, k and every layer
// sharing the frequencies: cs/sn[i] = cos/sin(pos · freqs[i]) (in double, rounded), i < half; then
// the rotation with them (mscale as for rope()).
void rope_angles(int pos, const float* freqs, int half, float* cs, float* sn, float mscale = 1.f);
void rope_rotate(float* x, int n_head, int head_dim, int rope_dim, const float* cs, const float* sn, bool neox);

void softmax(float* x, int n);                                    // in place, max-subtracted
// log Σ e^x[i] over n > 0 finite values (max-subtracted, the sum in double; the SIMD paths' exp is
// ~1e-7 relative): a row's log-softmax is x[i] − log_sum_exp (perplexity, runtime/perplexity.cpp).
double log_sum_exp(const float* x, int n);
void silu_gate(const float* g, const float* u, float* y, int n);  // y = silu(g) * u
void gelu_tanh_gate(const float* g, const float* u, float* y, int n);  // y = gelu_tanh(g) * u
// gpt-oss's clamped SwiGLU: y = x·σ(α·x)·(u' + 1), x = min(g, limit), u' = clamp(u, −limit, limit)
// (α = kSwigluOaiAlpha, limit = kSwigluOaiLimit: kernels/swiglu_oai.h). A NaN g or u gives NaN.
void swiglu_oai_gate(const float* g, const float* u, float* y, int n);
void add(float* y, const float* x, int n, float s = 1.f);         // y += s·x (s: granite's residual scale)
void scale(float* y, float s, int n);                             // y *= s
void softcap(float* y, float cap, int n);                         // y = cap * tanh(y / cap)
// Index of the largest of n > 0 values, ties to the lowest index; NaNs are never picked (all NaN: 0).
int argmax(const float* x, int n);
// The k largest values of x[0, n) (NaN skipped), sorted by value descending then index ascending
// (the order of the CUDA top_k): their indices and values. Returns how many it found, which is
// less than k only when fewer than k values are not NaN. One pass: a value enters only when it
// beats the worst of the k kept so far.
int top_k(const float* x, int n, int k, int32_t* idx, float* val);
// A mixture of experts' router for one token: softmax over the n_expert logits (in place), the k
// most probable experts (top_k's order) and their probabilities as weights, divided by their sum
// (kept >= 2^-14) when renorm. A NaN logit counts as -inf (never picked); places top_k cannot
// fill (every logit NaN or -inf) get expert -1 and weight 0.
void moe_route(float* logits, int n_expert, int k, bool renorm, int32_t* ids, float* weights);
// The routing of n tokens (k experts each: ids and weights, token-major, expert -1 skipped) grouped
// by expert: expert e's pairs are [first[e], first[e + 1]) of rows (the token) and weights, tokens
// in order. first has n_expert + 1 entries, rows and weights n·k.
void moe_group(const int32_t* ids, const float* w, int n, int k, int n_expert, int32_t* first, int32_t* rows,
               float* weights);
// A mixture of experts' data movement, rows of `width` floats: y[j] = x[rows[j]] for j < m; and
// acc[rows[j]] += f(w[j]) · y[j], f the identity or the sigmoid (a shared expert's gate), rows
// null meaning row j, in j order.
void gather_rows(const float* x, const int32_t* rows, int m, int width, float* y);
void scatter_add_rows(float* acc, const float* y, const int32_t* rows, const float* w, bool sigmoid_w, int m, int width);

// out[i] = row ids[i] of `emb` (dequantized) * s. Out-of-range ids are the caller's job to reject.
void embed_rows(const QMatrix& emb, const int32_t* ids, int n, float* out, float s);

// One layer's KV cache: for each sequence slot, n_cells positions of K and of V (all KV heads of a
// position: k_row / v_row bytes) in `type` (F16 or Q8_0). Position p lives in cell p % n_cells, so
// a sliding-window layer keeps a ring of just `window` cells. Head-major: per slot and KV head,
// the n_cells rows of that head are consecutive, so what one attention task reads (one head, all
// positions) is one contiguous run that the hardware streams.
struct KvLayerView {
  GgmlType type = GgmlType::F16;
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  size_t k_row = 0, v_row = 0;   // bytes per position (all KV heads)
  int n_cells = 0;
  int n_head_kv = 0, head_dim_k = 0, head_dim_v = 0;
  size_t k_head_bytes() const { return k_row / size_t(n_head_kv); }
  size_t v_head_bytes() const { return v_row / size_t(n_head_kv); }
  // Head g of the position `pos` of sequence slot `seq`.
  uint8_t* k_at(int seq, int g, int pos) const {
    return k + ((size_t(seq) * size_t(n_head_kv) + size_t(g)) * size_t(n_cells) + size_t(pos % n_cells)) * k_head_bytes();
  }
  uint8_t* v_at(int seq, int g, int pos) const {
    return v + ((size_t(seq) * size_t(n_head_kv) + size_t(g)) * size_t(n_cells) + size_t(pos % n_cells)) * v_head_bytes();
  }
};

// Converts n floats into a KV row of `type` (F16 or Q8_0; n a multiple of 32 for Q8_0).
void kv_convert(GgmlType type, const float* src, uint8_t* dst, int n);

// Causal grouped-query attention of a batch's n_tokens queries. The batch's own keys/values are
// staged (already converted to the cache type) in k_new/v_new, one row per token, each sequence's
// rows consecutive in position order; older positions come from the cache. Query i of sequence
// seq[i] at position pos[i] sees positions [max(0, pos[i] - window + 1), pos[i]] (window 0: from 0):
// position j >= first[i] (its sequence's first position in this batch) is staged row
// row0[i] + j - first[i], an older one is cache cell (seq, j). Because the batch is read from the
// staging rows, a ring of `window` cells suffices, and the caller commits the staged rows afterwards.
// Writes n_head * head_dim_v floats to out + i*out_stride.
struct AttentionArgs {
  int n_tokens = 0;
  const float* q = nullptr;
  size_t q_stride = 0;
  float* out = nullptr;
  size_t out_stride = 0;
  const int32_t* pos = nullptr;
  const int32_t* seq = nullptr;
  const int32_t* first = nullptr;
  const int32_t* row0 = nullptr;
  const uint8_t* k_new = nullptr;
  const uint8_t* v_new = nullptr;
  int n_head = 0;
  float scale = 1.f;
  float softcap = 0.f;  // > 0: every score s (scale included) becomes softcap·tanh(s / softcap) (Gemma 2)
  // n_head floats (host) or null: head h's softmax takes one more logit sinks[h] (gpt-oss's
  // attention sink), which takes probability mass and adds no value: out = Σ_j e^(s_j − M) v_j /
  // (Σ_j e^(s_j − M) + e^(sinks[h] − M)), M = max(max_j s_j, sinks[h]), s_j after scale and cap.
  const float* sinks = nullptr;
  int window = 0;
  KvLayerView kv;
};
void attention(const AttentionArgs& a, ThreadPool& pool);

// The most bytes one worker thread of attention() holds (thread-local, reused), n_rep query heads
// per KV head: the float K/V rows of one 64-key chunk, and for a query block's rows (tokens × its
// n_rep heads) one chunk of scores, the online softmax's running max and sum, and row pointers.
// It does not grow with the context. The planner charges it per thread.
uint64_t attention_thread_bytes(int n_rep, int head_dim_k, int head_dim_v);

// The scores step of attention() on the active ISA, exposed for its tests: for nh query heads (rows
// d apart) against n keys (rows d apart), s[h·n + j] = scale · q_h·K_j.
void attention_scores(const float* q, int nh, const float* K, int n, int d, float scale, float* s);

}  // namespace baton::cpu
