// AVX-512 VNNI kernels: vpdpbusd sums four u8×s8 products into each int32 lane in one
// instruction, with no 16-bit saturation step. 256-bit vectors (AVX-512VL) match the 32-byte
// blocks of every format. Compiled for AVX-512 by the pragma below; only reached when the CPU
// reports AVX-512 F/BW/VL/VNNI (see detected_isa()).
#if defined(__x86_64__)  // elsewhere detected_isa() is Scalar (stand-in tables: matmul.cpp)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/qkernels.h"

#ifdef BATON_AVX512_EMULATED
#include "kernels/cpu/avx512_emulated.h"  // tests on an AVX2 machine: SIMDe, see there
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif
// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their _mm512_undefined_*
// placeholders); nothing in this file reads an uninitialized value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace baton::cpu {
namespace {

struct O {
  static __m256i dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
  // u ≤ 63 in every k-quant (IQ4_XS: |level| ≤ 127 against |s| ≤ 127), so the 16-bit pair sums
  // of pmaddubsw cannot saturate; vpdpwssd then applies the scales and accumulates in one
  // instruction.
  static __m256i dot_scaled(__m256i acc, __m256i u, __m256i s, __m256i sc16) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), sc16);
  }
};

}  // namespace

#include "kernels/cpu/dot_simd.inc"

namespace {

inline __m512i zext(__m256i v) { return _mm512_zextsi256_si512(v); }
inline __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m128 fp16x4(const uint8_t* p, size_t stride) {
  uint16_t h[4];
  for (int i = 0; i < 4; i++) std::memcpy(&h[i], p + size_t(i) * stride, 2);
  return _mm_cvtph_ps(_mm_setr_epi16(short(h[0]), short(h[1]), short(h[2]), short(h[3]), 0, 0, 0, 0));
}

// Q4_0 and Q4_1, four blocks per step in 512-bit vectors: the 128-bit quarters of `lo` hold the
// low nibbles of blocks 0..3 and those of `hi` the high nibbles, so two vpdpbusd leave block i's
// sum in quarter i and one FMA applies the four scales. A GEMV does little else per weight byte,
// so fewer instructions per block is what lifts it to memory speed.
template <GgmlType T>
struct Q4x4 {
  static constexpr size_t kBytes = T == GgmlType::Q4_0 ? 18 : 20;
  static constexpr int kQs = T == GgmlType::Q4_0 ? 2 : 4;

  template <int NC>
  static void run(int64_t n, const uint8_t* w, const uint8_t* a, size_t as, float* y, size_t ys) {
    const int64_t nb = n / 32;
    __m512 acc[NC];
    __m128 corr[NC];
    for (int c = 0; c < NC; c++) {
      acc[c] = _mm512_setzero_ps();
      corr[c] = _mm_setzero_ps();
    }
    const __m512i s_order = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
      const uint8_t* p = w + size_t(b) * kBytes;
      __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kQs)));
      raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBytes + kQs)), 1);
      raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * kBytes + kQs)), 2);
      raw = _mm512_inserti32x4(raw, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * kBytes + kQs)), 3);
      const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      const __m128 dw = fp16x4(p, kBytes);
      const __m128 mw = T == GgmlType::Q4_0 ? dw : fp16x4(p + 2, kBytes);  // Q4_0: −8·d applied at the end
      for (int c = 0; c < NC; c++) {
        const auto* x = reinterpret_cast<const ActQ8_32x4*>(a + size_t(c) * as) + b / 4;
        __m512i p32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x->q));
        p32 = _mm512_dpbusd_epi32(p32, hi, _mm512_loadu_si512(x->q + 64));
        const __m128 sc = _mm_mul_ps(dw, _mm_loadu_ps(x->d));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), _mm512_permutexvar_ps(s_order, _mm512_zextps128_ps512(sc)),
                                 acc[c]);
        corr[c] = _mm_fmadd_ps(mw, _mm_loadu_ps(x->ds), corr[c]);
      }
    }
    // The last 0..3 blocks, from the zero-padded last activation group.
    __m256 acc_t[NC];
    float corr_t[NC];
    for (int c = 0; c < NC; c++) {
      acc_t[c] = _mm256_setzero_ps();
      corr_t[c] = 0;
    }
    for (; b < nb; b++) {
      const uint8_t* p = w + size_t(b) * kBytes;
      const float d = h2f(p), m = T == GgmlType::Q4_0 ? -8.0f * d : h2f(p + 2);
      const __m256i u = nibbles(p + kQs);
      const int j = int(b % 4);
      for (int c = 0; c < NC; c++) {
        const auto* x = reinterpret_cast<const ActQ8_32x4*>(a + size_t(c) * as) + b / 4;
        const __m256i xv = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x->q + 64 + 16 * j)),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(x->q + 16 * j)));
        acc_t[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d[j]), _mm256_cvtepi32_ps(O::dot(u, xv)), acc_t[c]);
        corr_t[c] += m * x->ds[j];
      }
    }
    const float k = T == GgmlType::Q4_0 ? -8.0f : 1.0f;
    for (int c = 0; c < NC; c++) {
      __m128 cs = _mm_add_ps(corr[c], _mm_movehl_ps(corr[c], corr[c]));
      cs = _mm_add_ss(cs, _mm_movehdup_ps(cs));
      y[size_t(c) * ys] = _mm512_reduce_add_ps(acc[c]) + hsum(acc_t[c]) + k * _mm_cvtss_f32(cs) + corr_t[c];
    }
  }
};

