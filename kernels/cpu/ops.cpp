// CPU transformer ops. Plain C++ written so the compiler can vectorize the inner loops (independent
// lanes, no reductions in a single accumulator); no fast-math, so results are reproducible.
#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef BATON_AVX512_EMULATED
#include "kernels/cpu/avx512_emulated.h"  // tests on an AVX2 machine: SIMDe, see there
#endif

#include "gguf/error.h"
#include "kernels/cpu/packed.h"
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

void rope_angles(int pos, const float* freqs, int half, float* cs, float* sn) {
  for (int i = 0; i < half; ++i) {
    const double a = double(pos) * double(freqs[i]);
    cs[i] = float(std::cos(a));
    sn[i] = float(std::sin(a));
  }
}

void rope_rotate(float* x, int n_head, int head_dim, int rope_dim, const float* cs, const float* sn, bool neox) {
  const int half = rope_dim / 2;
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

void rope(float* x, int n_head, int head_dim, int rope_dim, int pos, const float* freqs, bool neox) {
  const int half = rope_dim / 2;
  float cs[512], sn[512];  // rope_dim <= 1024 is checked by the caller's config (head dims are small)
  BATON_CHECK(half <= 512);
  rope_angles(pos, freqs, half, cs, sn);
  rope_rotate(x, n_head, head_dim, rope_dim, cs, sn, neox);
}

namespace {
void softmax_scalar(float* x, int n) {
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
}  // namespace

// The gates compute silu(g) = g / (1 + e^-g) and gelu_tanh(g) = 0.5 g (1 + tanh(z)) =
// g / (1 + e^-2z), z = sqrt(2/pi) (g + 0.044715 g^3): one exponential per element. The SIMD paths
// use their own exp (below, ~1 ulp) on every element, the tail included (masked), so an element's
// result depends only on its value, never on where it sits in the batch.
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluC = 0.044715f;

inline float silu_one(float g) { return g / (1.f + std::exp(-g)); }
inline float gelu_one(float g) { return g / (1.f + std::exp(-2.f * kGeluK * (g + kGeluC * g * g * g))); }

void silu_gate_scalar(const float* g, const float* u, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] = silu_one(g[i]) * u[i];
}
void gelu_gate_scalar(const float* g, const float* u, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] = gelu_one(g[i]) * u[i];
}

#if defined(__x86_64__) || defined(__i386__)
#define BATON_AVX2_FN __attribute__((target("avx2,fma,f16c")))
#ifdef BATON_AVX512_EMULATED
#define BATON_AVX512_FN
#else
#define BATON_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#endif
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps()/_pd(), which -W(maybe-)uninitialized
// reports as a false positive once inlined here (as in dot_avx512.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// e^x for x clamped to [-87, 88] (no overflow to inf, no denormals): x = n ln2 + r with |r| <= ln2/2
// (ln2 split in two for an exact product), e^r by its degree-7 Taylor polynomial (error < 1e-8
// relative), scaled by 2^n through the exponent bits.
BATON_AVX2_FN inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

BATON_AVX512_FN inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

BATON_AVX2_FN inline __m256 gelu_avx2(__m256 g) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(kGeluK), _mm256_fmadd_ps(_mm256_set1_ps(kGeluC), g3, g));
  const __m256 e = exp_avx2(_mm256_mul_ps(_mm256_set1_ps(-2.f), z));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
BATON_AVX2_FN inline __m256 silu_avx2(__m256 g) {
  const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
BATON_AVX512_FN inline __m512 gelu_avx512(__m512 g) {
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 z = _mm512_mul_ps(_mm512_set1_ps(kGeluK), _mm512_fmadd_ps(_mm512_set1_ps(kGeluC), g3, g));
  const __m512 e = exp_avx512(_mm512_mul_ps(_mm512_set1_ps(-2.f), z));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
BATON_AVX512_FN inline __m512 silu_avx512(__m512 g) {
  const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

template <bool Gelu>
BATON_AVX2_FN void gate_avx2(const float* g, const float* u, float* y, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(Gelu ? gelu_avx2(gv) : silu_avx2(gv), _mm256_loadu_ps(u + i)));
  }
  if (i < n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), idx);
    const __m256 gv = _mm256_maskload_ps(g + i, m);
    _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(Gelu ? gelu_avx2(gv) : silu_avx2(gv), _mm256_maskload_ps(u + i, m)));
  }
}

