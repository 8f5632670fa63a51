// Host-side packing of weight rows into the device layout (see layout.h).
#include <cstring>

#include "gguf/error.h"
#include "kernels/cuda/layout.h"

namespace baton::cuda {

bool packed_format(GgmlType t, PackedFormat& f) {
  switch (t) {
    // legacy blocks: [d (, m)][qs] -> quant bytes first, scales after
    case GgmlType::Q4_0: f = {32, 18, 2, 16, 0, 2}; return true;
    case GgmlType::Q4_1: f = {32, 20, 4, 16, 0, 4}; return true;
    case GgmlType::Q5_0: f = {32, 22, 6, 16, 0, 6}; return true;  // scales run: d, qh
    case GgmlType::Q5_1: f = {32, 24, 8, 16, 0, 8}; return true;  // scales run: d, m, qh
    case GgmlType::Q8_0: f = {32, 34, 2, 32, 0, 2}; return true;
    case GgmlType::IQ4_NL: f = {32, 18, 2, 16, 0, 2}; return true;
    // MXFP4: [e][qs 16] -> quant bytes first, then one exponent byte per block
    case GgmlType::MXFP4: f = {32, 17, 1, 16, 0, 1}; return true;
    // IQ4_XS: [d, scales_h, scales_l 4][qs 128] -> 128 quant bytes, then the 8-byte header
    case GgmlType::IQ4_XS: f = {256, 136, 8, 128, 0, 8}; return true;
    // Q2_K: [scales 16][qs 64][d, dmin] -> 80 bytes, then d, dmin
    case GgmlType::Q2_K: f = {256, 84, 0, 80, 80, 4}; return true;
    // Q3_K: [hmask 32][qs 64][scales 12][d] -> 96 bytes, then scales and d (14 bytes + 2 of padding)
    case GgmlType::Q3_K: f = {256, 110, 0, 96, 96, 14, 2}; return true;
    // Q6_K: [ql 128][qh 64][scales 16][d 2] -> 208 quant/scale bytes, then d
    case GgmlType::Q6_K: f = {256, 210, 0, 208, 208, 2}; return true;
    // already multiples of 16 bytes
    case GgmlType::Q4_K: f = {256, 144, 0, 144, 0, 0}; return true;
    case GgmlType::Q5_K: f = {256, 176, 0, 176, 0, 0}; return true;
    case GgmlType::F16: f = {1, 2, 0, 2, 0, 0}; return true;
    case GgmlType::BF16: f = {1, 2, 0, 2, 0, 0}; return true;
    case GgmlType::F32: f = {1, 4, 0, 4, 0, 0}; return true;
    default: return false;
  }
}

bool cuda_supports(GgmlType t) {
  PackedFormat f;
  return packed_format(t, f);
}

static PackedFormat format_or_fail(GgmlType t, int64_t cols) {
  PackedFormat f;
  if (!packed_format(t, f))
    fail(ErrorKind::Model, "CUDA backend: weight type {} is not supported (supported: F32, F16, "
         "BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)", type_name(t));
  const int64_t unit = f.block_elems == 1 ? 8 : f.block_elems;
  if (cols <= 0 || cols % unit != 0)
    fail(ErrorKind::Model, "CUDA backend: a {} row of {} elements is not a multiple of {}",
         type_name(t), cols, unit);
  return f;
}

size_t packed_row_bytes(GgmlType t, int64_t cols) {
  const PackedFormat f = format_or_fail(t, cols);
  const size_t nb = size_t(cols / f.block_elems);
  return (nb * (f.a_bytes + f.b_bytes + f.b_pad) + 15) / 16 * 16;
}

void pack_rows(GgmlType t, const void* src, void* dst, int64_t rows, int64_t cols) {
  const PackedFormat f = format_or_fail(t, cols);
  const size_t nb = size_t(cols / f.block_elems), in_row = nb * f.block_bytes;
  const size_t out_row = packed_row_bytes(t, cols);
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t* s = static_cast<const uint8_t*>(src) + size_t(r) * in_row;
    uint8_t* d = static_cast<uint8_t*>(dst) + size_t(r) * out_row;
    std::memset(d, 0, out_row);
    if (f.b_bytes == 0) {
      std::memcpy(d, s, in_row);
      continue;
    }
    for (size_t i = 0; i < nb; i++) {
      std::memcpy(d + i * f.a_bytes, s + i * f.block_bytes + f.a_off, f.a_bytes);
      std::memcpy(d + nb * f.a_bytes + i * (f.b_bytes + f.b_pad), s + i * f.block_bytes + f.b_off, f.b_bytes);
    }
  }
}

void unpack_rows(GgmlType t, const void* src, void* dst, int64_t rows, int64_t cols) {
  const PackedFormat f = format_or_fail(t, cols);
  const size_t nb = size_t(cols / f.block_elems), out_row = nb * f.block_bytes;
  const size_t in_row = packed_row_bytes(t, cols);
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t* s = static_cast<const uint8_t*>(src) + size_t(r) * in_row;
    uint8_t* d = static_cast<uint8_t*>(dst) + size_t(r) * out_row;
    if (f.b_bytes == 0) {
      std::memcpy(d, s, out_row);
      continue;
    }
    for (size_t i = 0; i < nb; i++) {
      std::memcpy(d + i * f.block_bytes + f.a_off, s + i * f.a_bytes, f.a_bytes);
      std::memcpy(d + i * f.block_bytes + f.b_off, s + nb * f.a_bytes + i * (f.b_bytes + f.b_pad), f.b_bytes);
    }
  }
}

}  // namespace baton::cuda
