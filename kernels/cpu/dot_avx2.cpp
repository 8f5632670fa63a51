// AVX2 kernels: 8-bit products with pmaddubsw (u8×s8 → s16 pairs) and pmaddwd. The sub-block
// scales ride along in pmaddwd for free. Compiled for AVX2 by the pragma below; only reached
// when the CPU reports AVX2, FMA and F16C (see detected_isa()).
#if defined(__x86_64__)  // elsewhere detected_isa() is Scalar (stand-in tables: matmul.cpp)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/cpu/qkernels.h"

#pragma GCC target("avx2,fma,f16c")

namespace baton::cpu {
namespace {

struct O {
  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  static __m256i dot_scaled(__m256i acc, __m256i u, __m256i s, __m256i sc16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc16));
  }
};

}  // namespace

#include "kernels/cpu/dot_simd.inc"

namespace {

// Four activation bytes broadcast to every 32-bit lane.
__m256i bcast(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// Rows 0..n-1 (n ≤ 8) of each column's 8-lane result.
template <int NC>
void store_half(const __m256* acc, float* y, size_t ys, int n) {
  for (int c = 0; c < NC; c++) {
    float* out = y + size_t(c) * ys;
    if (n == 8) {
      _mm256_storeu_ps(out, acc[c]);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[c]);
      std::memcpy(out, tmp, size_t(n) * sizeof(float));
    }
  }
}

// ---- packed (row-interleaved) tiles, see packed.h ----
// An 8-lane vector holds half of a tile's 16 rows (bytes 0..31 of a 64-byte line are rows 0..7,
// bytes 32..63 rows 8..15). Per output the arithmetic is the AVX-512 kernel's and the portable
// one's: per block an exact integer sum (here pmaddubsw pairs added in 16 bits, then pmaddwd;
// nothing saturates: u ≤ 31 against |q| ≤ 127), then f = float(s)·dx and acc = fma(f, d_r, acc)
// (Q4_1, Q5_1: acc = fma(m_r, dx·Σq, acc)), blocks in order: the same bits. Q8_0 moves each weight's sign
// onto the activation byte (psignb), so |w| ≤ 128 against |q| ≤ 127 fits as well and the sum
// needs no offset. Column passes and halves: tile_passes.
template <GgmlType T>
struct Packed2 {
  static constexpr bool kFive = T == GgmlType::Q5_0 || T == GgmlType::Q5_1;
  static constexpr bool kMin = T == GgmlType::Q4_1 || T == GgmlType::Q5_1;
  static constexpr size_t kTile = T == GgmlType::Q4_0 ? 288 : T == GgmlType::Q4_1 ? 320 : T == GgmlType::Q5_0 ? 352
                                : T == GgmlType::Q5_1 ? 384 : 544;
  static constexpr size_t kQs = T == GgmlType::Q4_1 ? 64 : T == GgmlType::Q5_0 ? 96 : T == GgmlType::Q5_1 ? 128 : 32;
  static constexpr size_t kQh = T == GgmlType::Q5_1 ? 64 : 32;  // the fifth-bit masks
  static constexpr int kOff = T == GgmlType::Q4_0 ? 8 : T == GgmlType::Q5_0 ? 16 : 0;  // Q8_0: signs, no offset
  // Tiles prefetched ahead, at every column count: one column too (decode), where the hardware
  // prefetcher alone left Q4_0 at ~55 GFLOP/s a thread and the prefetch makes it ~70 (session 24).
  static constexpr int64_t kAhead = 8;

  // Bit i of m as byte i: 0x10 where set (Q5_0/Q5_1's fifth bit), 0 elsewhere.
  static __m256i fifth_bits(uint32_t m) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(int(m)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
  }

