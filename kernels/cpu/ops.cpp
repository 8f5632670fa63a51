// CPU transformer ops. Plain C++ written so the compiler can vectorize the inner loops (independent
// lanes, no reductions in a single accumulator); no fast-math, so results are reproducible.
#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

void rope_angles(int pos, const float* freqs, int half, float* cs, float* sn, float mscale) {
  for (int i = 0; i < half; ++i) {
    const double a = double(pos) * double(freqs[i]);
    cs[i] = float(std::cos(a)) * mscale;  // rounded as the CUDA rope: float(cos), then the product
    sn[i] = float(std::sin(a)) * mscale;
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

void rope(float* x, int n_head, int head_dim, int rope_dim, int pos, const float* freqs, bool neox, float mscale) {
  const int half = rope_dim / 2;
  float cs[512], sn[512];  // rope_dim <= 1024 is checked by the caller's config (head dims are small)
  BATON_CHECK(half <= 512);
  rope_angles(pos, freqs, half, cs, sn, mscale);
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
// max + log Σ e^(x − max), the sum in double.
double log_sum_exp_scalar(const float* x, int n) {
  float mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(double(x[i]) - double(mx));
  return double(mx) + std::log(sum);
}
}  // namespace

// The gates compute silu(g) = g / (1 + e^-g), gelu_tanh(g) = 0.5 g (1 + tanh(z)) =
// g / (1 + e^-2z), z = sqrt(2/pi) (g + 0.044715 g^3), and gpt-oss's x / (1 + e^-αx) · (u' + 1) on
// the clamped x and u' (kernels/swiglu_oai.h): one exponential per element. The SIMD paths
// use their own exp (below, ~1 ulp) on every element, the tail included (masked), so an element's
// result depends only on its value, never on where it sits in the batch.
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluC = 0.044715f;

enum class Gate { Silu, Gelu, SwigluOai };

inline float silu_one(float g) { return g / (1.f + std::exp(-g)); }
inline float gelu_one(float g) { return g / (1.f + std::exp(-2.f * kGeluK * (g + kGeluC * g * g * g))); }
// std::min/max keep their first argument when a comparison with NaN is false: NaN stays NaN.
inline float swiglu_oai_one(float g, float u) {
  const float x = std::min(g, kSwigluOaiLimit), uc = std::max(std::min(u, kSwigluOaiLimit), -kSwigluOaiLimit);
  return x / (1.f + std::exp(-kSwigluOaiAlpha * x)) * (uc + 1.f);
}

template <Gate K>
void gate_scalar(const float* g, const float* u, float* y, int n) {
  for (int i = 0; i < n; ++i) {
    if constexpr (K == Gate::Silu) y[i] = silu_one(g[i]) * u[i];
    else if constexpr (K == Gate::Gelu) y[i] = gelu_one(g[i]) * u[i];
    else y[i] = swiglu_oai_one(g[i], u[i]);
  }
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
// gpt-oss's gate on the clamped values. min/max return their second operand when either is NaN,
// so with the constant first a NaN g or u stays NaN (as in swiglu_oai_one).
BATON_AVX2_FN inline __m256 swiglu_oai_avx2(__m256 g, __m256 u) {
  const __m256 lim = _mm256_set1_ps(kSwigluOaiLimit), one = _mm256_set1_ps(1.f);
  const __m256 x = _mm256_min_ps(lim, g);
  const __m256 uc = _mm256_max_ps(_mm256_set1_ps(-kSwigluOaiLimit), _mm256_min_ps(lim, u));
  const __m256 e = exp_avx2(_mm256_mul_ps(_mm256_set1_ps(-kSwigluOaiAlpha), x));
  return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_add_ps(uc, one));
}
BATON_AVX512_FN inline __m512 swiglu_oai_avx512(__m512 g, __m512 u) {
  const __m512 lim = _mm512_set1_ps(kSwigluOaiLimit), one = _mm512_set1_ps(1.f);
  const __m512 x = _mm512_min_ps(lim, g);
  const __m512 uc = _mm512_max_ps(_mm512_set1_ps(-kSwigluOaiLimit), _mm512_min_ps(lim, u));
  const __m512 e = exp_avx512(_mm512_mul_ps(_mm512_set1_ps(-kSwigluOaiAlpha), x));
  return _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_add_ps(uc, one));
}

// One vector of a gate's output from its g and u vectors.
template <Gate K>
BATON_AVX2_FN inline __m256 gate8(__m256 g, __m256 u) {
  if constexpr (K == Gate::Silu) return _mm256_mul_ps(silu_avx2(g), u);
  else if constexpr (K == Gate::Gelu) return _mm256_mul_ps(gelu_avx2(g), u);
  else return swiglu_oai_avx2(g, u);
}
template <Gate K>
BATON_AVX512_FN inline __m512 gate16(__m512 g, __m512 u) {
  if constexpr (K == Gate::Silu) return _mm512_mul_ps(silu_avx512(g), u);
  else if constexpr (K == Gate::Gelu) return _mm512_mul_ps(gelu_avx512(g), u);
  else return swiglu_oai_avx512(g, u);
}

template <Gate K>
BATON_AVX2_FN void gate_avx2(const float* g, const float* u, float* y, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, gate8<K>(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), idx);
    _mm256_maskstore_ps(y + i, m, gate8<K>(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m)));
  }
}

