// Per-type device code for the packed weight layout (layout.h): how one thread loads a "unit" of a
// row with 16-byte loads, dots it with 8-bit activations (dp4a) or F32 activations, and expands it
// to floats. A loaded W holds the bytes as they came (scales as raw half bits): no instruction
// waits for a load until dot() or dequant() uses it, so a kernel can keep loads in flight while it
// sums earlier units. Units are small (8..64 elements) so that consecutive lanes read consecutive bytes.
// The list of types lives in BATON_CUDA_WEIGHT_TYPES; with_weight_type() is the one switch over it.
// Compiled by a host compiler (no __CUDACC__) the same code runs on the CPU with plain C++
// stand-ins for the intrinsics (host_emulation.h), so tests check the bit logic without a GPU.
#pragma once
#if defined(__CUDACC__) || defined(BATON_CUDA_SIM)  // nvcc, or the CUDA simulator (kernels/cuda_sim)
#include "kernels/cuda/common.cuh"
#define BATON_DEV __device__ __forceinline__
#define BATON_UNROLL _Pragma("unroll")
#else
#include "kernels/cuda/host_emulation.h"
#define BATON_DEV inline
#define BATON_UNROLL
#endif

namespace baton::cuda {

// The 8-bit activations: per column `cols` int8 values and a (d, d·Σq) pair per 32 values.
struct Act {
  const int8_t* qs = nullptr;
  const float2* ds = nullptr;
  const float* x = nullptr;  // the F32 activations, for float weights
  int64_t cols = 0;
  BATON_DEV const int8_t* q(int j) const { return qs + j * cols; }
  BATON_DEV const float2* d(int j) const { return ds + j * (cols / 32); }
  BATON_DEV const float* f(int j) const { return x + j * cols; }
};

BATON_DEV uint4 ld16(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
BATON_DEV int4 ld16s(const int8_t* p) { return __ldg(reinterpret_cast<const int4*>(p)); }
BATON_DEV uint2 ld8(const uint8_t* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
BATON_DEV uint16_t ld2(const uint8_t* p) { return __ldg(reinterpret_cast<const unsigned short*>(p)); }
BATON_DEV uint32_t ld4(const uint8_t* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }
// Word i of a 16-byte vector by selects, not `(&v.x)[i]`: with an index known only at run time
// (the k-quants' scale bytes) indexing puts the vector in local memory (ptxas: a stack frame in
// every k-quant GEMV); selects keep it in registers and fold away for a constant index.
BATON_DEV uint32_t word(const uint4& v, int i) { return i < 2 ? (i == 0 ? v.x : v.y) : (i == 2 ? v.z : v.w); }
BATON_DEV int word(const int4& v, int i) { return i < 2 ? (i == 0 ? v.x : v.y) : (i == 2 ? v.z : v.w); }
BATON_DEV uint32_t byte_of(const uint4& v, int i) { return (word(v, i >> 2) >> (8 * (i & 3))) & 0xFF; }

constexpr uint32_t kLo4 = 0x0F0F0F0Fu;

// Emit 8 consecutive values starting at element e0 of the row.
#define BATON_PUT8(put, e0, expr) \
  do {                           \
    float v_[8];                 \
    for (int i_ = 0; i_ < 8; i_++) v_[i_] = (expr); \
    put(e0, v_);                 \
  } while (0)

// ---- legacy 32-element blocks: quant bytes of all blocks, then the scales ----

struct TQ4_0 {
  static constexpr GgmlType type = GgmlType::Q4_0;
  static constexpr int unit = 32, unroll = 4;
  static constexpr bool q8 = true;
  struct W { uint4 q; uint32_t dh; };  // dh: the half bits of d
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    return {ld16(row + u * 16), ld2(row + cols / 2 + u * 2)};
  }
  BATON_DEV static float d(const W& w) { return half_bits_to_float(uint16_t(w.dh)); }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int4 x0 = ld16s(a.q(j) + u * 32), x1 = ld16s(a.q(j) + u * 32 + 16);
    int s = 0;
BATON_UNROLL
    for (int t = 0; t < 4; t++) {
      s = __dp4a(int(word(w.q, t) & kLo4), word(x0, t), s);         // elements 4t..4t+3
      s = __dp4a(int((word(w.q, t) >> 4) & kLo4), word(x1, t), s);  // elements 16+4t..
    }
    const float2 ds = a.d(j)[u];
    return d(w) * (ds.x * float(s) - 8.0f * ds.y);
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
BATON_UNROLL
    for (int g = 0; g < 4; g++)  // g < 2: low nibbles of bytes 8g.., else high nibbles
      BATON_PUT8(put, u * 32 + 8 * g,
                 d(w) * (float((byte_of(w.q, (8 * g + i_) & 15) >> (g < 2 ? 0 : 4)) & 15) - 8.0f));
  }
};

struct TQ4_1 {
  static constexpr GgmlType type = GgmlType::Q4_1;
  static constexpr int unit = 32, unroll = 4;
  static constexpr bool q8 = true;
  struct W { uint4 q; uint32_t dm; };  // dm: the half bits of d (low) and m (high)
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    return {ld16(row + u * 16), ld4(row + cols / 2 + u * 4)};
  }
  BATON_DEV static float d(const W& w) { return half_bits_to_float(uint16_t(w.dm)); }
  BATON_DEV static float m(const W& w) { return half_bits_to_float(uint16_t(w.dm >> 16)); }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int4 x0 = ld16s(a.q(j) + u * 32), x1 = ld16s(a.q(j) + u * 32 + 16);
    int s = 0;
BATON_UNROLL
    for (int t = 0; t < 4; t++) {
      s = __dp4a(int(word(w.q, t) & kLo4), word(x0, t), s);
      s = __dp4a(int((word(w.q, t) >> 4) & kLo4), word(x1, t), s);
    }
    const float2 ds = a.d(j)[u];
    return d(w) * ds.x * float(s) + m(w) * ds.y;
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
BATON_UNROLL
    for (int g = 0; g < 4; g++)
      BATON_PUT8(put, u * 32 + 8 * g,
                 d(w) * float((byte_of(w.q, (8 * g + i_) & 15) >> (g < 2 ? 0 : 4)) & 15) + m(w));
  }
};