  // Columns 0..NC-1 of halves H0..H0+NH-1 of one group; rows: the group's valid rows (1..16).
  template <int NC, int H0, int NH>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m256 acc[NH][NC];
    for (int h = 0; h < NH; h++)
      for (int c = 0; c < NC; c++) acc[h][c] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* t = tiles + size_t(b) * kTile;
      if (H0 == 0)
        for (size_t l = 0; l < kTile; l += 64) _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * kTile + l), _MM_HINT_T0);
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + b;
      for (int h = 0; h < NH; h++) {
        const uint8_t* qs = t + kQs + 32 * (H0 + h);
        __m256i s[NC];
        for (int c = 0; c < NC; c++) s[c] = kOff ? _mm256_set1_epi32(-kOff * x[c]->sum) : _mm256_setzero_si256();
        if constexpr (T == GgmlType::Q8_0) {
          for (int k = 0; k < 8; k++) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * k));
            const __m256i u = _mm256_sign_epi8(w, w);  // |w| (-128 reads as 128 unsigned)
            for (int c = 0; c < NC; c++)
              s[c] = _mm256_add_epi32(
                  s[c], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(bcast(x[c]->q + 4 * k), w)), ones));
          }
        } else {
          for (int k = 0; k < 4; k++) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * k));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if constexpr (kFive) {
              uint64_t mlo, mhi;
              std::memcpy(&mlo, t + kQh + 16 * k, 8);
              std::memcpy(&mhi, t + kQh + 8 + 16 * k, 8);
              lo = _mm256_or_si256(lo, fifth_bits(uint32_t(mlo >> (32 * (H0 + h)))));
              hi = _mm256_or_si256(hi, fifth_bits(uint32_t(mhi >> (32 * (H0 + h)))));
            }
            for (int c = 0; c < NC; c++) {
              const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast(x[c]->q + 4 * k)),
                                                     _mm256_maddubs_epi16(hi, bcast(x[c]->q + 16 + 4 * k)));
              s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(pairs, ones));
            }
          }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * (H0 + h))));
        for (int c = 0; c < NC; c++) {
          const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s[c]), _mm256_set1_ps(x[c]->d));
          acc[h][c] = _mm256_fmadd_ps(f, dw, acc[h][c]);
        }
        if constexpr (kMin) {
          const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * (H0 + h))));
          for (int c = 0; c < NC; c++) acc[h][c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x[c]->ds), acc[h][c]);
        }
      }
    }
    for (int h = 0; h < NH && rows > 8 * (H0 + h); h++)
      store_half<NC>(acc[h], y + size_t(8 * (H0 + h)), ys, std::min(8, rows - 8 * (H0 + h)));
  }
};

// Q4_K, Q5_K (tile layout in packed.h and at PackedK4 in dot_avx512.cpp), one half of the rows at a
// time, up to 4 columns per pass. Per output the AVX-512 kernel's operations: per 32-element block
// B an exact s = Σ u·q, then acc = fma(float(s)·dx, d·sc_B, acc) and acc = fma(−dmin·mn_B, dx·Σq,
// acc), blocks in order. The 16 row-scale vectors of a half go through the stack: 16 registers
// would leave none for the sums.
template <GgmlType T>
struct PackedK42 {
  static constexpr bool kFive = T == GgmlType::Q5_K;
  static constexpr size_t kTile = kFive ? 16 * sizeof(BlockQ5_K) : 16 * sizeof(BlockQ4_K);
  static constexpr size_t kQh = 256, kQs = kFive ? 768 : 256;
  // Tiles prefetched ahead (Q4_K one column: 52 -> 71 GFLOP/s a thread; Q5_K's compute-bound
  // decode gains nothing, so it prefetches from 3 columns on).
  static constexpr int64_t kAhead = 4;

