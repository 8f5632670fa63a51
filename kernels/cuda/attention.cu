// Attention over the KV cache, with the staged-batch rule of cpu::attention: the batch's own keys
// are read from the staging rows, older positions from the cache ring.
//  - attention(): one query per (token, head); the keys are split over gridDim.z blocks
//    (flash-decoding) that each keep a running max/sum, merged by a second kernel. Any batch.
//  - attention_prefill(): a run of one sequence; a block takes a tile of queries of one head and
//    walks key/value tiles through shared memory with an online softmax (no score matrix).
// Scores and sums in F32; K/V are F16 or Q8_0 and expanded to F32 on load.
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
  // Elements e0..e0+7 (e0 a multiple of 8).
  __device__ static void load8(const uint8_t* row, int e0, float (&v)[8]) {
    if constexpr (!Q8) {
      const uint4 w = *reinterpret_cast<const uint4*>(row + size_t(e0) * 2);  // rows are 16-byte aligned
      const __half2* h = reinterpret_cast<const __half2*>(&w);
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 f = __half22float2(h[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
      }
    } else {
      const uint8_t* b = row + (e0 / 32) * 34;
      const float d = half_bits_to_float(*reinterpret_cast<const uint16_t*>(b));  // even offsets
      const uint16_t* q = reinterpret_cast<const uint16_t*>(b + 2 + e0 % 32);
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const uint16_t two = q[k];
        v[2 * k] = d * float(int8_t(two & 0xFF));
        v[2 * k + 1] = d * float(int8_t(two >> 8));
      }
    }
  }
};

// Row of position j for a query of sequence s whose batch rows start at position `first`.
__device__ __forceinline__ const uint8_t* kv_row(const uint8_t* staged, const uint8_t* cache, size_t row_bytes,
                                                 int n_cells, int j, int s, int first, int row0) {
  if (j >= first) return staged + size_t(row0 + j - first) * row_bytes;
  return cache + (size_t(s) * n_cells + size_t(j % n_cells)) * row_bytes;
}

// ---- split-K attention (decode and any batch) ----

template <int D, bool Q8>
__global__ void __launch_bounds__(kAttnThreads)
attn_split_kernel(AttentionArgs a, int chunk, float* __restrict__ part) {
  constexpr int R = D / 32;  // dims per lane: d = lane + 32 i
  __shared__ float qs[D];
  __shared__ float sm_m[4];
  __shared__ float sm_l[4];
  __shared__ float sm_o[4][D];
  const int t = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, n_split = gridDim.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int p = a.pos[t], s = a.seq[t], first = a.first[t], row0 = a.row0[t];
  const int g = h / (a.n_head / a.kv.n_head_kv);
  const int lo = a.window > 0 ? max(0, p - a.window + 1) : 0;
  // The last split runs to the end, so a max_len below pos + 1 costs speed, not correctness.
  const int kb = max(lo, sp * chunk), ke = sp == n_split - 1 ? p + 1 : min(p + 1, (sp + 1) * chunk);

  for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = a.q[size_t(t) * a.q_stride + size_t(h) * D + d];
  __syncthreads();

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
      score = acc * a.scale;
    }
    const float m_new = fmaxf(m, warp_max(score));  // lane 0's key is always valid here
    const float pj = j < ke ? expf(score - m_new) : 0.0f;
    const float corr = expf(m - m_new);
    l = l * corr + warp_sum(pj);
#pragma unroll
    for (int i = 0; i < R; i++) o[i] *= corr;
    const int nk = min(32, ke - k0);  // the same for the whole warp
    // Lanes = dims: coalesced value rows, kVGroup rows loaded before any is used (one row at a
    // time would wait out the memory latency once per key); summed in key order.
    constexpr int kVGroup = D >= 128 ? 4 : 8;
    for (int jj0 = 0; jj0 < nk; jj0 += kVGroup) {
      float vv[kVGroup][R];
#pragma unroll
      for (int u = 0; u < kVGroup; u++) {
        const uint8_t* vr = kv_row(a.v_new, a.kv.v, a.kv.v_row, a.kv.n_cells, k0 + min(jj0 + u, nk - 1), s, first, row0);
#pragma unroll
        for (int i = 0; i < R; i++) vv[u][i] = KvRead<Q8>::at(vr, g * D + lane + 32 * i);
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
  for (int i = 0; i < R; i++) sm_o[warp][lane + 32 * i] = o[i];
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < 4; w++) M = fmaxf(M, sm_m[w]);
  float* out = part + ((size_t(t) * gridDim.y + h) * n_split + sp) * (D + 2);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int w = 0; w < 4; w++)
      if (sm_m[w] > -INFINITY) acc += expf(sm_m[w] - M) * sm_o[w][d];
    out[2 + d] = acc;
  }
  if (threadIdx.x == 0) {
    float L = 0.0f;
    for (int w = 0; w < 4; w++)
      if (sm_m[w] > -INFINITY) L += expf(sm_m[w] - M) * sm_l[w];
    out[0] = M;
    out[1] = L;
  }
}