template <bool Gelu>
BATON_AVX512_FN void gate_avx512(const float* g, const float* u, float* y, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(Gelu ? gelu_avx512(gv) : silu_avx512(gv), _mm512_loadu_ps(u + i)));
  }
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(Gelu ? gelu_avx512(gv) : silu_avx512(gv), _mm512_maskz_loadu_ps(m, u + i)));
  }
}
// Softmax with the SIMD exp: max, exponentials and their sum in 8 lanes (tail masked), one scale.
BATON_AVX2_FN void softmax_avx2(float* x, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int body = n & ~7;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - body), idx);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mv = ninf;
  for (int i = 0; i < body; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  if (body < n) mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + body, tail), _mm256_castsi256_ps(tail)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < body; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mx));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (body < n) {
    const __m256 e = _mm256_and_ps(exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(x + body, tail), mx)), _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(x + body, tail, e);
    sum = _mm256_add_ps(sum, e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  const __m256 inv = _mm256_set1_ps(1.f / _mm_cvtss_f32(s4));
  for (int i = 0; i < body; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  if (body < n) _mm256_maskstore_ps(x + body, tail, _mm256_mul_ps(_mm256_maskload_ps(x + body, tail), inv));
}

// Softmax with the SIMD exp: max, exponentials and their sum in 16 lanes (tail masked), one scale.
BATON_AVX512_FN void softmax_avx512(float* x, int n) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 mv = ninf;
  int i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  const __mmask16 tail = __mmask16((1u << (n - i)) - 1);
  if (i < n) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, tail, x + i));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), mx)));
    _mm512_mask_storeu_ps(x + i, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
  if (i < n) _mm512_mask_storeu_ps(x + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), inv));
}
#pragma GCC diagnostic pop
#endif

}  // namespace

void softmax(float* x, int n) {
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx512) return softmax_avx512(x, n);
  if (active_isa() >= Isa::Avx2) return softmax_avx2(x, n);
#endif
  softmax_scalar(x, n);
}

void silu_gate(const float* g, const float* u, float* y, int n) {
#if defined(__x86_64__) || defined(__i386__)
  const Isa isa = active_isa();
  if (isa >= Isa::Avx512) return gate_avx512<false>(g, u, y, n);
  if (isa >= Isa::Avx2) return gate_avx2<false>(g, u, y, n);
#endif
  silu_gate_scalar(g, u, y, n);
}