// Q8_0, two blocks per 512-bit vector; |q| against the activations carrying q's sign.
struct Q8x2 {
  template <int NC>
  static void run(int64_t n, const uint8_t* w, const uint8_t* a, size_t as, float* y, size_t ys) {
    constexpr size_t kBytes = 34;
    const int64_t nb = n / 32;
    __m512 acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    const __m512i s_order = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const uint8_t* p0 = w + size_t(b) * kBytes;
      const uint8_t* p1 = p0 + kBytes;
      uint16_t h0, h1;
      std::memcpy(&h0, p0, 2);
      std::memcpy(&h1, p1, 2);
      const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(int(uint32_t(h0) | (uint32_t(h1) << 16))));
      const __m512i q = _mm512_inserti64x4(zext(load256(p0 + 2)), load256(p1 + 2), 1);
      const __m512i u = _mm512_abs_epi8(q);
      const __mmask64 neg = _mm512_movepi8_mask(q);
      for (int c = 0; c < NC; c++) {
        const ActQ8_32* x = act32(a, as, c) + b;
        __m512i xs = _mm512_inserti64x4(zext(load256(x[0].q)), load256(x[1].q), 1);
        xs = _mm512_mask_sub_epi8(xs, neg, _mm512_setzero_si512(), xs);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xs);
        const __m128 sc = _mm_mul_ps(dw, _mm_setr_ps(x[0].d, x[1].d, 0, 0));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(s_order, _mm512_zextps128_ps512(sc)),
                                 acc[c]);
      }
    }
    __m256 acc_t[NC];
    float corr_t[NC];
    for (int c = 0; c < NC; c++) {
      acc_t[c] = _mm256_setzero_ps();
      corr_t[c] = 0;
    }
    if (b < nb) Legacy<GgmlType::Q8_0>::template block<NC>(w + size_t(b) * kBytes, a, as, b, acc_t, corr_t);
    for (int c = 0; c < NC; c++) y[size_t(c) * ys] = _mm512_reduce_add_ps(acc[c]) + hsum(acc_t[c]);
  }
};

// Activations in groups of four blocks (ActQ8_32x4) for Q4x4.
void quant_q8_32x4(const float* x, int64_t n, void* out) {
  auto* o = static_cast<ActQ8_32x4*>(out);
  const int64_t nb = n / 32;
  for (int64_t g = 0; g < (nb + 3) / 4; g++) {
    std::memset(&o[g], 0, sizeof(ActQ8_32x4));
    for (int j = 0; j < 4 && 4 * g + j < nb; j++) {
      const float* xb = x + 32 * (4 * g + j);
      const float amax = amax_of(xb, 32);
      const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      __m256i s_lo, s_hi;
      const __m256i q = quant32(xb, _mm256_set1_ps(id), s_lo, s_hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o[g].q + 16 * j), _mm256_castsi256_si128(q));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o[g].q + 64 + 16 * j), _mm256_extracti128_si256(q, 1));
      o[g].d[j] = d;
      o[g].ds[j] = d * float(hsum_i32(_mm256_add_epi32(s_lo, s_hi)));
    }
  }
}

// ---- packed (row-interleaved) tiles, see packed.h ----
// Lane r of every vector is row r of the group. Per 32-element block and column: the integer sums
// start at −off·Σq and take 8 vpdpbusd against broadcast activation bytes (split over two chains
// when few columns give too little independent work), then one convert, one multiply by the
// activation scale and one FMA with the 16 row scales. The portable kernel does the same per output.
// The level formats (IQ4_NL, MXFP4, IQ4_XS: a nibble indexes signed levels) look their nibbles up
// as level + 128 with one vpshufb and take off = 128, as the portable kernel does; IQ4_XS is eight
// IQ4_NL blocks per tile with a scale d·(ls − 32) each, MXFP4's scale is 2^(e − 128).
template <GgmlType T>
struct Packed {
  static constexpr bool kMin = T == GgmlType::Q4_1 || T == GgmlType::Q5_1;
  static constexpr bool kFive = T == GgmlType::Q5_0 || T == GgmlType::Q5_1;
  static constexpr bool XS = T == GgmlType::IQ4_XS, MX = T == GgmlType::MXFP4;
  static constexpr bool kLevels = XS || MX || T == GgmlType::IQ4_NL;
  static constexpr int kBlocks = XS ? 8 : 1;  // 32-element blocks per tile
  static constexpr size_t kTile = T == GgmlType::Q4_0 || T == GgmlType::IQ4_NL ? 288
                                  : T == GgmlType::Q4_1                        ? 320
                                  : T == GgmlType::Q5_0                        ? 352
                                  : T == GgmlType::Q5_1                        ? 384
                                  : MX                                         ? 272
                                  : XS                                         ? 16 * sizeof(BlockIQ4_XS)
                                                                               : 544;
  static constexpr size_t kQs = T == GgmlType::Q4_1 ? 64
                                : T == GgmlType::Q5_0 ? 96
                                : T == GgmlType::Q5_1 || XS ? 128
                                : MX ? 16
                                     : 32;
  static constexpr size_t kMasks = T == GgmlType::Q5_1 ? 64 : 32;  // the fifth-bit masks (Q5_0, Q5_1)
  static constexpr int kOff = T == GgmlType::Q4_0 ? 8 : T == GgmlType::Q5_0 ? 16 : T == GgmlType::Q8_0 || kLevels ? 128 : 0;
  static constexpr int64_t kAhead = 8;  // tiles prefetched ahead (past the group's end too: the next group follows)
  static constexpr int64_t kAheadL2 = 24, kAheadL1 = 2;  // Q8_0

  static __m512i bcast(const int8_t* q) {
    int32_t v;
    std::memcpy(&v, q, 4);
    return _mm512_set1_epi32(v);
  }

  // The levels + 128 in each 128-bit lane (vpshufb looks up within lanes).
  static __m512i level_table() {
    uint8_t b[64];
    for (int i = 0; i < 64; i++) b[i] = uint8_t((MX ? kMXFP4Values : kIQ4Values)[i % 16] + 128);
    return load512(b);
  }

