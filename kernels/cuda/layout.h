// The device layout of a weight matrix. GGUF blocks are 18, 20, 34 or 210 bytes long, so a row of
// them cannot be read with aligned 16-byte loads. On upload each row is split into two runs: the
// quant bytes of every block (a multiple of 16 bytes per block) followed by the per-block scales,
// and the row is padded to 16 bytes. Types whose blocks already are a multiple of 16 bytes
// (Q4_K: 144, Q5_K: 176, F16/BF16/F32 rows of 8 elements) keep their bytes as they are.
// Plain C++: the runtime packs rows on the host while staging them for the copy to the GPU.
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/types.h"

namespace baton::cuda {

struct PackedFormat {
  uint32_t block_elems = 0;  // elements per block
  uint32_t block_bytes = 0;  // bytes per block in the GGUF file
  uint32_t a_off = 0, a_bytes = 0;  // quant part: offset inside the file block, length
  uint32_t b_off = 0, b_bytes = 0;  // scale part (0 bytes: nothing to split off)
  uint32_t b_pad = 0;  // zero bytes after each scale part (Q3_K: its 14 bytes read as one 16)
};

// False for types the CUDA backend does not compute with.
bool packed_format(GgmlType t, PackedFormat& f);
// Types the CUDA matmul, embedding lookup and dequantize accept.
bool cuda_supports(GgmlType t);

// Bytes of one packed row (a multiple of 16). cols must be a multiple of the block size and, for
// the float types, of 8.
size_t packed_row_bytes(GgmlType t, int64_t cols);

// Pack / unpack `rows` rows of `cols` elements (src rows are row_bytes(t, cols) apart, dst rows
// packed_row_bytes apart, padding zeroed). Host memory only.
void pack_rows(GgmlType t, const void* src, void* dst, int64_t rows, int64_t cols);
void unpack_rows(GgmlType t, const void* src, void* dst, int64_t rows, int64_t cols);

}  // namespace baton::cuda
