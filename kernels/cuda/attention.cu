// Attention over the KV cache, with the staged-batch rule of cpu::attention: the batch's own keys
// are read from the staging rows, older positions from the cache ring.
//  - attention(): one query per (token, head); the keys are split over gridDim.z blocks
//    (flash-decoding) that each keep a running max/sum, merged by the head's last split to finish
//    (or a second kernel, Context::fused_attention off). Any batch.
//  - attention_prefill(): a run of one sequence; a block takes a tile of queries of one head and
//    walks key/value tiles through shared memory with an online softmax (no score matrix): on the
//    tensor cores for heads up to 128 (Q, K, V and the probabilities as F16), else in F32.
// Scores and sums in F32; K/V are F16 or Q8_0 in the cache, expanded on load. An attention sink
// (a.sinks, gpt-oss) enters once per head, in the final division (softmax_denom): at the merge of
// the splits, or where a head's only split or a prefill tile writes its output.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.cuh"

namespace baton::cuda {

namespace {

constexpr int kAttnThreads = 128;
constexpr int kSplitKeys = 128;  // the split size is a multiple of this

template <bool Q8>
struct KvRead {
  // Element e of a cache row (all heads of one position).
  __device__ static float at(const uint8_t* row, int e) {
    if constexpr (!Q8) {
      return __half2float(reinterpret_cast<const __half*>(row)[e]);
    } else {
      const uint8_t* b = row + (e / 32) * 34;
      return half_bits_to_float(uint16_t(b[0] | (b[1] << 8))) * float(int8_t(b[2 + e % 32]));
    }
  }
  // Elements e0..e0+R-1 (e0 a multiple of R): one load of 2R bytes for an F16 row, the block's
  // scale and R/2 two-byte loads for a Q8_0 row (R a power of two: the run is in one block);
  // element by element for other R.
  template <int R>
  __device__ static void load_run(const uint8_t* row, int e0, float (&v)[R]) {
    if constexpr ((R & (R - 1)) != 0 || R == 1) {
#pragma unroll
      for (int i = 0; i < R; i++) v[i] = at(row, e0 + i);
    } else if constexpr (!Q8) {
      uint32_t w[R / 2];  // rows are 16-byte aligned, so the run is 2R-byte aligned
      const uint8_t* p = row + size_t(e0) * 2;
      if constexpr (R == 2) {
        w[0] = *reinterpret_cast<const uint32_t*>(p);
      } else if constexpr (R == 4) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        w[0] = x.x, w[1] = x.y;
      } else {
        static_assert(R == 8);
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
      }
#pragma unroll
      for (int k = 0; k < R / 2; k++) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
      }
    } else {
      const uint8_t* b = row + (e0 / 32) * 34;
      const float d = half_bits_to_float(*reinterpret_cast<const uint16_t*>(b));  // even offsets
      const uint16_t* q = reinterpret_cast<const uint16_t*>(b + 2 + e0 % 32);
#pragma unroll
      for (int k = 0; k < R / 2; k++) {
        const uint16_t two = q[k];
        v[2 * k] = d * float(int8_t(two & 0xFF));
        v[2 * k + 1] = d * float(int8_t(two >> 8));
      }
    }
  }
  // Elements e0..e0+7 (e0 a multiple of 8).
  __device__ static void load8(const uint8_t* row, int e0, float (&v)[8]) { load_run<8>(row, e0, v); }
};

// Row of position j for a query of sequence s whose batch rows start at position `first`.
__device__ __forceinline__ const uint8_t* kv_row(const uint8_t* staged, const uint8_t* cache, size_t row_bytes,
                                                 int n_cells, int j, int s, int first, int row0) {
  if (j >= first) return staged + size_t(row0 + j - first) * row_bytes;
  return cache + (size_t(s) * n_cells + size_t(j % n_cells)) * row_bytes;
}

// ---- split-K attention (decode and any batch) ----