  // The 16 row scales of a tile's block: fp16 d; MXFP4 2^(e − 128) exactly as mxfp4_scale (float
  // exponent field e − 1, or the subnormal 0x00200000 << e for e = 0, 1); IQ4_XS d·(ls − 32).
  static __m512 row_scale(const uint8_t* t) {
    if constexpr (MX) {
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
      const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
      return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32(2), e), normal, sub));
    } else {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    }
  }
  static void xs_scales(const uint8_t* t, __m512* dsc) {
    const __m512 d = row_scale(t);
    const __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    const __m512i sl = load512(t + 64);
    for (int b = 0; b < 8; b++) {
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sl, 4 * b), _mm512_set1_epi32(0x0F));
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(sh, 2 * b), _mm512_set1_epi32(0x03));
      const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
      dsc[b] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls));
    }
  }

  template <int NC>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    constexpr bool kTwoChains = NC < 4;
    __m512 acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i levels = kLevels ? level_table() : _mm512_setzero_si512();
    for (int64_t i = 0; i < nb / kBlocks; i++) {
      const uint8_t* t = tiles + size_t(i) * kTile;
      if (NC >= 4) {  // several columns: a tile takes long enough for DRAM to lag the streamer
        if constexpr (T == GgmlType::Q8_0) {
          // Q8_0 needs 1.7x the bytes of Q4_1 per multiply: far ahead into L2, then just ahead
          // into L1 (8 columns, 1 thread, 32 MiB from DRAM: 168 -> 217 GFLOP/s, median of 5).
          for (size_t l = 0; l < kTile; l += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(t + kAheadL2 * kTile + l), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(t + kAheadL1 * kTile + l), _MM_HINT_T0);
          }
        } else if constexpr (!XS) {  // (IQ4_XS: a block's share at a time, below)
          for (size_t l = 0; l < kTile; l += 64) _mm_prefetch(reinterpret_cast<const char*>(t + kAhead * kTile + l), _MM_HINT_T0);
        }
      }
      __m512 dsc[kBlocks];
      if constexpr (XS) xs_scales(t, dsc);
      else dsc[0] = row_scale(t);
      for (int blk = 0; blk < kBlocks; blk++) {
        const uint8_t* qs = t + kQs + 256 * size_t(blk);
        if (XS && NC >= 4)  // 2 tiles on: 8 columns 6.7 -> 10.7 GB/s against a whole tile 8 on
          for (size_t l = 0; l < kTile / 8; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(t + 2 * kTile + (kTile / 8) * size_t(blk) + l), _MM_HINT_T0);
        const ActQ8_32s* x[NC];
        __m512i s0[NC], s1[NC];
        for (int c = 0; c < NC; c++) {
          x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + kBlocks * i + blk;
          s0[c] = kOff ? _mm512_set1_epi32(-kOff * x[c]->sum) : _mm512_setzero_si512();
          if (kTwoChains) s1[c] = _mm512_setzero_si512();
        }
        if constexpr (T == GgmlType::Q8_0) {
          const __m512i flip = _mm512_set1_epi8(char(0x80));
          for (int k = 0; k < 8; k++) {
            const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * k), flip);  // q + 128
            for (int c = 0; c < NC; c++) {
              __m512i& s = kTwoChains && k >= 4 ? s1[c] : s0[c];
              s = _mm512_dpbusd_epi32(s, u, bcast(x[c]->q + 4 * k));
            }
          }
        } else {
          for (int k = 0; k < 4; k++) {
            const __m512i raw = _mm512_loadu_si512(qs + 64 * k);
            __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            if constexpr (kFive) {
              uint64_t mlo, mhi;
              std::memcpy(&mlo, t + kMasks + 16 * k, 8);
              std::memcpy(&mhi, t + kMasks + 8 + 16 * k, 8);
              const __m512i b16 = _mm512_set1_epi8(0x10);
              lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(mlo), lo, b16);
              hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(mhi), hi, b16);
            }
            if constexpr (kLevels) {
              lo = _mm512_shuffle_epi8(levels, lo);
              hi = _mm512_shuffle_epi8(levels, hi);
            }
            for (int c = 0; c < NC; c++) {
              s0[c] = _mm512_dpbusd_epi32(s0[c], lo, bcast(x[c]->q + 4 * k));
              __m512i& s = kTwoChains ? s1[c] : s0[c];
              s = _mm512_dpbusd_epi32(s, hi, bcast(x[c]->q + 16 + 4 * k));
            }
          }
        }
        for (int c = 0; c < NC; c++) {
          const __m512i s = kTwoChains ? _mm512_add_epi32(s0[c], s1[c]) : s0[c];
          const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(x[c]->d));
          acc[c] = _mm512_fmadd_ps(f, dsc[blk], acc[c]);
        }
        if constexpr (kMin) {
          const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
          for (int c = 0; c < NC; c++) acc[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x[c]->ds), acc[c]);
        }
      }
    }
    const __mmask16 keep = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    for (int c = 0; c < NC; c++) _mm512_mask_storeu_ps(y + size_t(c) * ys, keep, acc[c]);
  }

  static void by_cols(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, int nc, float* y, size_t ys,
                      int rows) {
    switch (nc) {
      case 1: return run<1>(nb, tiles, a, as, y, ys, rows);
      case 2: return run<2>(nb, tiles, a, as, y, ys, rows);
      case 3: return run<3>(nb, tiles, a, as, y, ys, rows);
      case 4: return run<4>(nb, tiles, a, as, y, ys, rows);
      case 5: return run<5>(nb, tiles, a, as, y, ys, rows);
      case 6: return run<6>(nb, tiles, a, as, y, ys, rows);
      case 7: return run<7>(nb, tiles, a, as, y, ys, rows);
      default: return run<8>(nb, tiles, a, as, y, ys, rows);
    }
  }
};

// ---- packed k-quants: one tile per 16 rows × one 256-element super-block ----
// Each 32-element block of the super-block meets one activation block. The row scales (d, dmin,
// the sub-block scales and mins) become 16-lane float vectors once per tile, shared by every column.

inline __m512i bcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}
// Byte i (0..3) of every 32-bit lane as 16 floats, unsigned or signed.
template <int I>
inline __m512 byte_u(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * I), _mm512_set1_epi32(0xFF)));
}
template <int I>
inline __m512i byte_si(__m512i v) {
  return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * I), 24);
}
template <int I>
inline __m512 byte_s(__m512i v) {
  return _mm512_cvtepi32_ps(byte_si<I>(v));
}

// Q4_K, Q5_K. Tile: d[16], dmin[16] (fp16) | 3 lines of the 12 packed scale bytes | Q5_K: 8 lines of
// qh | 32 lines of qs (chunk c = lines 8c..8c+7: low nibbles block 2c, high nibbles block 2c+1).
// Per column and block: s = Σ u·q in integers (blocks 2c and 2c+1 are two independent chains),
// acc = fma(float(s)·dx, d·sc, acc), acc = fma(−dmin·mn, dx·Σq, acc); the portable kernel agrees.
template <GgmlType T>
struct PackedK4 {
  static constexpr bool kFive = T == GgmlType::Q5_K;
  static constexpr size_t kTile = kFive ? 16 * sizeof(BlockQ5_K) : 16 * sizeof(BlockQ4_K);
  static constexpr size_t kQh = 256, kQs = kFive ? 768 : 256;