// Q5_0 / Q5_1: the low nibbles as in Q4, the fifth bits (qh, bit e for element e of the block)
// spread to bit 4 of each byte before the dot. The packed scale run per block is [d, qh] (6 bytes,
// 2-byte aligned) or [d, m, qh] (8 bytes).
BATON_DEV uint32_t fifth_bits(uint32_t qh, int e0) {  // bits e0..e0+3 of qh -> bit 4 of bytes 0..3
  const uint32_t h = (qh >> e0) & 15;
  return ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25);
}

template <bool Min>
struct TQ5 {
  static constexpr GgmlType type = Min ? GgmlType::Q5_1 : GgmlType::Q5_0;
  static constexpr int unit = 32, unroll = 4;
  static constexpr bool q8 = true;
  // dm: the half bits of d (low) and, for Q5_1, m (high); qh: the fifth bits, in two halves for
  // Q5_0 (its 6-byte scale run leaves them 2-byte aligned)
  struct W { uint4 q; uint32_t dm, qh0, qh1; };
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    if constexpr (Min) {
      const uint8_t* s = row + cols / 2 + u * 8;
      return {ld16(row + u * 16), ld4(s), ld4(s + 4), 0u};
    } else {
      const uint8_t* s = row + cols / 2 + u * 6;
      return {ld16(row + u * 16), ld2(s), ld2(s + 2), ld2(s + 4)};
    }
  }
  BATON_DEV static float d(const W& w) { return half_bits_to_float(uint16_t(w.dm)); }
  BATON_DEV static float m(const W& w) { return Min ? half_bits_to_float(uint16_t(w.dm >> 16)) : 0.0f; }
  BATON_DEV static uint32_t qh(const W& w) { return Min ? w.qh0 : w.qh0 | (w.qh1 << 16); }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int4 x0 = ld16s(a.q(j) + u * 32), x1 = ld16s(a.q(j) + u * 32 + 16);
    const uint32_t h = qh(w);
    int s = 0;
BATON_UNROLL
    for (int t = 0; t < 4; t++) {
      s = __dp4a(int((word(w.q, t) & kLo4) | fifth_bits(h, 4 * t)), word(x0, t), s);
      s = __dp4a(int(((word(w.q, t) >> 4) & kLo4) | fifth_bits(h, 16 + 4 * t)), word(x1, t), s);
    }
    const float2 ds = a.d(j)[u];
    if constexpr (Min) return d(w) * ds.x * float(s) + m(w) * ds.y;
    else return d(w) * (ds.x * float(s) - 16.0f * ds.y);
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    const uint32_t h = qh(w);
BATON_UNROLL
    for (int g = 0; g < 4; g++)  // element e = 8g + i: nibble of byte e & 15, fifth bit e of qh
      BATON_PUT8(put, u * 32 + 8 * g,
                 d(w) * (float(((byte_of(w.q, (8 * g + i_) & 15) >> (g < 2 ? 0 : 4)) & 15) |
                               (((h >> (8 * g + i_)) & 1) << 4)) - (Min ? 0.0f : 16.0f)) + m(w));
  }
};
using TQ5_0 = TQ5<false>;
using TQ5_1 = TQ5<true>;