// Staged row row[t] of k (is_v false) or v to its cell, by the block's threads: 16-byte words when
// the rows allow (F16 rows of a multiple of 8 values, Q8_0 rows of a multiple of 256), else bytes.
__device__ __forceinline__ void commit_row(const KvLayer& kv, const KvCommit& m, int t, bool is_v) {
  const size_t cell = size_t(m.seq[t]) * kv.n_cells + size_t(m.pos[t] % kv.n_cells);
  const size_t rb = is_v ? kv.v_row : kv.k_row;
  const uint8_t* __restrict__ src = (is_v ? m.v_new : m.k_new) + size_t(m.row[t]) * rb;
  uint8_t* __restrict__ dst = (is_v ? kv.v : kv.k) + cell * rb;
  if (rb % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    for (size_t i = threadIdx.x; i < rb / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    return;
  }
  for (size_t i = threadIdx.x; i < rb; i += blockDim.x) dst[i] = src[i];
}

// What the split kernel does with its sums. Unfused (counters null): every block writes its
// partial (M, L, D sums) and attn_combine_kernel merges them. Fused: a head whose keys fit one
// split writes its output at once; otherwise the head's last block to finish merges the partials
// (counters[t * n_head + h] counts them), and the commit goes in the same launch.
struct SplitEnd {
  float* part = nullptr;  // (token, head, split) rows of D + 2 floats
  uint32_t* counters = nullptr;
  int grid_counter = 0;  // counters[grid_counter] counts the grid's blocks (the commit's wait)
  int8_t* qs = nullptr;  // the output's 8-bit activations (rows of n_head * D values)
  float2* ds = nullptr;
  KvCommit commit;
  // true: blocks (t, 0 or 1, 0) commit at once (no cell the batch reads is one it commits: no
  // position reaches the ring's length); false: the grid's last block, after every key is read.
  bool commit_first = false;
  RopeStage rope;  // rope.k set: the step's rope and staging too (attention()'s `rope`)
};

// With e.rope: the token's own key and value, head g, from the F32 rows (k rotated) into the staged
// row `row` and, with `cell` set, into that cache cell: the bytes rope_stage and the commit write.
// Every thread of the block calls this (a warp per 32 values).
template <int D, bool Q8>
__device__ void stage_own_head(const AttentionArgs& a, const RopeStage& r, int t, int g, int p, int row, uint8_t* k_cell,
                               uint8_t* v_cell) {
  const float* kh = r.k + size_t(t) * r.k_stride + size_t(g) * D;
  const float* vh = r.v + size_t(t) * r.v_stride + size_t(g) * D;
  uint8_t* k_row = const_cast<uint8_t*>(a.k_new) + size_t(row) * a.kv.k_row;
  uint8_t* v_row = const_cast<uint8_t*>(a.v_new) + size_t(row) * a.kv.v_row;
  for (int e = threadIdx.x; e < D; e += blockDim.x) {  // whole warps: D is a multiple of 32
    const float x = rope_value(kh, e, r.rope_dim, r.neox, p, r.freqs, r.mscale), y = vh[e];
    const int i = g * D + e;
    if constexpr (Q8) {
      kv_store_q8(k_row, i / 32, i % 32, x);
      kv_store_q8(v_row, i / 32, i % 32, y);
      if (k_cell) {
        kv_store_q8(k_cell, i / 32, i % 32, x);
        kv_store_q8(v_cell, i / 32, i % 32, y);
      }
    } else {
      kv_store_f16(k_row, i, x);
      kv_store_f16(v_row, i, y);
      if (k_cell) {
        kv_store_f16(k_cell, i, x);
        kv_store_f16(v_cell, i, y);
      }
    }
  }
}

// The splits' partials of head h merged into output value d (in split order, empty ones skipped),
// the head's attention sink (sinks non-null) taken in once, here. Read from the L2: other blocks
// wrote them.
template <int D>
__device__ __forceinline__ float merge_splits(const float* p, int n, int d, const float* sinks, int h) {
  float M = -INFINITY;
  for (int s = 0; s < n; s++) M = fmaxf(M, __ldcg(p + s * (D + 2)));
  float acc = 0.0f, L = 0.0f;
  for (int s = 0; s < n; s++) {
    const float ms = __ldcg(p + s * (D + 2));
    if (ms == -INFINITY) continue;
    const float w = expf(ms - M);
    L += w * __ldcg(p + s * (D + 2) + 1);
    acc += w * __ldcg(p + s * (D + 2) + 2 + d);
  }
  return acc / softmax_denom(M, L, sinks, h);
}

// Output value d of token t, head h (and its 8-bit activation: every lane of the warp calls this,
// a warp's 32 values one block).
template <int D>
__device__ __forceinline__ void write_out(const AttentionArgs& a, const SplitEnd& e, int t, int h, int d, float o) {
  a.out[size_t(t) * a.out_stride + size_t(h) * D + d] = o;
  if (e.qs) q8_store(o, (int64_t(t) * a.n_head + h) * D + d, e.qs, e.ds);
}

// A fused block done with the cache: with the commit left to the grid's last block, counts itself
// in, and the last one copies every staged row to its cell.
__device__ __forceinline__ void grid_done(const KvLayer& kv, const SplitEnd& e, bool& last) {
  if (!e.counters || e.commit_first || e.commit.n <= 0) return;
  __threadfence();  // the staged rows this block wrote (e.rope) are visible before it counts
  __syncthreads();  // every thread's reads are done
  if (threadIdx.x == 0) last = atomicAdd(&e.counters[e.grid_counter], 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int r = 0; r < e.commit.n; r++) {
    commit_row(kv, e.commit, r, false);
    commit_row(kv, e.commit, r, true);
  }
  if (threadIdx.x == 0) e.counters[e.grid_counter] = 0;  // for the next launch
}


template <int D, bool Q8>
__global__ void __launch_bounds__(kAttnThreads)
attn_split_kernel(AttentionArgs a, SplitEnd e) {
  constexpr int R = D / 32;  // dims per lane: d = R lane + i
  __shared__ float qs[D];
  __shared__ float sm_m[4];
  __shared__ float sm_l[4];
  __shared__ float sm_o[4][D];
  __shared__ bool last;
  griddep_release();
  const int t = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, n_split = gridDim.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The int arrays are the step's inputs (copied before its first kernel), not an op's output.
  const int p = a.pos[t], s = a.seq[t], first = a.first[t], row0 = a.row0[t];
  const int g = h / (a.n_head / a.kv.n_head_kv);
  const int lo = a.window > 0 ? max(0, p - a.window + 1) : 0;
  // The token's keys [lo, p] in n_split runs of a multiple of kSplitKeys (a block's four warps take
  // 32 keys each per pass): the splits follow the token's length, not max_len (a graph captured
  // for n_ctx would leave most of them empty and give the rest many passes).
  const int per = ((p + 1 - lo + n_split - 1) / n_split + kSplitKeys - 1) / kSplitKeys * kSplitKeys;
  const int kb = lo + sp * per, ke = min(p + 1, kb + per);
  const int n_active = (p + 1 - lo + per - 1) / per;  // splits with keys: the first n_active
  const bool fused = e.counters != nullptr;
  {
    // While the ops before finish (q comes from them), the L2 fetches this block's cached keys
    // and values (no op of the step writes cells before the commit, which follows this kernel):
    // the head group's slice of each row, in 128-byte lines.
    constexpr int len = Q8 ? (D / 32) * 34 : D * 2, lines = len / 128 + 2;  // lines a slice may touch
    const size_t off = size_t(g) * len;
    const int cached_end = min(ke, first);
    for (int i = threadIdx.x; i < (cached_end - kb) * lines; i += blockDim.x) {
      const int j = kb + i / lines;
      const size_t cell = size_t(s) * a.kv.n_cells + size_t(j % a.kv.n_cells);
      const size_t at = off + size_t(min(128 * (i % lines), len - 1));  // the last: the slice's last byte
      prefetch_l2(a.kv.k + cell * a.kv.k_row + at);
      prefetch_l2(a.kv.v + cell * a.kv.v_row + at);
    }
  }
  griddep_wait();
  const bool rope = e.rope.k != nullptr;
  if (fused && !rope) {
    if (e.commit_first && sp == 0 && h < 2)  // no cell this batch reads is one it commits
      for (int r = t; r < e.commit.n; r += gridDim.x)
        if (h == 0 || a.n_head == 1) commit_row(a.kv, e.commit, r, false);
    if (e.commit_first && sp == 0 && h == min(1, a.n_head - 1))
      for (int r = t; r < e.commit.n; r += gridDim.x) commit_row(a.kv, e.commit, r, true);
  }
  if (fused && sp >= n_active) {  // no keys: nothing to merge
    grid_done(a.kv, e, last);
    return;
  }

  const float* qh = a.q + size_t(t) * a.q_stride + size_t(h) * D;
  if (rope) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = rope_value(qh, d, e.rope.rope_dim, e.rope.neox, p, e.rope.freqs, e.rope.mscale);
    if (kb < ke && ke == p + 1) {  // this block reads the token's own key (the only staged one): stage it itself
      // One block per KV head also writes the cell, when no key of the step is read from it.
      const bool to_cell = fused && e.commit_first && e.commit.n > 0 && h % (a.n_head / a.kv.n_head_kv) == 0;
      const size_t cell = size_t(s) * a.kv.n_cells + size_t(p % a.kv.n_cells);
      stage_own_head<D, Q8>(a, e.rope, t, g, p, row0, to_cell ? a.kv.k + cell * a.kv.k_row : nullptr,
                            to_cell ? a.kv.v + cell * a.kv.v_row : nullptr);
    }
  } else {
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = qh[d];
  }
  __syncthreads();  // qs, and the staged row's bytes this block wrote

  float m = -INFINITY, l = 0.0f, o[R];
#pragma unroll
  for (int i = 0; i < R; i++) o[i] = 0.0f;

  for (int k0 = kb + warp * 32; k0 < ke; k0 += 4 * 32) {
    const int j = k0 + lane;
    float score = -INFINITY;
    if (j < ke) {  // lane = key: the whole head dot product, 8 values per load
      const uint8_t* kr = kv_row(a.k_new, a.kv.k, a.kv.k_row, a.kv.n_cells, j, s, first, row0);
      float acc = 0.0f;
#pragma unroll
      for (int e0 = 0; e0 < D; e0 += 8) {
        float kv[8];
        KvRead<Q8>::load8(kr, g * D + e0, kv);
#pragma unroll
        for (int i = 0; i < 8; i++) acc += qs[e0 + i] * kv[i];
      }
      score = softcap_score(acc * a.scale, a.softcap);
    }
    const float m_new = fmaxf(m, warp_max(score));  // lane 0's key is always valid here
    const float pj = j < ke ? expf(score - m_new) : 0.0f;
    const float corr = expf(m - m_new);
    l = l * corr + warp_sum(pj);
#pragma unroll
    for (int i = 0; i < R; i++) o[i] *= corr;
    const int nk = min(32, ke - k0);  // the same for the whole warp
    // Lanes = runs of R dims: coalesced value rows (one load per lane and row where R allows),
    // kVGroup rows loaded before any is used (one row at a time would wait out the memory
    // latency once per key); summed in key order.
    constexpr int kVGroup = D >= 256 ? 4 : D >= 128 ? 8 : 16;
    for (int jj0 = 0; jj0 < nk; jj0 += kVGroup) {
      float vv[kVGroup][R];
#pragma unroll
      for (int u = 0; u < kVGroup; u++) {
        const uint8_t* vr = kv_row(a.v_new, a.kv.v, a.kv.v_row, a.kv.n_cells, k0 + min(jj0 + u, nk - 1), s, first, row0);
        KvRead<Q8>::template load_run<R>(vr, g * D + R * lane, vv[u]);
      }
#pragma unroll
      for (int u = 0; u < kVGroup; u++) {
        const float w = __shfl_sync(kFullMask, pj, (jj0 + u) & 31);
        if (jj0 + u < nk)
#pragma unroll
          for (int i = 0; i < R; i++) o[i] += w * vv[u][i];
      }
    }
    m = m_new;
  }

  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < R; i++) sm_o[warp][R * lane + i] = o[i];
  __syncthreads();
  float M = -INFINITY, L = 0.0f;
  for (int w = 0; w < 4; w++) M = fmaxf(M, sm_m[w]);
  for (int w = 0; w < 4; w++)
    if (sm_m[w] > -INFINITY) L += expf(sm_m[w] - M) * sm_l[w];
  const size_t row = size_t(t) * gridDim.y + h;  // (token, head)
  if (fused && n_active == 1) {
    // The only split with keys: its sums are the head's (the merge would weigh them by exp(0)).
    const float denom = softmax_denom(M, L, a.sinks, h);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0.0f;
      for (int w = 0; w < 4; w++)
        if (sm_m[w] > -INFINITY) acc += expf(sm_m[w] - M) * sm_o[w][d];
      write_out<D>(a, e, t, h, d, acc / denom);
    }
    grid_done(a.kv, e, last);
    return;
  }
  float* out = e.part + (row * n_split + sp) * (D + 2);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int w = 0; w < 4; w++)
      if (sm_m[w] > -INFINITY) acc += expf(sm_m[w] - M) * sm_o[w][d];
    out[2 + d] = acc;
  }
  if (threadIdx.x == 0) {
    out[0] = M;
    out[1] = L;
  }
  if (!fused) return;
  // The block that finishes the head's splits last merges them (as the combine kernel).
  __threadfence();  // the partial is visible before the count says so
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&e.counters[row], 1u) == uint32_t(n_active - 1);
  __syncthreads();
  if (last) {
    __threadfence();
    const float* ph = e.part + row * n_split * (D + 2);
    for (int d = threadIdx.x; d < D; d += blockDim.x)
      write_out<D>(a, e, t, h, d, merge_splits<D>(ph, n_active, d, a.sinks, h));
    if (threadIdx.x == 0) e.counters[row] = 0;  // for the next launch
  }
  grid_done(a.kv, e, last);
}