  // Block B of the super-block (chunk B / 2, low nibbles for even B), unsigned 4- or 5-bit quants
  // of line k.
  template <int B>
  static __m512i quants(const uint8_t* t, int k) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i raw = load512(t + kQs + 64 * (8 * (B / 2) + k));
    __m512i u = B % 2 ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4) : _mm512_and_si512(raw, m4);
    if constexpr (kFive) {
      const __m512i qh = load512(t + kQh + 64 * k);
      u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(qh, _mm512_set1_epi8(char(1 << B))), u, _mm512_set1_epi8(0x10));
    }
    return u;
  }

  template <int NC, int B>
  static void finish(const ActQ8_32s* const* x, const __m512i* s, const __m512* dsc, const __m512* nmn, __m512* acc) {
    for (int c = 0; c < NC; c++) {
      const ActQ8_32s& xb = x[c][B];
      acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[c]), _mm512_set1_ps(xb.d)), dsc[B], acc[c]);
      acc[c] = _mm512_fmadd_ps(nmn[B], _mm512_set1_ps(xb.ds), acc[c]);
    }
  }

  // Blocks 2C and 2C + 1. Up to 4 columns both blocks' sums run together (two chains); with more,
  // one block at a time, since both sets of sums at once spill.
  template <int NC, int C>
  static void chunk(const uint8_t* t, const ActQ8_32s* const* x, const __m512* dsc, const __m512* nmn, __m512* acc) {
    if constexpr (NC <= 4) {
      __m512i s0[NC], s1[NC];
      for (int c = 0; c < NC; c++) s0[c] = s1[c] = _mm512_setzero_si512();
      for (int k = 0; k < 8; k++) {
        const __m512i lo = quants<2 * C>(t, k), hi = quants<2 * C + 1>(t, k);
        for (int c = 0; c < NC; c++) {
          s0[c] = _mm512_dpbusd_epi32(s0[c], lo, bcast4(x[c][2 * C].q + 4 * k));
          s1[c] = _mm512_dpbusd_epi32(s1[c], hi, bcast4(x[c][2 * C + 1].q + 4 * k));
        }
      }
      finish<NC, 2 * C>(x, s0, dsc, nmn, acc);
      finish<NC, 2 * C + 1>(x, s1, dsc, nmn, acc);
    } else {
      one<NC, 2 * C>(t, x, dsc, nmn, acc);
      one<NC, 2 * C + 1>(t, x, dsc, nmn, acc);
    }
  }

  template <int NC, int B>
  static void one(const uint8_t* t, const ActQ8_32s* const* x, const __m512* dsc, const __m512* nmn, __m512* acc) {
    __m512i s[NC];
    for (int c = 0; c < NC; c++) s[c] = _mm512_setzero_si512();
    for (int k = 0; k < 8; k++) {
      const __m512i u = quants<B>(t, k);
      for (int c = 0; c < NC; c++) s[c] = _mm512_dpbusd_epi32(s[c], u, bcast4(x[c][B].q + 4 * k));
    }
    finish<NC, B>(x, s, dsc, nmn, acc);
  }

  template <int NC>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m512 acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi8(0x3F), m30 = _mm512_set1_epi8(0x30);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
      const uint8_t* t = tiles + size_t(sb) * kTile;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
      const __m512 ndmin = _mm512_sub_ps(_mm512_setzero_ps(),
                                         _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32))));
      // Lane r of line k holds row r's scale bytes 4k..4k+3; bytes 0..3 of sc_a/mn_a are the scales
      // and mins of blocks 0..3, those of sc_b/mn_b of blocks 4..7 (the GGUF 6-bit packing).
      const __m512i v0 = load512(t + 64), v1 = load512(t + 128), v2 = load512(t + 192);
      const __m512i sc_a = _mm512_and_si512(v0, m6), mn_a = _mm512_and_si512(v1, m6);
      const __m512i sc_b = _mm512_or_si512(_mm512_and_si512(v2, m4), _mm512_and_si512(_mm512_srli_epi32(v0, 2), m30));
      const __m512i mn_b = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v2, 4), m4),
                                           _mm512_and_si512(_mm512_srli_epi32(v1, 2), m30));
      const __m512 dsc[8] = {_mm512_mul_ps(d, byte_u<0>(sc_a)), _mm512_mul_ps(d, byte_u<1>(sc_a)),
                             _mm512_mul_ps(d, byte_u<2>(sc_a)), _mm512_mul_ps(d, byte_u<3>(sc_a)),
                             _mm512_mul_ps(d, byte_u<0>(sc_b)), _mm512_mul_ps(d, byte_u<1>(sc_b)),
                             _mm512_mul_ps(d, byte_u<2>(sc_b)), _mm512_mul_ps(d, byte_u<3>(sc_b))};
      const __m512 nmn[8] = {_mm512_mul_ps(ndmin, byte_u<0>(mn_a)), _mm512_mul_ps(ndmin, byte_u<1>(mn_a)),
                             _mm512_mul_ps(ndmin, byte_u<2>(mn_a)), _mm512_mul_ps(ndmin, byte_u<3>(mn_a)),
                             _mm512_mul_ps(ndmin, byte_u<0>(mn_b)), _mm512_mul_ps(ndmin, byte_u<1>(mn_b)),
                             _mm512_mul_ps(ndmin, byte_u<2>(mn_b)), _mm512_mul_ps(ndmin, byte_u<3>(mn_b))};
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + 8 * sb;
      chunk<NC, 0>(t, x, dsc, nmn, acc);
      chunk<NC, 1>(t, x, dsc, nmn, acc);
      chunk<NC, 2>(t, x, dsc, nmn, acc);
      chunk<NC, 3>(t, x, dsc, nmn, acc);
    }
    const __mmask16 keep = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    for (int c = 0; c < NC; c++) _mm512_mask_storeu_ps(y + size_t(c) * ys, keep, acc[c]);
  }
};

