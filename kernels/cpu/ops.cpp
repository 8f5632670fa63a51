// CPU transformer ops. Plain C++ written so the compiler can vectorize the inner loops (independent
// lanes, no reductions in a single accumulator); no fast-math, so results are reproducible.
#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "gguf/error.h"
#include "quant/blocks.h"
#include "quant/quant.h"

namespace baton::cpu {

namespace {

// Sum of a[i]*b[i] in 8 independent lanes (vectorizable), then a fixed-order reduction.
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// F16 -> F32 by table: exact, and fast without relying on F16C being enabled at compile time.
const float* fp16_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(65536);
    for (uint32_t h = 0; h < 65536; ++h) v[h] = fp16_to_f32(uint16_t(h));
    return v;
  }();
  return t.data();
}

// n floats of one head from a cache row in `type`, starting at element `first` (a block boundary).
inline void load_head(GgmlType type, const uint8_t* row, int first, int n, float* dst, const float* f16) {
  if (type == GgmlType::F16) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + first;
    for (int i = 0; i < n; ++i) dst[i] = f16[h[i]];
  } else {  // Q8_0
    const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row) + first / QK;
    for (int blk = 0; blk < n / QK; ++blk) {
      const float d = f16[b[blk].d];
      for (int i = 0; i < QK; ++i) dst[blk * QK + i] = d * float(b[blk].qs[i]);
    }
  }
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + size_t(r) * n;
    float* yr = y + size_t(r) * n;
    const float ms = dot(xr, xr, n) / float(n);
    const float inv = 1.f / std::sqrt(ms + eps);
    if (w) {
      for (int i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i];
    } else {
      for (int i = 0; i < n; ++i) yr[i] = xr[i] * inv;
    }
  }
}

void rope(float* x, int n_head, int head_dim, int rope_dim, int pos, const float* freqs, bool neox) {
  const int half = rope_dim / 2;
  float cs[512], sn[512];  // rope_dim <= 1024 is checked by the caller's config (head dims are small)
  BATON_CHECK(half <= 512);
  for (int i = 0; i < half; ++i) {
    const double a = double(pos) * double(freqs[i]);
    cs[i] = float(std::cos(a));
    sn[i] = float(std::sin(a));
  }
  for (int h = 0; h < n_head; ++h) {
    float* v = x + size_t(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
      const float a = v[i0], b = v[i1];
      v[i0] = a * cs[i] - b * sn[i];
      v[i1] = a * sn[i] + b * cs[i];
    }
  }
}