template <Gate K>
BATON_AVX512_FN void gate_avx512(const float* g, const float* u, float* y, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, gate16<K>(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, gate16<K>(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i)));
  }
}
// The largest lane, and the sum of the lanes (halves, then pairs, then neighbours).
BATON_AVX2_FN inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
BATON_AVX2_FN inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The largest of n floats in 8 lanes (tail masked to -inf), reduced.
BATON_AVX2_FN inline float max_avx2(const float* x, int n) {
  const int body = n & ~7;
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mv = ninf;
  for (int i = 0; i < body; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  if (body < n) {
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - body), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + body, tail), _mm256_castsi256_ps(tail)));
  }
  return hmax8(mv);
}

// The largest of n floats in 16 lanes (tail masked to -inf), reduced.
BATON_AVX512_FN inline float max_avx512(const float* x, int n) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 mv = ninf;
  int i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(x + i));
  if (i < n) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, __mmask16((1u << (n - i)) - 1), x + i));
  return _mm512_reduce_max_ps(mv);
}

// Softmax with the SIMD exp: max, exponentials and their sum in 8 lanes (tail masked), one scale.
BATON_AVX2_FN void softmax_avx2(float* x, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int body = n & ~7;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - body), idx);
  const __m256 mx = _mm256_set1_ps(max_avx2(x, n));
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
  const __m256 inv = _mm256_set1_ps(1.f / hsum8(sum));
  for (int i = 0; i < body; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  if (body < n) _mm256_maskstore_ps(x + body, tail, _mm256_mul_ps(_mm256_maskload_ps(x + body, tail), inv));
}

// Softmax with the SIMD exp: max, exponentials and their sum in 16 lanes (tail masked), one scale.
BATON_AVX512_FN void softmax_avx512(float* x, int n) {
  const __m512 mx = _mm512_set1_ps(max_avx512(x, n));
  const __mmask16 tail = __mmask16((1u << (n & 15)) - 1);
  __m512 sum = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
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

// log_sum_exp with the SIMD exp: the lanes' float sums go into a double every 1024 values (64 per
// lane, each ≤ 1: float keeps them to ~1e-7 relative).
BATON_AVX2_FN double log_sum_exp_avx2(const float* x, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int body = n & ~7;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - body), idx);
  const float m = max_avx2(x, n);
  const __m256 mx = _mm256_set1_ps(m);
  double total = 0;
  for (int i = 0; i < body;) {
    __m256 sum = _mm256_setzero_ps();
    for (const int end = std::min(body, i + 1024); i < end; i += 8)
      sum = _mm256_add_ps(sum, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mx)));
    total += double(hsum8(sum));
  }
  if (body < n)
    total += double(hsum8(_mm256_and_ps(exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(x + body, tail), mx)),
                                        _mm256_castsi256_ps(tail))));
  return double(m) + std::log(total);
}

BATON_AVX512_FN double log_sum_exp_avx512(const float* x, int n) {
  const int body = n & ~15;
  const __mmask16 tail = __mmask16((1u << (n - body)) - 1);
  const float m = max_avx512(x, n);
  const __m512 mx = _mm512_set1_ps(m);
  double total = 0;
  for (int i = 0; i < body;) {
    __m512 sum = _mm512_setzero_ps();
    for (const int end = std::min(body, i + 1024); i < end; i += 16)
      sum = _mm512_add_ps(sum, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx)));
    total += double(_mm512_reduce_add_ps(sum));
  }
  if (body < n)
    total += double(_mm512_reduce_add_ps(
        _mm512_maskz_mov_ps(tail, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + body), mx)))));
  return double(m) + std::log(total);
}
#pragma GCC diagnostic pop
#endif

}  // namespace

double log_sum_exp(const float* x, int n) {
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx512) return log_sum_exp_avx512(x, n);
  if (active_isa() >= Isa::Avx2) return log_sum_exp_avx2(x, n);
#endif
  return log_sum_exp_scalar(x, n);
}

void softmax(float* x, int n) {
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx512) return softmax_avx512(x, n);
  if (active_isa() >= Isa::Avx2) return softmax_avx2(x, n);
#endif
  softmax_scalar(x, n);
}

namespace {
template <Gate K>
void gate(const float* g, const float* u, float* y, int n) {
#if defined(__x86_64__) || defined(__i386__)
  const Isa isa = active_isa();
  if (isa >= Isa::Avx512) return gate_avx512<K>(g, u, y, n);
  if (isa >= Isa::Avx2) return gate_avx2<K>(g, u, y, n);
#endif
  gate_scalar<K>(g, u, y, n);
}
}  // namespace

void silu_gate(const float* g, const float* u, float* y, int n) { gate<Gate::Silu>(g, u, y, n); }
void gelu_tanh_gate(const float* g, const float* u, float* y, int n) { gate<Gate::Gelu>(g, u, y, n); }
void swiglu_oai_gate(const float* g, const float* u, float* y, int n) { gate<Gate::SwigluOai>(g, u, y, n); }

void add(float* y, const float* x, int n, float s) {
  if (s == 1.f) {
    for (int i = 0; i < n; ++i) y[i] += x[i];
  } else {
    for (int i = 0; i < n; ++i) y[i] += s * x[i];
  }
}

void scale(float* y, float s, int n) {
  for (int i = 0; i < n; ++i) y[i] *= s;
}

void moe_route(float* logits, int n_expert, int k, bool renorm, int32_t* ids, float* weights) {
  bool any = false;
  for (int e = 0; e < n_expert; ++e) {
    if (std::isnan(logits[e])) logits[e] = -INFINITY;  // (every ISA's softmax then agrees)
    any = any || logits[e] > -INFINITY;
  }
  if (!any) {
    for (int i = 0; i < k; ++i) ids[i] = -1, weights[i] = 0.f;
    return;
  }
  softmax(logits, n_expert);
  const int found = top_k(logits, n_expert, k, ids, weights);
  for (int i = found; i < k; ++i) ids[i] = -1, weights[i] = 0.f;
  if (!renorm) return;
  float sum = 0.f;
  for (int i = 0; i < k; ++i) sum += weights[i];
  sum = std::max(sum, 6.103515625e-5f);
  for (int i = 0; i < k; ++i) weights[i] /= sum;
}