// Block per token and part (blockIdx.y: k or v).
__global__ void kv_commit_kernel(KvLayer kv, KvCommit m) {
  griddep_release();
  griddep_wait();
  commit_row(kv, m, blockIdx.x, blockIdx.y);
}

// Block (t, h) merges the splits of token t, head h (thread per output value), with the head's
// sink (sinks: n_head floats or null). With qs: out's 8-bit activations too (rows of n_head * D
// values, a warp's 32 values one block). Blocks (t, n_head) and (t, n_head + 1), t < m.n, do the
// commit's k and v rows: every split has read the cache by now (this kernel waits for them), so
// the new rows may overwrite old cells.
template <int D>
__global__ void attn_combine_kernel(const float* __restrict__ part, int n_split, int n_tokens, int n_head,
                                    const float* __restrict__ sinks, float* out, size_t out_stride,
                                    int8_t* __restrict__ qs, float2* __restrict__ ds, KvLayer kv, KvCommit m) {
  griddep_release();
  griddep_wait();
  const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  if (h >= n_head) {
    if (t < m.n) commit_row(kv, m, t, h > n_head);
    return;
  }
  if (t >= n_tokens) return;
  const float o = merge_splits<D>(part + (size_t(t) * n_head + h) * n_split * (D + 2), n_split, d, sinks, h);
  out[size_t(t) * out_stride + size_t(h) * D + d] = o;
  if (qs) q8_store(o, (int64_t(t) * n_head + h) * D + d, qs, ds);
}

