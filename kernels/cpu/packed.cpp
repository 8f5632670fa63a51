// Packing GGUF rows into the row-interleaved tiles of packed.h, the inverse for one row, and the
// portable packed kernel (plain C++: the scalar/AVX2 levels' path and the tests' reference).
#include "kernels/cpu/packed.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "gguf/error.h"
#include "kernels/cpu/qkernels.h"
#include "quant/blocks.h"
#include "quant/quant.h"

namespace baton::cpu {

namespace {

// Where a tile's parts start, and the weight offset each unsigned quant carries (value = d·(u − off),
// Q4_1: d·u + m). A tile spans 32 elements (the legacy formats) or one 256-element super-block.
struct TileLayout {
  size_t bytes = 0;
  size_t m = 0;   // Q4_1, Q5_1: fp16 minimums
  size_t qh = 0;  // Q5_0, Q5_1: eight u64 fifth-bit masks
  size_t qs = 0;  // the 64-byte quant lines
  int off = 0;
  int elems = 32;
};

TileLayout layout(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return {288, 0, 0, 32, 8, 32};
    case GgmlType::Q4_1: return {320, 32, 0, 64, 0, 32};
    case GgmlType::Q5_0: return {352, 0, 32, 96, 16, 32};
    case GgmlType::Q5_1: return {384, 32, 64, 128, 0, 32};
    case GgmlType::Q8_0: return {544, 0, 0, 32, 128, 32};
    case GgmlType::Q2_K: return {16 * sizeof(BlockQ2_K), 0, 0, 0, 0, 256};
    case GgmlType::Q3_K: return {16 * sizeof(BlockQ3_K), 0, 0, 0, 4, 256};
    case GgmlType::Q4_K: return {16 * sizeof(BlockQ4_K), 0, 0, 0, 0, 256};
    case GgmlType::Q5_K: return {16 * sizeof(BlockQ5_K), 0, 0, 0, 0, 256};
    case GgmlType::Q6_K: return {16 * sizeof(BlockQ6_K), 0, 0, 0, 32, 256};
    case GgmlType::IQ4_NL: return {288, 0, 0, 32, 128, 32};
    case GgmlType::MXFP4: return {272, 0, 0, 16, 128, 32};
    case GgmlType::IQ4_XS: return {16 * sizeof(BlockIQ4_XS), 0, 0, 128, 128, 256};
    case GgmlType::F16: case GgmlType::BF16: return {1024, 0, 0, 0, 0, 32};
    default: break;
  }
  BATON_CHECK(false && "not a packable type");
  return {};
}

// Tile ↔ block as a list of fields: a 1- or 2-byte field (MXFP4's exponent, an fp16 scale) goes to
// tile + len·r, a longer one to 64-byte lines, byte j of row r at tile + 64·(j / 4) + 4·r + j % 4. Q5_0/Q5_1's fifth bits are
// the one exception (bit masks, handled apart). See packed.h for each type's order.
struct Field {
  size_t blk, len, tile;
  int order = 0;  // 1, 2: Q6_K's ql and qh lines, interleaved in the order the kernel first reads them
};
struct Fields {
  Field f[5];
  int n;
};
Fields fields(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return {{{0, 2, 0}, {2, 16, 32}}, 2};
    case GgmlType::Q4_1: return {{{0, 2, 0}, {2, 2, 32}, {4, 16, 64}}, 3};
    case GgmlType::Q5_0: return {{{0, 2, 0}, {6, 16, 96}}, 2};
    case GgmlType::Q5_1: return {{{0, 2, 0}, {2, 2, 32}, {8, 16, 128}}, 3};
    case GgmlType::Q8_0: return {{{0, 2, 0}, {2, 32, 32}}, 2};
    case GgmlType::Q2_K: return {{{80, 2, 0}, {82, 2, 32}, {0, 16, 64}, {16, 64, 320}}, 4};
    case GgmlType::Q3_K: return {{{108, 2, 0}, {96, 12, 32}, {0, 32, 224}, {32, 64, 736}}, 4};
    case GgmlType::Q4_K: return {{{0, 2, 0}, {2, 2, 32}, {4, 12, 64}, {16, 128, 256}}, 4};
    case GgmlType::Q5_K: return {{{0, 2, 0}, {2, 2, 32}, {4, 12, 64}, {16, 32, 256}, {48, 128, 768}}, 5};
    case GgmlType::Q6_K: return {{{208, 2, 0}, {192, 16, 32}, {0, 128, 288, 1}, {128, 64, 288, 2}}, 4};
    case GgmlType::IQ4_NL: return {{{0, 2, 0}, {2, 16, 32}}, 2};
    case GgmlType::MXFP4: return {{{0, 1, 0}, {1, 16, 16}}, 2};
    case GgmlType::IQ4_XS: return {{{0, 2, 0}, {2, 2, 32}, {4, 4, 64}, {8, 128, 128}}, 4};
    case GgmlType::F16: case GgmlType::BF16: return {{{0, 64, 0}}, 1};  // 32 elements of a row as one 64-byte "block"
    default: break;
  }
  BATON_CHECK(false && "not a packable type");
  return {};
}