// Q6_K. Tile: d[16] (fp16) | 4 lines of int8 scales | 48 quant lines, 24 per half h: for
// k = 0..7 the triple ql line 16h + k, ql line 16h + 8 + k, qh line 8h + k. Block m (h = m / 4,
// p = m % 4) takes ql lines 16h + 8·(p & 1) + k (low nibbles for p < 2, high otherwise) and qh
// lines 8h + k (bits 2p, 2p + 1 as bits 4, 5). Per column and 32-element block m, in integers:
// s = Σ sc·(−32·Σq16 + Σ u·q) over its two 16-element sub-blocks, then acc = fma(float(s)·dx, d, acc),
// blocks in order; the portable kernel agrees. Memory order matters here: read in any other order than the
// layout's, a GEMV fell from ~14 to ~7 GB/s. Registers too: with 8 columns, the sums of all four
// blocks of a half live at once spilled and halved the GEMM speed; the per-block form keeps two
// sub-blocks' sums (24 registers with the accumulators; since the integer scales of session 21,
// not measured: that machine had no AVX-512).
struct PackedQ6K {
  static constexpr size_t kTile = 16 * sizeof(BlockQ6_K);
  static constexpr size_t kSc = 32, kQ = 288;
  // One and two columns (memory bound) ask for their lines 3 tiles ahead: one thread, 128 MiB,
  // five alternating runs each, 24.9–27.7 GB/s against 21.5–25.4 at 6 (session 37; 2 and 4 between).
  static constexpr size_t kAhead = 3;

  // Quant line k of block p of the tile's half H, as unsigned 6-bit values (ql: the block's ql
  // line, qh: its qh line).
  template <int P>
  static __m512i quants(__m512i ql, __m512i qh) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i lo = P < 2 ? _mm512_and_si512(ql, m4) : _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
    __m512i hb;
    if constexpr (P == 0) hb = _mm512_slli_epi16(qh, 4);
    else if constexpr (P == 1) hb = _mm512_slli_epi16(qh, 2);
    else if constexpr (P == 2) hb = qh;
    else hb = _mm512_srli_epi16(qh, 2);
    return _mm512_ternarylogic_epi32(lo, hb, m30, 0xF8);  // lo | (hb & 0x30)
  }
  static const uint8_t* ql_line(const uint8_t* t, int h, int p, int k) {
    return t + kQ + 64 * (24 * h + 3 * k + (p & 1));
  }
  static const uint8_t* qh_line(const uint8_t* t, int h, int k) { return t + kQ + 64 * (24 * h + 3 * k + 2); }

  // −32·Σq16 of both halves in every lane: the two int16 sums broadcast as one dword, and one
  // vpmaddwd each (cheaper than two scalar-to-vector broadcasts).
  static void offsets(const ActQ8_32s& x, __m512i& sa, __m512i& sb) {
    int32_t both;
    std::memcpy(&both, x.sum16, 4);
    const __m512i v = _mm512_set1_epi32(both);
    sa = _mm512_madd_epi16(v, _mm512_set1_epi32(0x0000FFE0));  // (−32, 0)
    sb = _mm512_madd_epi16(v, _mm512_set1_epi32(int32_t(0xFFE00000u)));  // (0, −32)
  }

  // The same sums for the four blocks of half H at once, every line loaded once (few columns:
  // 8 sums per column fit the registers). Integer sums are exact, so the bits are the same.
  template <int NC, int H>
  static void half_sums(const uint8_t* t, const ActQ8_32s* const* x, __m512i (*sa)[NC], __m512i (*sb)[NC]) {
    for (int p = 0; p < 4; p++)
      for (int c = 0; c < NC; c++) offsets(x[c][4 * H + p], sa[p][c], sb[p][c]);
    for (int k = 0; k < 8; k++) {
      for (int i = 0; i < 3; i++)  // this k's three lines, kAhead tiles on
        _mm_prefetch(reinterpret_cast<const char*>(ql_line(t, H, 0, k) + kAhead * kTile + 64 * i), _MM_HINT_T0);
      const __m512i la = load512(ql_line(t, H, 0, k)), lb = load512(ql_line(t, H, 1, k));
      const __m512i h = load512(qh_line(t, H, k));
      const __m512i u[4] = {quants<0>(la, h), quants<1>(lb, h), quants<2>(la, h), quants<3>(lb, h)};
      for (int p = 0; p < 4; p++)
        for (int c = 0; c < NC; c++) {
          __m512i& s = k < 4 ? sa[p][c] : sb[p][c];
          s = _mm512_dpbusd_epi32(s, u[p], bcast4(x[c][4 * H + p].q + 4 * k));
        }
    }
  }

  // Block M's two sub-block sums scaled in integers (sc·s, exact), then one fma with d.
  template <int NC, int M>
  static void apply(const uint8_t* t, __m512 d, const ActQ8_32s* const* x, const __m512i* sa, const __m512i* sb,
                    __m512* acc) {
    // Sub-block scales 2M and 2M + 1: bytes 2·(M % 2) and 2·(M % 2) + 1 of scale line M / 2.
    const __m512i sv = load512(t + kSc + 64 * (M / 2));
    const __m512i sca = byte_si<2 * (M % 2)>(sv), scb = byte_si<2 * (M % 2) + 1>(sv);
    for (int c = 0; c < NC; c++) {
      const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(sa[c], sca), _mm512_mullo_epi32(sb[c], scb));
      acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(x[c][M].d)), d, acc[c]);
    }
  }

  // The sums of sub-block S of block M (with many columns only one block's sums are live at a
  // time: two blocks' spill at 8 columns).
  template <int NC, int M, int S>
  static void sub_sums(const uint8_t* t, const ActQ8_32s* const* x, __m512i* s) {
    constexpr int H = M / 4, P = M % 4;
    for (int c = 0; c < NC; c++) {
      int32_t both;
      std::memcpy(&both, x[c][M].sum16, 4);
      s[c] = _mm512_madd_epi16(_mm512_set1_epi32(both), _mm512_set1_epi32(S ? int32_t(0xFFE00000u) : 0x0000FFE0));
    }
    for (int k = 4 * S; k < 4 * S + 4; k++) {
      const __m512i u = quants<P>(load512(ql_line(t, H, P, k)), load512(qh_line(t, H, k)));
      for (int c = 0; c < NC; c++) s[c] = _mm512_dpbusd_epi32(s[c], u, bcast4(x[c][M].q + 4 * k));
    }
  }

  template <int NC, int M>
  static void block(const uint8_t* t, __m512 d, const ActQ8_32s* const* x, __m512* acc) {
    __m512i sa[NC], sb[NC];
    sub_sums<NC, M, 0>(t, x, sa);
    sub_sums<NC, M, 1>(t, x, sb);
    apply<NC, M>(t, d, x, sa, sb, acc);
  }

  template <int NC, int H>
  static void half(const uint8_t* t, __m512 d, const ActQ8_32s* const* x, __m512* acc) {
    if constexpr (NC <= 2) {
      __m512i sa[4][NC], sb[4][NC];
      half_sums<NC, H>(t, x, sa, sb);
      apply<NC, 4 * H + 0>(t, d, x, sa[0], sb[0], acc);
      apply<NC, 4 * H + 1>(t, d, x, sa[1], sb[1], acc);
      apply<NC, 4 * H + 2>(t, d, x, sa[2], sb[2], acc);
      apply<NC, 4 * H + 3>(t, d, x, sa[3], sb[3], acc);
    } else {
      block<NC, 4 * H + 0>(t, d, x, acc);
      block<NC, 4 * H + 1>(t, d, x, acc);
      block<NC, 4 * H + 2>(t, d, x, acc);
      block<NC, 4 * H + 3>(t, d, x, acc);
    }
  }

  template <int NC>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m512 acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
      const uint8_t* t = tiles + size_t(sb) * kTile;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + 8 * sb;
      half<NC, 0>(t, d, x, acc);
      half<NC, 1>(t, d, x, acc);
    }
    const __mmask16 keep = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    for (int c = 0; c < NC; c++) _mm512_mask_storeu_ps(y + size_t(c) * ys, keep, acc[c]);
  }
};