// ---- tiled prefill ----

template <int D> struct Tile {
  static constexpr int BQ = D <= 128 ? 16 : 8;   // queries per block (4 warps)
  static constexpr int BK = D <= 128 ? 32 : 16;  // keys per shared-memory tile
  static constexpr int QPW = BQ / 4;             // queries per warp
};

template <int D, bool Q8>
__global__ void __launch_bounds__(kAttnThreads)
attn_prefill_kernel(AttentionArgs a, int seq, int pos0, int row0) {
  using TL = Tile<D>;
  constexpr int BQ = TL::BQ, BK = TL::BK, QPW = TL::QPW, R = D / 32;
  __shared__ float Qs[BQ][D];
  __shared__ float Ks[BK][D + 1];  // +1: lane = key reads walk distinct banks
  __shared__ float Vs[BK][D];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y, g = h / (a.n_head / a.kv.n_head_kv);
  const int q_first = blockIdx.x * BQ, q_last = min(a.n_tokens, q_first + BQ) - 1;

  for (int i = threadIdx.x; i < BQ * D; i += blockDim.x) {
    const int r = i / D, d = i % D, qi = q_first + r;
    Qs[r][d] = qi < a.n_tokens ? a.q[size_t(qi) * a.q_stride + size_t(h) * D + d] : 0.0f;
  }

  float m[QPW], l[QPW], o[QPW][R];
#pragma unroll
  for (int r = 0; r < QPW; r++) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < R; i++) o[r][i] = 0.0f;
  }

  const int hi = pos0 + q_last;  // last key any query of the tile sees
  const int lo = a.window > 0 ? max(0, pos0 + q_first - a.window + 1) : 0;
  for (int k0 = lo; k0 <= hi; k0 += BK) {
    __syncthreads();  // the previous tile is no longer read (and Qs is written, first time)
    for (int i = threadIdx.x; i < BK * (D / 8); i += blockDim.x) {
      const int jj = i / (D / 8), e0 = (i % (D / 8)) * 8, j = k0 + jj;
      float kv[8], vv[8];
      if (j <= hi) {
        KvRead<Q8>::load8(kv_row(a.k_new, a.kv.k, a.kv.k_row, a.kv.n_cells, j, seq, pos0, row0), g * D + e0, kv);
        KvRead<Q8>::load8(kv_row(a.v_new, a.kv.v, a.kv.v_row, a.kv.n_cells, j, seq, pos0, row0), g * D + e0, vv);
      } else {
#pragma unroll
        for (int k = 0; k < 8; k++) kv[k] = vv[k] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < 8; k++) {
        Ks[jj][e0 + k] = kv[k];
        Vs[jj][e0 + k] = vv[k];
      }
    }
    __syncthreads();

    // Scores: lane = key, all of this warp's queries at once (each K value read once).
    float sc[QPW];
#pragma unroll
    for (int r = 0; r < QPW; r++) sc[r] = 0.0f;
    if (lane < BK) {
      for (int d = 0; d < D; d++) {
        const float kd = Ks[lane][d];
#pragma unroll
        for (int r = 0; r < QPW; r++) sc[r] += Qs[warp * QPW + r][d] * kd;
      }
    }
    float pr[QPW];
#pragma unroll
    for (int r = 0; r < QPW; r++) {
      const int qi = q_first + warp * QPW + r, pq = pos0 + qi, j = k0 + lane;
      const int lo_q = a.window > 0 ? max(0, pq - a.window + 1) : 0;
      const bool ok = lane < BK && qi < a.n_tokens && j <= pq && j >= lo_q;
      const float s = ok ? softcap_score(sc[r] * a.scale, a.softcap) : -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(s));
      if (m_new == -INFINITY) {  // nothing visible yet for this query
        pr[r] = 0.0f;
        continue;
      }
      pr[r] = ok ? expf(s - m_new) : 0.0f;
      const float corr = expf(m[r] - m_new);
      l[r] = l[r] * corr + warp_sum(pr[r]);
#pragma unroll
      for (int i = 0; i < R; i++) o[r][i] *= corr;
      m[r] = m_new;
    }
    for (int jj = 0; jj < BK; jj++) {
      float v[R];
#pragma unroll
      for (int i = 0; i < R; i++) v[i] = Vs[jj][lane + 32 * i];
#pragma unroll
      for (int r = 0; r < QPW; r++) {
        const float w = __shfl_sync(kFullMask, pr[r], jj);
#pragma unroll
        for (int i = 0; i < R; i++) o[r][i] += w * v[i];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < QPW; r++) {
    const int qi = q_first + warp * QPW + r;
    if (qi >= a.n_tokens) continue;
    float* out = a.out + size_t(qi) * a.out_stride + size_t(h) * D;
    const float denom = softmax_denom(m[r], l[r], a.sinks, h);
#pragma unroll
    for (int i = 0; i < R; i++) out[lane + 32 * i] = o[r][i] / denom;
  }
}