void gelu_tanh_gate(const float* g, const float* u, float* y, int n) {
#if defined(__x86_64__) || defined(__i386__)
  const Isa isa = active_isa();
  if (isa >= Isa::Avx512) return gate_avx512<true>(g, u, y, n);
  if (isa >= Isa::Avx2) return gate_avx2<true>(g, u, y, n);
#endif
  gelu_gate_scalar(g, u, y, n);
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

namespace {
int argmax_scalar(const float* x, int n) {
  int best = -1;
  for (int i = 0; i < n; ++i)
    if (!std::isnan(x[i]) && (best < 0 || x[i] > x[best])) best = i;
  return best < 0 ? 0 : best;
}

#if defined(__x86_64__) || defined(__i386__)
// Per lane the first index of its largest value (strictly greater replaces), then the largest
// value over the lanes and the lowest index holding it: the scalar loop's answer.
BATON_AVX512_FN int argmax_avx512(const float* x, int n) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 m = ninf;
  __m512i at = _mm512_set1_epi32(-1), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int i = 0;
  for (; i + 16 <= n; i += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
    m = _mm512_mask_mov_ps(m, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
  }
  if (i < n) {
    const __mmask16 tail = __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(ninf, tail, x + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
    m = _mm512_mask_mov_ps(m, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
  }
  alignas(64) float mv[16];
  alignas(64) int32_t av[16];
  _mm512_store_ps(mv, m);
  _mm512_store_epi32(av, at);
  int best = -1;
  for (int l = 0; l < 16; ++l)
    if (av[l] >= 0 && (best < 0 || mv[l] > mv[best] || (mv[l] == mv[best] && av[l] < av[best]))) best = l;
  // No lane moved: every value is NaN or -inf, where the first non-NaN index is the answer.
  return best < 0 ? argmax_scalar(x, n) : av[best];
}
#endif
}  // namespace

int argmax(const float* x, int n) {
  BATON_CHECK(n > 0);
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx512) return argmax_avx512(x, n);
#endif
  return argmax_scalar(x, n);
}

namespace {

// Candidates in an unsorted buffer of up to 2k (value, index) pairs; a better one has the larger
// value, or the same value and the smaller index. A full buffer is pruned to its k best
// (nth_element), and from then on only values above the worst of those k can be among the k
// best: the scan compares against that bar and appends the few that pass. Cheaper than a heap
// when k is large (an append per candidate, a linear prune per k of them).
struct TopK {
  struct Item {
    float v;
    int32_t i;
  };
  static bool better(const Item& a, const Item& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }
  std::vector<Item>& buf;
  size_t k;
  // Before the first prune every non-NaN value enters (-inf too); after it, the scan visits
  // indices in increasing order, so a value must be strictly greater than the worst kept one (an
  // equal value has the larger index).
  bool pruned = false;
  float bar = -INFINITY;

  bool passes(float v) const { return pruned ? v > bar : v >= -INFINITY; }  // NaN: never
  void add(float v, int32_t i) {
    buf.push_back({v, i});
    if (buf.size() == 2 * k) prune();
  }
  void prune() {
    std::nth_element(buf.begin(), buf.begin() + ptrdiff_t(k - 1), buf.end(), better);
    buf.resize(k);
    bar = buf[k - 1].v;  // the k-th best: the smallest value kept
    pruned = true;
  }
};

#if defined(__x86_64__) || defined(__i386__)
// 16 values per compare against the bar; only the lanes that pass are appended (after the first
// prunes, few do).
BATON_AVX512_FN void top_k_scan_avx512(const float* x, int n, TopK& t) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __mmask16 m = t.pruned ? _mm512_cmp_ps_mask(v, _mm512_set1_ps(t.bar), _CMP_GT_OQ)
                           : _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);  // not NaN
    while (m) {
      const int l = __builtin_ctz(m);
      m &= __mmask16(m - 1);
      if (t.passes(x[i + l])) t.add(x[i + l], i + l);  // the bar may have risen within the 16
    }
  }
  for (; i < n; ++i)
    if (t.passes(x[i])) t.add(x[i], i);
}
#endif

}  // namespace

int top_k(const float* x, int n, int k, int32_t* idx, float* val) {
  BATON_CHECK(n > 0 && k > 0);
  thread_local std::vector<TopK::Item> buf;
  buf.clear();
  const size_t kk = size_t(std::min(k, n));
  buf.reserve(2 * kk);
  TopK t{buf, kk};
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx512) {
    top_k_scan_avx512(x, n, t);
  } else
#endif
  {
    for (int i = 0; i < n; ++i)
      if (t.passes(x[i])) t.add(x[i], i);
  }
  if (buf.size() > kk) t.prune();
  std::sort(buf.begin(), buf.end(), TopK::better);  // best first
  for (size_t j = 0; j < buf.size(); ++j) idx[j] = buf[j].i, val[j] = buf[j].v;
  return int(buf.size());
}

void embed_rows(const QMatrix& emb, const int32_t* ids, int n, float* out, float s) {
  for (int i = 0; i < n; ++i) {
    float* o = out + size_t(i) * emb.cols;
    if (emb.packed) unpack_row(emb, ids[i], o);
    else dequantize_row(emb.type, emb.row(ids[i]), o, emb.cols);
    if (s != 1.f) scale(o, s, int(emb.cols));
  }
}

#if defined(__x86_64__) || defined(__i386__)
// F16C rounds to nearest even like f32_to_fp16 (same bits for every non-NaN value; tested).
__attribute__((target("avx2,f16c"))) void f32_to_f16_f16c(const float* src, uint16_t* h, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) h[i] = f32_to_fp16(src[i]);
}
#endif

