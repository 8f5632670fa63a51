// Scalar reference dequantization for every compute type (and Q8_K). The test oracle:
// plain C++, no SIMD, no fast-math; each function decodes whole blocks in element order.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "quant/quant.h"

namespace baton {
namespace {

inline float h2f(uint16_t h) { return fp16_to_f32(h); }

void deq_q4_0(const BlockQ4_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += QK) {
    const float d = h2f(b[i].d);
    for (int l = 0; l < QK / 2; l++) {
      y[l] = float((b[i].qs[l] & 0x0F) - 8) * d;
      y[l + QK / 2] = float((b[i].qs[l] >> 4) - 8) * d;
    }
  }
}

void deq_q4_1(const BlockQ4_1* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += QK) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    for (int l = 0; l < QK / 2; l++) {
      y[l] = float(b[i].qs[l] & 0x0F) * d + m;
      y[l + QK / 2] = float(b[i].qs[l] >> 4) * d + m;
    }
  }
}

// Q5: the fifth bit of element l sits in bit l of the little-endian 32-bit qh.
void deq_q5_0(const BlockQ5_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += QK) {
    const float d = h2f(b[i].d);
    uint32_t qh;
    std::memcpy(&qh, b[i].qh, 4);
    for (int l = 0; l < QK / 2; l++) {
      const int lo = (b[i].qs[l] & 0x0F) | int(((qh >> l) & 1) << 4);
      const int hi = (b[i].qs[l] >> 4) | int(((qh >> (l + 16)) & 1) << 4);
      y[l] = float(lo - 16) * d;
      y[l + QK / 2] = float(hi - 16) * d;
    }
  }
}

void deq_q5_1(const BlockQ5_1* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += QK) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    uint32_t qh;
    std::memcpy(&qh, b[i].qh, 4);
    for (int l = 0; l < QK / 2; l++) {
      const int lo = (b[i].qs[l] & 0x0F) | int(((qh >> l) & 1) << 4);
      const int hi = (b[i].qs[l] >> 4) | int(((qh >> (l + 16)) & 1) << 4);
      y[l] = float(lo) * d + m;
      y[l + QK / 2] = float(hi) * d + m;
    }
  }
}

void deq_q8_0(const BlockQ8_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += QK) {
    const float d = h2f(b[i].d);
    for (int l = 0; l < QK; l++) y[l] = float(b[i].qs[l]) * d;
  }
}

// Q2_K: 16 sub-blocks of 16; scale byte = (min << 4) | scale.
void deq_q2_k(const BlockQ2_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    int is = 0;
    for (int half = 0; half < 2; half++, q += 32) {
      for (int shift = 0; shift < 8; shift += 2) {
        for (int part = 0; part < 2; part++) {
          const uint8_t sc = b[i].scales[is++];
          const float dl = d * float(sc & 0x0F), ml = dmin * float(sc >> 4);
          for (int l = 0; l < 16; l++) *y++ = dl * float((q[16 * part + l] >> shift) & 3) - ml;
        }
      }
    }
  }
}

// Q3_K: 2-bit low part in qs, high bit in hmask (a clear bit subtracts 4), 6-bit signed scales.
void deq_q3_k(const BlockQ3_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    const float d_all = h2f(b[i].d);
    const uint8_t* s = b[i].scales;
    int8_t scales[16];
    for (int j = 0; j < 16; j++) {
      const int low = j < 8 ? (s[j] & 0x0F) : (s[j - 8] >> 4);
      const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      scales[j] = int8_t((low | (high << 4)) - 32);
    }
    const uint8_t* q = b[i].qs;
    uint8_t m = 1;
    int is = 0;
    for (int half = 0; half < 2; half++, q += 32) {
      for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
        for (int part = 0; part < 2; part++) {
          const float dl = d_all * float(scales[is++]);
          for (int l = 0; l < 16; l++) {
            const int idx = 16 * part + l;
            const int v = ((q[idx] >> shift) & 3) - ((b[i].hmask[idx] & m) ? 0 : 4);
            *y++ = dl * float(v);
          }
        }
      }
    }
  }
}

void deq_q4_k(const BlockQ4_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int c = 0; c < 4; c++, q += 32) {
      uint8_t sc, mn;
      k_scale_min(2 * c, b[i].scales, sc, mn);
      const float d1 = d * float(sc), m1 = dmin * float(mn);
      k_scale_min(2 * c + 1, b[i].scales, sc, mn);
      const float d2 = d * float(sc), m2 = dmin * float(mn);
      for (int l = 0; l < 32; l++) *y++ = d1 * float(q[l] & 0x0F) - m1;
      for (int l = 0; l < 32; l++) *y++ = d2 * float(q[l] >> 4) - m2;
    }
  }
}