// ---- tensor-core prefill (head sizes up to 128) ----
//
// mma.sync m16n8k16 (sm_80+): D (16x8, F32) += A (16x16, F16, row-major) * B (16x8, F16, column-
// major). Lane l, with g = l / 4 and t = l % 4, holds A's rows g (regs 0, 2) and g + 8 (1, 3) at
// columns 2t, 2t+1 (0, 1) and 2t+8, 2t+9 (2, 3); B's column g at rows 2t, 2t+1 (b0) and 2t+8, 2t+9
// (b1); D's rows g (0, 1) and g + 8 (2, 3) at columns 2t, 2t+1. The lower half of a register is
// the element of the lower index. The simulator computes the same from the lanes' registers.
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  return uint32_t(__half_as_ushort(__float2half_rn(lo))) | (uint32_t(__half_as_ushort(__float2half_rn(hi))) << 16);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  auto lo = [](uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w))); };
  auto hi = [](uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w >> 16))); };
  float A[2][16], B[2][16];  // A: rows g, g + 8; B: columns 2t, 2t + 1
  for (int tt = 0; tt < 4; tt++) {
    const uint64_t a01 = __shfl_sync(kFullMask, uint64_t(a[0]) | (uint64_t(a[1]) << 32), g * 4 + tt);
    const uint64_t a23 = __shfl_sync(kFullMask, uint64_t(a[2]) | (uint64_t(a[3]) << 32), g * 4 + tt);
    for (int r = 0; r < 2; r++) {
      const uint32_t w01 = uint32_t(a01 >> (32 * r)), w23 = uint32_t(a23 >> (32 * r));
      A[r][2 * tt] = lo(w01), A[r][2 * tt + 1] = hi(w01), A[r][2 * tt + 8] = lo(w23), A[r][2 * tt + 9] = hi(w23);
    }
    for (int c = 0; c < 2; c++) {
      const uint64_t b = __shfl_sync(kFullMask, uint64_t(b0) | (uint64_t(b1) << 32), (2 * t + c) * 4 + tt);
      B[c][2 * tt] = lo(uint32_t(b)), B[c][2 * tt + 1] = hi(uint32_t(b));
      B[c][2 * tt + 8] = lo(uint32_t(b >> 32)), B[c][2 * tt + 9] = hi(uint32_t(b >> 32));
    }
  }
  for (int k = 0; k < 16; k++) {
    d[0] += A[0][k] * B[0][k];
    d[1] += A[0][k] * B[1][k];
    d[2] += A[1][k] * B[0][k];
    d[3] += A[1][k] * B[1][k];
  }