void kv_convert(GgmlType type, const float* src, uint8_t* dst, int n) {
  if (type == GgmlType::F16) {
    uint16_t* h = reinterpret_cast<uint16_t*>(dst);
#if defined(__x86_64__) || defined(__i386__)
    if (active_isa() >= Isa::Avx2) return f32_to_f16_f16c(src, h, n);
#endif
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
  // For nh query heads (q rows d apart) sharing one K tile: s[h*ss + j] = scale * q_h·K[j], j < n.
  // A score's bits do not depend on n, nh or where the key sits in the tile.
  void (*scores)(const float* q, int nh, const float* K, int n, int d, float scale, float* s, size_t ss);
  // out_h = sum_j p[h*ps + j] * V[j] for each of nh heads (out rows d apart; V rows d apart), each
  // output a chain of FMAs in j order; accumulate: the chain continues from out (a later run of
  // keys: the bits are those of one call over all of them), else it starts from 0.
  void (*pv)(const float* p, int nh, const float* V, int n, int d, float* out, size_t ps, bool accumulate);
};

void cvt_f16_scalar(const uint16_t* h, float* dst, int n) {
  const float* f16 = fp16_table();
  for (int i = 0; i < n; ++i) dst[i] = f16[h[i]];
}

void scores_scalar(const float* q, int nh, const float* K, int n, int d, float scale, float* s, size_t ss) {
  for (int h = 0; h < nh; ++h)
    for (int j = 0; j < n; ++j) s[size_t(h) * ss + j] = dot(q + size_t(h) * d, K + size_t(j) * d, d) * scale;
}

void pv_scalar(const float* p, int nh, const float* V, int n, int d, float* out, size_t ps, bool accumulate) {
  for (int h = 0; h < nh; ++h) {
    float* o = out + size_t(h) * d;
    if (!accumulate) std::fill(o, o + d, 0.f);
    for (int j = 0; j < n; ++j) axpy(o, p[size_t(h) * ps + j], V + size_t(j) * d, d);
  }
}

#if defined(__x86_64__) || defined(__i386__)
BATON_AVX2_FN void cvt_f16_avx2(const uint16_t* h, float* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  const float* f16 = fp16_table();
  for (; i < n; ++i) dst[i] = f16[h[i]];
}

BATON_AVX2_FN inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// d % 8 == 0 (checked by the caller). Four keys at a time share each load of q.
BATON_AVX2_FN void scores_avx2_head(const float* q, const float* K, int n, int d, float scale, float* s) {
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
BATON_AVX2_FN void pv_avx2_head(const float* p, const float* V, int n, int d, float* out, bool accumulate) {
  int i = 0;
  for (; i + 32 <= d; i += 32) {
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
    if (accumulate) {
      o0 = _mm256_loadu_ps(out + i);
      o1 = _mm256_loadu_ps(out + i + 8);
      o2 = _mm256_loadu_ps(out + i + 16);
      o3 = _mm256_loadu_ps(out + i + 24);
    }
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
    __m256 o0 = accumulate ? _mm256_loadu_ps(out + i) : _mm256_setzero_ps();
    for (int j = 0; j < n; ++j)
      o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(V + size_t(j) * d + i), o0);
    _mm256_storeu_ps(out + i, o0);
  }
}

void scores_avx2(const float* q, int nh, const float* K, int n, int d, float scale, float* s, size_t ss) {
  for (int h = 0; h < nh; ++h) scores_avx2_head(q + size_t(h) * d, K, n, d, scale, s + size_t(h) * ss);
}
void pv_avx2(const float* p, int nh, const float* V, int n, int d, float* out, size_t ps, bool accumulate) {
  for (int h = 0; h < nh; ++h) pv_avx2_head(p + size_t(h) * ps, V, n, d, out + size_t(h) * d, accumulate);
}

// AVX-512, register-blocked over the query heads that share a KV head (Gemma 3: 4 of them): every
// K or V vector loaded feeds NH heads. Each head keeps its own accumulators and summation order,
// so a head's result is the same whatever NH is (a task's head count varies with the batch).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers, see above
#pragma GCC diagnostic ignored "-Wuninitialized"

// Rows of V as P·V reads them: a float tile (row j at V + j·d) or F16 cache rows read in place.
struct FloatRows {
  const float* V;
  int d;
  const float* operator()(int j) const { return V + size_t(j) * d; }
  void prefetch(int, int, int, int) const {}  // a tile the block just converted: in cache
};
// Cache rows are read in place from wherever the sequence's positions live: a decode step touches
// every sequence's whole cache once, mostly from DRAM, so the rows a few keys ahead are prefetched.
constexpr int kRowsAhead = 6;
BATON_AVX512_FN inline void prefetch_row(const uint16_t* row, int d) {
  for (int b = 0; b < d * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}
struct F16Rows {
  const uint16_t* const* V;
  const uint16_t* operator()(int j) const { return V[j]; }
  void prefetch(int j, int n, int i, int w) const {
    if (j + kRowsAhead < n) prefetch_row(V[j + kRowsAhead] + i, w);
  }
};
BATON_AVX512_FN inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
BATON_AVX512_FN inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// d % 16 == 0. Output slices of W vectors per head stay in registers over all n keys: W V loads
// and NH broadcasts per W·NH FMAs.
template <int NH, int W, class Rows>
BATON_AVX512_FN void pv_avx512_slice(const float* p, Rows V, int n, int d, int i, float* out, size_t ps, bool accumulate) {
  __m512 acc[NH][W];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < W; ++c)
      acc[h][c] = accumulate ? _mm512_loadu_ps(out + size_t(h) * d + i + 16 * c) : _mm512_setzero_ps();
  for (int j = 0; j < n; ++j) {
    V.prefetch(j, n, i, 16 * W);
    const auto* v = V(j) + i;
    __m512 vv[W];
    for (int c = 0; c < W; ++c) vv[c] = load16(v + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 ph = _mm512_set1_ps(p[size_t(h) * ps + j]);
      for (int c = 0; c < W; ++c) acc[h][c] = _mm512_fmadd_ps(ph, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(out + size_t(h) * d + i + 16 * c, acc[h][c]);
}

template <int NH, class Rows>
BATON_AVX512_FN void pv_avx512_nh(const float* p, Rows V, int n, int d, float* out, size_t ps, bool accumulate) {
  int i = 0;
  for (; i + 64 <= d; i += 64) pv_avx512_slice<NH, 4>(p, V, n, d, i, out, ps, accumulate);
  for (; i < d; i += 16) pv_avx512_slice<NH, 1>(p, V, n, d, i, out, ps, accumulate);
}

// The sums of 16 vectors at once: lane k of the result is the sum of the lanes of v[k], added in
// exactly the pairs _mm512_reduce_add_ps adds them (lanes i and i + 8, then i and i + 4, i and
// i + 2, i and i + 1), so every sum has the bits of its own reduction; 15 adds and 30 shuffles for
// 16 sums instead of 16 full reductions. The tree leaves lane 4q + m holding the sum of slot
// 4m + q, so slot s is fed v[4·(s % 4) + s / 4] (a 4 × 4 transpose, its own inverse).
BATON_AVX512_FN inline __m512 reduce16(const __m512* v) {
  __m512 b[8], c[4], e[2];
  for (int p = 0; p < 8; ++p) {  // lanes i and i + 8 of a pair of sources: one source per 256-bit half
    const int s0 = 2 * p, s1 = 2 * p + 1;
    const __m512 x = v[4 * (s0 % 4) + s0 / 4], y = v[4 * (s1 % 4) + s1 / 4];
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int p = 0; p < 4; ++p)  // i and i + 4: one source per 128-bit quarter
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88), _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // i and i + 2, within each quarter
    e[p] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0x44), _mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));  // i and i + 1
}

