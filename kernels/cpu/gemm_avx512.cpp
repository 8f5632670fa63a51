// AVX-512 VNNI GEMM for the legacy 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): many
// activation columns against a chunk of weight rows. Compiled for AVX-512 by the pragma below;
// only reached when the CPU reports AVX-512 F/BW/VL/VNNI (see detected_isa()).
//
// Both sides are brought into one shape first, in groups of four blocks (128 elements):
//   weights (per row, unpacked once per call into a per-thread panel): signed 8-bit values s with
//     w = d·s (+ m), 64 bytes of elements 0..15 of blocks 0..3 ("lo"), 64 bytes of elements
//     16..31 ("hi"), the four d spread over the 128-bit quarters, −128·Σs per block, and m;
//   activations (per column, ActGemm32): q + 128 as unsigned bytes in the same order, d per
//     quarter, d·Σq per block.
// Then a block's dot product is two vpdpbusd (u8 activations × s8 weights, the −128·Σs bias as
// the starting value so the +128 cancels) whose int32 lanes, per quarter, belong to one block: one
// multiply of the two scale vectors and one FMA fold four blocks into 16 float accumulators. The
// microkernel holds R rows × C columns of those accumulators in registers, so each weight load
// serves C columns and each activation load R rows.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/qkernels.h"

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers; see dot_avx512.cpp

namespace baton::cpu {
namespace {

// Sum of 16 lanes. (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized.)
inline float sum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One group of four weight blocks of one row, unpacked.
struct WGroup {
  int8_t lo[64];
  int8_t hi[64];
  float d[16];     // block i's d in lanes 4i..4i+3
  int32_t bias[16];  // −128·Σs of block i in lane 4i
  float m[16];     // block i's m in lanes 4i..4i+3 (the _1 formats only)
};
static_assert(sizeof(WGroup) == 320);

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 packed bytes -> 32 bytes: the low nibbles, then the high nibbles.
inline __m256i nib32(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Byte i is 0x10 when bit i of `bits` is set.
inline __m256i fifth_bits(uint32_t bits) {
  return _mm256_maskz_set1_epi8(__mmask32(bits), 0x10);
}

// One block in element order as signed values s (w = d·s + m), with d and m.
template <GgmlType T>
inline __m256i block_values(const uint8_t* p, float& d, float& m) {
  m = 0;
  d = f16(p);
  if constexpr (T == GgmlType::Q4_0) {
    return _mm256_sub_epi8(nib32(p + 2), _mm256_set1_epi8(8));
  } else if constexpr (T == GgmlType::Q4_1) {
    m = f16(p + 2);
    return nib32(p + 4);
  } else if constexpr (T == GgmlType::Q5_0 || T == GgmlType::Q5_1) {
    const bool one = T == GgmlType::Q5_1;
    uint32_t qh;
    std::memcpy(&qh, p + (one ? 4 : 2), 4);
    const __m256i u = _mm256_or_si256(nib32(p + (one ? 8 : 6)), fifth_bits(qh));
    if constexpr (one) {
      m = f16(p + 2);
      return u;
    }
    return _mm256_sub_epi8(u, _mm256_set1_epi8(16));
  } else {  // Q8_0
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  }
}

// Unpack a row of nb blocks into (nb + 3) / 4 groups; a partial last group is zero-padded.
template <GgmlType T>
void unpack_row(const uint8_t* row, int64_t nb, WGroup* out) {
  constexpr size_t kBytes = T == GgmlType::Q4_0 ? 18 : T == GgmlType::Q4_1 ? 20 : T == GgmlType::Q5_0 ? 22
                            : T == GgmlType::Q5_1 ? 24 : 34;
  constexpr bool kMin = T == GgmlType::Q4_1 || T == GgmlType::Q5_1;
  const int64_t ng = (nb + 3) / 4;
  if (nb % 4) std::memset(&out[ng - 1], 0, sizeof(WGroup));
  for (int64_t b = 0; b < nb; b++) {
    WGroup& g = out[b / 4];
    const int i = int(b % 4);
    float d, m;
    const __m256i s = block_values<T>(row + size_t(b) * kBytes, d, m);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(g.lo + 16 * i), _mm256_castsi256_si128(s));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(g.hi + 16 * i), _mm256_extracti128_si256(s, 1));
    // Σs from the byte sums of s + 128 (vpsadbw works on unsigned bytes).
    const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(s, _mm256_set1_epi8(char(0x80))), _mm256_setzero_si256());
    const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
    const int32_t sum = int32_t(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
    _mm_storeu_ps(g.d + 4 * i, _mm_set1_ps(d));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(g.bias + 4 * i), _mm_setr_epi32(-128 * sum, 0, 0, 0));
    if constexpr (kMin) _mm_storeu_ps(g.m + 4 * i, _mm_set1_ps(m));
  }
}