// Q6_K's 48 quant lines per tile, in the order its kernel reads them (see packed.h): per half h
// and k = 0..7, ql lines 16h + k and 16h + 8 + k, then qh line 8h + k.
inline size_t q6_line(int order, size_t li) {
  if (order == 2) return 24 * (li / 8) + 3 * (li % 8) + 2;  // qh
  const size_t h = li / 16, k = li % 16;
  return 24 * h + 3 * (k % 8) + k / 8;  // ql
}
inline size_t line_pos(const Field& f, size_t j, int r) {
  const size_t line = f.order ? q6_line(f.order, j / 4) : j / 4;
  return f.tile + 64 * line + 4 * size_t(r) + j % 4;
}

// Where a Q5_0 / Q5_1 block keeps its 32 fifth bits.
size_t qh_offset(GgmlType t) { return t == GgmlType::Q5_0 ? offsetof(BlockQ5_0, qh) : offsetof(BlockQ5_1, qh); }

// Tile ↔ block: row r (0..15) of a tile holds the GGUF block `blk` (nullptr: a zero padding row).
void put_block(GgmlType t, const uint8_t* blk, int r, uint8_t* tile) {
  static const uint8_t zero[sizeof(BlockQ6_K)] = {};
  if (!blk) blk = zero;
  const Fields F = fields(t);
  for (int i = 0; i < F.n; i++) {
    const Field& f = F.f[i];
    if (f.len <= 2) std::memcpy(tile + f.tile + f.len * size_t(r), blk + f.blk, f.len);
    else for (size_t j = 0; j < f.len; j += 4) std::memcpy(tile + line_pos(f, j, r), blk + f.blk + j, 4);  // 4 bytes a line
  }
  if (t == GgmlType::Q5_0 || t == GgmlType::Q5_1) {
    const size_t qh_at = layout(t).qh;
    uint32_t qh;
    std::memcpy(&qh, blk + qh_offset(t), 4);
    uint64_t mask[8];
    std::memcpy(mask, tile + qh_at, 64);
    for (int e = 0; e < 32; e++) {
      const int half = e / 16, k = (e % 16) / 4, i = e % 4;
      const uint64_t bit = uint64_t(1) << (4 * r + i);
      if ((qh >> e) & 1) mask[2 * k + half] |= bit;
      else mask[2 * k + half] &= ~bit;
    }
    std::memcpy(tile + qh_at, mask, 64);
  }
}