// Scores of NH query heads against the keys of one KV head, d % 16 == 0. Keys go in blocks of
// KB (NH·KB <= 16 accumulators): each K vector loaded feeds NH heads, and a block's NH·KB dot
// products are reduced together by reduce16. Per (head, key) the FMAs run along d in order and
// end in the same reduction, so a score's bits do not depend on NH, on the block, or on whether
// the rows are a float tile or F16 cache rows read in place (decode).
template <int NH, class Rows>
BATON_AVX512_FN void scores_avx512_nh(const float* q, Rows K, int n, int d, float scale, float* s, size_t ss) {
  constexpr int KB = NH == 1 ? 16 : NH == 2 ? 8 : NH == 3 ? 5 : 4;
  static_assert(NH * KB <= 16);
  const __m512 vscale = _mm512_set1_ps(scale);
  int j = 0;
  for (; j + KB <= n; j += KB) {
    for (int k = 0; k < KB; ++k) K.prefetch(j + k, n, 0, d);
    __m512 acc[16];
    for (int a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
      __m512 qv[NH];
      for (int h = 0; h < NH; ++h) qv[h] = _mm512_loadu_ps(q + size_t(h) * d + i);
      for (int k = 0; k < KB; ++k) {
        const __m512 kv = load16(K(j + k) + i);
        for (int h = 0; h < NH; ++h) acc[h * KB + k] = _mm512_fmadd_ps(qv[h], kv, acc[h * KB + k]);
      }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_mul_ps(reduce16(acc), vscale));
    for (int h = 0; h < NH; ++h) std::memcpy(s + size_t(h) * ss + j, sums + h * KB, KB * sizeof(float));
  }
  for (; j < n; ++j) {
    K.prefetch(j, n, 0, d);
    __m512 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
      const __m512 kv = load16(K(j) + i);
      for (int h = 0; h < NH; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + size_t(h) * d + i), kv, acc[h]);
    }
    for (int h = 0; h < NH; ++h) s[size_t(h) * ss + j] = _mm512_reduce_add_ps(acc[h]) * scale;
  }
}