  template <int I>
  static __m256 byte_u(__m256i v) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * I), _mm256_set1_epi32(0xFF)));
  }
  // Unsigned quants of Q4_K block b, line k, half h (Q4_K's loop over b stays a loop: unrolled, its
  // prompts ran 25 % slower, session 23), and Q5_K's low four bits.
  static __m256i quants(const uint8_t* t, int b, int k, int h) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i raw = load256(t + kQs + 64 * (8 * (b / 2) + k) + 32 * h);
    return b % 2 ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
  }
  // Unsigned quants of Q5_K block B, line k, half h, B known at compile time (the blocks unrolled:
  // +5 % decode and prompt): the fifth bits are bit B of each qh byte, shifted to bit 4 within
  // 16-bit lanes (no bit of the other byte reaches bit 4) and masked, two operations.
  template <int B>
  static __m256i quants5(const uint8_t* t, int k, int h) {
    const __m256i u = quants(t, B, k, h);  // the low four bits
    const __m256i qh = load256(t + kQh + 64 * k + 32 * h);
    const __m256i at4 = B <= 4 ? _mm256_slli_epi16(qh, 4 - B) : _mm256_srli_epi16(qh, B - 4);
    return _mm256_or_si256(u, _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
  }

  // The 16 row-scale vectors of half h of tile t, into dsc/nmn.
  static void row_scales(const uint8_t* t, int h, float (*dsc)[8], float (*nmn)[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi8(0x3F), m30 = _mm256_set1_epi8(0x30);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
    const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(),
                                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * h))));
    const __m256i v0 = load256(t + 64 + 32 * h), v1 = load256(t + 128 + 32 * h), v2 = load256(t + 192 + 32 * h);
    const __m256i sc_a = _mm256_and_si256(v0, m6), mn_a = _mm256_and_si256(v1, m6);
    const __m256i sc_b = _mm256_or_si256(_mm256_and_si256(v2, m4), _mm256_and_si256(_mm256_srli_epi32(v0, 2), m30));
    const __m256i mn_b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v2, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi32(v1, 2), m30));
    _mm256_store_ps(dsc[0], _mm256_mul_ps(d, byte_u<0>(sc_a)));
    _mm256_store_ps(dsc[1], _mm256_mul_ps(d, byte_u<1>(sc_a)));
    _mm256_store_ps(dsc[2], _mm256_mul_ps(d, byte_u<2>(sc_a)));
    _mm256_store_ps(dsc[3], _mm256_mul_ps(d, byte_u<3>(sc_a)));
    _mm256_store_ps(dsc[4], _mm256_mul_ps(d, byte_u<0>(sc_b)));
    _mm256_store_ps(dsc[5], _mm256_mul_ps(d, byte_u<1>(sc_b)));
    _mm256_store_ps(dsc[6], _mm256_mul_ps(d, byte_u<2>(sc_b)));
    _mm256_store_ps(dsc[7], _mm256_mul_ps(d, byte_u<3>(sc_b)));
    _mm256_store_ps(nmn[0], _mm256_mul_ps(ndmin, byte_u<0>(mn_a)));
    _mm256_store_ps(nmn[1], _mm256_mul_ps(ndmin, byte_u<1>(mn_a)));
    _mm256_store_ps(nmn[2], _mm256_mul_ps(ndmin, byte_u<2>(mn_a)));
    _mm256_store_ps(nmn[3], _mm256_mul_ps(ndmin, byte_u<3>(mn_a)));
    _mm256_store_ps(nmn[4], _mm256_mul_ps(ndmin, byte_u<0>(mn_b)));
    _mm256_store_ps(nmn[5], _mm256_mul_ps(ndmin, byte_u<1>(mn_b)));
    _mm256_store_ps(nmn[6], _mm256_mul_ps(ndmin, byte_u<2>(mn_b)));
    _mm256_store_ps(nmn[7], _mm256_mul_ps(ndmin, byte_u<3>(mn_b)));
  }

  // Columns 0..NC-1 of halves H0..H0+NH-1 (1 or 2 columns: both halves in one pass over the tiles).
  template <int NC, int H0, int NH>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m256 acc[NH][NC];
    for (int h = 0; h < NH; h++)
      for (int c = 0; c < NC; c++) acc[h][c] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    alignas(32) float dsc[NH][8][8], nmn[NH][8][8];
    for (int64_t sb = 0; sb < nb / 8; sb++) {
      const uint8_t* t = tiles + size_t(sb) * kTile;
      for (int h = 0; h < NH; h++) row_scales(t, H0 + h, dsc[h], nmn[h]);
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + 8 * sb;
      auto block = [&](int b, auto u) {
        if constexpr (H0 == 0 && (!kFive || NC > 2))  // an eighth of the tile kAhead tiles on, per block
          for (size_t l = 0; l < kTile / 8; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * kTile + (kTile / 8) * size_t(b) + l), _MM_HINT_T0);
        for (int h = 0; h < NH; h++) {
          __m256i s[NC];
          for (int c = 0; c < NC; c++) s[c] = _mm256_setzero_si256();
          for (int k = 0; k < 8; k += 2) {  // two lines' pairs add in 16 bits: 4 × 31 × 127 < 2^15
            const __m256i u0 = u(k, H0 + h), u1 = u(k + 1, H0 + h);
            for (int c = 0; c < NC; c++) {
              const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast(x[c][b].q + 4 * k)),
                                                     _mm256_maddubs_epi16(u1, bcast(x[c][b].q + 4 * k + 4)));
              s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(pairs, ones));
            }
          }
          const __m256 ds = _mm256_load_ps(dsc[h][b]), nm = _mm256_load_ps(nmn[h][b]);
          for (int c = 0; c < NC; c++) {
            const ActQ8_32s& xb = x[c][b];
            acc[h][c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[c]), _mm256_set1_ps(xb.d)), ds, acc[h][c]);
            acc[h][c] = _mm256_fmadd_ps(nm, _mm256_set1_ps(xb.ds), acc[h][c]);
          }
        }
      };
      if constexpr (kFive) {
        [&]<int... B>(std::integer_sequence<int, B...>) {
          (block(B, [&](int k, int h) { return quants5<B>(t, k, h); }), ...);
        }(std::make_integer_sequence<int, 8>{});
      } else {
        for (int b = 0; b < 8; b++) block(b, [&](int k, int h) { return quants(t, b, k, h); });
      }
    }
    for (int h = 0; h < NH && rows > 8 * (H0 + h); h++)
      store_half<NC>(acc[h], y + size_t(8 * (H0 + h)), ys, std::min(8, rows - 8 * (H0 + h)));
  }
};

// Bytes I and J of every row's dword of a scale line v as the high bytes of int16 pairs (low half:
// byte I, high: J; the low bytes zero): srai 8 gives the signed byte, srai 3 32 × it, srli 12 its
// high nibble.
template <int I, int J>
__m256i byte_pairs(__m256i v) {
  constexpr char z = char(0x80);
  const __m256i pat = _mm256_setr_epi8(z, I, z, J, z, 4 + I, z, 4 + J, z, 8 + I, z, 8 + J, z, 12 + I, z, 12 + J,  //
                                       z, I, z, J, z, 4 + I, z, 4 + J, z, 8 + I, z, 8 + J, z, 12 + I, z, 12 + J);
  return _mm256_shuffle_epi8(v, pat);
}
template <int I, int J, int S>
__m256i scale_pairs(__m256i v) {
  return _mm256_srai_epi16(byte_pairs<I, J>(v), S);
}

