// The CUDA simulator's FP16 type and conversions (IEEE binary16, round to nearest even).
#pragma once
#include <array>
#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __half { unsigned short x; };
struct alignas(4) __half2 { __half x, y; };

inline __half __float2half_rn(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  __half r;
  std::memcpy(&r.x, &h, 2);
  return r;
}
inline __half __float2half(float f) { return __float2half_rn(f); }
// Every FP16 value as a float (runtime.cpp, built at compile time): a table lookup, not libgcc's
// software conversion.
extern const std::array<float, 65536> cudasim_half_to_float;
inline float __half2float(__half h) { return cudasim_half_to_float[h.x]; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
