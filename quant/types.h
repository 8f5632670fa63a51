// Tensor element types as ggml numbers them in GGUF files, and one traits table for all of them.
// Quant formats are data: a type is an id plus the row of facts below, nothing more.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace baton {

enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

struct TypeTraits {
  GgmlType type;
  const char* name;
  uint32_t block_elems;   // elements per block (1 for plain floats)
  uint32_t block_bytes;   // bytes per block
  bool compute;           // Baton can dequantize it and multiply with it
  double bits_per_weight() const { return 8.0 * block_bytes / block_elems; }
};

// nullptr for an id that is not a ggml type at all.
const TypeTraits* type_traits(uint32_t id);
const TypeTraits& traits(GgmlType t);  // t must be valid
inline const char* type_name(GgmlType t) { return traits(t).name; }
const TypeTraits* type_by_name(std::string_view name);  // case-insensitive, nullptr if unknown

// Bytes of a row of n elements; n must be a multiple of the block size.
inline size_t row_bytes(GgmlType t, int64_t n) {
  const TypeTraits& tt = traits(t);
  return size_t(n / tt.block_elems) * tt.block_bytes;
}

// The 16 weight types the CPU backend computes with.
inline constexpr GgmlType kComputeTypes[] = {
  GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,
  GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K,
  GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS,
  GgmlType::MXFP4,
};

// ---- IEEE half and bfloat16, exact scalar conversions (no intrinsics: these are the oracle) ----

inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t bits_from_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    // subnormal half: value = mant * 2^-24
    float v = float(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round to nearest even, overflow to infinity, NaN kept quiet.
inline uint16_t f32_to_fp16(float f) {
  const uint32_t x = bits_from_f32(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {                                  // below the smallest normal half
    if (ax < 0x33000000u) return uint16_t(sign);           // < 2^-25: rounds to zero
    const uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;                        // 14..24
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) h++;
    return uint16_t(sign | h);
  }
  uint32_t h = ((ax - 0x38000000u) >> 13);
  const uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return uint16_t(sign | h);
}

inline float bf16_to_f32(uint16_t b) { return f32_from_bits(uint32_t(b) << 16); }
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept
  uint32_t x = bits_from_f32(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

}  // namespace baton
