// AVX-512 emulated on an AVX2 machine, for tests only (cmake -DBATON_EMULATE_AVX512=ON): the
// AVX-512 kernels are compiled against SIMDe (Debian's libsimde-dev), whose 512-bit intrinsics are
// plain C++ over two native 256-bit halves, so CI's AVX2 machine runs the kernels an AVX-512
// server runs and test_matmul / test_ops compare them with the portable kernels bit for bit.
// Included after <immintrin.h> by the files with AVX-512 code; never in a release build.
//
// SIMDe 0.7.4 lacks a few intrinsics these kernels use; they are defined below with exactly the
// hardware's arithmetic (FMA and conversions are the native 256-bit ones; the reductions add the
// lanes in the order GCC's _mm512_reduce_add_ps does), so bit-exact tests stay meaningful.
#pragma once
#ifndef BATON_AVX512_EMULATED
#error "avx512_emulated.h is for the BATON_EMULATE_AVX512 test build only"
#endif
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the AVX-512 emulation needs -mavx2 -mfma -mf16c (its halves are native AVX2)"
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define SIMDE_X86_AVX512F_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512BW_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VL_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VNNI_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

// SIMDe 0.7.4's alias of this one takes the masked form's four arguments.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

namespace baton::cpu::emu {

inline __m256 lo_ps(simde__m512 v) { return simde_mm512_castps512_ps256(v); }
inline __m256 hi_ps(simde__m512 v) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, v);
  return _mm256_load_ps(f + 8);
}
inline simde__m512 join_ps(__m256 lo, __m256 hi) {
  alignas(64) float f[16];
  _mm256_store_ps(f, lo);
  _mm256_store_ps(f + 8, hi);
  return simde_mm512_load_ps(f);
}
inline __m256i lo_si(simde__m512i v) { return simde_mm512_castsi512_si256(v); }
inline __m256i hi_si(simde__m512i v) { return simde_mm512_extracti64x4_epi64(v, 1); }
inline simde__m512i join_si(__m256i lo, __m256i hi) {
  return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}

inline simde__m512 cvtepi32_ps(simde__m512i v) {
  return join_ps(_mm256_cvtepi32_ps(lo_si(v)), _mm256_cvtepi32_ps(hi_si(v)));
}
inline simde__m512 cvtph_ps(__m256i h) {
  return join_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
template <int N>
inline simde__m512i srai_epi32(simde__m512i v) {
  return join_si(_mm256_srai_epi32(lo_si(v), N), _mm256_srai_epi32(hi_si(v), N));
}
inline simde__m512 mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, src);
  for (int i = 0; i < 16; i++)
    if (k >> i & 1) std::memcpy(f + i, static_cast<const float*>(p) + i, sizeof(float));
  return simde_mm512_load_ps(f);
}
inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  return mask_loadu_ps(simde_mm512_setzero_ps(), k, p);
}
inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 v) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, v);
  for (int i = 0; i < 16; i++)
    if (k >> i & 1) std::memcpy(static_cast<float*>(p) + i, f + i, sizeof(float));
}
// GCC's order: the upper 256 bits with the lower, then the 128-bit halves, then lanes (2, 3) with
// (0, 1), then lane 1 with lane 0.
template <class Op>
inline float reduce(simde__m512 v, Op op) {
  const __m256 a = op(hi_ps(v), lo_ps(v));
  const __m128 b = op(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
  const __m128 c = op(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
  return op(_mm_set_ss(_mm_cvtss_f32(c)), _mm_set_ss(_mm_cvtss_f32(_mm_shuffle_ps(c, c, 1))))[0];
}
struct Add {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_add_ps(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_add_ps(a, b); }
};
struct Max {
  __m256 operator()(__m256 a, __m256 b) const { return _mm256_max_ps(a, b); }
  __m128 operator()(__m128 a, __m128 b) const { return _mm_max_ps(a, b); }
};
// 128-bit lanes: a's imm[1:0] and imm[3:2], then b's imm[5:4] and imm[7:6].
inline simde__m512 shuffle_f32x4(simde__m512 a, simde__m512 b, int imm) {
  alignas(64) float fa[16], fb[16], r[16];
  simde_mm512_store_ps(fa, a);
  simde_mm512_store_ps(fb, b);
  for (int l = 0; l < 4; l++) std::memcpy(r + 4 * l, (l < 2 ? fa : fb) + 4 * (imm >> (2 * l) & 3), 4 * sizeof(float));
  return simde_mm512_load_ps(r);
}
inline simde__m512 zextps128_ps512(__m128 v) {
  alignas(64) float f[16] = {};
  _mm_store_ps(f, v);
  return simde_mm512_load_ps(f);
}
inline simde__m512i zextsi256_si512(__m256i v) { return join_si(v, _mm256_setzero_si256()); }
inline __m256i cvtepi32_epi16(simde__m512i v) {  // truncating, as vpmovdw
  alignas(64) int32_t a[16];
  simde_mm512_store_si512(a, v);
  alignas(32) int16_t b[16];
  for (int i = 0; i < 16; i++) b[i] = int16_t(a[i]);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
}
inline simde__m512i cvtepu8_epi32(__m128i v) {
  return join_si(_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
inline simde__m512i cvtepu16_epi32(__m256i v) {
  return join_si(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)));
}

}  // namespace baton::cpu::emu

#define _mm512_cvtepi32_ps(v) ::baton::cpu::emu::cvtepi32_ps(v)
#define _mm512_cvtph_ps(h) ::baton::cpu::emu::cvtph_ps(h)
#define _mm512_srai_epi32(v, n) ::baton::cpu::emu::srai_epi32<(n)>(v)
#define _mm512_mask_loadu_ps(s, k, p) ::baton::cpu::emu::mask_loadu_ps((s), (k), (p))
#define _mm512_maskz_loadu_ps(k, p) ::baton::cpu::emu::maskz_loadu_ps((k), (p))
#define _mm512_mask_storeu_ps(p, k, v) ::baton::cpu::emu::mask_storeu_ps((p), (k), (v))
#define _mm512_reduce_add_ps(v) ::baton::cpu::emu::reduce((v), ::baton::cpu::emu::Add{})
#define _mm512_reduce_max_ps(v) ::baton::cpu::emu::reduce((v), ::baton::cpu::emu::Max{})
#define _mm512_zextps128_ps512(v) ::baton::cpu::emu::zextps128_ps512(v)
#define _mm512_zextsi256_si512(v) ::baton::cpu::emu::zextsi256_si512(v)
#define _mm512_shuffle_f32x4(a, b, imm) ::baton::cpu::emu::shuffle_f32x4((a), (b), (imm))
#define _mm512_cvtepi32_epi16(v) ::baton::cpu::emu::cvtepi32_epi16(v)
#define _mm512_cvtepu8_epi32(v) ::baton::cpu::emu::cvtepu8_epi32(v)
#define _mm512_cvtepu16_epi32(v) ::baton::cpu::emu::cvtepu16_epi32(v)
#define _cvtu64_mask64(x) static_cast<simde__mmask64>(x)