#pragma GCC diagnostic pop

template <class Rows>
void scores_rows(const float* q, int nh, Rows K, int n, int d, float scale, float* s, size_t ss) {
  for (; nh >= 4; nh -= 4, q += 4 * size_t(d), s += 4 * ss) scores_avx512_nh<4>(q, K, n, d, scale, s, ss);
  if (nh == 3) scores_avx512_nh<3>(q, K, n, d, scale, s, ss);
  if (nh == 2) scores_avx512_nh<2>(q, K, n, d, scale, s, ss);
  if (nh == 1) scores_avx512_nh<1>(q, K, n, d, scale, s, ss);
}
void scores_avx512(const float* q, int nh, const float* K, int n, int d, float scale, float* s, size_t ss) {
  scores_rows(q, nh, FloatRows{K, d}, n, d, scale, s, ss);
}
template <class Rows>
void pv_rows(const float* p, int nh, Rows V, int n, int d, float* out, size_t ps, bool accumulate) {
  for (; nh >= 4; nh -= 4, p += 4 * ps, out += 4 * size_t(d)) pv_avx512_nh<4>(p, V, n, d, out, ps, accumulate);
  if (nh == 3) pv_avx512_nh<3>(p, V, n, d, out, ps, accumulate);
  if (nh == 2) pv_avx512_nh<2>(p, V, n, d, out, ps, accumulate);
  if (nh == 1) pv_avx512_nh<1>(p, V, n, d, out, ps, accumulate);
}
void pv_avx512(const float* p, int nh, const float* V, int n, int d, float* out, size_t ps, bool accumulate) {
  pv_rows(p, nh, FloatRows{V, d}, n, d, out, ps, accumulate);
}
void scores_f16(const float* q, int nh, const uint16_t* const* K, int n, int d, float scale, float* s) {
  scores_rows(q, nh, F16Rows{K}, n, d, scale, s, size_t(n));
}
void pv_f16(const float* p, int nh, const uint16_t* const* V, int n, int d, float* out) {
  pv_rows(p, nh, F16Rows{V}, n, d, out, size_t(n), false);
}
#endif

AttnKernels attn_kernels(int dk, int dv) {
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx512 && dk % 16 == 0 && dv % 16 == 0) return {cvt_f16_avx2, scores_avx512, pv_avx512};
  if (active_isa() >= Isa::Avx2 && dk % 8 == 0 && dv % 8 == 0) return {cvt_f16_avx2, scores_avx2, pv_avx2};
#endif
  (void)dk, (void)dv;
  return {cvt_f16_scalar, scores_scalar, pv_scalar};
}

}  // namespace

void attention_scores(const float* q, int nh, const float* K, int n, int d, float scale, float* s) {
  attn_kernels(d, d).scores(q, nh, K, n, d, scale, s, size_t(n));
}

namespace {

// dst[n] = one head of one position in the cache's `type`, as floats.
inline void load_head(const AttnKernels& kern, GgmlType type, const uint8_t* head, int n, float* dst) {
  if (type == GgmlType::F16) {
    kern.cvt_f16(reinterpret_cast<const uint16_t*>(head), dst, n);
  } else {  // Q8_0
    const float* f16 = fp16_table();
    const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(head);
    for (int blk = 0; blk < n / QK; ++blk) {
      const float d = f16[b[blk].d];
      for (int i = 0; i < QK; ++i) dst[blk * QK + i] = d * float(b[blk].qs[i]);
    }
  }
}

constexpr int kQueryBlock = 32;  // query tokens sharing one conversion of their K/V rows
constexpr int kKeyChunk = 64;    // K/V rows converted (and used by every query of a block) at a time

}  // namespace