struct TQ8_0 {
  static constexpr GgmlType type = GgmlType::Q8_0;
  static constexpr int unit = 32, unroll = 2;
  static constexpr bool q8 = true;
  struct W { uint4 q0, q1; uint32_t dh; };  // dh: the half bits of d
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    return {ld16(row + u * 32), ld16(row + u * 32 + 16), ld2(row + cols + u * 2)};
  }
  BATON_DEV static float d(const W& w) { return half_bits_to_float(uint16_t(w.dh)); }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int4 x0 = ld16s(a.q(j) + u * 32), x1 = ld16s(a.q(j) + u * 32 + 16);
    int s = 0;
BATON_UNROLL
    for (int t = 0; t < 4; t++) {
      s = __dp4a(int(word(w.q0, t)), word(x0, t), s);
      s = __dp4a(int(word(w.q1, t)), word(x1, t), s);
    }
    return d(w) * a.d(j)[u].x * float(s);
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
BATON_UNROLL
    for (int g = 0; g < 4; g++)
      BATON_PUT8(put, u * 32 + 8 * g,
                 d(w) * float(int8_t(byte_of(g < 2 ? w.q0 : w.q1, (8 * g + i_) & 15))));
  }
};

// ---- IQ4 and MXFP4: 4-bit indices into 16 signed levels (kIQ4Values, kMXFP4Values) ----

// A level table L's levels as four words of four bytes (levels 0..3, 4..7, 8..11, 12..15).
template <const int8_t* L>
constexpr uint32_t level_word(int k) {
  uint32_t w = 0;
  for (int i = 0; i < 4; i++) w |= uint32_t(uint8_t(L[4 * k + i])) << (8 * i);
  return w;
}
// Four indices (one per byte, 0..15) -> their four signed levels: two byte permutes pick from
// levels 0..7 and 8..15 by the index's low 3 bits, bit 3 chooses between them.
template <const int8_t* L = kIQ4Values>
BATON_DEV uint32_t iq4_levels4(uint32_t idx) {
  constexpr uint32_t w0 = level_word<L>(0), w1 = level_word<L>(1), w2 = level_word<L>(2), w3 = level_word<L>(3);
  const uint32_t t = idx & 0x07070707u, nib = t | (t >> 4);
  const uint32_t sel = (nib & 0xFFu) | ((nib >> 8) & 0xFF00u);  // index i's low bits in nibble i
  const uint32_t lo = __byte_perm(w0, w1, sel), hi = __byte_perm(w2, w3, sel);
  const uint32_t upper = ((idx >> 3) & 0x01010101u) * 0xFFu;
  return (lo & ~upper) | (hi & upper);
}
template <const int8_t* L = kIQ4Values>
BATON_DEV float iq4_level(uint32_t idx) { return float(int8_t(iq4_levels4<L>(idx) & 0xFF)); }

// The 32 levels of a 16-byte unit (low nibbles: elements 0..15, high: 16..31) against activations.
template <const int8_t* L = kIQ4Values>
BATON_DEV int iq4_dot32(const uint4& q, const int4& x0, const int4& x1) {
  int s = 0;
BATON_UNROLL
  for (int t = 0; t < 4; t++) {
    s = __dp4a(int(iq4_levels4<L>(word(q, t) & kLo4)), word(x0, t), s);
    s = __dp4a(int(iq4_levels4<L>((word(q, t) >> 4) & kLo4)), word(x1, t), s);
  }
  return s;
}
// A 16-byte unit's 32 levels times the scale w, as put() wants them (elements 8g..8g+7 of the unit).
template <const int8_t* L, class P>
BATON_DEV void levels_dequant(const uint4& q, float w, int u, P&& put) {
BATON_UNROLL
  for (int g = 0; g < 4; g++)
    BATON_PUT8(put, u * 32 + 8 * g, w * iq4_level<L>((byte_of(q, (8 * g + i_) & 15) >> (g < 2 ? 0 : 4)) & 15));
}

// IQ4_NL: Q4_0's blocks and packed layout, levels instead of nibble − 8.
struct TIQ4_NL : TQ4_0 {
  static constexpr GgmlType type = GgmlType::IQ4_NL;
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int s = iq4_dot32(w.q, ld16s(a.q(j) + u * 32), ld16s(a.q(j) + u * 32 + 16));
    return d(w) * a.d(j)[u].x * float(s);
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    levels_dequant<kIQ4Values>(w.q, d(w), u, put);
  }
};