// Q2_K and Q3_K (tile layouts in packed.h). Block M = 4N + J of a super-block is bits 2J, 2J + 1
// of qs lines 8N..8N+7, its 16-element sub-blocks lines 8N..8N+3 and 8N+4..8N+7; Q3_K's third bit
// is bit M of hmask line k (u = 0..7 for the value u − 4). The four blocks of a half share their
// lines: with few columns each line is loaded once and serves all four (as Q6_K's halves). Per
// column and block the portable kernel's integer sums, exact in any order: Q3_K s = Σ_h sc_h·(Σ u·q
// − 4·Σq_h) with the signed 6-bit scales unpacked once per tile into four lines of bytes, Q2_K
// s = Σ_h sc_h·Σ u·q and n = Σ_h mn_h·Σq_h (one vpmaddwd of the (mn, mn') pair against the two
// 16-element sums); then acc = fma(float(s)·dx, d, acc) (Q3_K) or acc = fma(fma(float(s), d,
// float(n)·(−dmin)), dx, acc) (Q2_K), blocks in order.
template <GgmlType T>
struct PackedK23 {
  static constexpr bool kThree = T == GgmlType::Q3_K;
  static constexpr size_t kTile = kThree ? 16 * sizeof(BlockQ3_K) : 16 * sizeof(BlockQ2_K);
  static constexpr size_t kSc = kThree ? 32 : 64, kHm = 224, kQs = kThree ? 736 : 320;
  static constexpr size_t kAhead = 6;  // tiles prefetched ahead