// R weight rows (panel groups, `wg` groups apart) × C activation columns (`as` bytes apart) over
// ng groups: y[c·ys + r] = Σ w_r·x_c.
template <bool kMin, int R, int C>
void micro(const WGroup* w, int64_t wg, const uint8_t* a, size_t as, int64_t ng, float* y, size_t ys) {
  __m512 acc[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; g++) {
    __m512i xlo[C], xhi[C];
    __m512 xd[C];
    for (int c = 0; c < C; c++) {
      const auto* x = reinterpret_cast<const ActGemm32*>(a + size_t(c) * as) + g;
      xlo[c] = _mm512_loadu_si512(x->q);
      xhi[c] = _mm512_loadu_si512(x->q + 64);
      xd[c] = _mm512_loadu_ps(x->d);
    }
    for (int r = 0; r < R; r++) {
      const WGroup& wr = w[r * wg + g];
      const __m512i lo = _mm512_loadu_si512(wr.lo), hi = _mm512_loadu_si512(wr.hi);
      const __m512i bias = _mm512_loadu_si512(wr.bias);
      const __m512 wd = _mm512_loadu_ps(wr.d);
      for (int c = 0; c < C; c++) {
        __m512i p = _mm512_dpbusd_epi32(bias, xlo[c], lo);
        p = _mm512_dpbusd_epi32(p, xhi[c], hi);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd, xd[c]), acc[r][c]);
        if constexpr (kMin) {
          const auto* x = reinterpret_cast<const ActGemm32*>(a + size_t(c) * as) + g;
          acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(wr.m), _mm512_loadu_ps(x->ds), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) y[size_t(c) * ys + size_t(r)] = sum16(acc[r][c]);
}

// Edge tiles: the row and column counts picked at run time, each a compiled instance.
template <bool kMin, int R>
void micro_cols(int nc, const WGroup* w, int64_t wg, const uint8_t* a, size_t as, int64_t ng, float* y, size_t ys) {
  switch (nc) {
    case 1: return micro<kMin, R, 1>(w, wg, a, as, ng, y, ys);
    case 2: return micro<kMin, R, 2>(w, wg, a, as, ng, y, ys);
    case 3: return micro<kMin, R, 3>(w, wg, a, as, ng, y, ys);
    default: return micro<kMin, R, 4>(w, wg, a, as, ng, y, ys);
  }
}

template <bool kMin>
void micro_tile(int nr, int nc, const WGroup* w, int64_t wg, const uint8_t* a, size_t as, int64_t ng, float* y,
                size_t ys) {
  switch (nr) {
    case 1: return micro_cols<kMin, 1>(nc, w, wg, a, as, ng, y, ys);
    case 2: return micro_cols<kMin, 2>(nc, w, wg, a, as, ng, y, ys);
    case 3: return micro_cols<kMin, 3>(nc, w, wg, a, as, ng, y, ys);
    default: return micro_cols<kMin, 4>(nc, w, wg, a, as, ng, y, ys);
  }
}

constexpr int kR = 4, kC = 4;

// A chunk of rows against all n columns. The chunk's rows are unpacked into a per-thread panel
// (kept in L2); columns go in blocks whose activations stay in L2 while every row tile of the
// chunk passes over them, the row tile's panel (≤ 4 × ng × 320 bytes) staying in L1.
template <GgmlType T>
void gemm_rows(int64_t k, const uint8_t* w, size_t row_bytes, int64_t rows, const uint8_t* a, size_t as, int n,
               float* y, size_t ys) {
  constexpr bool kMin = T == GgmlType::Q4_1 || T == GgmlType::Q5_1;
  const int64_t nb = k / 32, ng = (nb + 3) / 4;
  thread_local std::vector<WGroup> panel;
  if (panel.size() < size_t(rows * ng)) panel.resize(size_t(rows * ng));
  for (int64_t r = 0; r < rows; r++) unpack_row<T>(w + size_t(r) * row_bytes, nb, panel.data() + r * ng);
  // Column blocks: about 256 KiB of activations.
  const int nblk = std::max(kC, int(256 * 1024 / std::max<size_t>(as, 1)) / kC * kC);
  for (int j0 = 0; j0 < n; j0 += nblk) {
    const int j1 = std::min(n, j0 + nblk);
    for (int64_t r = 0; r < rows; r += kR) {
      const int nr = int(std::min<int64_t>(kR, rows - r));
      for (int j = j0; j < j1; j += kC) {
        const int nc = std::min(kC, j1 - j);
        micro_tile<kMin>(nr, nc, panel.data() + r * ng, ng, a + size_t(j) * as, as, ng, y + size_t(j) * ys + size_t(r),
                         ys);
      }
    }
  }
}

}  // namespace

void add_gemm_avx512(KernelTable& t) {
  t.gemm[int(GgmlType::Q4_0)] = gemm_rows<GgmlType::Q4_0>;
  t.gemm[int(GgmlType::Q4_1)] = gemm_rows<GgmlType::Q4_1>;
  t.gemm[int(GgmlType::Q5_0)] = gemm_rows<GgmlType::Q5_0>;
  t.gemm[int(GgmlType::Q5_1)] = gemm_rows<GgmlType::Q5_1>;
  t.gemm[int(GgmlType::Q8_0)] = gemm_rows<GgmlType::Q8_0>;
}

}  // namespace baton::cpu
