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
  using Scale = __m256i;  // 16-bit lanes: 0-7 cover bytes 0-15, 8-15 cover bytes 16-31
  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  static Scale scale2(int a, int b) { return _mm256_set_m128i(_mm_set1_epi16(short(b)), _mm_set1_epi16(short(a))); }
  static __m256i dot_scaled(__m256i u, __m256i s, Scale sc) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc);
  }
};

}  // namespace

#include "kernels/cpu/dot_simd.inc"

const KernelTable& kernels_avx2() {
  static const KernelTable t = make_simd_table();
  return t;
}

}  // namespace baton::cpu