void deq_q5_k(const BlockQ5_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    const uint8_t* qh = b[i].qh;
    for (int c = 0; c < 4; c++, q += 32) {
      uint8_t sc, mn;
      k_scale_min(2 * c, b[i].scales, sc, mn);
      const float d1 = d * float(sc), m1 = dmin * float(mn);
      k_scale_min(2 * c + 1, b[i].scales, sc, mn);
      const float d2 = d * float(sc), m2 = dmin * float(mn);
      const uint8_t u1 = uint8_t(1u << (2 * c)), u2 = uint8_t(2u << (2 * c));
      for (int l = 0; l < 32; l++) *y++ = d1 * float((q[l] & 0x0F) + ((qh[l] & u1) ? 16 : 0)) - m1;
      for (int l = 0; l < 32; l++) *y++ = d2 * float((q[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    }
  }
}

void deq_q6_k(const BlockQ6_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    const float d = h2f(b[i].d);
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* sc = b[i].scales;
    for (int half = 0; half < 2; half++, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; l++) {
        const int is = l / 16;
        const int q1 = int((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = int((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * float(sc[is + 0]) * float(q1);
        y[l + 32] = d * float(sc[is + 2]) * float(q2);
        y[l + 64] = d * float(sc[is + 4]) * float(q3);
        y[l + 96] = d * float(sc[is + 6]) * float(q4);
      }
    }
  }
}

void deq_iq4_nl(const BlockIQ4_NL* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += QK) {
    const float d = h2f(b[i].d);
    for (int l = 0; l < QK / 2; l++) {
      y[l] = d * float(kIQ4Values[b[i].qs[l] & 0x0F]);
      y[l + QK / 2] = d * float(kIQ4Values[b[i].qs[l] >> 4]);
    }
  }
}

void deq_mxfp4(const BlockMXFP4* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, y += QK) {
    const float d = mxfp4_scale(b[i].e);  // a power of two: every product below is exact
    for (int l = 0; l < QK / 2; l++) {
      y[l] = d * float(kMXFP4Values[b[i].qs[l] & 0x0F]);
      y[l + QK / 2] = d * float(kMXFP4Values[b[i].qs[l] >> 4]);
    }
  }
}

void deq_iq4_xs(const BlockIQ4_XS* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++) {
    const float d = h2f(b[i].d);
    for (int ib = 0; ib < QK_K / 32; ib++, y += 32) {
      const float dl = d * float(iq4xs_scale(b[i], ib));
      const uint8_t* q = b[i].qs + 16 * ib;
      for (int l = 0; l < 16; l++) {
        y[l] = dl * float(kIQ4Values[q[l] & 0x0F]);
        y[l + 16] = dl * float(kIQ4Values[q[l] >> 4]);
      }
    }
  }
}

void deq_q8_k(const BlockQ8_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; i++)
    for (int l = 0; l < QK_K; l++) *y++ = b[i].d * float(b[i].qs[l]);
}

}  // namespace

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
  const int64_t nb = n / int64_t(traits(t).block_elems);
  if (nb * int64_t(traits(t).block_elems) != n) {
    std::fprintf(stderr, "baton: internal error: dequantize_row(%s) of %lld elements\n", type_name(t), (long long)n);
    std::abort();
  }
  switch (t) {
    case GgmlType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case GgmlType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; i++) dst[i] = fp16_to_f32(s[i]);
      return;
    }
    case GgmlType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case GgmlType::Q4_0: return deq_q4_0(static_cast<const BlockQ4_0*>(src), dst, nb);
    case GgmlType::Q4_1: return deq_q4_1(static_cast<const BlockQ4_1*>(src), dst, nb);
    case GgmlType::Q5_0: return deq_q5_0(static_cast<const BlockQ5_0*>(src), dst, nb);
    case GgmlType::Q5_1: return deq_q5_1(static_cast<const BlockQ5_1*>(src), dst, nb);
    case GgmlType::Q8_0: return deq_q8_0(static_cast<const BlockQ8_0*>(src), dst, nb);
    case GgmlType::Q2_K: return deq_q2_k(static_cast<const BlockQ2_K*>(src), dst, nb);
    case GgmlType::Q3_K: return deq_q3_k(static_cast<const BlockQ3_K*>(src), dst, nb);
    case GgmlType::Q4_K: return deq_q4_k(static_cast<const BlockQ4_K*>(src), dst, nb);
    case GgmlType::Q5_K: return deq_q5_k(static_cast<const BlockQ5_K*>(src), dst, nb);
    case GgmlType::Q6_K: return deq_q6_k(static_cast<const BlockQ6_K*>(src), dst, nb);
    case GgmlType::Q8_K: return deq_q8_k(static_cast<const BlockQ8_K*>(src), dst, nb);
    case GgmlType::IQ4_NL: return deq_iq4_nl(static_cast<const BlockIQ4_NL*>(src), dst, nb);
    case GgmlType::IQ4_XS: return deq_iq4_xs(static_cast<const BlockIQ4_XS*>(src), dst, nb);
    case GgmlType::MXFP4: return deq_mxfp4(static_cast<const BlockMXFP4*>(src), dst, nb);
    default: break;
  }
  std::fprintf(stderr, "baton: internal error: dequantize_row: unsupported type %s\n", type_name(t));
  std::abort();
}

}  // namespace baton