void moe_group(const int32_t* ids, const float* w, int n, int k, int n_expert, int32_t* first, int32_t* rows,
               float* weights) {
  std::fill(first, first + n_expert + 1, 0);
  for (int i = 0; i < n * k; ++i)
    if (ids[i] >= 0) ++first[ids[i] + 1];
  for (int e = 0; e < n_expert; ++e) first[e + 1] += first[e];
  std::vector<int32_t> at(first, first + n_expert);
  for (int i = 0; i < n * k; ++i) {
    if (ids[i] < 0) continue;
    const int32_t j = at[size_t(ids[i])]++;
    rows[j] = i / k;
    weights[j] = w[i];
  }
}

void gather_rows(const float* x, const int32_t* rows, int m, int width, float* y) {
  for (int j = 0; j < m; ++j)
    std::memcpy(y + size_t(j) * width, x + size_t(rows[j]) * width, size_t(width) * sizeof(float));
}

void scatter_add_rows(float* acc, const float* y, const int32_t* rows, const float* w, bool sigmoid_w, int m, int width) {
  for (int j = 0; j < m; ++j) {
    const float f = sigmoid_w ? 1.f / (1.f + std::exp(-w[j])) : w[j];
    float* a = acc + size_t(rows ? rows[j] : j) * width;
    const float* d = y + size_t(j) * width;
    for (int i = 0; i < width; ++i) a[i] += f * d[i];
  }
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

// Attention inner loops over float tiles, picked by active_isa(): scalar, AVX2/FMA/F16C and
// AVX-512. They work on "rows": the (query token, query head) pairs of a task, all reading one
// KV head, so every K or V vector loaded feeds several rows. A row's result depends only on its
// own query and keys, never on how many rows share the call or where it sits among them.
struct AttnKernels {
  void (*cvt_f16)(const uint16_t* h, float* dst, int n);
  void (*cvt_q8_0)(const BlockQ8_0* b, float* dst, int n);  // d · q, exact on every ISA
  // For nr query rows q[r] (d floats each) against one K tile: s[r*ss + j] = scale * q_r·K[j], j < n.
  // A score's bits do not depend on n, nr or where the key sits in the tile.
  void (*scores)(const float* const* q, int nr, const float* K, int n, int d, float scale, float* s, size_t ss);
  // out[r] += sum_j p[r*ps + j] * V[j] for nr rows (V rows d apart): each output continues a chain
  // of FMAs in j order, so runs of keys in order have the bits of one call over all of them.
  void (*pv)(const float* p, size_t ps, int nr, const float* V, int n, int d, float* const* out);
  // One row's step of the online softmax over a chunk of kKeyChunk score slots, slots [v0, v1)
  // valid (v0 < v1): the running max m and sum l move to the chunk, p[slot] becomes
  // exp(s - m) on the valid slots and 0 on the others, and the factor the row's output and sum
  // must be scaled by is returned (0 on the row's first chunk, 1 when the max did not move). A
  // slot is a key's position mod kKeyChunk, so the arithmetic depends only on the row's keys.
  float (*chunk_softmax)(float* p, int v0, int v1, float& m, float& l);
};

constexpr int kQueryBlock = 32;  // query tokens sharing one conversion of their K/V rows
constexpr int kKeyChunk = 64;    // K/V rows converted (and used by every query of a block) at a time
// Floats between two rows of a task's chunk scores: 5 cache lines, an odd number, so that the
// rows a tile touches together fall in different L1 sets.
constexpr int kScoreStride = kKeyChunk + 16;

float chunk_softmax_scalar(float* p, int v0, int v1, float& m, float& l) {
  float mc = p[v0];
  for (int j = v0 + 1; j < v1; ++j) mc = std::max(mc, p[j]);
  const float mn = std::max(m, mc);
  const float c = m == -INFINITY ? 0.f : std::exp(m - mn);
  float sum = 0.f;
  for (int j = 0; j < kKeyChunk; ++j) {
    p[j] = j >= v0 && j < v1 ? std::exp(p[j] - mn) : 0.f;
    sum += p[j];
  }
  l = l * c + sum;
  m = mn;
  return c;
}

void cvt_f16_scalar(const uint16_t* h, float* dst, int n) {
  const float* f16 = fp16_table();
  for (int i = 0; i < n; ++i) dst[i] = f16[h[i]];
}

void cvt_q8_0_scalar(const BlockQ8_0* b, float* dst, int n) {
  const float* f16 = fp16_table();
  for (int blk = 0; blk < n / QK; ++blk) {
    const float d = f16[b[blk].d];
    for (int i = 0; i < QK; ++i) dst[blk * QK + i] = d * float(b[blk].qs[i]);
  }
}

void scores_scalar(const float* const* q, int nr, const float* K, int n, int d, float scale, float* s, size_t ss) {
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < n; ++j) s[size_t(r) * ss + j] = dot(q[r], K + size_t(j) * d, d) * scale;
}

void pv_scalar(const float* p, size_t ps, int nr, const float* V, int n, int d, float* const* out) {
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < n; ++j) axpy(out[r], p[size_t(r) * ps + j], V + size_t(j) * d, d);
}