  // At qs line i (0..15) the i-th sixteenth of the tile kAhead tiles on (two lines cover it).
  static void prefetch(const uint8_t* t, int i) {
    const size_t o = kAhead * kTile + ((kTile * size_t(i) / 16) & ~size_t(63));
    _mm_prefetch(reinterpret_cast<const char*>(t + o), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + o + 64), _MM_HINT_T0);
  }

  // Block 4N + J's unsigned quants of line k (raw: qs line 8N + k; hm: hmask line k, Q3_K).
  template <int N, int J>
  static __m512i quants(__m512i raw, __m512i hm) {
    const __m512i m2 = _mm512_set1_epi8(0x03);
    __m512i u = J == 0 ? _mm512_and_si512(raw, m2) : _mm512_and_si512(_mm512_srli_epi16(raw, 2 * J), m2);
    if constexpr (kThree) {
      const __mmask64 hi = _mm512_test_epi8_mask(hm, _mm512_set1_epi8(char(1 << (4 * N + J))));
      u = _mm512_mask_add_epi8(u, hi, u, _mm512_set1_epi8(4));
    }
    return u;
  }
  static __m512i hm_line(const uint8_t* t, int k) {
    return kThree ? load512(t + kHm + 64 * k) : _mm512_setzero_si512();
  }

  // The sums' starting values: Q3_K −4·Σq16 of sub-block S (one vpmaddwd of both int16 sums), Q2_K 0.
  template <int S>
  static __m512i start(const ActQ8_32s& x) {
    if constexpr (!kThree) {
      return _mm512_setzero_si512();
    } else {
      int32_t both;
      std::memcpy(&both, x.sum16, 4);
      return _mm512_madd_epi16(_mm512_set1_epi32(both), _mm512_set1_epi32(S ? int32_t(0xFFFC0000u) : 0x0000FFFC));
    }
  }

  // The four blocks of half N at once (sa: first sub-blocks, sb: second), every line loaded once.
  template <int NC, int N>
  static void half_sums(const uint8_t* t, const ActQ8_32s* const* x, __m512i (*sa)[NC], __m512i (*sb)[NC]) {
    for (int j = 0; j < 4; j++)
      for (int c = 0; c < NC; c++) {
        sa[j][c] = start<0>(x[c][4 * N + j]);
        sb[j][c] = start<1>(x[c][4 * N + j]);
      }
    for (int k = 0; k < 8; k++) {
      const uint8_t* line = t + kQs + 64 * (8 * N + k);
      prefetch(t, 8 * N + k);
      const __m512i raw = load512(line), hm = hm_line(t, k);
      const __m512i u[4] = {quants<N, 0>(raw, hm), quants<N, 1>(raw, hm), quants<N, 2>(raw, hm), quants<N, 3>(raw, hm)};
      for (int j = 0; j < 4; j++)
        for (int c = 0; c < NC; c++) {
          __m512i& s = k < 4 ? sa[j][c] : sb[j][c];
          s = _mm512_dpbusd_epi32(s, u[j], bcast4(x[c][4 * N + j].q + 4 * k));
        }
    }
  }

  // One block's sums (many columns: one block's sums live at a time).
  template <int NC, int N, int J>
  static void block_sums(const uint8_t* t, const ActQ8_32s* const* x, __m512i* sa, __m512i* sb) {
    constexpr int M = 4 * N + J;
    for (int c = 0; c < NC; c++) {
      sa[c] = start<0>(x[c][M]);
      sb[c] = start<1>(x[c][M]);
    }
    for (int k = 0; k < 8; k++) {
      if constexpr (J == 0) prefetch(t, 8 * N + k);
      const __m512i u = quants<N, J>(load512(t + kQs + 64 * (8 * N + k)), hm_line(t, k));
      for (int c = 0; c < NC; c++) {
        __m512i& s = k < 4 ? sa[c] : sb[c];
        s = _mm512_dpbusd_epi32(s, u, bcast4(x[c][M].q + 4 * k));
      }
    }
  }

  // Block M's sums scaled and accumulated (sc3: Q3_K's four lines of signed scale bytes).
  template <int NC, int M>
  static void apply(const uint8_t* t, __m512 d, __m512 ndmin, const __m512i* sc3, const ActQ8_32s* const* x,
                    const __m512i* sa, const __m512i* sb, __m512* acc) {
    constexpr int I = 2 * (M % 2);  // sub-blocks 2M, 2M + 1: bytes I, I + 1 of scale line M / 2
    if constexpr (kThree) {
      const __m512i sca = byte_si<I>(sc3[M / 2]), scb = byte_si<I + 1>(sc3[M / 2]);
      for (int c = 0; c < NC; c++) {
        const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(sa[c], sca), _mm512_mullo_epi32(sb[c], scb));
        acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(x[c][M].d)), d, acc[c]);
      }
    } else {
      const __m512i v = load512(t + kSc + 64 * (M / 2)), m4 = _mm512_set1_epi32(0x0F);
      const __m512i sca = _mm512_and_si512(_mm512_srli_epi32(v, 8 * I), m4);
      const __m512i scb = _mm512_and_si512(_mm512_srli_epi32(v, 8 * I + 8), m4);
      // (mn_2M, mn_2M+1) as two int16 per lane: high nibbles of bytes I and I + 1.
      const __m512i mlo = _mm512_and_si512(_mm512_srli_epi32(v, 8 * I + 4), m4);
      const __m512i mhi = I == 0 ? _mm512_and_si512(_mm512_slli_epi32(v, 4), _mm512_set1_epi32(0x000F0000))
                                 : _mm512_and_si512(_mm512_srli_epi32(v, 12), _mm512_set1_epi32(0x000F0000));
      const __m512i mn = _mm512_or_si512(mlo, mhi);
      for (int c = 0; c < NC; c++) {
        int32_t both;
        std::memcpy(&both, x[c][M].sum16, 4);
        const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(sa[c], sca), _mm512_mullo_epi32(sb[c], scb));
        const __m512 n = _mm512_cvtepi32_ps(_mm512_madd_epi16(mn, _mm512_set1_epi32(both)));
        const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, _mm512_mul_ps(n, ndmin));
        acc[c] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[c][M].d), acc[c]);
      }
    }
  }

  template <int NC, int N>
  static void half(const uint8_t* t, __m512 d, __m512 ndmin, const __m512i* sc3, const ActQ8_32s* const* x,
                   __m512* acc) {
    if constexpr (NC <= 2) {
      __m512i sa[4][NC], sb[4][NC];
      half_sums<NC, N>(t, x, sa, sb);
      apply<NC, 4 * N + 0>(t, d, ndmin, sc3, x, sa[0], sb[0], acc);
      apply<NC, 4 * N + 1>(t, d, ndmin, sc3, x, sa[1], sb[1], acc);
      apply<NC, 4 * N + 2>(t, d, ndmin, sc3, x, sa[2], sb[2], acc);
      apply<NC, 4 * N + 3>(t, d, ndmin, sc3, x, sa[3], sb[3], acc);
    } else {
      __m512i sa[NC], sb[NC];
      block_sums<NC, N, 0>(t, x, sa, sb);
      apply<NC, 4 * N + 0>(t, d, ndmin, sc3, x, sa, sb, acc);
      block_sums<NC, N, 1>(t, x, sa, sb);
      apply<NC, 4 * N + 1>(t, d, ndmin, sc3, x, sa, sb, acc);
      block_sums<NC, N, 2>(t, x, sa, sb);
      apply<NC, 4 * N + 2>(t, d, ndmin, sc3, x, sa, sb, acc);
      block_sums<NC, N, 3>(t, x, sa, sb);
      apply<NC, 4 * N + 3>(t, d, ndmin, sc3, x, sa, sb, acc);
    }
  }

  template <int NC>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m512 acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
      const uint8_t* t = tiles + size_t(sb) * kTile;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
      __m512 ndmin = _mm512_setzero_ps();
      __m512i sc3[4];
      if constexpr (kThree) {
        // Scale j: low 4 bits from byte j (j < 8) or the high nibble of byte j − 8, bits 4-5 from
        // byte 8 + j % 4 at shift 2·(j / 4); line v of sc3 holds scales 4v..4v+3, minus 32.
        const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
        const __m512i l0 = load512(t + kSc), l1 = load512(t + kSc + 64), l2 = load512(t + kSc + 128);
        auto make = [&](__m512i low, __m512i high) {
          return _mm512_sub_epi8(_mm512_ternarylogic_epi32(low, high, m4, 0xEC) /* (low & m4) | high */, k32);
        };
        sc3[0] = make(l0, _mm512_and_si512(_mm512_slli_epi16(l2, 4), m30));
        sc3[1] = make(l1, _mm512_and_si512(_mm512_slli_epi16(l2, 2), m30));
        sc3[2] = make(_mm512_srli_epi16(l0, 4), _mm512_and_si512(l2, m30));
        sc3[3] = make(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(l2, 2), m30));
      } else {
        ndmin = _mm512_sub_ps(_mm512_setzero_ps(),
                              _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32))));
      }
      const ActQ8_32s* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + 8 * sb;
      half<NC, 0>(t, d, ndmin, sc3, x, acc);
      half<NC, 1>(t, d, ndmin, sc3, x, acc);
    }
    const __mmask16 keep = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    for (int c = 0; c < NC; c++) _mm512_mask_storeu_ps(y + size_t(c) * ys, keep, acc[c]);
  }
};