uint64_t attention_thread_bytes(int n_rep, int head_dim_k, int head_dim_v, int n_keys) {
  // Prefill: one chunk of K and V as floats + [kQueryBlock][n_rep][n_keys] scores. Decode's F16
  // path (one query): 2 × n_keys row pointers and [n_rep][n_keys] scores, never more.
  const uint64_t prefill = sizeof(float) * (uint64_t(kKeyChunk) * uint64_t(head_dim_k + head_dim_v) +
                                            uint64_t(kQueryBlock) * uint64_t(n_rep) * uint64_t(n_keys));
  const uint64_t decode = 2 * sizeof(void*) * uint64_t(n_keys) + sizeof(float) * uint64_t(n_rep) * uint64_t(n_keys);
  return std::max(prefill, decode);
}

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

  // One task = one block × a group of query heads sharing a KV head. A task reads each K/V vector
  // once for all its heads (one load, `heads` FMAs), so it costs about 1 + heads; with few blocks
  // (decode) a group is split when that shortens the busiest thread: rounds of tasks × (1 + heads).
  // (Splitting always until every thread had two tasks read each row n_rep times: SmolLM2's 3-head
  // groups decoded at 2048 tokens of depth 14-25 % slower on 2 threads, docs/BENCHMARKS.md.)
  // A head's arithmetic does not depend on how many heads share its task.
  auto cost = [&](int h) {
    const int64_t tasks = int64_t(n_blocks) * (a.n_head / h);
    return (tasks + pool.size() - 1) / pool.size() * (1 + h);
  };
  int heads_per_task = n_rep;
  for (int h = n_rep - 1; h >= 1; --h)
    if (n_rep % h == 0 && cost(h) < cost(heads_per_task)) heads_per_task = h;
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
    // Head g of position j: a staged row of the batch, or the cache.
    auto key_at = [&](int j) {
      return j >= first ? a.k_new + size_t(row0 + j - first) * kv.k_row + size_t(g) * kv.k_head_bytes() : kv.k_at(s, g, j);
    };
    auto val_at = [&](int j) {
      return j >= first ? a.v_new + size_t(row0 + j - first) * kv.v_row + size_t(g) * kv.v_head_bytes() : kv.v_at(s, g, j);
    };

#if defined(__x86_64__) || defined(__i386__)
    // One query over an F16 cache (decode): read the rows in place instead of converting them.
    if (t1 - t0 == 1 && kv.type == GgmlType::F16 && kern.scores == scores_avx512) {
      thread_local std::vector<const uint16_t*> rows;
      thread_local std::vector<float> sc;
      rows.resize(2 * size_t(nk));
      sc.resize(size_t(nk) * heads_per_task);
      // The cached positions of (s, g) are consecutive rows of one run (a ring wraps once at most):
      // walk the cells instead of dividing per key; staged rows (j >= first) come from the batch.
      const size_t kh = kv.k_head_bytes(), vh = kv.v_head_bytes();
      const uint8_t* kbase = kv.k_at(s, g, 0);
      const uint8_t* vbase = kv.v_at(s, g, 0);
      const int cached = std::max(0, std::min(nk, first - lo));
      for (int j = 0, cell = lo % kv.n_cells; j < cached; ++j) {
        rows[size_t(j)] = reinterpret_cast<const uint16_t*>(kbase + size_t(cell) * kh);
        rows[size_t(nk + j)] = reinterpret_cast<const uint16_t*>(vbase + size_t(cell) * vh);
        if (++cell == kv.n_cells) cell = 0;
      }
      for (int j = cached; j < nk; ++j) {
        rows[size_t(j)] = reinterpret_cast<const uint16_t*>(key_at(lo + j));
        rows[size_t(nk + j)] = reinterpret_cast<const uint16_t*>(val_at(lo + j));
      }
      const int off = lo_of(t0) - lo, n = a.pos[t0] - lo_of(t0) + 1;
      // The task's rows into L2 up front: the run of one head is short enough that the hardware
      // streamers only ramp up as it ends, and every row is read from DRAM once per step.
      for (int j = 0; j < n; ++j) {
        const char* kr = reinterpret_cast<const char*>(rows[size_t(off + j)]);
        const char* vr = reinterpret_cast<const char*>(rows[size_t(nk + off + j)]);
        for (int b = 0; b < dk * 2; b += 64) _mm_prefetch(kr + b, _MM_HINT_T1);
        for (int b = 0; b < dv * 2; b += 64) _mm_prefetch(vr + b, _MM_HINT_T1);
      }
      const float* q = a.q + size_t(t0) * a.q_stride + size_t(h0) * dk;
      float* out = a.out + size_t(t0) * a.out_stride + size_t(h0) * dv;
      scores_f16(q, heads_per_task, rows.data() + off, n, dk, a.scale, sc.data());
      for (int r = 0; r < heads_per_task; ++r) softmax(sc.data() + size_t(r) * n, n);
      pv_f16(sc.data(), heads_per_task, rows.data() + nk + off, n, dv, out);
      return;
    }