// Q6_K (tile layout in packed.h). Per output and 32-element block m the portable kernel's integer
// sum s = sc_2m·(Σ u·q − 32·Σq16_0) + sc_2m+1·(Σ u·q − 32·Σq16_1) over its two 16-element
// sub-blocks, exact in 32 bits, then acc = fma(float(s)·dx, d, acc), blocks in order. The int8
// sub-block scales ride in pmaddwd (each row's scale in both 16-bit halves of its dword), and the
// offsets take one pmaddwd per block and column: (−32·sc_2m, −32·sc_2m+1) against the activation
// block's two 16-bit sums. Two lines' pmaddubsw pairs add in 16 bits: 4 × 63 × 127 < 2^15.
struct PackedQ62 {
  static constexpr size_t kTile = 16 * sizeof(BlockQ6_K);
  static constexpr size_t kSc = 32, kQ = 288;
  static constexpr int64_t kAhead = 4;  // tiles prefetched ahead (a GEMV is memory bound)

  // Line k of block M (element half E = M / 4, P = M % 4) for row half R, as unsigned 6-bit values.
  template <int M>
  static __m256i quants(const uint8_t* t, int k, int R) {
    constexpr int E = M / 4, P = M % 4;
    const uint8_t* lines = t + kQ + 64 * (24 * E + 3 * k) + 32 * R;
    const __m256i ql = load256(lines + 64 * (P & 1)), qh = load256(lines + 128);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo, hb;
    if constexpr (P < 2) lo = _mm256_and_si256(ql, m4);
    else lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
    if constexpr (P == 0) hb = _mm256_slli_epi16(qh, 4);
    else if constexpr (P == 1) hb = _mm256_slli_epi16(qh, 2);
    else if constexpr (P == 2) hb = qh;
    else hb = _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
  }
  // Block M of row half R for columns 0..NC-1.
  template <int NC, int M>
  static void block(const uint8_t* t, int R, __m256 d, const ActQ8_32s* const* x, __m256* acc) {
    constexpr int I = 2 * (M % 2);
    const __m256i sv = load256(t + kSc + 64 * (M / 2) + 32 * R);
    const __m256i off = _mm256_sub_epi16(_mm256_setzero_si256(), scale_pairs<I, I + 1, 3>(sv));
    const __m256i sc0 = scale_pairs<I, I, 8>(sv), sc1 = scale_pairs<I + 1, I + 1, 8>(sv);
    __m256i s[NC];
    for (int c = 0; c < NC; c++) {
      int32_t both;
      std::memcpy(&both, x[c][M].sum16, 4);
      s[c] = _mm256_madd_epi16(off, _mm256_set1_epi32(both));
    }
    for (int k = 0; k < 8; k += 2) {
      const __m256i u0 = quants<M>(t, k, R), u1 = quants<M>(t, k + 1, R);
      const __m256i sc = k < 4 ? sc0 : sc1;
      for (int c = 0; c < NC; c++) {
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast(x[c][M].q + 4 * k)),
                                               _mm256_maddubs_epi16(u1, bcast(x[c][M].q + 4 * k + 4)));
        s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(pairs, sc));
      }
    }
    for (int c = 0; c < NC; c++)
      acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[c]), _mm256_set1_ps(x[c][M].d)), d, acc[c]);
  }

  template <int NC, int H0, int NH, int M>
  static void step(const uint8_t* t, const __m256* d, const ActQ8_32s* const* x, __m256 (*acc)[NC]) {
    if constexpr (H0 == 0)  // an eighth of the tile kAhead tiles on, per block
      for (size_t l = 0; l < kTile / 8; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * kTile + (kTile / 8) * M + l), _MM_HINT_T0);
    for (int h = 0; h < NH; h++) block<NC, M>(t, H0 + h, d[h], x, acc[h]);
    if constexpr (M < 7) step<NC, H0, NH, M + 1>(t, d, x, acc);
  }

  template <int NC, int H0, int NH>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m256 acc[NH][NC];
    for (int h = 0; h < NH; h++)
      for (int c = 0; c < NC; c++) acc[h][c] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
      const uint8_t* t = tiles + size_t(sb) * kTile;
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + 8 * sb;
      __m256 d[NH];
      for (int h = 0; h < NH; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * (H0 + h))));
      step<NC, H0, NH, 0>(t, d, x, acc);
    }
    for (int h = 0; h < NH && rows > 8 * (H0 + h); h++)
      store_half<NC>(acc[h], y + size_t(8 * (H0 + h)), ys, std::min(8, rows - 8 * (H0 + h)));
  }
};