#if defined(__x86_64__) || defined(__i386__)
BATON_AVX2_FN void cvt_q8_0_avx2(const BlockQ8_0* b, float* dst, int n) {
  const float* f16 = fp16_table();
  for (int blk = 0; blk < n / QK; ++blk) {
    const __m256 d = _mm256_set1_ps(f16[b[blk].d]);
    for (int i = 0; i < QK; i += 8) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[blk].qs + i));
      _mm256_storeu_ps(dst + blk * QK + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
    }
  }
}

BATON_AVX2_FN void cvt_f16_avx2(const uint16_t* h, float* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  const float* f16 = fp16_table();
  for (; i < n; ++i) dst[i] = f16[h[i]];
}

// The lane sums of 8 vectors at once: lane k of the result is ((x0 + x1) + (x2 + x3)) +
// ((x4 + x5) + (x6 + x7)) of v[k], the same tree for every k.
BATON_AVX2_FN inline __m256 reduce8(const __m256* v) {
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

// The lane sums of 4 vectors, by the same tree: lanes 0-3 of the result.
BATON_AVX2_FN inline __m128 reduce4(const __m256* v) {
  const __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1));
}

// Scores of R rows × KB keys (R·KB <= 12 accumulators), d % 8 == 0: per d-step R q loads and KB
// K loads feed R·KB FMAs. Every (row, key) sum is 8 lanes of FMAs along d folded by the tree of
// reduce8/reduce4, so its bits do not depend on R, KB or the tile.
template <int R, int KB>
BATON_AVX2_FN inline void scores_avx2_tile(const float* const* q, const float* K, int d, float scale, float* s, size_t ss) {
  static_assert(R * KB <= 12);
  __m256 acc[12];
  for (int a = 0; a < 12; ++a) acc[a] = _mm256_setzero_ps();
  const float* qr[R];
  for (int r = 0; r < R; ++r) qr[r] = q[r];
  for (int i = 0; i < d; i += 8) {
    __m256 qv[R];
    for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(qr[r] + i);
    for (int k = 0; k < KB; ++k) {
      const __m256 kv = _mm256_loadu_ps(K + size_t(k) * d + i);
      for (int r = 0; r < R; ++r) acc[r * KB + k] = _mm256_fmadd_ps(qv[r], kv, acc[r * KB + k]);
    }
  }
  alignas(32) float sums[12];
  const __m256 vs = _mm256_set1_ps(scale);
  _mm256_store_ps(sums, _mm256_mul_ps(reduce8(acc), vs));
  if (R * KB > 8) _mm_store_ps(sums + 8, _mm_mul_ps(reduce4(acc + 8), _mm256_castps256_ps128(vs)));
  for (int r = 0; r < R; ++r) std::memcpy(s + size_t(r) * ss, sums + r * KB, KB * sizeof(float));
}

template <int R>
BATON_AVX2_FN inline void scores_avx2_rows(const float* const* q, const float* K, int n, int d, float scale, float* s, size_t ss) {
  int j = 0;
  for (; j + 4 <= n; j += 4) scores_avx2_tile<R, 4>(q, K + size_t(j) * d, d, scale, s + j, ss);
  for (; j < n; ++j) scores_avx2_tile<R, 1>(q, K + size_t(j) * d, d, scale, s + j, ss);
}

void scores_avx2(const float* const* q, int nr, const float* K, int n, int d, float scale, float* s, size_t ss) {
  int r = 0;
  for (; r + 3 <= nr; r += 3) scores_avx2_rows<3>(q + r, K, n, d, scale, s + size_t(r) * ss, ss);
  if (nr - r == 2) scores_avx2_rows<2>(q + r, K, n, d, scale, s + size_t(r) * ss, ss);
  if (nr - r == 1) scores_avx2_rows<1>(q + r, K, n, d, scale, s + size_t(r) * ss, ss);
}