void softmax(float* x, int n) {
  float mx = x[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

void silu_gate(const float* g, const float* u, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void gelu_tanh_gate(const float* g, const float* u, float* y, int n) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  for (int i = 0; i < n; ++i) {
    const float x = g[i];
    y[i] = 0.5f * x * (1.f + std::tanh(k * (x + 0.044715f * x * x * x))) * u[i];
  }
}

void add(float* y, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += x[i];
}

void scale(float* y, float s, int n) {
  for (int i = 0; i < n; ++i) y[i] *= s;
}

void softcap(float* y, float cap, int n) {
  for (int i = 0; i < n; ++i) y[i] = cap * std::tanh(y[i] / cap);
}

void embed_rows(const QMatrix& emb, const int32_t* ids, int n, float* out, float s) {
  for (int i = 0; i < n; ++i) {
    float* o = out + size_t(i) * emb.cols;
    dequantize_row(emb.type, emb.row(ids[i]), o, emb.cols);
    if (s != 1.f) scale(o, s, int(emb.cols));
  }
}

void kv_convert(GgmlType type, const float* src, uint8_t* dst, int n) {
  if (type == GgmlType::F16) {
    uint16_t* h = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) h[i] = f32_to_fp16(src[i]);
  } else {
    BATON_CHECK(type == GgmlType::Q8_0);
    quantize_row(GgmlType::Q8_0, src, dst, n);
  }
}

namespace {

// Attention inner loops over float tiles: one scalar version and one AVX2/FMA/F16C version picked
// by active_isa(). Each query row's result depends only on its own keys, never on the block.
struct AttnKernels {
  void (*cvt_f16)(const uint16_t* h, float* dst, int n);
  // s[j] = scale * q·K[j] for j < n (K rows d apart).
  void (*scores)(const float* q, const float* K, int n, int d, float scale, float* s);
  // out = sum_j p[j] * V[j] for j < n (V rows d apart).
  void (*pv)(const float* p, const float* V, int n, int d, float* out);
};

void cvt_f16_scalar(const uint16_t* h, float* dst, int n) {
  const float* f16 = fp16_table();
  for (int i = 0; i < n; ++i) dst[i] = f16[h[i]];
}

void scores_scalar(const float* q, const float* K, int n, int d, float scale, float* s) {
  for (int j = 0; j < n; ++j) s[j] = dot(q, K + size_t(j) * d, d) * scale;
}

void pv_scalar(const float* p, const float* V, int n, int d, float* out) {
  std::fill(out, out + d, 0.f);
  for (int j = 0; j < n; ++j) axpy(out, p[j], V + size_t(j) * d, d);
}

#if defined(__x86_64__) || defined(__i386__)
#define BATON_AVX2 __attribute__((target("avx2,fma,f16c")))

BATON_AVX2 void cvt_f16_avx2(const uint16_t* h, float* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  const float* f16 = fp16_table();
  for (; i < n; ++i) dst[i] = f16[h[i]];
}

BATON_AVX2 inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// d % 8 == 0 (checked by the caller). Four keys at a time share each load of q.
BATON_AVX2 void scores_avx2(const float* q, const float* K, int n, int d, float scale, float* s) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k0 = K + size_t(j) * d;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d + i), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * d + i), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * d + i), a3);
    }
    s[j] = hsum8(a0) * scale;
    s[j + 1] = hsum8(a1) * scale;
    s[j + 2] = hsum8(a2) * scale;
    s[j + 3] = hsum8(a3) * scale;
  }
  for (; j < n; ++j) {
    const float* k0 = K + size_t(j) * d;
    __m256 a0 = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k0 + i), a0);
    s[j] = hsum8(a0) * scale;
  }
}

// d % 8 == 0. The output slice (up to 32 floats) stays in registers across all n rows.
BATON_AVX2 void pv_avx2(const float* p, const float* V, int n, int d, float* out) {
  int i = 0;
  for (; i + 32 <= d; i += 32) {
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
    for (int j = 0; j < n; ++j) {
      const float* v = V + size_t(j) * d + i;
      const __m256 pj = _mm256_set1_ps(p[j]);
      o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), o0);
      o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), o1);
      o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), o2);
      o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), o3);
    }
    _mm256_storeu_ps(out + i, o0);
    _mm256_storeu_ps(out + i + 8, o1);
    _mm256_storeu_ps(out + i + 16, o2);
    _mm256_storeu_ps(out + i + 24, o3);
  }
  for (; i < d; i += 8) {
    __m256 o0 = _mm256_setzero_ps();
    for (int j = 0; j < n; ++j)
      o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(V + size_t(j) * d + i), o0);
    _mm256_storeu_ps(out + i, o0);
  }
}
#endif

AttnKernels attn_kernels(int dk, int dv) {
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx2 && dk % 8 == 0 && dv % 8 == 0) return {cvt_f16_avx2, scores_avx2, pv_avx2};
#endif
  (void)dk, (void)dv;
  return {cvt_f16_scalar, scores_scalar, pv_scalar};
}

// dst[n] = one head of a cache row in `type`, starting at element `first` (a block boundary).
inline void load_head(const AttnKernels& kern, GgmlType type, const uint8_t* row, int first, int n, float* dst) {
  if (type == GgmlType::F16) {
    kern.cvt_f16(reinterpret_cast<const uint16_t*>(row) + first, dst, n);
  } else {  // Q8_0
    const float* f16 = fp16_table();
    const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row) + first / QK;
    for (int blk = 0; blk < n / QK; ++blk) {
      const float d = f16[b[blk].d];
      for (int i = 0; i < QK; ++i) dst[blk * QK + i] = d * float(b[blk].qs[i]);
    }
  }
}