void get_block(GgmlType t, const uint8_t* tile, int r, uint8_t* blk) {
  const Fields F = fields(t);
  for (int i = 0; i < F.n; i++) {
    const Field& f = F.f[i];
    if (f.len <= 2) std::memcpy(blk + f.blk, tile + f.tile + f.len * size_t(r), f.len);
    else for (size_t j = 0; j < f.len; j += 4) std::memcpy(blk + f.blk + j, tile + line_pos(f, j, r), 4);
  }
  if (t == GgmlType::Q5_0 || t == GgmlType::Q5_1) {
    uint64_t mask[8];
    std::memcpy(mask, tile + layout(t).qh, 64);
    uint32_t qh = 0;
    for (int e = 0; e < 32; e++) {
      const int half = e / 16, k = (e % 16) / 4, i = e % 4;
      qh |= uint32_t((mask[2 * k + half] >> (4 * r + i)) & 1) << e;
    }
    std::memcpy(blk + qh_offset(t), &qh, 4);
  }
}

// The 32 unsigned quants of row r of a legacy tile, element order (value = d·(u − off), Q4_1/Q5_1 d·u + m).
void tile_quants(GgmlType t, const uint8_t* tile, int r, int32_t u[32]) {
  const TileLayout L = layout(t);
  const uint8_t* lines = tile + L.qs;
  if (t == GgmlType::Q8_0) {
    for (int e = 0; e < 32; e++) u[e] = int32_t(int8_t(lines[64 * (e / 4) + 4 * r + e % 4])) + 128;
    return;
  }
  for (int e = 0; e < 16; e++) {
    const uint8_t b = lines[64 * (e / 4) + 4 * r + e % 4];
    u[e] = b & 0x0F;
    u[e + 16] = b >> 4;
  }
  if (t == GgmlType::IQ4_NL || t == GgmlType::MXFP4) {
    const int8_t* levels = t == GgmlType::IQ4_NL ? kIQ4Values : kMXFP4Values;
    for (int e = 0; e < 32; e++) u[e] = levels[u[e]] + 128;
  }
  if (t == GgmlType::Q5_0 || t == GgmlType::Q5_1) {
    uint64_t mask[8];
    std::memcpy(mask, tile + L.qh, 64);
    for (int e = 0; e < 32; e++) {
      const int half = e / 16, k = (e % 16) / 4, i = e % 4;
      u[e] |= int32_t((mask[2 * k + half] >> (4 * r + i)) & 1) << 4;
    }
  }
}

float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_f32(h);
}

// Row r's scale in a legacy tile: the fp16 d, or MXFP4's exponent byte as the exact float 2^(e − 128)
// (e = 0 and 1 give the subnormals 2^−128 and 2^−127, as the reference dequantizer does).
template <GgmlType T>
float tile_scale(const uint8_t* tile, int r) {
  if constexpr (T == GgmlType::MXFP4) return mxfp4_scale(tile[r]);
  else return h2f(tile + 2 * r);
}

// Per output: s = Σ (u − off)·q over the block in integers, then acc = fma(float(s)·dx, dw, acc)
// (Q4_1, Q5_1: plus fma(m, dx·Σq, acc)), blocks in order. The SIMD kernels do the same operations.
template <GgmlType T>
void portable_kernel(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, int nc, float* y, size_t ys,
                     int rows) {
  const TileLayout L = layout(T);
  float acc[kPackedMaxCols][kPackRows] = {};
  int32_t u[kPackRows][32];
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* tile = tiles + size_t(b) * L.bytes;
    for (int r = 0; r < kPackRows; r++) tile_quants(T, tile, r, u[r]);
    for (int c = 0; c < nc; c++) {
      const ActQ8_32s& x = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as)[b];
      for (int r = 0; r < kPackRows; r++) {
        int32_t s = -L.off * x.sum;
        for (int e = 0; e < 32; e++) s += u[r][e] * int32_t(x.q[e]);
        acc[c][r] = std::fma(float(s) * x.d, tile_scale<T>(tile, r), acc[c][r]);
        if (T == GgmlType::Q4_1 || T == GgmlType::Q5_1) acc[c][r] = std::fma(h2f(tile + L.m + 2 * r), x.ds, acc[c][r]);
      }
    }
  }
  for (int c = 0; c < nc; c++)
    for (int r = 0; r < rows; r++) y[size_t(c) * ys + size_t(r)] = acc[c][r];
}