// P·V for R rows × W vectors of output (kept in registers over all n keys), d % 8 == 0: per key
// W V loads and R broadcasts feed R·W FMAs.
template <int R, int W>
BATON_AVX2_FN inline void pv_avx2_tile(const float* p, size_t ps, const float* V, int n, int d, int i, float* const* out) {
  __m256 acc[R * W];
  float* o[R];  // in locals: stores through out[r] would keep acc in memory (GCC 12)
  for (int r = 0; r < R; ++r) o[r] = out[r] + i;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) acc[r * W + c] = _mm256_loadu_ps(o[r] + 8 * c);
  for (int j = 0; j < n; ++j) {
    const float* v = V + size_t(j) * d + i;
    __m256 pr[R];
    for (int r = 0; r < R; ++r) pr[r] = _mm256_broadcast_ss(p + size_t(r) * ps + j);
    for (int c = 0; c < W; ++c) {
      const __m256 vv = _mm256_loadu_ps(v + 8 * c);
      for (int r = 0; r < R; ++r) acc[r * W + c] = _mm256_fmadd_ps(pr[r], vv, acc[r * W + c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(o[r] + 8 * c, acc[r * W + c]);
}

// The 3 × 4 tile written out: as an array (pv_avx2_tile<3, 4>) GCC 12 stores all 12 accumulators
// to the stack on every key. Same chains as the template.
BATON_AVX2_FN inline void pv_avx2_tile34(const float* p, size_t ps, const float* V, int n, int d, int i, float* const* out) {
  float *o0 = out[0] + i, *o1 = out[1] + i, *o2 = out[2] + i;
  __m256 a00 = _mm256_loadu_ps(o0), a01 = _mm256_loadu_ps(o0 + 8), a02 = _mm256_loadu_ps(o0 + 16), a03 = _mm256_loadu_ps(o0 + 24);
  __m256 a10 = _mm256_loadu_ps(o1), a11 = _mm256_loadu_ps(o1 + 8), a12 = _mm256_loadu_ps(o1 + 16), a13 = _mm256_loadu_ps(o1 + 24);
  __m256 a20 = _mm256_loadu_ps(o2), a21 = _mm256_loadu_ps(o2 + 8), a22 = _mm256_loadu_ps(o2 + 16), a23 = _mm256_loadu_ps(o2 + 24);
  const float *p0 = p, *p1 = p + ps, *p2 = p + 2 * ps;
  for (int j = 0; j < n; ++j) {
    const float* v = V + size_t(j) * d + i;
    const __m256 b0 = _mm256_broadcast_ss(p0 + j), b1 = _mm256_broadcast_ss(p1 + j), b2 = _mm256_broadcast_ss(p2 + j);
    __m256 vv = _mm256_loadu_ps(v);
    a00 = _mm256_fmadd_ps(b0, vv, a00), a10 = _mm256_fmadd_ps(b1, vv, a10), a20 = _mm256_fmadd_ps(b2, vv, a20);
    vv = _mm256_loadu_ps(v + 8);
    a01 = _mm256_fmadd_ps(b0, vv, a01), a11 = _mm256_fmadd_ps(b1, vv, a11), a21 = _mm256_fmadd_ps(b2, vv, a21);
    vv = _mm256_loadu_ps(v + 16);
    a02 = _mm256_fmadd_ps(b0, vv, a02), a12 = _mm256_fmadd_ps(b1, vv, a12), a22 = _mm256_fmadd_ps(b2, vv, a22);
    vv = _mm256_loadu_ps(v + 24);
    a03 = _mm256_fmadd_ps(b0, vv, a03), a13 = _mm256_fmadd_ps(b1, vv, a13), a23 = _mm256_fmadd_ps(b2, vv, a23);
  }
  _mm256_storeu_ps(o0, a00), _mm256_storeu_ps(o0 + 8, a01), _mm256_storeu_ps(o0 + 16, a02), _mm256_storeu_ps(o0 + 24, a03);
  _mm256_storeu_ps(o1, a10), _mm256_storeu_ps(o1 + 8, a11), _mm256_storeu_ps(o1 + 16, a12), _mm256_storeu_ps(o1 + 24, a13);
  _mm256_storeu_ps(o2, a20), _mm256_storeu_ps(o2 + 8, a21), _mm256_storeu_ps(o2 + 16, a22), _mm256_storeu_ps(o2 + 24, a23);
}

template <int R>
BATON_AVX2_FN inline void pv_avx2_rows(const float* p, size_t ps, const float* V, int n, int d, float* const* out) {
  int i = 0;
  for (; i + 32 <= d; i += 32) {
    if constexpr (R == 3) pv_avx2_tile34(p, ps, V, n, d, i, out);
    else pv_avx2_tile<R, 4>(p, ps, V, n, d, i, out);
  }
  for (; i < d; i += 8) pv_avx2_tile<R, 1>(p, ps, V, n, d, i, out);
}

void pv_avx2(const float* p, size_t ps, int nr, const float* V, int n, int d, float* const* out) {
  int r = 0;
  for (; r + 3 <= nr; r += 3) pv_avx2_rows<3>(p + size_t(r) * ps, ps, V, n, d, out + r);
  if (nr - r == 2) pv_avx2_rows<2>(p + size_t(r) * ps, ps, V, n, d, out + r);
  if (nr - r == 1) pv_avx2_rows<1>(p + size_t(r) * ps, ps, V, n, d, out + r);
}

// The online-softmax step on AVX2: the slots in 8 vectors, invalid ones masked (to -inf for the
// max, to 0 after the exp); the chunk's sum by one fixed tree over the 8 vectors and their lanes.
BATON_AVX2_FN float chunk_softmax_avx2(float* p, int v0, int v1, float& m, float& l) {
  static_assert(kKeyChunk == 64);
  const __m256i lo = _mm256_set1_epi32(v0 - 1), hi = _mm256_set1_epi32(v1);
  const auto valid = [lo, hi](int k) BATON_AVX2_FN {  // the mask of slots 8k..8k+7 inside [v0, v1)
    const __m256i slot = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * k));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(slot, lo), _mm256_cmpgt_epi32(hi, slot)));
  };
  const bool all = v0 == 0 && v1 == kKeyChunk;
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mv = ninf;
  for (int k = 0; k < 8; ++k) {
    const __m256 x = _mm256_loadu_ps(p + 8 * k);
    mv = _mm256_max_ps(mv, all ? x : _mm256_blendv_ps(ninf, x, valid(k)));
  }
  const float mn = std::max(m, hmax8(mv));
  const __m256 vmn = _mm256_set1_ps(mn);
  __m256 t0 = _mm256_setzero_ps(), t1 = t0;
  for (int k = 0; k < 8; k += 2) {  // the sum: ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    __m256 e[2];
    for (int u = 0; u < 2; ++u) {
      const int kk = k + u;
      if (all) e[u] = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + 8 * kk), vmn));
      else if (8 * kk + 7 >= v0 && 8 * kk < v1)
        e[u] = _mm256_and_ps(exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + 8 * kk), vmn)), valid(kk));
      else e[u] = _mm256_setzero_ps();
      _mm256_storeu_ps(p + 8 * kk, e[u]);
    }
    const __m256 pair = _mm256_add_ps(e[0], e[1]);
    if (k == 0) t0 = pair;
    else if (k == 2) t0 = _mm256_add_ps(t0, pair);
    else if (k == 4) t1 = pair;
    else t1 = _mm256_add_ps(t1, pair);
  }
  const float c = m == -INFINITY ? 0.f : _mm256_cvtss_f32(exp_avx2(_mm256_set1_ps(m - mn)));
  l = l * c + hsum8(_mm256_add_ps(t0, t1));
  m = mn;
  return c;
}