template <int D>
__global__ void attn_combine_kernel(const float* __restrict__ part, int n_split, float* out, size_t out_stride) {
  const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const float* p = part + (size_t(t) * gridDim.y + h) * n_split * (D + 2);
  float M = -INFINITY;
  for (int s = 0; s < n_split; s++) M = fmaxf(M, p[s * (D + 2)]);
  float acc = 0.0f, L = 0.0f;
  for (int s = 0; s < n_split; s++) {
    const float ms = p[s * (D + 2)];
    if (ms == -INFINITY) continue;
    const float w = expf(ms - M);
    L += w * p[s * (D + 2) + 1];
    acc += w * p[s * (D + 2) + 2 + d];
  }
  out[size_t(t) * out_stride + size_t(h) * D + d] = acc / L;
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
      const float s = ok ? sc[r] * a.scale : -INFINITY;
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
#pragma unroll
    for (int i = 0; i < R; i++) out[lane + 32 * i] = o[r][i] / l[r];
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

// Keys per split: a multiple of kSplitKeys, chosen so that tokens × heads × splits fills the GPU.
int split_chunk(const Context& c, int n_tokens, int n_head, int max_len) {
  const int64_t blocks = int64_t(n_tokens) * n_head;
  const int64_t want = std::max<int64_t>(1, (int64_t(c.sm_count()) * 4 + blocks - 1) / blocks);
  int64_t chunk = (max_len + want - 1) / want;
  chunk = (chunk + kSplitKeys - 1) / kSplitKeys * kSplitKeys;
  return int(std::max<int64_t>(kSplitKeys, chunk));
}

}  // namespace

size_t attention_scratch_bytes(const Context& c, int n_tokens, int n_head, int head_dim, int max_len) {
  if (n_tokens <= 0 || max_len <= 0) return 0;
  const int chunk = split_chunk(c, n_tokens, n_head, max_len);
  const int n_split = (max_len + chunk - 1) / chunk;
  return size_t(n_tokens) * n_head * n_split * (head_dim + 2) * sizeof(float);
}

void attention(Context& c, const AttentionArgs& a, int max_len) {
  check_args(a);
  if (a.n_tokens <= 0) return;
  if (max_len <= 0) input_error(cat("CUDA attention: max_len ", max_len, " must be positive"));
  const int D = a.kv.head_dim;
  const int chunk = split_chunk(c, a.n_tokens, a.n_head, max_len);
  const int n_split = (max_len + chunk - 1) / chunk;
  float* part = static_cast<float*>(c.scratch(attention_scratch_bytes(c, a.n_tokens, a.n_head, D, max_len)));
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  with_head(a.kv, [&](auto dim, auto q8) {
    constexpr int DD = decltype(dim)::value;
    attn_split_kernel<DD, decltype(q8)::value>
        <<<dim3(a.n_tokens, a.n_head, n_split), kAttnThreads, 0, s>>>(a, chunk, part);
    CUDA_CHECK_LAUNCH();
    attn_combine_kernel<DD><<<dim3(a.n_tokens, a.n_head), DD, 0, s>>>(part, n_split, a.out, a.out_stride);
    CUDA_CHECK_LAUNCH();
  });
}

void attention_prefill(Context& c, const AttentionArgs& a, int seq, int pos0, int row0) {
  check_args(a);
  if (a.n_tokens <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  with_head(a.kv, [&](auto dim, auto q8) {
    constexpr int DD = decltype(dim)::value;
    const unsigned tiles = ceil_div(a.n_tokens, Tile<DD>::BQ);
    attn_prefill_kernel<DD, decltype(q8)::value><<<dim3(tiles, a.n_head), kAttnThreads, 0, s>>>(a, seq, pos0, row0);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace baton::cuda