#endif
    const int nq = t1 - t0, H = heads_per_task;
    thread_local std::vector<float> buf;
    buf.resize(size_t(kKeyChunk) * (dk + dv) + size_t(nq) * H * nk);
    BATON_CHECK(buf.size() * sizeof(float) <= attention_thread_bytes(n_rep, dk, dv, nk));
    float* ktile = buf.data();                      // [kKeyChunk][dk]: the keys of one chunk
    float* vtile = ktile + size_t(kKeyChunk) * dk;  // [kKeyChunk][dv]
    float* scores = vtile + size_t(kKeyChunk) * dv; // [nq][H][nk]: query t's heads, by tile row
    // Tile rows [c0, c0 + kKeyChunk) as floats, each row converted once per task.
    auto load_chunk = [&](int c0, float* tile, int d, auto row_at) {
      for (int j = c0; j < std::min(nk, c0 + kKeyChunk); ++j)
        load_head(kern, kv.type, row_at(lo + j), d, tile + size_t(j - c0) * d);
    };

    // Key-major: a chunk of K (then V) rows is converted and used by every query of the block
    // while it is in L1, instead of each query streaming a whole tile from L2/L3 (the tiles of a
    // long prompt are megabytes), and only a chunk is ever held. Query t sees tile rows
    // [off, off + n). The task's heads are consecutive in q and out, so one call covers them all.
    // Each score and each output is the same chain of operations as one call over the query's
    // whole range, so the bits do not change.
    auto first_row = [&](int t) { return lo_of(t) - lo; };
    auto n_keys = [&](int t) { return a.pos[t] - lo_of(t) + 1; };
    auto range = [&](int t, int c0, int& j0, int& j1) {
      j0 = std::max(c0, first_row(t)), j1 = std::min(c0 + kKeyChunk, first_row(t) + n_keys(t));
      return j0 < j1;
    };
    auto s_row = [&](int t) { return scores + size_t(t - t0) * H * nk; };
    for (int c0 = 0; c0 < nk; c0 += kKeyChunk) {
      load_chunk(c0, ktile, dk, key_at);
      for (int t = t0, j0, j1; t < t1; ++t)
        if (range(t, c0, j0, j1)) {
          const float* q = a.q + size_t(t) * a.q_stride + size_t(h0) * dk;
          kern.scores(q, H, ktile + size_t(j0 - c0) * dk, j1 - j0, dk, a.scale, s_row(t) + j0, size_t(nk));
        }
    }
    for (int t = t0; t < t1; ++t)
      for (int r = 0; r < H; ++r) softmax(s_row(t) + size_t(r) * nk + first_row(t), n_keys(t));
    for (int c0 = 0; c0 < nk; c0 += kKeyChunk) {
      load_chunk(c0, vtile, dv, val_at);
      for (int t = t0, j0, j1; t < t1; ++t)
        if (range(t, c0, j0, j1)) {
          float* out = a.out + size_t(t) * a.out_stride + size_t(h0) * dv;
          kern.pv(s_row(t) + j0, H, vtile + size_t(j0 - c0) * dv, j1 - j0, dv, out, size_t(nk), j0 > first_row(t));
        }
    }
  });
}

}  // namespace baton::cpu