#endif
}

// Eight consecutive K or V values of a cache row as F16 (four registers).
template <bool Q8>
__device__ __forceinline__ uint4 load8_f16(const uint8_t* row, int e0) {
  if constexpr (!Q8) {
    return *reinterpret_cast<const uint4*>(row + size_t(e0) * 2);  // rows are 16-byte aligned
  } else {
    float v[8];
    KvRead<true>::load8(row, e0, v);
    return make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
  }
}

// A warp takes 16 queries (4 warps: 64 per block) of one head; key/value tiles of 32 positions go
// through shared memory as F16 (K row-major, V transposed, so that both B operands are one 32-bit
// load per register, on distinct banks). Scores, softmax and the output in F32; Q (pre-scaled)
// and the probabilities enter the tensor cores as F16.
constexpr int kMmaWarps = 4, kMmaBQ = 16 * kMmaWarps, kMmaBK = 32;

template <int D, bool Q8>
__global__ void __launch_bounds__(kMmaWarps * 32)
attn_prefill_mma_kernel(AttentionArgs a, int seq, int pos0, int row0) {
  constexpr int KS = D / 16;       // k-steps of Q K^T over the head
  constexpr int NT = D / 8;        // n-tiles of the output
  constexpr int KP = D + 8;        // Ks row pitch (halves)
  constexpr int VP = kMmaBK + 8;   // Vt row pitch (halves)
  __shared__ uint4 ks_raw[kMmaBK * KP / 8];
  __shared__ uint4 vt_raw[D * VP / 8];
  uint16_t* Ks = reinterpret_cast<uint16_t*>(ks_raw);
  uint16_t* Vt = reinterpret_cast<uint16_t*>(vt_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, gk = h / (a.n_head / a.kv.n_head_kv);
  const int qb = int(blockIdx.x) * kMmaBQ, q0 = qb + warp * 16;  // run indices
  const int q_last = min(a.n_tokens, qb + kMmaBQ) - 1;

  uint32_t qa[KS][4];  // this warp's 16 queries times the scale, as A fragments
  {
    const float* r0 = a.q + size_t(min(q0 + g, a.n_tokens - 1)) * a.q_stride + size_t(h) * D;
    const float* r1 = a.q + size_t(min(q0 + g + 8, a.n_tokens - 1)) * a.q_stride + size_t(h) * D;
    const float sc = a.scale;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      const int c = ks * 16 + 2 * t;
      qa[ks][0] = pack_half2(r0[c] * sc, r0[c + 1] * sc);
      qa[ks][1] = pack_half2(r1[c] * sc, r1[c + 1] * sc);
      qa[ks][2] = pack_half2(r0[c + 8] * sc, r0[c + 9] * sc);
      qa[ks][3] = pack_half2(r1[c + 8] * sc, r1[c + 9] * sc);
    }
  }
  float o[NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  const int hi = pos0 + q_last;  // last key any query of the block sees
  const int lo = a.window > 0 ? max(0, pos0 + qb - a.window + 1) : 0;
  const int warp_hi = pos0 + min(q0 + 15, q_last);  // this warp's last visible key
  const int warp_lo = a.window > 0 ? pos0 + q0 - a.window + 1 : 0;  // below every window of the warp
  for (int k0 = lo; k0 <= hi; k0 += kMmaBK) {
    __syncthreads();  // the previous tile is no longer read
    for (int i = threadIdx.x; i < kMmaBK * (D / 8); i += blockDim.x) {
      const int jj = i % kMmaBK, e0 = (i / kMmaBK) * 8, j = k0 + jj;  // lanes: consecutive keys
      uint4 kw = make_uint4(0, 0, 0, 0), vw = kw;
      if (j <= hi) {
        kw = load8_f16<Q8>(kv_row(a.k_new, a.kv.k, a.kv.k_row, a.kv.n_cells, j, seq, pos0, row0), gk * D + e0);
        vw = load8_f16<Q8>(kv_row(a.v_new, a.kv.v, a.kv.v_row, a.kv.n_cells, j, seq, pos0, row0), gk * D + e0);
      }
      *reinterpret_cast<uint4*>(Ks + jj * KP + e0) = kw;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint32_t w = word(vw, k);
        Vt[(e0 + 2 * k) * VP + jj] = uint16_t(w);
        Vt[(e0 + 2 * k + 1) * VP + jj] = uint16_t(w >> 16);
      }
    }
    __syncthreads();
    if (q0 >= a.n_tokens || k0 > warp_hi || k0 + kMmaBK - 1 < warp_lo) continue;  // nothing visible here

    float s[4][4];  // scores: n-tile n holds keys k0 + 8n + 2t, +1 for rows g, g + 8
#pragma unroll
    for (int n = 0; n < 4; n++) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const uint16_t* kr = Ks + (n * 8 + g) * KP + 2 * t;
#pragma unroll
      for (int ks = 0; ks < KS; ks++)
        mma_16816(s[n], qa[ks], *reinterpret_cast<const uint32_t*>(kr + ks * 16),
                  *reinterpret_cast<const uint32_t*>(kr + ks * 16 + 8));
    }
    // Mask, then the online softmax of rows g (r = 0) and g + 8 (r = 1); a row's 32 scores are
    // spread over the 4 lanes of its group.
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int qi = q0 + g + 8 * r, pq = pos0 + qi;
      const int lo_q = a.window > 0 ? max(0, pq - a.window + 1) : 0;
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 4; n++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
          const int j = k0 + 8 * n + 2 * t + c;
          const bool ok = qi < a.n_tokens && j <= pq && j >= lo_q;
          float& v = s[n][2 * r + c];
          v = ok ? softcap_score(v, a.softcap) : -INFINITY;  // (q was scaled)
          mx = fmaxf(mx, v);
        }
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      float corr = 1.0f, sum = 0.0f;
      if (m_new != -INFINITY) {  // else nothing visible yet: p = 0, o and l stay
        corr = expf(m[r] - m_new);
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
          for (int c = 0; c < 2; c++) {
            float& v = s[n][2 * r + c];
            v = expf(v - m_new);  // -inf: 0
            sum += v;
          }
      } else {
#pragma unroll
        for (int n = 0; n < 4; n++) s[n][2 * r] = s[n][2 * r + 1] = 0.0f;
      }
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
#pragma unroll
      for (int n = 0; n < NT; n++) {
        o[n][2 * r] *= corr;
        o[n][2 * r + 1] *= corr;
      }
    }
    // O += P V, P as A fragments (two k-steps of 16 keys).
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
      const uint32_t pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                              pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < NT; n++) {
        const uint16_t* vr = Vt + (n * 8 + g) * VP + kk * 16 + 2 * t;
        mma_16816(o[n], pa, *reinterpret_cast<const uint32_t*>(vr), *reinterpret_cast<const uint32_t*>(vr + 8));
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; r++) {
    float L = l[r];
    L += __shfl_xor_sync(kFullMask, L, 1);
    L += __shfl_xor_sync(kFullMask, L, 2);
    const int qi = q0 + g + 8 * r;
    if (qi >= a.n_tokens) continue;
    float* out = a.out + size_t(qi) * a.out_stride + size_t(h) * D + 2 * t;
    L = softmax_denom(m[r], L, a.sinks, h);  // m[r]: the same in the row's 4 lanes
#pragma unroll
    for (int n = 0; n < NT; n++) {
      out[8 * n] = o[n][2 * r] / L;
      out[8 * n + 1] = o[n][2 * r + 1] / L;
    }
  }
}

