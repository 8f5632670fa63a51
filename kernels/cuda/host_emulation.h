// Plain C++ stand-ins for the CUDA vector types and intrinsics that quant.cuh uses, so that its
// per-type load / dot / dequantize code can be compiled by the host compiler and tested against
// the scalar reference on machines without a GPU (tests/test_cuda_quant_host.cpp). Not used by
// the CUDA build.
#pragma once
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

#include "kernels/cuda/errors.h"
#include "quant/blocks.h"
#include "quant/types.h"

namespace baton::cuda {

struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
struct int4 { int32_t x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };

template <class T>
inline T __ldg(const T* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
inline int __dp4a(int a, int b, int c) {  // signed bytes
  for (int i = 0; i < 4; i++) c += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
  return c;
}
inline uint32_t __vsub4(uint32_t a, uint32_t b) {  // per-byte wrap-around subtraction
  uint32_t r = 0;
  for (int i = 0; i < 4; i++) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xFFu) << (8 * i);
  return r;
}
// Byte i of the result: byte ((s >> 4i) & 7) of the 8-byte pool x (bytes 0..3), y (4..7).
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t pool = uint64_t(x) | (uint64_t(y) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; i++) r |= uint32_t((pool >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float half_bits_to_float(uint16_t h) { return fp16_to_f32(h); }
inline float bf16_bits_to_float(uint16_t b) { return bf16_to_f32(b); }

template <class... A>
std::string cat(const A&... a) {
  std::ostringstream o;
  (o << ... << a);
  return o.str();
}

}  // namespace baton::cuda