// Q2_K and Q3_K (tile layout in packed.h). Block M = 4n + j of a super-block is bits 2j, 2j + 1 of
// quant lines 8n..8n+7 (Q3_K: bit M of the 8 hmask lines its bit 2, u = 0..7 for the value u − 4).
// Per output the portable kernel's integer sums over the two 16-element sub-blocks: Q3_K
// s = Σ_h sc_h·(Σ u·q − 4·Σq_h), as Q6_K's (the signed 6-bit scales unpacked once per tile); Q2_K
// s = Σ_h sc_h·Σ u·q and n = Σ_h mn_h·Σq_h from the 4-bit scale/min bytes. Then Q3_K acc =
// fma(float(s)·dx, d, acc), Q2_K acc = fma(fma(float(s), d, float(n)·(−dmin)), dx, acc) (one fma
// chain for both terms: 115 GFLOP/s against 90 with two), blocks in order. A sub-block's four
// lines add their pmaddubsw pairs in 16 bits (8 products: 8 × 7 × 127 < 2^15) and meet its scale in
// one pmaddwd. The lines of block 4n + j are re-read for each j (L1 hits).
template <GgmlType T>
struct PackedK23 {
  static constexpr bool kThree = T == GgmlType::Q3_K;
  static constexpr size_t kTile = kThree ? 16 * sizeof(BlockQ3_K) : 16 * sizeof(BlockQ2_K);
  static constexpr size_t kSc = kThree ? 32 : 64, kHm = 224, kQs = kThree ? 736 : 320;
  static constexpr int64_t kAhead = 4;  // tiles prefetched ahead, an eighth per block

  // Block 4N + J, line k, row half R: unsigned quants. N is a run-time int for Q2_K (the two halves
  // of the super-block share one copy of the code: GEMM +10 %) and a compile-time constant for
  // Q3_K (its bit 4N + J of the hmask lines then takes one constant shift: a run-time N cost 4 %).
  template <int J, class Nt>
  static __m256i quants(const uint8_t* t, Nt N, int k, int R) {
    const __m256i raw = load256(t + kQs + 64 * (8 * N + k) + 32 * R);
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * J), _mm256_set1_epi8(3));
    if constexpr (!kThree) {
      return lo;
    } else {
      constexpr int M = 4 * Nt::value + J;
      const __m256i hm = load256(t + kHm + 64 * k + 32 * R);
      __m256i at2;
      if constexpr (M <= 2) at2 = _mm256_slli_epi16(hm, 2 - M);
      else at2 = _mm256_srli_epi16(hm, M - 2);
      return _mm256_or_si256(lo, _mm256_and_si256(at2, _mm256_set1_epi8(4)));
    }
  }

  // Q3_K: row half R's 16 scales as 4 lines of signed bytes (line v: scales 4v..4v+3 of each row).
  static void scales3(const uint8_t* t, int R, __m256i* sc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    const __m256i l0 = load256(t + kSc + 32 * R), l1 = load256(t + kSc + 64 + 32 * R);
    const __m256i l2 = load256(t + kSc + 128 + 32 * R);
    auto make = [&](__m256i low, __m256i high) {
      return _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(low, m4), _mm256_and_si256(high, m30)), k32);
    };
    sc[0] = make(l0, _mm256_slli_epi16(l2, 4));
    sc[1] = make(l1, _mm256_slli_epi16(l2, 2));
    sc[2] = make(_mm256_srli_epi16(l0, 4), l2);
    sc[3] = make(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(l2, 2));
  }

  // Block M = 4N + J of row half R for columns 0..NC-1 (sv: the block's scale line; d, ndmin: the
  // rows' d and −dmin).
  template <int NC, int J, class Nt>
  static void block(const uint8_t* t, Nt N, int R, __m256i sv, __m256 d, __m256 ndmin, const ActQ8_32s* const* x,
                    __m256* acc) {
    constexpr int I = 2 * (J % 2);
    const int M = 4 * N + J;
    __m256i sc[2], s[NC], mn;
    for (int c = 0; c < NC; c++) s[c] = _mm256_setzero_si256();
    if constexpr (kThree) {
      sc[0] = scale_pairs<I, I, 8>(sv);
      sc[1] = scale_pairs<I + 1, I + 1, 8>(sv);
      const __m256i off = _mm256_sub_epi16(_mm256_setzero_si256(), scale_pairs<I, I + 1, 6>(sv));  // −4·sc
      for (int c = 0; c < NC; c++) {
        int32_t both;
        std::memcpy(&both, x[c][M].sum16, 4);
        s[c] = _mm256_madd_epi16(off, _mm256_set1_epi32(both));
      }
    } else {
      const __m256i m4 = _mm256_set1_epi16(0x0F);
      sc[0] = _mm256_and_si256(_mm256_srli_epi16(byte_pairs<I, I>(sv), 8), m4);
      sc[1] = _mm256_and_si256(_mm256_srli_epi16(byte_pairs<I + 1, I + 1>(sv), 8), m4);
      mn = _mm256_srli_epi16(byte_pairs<I, I + 1>(sv), 12);
    }
    for (int h = 0; h < 2; h++) {
      const __m256i u0 = quants<J>(t, N, 4 * h, R), u1 = quants<J>(t, N, 4 * h + 1, R);
      const __m256i u2 = quants<J>(t, N, 4 * h + 2, R), u3 = quants<J>(t, N, 4 * h + 3, R);
      for (int c = 0; c < NC; c++) {
        const int8_t* q = x[c][M].q + 16 * h;
        const __m256i p01 =
            _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast(q)), _mm256_maddubs_epi16(u1, bcast(q + 4)));
        const __m256i p23 =
            _mm256_add_epi16(_mm256_maddubs_epi16(u2, bcast(q + 8)), _mm256_maddubs_epi16(u3, bcast(q + 12)));
        s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(_mm256_add_epi16(p01, p23), sc[h]));
      }
    }
    for (int c = 0; c < NC; c++) {
      const __m256 dx = _mm256_set1_ps(x[c][M].d);
      if constexpr (kThree) {
        acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[c]), dx), d, acc[c]);
      } else {
        int32_t both;
        std::memcpy(&both, x[c][M].sum16, 4);
        const __m256 n = _mm256_cvtepi32_ps(_mm256_madd_epi16(mn, _mm256_set1_epi32(both)));
        const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), d, _mm256_mul_ps(n, ndmin));
        acc[c] = _mm256_fmadd_ps(w, dx, acc[c]);
      }
    }
  }

  template <int NC, int H0, int NH, int J, class Nt>
  static void step(const uint8_t* t, Nt N, const __m256* d, const __m256* ndmin, const __m256i (*sc3)[4],
                   const ActQ8_32s* const* x, __m256 (*acc)[NC]) {
    const int M = 4 * N + J;
    if constexpr (H0 == 0)
      for (size_t l = 0; l < kTile / 8; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * kTile + (kTile / 8) * size_t(M) + l), _MM_HINT_T0);
    for (int h = 0; h < NH; h++) {
      const __m256i sv = kThree ? sc3[h][M / 2] : load256(t + kSc + 64 * (M / 2) + 32 * (H0 + h));
      block<NC, J>(t, N, H0 + h, sv, d[h], ndmin[h], x, acc[h]);
    }
    if constexpr (J < 3) step<NC, H0, NH, J + 1>(t, N, d, ndmin, sc3, x, acc);
  }

  template <int NC, int H0, int NH>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m256 acc[NH][NC];
    for (int h = 0; h < NH; h++)
      for (int c = 0; c < NC; c++) acc[h][c] = _mm256_setzero_ps();
    __m256i sc3[NH][4];
    for (int64_t sb = 0; sb < nb / 8; sb++) {
      const uint8_t* t = tiles + size_t(sb) * kTile;
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + 8 * sb;
      __m256 d[NH], ndmin[NH];
      for (int h = 0; h < NH; h++) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * (H0 + h))));
        if constexpr (kThree) {
          ndmin[h] = _mm256_setzero_ps();
          scales3(t, H0 + h, sc3[h]);
        } else {
          const __m128i dmin = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * (H0 + h)));
          ndmin[h] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(dmin));
        }
      }
      if constexpr (kThree) {
        step<NC, H0, NH, 0>(t, std::integral_constant<int, 0>{}, d, ndmin, sc3, x, acc);
        step<NC, H0, NH, 0>(t, std::integral_constant<int, 1>{}, d, ndmin, sc3, x, acc);
      } else {
#pragma GCC unroll 1
        for (int N = 0; N < 2; N++) step<NC, H0, NH, 0>(t, N, d, ndmin, sc3, x, acc);
      }
    }
    for (int h = 0; h < NH && rows > 8 * (H0 + h); h++)
      store_half<NC>(acc[h], y + size_t(8 * (H0 + h)), ys, std::min(8, rows - 8 * (H0 + h)));
  }
};