// MXFP4: IQ4_NL's nibbles indexing the doubled E2M1 values kMXFP4Values, and a one-byte E8M0 scale
// run (the packed row: 16 quant bytes per block, then one exponent byte per block). The halved scale
// 2^(e − 128) is built exactly from its bits as mxfp4_scale does (e = 0, 1: float32 subnormals).
// The GEMV keeps it exact: dx·Σ level·q is formed first, d multiplies last. The prefill's FP16
// expansion rounds as FP16 does: values under 2^-14 lose bits (e ≤ 114 for the smallest level),
// under 2^-25 become 0, past 65504 become inf (e ≥ 141 with level ±12).
BATON_DEV float mxfp4_scale_dev(uint32_t e) {
  return __uint_as_float(e >= 2 ? (e - 1) << 23 : 0x00200000u << e);
}
struct TMXFP4 {
  static constexpr GgmlType type = GgmlType::MXFP4;
  static constexpr int unit = 32, unroll = 4;
  static constexpr bool q8 = true;
  // e4: the aligned word of the exponent run holding block u's byte (byte u & 3; a word, not a byte
  // load: byte loads in a GEMV are what tests/check_cuda_resources.py flags as split weight reads;
  // the run starts 16-byte aligned and the row's padding covers the last word)
  struct W { uint4 q; uint32_t e4; };
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    return {ld16(row + u * 16), ld4(row + cols / 2 + (u & ~3))};
  }
  BATON_DEV static float d(const W& w, int u) { return mxfp4_scale_dev((w.e4 >> (8 * (u & 3))) & 0xFF); }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int s = iq4_dot32<kMXFP4Values>(w.q, ld16s(a.q(j) + u * 32), ld16s(a.q(j) + u * 32 + 16));
    return d(w, u) * (a.d(j)[u].x * float(s));
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    levels_dequant<kMXFP4Values>(w.q, d(w, u), u, put);
  }
};

// IQ4_XS packed: the 128 quant bytes of every super-block, then their 8-byte headers
// [d, scales_h][scales_l 4]. A unit is one 32-element sub-block (16 quant bytes).
struct TIQ4_XS {
  static constexpr GgmlType type = GgmlType::IQ4_XS;
  static constexpr int unit = 32, unroll = 4;
  static constexpr bool q8 = true;
  struct W { uint4 q; uint32_t h0, h1; };  // h0: d | scales_h << 16; h1: scales_l
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    const uint8_t* h = row + (cols / 256) * 128 + (u >> 3) * 8;
    return {ld16(row + u * 16), ld4(h), ld4(h + 4)};
  }
  BATON_DEV static float scale(const W& w, int u) {  // d · (ls − 32) of sub-block u & 7
    const int ib = u & 7;
    const int ls = int((w.h1 >> (4 * ib)) & 15) | int(((w.h0 >> (16 + 2 * ib)) & 3) << 4);
    return half_bits_to_float(uint16_t(w.h0)) * float(ls - 32);
  }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int s = iq4_dot32(w.q, ld16s(a.q(j) + u * 32), ld16s(a.q(j) + u * 32 + 16));
    return scale(w, u) * a.d(j)[u].x * float(s);
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    levels_dequant<kIQ4Values>(w.q, scale(w, u), u, put);
  }
};

// ---- k-quants: a unit is 64 elements (a quarter of a 256-element super-block) ----

// 6-bit scale and min of sub-block j (0..7) from the 12 scale bytes held in h.y, h.z, h.w.
BATON_DEV void k_scale_min_dev(const uint4& h, int j, float& sc, float& mn) {
  auto s = [&](int i) { return byte_of(h, 4 + i); };
  if (j < 4) {
    sc = float(s(j) & 63);
    mn = float(s(j + 4) & 63);
  } else {
    sc = float((s(j + 4) & 0x0F) | ((s(j - 4) >> 6) << 4));
    mn = float((s(j + 4) >> 4) | ((s(j) >> 6) << 4));
  }
}

// Q2_K / Q3_K: element 128h + 32j + 16p + l of a super-block sits in bits 2j of qs byte
// 32h + 16p + l (Q3_K: its third bit in bit 4h + j of hmask byte 16p + l) and has sub-block scale
// 8h + 2j + p. A unit c = 2h + p (64 elements) is 16 qs bytes: four 16-element groups j, group j
// meeting the first (p = 0) or second half of activation block 4h + j.
BATON_DEV uint32_t crumbs(uint32_t q, int j) { return (q >> (2 * j)) & 0x03030303u; }
// Σ of 16 activations (for a per-16 minimum or offset; the activation pairs hold per-32 sums).
BATON_DEV int sum16(const int4& x) {
  int s = 0;
BATON_UNROLL
  for (int t = 0; t < 4; t++) s = __dp4a(0x01010101, word(x, t), s);
  return s;
}

