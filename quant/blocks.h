// Block layouts of the ggml quantized formats, byte for byte as they sit in GGUF files.
// Field order is byte order; every struct is checked against the traits table's size.
#pragma once
#include <cstdint>

#include "quant/types.h"

namespace baton {

constexpr int QK = 32;    // elements per legacy block
constexpr int QK_K = 256; // elements per k-quant super-block
constexpr int K_SCALE_SIZE = 12;

#pragma pack(push, 1)
struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
struct BlockQ8_1 { uint16_t d, s; int8_t qs[QK]; };
struct BlockQ2_K { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
struct BlockQ8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
// The non-linear 4-bit formats: a nibble indexes kIQ4Values, value = d·kIQ4Values[nibble].
// IQ4_NL: Q4_0's layout. IQ4_XS: 8 sub-blocks of 32 (16 qs bytes each, low nibbles first), each with
// a 6-bit scale ls (4 low bits in scales_l, 2 high in scales_h), value = d·(ls − 32)·kIQ4Values[q].
struct BlockIQ4_NL { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockIQ4_XS { uint16_t d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; };
// MXFP4 (OCP microscaling, gpt-oss's expert matrices): an E8M0 exponent byte e and 32 E2M1 values
// as nibbles (low nibbles elements 0..15, high 16..31), value = kMXFP4Values[nibble]·2^(e − 128).
struct BlockMXFP4 { uint8_t e; uint8_t qs[QK / 2]; };
#pragma pack(pop)

// The 16 levels of the IQ4 formats (denser near zero, as trained weights are).
inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

// The 16 E2M1 values of MXFP4 doubled (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6 times 2), so that they are
// integers for the 8-bit dot products; the block scale is halved to match (mxfp4_scale). Nibble 8 is −0.
inline constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The halved E8M0 scale of an MXFP4 block, 2^(e − 128), exactly: a normal float's exponent field
// e − 1 for e ≥ 2, the subnormals 2^−128 and 2^−127 for e = 0 and 1. e = 255 is 2^127 (ggml's
// reading; the OCP spec's NaN code is not used by GGUF files).
inline float mxfp4_scale(uint8_t e) {
  return f32_from_bits(e >= 2 ? uint32_t(e - 1) << 23 : 0x00200000u << e);
}

// The signed scale (ls − 32, −32..31) of sub-block ib (0..7) of an IQ4_XS super-block.
inline int iq4xs_scale(const BlockIQ4_XS& b, int ib) {
  const int lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
  const int hi = (b.scales_h >> (2 * ib)) & 3;
  return (lo | (hi << 4)) - 32;
}

// Compile-time agreement between the structs and the traits table's numbers.
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292);
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136);
static_assert(sizeof(BlockMXFP4) == 17);

template <class B> struct BlockOf;
#define BATON_BLOCK(T, B) template <> struct BlockOf<B> { static constexpr GgmlType type = GgmlType::T; };
BATON_BLOCK(Q4_0, BlockQ4_0) BATON_BLOCK(Q4_1, BlockQ4_1) BATON_BLOCK(Q5_0, BlockQ5_0)
BATON_BLOCK(Q5_1, BlockQ5_1) BATON_BLOCK(Q8_0, BlockQ8_0) BATON_BLOCK(Q8_1, BlockQ8_1)
BATON_BLOCK(Q2_K, BlockQ2_K) BATON_BLOCK(Q3_K, BlockQ3_K) BATON_BLOCK(Q4_K, BlockQ4_K)
BATON_BLOCK(Q5_K, BlockQ5_K) BATON_BLOCK(Q6_K, BlockQ6_K) BATON_BLOCK(Q8_K, BlockQ8_K)
BATON_BLOCK(IQ4_NL, BlockIQ4_NL) BATON_BLOCK(IQ4_XS, BlockIQ4_XS) BATON_BLOCK(MXFP4, BlockMXFP4)
#undef BATON_BLOCK

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block.
inline void k_scale_min(int j, const uint8_t* s, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = uint8_t((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    mn = uint8_t((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

}  // namespace baton
