// AVX-512 VNNI kernels: vpdpbusd sums four u8×s8 products into each int32 lane in one
// instruction, with no 16-bit saturation step. 256-bit vectors (AVX-512VL) match the 32-byte
// blocks of every format. Compiled for AVX-512 by the pragma below; only reached when the CPU
// reports AVX-512 F/BW/VL/VNNI (see detected_isa()).
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/qkernels.h"

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

namespace baton::cpu {
namespace {

struct O {
  using Scale = __m256i;  // 32-bit lanes: 0-3 cover bytes 0-15, 4-7 cover bytes 16-31
  static __m256i dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
  static Scale scale2(int a, int b) { return _mm256_set_m128i(_mm_set1_epi32(b), _mm_set1_epi32(a)); }
  static __m256i dot_scaled(__m256i u, __m256i s, Scale sc) { return _mm256_mullo_epi32(dot(u, s), sc); }
};

}  // namespace

#include "kernels/cpu/dot_simd.inc"

const KernelTable& kernels_avx512() {
  static const KernelTable t = make_simd_table();
  return t;
}

}  // namespace baton::cpu
