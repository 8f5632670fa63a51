// Scalar reference dequantize / quantize: the oracle every fast kernel is tested against.
// Compiled without fast-math and without SIMD. Byte-compatible with ggml's formats.
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/blocks.h"
#include "quant/types.h"

namespace baton {

// Dequantize n elements (a multiple of the type's block size) from `src` into `dst`.
// Works for every type with TypeTraits::compute == true, plus Q8_K.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

// Quantize n elements (a multiple of the block size). Supported for: F32, F16, BF16, Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL, IQ4_XS, MXFP4 (see has_quantize).
bool has_quantize(GgmlType t);
void quantize_row(GgmlType t, const float* src, void* dst, int64_t n);

}  // namespace baton