// AVX-512, register-blocked over up to 4 rows: every K or V vector loaded feeds NH rows. Each row
// keeps its own accumulators and summation order, so its result is the same whatever NH is.
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
  const uint8_t* const* V;  // F16 rows, as the cache's bytes
  const uint16_t* operator()(int j) const { return reinterpret_cast<const uint16_t*>(V[j]); }
  void prefetch(int j, int n, int i, int w) const {
    if (j + kRowsAhead < n) prefetch_row((*this)(j + kRowsAhead) + i, w);
  }
};
BATON_AVX512_FN inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
BATON_AVX512_FN inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// d % 16 == 0. Output slices of W vectors per row stay in registers over all n keys: W V loads
// and NH broadcasts per W·NH FMAs, each output's chain continuing from out.
template <int NH, int W, class Rows>
BATON_AVX512_FN void pv_avx512_slice(const float* p, size_t ps, Rows V, int n, int i, float* const* out) {
  __m512 acc[NH][W];
  float* o[NH];  // in locals: stores through out[h] would keep acc in memory (GCC 12)
  for (int h = 0; h < NH; ++h) o[h] = out[h] + i;
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < W; ++c) acc[h][c] = _mm512_loadu_ps(o[h] + 16 * c);
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
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(o[h] + 16 * c, acc[h][c]);
}

template <int NH, class Rows>
BATON_AVX512_FN void pv_avx512_nh(const float* p, size_t ps, Rows V, int n, int d, float* const* out) {
  int i = 0;
  for (; i + 64 <= d; i += 64) pv_avx512_slice<NH, 4>(p, ps, V, n, i, out);
  for (; i < d; i += 16) pv_avx512_slice<NH, 1>(p, ps, V, n, i, out);
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

// Scores of NH query rows against the keys of one KV head, d % 16 == 0. Keys go in blocks of
// KB (NH·KB <= 16 accumulators): each K vector loaded feeds NH rows, and a block's NH·KB dot
// products are reduced together by reduce16. Per (row, key) the FMAs run along d in order and
// end in the same reduction, so a score's bits do not depend on NH, on the block, or on whether
// the rows are a float tile or F16 cache rows read in place (decode).
template <int NH, class Rows>
BATON_AVX512_FN void scores_avx512_nh(const float* const* q, Rows K, int n, int d, float scale, float* s, size_t ss) {
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
      for (int h = 0; h < NH; ++h) qv[h] = _mm512_loadu_ps(q[h] + i);
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
      for (int h = 0; h < NH; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q[h] + i), kv, acc[h]);
    }
    for (int h = 0; h < NH; ++h) s[size_t(h) * ss + j] = _mm512_reduce_add_ps(acc[h]) * scale;
  }
}

#pragma GCC diagnostic pop

template <class Rows>
void scores_rows(const float* const* q, int nr, Rows K, int n, int d, float scale, float* s, size_t ss) {
  for (; nr >= 4; nr -= 4, q += 4, s += 4 * ss) scores_avx512_nh<4>(q, K, n, d, scale, s, ss);
  if (nr == 3) scores_avx512_nh<3>(q, K, n, d, scale, s, ss);
  if (nr == 2) scores_avx512_nh<2>(q, K, n, d, scale, s, ss);
  if (nr == 1) scores_avx512_nh<1>(q, K, n, d, scale, s, ss);
}
void scores_avx512(const float* const* q, int nr, const float* K, int n, int d, float scale, float* s, size_t ss) {
  scores_rows(q, nr, FloatRows{K, d}, n, d, scale, s, ss);
}
template <class Rows>
void pv_rows(const float* p, size_t ps, int nr, Rows V, int n, int d, float* const* out) {
  for (; nr >= 4; nr -= 4, p += 4 * ps, out += 4) pv_avx512_nh<4>(p, ps, V, n, d, out);
  if (nr == 3) pv_avx512_nh<3>(p, ps, V, n, d, out);
  if (nr == 2) pv_avx512_nh<2>(p, ps, V, n, d, out);
  if (nr == 1) pv_avx512_nh<1>(p, ps, V, n, d, out);
}
void pv_avx512(const float* p, size_t ps, int nr, const float* V, int n, int d, float* const* out) {
  pv_rows(p, ps, nr, FloatRows{V, d}, n, d, out);
}
void scores_f16(const float* const* q, int nr, const uint8_t* const* K, int n, int d, float scale, float* s, size_t ss) {
  scores_rows(q, nr, F16Rows{K}, n, d, scale, s, ss);
}
void pv_f16(const float* p, size_t ps, int nr, const uint8_t* const* V, int n, int d, float* const* out) {
  pv_rows(p, ps, nr, F16Rows{V}, n, d, out);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// The online-softmax step on AVX-512: the slots in 4 vectors under masks, the chunk's sum by one
// fixed tree ((x0 + x1) + (x2 + x3), then _mm512_reduce_add_ps).
BATON_AVX512_FN float chunk_softmax_avx512(float* p, int v0, int v1, float& m, float& l) {
  static_assert(kKeyChunk == 64);
  const uint64_t bits = (v1 >= 64 ? ~uint64_t(0) : (uint64_t(1) << v1) - 1) & ~((uint64_t(1) << v0) - 1);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 x[4];
  __m512 mv = ninf;
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm512_loadu_ps(p + 16 * k);
    mv = _mm512_mask_max_ps(mv, __mmask16(bits >> (16 * k)), mv, x[k]);
  }
  const float mn = std::max(m, _mm512_reduce_max_ps(mv));
  const __m512 vmn = _mm512_set1_ps(mn);
  for (int k = 0; k < 4; ++k) {
    const __mmask16 mk = __mmask16(bits >> (16 * k));
    x[k] = mk ? _mm512_maskz_mov_ps(mk, exp_avx512(_mm512_sub_ps(x[k], vmn))) : _mm512_setzero_ps();
    _mm512_storeu_ps(p + 16 * k, x[k]);
  }
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(x[0], x[1]), _mm512_add_ps(x[2], x[3])));
  const float c = m == -INFINITY ? 0.f : _mm_cvtss_f32(_mm512_castps512_ps128(exp_avx512(_mm512_set1_ps(m - mn))));
  l = l * c + sum;
  m = mn;
  return c;
}
#pragma GCC diagnostic pop
#endif