// The k-quants, per 32-element block m of a super-block (it meets exactly one activation block):
//   Q4_K, Q5_K: s = Σ u·q, then acc = fma(float(s)·dx, d·sc_m, acc), acc = fma(−dmin·mn_m, dx·Σq, acc);
//   IQ4_XS: s = Σ level·q, then acc = fma(float(s)·dx, d·(ls_m − 32), acc);
//   Q6_K, Q3_K: s = Σ_h sc_2m+h·(−off·Σq_h + Σ u·q) over its 16-element halves h, off = 32 / 4 (exact
//         in 32 bits: at most 2 × 128 × 16 × 63 × 127), then acc = fma(float(s)·dx, d, acc);
//   Q2_K: s = Σ_h sc_2m+h·Σ u·q and n = Σ_h mn_2m+h·Σq_h, then acc = fma(fma(float(s), d,
//         float(n)·(−dmin)), dx, acc).
// Blocks (and halves) in element order; the AVX-512 kernel does the same operations.
template <GgmlType T>
void portable_kquant(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, int nc, float* y, size_t ys,
                     int rows) {
  const TileLayout L = layout(T);
  float acc[kPackedMaxCols][kPackRows] = {};
  std::vector<KBlock> kb(kPackRows);
  uint8_t blk[sizeof(BlockQ6_K)];
  for (int64_t sb = 0; sb < nb / 8; sb++) {
    const uint8_t* tile = tiles + size_t(sb) * L.bytes;
    for (int r = 0; r < kPackRows; r++) {
      get_block(T, tile, r, blk);
      decode_k(T, blk, kb[size_t(r)]);
    }
    for (int c = 0; c < nc; c++) {
      const ActQ8_32s* xs = reinterpret_cast<const ActQ8_32s*>(a + size_t(c) * as) + 8 * sb;
      for (int r = 0; r < kPackRows; r++) {
        const KBlock& k = kb[size_t(r)];
        float& out = acc[c][r];
        for (int m = 0; m < 8; m++) {
          const ActQ8_32s& x = xs[m];
          const uint8_t* u = k.u + 32 * m;
          if constexpr (T == GgmlType::Q6_K || T == GgmlType::Q3_K) {
            int32_t s = 0;
            for (int h = 0; h < 2; h++) {
              int32_t sh = -k.off * int32_t(x.sum16[h]);
              for (int e = 16 * h; e < 16 * h + 16; e++) sh += int32_t(u[e]) * int32_t(x.q[e]);
              s += int32_t(k.s[2 * m + h]) * sh;
            }
            out = std::fma(float(s) * x.d, k.d, out);
          } else if constexpr (T == GgmlType::Q2_K) {
            int32_t s = 0, mn = 0;
            for (int h = 0; h < 2; h++) {
              int32_t sh = 0;
              for (int e = 16 * h; e < 16 * h + 16; e++) sh += int32_t(u[e]) * int32_t(x.q[e]);
              s += int32_t(k.s[2 * m + h]) * sh;
              mn += int32_t(k.mn[2 * m + h]) * int32_t(x.sum16[h]);
            }
            out = std::fma(std::fma(float(s), k.d, float(mn) * -k.dmin), x.d, out);
          } else if constexpr (T == GgmlType::IQ4_XS) {
            int32_t s = -k.off * x.sum;  // u = level + 128
            for (int e = 0; e < 32; e++) s += int32_t(u[e]) * int32_t(x.q[e]);
            out = std::fma(float(s) * x.d, k.d * float(k.s[2 * m]), out);
          } else {
            int32_t s = 0;
            for (int e = 0; e < 32; e++) s += int32_t(u[e]) * int32_t(x.q[e]);
            out = std::fma(float(s) * x.d, k.d * float(k.s[2 * m]), out);
            out = std::fma(-k.dmin * float(k.mn[2 * m]), x.ds, out);
          }
        }
      }
    }
  }
  for (int c = 0; c < nc; c++)
    for (int r = 0; r < rows; r++) y[size_t(c) * ys + size_t(r)] = acc[c][r];
}