// F16, BF16 (tile layout in packed.h: line m holds elements 2m, 2m + 1 of the 16 rows as each
// lane's two halves). The activations are the floats themselves, broadcast from memory into the
// FMA; per column two chains, the even and the odd elements, in element order, and the output their
// sum: the portable kernel's operations, lane by lane. A GEMM does 16 rows × up to 8 columns per
// weight load (the row kernel re-reads 4 activation columns from L2 for every row).
template <GgmlType T>
struct PackedFloat {
  static constexpr size_t kTile = 1024;

  template <int NC>
  static void run(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, float* y, size_t ys, int rows) {
    __m512 even[NC], odd[NC];
    for (int c = 0; c < NC; c++) even[c] = odd[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* t = tiles + size_t(b) * kTile;
      const float* x[NC];
      for (int c = 0; c < NC; c++) x[c] = reinterpret_cast<const float*>(a + size_t(c) * as) + 32 * b;
      for (int m = 0; m < 16; m++) {
        const __m512i v = load512(t + 64 * m);
        __m512 w0, w1;
        if constexpr (T == GgmlType::BF16) {
          w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
          w1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
        } else {
          w0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
          w1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
        }
        for (int c = 0; c < NC; c++) {
          even[c] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[c][2 * m]), even[c]);
          odd[c] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[c][2 * m + 1]), odd[c]);
        }
      }
    }
    const __mmask16 keep = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    for (int c = 0; c < NC; c++) _mm512_mask_storeu_ps(y + size_t(c) * ys, keep, _mm512_add_ps(even[c], odd[c]));
  }
};

// Column counts 1..8 to the kernel's instantiations.
template <class K>
void packed_by_cols(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, int nc, float* y, size_t ys,
                    int rows) {
  switch (nc) {
    case 1: return K::template run<1>(nb, tiles, a, as, y, ys, rows);
    case 2: return K::template run<2>(nb, tiles, a, as, y, ys, rows);
    case 3: return K::template run<3>(nb, tiles, a, as, y, ys, rows);
    case 4: return K::template run<4>(nb, tiles, a, as, y, ys, rows);
    case 5: return K::template run<5>(nb, tiles, a, as, y, ys, rows);
    case 6: return K::template run<6>(nb, tiles, a, as, y, ys, rows);
    case 7: return K::template run<7>(nb, tiles, a, as, y, ys, rows);
    default: return K::template run<8>(nb, tiles, a, as, y, ys, rows);
  }
}

// Up to 4 columns a pass (Q2_K, Q3_K: with more, a block's two sets of sums and the accumulators
// outgrow the 32 registers and spill): 5..8 columns are two passes over the tiles, the second
// from the cache.
template <class K>
void packed_by_4_cols(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, int nc, float* y, size_t ys,
                      int rows) {
  nc = std::min(nc, 8);
  for (int c0 = 0; c0 < nc; c0 += 4) {
    const uint8_t* ac = a + size_t(c0) * as;
    float* yc = y + size_t(c0) * ys;
    switch (std::min(4, nc - c0)) {
      case 1: K::template run<1>(nb, tiles, ac, as, yc, ys, rows); break;
      case 2: K::template run<2>(nb, tiles, ac, as, yc, ys, rows); break;
      case 3: K::template run<3>(nb, tiles, ac, as, yc, ys, rows); break;
      default: K::template run<4>(nb, tiles, ac, as, yc, ys, rows); break;
    }
  }
}

KernelTable make_avx512_table() {
  KernelTable t = make_simd_table();
  t.quant[int(ActKind::Q8_32x4)] = quant_q8_32x4;
  t.act[int(GgmlType::Q4_0)] = t.act[int(GgmlType::Q4_1)] = ActKind::Q8_32x4;
  t.dot[int(GgmlType::Q4_0)] = by_columns<Q4x4<GgmlType::Q4_0>>;
  t.dot[int(GgmlType::Q4_1)] = by_columns<Q4x4<GgmlType::Q4_1>>;
  t.dot[int(GgmlType::Q8_0)] = by_columns<Q8x2>;
  t.packed[int(GgmlType::Q4_0)] = Packed<GgmlType::Q4_0>::by_cols;
  t.packed[int(GgmlType::Q4_1)] = Packed<GgmlType::Q4_1>::by_cols;
  t.packed[int(GgmlType::Q5_0)] = Packed<GgmlType::Q5_0>::by_cols;
  t.packed[int(GgmlType::Q5_1)] = Packed<GgmlType::Q5_1>::by_cols;
  t.packed[int(GgmlType::Q2_K)] = packed_by_4_cols<PackedK23<GgmlType::Q2_K>>;
  t.packed[int(GgmlType::Q3_K)] = packed_by_4_cols<PackedK23<GgmlType::Q3_K>>;
  t.packed[int(GgmlType::Q8_0)] = Packed<GgmlType::Q8_0>::by_cols;
  t.packed[int(GgmlType::Q4_K)] = packed_by_cols<PackedK4<GgmlType::Q4_K>>;
  t.packed[int(GgmlType::Q5_K)] = packed_by_cols<PackedK4<GgmlType::Q5_K>>;
  t.packed[int(GgmlType::Q6_K)] = packed_by_cols<PackedQ6K>;
  t.packed[int(GgmlType::IQ4_NL)] = Packed<GgmlType::IQ4_NL>::by_cols;
  t.packed[int(GgmlType::IQ4_XS)] = Packed<GgmlType::IQ4_XS>::by_cols;
  t.packed[int(GgmlType::MXFP4)] = Packed<GgmlType::MXFP4>::by_cols;
  t.packed[int(GgmlType::F16)] = packed_by_cols<PackedFloat<GgmlType::F16>>;
  t.packed[int(GgmlType::BF16)] = packed_by_cols<PackedFloat<GgmlType::BF16>>;
  return t;
}

}  // namespace

const KernelTable& kernels_avx512() {
  static const KernelTable t = make_avx512_table();
  return t;
}

}  // namespace baton::cpu

#endif  // __x86_64__