AttnKernels attn_kernels(int dk, int dv) {
#if defined(__x86_64__) || defined(__i386__)
  if (active_isa() >= Isa::Avx512 && dk % 16 == 0 && dv % 16 == 0)
    return {cvt_f16_avx2, cvt_q8_0_avx2, scores_avx512, pv_avx512, chunk_softmax_avx512};
  if (active_isa() >= Isa::Avx2 && dk % 8 == 0 && dv % 8 == 0)
    return {cvt_f16_avx2, cvt_q8_0_avx2, scores_avx2, pv_avx2, chunk_softmax_avx2};
#endif
  (void)dk, (void)dv;
  return {cvt_f16_scalar, cvt_q8_0_scalar, scores_scalar, pv_scalar, chunk_softmax_scalar};
}

}  // namespace

void attention_scores(const float* q, int nh, const float* K, int n, int d, float scale, float* s) {
  std::vector<const float*> rows(static_cast<size_t>(nh));
  for (int h = 0; h < nh; ++h) rows[size_t(h)] = q + size_t(h) * d;
  attn_kernels(d, d).scores(rows.data(), nh, K, n, d, scale, s, size_t(n));
}

namespace {

// dst[n] = one head of one position in the cache's `type`, as floats.
inline void load_head(const AttnKernels& kern, GgmlType type, const uint8_t* head, int n, float* dst) {
  if (type == GgmlType::F16) kern.cvt_f16(reinterpret_cast<const uint16_t*>(head), dst, n);
  else kern.cvt_q8_0(reinterpret_cast<const BlockQ8_0*>(head), dst, n);  // Q8_0
}

// The denominator of a row's output, accumulated against its online softmax's final max m and sum
// l: l; with an attention sink (one more logit that takes probability mass and adds no value)
// l + e^(sink − m), which is the one correction a last chunk holding just the sink would make:
// acc·c / (l·c + e^(sink − M)) with M = max(m, sink), c = e^(m − M), divided through by c (a term
// that overflows to inf gives 0, the limit). The CUDA kernels' softmax_denom.
inline float softmax_denom(float m, float l, const float* sink) { return sink ? l + std::exp(*sink - m) : l; }

}  // namespace