void check_args(const AttentionArgs& a) {
  const KvLayer& kv = a.kv;
  if (kv.type != GgmlType::F16 && kv.type != GgmlType::Q8_0)
    input_error(cat("CUDA attention: KV type ", type_name(kv.type), " is not F16 or Q8_0"));
  if (kv.n_head_kv <= 0 || a.n_head % kv.n_head_kv != 0)
    input_error(cat("CUDA attention: ", a.n_head, " query heads do not group over ", kv.n_head_kv, " KV heads"));
  const int d = kv.head_dim;
  if (d != 32 && d != 64 && d != 96 && d != 128 && d != 256)
    input_error(cat("CUDA attention: head dim ", d, " is not supported (32, 64, 96, 128, 256)"));
}

// Calls f(std::integral_constant<int, D>{}, std::bool_constant<Q8>{}).
template <class F>
void with_head(const KvLayer& kv, F&& f) {
  const bool q8 = kv.type == GgmlType::Q8_0;
  auto go = [&](auto dim) {
    if (q8) f(dim, std::true_type{});
    else f(dim, std::false_type{});
  };
  switch (kv.head_dim) {
    case 32: go(std::integral_constant<int, 32>{}); break;  // small models (the peer tiny model)
    case 64: go(std::integral_constant<int, 64>{}); break;
    case 96: go(std::integral_constant<int, 96>{}); break;
    case 128: go(std::integral_constant<int, 128>{}); break;
    default: go(std::integral_constant<int, 256>{}); break;
  }
}

// Splits per query: enough that tokens × heads × splits fills the GPU, and no more than max_len
// keys give runs of kSplitKeys.
int split_count(const Context& c, int n_tokens, int n_head, int max_len) {
  const int64_t blocks = int64_t(n_tokens) * n_head;
  const int64_t want = std::max<int64_t>(1, (int64_t(c.sm_count()) * 4 + blocks - 1) / blocks);
  return int(std::min<int64_t>(want, (int64_t(max_len) + kSplitKeys - 1) / kSplitKeys));
}

}  // namespace

