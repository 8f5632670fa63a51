// Row-interleaved ("packed") weights for the CPU matmul: the layout a register-tiled kernel wants.
//
// Rows go in groups of 16. For every 32-element block column of a group, one tile holds the 16
// rows' scales (fp16, as stored) and their quants interleaved four bytes per row: byte 4·r + i of
// a 64-byte line is row r's quant byte 4·k + i. One 512-bit load then holds 4 quant bytes of each of
// the 16 rows, and one vpdpbusd against a broadcast 4 bytes of activations adds them into 16
// per-row sums: no horizontal reductions, the weights reused from registers for up to 8 activation
// columns. The same kernel runs for every column count (decode included), so each output's
// arithmetic — and its bits — never depend on how many columns were multiplied together.
//
// Tile contents (32 B of fp16 scales first; MXFP4: its 16 exponent bytes):
//   Q4_0  d[16] | 4 lines of nibbles (line k: bytes 4k..4k+3 of each row's qs)          288 B
//   Q4_1  d[16] m[16] | 4 nibble lines                                                  320 B
//   Q5_0  d[16] | 8 × u64 fifth-bit masks (line k low nibbles, line k high) | 4 lines  352 B
//   Q5_1  d[16] m[16] | 8 × u64 fifth-bit masks | 4 nibble lines                        384 B
//   Q8_0  d[16] | 8 lines of signed bytes (line k: bytes 4k..4k+3 of each row's qs)    544 B
//   IQ4_NL  as Q4_0 (the nibbles index kIQ4Values)                                      288 B
//   MXFP4   e[16] (the E8M0 bytes as stored) | 4 nibble lines (indexing kMXFP4Values)  272 B
//
// The k-quants tile 16 rows × one 256-element super-block; every field is kept as stored, the
// byte arrays as 64-byte lines (byte j of row r at 64·(j / 4) + 4·r + j % 4):
//   Q2_K  d[16] dmin[16] | 4 lines of scale/min bytes | 16 lines of qs                        1344 B
//   Q3_K  d[16] | 3 lines of the 12 packed 6-bit scale bytes | 8 lines of hmask | 16 lines of qs 1760 B
//   Q4_K  d[16] dmin[16] | 3 lines of the 12 packed 6-bit scale/min bytes | 32 lines of qs     2304 B
//   Q5_K  d[16] dmin[16] | 3 scale lines | 8 lines of qh | 32 lines of qs                     2816 B
//   Q6_K  d[16] | 4 lines of int8 scales | 48 lines: per half h and k = 0..7, ql line 16h + k,
//         ql line 16h + 8 + k, qh line 8h + k (the order its kernel reads them)               3360 B
//   IQ4_XS  d[16] scales_h[16] | 1 line of scales_l | 32 lines of qs (sub-block b: lines 4b..4b+3,
//         laid out as one IQ4_NL tile's)                                                       2176 B
//   F16, BF16  16 lines: line m holds elements 2m, 2m + 1 of each row (4 bytes a row)         1024 B
// (a float tile spans 32 elements of each row, as the 32-element formats; its kernels read float
// activations, not ActQ8_32s. F32 is not packed.)
// A 32-element block of the super-block then reads 8 quant lines (Q4_K: chunk c = lines 8c..8c+7,
// low nibbles block 2c, high nibbles 2c + 1; Q2_K/Q3_K: block 4n + j = bits 2j, 2j + 1 of lines
// 8n..8n+7, Q3_K's third bit bit 4n + j of the 8 hmask lines) and meets exactly one 32-element
// activation block.
//
// Every tile is exactly 16 × the GGUF block size: the packed matrix has the file's bytes (rows
// padded to a multiple of 16 with zero rows, counted by packed_bytes()).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/cpu/matmul.h"
#include "quant/types.h"

namespace baton::cpu {

constexpr int kPackRows = 16;

// Whether a type has a packed layout (pack_matrix accepts it; the planner counts its padding);
// whether this process packs it at load (the active ISA has its tile kernel — AVX-512 for every
// packable type, AVX2 for the quantized ones — and BATON_CPU_PACK is not 0).
bool packable(GgmlType t);
bool packing_enabled(GgmlType t);
// The same for a matrix of rows of `cols` elements: F16 and BF16 may have rows the 32-element tiles
// do not divide, which stay in rows.
bool packing_enabled(GgmlType t, int64_t cols);
// Whether a packed type's tile kernel reads the activations as floats (F16, BF16) rather than as
// 8-bit blocks (ActQ8_32s).
bool packed_float(GgmlType t);

// Bytes of a packed rows × cols matrix (rows rounded up to a multiple of 16).
size_t packed_bytes(GgmlType t, int64_t rows, int64_t cols);

// Packs W (row-major GGUF layout) into out (packed_bytes() long; 64-byte alignment is best).
void pack_matrix(const QMatrix& W, uint8_t* out, ThreadPool* pool = nullptr);

// Row r of a packed matrix as floats (the embedding lookup of a tied, packed head).
void unpack_row(const QMatrix& W, int64_t r, float* out);

// An owned, 64-byte aligned buffer for packed weights.
struct FreeDeleter {
  void operator()(uint8_t* p) const noexcept;
};
using PackedBuffer = std::unique_ptr<uint8_t[], FreeDeleter>;
PackedBuffer alloc_packed(size_t bytes);

}  // namespace baton::cpu
