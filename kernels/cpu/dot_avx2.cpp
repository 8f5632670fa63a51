// AVX2 kernels: 8-bit products with pmaddubsw (u8×s8 → s16 pairs) and pmaddwd. The sub-block
// scales ride along in pmaddwd for free. Compiled for AVX2 by the pragma below; only reached
// when the CPU reports AVX2, FMA and F16C (see detected_isa()).
#include <immintrin.h>

#include <cstring>

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

const KernelTable& kernels_avx2() {
  static const KernelTable t = make_simd_table();
  return t;
}

}  // namespace baton::cpu