// The scratch: the output's 8-bit activations where q8_scratch puts them, then the split partials.
static size_t q8_area(int n_tokens, int n_head, int head_dim) {
  return (q8_act_bytes(int64_t(n_head) * head_dim, n_tokens) + 255) / 256 * 256;
}

size_t attention_scratch_bytes(const Context& c, int n_tokens, int n_head, int head_dim, int max_len) {
  if (n_tokens <= 0 || max_len <= 0) return 0;
  const int n_split = split_count(c, n_tokens, n_head, max_len);
  return q8_area(n_tokens, n_head, head_dim) + size_t(n_tokens) * n_head * n_split * (head_dim + 2) * sizeof(float);
}

void attention(Context& c, const AttentionArgs& a, int max_len, bool q8_out, const KvCommit& commit,
               const RopeStage& rope) {
  check_args(a);
  if (rope.k) {
    const int d = a.kv.head_dim;
    if (rope.rope_dim < 0 || rope.rope_dim % 2 != 0 || rope.rope_dim > d)  // (0: a NoPE layer, the staging only)
      input_error(cat("CUDA attention: rope_dim ", rope.rope_dim, " must be even and at most the head dim ", d));
    if (!rope.v || !rope.freqs || !a.k_new || !a.v_new) input_error("CUDA attention: rope without its v rows, frequencies or staging rows");
    if (a.kv.type == GgmlType::Q8_0 &&
        (reinterpret_cast<uintptr_t>(a.k_new) % 2 || reinterpret_cast<uintptr_t>(a.v_new) % 2 || a.kv.k_row % 2 || a.kv.v_row % 2))
      input_error("CUDA attention: Q8_0 rows must start at even addresses");
  }
  if (a.n_tokens <= 0) return;
  if (max_len <= 0) input_error(cat("CUDA attention: max_len ", max_len, " must be positive"));
  const int D = a.kv.head_dim;
  const int64_t cols = int64_t(a.n_head) * D;
  if (q8_out && a.out_stride != size_t(cols))
    input_error(cat("CUDA attention: 8-bit activations of output rows ", a.out_stride, " apart (not ", cols, ")"));
  const int n_split = split_count(c, a.n_tokens, a.n_head, max_len);
  auto* base = static_cast<uint8_t*>(c.scratch(attention_scratch_bytes(c, a.n_tokens, a.n_head, D, max_len)));
  float* part = reinterpret_cast<float*>(base + q8_area(a.n_tokens, a.n_head, D));
  const Q8Act act = q8_out ? q8_scratch(c, cols, a.n_tokens) : Q8Act{};  // at base: no reallocation
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  SplitEnd e;
  e.part = part;
  e.rope = rope;
  const int64_t heads = int64_t(a.n_tokens) * a.n_head;
  const bool fused = c.fused_attention && heads + 1 <= Context::kAttnCounters;
  if (fused) {
    e.counters = c.counters() + Context::kCounters;
    e.grid_counter = int(heads);
    e.qs = act.qs;
    e.ds = reinterpret_cast<float2*>(act.ds);
    e.commit = commit;
    e.commit_first = max_len <= a.kv.n_cells;
  }
  with_head(a.kv, [&](auto dim, auto q8) {
    constexpr int DD = decltype(dim)::value;
    launch_early(c.early_launch, attn_split_kernel<DD, decltype(q8)::value>, dim3(a.n_tokens, a.n_head, n_split),
                 kAttnThreads, s, a, e);
    CUDA_CHECK_LAUNCH();
    if (fused) return;
    const dim3 grid(unsigned(std::max(a.n_tokens, commit.n)), unsigned(a.n_head + (commit.n > 0 ? 2 : 0)));
    launch_early(c.early_launch, attn_combine_kernel<DD>, grid, DD, s, part, n_split, a.n_tokens, a.n_head, a.sinks,
                 a.out, a.out_stride, act.qs, reinterpret_cast<float2*>(act.ds), a.kv, commit);
    CUDA_CHECK_LAUNCH();
  });
}

void kv_commit(Context& c, const KvLayer& kv, const KvCommit& m) {
  if (m.n <= 0) return;
  launch_early(c.early_launch, kv_commit_kernel, dim3(unsigned(m.n), 2u), 256, static_cast<cudaStream_t>(c.stream()), kv,
               m);
  CUDA_CHECK_LAUNCH();
}

void attention_prefill(Context& c, const AttentionArgs& a, int seq, int pos0, int row0) {
  check_args(a);
  if (a.n_tokens <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  with_head(a.kv, [&](auto dim, auto q8) {
    constexpr int DD = decltype(dim)::value;
    if constexpr (DD <= 128) {  // tensor cores (the output tile of a 256-wide head would not fit in registers)
      if (c.mma_prefill) {
        attn_prefill_mma_kernel<DD, decltype(q8)::value>
            <<<dim3(ceil_div(a.n_tokens, kMmaBQ), a.n_head), kMmaWarps * 32, 0, s>>>(a, seq, pos0, row0);
        CUDA_CHECK_LAUNCH();
        return;
      }
    }
    const unsigned tiles = ceil_div(a.n_tokens, Tile<DD>::BQ);
    attn_prefill_kernel<DD, decltype(q8)::value><<<dim3(tiles, a.n_head), kAttnThreads, 0, s>>>(a, seq, pos0, row0);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace baton::cuda