// F16, BF16 (float activations): per output two chains, the even and the odd elements of the
// row, each acc = fma(w, x, acc) in element order, and the output their sum. The AVX-512 tile does
// the same in each lane.
template <GgmlType T>
void portable_float(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t as, int nc, float* y, size_t ys,
                    int rows) {
  const TileLayout L = layout(T);
  float acc[2][kPackedMaxCols][kPackRows] = {};
  uint8_t blk[64];
  float w[kPackRows][32];
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* tile = tiles + size_t(b) * L.bytes;
    for (int r = 0; r < kPackRows; r++) {
      get_block(T, tile, r, blk);
      dequantize_row(T, blk, w[r], 32);
    }
    for (int c = 0; c < nc; c++) {
      const float* x = reinterpret_cast<const float*>(a + size_t(c) * as) + 32 * b;
      for (int r = 0; r < kPackRows; r++)
        for (int e = 0; e < 32; e++) acc[e % 2][c][r] = std::fma(w[r][e], x[e], acc[e % 2][c][r]);
    }
  }
  for (int c = 0; c < nc; c++)
    for (int r = 0; r < rows; r++) y[size_t(c) * ys + size_t(r)] = acc[0][c][r] + acc[1][c][r];
}

}  // namespace

bool packed_float(GgmlType t) { return t == GgmlType::F16 || t == GgmlType::BF16; }

bool packing_enabled(GgmlType t, int64_t cols) { return packing_enabled(t) && cols % layout(t).elems == 0; }

bool packable(GgmlType t) {
  switch (t) {  // every quantized type (since session 26), F16 and BF16 (session 37); F32 (biases, routers,
                // small tensors more often than matmul weights) stays in rows
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::Q8_0:
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
    case GgmlType::IQ4_NL: case GgmlType::IQ4_XS: case GgmlType::MXFP4:
    case GgmlType::F16: case GgmlType::BF16: return true;
    default: return false;
  }
}

bool packing_enabled(GgmlType t) {
  static const bool off = [] {
    const char* e = std::getenv("BATON_CPU_PACK");
    return e && std::strcmp(e, "0") == 0;
  }();
  if (off || !packable(t)) return false;
  switch (active_isa()) {
    // Every quantized type has a tile on both levels, and it beats the row kernel there (on AVX-512
    // since session 37: Q2_K, Q3_K, Q5_1, Q6_K and the level formats, docs/KERNELS.md), and so do
    // F16 and BF16 (AVX-512 since session 37, AVX2 since 38).
    case Isa::Avx512: return kernels_avx512().packed[int(t)] != nullptr;
    case Isa::Avx2: return kernels_avx2().packed[int(t)] != nullptr;
    case Isa::Scalar: break;
  }
  return false;
}

size_t packed_group_bytes(GgmlType t, int64_t cols) {
  const TileLayout L = layout(t);
  return size_t(cols / L.elems) * L.bytes;
}

size_t packed_bytes(GgmlType t, int64_t rows, int64_t cols) {
  const int64_t groups = (rows + kPackRows - 1) / kPackRows;
  return size_t(groups) * packed_group_bytes(t, cols);
}

void pack_matrix(const QMatrix& W, uint8_t* out, ThreadPool* pool) {
  const GgmlType t = W.type;
  BATON_CHECK(packable(t) && W.cols % layout(t).elems == 0);
  const size_t tb = layout(t).bytes, bb = row_bytes(t, layout(t).elems);  // a row's share of a tile
  const int64_t nb = W.cols / layout(t).elems, groups = (W.rows + kPackRows - 1) / kPackRows;
  auto group = [&](int g, int) {
    uint8_t* tiles = out + size_t(g) * size_t(nb) * tb;
    std::memset(tiles, 0, size_t(nb) * tb);
    for (int r = 0; r < kPackRows; r++) {
      const int64_t row = int64_t(g) * kPackRows + r;
      for (int64_t b = 0; b < nb; b++)
        put_block(t, row < W.rows ? W.row(row) + size_t(b) * bb : nullptr, r, tiles + size_t(b) * tb);
    }
  };
  if (pool && pool->size() > 1) pool->run(int(groups), std::ref(group));
  else for (int g = 0; g < int(groups); g++) group(g, 0);
}