// The formats whose nibbles index a table of 16 signed levels: IQ4_NL (Q4_0's tile), IQ4_XS (eight
// such blocks per tile) and MXFP4 (kMXFP4Values; 16 exponent bytes, then IQ4_NL's nibble lines;
// tile layouts in packed.h). A nibble line becomes signed levels by one pshufb; as for Q8_0 the
// level's sign moves onto the activation byte, so pmaddubsw multiplies |level| ≤ 127 by |q| ≤ 127.
// Two lines' pairs would overflow 16 bits (2 × 2 × 127 × 127), so each line goes through pmaddwd on
// its own. Per output the portable kernel's operations: per 32-element block s = Σ level·q, then
// acc = fma(float(s)·dx, w, acc) with w = d (IQ4_NL), d·(ls − 32) (IQ4_XS) or 2^(e − 128) (MXFP4),
// blocks in order.
template <GgmlType T>
struct PackedLevels2 {
  static constexpr bool XS = T == GgmlType::IQ4_XS, MX = T == GgmlType::MXFP4;
  static constexpr size_t kTile = XS ? 16 * sizeof(BlockIQ4_XS) : MX ? 16 * sizeof(BlockMXFP4) : 288;
  static constexpr size_t kQs = XS ? 128 : MX ? 16 : 32;
  static constexpr int kBlocks = XS ? 8 : 1;  // 32-element blocks per tile
  static constexpr int64_t kAhead = XS ? 4 : 8;  // tiles prefetched ahead, a block's share at a time
  static constexpr const int8_t* kLevels = MX ? kMXFP4Values : kIQ4Values;