// Q2_K packed: [scales 16][qs 64] per super-block, then [d, dmin] of every super-block.
struct TQ2_K {
  static constexpr GgmlType type = GgmlType::Q2_K;
  static constexpr int unit = 64, unroll = 2;
  static constexpr bool q8 = true;
  // sc: scale bytes 8h..8h+7 (the unit's four are 8h + p + 2j); dm: the half bits of d and dmin
  struct W { uint2 sc; uint4 q; uint32_t dm; };
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    const uint8_t* b = row + (u >> 2) * 80;
    return {ld8(b + 8 * ((u >> 1) & 1)), ld16(b + 16 + 16 * (u & 3)), ld4(row + (cols / 256) * 80 + (u >> 2) * 4)};
  }
  BATON_DEV static uint32_t scale_byte(const W& w, int j, int p) {  // sub-block 8h + 2j + p
    return ((j < 2 ? w.sc.x : w.sc.y) >> (8 * (2 * (j & 1) + p))) & 0xFF;
  }
  BATON_DEV static float dot(const W& w, const Act& a, int j0, int u) {
    const int h = (u >> 1) & 1, p = u & 1;
    const int8_t* x = a.q(j0) + (u >> 2) * 256 + 128 * h + 16 * p;
    const float2* ds = a.d(j0) + (u >> 2) * 8 + 4 * h;
    float acc = 0.0f, accm = 0.0f;
BATON_UNROLL
    for (int j = 0; j < 4; j++) {
      const int4 xj = ld16s(x + 32 * j);
      int s = 0;
BATON_UNROLL
      for (int t = 0; t < 4; t++) s = __dp4a(int(crumbs(word(w.q, t), j)), word(xj, t), s);
      const uint32_t sc = scale_byte(w, j, p);
      acc += ds[j].x * float(int(sc & 15) * s);
      accm += ds[j].x * float(int(sc >> 4) * sum16(xj));
    }
    return half_bits_to_float(uint16_t(w.dm)) * acc - half_bits_to_float(uint16_t(w.dm >> 16)) * accm;
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    const int h = (u >> 1) & 1, p = u & 1;
    const float d = half_bits_to_float(uint16_t(w.dm)), dmin = half_bits_to_float(uint16_t(w.dm >> 16));
    const int e0 = (u >> 2) * 256 + 128 * h + 16 * p;
BATON_UNROLL
    for (int g = 0; g < 8; g++) {  // group j = g / 2, elements 8(g & 1)..+7 of its 16
      const int j = g >> 1;
      const uint32_t sc = scale_byte(w, j, p);
      const float dl = d * float(sc & 15), ml = dmin * float(sc >> 4);
      BATON_PUT8(put, e0 + 32 * j + 8 * (g & 1), dl * float((byte_of(w.q, 8 * (g & 1) + i_) >> (2 * j)) & 3) - ml);
    }
  }
};

// Q3_K packed: [hmask 32][qs 64] per super-block, then [scales 12][d][2 bytes of padding] of every
// super-block.
struct TQ3_K {
  static constexpr GgmlType type = GgmlType::Q3_K;
  static constexpr int unit = 64, unroll = 2;
  static constexpr bool q8 = true;
  struct W { uint4 hm, q, s; };  // s: the 12 scale bytes, then d's half bits
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    const uint8_t* b = row + (u >> 2) * 96;
    return {ld16(b + 16 * (u & 1)), ld16(b + 32 + 16 * (u & 3)), ld16(row + (cols / 256) * 96 + (u >> 2) * 16)};
  }
  BATON_DEV static uint32_t sbyte(const W& w, int i) { return byte_of(w.s, i); }  // scale byte i (0..11)
  // The signed 6-bit scale of sub-block 8h + 2j + p.
  BATON_DEV static int scale(const W& w, int h, int j, int p) {
    const int i = 2 * j + p;  // 0..7
    const int low = int(sbyte(w, i) >> (4 * h)) & 15, high = int(sbyte(w, 8 + i % 4) >> (2 * (2 * h + j / 2))) & 3;
    return (low | (high << 4)) - 32;
  }
  // Signed 3-bit values (−4..3) of group j, byte-lane word t.
  BATON_DEV static int q3(const W& w, int h, int j, int t) {
    const uint32_t hb = (word(w.hm, t) >> (4 * h + j)) & 0x01010101u;
    return int(__vsub4(crumbs(word(w.q, t), j) | (hb << 2), 0x04040404u));
  }
  BATON_DEV static float dot(const W& w, const Act& a, int j0, int u) {
    const int h = (u >> 1) & 1, p = u & 1;
    const int8_t* x = a.q(j0) + (u >> 2) * 256 + 128 * h + 16 * p;
    const float2* ds = a.d(j0) + (u >> 2) * 8 + 4 * h;
    float acc = 0.0f;
BATON_UNROLL
    for (int j = 0; j < 4; j++) {
      const int4 xj = ld16s(x + 32 * j);
      int s = 0;
BATON_UNROLL
      for (int t = 0; t < 4; t++) s = __dp4a(q3(w, h, j, t), word(xj, t), s);
      acc += ds[j].x * float(scale(w, h, j, p) * s);
    }
    return half_bits_to_float(uint16_t(w.s.w)) * acc;
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    const int h = (u >> 1) & 1, p = u & 1;
    const float d = half_bits_to_float(uint16_t(w.s.w));
    const int e0 = (u >> 2) * 256 + 128 * h + 16 * p;
BATON_UNROLL
    for (int g = 0; g < 8; g++) {  // group j = g / 2, byte-lane words 2(g & 1), 2(g & 1) + 1
      const int j = g >> 1, t0 = 2 * (g & 1);
      const int lo_w = q3(w, h, j, t0), hi_w = q3(w, h, j, t0 + 1);
      const float dl = d * float(scale(w, h, j, p));
      BATON_PUT8(put, e0 + 32 * j + 8 * (g & 1), dl * float(int8_t(((i_ < 4 ? lo_w : hi_w) >> (8 * (i_ & 3))) & 0xFF)));
    }
  }
};