uint64_t attention_thread_bytes(int n_rep, int head_dim_k, int head_dim_v) {
  // One chunk of K and V as floats, and per row (a query block's n_rep heads) its chunk of scores,
  // running max and sum, and a query and an output pointer; the F16 decode path's 2 × kKeyChunk
  // row pointers. None of it grows with the context.
  const uint64_t rows = uint64_t(kQueryBlock) * uint64_t(n_rep);
  return sizeof(float) * (uint64_t(kKeyChunk) * uint64_t(head_dim_k + head_dim_v) + rows * (kScoreStride + 2)) +
         2 * sizeof(void*) * (rows + kKeyChunk);
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
    BATON_CHECK(lo >= first - kv.n_cells);  // every older position is still in the ring
    // Head g of position j: a staged row of the batch, or the cache.
    auto key_at = [&](int j) {
      return j >= first ? a.k_new + size_t(row0 + j - first) * kv.k_row + size_t(g) * kv.k_head_bytes() : kv.k_at(s, g, j);
    };
    auto val_at = [&](int j) {
      return j >= first ? a.v_new + size_t(row0 + j - first) * kv.v_row + size_t(g) * kv.v_head_bytes() : kv.v_at(s, g, j);
    };

    const int nq = t1 - t0, H = heads_per_task, nr = nq * H;
    thread_local std::vector<float> buf;
    thread_local std::vector<const float*> qrow;
    thread_local std::vector<float*> orow;
    buf.resize(size_t(kKeyChunk) * (dk + dv) + size_t(nr) * (kScoreStride + 2));
    BATON_CHECK(buf.size() * sizeof(float) + 2 * sizeof(void*) * (size_t(nr) + kKeyChunk) <=
                attention_thread_bytes(n_rep, dk, dv));
    float* ktile = buf.data();                      // [kKeyChunk][dk]: the keys of one chunk
    float* vtile = ktile + size_t(kKeyChunk) * dk;  // [kKeyChunk][dv]
    float* sc = vtile + size_t(kKeyChunk) * dv;     // [nr][kScoreStride]: row i's slot c is key cb + c
    float* run_max = sc + size_t(nr) * kScoreStride;
    float* run_sum = run_max + nr;
    // The task's rows: (query token, head) pairs, token-major, all reading KV head g. Row i is
    // query t0 + i / H, head h0 + i % H.
    qrow.resize(size_t(nr));
    orow.resize(size_t(nr));
    for (int i = 0; i < nr; ++i) {
      const int t = t0 + i / H, h = h0 + i % H;
      qrow[size_t(i)] = a.q + size_t(t) * a.q_stride + size_t(h) * dk;
      orow[size_t(i)] = a.out + size_t(t) * a.out_stride + size_t(h) * dv;
      std::fill(orow[size_t(i)], orow[size_t(i)] + dv, 0.f);
      run_max[i] = -INFINITY;
      run_sum[i] = 0.f;
    }
    // A chunk's K rows, then its V rows (head g of each position), as pointers.
    thread_local std::vector<const uint8_t*> rows;
    rows.resize(2 * size_t(kKeyChunk));
#if defined(__x86_64__) || defined(__i386__)
    // One query over an F16 cache (decode) on AVX-512: the rows are read in place (vcvtph2ps
    // inside the dot products) instead of being converted into tiles first; same FMAs, same bits.
    const bool in_place = nq == 1 && kv.type == GgmlType::F16 && kern.scores == scores_avx512;
#endif

    // Key-major, one chunk of kKeyChunk positions at a time, the chunks aligned to multiples of
    // kKeyChunk: its K rows are converted and scored against every row of the task while they are
    // in L1, each row's online softmax moves to the chunk (its earlier output and sum rescaled
    // when its max grows), then the V rows are converted and added in. Every row takes the whole
    // chunk (the kernels block over rows and keys); the probabilities outside a row's own keys
    // are 0, exact no-ops in its FMA chains, and a slot is the key's position mod kKeyChunk, so a
    // row's result has the same bits in any block: alone (decode) or in a batch of any size.
    // Nothing held grows with the context.
    const size_t kh = kv.k_head_bytes(), vh = kv.v_head_bytes();
    const uint8_t* kbase = kv.n_cells > 0 ? kv.k_at(s, g, 0) : nullptr;
    const uint8_t* vbase = kv.n_cells > 0 ? kv.v_at(s, g, 0) : nullptr;
    for (int cb = lo / kKeyChunk * kKeyChunk; cb <= hi; cb += kKeyChunk) {
      const int j0 = std::max(cb, lo), j1 = std::min(cb + kKeyChunk - 1, hi);  // the chunk's positions
      const int cn = j1 - j0 + 1;
      float* s0 = sc + (j0 - cb);
      // The cached positions of (s, g) are consecutive rows of one run (a ring wraps once at
      // most): walk the cells instead of dividing per key; staged rows come from the batch.
      const int cached = std::max(0, std::min(j1 + 1, first) - j0);
      for (int j = 0, cell = cached > 0 ? j0 % kv.n_cells : 0; j < cached; ++j) {
        rows[size_t(j)] = kbase + size_t(cell) * kh;
        rows[size_t(kKeyChunk + j)] = vbase + size_t(cell) * vh;
        if (++cell == kv.n_cells) cell = 0;
      }
      for (int j = cached; j < cn; ++j) {
        rows[size_t(j)] = key_at(j0 + j);
        rows[size_t(kKeyChunk + j)] = val_at(j0 + j);
      }
#if defined(__x86_64__) || defined(__i386__)
      if (in_place) {
        // The chunk's rows into L2 up front: a decode step reads every row from DRAM once, and
        // a run this short ends before the hardware streamers ramp up.
        for (int j = 0; j < cn; ++j) {
          const char* kr = reinterpret_cast<const char*>(rows[size_t(j)]);
          const char* vr = reinterpret_cast<const char*>(rows[size_t(kKeyChunk + j)]);
          for (int b = 0; b < dk * 2; b += 64) _mm_prefetch(kr + b, _MM_HINT_T1);
          for (int b = 0; b < dv * 2; b += 64) _mm_prefetch(vr + b, _MM_HINT_T1);
        }
        scores_f16(qrow.data(), nr, rows.data(), cn, dk, a.scale, s0, kScoreStride);
      } else
#endif
      {
        for (int j = 0; j < cn; ++j) load_head(kern, kv.type, rows[size_t(j)], dk, ktile + size_t(j) * dk);
        kern.scores(qrow.data(), nr, ktile, cn, dk, a.scale, s0, kScoreStride);
      }
      for (int i = 0; i < nr; ++i) {
        const int t = t0 + i / H;
        const int v0 = std::max(lo_of(t), cb) - cb, v1 = std::min(a.pos[t], j1) - cb + 1;  // its slots
        float* p = sc + size_t(i) * kScoreStride;
        if (v0 >= v1) {  // none of its keys here: P·V adds zeros
          std::fill(p, p + kKeyChunk, 0.f);
          continue;
        }
        if (a.softcap > 0)  // Gemma 2: scores capped before the softmax (float tanh, as the CUDA kernels)
          for (int j = v0; j < v1; ++j) p[j] = a.softcap * std::tanh(p[j] / a.softcap);
        const float c = kern.chunk_softmax(p, v0, v1, run_max[i], run_sum[i]);
        if (c != 1.f) scale(orow[size_t(i)], c, dv);
      }
#if defined(__x86_64__) || defined(__i386__)
      if (in_place) {
        pv_f16(s0, kScoreStride, nr, rows.data() + kKeyChunk, cn, dv, orow.data());
        continue;
      }
#endif
      for (int j = 0; j < cn; ++j) load_head(kern, kv.type, rows[size_t(kKeyChunk + j)], dv, vtile + size_t(j) * dv);
      kern.pv(s0, kScoreStride, nr, vtile, cn, dv, orow.data());
    }
    for (int i = 0; i < nr; ++i)
      scale(orow[size_t(i)], 1.f / softmax_denom(run_max[i], run_sum[i], a.sinks ? a.sinks + h0 + i % H : nullptr), dv);
  });
}

}  // namespace baton::cpu