constexpr int kQueryBlock = 32;  // query tokens sharing one conversion of their K/V rows

}  // namespace

void attention(const AttentionArgs& a, ThreadPool& pool) {
  const KvLayerView& kv = a.kv;
  BATON_CHECK(kv.type == GgmlType::F16 || kv.type == GgmlType::Q8_0);
  const int n_rep = a.n_head / kv.n_head_kv;
  const int dk = kv.head_dim_k, dv = kv.head_dim_v;
  const AttnKernels kern = attn_kernels(dk, dv);

  // Blocks of consecutive batch tokens of one sequence: each block converts the K/V rows its
  // queries see once into float tiles. Blocks never mix sequences, and each query's arithmetic
  // is the same whatever block it lands in, so a row's result does not depend on the batch.
  std::vector<int> block_start;
  for (int t = 0; t < a.n_tokens; ++t) {
    if (block_start.empty() || t - block_start.back() >= kQueryBlock || a.seq[t] != a.seq[block_start.back()] ||
        a.first[t] != a.first[block_start.back()] || a.row0[t] != a.row0[block_start.back()])
      block_start.push_back(t);
  }
  const int n_blocks = int(block_start.size());
  block_start.push_back(a.n_tokens);

  // One task = one block × a group of query heads sharing a KV head. With few blocks (decode),
  // split groups so every thread has work.
  int heads_per_task = n_rep;
  while (heads_per_task > 1 && n_blocks * (a.n_head / heads_per_task) < 2 * pool.size()) {
    int h = heads_per_task - 1;
    while (n_rep % h) --h;
    heads_per_task = h;
  }
  const int tasks_per_block = a.n_head / heads_per_task;

  pool.run(n_blocks * tasks_per_block, [&](int task, int) {
    const int b = task / tasks_per_block;
    const int h0 = (task % tasks_per_block) * heads_per_task;  // first query head
    const int g = h0 / n_rep;                                   // its KV head
    const int t0 = block_start[b], t1 = block_start[b + 1];
    const int s = a.seq[t0], first = a.first[t0], row0 = a.row0[t0];
    auto lo_of = [&](int t) { return a.window > 0 ? std::max(0, a.pos[t] - a.window + 1) : 0; };
    int lo = lo_of(t0), hi = a.pos[t0];
    for (int t = t0 + 1; t < t1; ++t) lo = std::min(lo, lo_of(t)), hi = std::max(hi, a.pos[t]);
    const int nk = hi - lo + 1;
    BATON_CHECK(lo >= first - kv.n_cells);  // every older position is still in the ring
    auto key_at = [&](int j) { return j >= first ? a.k_new + size_t(row0 + j - first) * kv.k_row : kv.k_cell(s, j); };
    auto val_at = [&](int j) { return j >= first ? a.v_new + size_t(row0 + j - first) * kv.v_row : kv.v_cell(s, j); };

    thread_local std::vector<float> buf;
    buf.resize(size_t(nk) * (dk + dv) + size_t(nk));
    float* ktile = buf.data();                   // [nk][dk]
    float* vtile = ktile + size_t(nk) * dk;      // [nk][dv]
    float* scores = vtile + size_t(nk) * dv;     // [nk]
    for (int j = 0; j < nk; ++j) {
      load_head(kern, kv.type, key_at(lo + j), g * dk, dk, ktile + size_t(j) * dk);
      load_head(kern, kv.type, val_at(lo + j), g * dv, dv, vtile + size_t(j) * dv);
    }

    for (int t = t0; t < t1; ++t) {
      const int off = lo_of(t) - lo, n = a.pos[t] - lo_of(t) + 1;
      for (int r = 0; r < heads_per_task; ++r) {
        const float* q = a.q + size_t(t) * a.q_stride + size_t(h0 + r) * dk;
        float* out = a.out + size_t(t) * a.out_stride + size_t(h0 + r) * dv;
        kern.scores(q, ktile + size_t(off) * dk, n, dk, a.scale, scores);
        softmax(scores, n);
        kern.pv(scores, vtile + size_t(off) * dv, n, dv, out);
      }
    }
  });
}

}  // namespace baton::cpu