struct TQ4_K {  // [d, dmin][scales 12][qs 128] = 144 bytes, 16-byte aligned as stored
  static constexpr GgmlType type = GgmlType::Q4_K;
  static constexpr int unit = 64, unroll = 2;
  static constexpr bool q8 = true;
  struct W { uint4 h, q0, q1; };
  BATON_DEV static W load(const uint8_t* row, int64_t, int u) {
    const uint8_t* b = row + (u >> 2) * 144;
    const int c = u & 3;
    return {ld16(b), ld16(b + 16 + 32 * c), ld16(b + 32 + 32 * c)};
  }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int c = u & 3;
    const int8_t* x = a.q(j) + (u >> 2) * 256 + 64 * c;
    const int4 xl0 = ld16s(x), xl1 = ld16s(x + 16), xh0 = ld16s(x + 32), xh1 = ld16s(x + 48);
    int s0 = 0, s1 = 0;
BATON_UNROLL
    for (int t = 0; t < 4; t++) {
      s0 = __dp4a(int(word(w.q0, t) & kLo4), word(xl0, t), s0);
      s0 = __dp4a(int(word(w.q1, t) & kLo4), word(xl1, t), s0);
      s1 = __dp4a(int((word(w.q0, t) >> 4) & kLo4), word(xh0, t), s1);
      s1 = __dp4a(int((word(w.q1, t) >> 4) & kLo4), word(xh1, t), s1);
    }
    float sc0, mn0, sc1, mn1;
    k_scale_min_dev(w.h, 2 * c, sc0, mn0);
    k_scale_min_dev(w.h, 2 * c + 1, sc1, mn1);
    const float2* ds = a.d(j) + (u >> 2) * 8 + 2 * c;
    const float d = half_bits_to_float(uint16_t(w.h.x)), dmin = half_bits_to_float(uint16_t(w.h.x >> 16));
    return d * (sc0 * ds[0].x * float(s0) + sc1 * ds[1].x * float(s1)) - dmin * (mn0 * ds[0].y + mn1 * ds[1].y);
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    const int c = u & 3;
    float sc0, mn0, sc1, mn1;
    k_scale_min_dev(w.h, 2 * c, sc0, mn0);
    k_scale_min_dev(w.h, 2 * c + 1, sc1, mn1);
    const float d = half_bits_to_float(uint16_t(w.h.x)), dmin = half_bits_to_float(uint16_t(w.h.x >> 16));
    const int e0 = (u >> 2) * 256 + 64 * c;
BATON_UNROLL
    for (int g = 0; g < 8; g++) {  // g < 4: low nibbles (sub-block 2c), else high (2c+1)
      const uint4& q = (g & 3) < 2 ? w.q0 : w.q1;
      const float dd = g < 4 ? d * sc0 : d * sc1, mm = g < 4 ? dmin * mn0 : dmin * mn1;
      BATON_PUT8(put, e0 + 8 * g, dd * float((byte_of(q, (8 * g + i_) & 15) >> (g < 4 ? 0 : 4)) & 15) - mm);
    }
  }
};