  // The 8 row scales 2^(e − 128) of half h of an MXFP4 tile, exactly as mxfp4_scale: the float
  // exponent field e − 1, or the subnormal 0x00200000 << e for e = 0, 1.
  static __m256 mx_scales(const uint8_t* t, int h) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 8 * h)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }

  // The 8 row-scale vectors d·(ls_b − 32) of half h of an IQ4_XS tile.
  static void row_scales(const uint8_t* t, int h, float (*dsc)[8]) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
    const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * h)));
    const __m256i sl = load256(t + 64 + 32 * h);
    for (int b = 0; b < 8; b++) {
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(sl, 4 * b), _mm256_set1_epi32(0x0F));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(sh, 2 * b), _mm256_set1_epi32(0x03));
      const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
      _mm256_store_ps(dsc[b], _mm256_mul_ps(d, _mm256_cvtepi32_ps(ls)));
    }
  }

  template <int NC, int H0, int NH>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m256 acc[NH][NC];
    for (int h = 0; h < NH; h++)
      for (int c = 0; c < NC; c++) acc[h][c] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    alignas(32) float dsc[NH][8][8];
    for (int64_t i = 0; i < nb / kBlocks; i++) {
      const uint8_t* t = tiles + size_t(i) * kTile;
      if constexpr (XS)
        for (int h = 0; h < NH; h++) row_scales(t, H0 + h, dsc[h]);
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + kBlocks * i;
      for (int b = 0; b < kBlocks; b++) {
        if constexpr (H0 == 0)
          for (size_t l = 0; l < kTile / kBlocks; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * kTile + (kTile / kBlocks) * size_t(b) + l),
                         _MM_HINT_T0);
        for (int h = 0; h < NH; h++) {
          __m256i s[NC];
          for (int c = 0; c < NC; c++) s[c] = _mm256_setzero_si256();
          for (int k = 0; k < 4; k++) {
            const __m256i raw = load256(t + kQs + 64 * (4 * b + k) + 32 * (H0 + h));
            const __m256i lo = table_levels(kLevels, _mm256_and_si256(raw, m4));
            const __m256i hi = table_levels(kLevels, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
            const __m256i ulo = _mm256_sign_epi8(lo, lo), uhi = _mm256_sign_epi8(hi, hi);
            for (int c = 0; c < NC; c++) {
              const __m256i plo = _mm256_maddubs_epi16(ulo, _mm256_sign_epi8(bcast(x[c][b].q + 4 * k), lo));
              const __m256i phi = _mm256_maddubs_epi16(uhi, _mm256_sign_epi8(bcast(x[c][b].q + 16 + 4 * k), hi));
              s[c] = _mm256_add_epi32(s[c], _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones)));
            }
          }
          const __m256 w = XS   ? _mm256_load_ps(dsc[h][b])
                           : MX ? mx_scales(t, H0 + h)
                                : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * (H0 + h))));
          for (int c = 0; c < NC; c++)
            acc[h][c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[c]), _mm256_set1_ps(x[c][b].d)), w, acc[h][c]);
        }
      }
    }
    for (int h = 0; h < NH && rows > 8 * (H0 + h); h++)
      store_half<NC>(acc[h], y + size_t(8 * (H0 + h)), ys, std::min(8, rows - 8 * (H0 + h)));
  }
};

// F16, BF16 (tile layout in packed.h: line m holds elements 2m and 2m + 1 of the 16 rows, as the
// two 16-bit halves of each row's 32-bit lane; bytes 0..31 rows 0..7, 32..63 rows 8..15). Per
// output the portable kernel's operations: the even and the odd elements in two FMA chains, in
// element order, and the output their sum: the same bits. The chains stay interleaved as the tile
// has them: a half-line's 16 values widen to two vectors, rows 0-3 and rows 4-7 of the half, each
// row's even element then its odd one, and the activation pair x[2m], x[2m + 1] is one 8-byte
// broadcast; the end adds each lane pair (hadd) and puts the rows in order. Per half-line and
// column two FMAs and one broadcast load; F16 widens with two vcvtph2ps and no shuffle.
template <GgmlType T>
struct PackedFloat2 {
  static constexpr size_t kTile = 1024;

