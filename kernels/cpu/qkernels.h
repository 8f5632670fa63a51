// Internal to kernels/cpu: the activation formats, the per-ISA kernel tables, and the block
// decoders the scalar path (and the SIMD fallbacks for the less common types) share.
//
// Scheme: activations are quantized once per matmul call to 8 bits, in blocks that match the
// weight type's block (32 for the legacy formats, 256 with per-16 sums for the k-quants). Every
// weight value is written as d·s·(u − off) − m, with u an unsigned small integer, s an integer
// sub-block scale and off a per-type constant. Then a block's dot product with activations
// (dx, q) is  d·dx·Σ s·(Σ u·q − off·Σq) − m·dx·Σq : unsigned×signed 8-bit integer products
// (pmaddubsw, vpdpbusd), the offsets and minimums folded in through the activation sums.
// The IQ4 formats and MXFP4 fit the same scheme with u = level + 128 and off = 128 (their SIMD
// kernels move the level's sign onto the activations instead, as Q8_0's do); MXFP4's levels are
// its doubled E2M1 values and d its halved power-of-two scale (quant/blocks.h).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "quant/blocks.h"
#include "quant/types.h"

namespace baton::cpu {

// Activation block for the legacy formats: 32 values q·d, plus d·Σq for the offset/min terms.
struct ActQ8_32 {
  float d;
  float ds;
  int8_t q[32];
};
static_assert(sizeof(ActQ8_32) == 40);

// Activation block for the k-quants: ggml's Q8_K layout (d, 256 values, sums of each 16).
using ActQ8_256 = BlockQ8_K;

// Groups of four legacy blocks for the AVX-512 4-bit kernels: values 0..15 of blocks 0..3, then
// values 16..31 of blocks 0..3 (the order nibble unpacking produces), then the four d and d·Σq.
// A partial last group is padded with zero blocks.
struct ActQ8_32x4 {
  int8_t q[128];
  float d[4];
  float ds[4];
};
static_assert(sizeof(ActQ8_32x4) == 160);

// Activation block for the packed (row-interleaved) kernels: the integer Σq lets a kernel fold a
// weight offset into its integer sum (start at −off·Σq), ds = d·Σq serves the Q4_1/Q4_K/Q5_K
// minimums, and the sums of values 0..15 and 16..31 (|·| ≤ 2032) the offset of Q6_K's 16-element
// sub-blocks.
struct ActQ8_32s {
  float d;
  float ds;
  int32_t sum;
  int16_t sum16[2];
  int8_t q[32];
};
static_assert(sizeof(ActQ8_32s) == 48);

enum class ActKind { Float = 0, Q8_32 = 1, Q8_256 = 2, Q8_32x4 = 3, Q8_32s = 4 };
constexpr int kActKinds = 5;

// Bytes of one activation column of n elements in a given format.
inline size_t act_bytes(ActKind k, int64_t n) {
  switch (k) {
    case ActKind::Q8_32: return size_t(n / 32) * sizeof(ActQ8_32);
    case ActKind::Q8_256: return size_t(n / 256) * sizeof(ActQ8_256);
    case ActKind::Q8_32x4: return size_t((n / 32 + 3) / 4) * sizeof(ActQ8_32x4);
    case ActKind::Q8_32s: return size_t(n / 32) * sizeof(ActQ8_32s);
    case ActKind::Float: break;
  }
  return size_t(n) * sizeof(float);
}

// One row of weights against nc (1..4) activation columns: y[c·y_stride] = Σ w·x_c.
// n is the row length in elements; a points at column 0's activations, a_stride bytes apart.
using DotFn = void (*)(int64_t n, const uint8_t* w, const uint8_t* a, size_t a_stride, int nc, float* y,
                       size_t y_stride);
// Quantize n floats (a multiple of the format's block) into one activation column.
using QuantFn = void (*)(const float* x, int64_t n, void* out);
// One group of 16 packed rows (kernels/cpu/packed.h; nb = the row's 32-element blocks, i.e.
// nb tiles of a legacy or float type, nb / 8 of a k-quant) against nc (1..8) ActQ8_32s columns
// (float columns for F16, BF16): y[c·y_stride + r] for the group's first `rows` (1..16) rows.
// Each output's arithmetic is independent of nc.
using PackedFn = void (*)(int64_t nb, const uint8_t* tiles, const uint8_t* a, size_t a_stride, int nc, float* y,
                          size_t y_stride, int rows);
constexpr int kPackedMaxCols = 8;

constexpr int kTypeSlots = 40;  // indexed by the ggml type id (MXFP4 = 39 is the largest we use)

// One instruction-set level: per weight type the dot kernel and the activation format it reads,
// and per activation format its quantizer.
struct KernelTable {
  DotFn dot[kTypeSlots] = {};
  ActKind act[kTypeSlots] = {};
  QuantFn quant[kActKinds] = {};
  PackedFn packed[kTypeSlots] = {};  // null: the portable packed kernel (packed_portable) is used
};

// The portable (scalar) packed kernels and their activation quantizer, for ISA levels without
// tiled kernels of their own; also the reference the SIMD ones are tested against.
PackedFn packed_portable(GgmlType t);
void quant_q8_32s_portable(const float* x, int64_t n, void* out);
// Bytes of one packed group (16 rows of `cols` elements) of a packable type.
size_t packed_group_bytes(GgmlType t, int64_t cols);

const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();    // only call when the CPU has AVX2 + FMA + F16C
const KernelTable& kernels_avx512();  // only call when the CPU has AVX-512 F/BW/VL/VNNI

// ---- block decoders (scalar; shared by every ISA for the types without a dedicated kernel) ----

// A legacy block as value = d·(u − off) + m, element order.
struct LegacyBlock {
  uint8_t u[32];
  float d, m;
  int off;
};

// A k-quant super-block as value = d·s[i]·(u − off) − dmin·mn[i] for element e, i = e / 16.
struct KBlock {
  uint8_t u[256];
  int16_t s[16];
  int16_t mn[16];
  float d, dmin;
  int off;
};

inline void decode_legacy(GgmlType t, const uint8_t* p, LegacyBlock& o) {
  o.m = 0;
  o.off = 0;
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1: {
      const uint8_t* qs = t == GgmlType::Q4_0 ? reinterpret_cast<const BlockQ4_0*>(p)->qs
                                              : reinterpret_cast<const BlockQ4_1*>(p)->qs;
      for (int l = 0; l < 16; l++) {
        o.u[l] = qs[l] & 0x0F;
        o.u[l + 16] = qs[l] >> 4;
      }
      if (t == GgmlType::Q4_0) {
        o.d = fp16_to_f32(reinterpret_cast<const BlockQ4_0*>(p)->d);
        o.off = 8;
      } else {
        o.d = fp16_to_f32(reinterpret_cast<const BlockQ4_1*>(p)->d);
        o.m = fp16_to_f32(reinterpret_cast<const BlockQ4_1*>(p)->m);
      }
      return;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool one = t == GgmlType::Q5_1;
      const uint8_t* qs = one ? reinterpret_cast<const BlockQ5_1*>(p)->qs : reinterpret_cast<const BlockQ5_0*>(p)->qs;
      const uint8_t* qhp = one ? reinterpret_cast<const BlockQ5_1*>(p)->qh : reinterpret_cast<const BlockQ5_0*>(p)->qh;
      uint32_t qh;
      std::memcpy(&qh, qhp, 4);
      for (int l = 0; l < 16; l++) {
        o.u[l] = uint8_t((qs[l] & 0x0F) | (((qh >> l) & 1) << 4));
        o.u[l + 16] = uint8_t((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
      }
      if (one) {
        o.d = fp16_to_f32(reinterpret_cast<const BlockQ5_1*>(p)->d);
        o.m = fp16_to_f32(reinterpret_cast<const BlockQ5_1*>(p)->m);
      } else {
        o.d = fp16_to_f32(reinterpret_cast<const BlockQ5_0*>(p)->d);
        o.off = 16;
      }
      return;
    }
    case GgmlType::Q8_0: {
      const auto* b = reinterpret_cast<const BlockQ8_0*>(p);
      for (int l = 0; l < 32; l++) o.u[l] = uint8_t(b->qs[l] ^ int8_t(-128));  // q + 128
      o.d = fp16_to_f32(b->d);
      o.off = 128;
      return;
    }
    case GgmlType::IQ4_NL: {  // the level + 128, as Q8_0
      const auto* b = reinterpret_cast<const BlockIQ4_NL*>(p);
      for (int l = 0; l < 16; l++) {
        o.u[l] = uint8_t(kIQ4Values[b->qs[l] & 0x0F] + 128);
        o.u[l + 16] = uint8_t(kIQ4Values[b->qs[l] >> 4] + 128);
      }
      o.d = fp16_to_f32(b->d);
      o.off = 128;
      return;
    }
    case GgmlType::MXFP4: {  // the doubled E2M1 value + 128, d = 2^(e − 128)
      const auto* b = reinterpret_cast<const BlockMXFP4*>(p);
      for (int l = 0; l < 16; l++) {
        o.u[l] = uint8_t(kMXFP4Values[b->qs[l] & 0x0F] + 128);
        o.u[l + 16] = uint8_t(kMXFP4Values[b->qs[l] >> 4] + 128);
      }
      o.d = mxfp4_scale(b->e);
      o.off = 128;
      return;
    }
    default: return;
  }
}

inline void decode_k(GgmlType t, const uint8_t* p, KBlock& o) {
  o.off = 0;
  o.dmin = 0;
  switch (t) {
    case GgmlType::Q2_K: {
      const auto* b = reinterpret_cast<const BlockQ2_K*>(p);
      o.d = fp16_to_f32(b->d);
      o.dmin = fp16_to_f32(b->dmin);
      for (int i = 0; i < 16; i++) {
        o.s[i] = b->scales[i] & 0x0F;
        o.mn[i] = b->scales[i] >> 4;
      }
      for (int e = 0; e < 256; e++) {
        const int half = e / 128, shift = 2 * ((e % 128) / 32), idx = e % 32;
        o.u[e] = (b->qs[32 * half + idx] >> shift) & 3;
      }
      return;
    }
    case GgmlType::Q3_K: {
      const auto* b = reinterpret_cast<const BlockQ3_K*>(p);
      o.d = fp16_to_f32(b->d);
      const uint8_t* s = b->scales;
      for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? (s[j] & 0x0F) : (s[j - 8] >> 4);
        const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        o.s[j] = int16_t((low | (high << 4)) - 32);
        o.mn[j] = 0;
      }
      for (int e = 0; e < 256; e++) {
        const int half = e / 128, sh = (e % 128) / 32, idx = e % 32;
        const int lo = (b->qs[32 * half + idx] >> (2 * sh)) & 3;
        const int hi = (b->hmask[idx] >> (4 * half + sh)) & 1;
        o.u[e] = uint8_t(lo | (hi << 2));  // value = lo − (hi ? 0 : 4) = u − 4
      }
      o.off = 4;
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = t == GgmlType::Q5_K;
      const uint8_t* scales = five ? reinterpret_cast<const BlockQ5_K*>(p)->scales : reinterpret_cast<const BlockQ4_K*>(p)->scales;
      const uint8_t* qs = five ? reinterpret_cast<const BlockQ5_K*>(p)->qs : reinterpret_cast<const BlockQ4_K*>(p)->qs;
      const uint16_t dh = five ? reinterpret_cast<const BlockQ5_K*>(p)->d : reinterpret_cast<const BlockQ4_K*>(p)->d;
      const uint16_t mh = five ? reinterpret_cast<const BlockQ5_K*>(p)->dmin : reinterpret_cast<const BlockQ4_K*>(p)->dmin;
      o.d = fp16_to_f32(dh);
      o.dmin = fp16_to_f32(mh);
      for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        k_scale_min(j, scales, sc, mn);
        o.s[2 * j] = o.s[2 * j + 1] = sc;
        o.mn[2 * j] = o.mn[2 * j + 1] = mn;
      }
      for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
          o.u[64 * c + l] = qs[32 * c + l] & 0x0F;
          o.u[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
      if (five) {
        const uint8_t* qh = reinterpret_cast<const BlockQ5_K*>(p)->qh;
        for (int c = 0; c < 4; c++)
          for (int l = 0; l < 32; l++) {
            o.u[64 * c + l] |= uint8_t(((qh[l] >> (2 * c)) & 1) << 4);
            o.u[64 * c + 32 + l] |= uint8_t(((qh[l] >> (2 * c + 1)) & 1) << 4);
          }
      }
      return;
    }
    case GgmlType::Q6_K: {
      const auto* b = reinterpret_cast<const BlockQ6_K*>(p);
      o.d = fp16_to_f32(b->d);
      for (int i = 0; i < 16; i++) {
        o.s[i] = b->scales[i];
        o.mn[i] = 0;
      }
      for (int half = 0; half < 2; half++) {
        const uint8_t* ql = b->ql + 64 * half;
        const uint8_t* qh = b->qh + 32 * half;
        uint8_t* u = o.u + 128 * half;
        for (int l = 0; l < 32; l++) {
          u[l] = uint8_t((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4));
          u[l + 32] = uint8_t((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
          u[l + 64] = uint8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
          u[l + 96] = uint8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
      }
      o.off = 32;
      return;
    }
    case GgmlType::IQ4_XS: {  // the level + 128; both 16-groups of a sub-block share its scale
      const auto* b = reinterpret_cast<const BlockIQ4_XS*>(p);
      o.d = fp16_to_f32(b->d);
      for (int ib = 0; ib < 8; ib++) {
        o.s[2 * ib] = o.s[2 * ib + 1] = int16_t(iq4xs_scale(*b, ib));
        o.mn[2 * ib] = o.mn[2 * ib + 1] = 0;
        for (int l = 0; l < 16; l++) {
          o.u[32 * ib + l] = uint8_t(kIQ4Values[b->qs[16 * ib + l] & 0x0F] + 128);
          o.u[32 * ib + 16 + l] = uint8_t(kIQ4Values[b->qs[16 * ib + l] >> 4] + 128);
        }
      }
      o.off = 128;
      return;
    }
    default: return;
  }
}

inline bool is_legacy_quant(GgmlType t) {
  return t == GgmlType::Q4_0 || t == GgmlType::Q4_1 || t == GgmlType::Q5_0 || t == GgmlType::Q5_1 ||
         t == GgmlType::Q8_0 || t == GgmlType::IQ4_NL || t == GgmlType::MXFP4;
}
inline bool is_k_quant(GgmlType t) {  // 256-element super-blocks (IQ4_XS included)
  return t == GgmlType::Q2_K || t == GgmlType::Q3_K || t == GgmlType::Q4_K || t == GgmlType::Q5_K ||
         t == GgmlType::Q6_K || t == GgmlType::IQ4_XS;
}

}  // namespace baton::cpu