void unpack_row(const QMatrix& W, int64_t r, float* out) {
  BATON_CHECK(W.packed && r >= 0 && r < W.rows);
  const GgmlType t = W.type;
  const size_t tb = layout(t).bytes, bb = row_bytes(t, layout(t).elems);
  const int64_t nb = W.cols / layout(t).elems;
  const uint8_t* tiles = W.packed + size_t(r / kPackRows) * size_t(nb) * tb;
  std::vector<uint8_t> row(size_t(nb) * bb);
  for (int64_t b = 0; b < nb; b++) get_block(t, tiles + size_t(b) * tb, int(r % kPackRows), row.data() + size_t(b) * bb);
  dequantize_row(t, row.data(), out, W.cols);
}

void FreeDeleter::operator()(uint8_t* p) const noexcept { std::free(p); }

// Packed weights stream through the cores once per step: a buffer of 2 MiB or more is placed on
// 2 MiB boundaries and offered to the kernel as huge pages (Linux THP in `madvise` mode), so the
// stream takes one TLB entry per 2 MiB instead of one per 4 KiB.
PackedBuffer alloc_packed(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  const bool huge = bytes >= kHuge;
  const size_t align = huge ? kHuge : 64, size = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, size);
  if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge) madvise(p, size, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
  return PackedBuffer(static_cast<uint8_t*>(p));
}

PackedFn packed_portable(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return portable_kernel<GgmlType::Q4_0>;
    case GgmlType::Q4_1: return portable_kernel<GgmlType::Q4_1>;
    case GgmlType::Q5_0: return portable_kernel<GgmlType::Q5_0>;
    case GgmlType::Q5_1: return portable_kernel<GgmlType::Q5_1>;
    case GgmlType::Q8_0: return portable_kernel<GgmlType::Q8_0>;
    case GgmlType::Q2_K: return portable_kquant<GgmlType::Q2_K>;
    case GgmlType::Q3_K: return portable_kquant<GgmlType::Q3_K>;
    case GgmlType::Q4_K: return portable_kquant<GgmlType::Q4_K>;
    case GgmlType::Q5_K: return portable_kquant<GgmlType::Q5_K>;
    case GgmlType::Q6_K: return portable_kquant<GgmlType::Q6_K>;
    case GgmlType::IQ4_NL: return portable_kernel<GgmlType::IQ4_NL>;
    case GgmlType::MXFP4: return portable_kernel<GgmlType::MXFP4>;
    case GgmlType::IQ4_XS: return portable_kquant<GgmlType::IQ4_XS>;
    case GgmlType::F16: return portable_float<GgmlType::F16>;
    case GgmlType::BF16: return portable_float<GgmlType::BF16>;
    default: return nullptr;
  }
}

void quant_q8_32s_portable(const float* x, int64_t n, void* out) {
  auto* o = static_cast<ActQ8_32s*>(out);
  for (int64_t b = 0; b < n / 32; b++, x += 32) {
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    int32_t half[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
      o[b].q[i] = int8_t(std::nearbyint(x[i] * id));
      half[i / 16] += o[b].q[i];
    }
    const int32_t sum = half[0] + half[1];
    o[b].d = d;
    o[b].sum = sum;
    o[b].ds = d * float(sum);
    o[b].sum16[0] = int16_t(half[0]);
    o[b].sum16[1] = int16_t(half[1]);
  }
}

}  // namespace baton::cpu