struct TQ5_K {  // [d, dmin][scales 12][qh 32][qs 128] = 176 bytes
  static constexpr GgmlType type = GgmlType::Q5_K;
  static constexpr int unit = 64, unroll = 2;
  static constexpr bool q8 = true;
  struct W { uint4 h, qh0, qh1, q0, q1; };
  BATON_DEV static W load(const uint8_t* row, int64_t, int u) {
    const uint8_t* b = row + (u >> 2) * 176;
    const int c = u & 3;
    return {ld16(b), ld16(b + 16), ld16(b + 32), ld16(b + 48 + 32 * c), ld16(b + 64 + 32 * c)};
  }
  // The 5-bit values of byte lane word t: `hi` selects the high nibbles (sub-block 2c+1).
  BATON_DEV static int q5(const W& w, int c, int t, bool hi) {
    const uint32_t q = t < 4 ? word(w.q0, t) : word(w.q1, t - 4);
    const uint32_t h = t < 4 ? word(w.qh0, t) : word(w.qh1, t - 4);
    const int shift = 2 * c + (hi ? 1 : 0);
    return int(((hi ? q >> 4 : q) & kLo4) | (((h >> shift) & 0x01010101u) << 4));
  }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int c = u & 3;
    const int8_t* x = a.q(j) + (u >> 2) * 256 + 64 * c;
    const int4 xl0 = ld16s(x), xl1 = ld16s(x + 16), xh0 = ld16s(x + 32), xh1 = ld16s(x + 48);
    int s0 = 0, s1 = 0;
BATON_UNROLL
    for (int t = 0; t < 4; t++) {
      s0 = __dp4a(q5(w, c, t, false), word(xl0, t), s0);
      s0 = __dp4a(q5(w, c, t + 4, false), word(xl1, t), s0);
      s1 = __dp4a(q5(w, c, t, true), word(xh0, t), s1);
      s1 = __dp4a(q5(w, c, t + 4, true), word(xh1, t), s1);
    }
    float sc0, mn0, sc1, mn1;
    k_scale_min_dev(w.h, 2 * c, sc0, mn0);
    k_scale_min_dev(w.h, 2 * c + 1, sc1, mn1);
    const float2* ds = a.d(j) + (u >> 2) * 8 + 2 * c;
    const float d = half_bits_to_float(uint16_t(w.h.x)), dmin = half_bits_to_float(uint16_t(w.h.x >> 16));
    return d * (sc0 * ds[0].x * float(s0) + sc1 * ds[1].x * float(s1)) - dmin * (mn0 * ds[0].y + mn1 * ds[1].y);
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    const int c = u & 3;
    float sc0, mn0, sc1, mn1;
    k_scale_min_dev(w.h, 2 * c, sc0, mn0);
    k_scale_min_dev(w.h, 2 * c + 1, sc1, mn1);
    const float d = half_bits_to_float(uint16_t(w.h.x)), dmin = half_bits_to_float(uint16_t(w.h.x >> 16));
    const int e0 = (u >> 2) * 256 + 64 * c;
BATON_UNROLL
    for (int g = 0; g < 8; g++) {  // 8 values = two byte-lane words t0, t0+1
      const bool hi = g >= 4;
      const int t0 = 2 * (g & 3);
      const int lo_w = q5(w, c, t0, hi), hi_w = q5(w, c, t0 + 1, hi);
      const float dd = hi ? d * sc1 : d * sc0, mm = hi ? dmin * mn1 : dmin * mn0;
      BATON_PUT8(put, e0 + 8 * g, dd * float(((i_ < 4 ? lo_w : hi_w) >> (8 * (i_ & 3))) & 0xFF) - mm);
    }
  }
};

// Q6_K packed: [ql 128][qh 64][scales 16] per super-block, then the d of every super-block.
// A unit is half n (128 elements) x 16-lane group h: elements 128n + 16h + 32m + (0..15), m = 0..3.
struct TQ6_K {
  static constexpr GgmlType type = GgmlType::Q6_K;
  static constexpr int unit = 64, unroll = 2;
  static constexpr bool q8 = true;
  struct W { uint4 la, lb, hh, sc; uint32_t dh; };  // dh: the half bits of the super-block's d
  BATON_DEV static W load(const uint8_t* row, int64_t cols, int u) {
    const int sb = u >> 2, n = (u >> 1) & 1, h = u & 1;
    const uint8_t* b = row + sb * 208;
    return {ld16(b + 64 * n + 16 * h), ld16(b + 64 * n + 32 + 16 * h), ld16(b + 128 + 32 * n + 16 * h),
            ld16(b + 192), ld2(row + (cols / 256) * 208 + sb * 2)};
  }
  BATON_DEV static float d(const W& w) { return half_bits_to_float(uint16_t(w.dh)); }
  // Signed 6-bit values (q - 32) of group m, byte-lane word t.
  BATON_DEV static int q6(const W& w, int m, int t) {
    const uint32_t la = word(w.la, t), lb = word(w.lb, t), h = word(w.hh, t);
    uint32_t q;
    switch (m) {
      case 0: q = (la & kLo4) | ((h << 4) & 0x30303030u); break;
      case 1: q = (lb & kLo4) | ((h << 2) & 0x30303030u); break;
      case 2: q = ((la >> 4) & kLo4) | (h & 0x30303030u); break;
      default: q = ((lb >> 4) & kLo4) | ((h >> 2) & 0x30303030u); break;
    }
    return int(__vsub4(q, 0x20202020u));
  }
  BATON_DEV static float scale(const W& w, int u, int m) {
    const int n = (u >> 1) & 1, h = u & 1;
    return float(int8_t(byte_of(w.sc, 8 * n + h + 2 * m)));
  }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const int sb = u >> 2, n = (u >> 1) & 1, h = u & 1;
    const int8_t* x = a.q(j) + sb * 256 + 128 * n + 16 * h;
    const float2* ds = a.d(j) + sb * 8 + 4 * n;
    float acc = 0.0f;
BATON_UNROLL
    for (int m = 0; m < 4; m++) {
      const int4 xm = ld16s(x + 32 * m);
      int s = 0;
BATON_UNROLL
      for (int t = 0; t < 4; t++) s = __dp4a(q6(w, m, t), word(xm, t), s);
      acc += scale(w, u, m) * ds[m].x * float(s);
    }
    return d(w) * acc;
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    const int sb = u >> 2, n = (u >> 1) & 1, h = u & 1;
    const int e0 = sb * 256 + 128 * n + 16 * h;
BATON_UNROLL
    for (int g = 0; g < 8; g++) {  // group m = g/2, words 2(g&1), 2(g&1)+1
      const int m = g >> 1, t0 = 2 * (g & 1);
      const int lo_w = q6(w, m, t0), hi_w = q6(w, m, t0 + 1);
      const float dd = d(w) * scale(w, u, m);
      BATON_PUT8(put, e0 + 32 * m + 8 * (g & 1),
                 dd * float(int8_t(((i_ < 4 ? lo_w : hi_w) >> (8 * (i_ & 3))) & 0xFF)));
    }
  }
};