  static __m256 widen4(__m128i h) {  // 4 rows × (even, odd) as floats
    if constexpr (T == GgmlType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }

  template <int NC, int H0, int NH>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m256 lo[NH][NC], hi[NH][NC];  // rows 0-3, rows 4-7 of the half
    for (int h = 0; h < NH; h++)
      for (int c = 0; c < NC; c++) lo[h][c] = hi[h][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* t = tiles + size_t(b) * kTile;
      const double* x[NC];  // the activations as (even, odd) pairs
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const double*>(a + size_t(c) * as) + 16 * b;
      for (int m = 0; m < 16; m++) {
        for (int h = 0; h < NH; h++) {
          const uint8_t* line = t + 64 * m + 32 * (H0 + h);
          const __m256 w0 = widen4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
          const __m256 w1 = widen4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16)));
          for (int c = 0; c < NC; c++) {
            const __m256 xp = _mm256_castpd_ps(_mm256_broadcast_sd(x[c] + m));
            lo[h][c] = _mm256_fmadd_ps(w0, xp, lo[h][c]);
            hi[h][c] = _mm256_fmadd_ps(w1, xp, hi[h][c]);
          }
        }
      }
    }
    for (int h = 0; h < NH && rows > 8 * (H0 + h); h++) {
      __m256 sum[NC];
      for (int c = 0; c < NC; c++)  // [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order
        sum[c] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(lo[h][c], hi[h][c])), 0xD8));
      store_half<NC>(sum, y + size_t(8 * (H0 + h)), ys, std::min(8, rows - 8 * (H0 + h)));
    }
  }
};

// f(std::integral_constant<int, n>) for a run-time n in 1..N.
template <int N, class F>
void with_cols(int n, F&& f) {
  if constexpr (N > 1)
    if (n < N) return with_cols<N - 1>(n, f);
  f(std::integral_constant<int, N>{});
}

// A tile kernel K (K::run<NC, H0, NH>: columns 0..NC-1 of row halves H0..H0+NH-1) over any column
// count, in passes of up to kMaxCols columns (a call has at most kPackedMaxCols = 8): 1-2 columns take
// both halves per pass (one read of each tile), more one half of the rows at a time. From 5
// columns the sums and accumulators no longer fit the 16 ymm registers and the accumulators live
// on the stack (one load and store per block and column), but each unpacked line serves twice the
// columns of a 4-column pass: one thread, GEMM n=512, Q4_0 138-145 -> 151, Q8_0 102 -> 114, Q4_K
// 128-133 -> 146-150, Q5_K 104-108 -> 129, Q6_K 82 -> 105 GFLOP/s (docs/KERNELS.md).
template <class K, int kMaxCols = 8>
void tile_passes(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, int nc, float* y, size_t ys, int rows) {
  for (int c0 = 0; c0 < nc; c0 += kMaxCols) {
    const uint8_t* ac = a + size_t(c0) * as;
    float* yc = y + size_t(c0) * ys;
    with_cols<kMaxCols>(std::min(kMaxCols, nc - c0), [&](auto n) {
      constexpr int N = decltype(n)::value;
      if (N <= 2 && rows > 8) return K::template run<N, 0, 2>(nb, tiles, ac, as, yc, ys, rows);
      K::template run<N, 0, 1>(nb, tiles, ac, as, yc, ys, rows);
      if (rows > 8) K::template run<N, 1, 1>(nb, tiles, ac, as, yc, ys, rows);
    });
  }
}

KernelTable make_avx2_table() {
  KernelTable t = make_simd_table();
  t.packed[int(GgmlType::Q4_0)] = tile_passes<Packed2<GgmlType::Q4_0>>;
  t.packed[int(GgmlType::Q4_1)] = tile_passes<Packed2<GgmlType::Q4_1>>;
  t.packed[int(GgmlType::Q5_0)] = tile_passes<Packed2<GgmlType::Q5_0>>;
  t.packed[int(GgmlType::Q5_1)] = tile_passes<Packed2<GgmlType::Q5_1>>;
  t.packed[int(GgmlType::Q8_0)] = tile_passes<Packed2<GgmlType::Q8_0>>;
  t.packed[int(GgmlType::Q2_K)] = tile_passes<PackedK23<GgmlType::Q2_K>>;
  t.packed[int(GgmlType::Q3_K)] = tile_passes<PackedK23<GgmlType::Q3_K>>;
  t.packed[int(GgmlType::Q4_K)] = tile_passes<PackedK42<GgmlType::Q4_K>>;
  t.packed[int(GgmlType::Q5_K)] = tile_passes<PackedK42<GgmlType::Q5_K>>;
  t.packed[int(GgmlType::Q6_K)] = tile_passes<PackedQ62>;
  t.packed[int(GgmlType::IQ4_NL)] = tile_passes<PackedLevels2<GgmlType::IQ4_NL>>;
  t.packed[int(GgmlType::IQ4_XS)] = tile_passes<PackedLevels2<GgmlType::IQ4_XS>>;
  t.packed[int(GgmlType::MXFP4)] = tile_passes<PackedLevels2<GgmlType::MXFP4>>;
  // The float tiles at most 6 columns a pass: two accumulators per column and half must stay in the
  // 16 ymm registers, with an FMA a line each (the integer kernels add to theirs once per block).
  t.packed[int(GgmlType::F16)] = tile_passes<PackedFloat2<GgmlType::F16>, 6>;
  t.packed[int(GgmlType::BF16)] = tile_passes<PackedFloat2<GgmlType::BF16>, 6>;
  return t;
}

}  // namespace

const KernelTable& kernels_avx2() {
  static const KernelTable t = make_avx2_table();
  return t;
}

}  // namespace baton::cpu

#endif  // __x86_64__