// ---- float weights: a unit is 8 elements (16 bytes of F16/BF16, 32 of F32), F32 activations ----

template <GgmlType T>
struct TFloat {
  static constexpr GgmlType type = T;
  static constexpr int unit = 8, unroll = 4;
  static constexpr bool q8 = false;
  struct W { uint4 v0, v1; };
  BATON_DEV static W load(const uint8_t* row, int64_t, int u) {
    if constexpr (T == GgmlType::F32) return {ld16(row + u * 32), ld16(row + u * 32 + 16)};
    else return {ld16(row + u * 16), uint4{}};
  }
  BATON_DEV static float at(const W& w, int i) {  // i: constant
    if constexpr (T == GgmlType::F32) return __uint_as_float(i < 4 ? word(w.v0, i) : word(w.v1, i - 4));
    const uint16_t bits = uint16_t(word(w.v0, i >> 1) >> (16 * (i & 1)));
    if constexpr (T == GgmlType::F16) return half_bits_to_float(bits);
    else return bf16_bits_to_float(bits);
  }
  BATON_DEV static float dot(const W& w, const Act& a, int j, int u) {
    const float4* x = reinterpret_cast<const float4*>(a.f(j) + u * 8);
    const float4 x0 = __ldg(x), x1 = __ldg(x + 1);
    return at(w, 0) * x0.x + at(w, 1) * x0.y + at(w, 2) * x0.z + at(w, 3) * x0.w +
           at(w, 4) * x1.x + at(w, 5) * x1.y + at(w, 6) * x1.z + at(w, 7) * x1.w;
  }
  template <class P> BATON_DEV static void dequant(const W& w, int u, P&& put) {
    BATON_PUT8(put, u * 8, at(w, i_));
  }
};

// The one list of weight types the CUDA kernels handle, and the one switch over it.
#define BATON_CUDA_WEIGHT_TYPES(X) \
  X(::baton::cuda::TQ4_0) X(::baton::cuda::TQ4_1) X(::baton::cuda::TQ5_0) X(::baton::cuda::TQ5_1) X(::baton::cuda::TQ8_0) \
  X(::baton::cuda::TQ2_K) X(::baton::cuda::TQ3_K) X(::baton::cuda::TQ4_K) X(::baton::cuda::TQ5_K) \
  X(::baton::cuda::TQ6_K) \
  X(::baton::cuda::TIQ4_NL) X(::baton::cuda::TIQ4_XS) X(::baton::cuda::TMXFP4) \
  X(::baton::cuda::TFloat<::baton::GgmlType::F16>) X(::baton::cuda::TFloat<::baton::GgmlType::BF16>) \
  X(::baton::cuda::TFloat<::baton::GgmlType::F32>)

// Calls f(T{}) with the traits of weight type t.
template <class F>
void with_weight_type(GgmlType t, F&& f) {
  switch (t) {
#define BATON_CASE(T) case T::type: f(T{}); return;
    BATON_CUDA_WEIGHT_TYPES(BATON_CASE)
#undef BATON_CASE
    default:
      input_error(cat("CUDA backend: no kernel for weight type ", type_name(t)));
  }
}

}  // namespace baton::cuda
