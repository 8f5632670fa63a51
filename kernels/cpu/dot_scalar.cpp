// Scalar kernels: the integer dot-product scheme of qkernels.h in plain C++, one generic loop for
// the legacy formats and one for the k-quants, driven by the block decoders. Also the portable
// activation quantizers.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/qkernels.h"

namespace baton::cpu {
namespace {

int8_t round_q(float v) { return int8_t(std::nearbyint(v)); }  // |v| <= 127 by construction

void quant_q8_32(const float* x, int64_t n, void* out) {
  auto* o = static_cast<ActQ8_32*>(out);
  for (int64_t b = 0; b < n / 32; b++, x += 32) {
    float amax = 0;
    for (int l = 0; l < 32; l++) amax = std::max(amax, std::fabs(x[l]));
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int l = 0; l < 32; l++) {
      o[b].q[l] = round_q(x[l] * id);
      sum += o[b].q[l];
    }
    o[b].d = d;
    o[b].ds = d * float(sum);
  }
}

void quant_q8_256(const float* x, int64_t n, void* out) {
  auto* o = static_cast<ActQ8_256*>(out);
  for (int64_t b = 0; b < n / 256; b++, x += 256) {
    float amax = 0;
    for (int l = 0; l < 256; l++) amax = std::max(amax, std::fabs(x[l]));
    const float id = amax > 0 ? 127.0f / amax : 0.0f;
    for (int l = 0; l < 256; l++) o[b].qs[l] = round_q(x[l] * id);
    for (int i = 0; i < 16; i++) {
      int s = 0;
      for (int l = 0; l < 16; l++) s += o[b].qs[16 * i + l];
      o[b].bsums[i] = int16_t(s);
    }
    o[b].d = amax / 127.0f;
  }
}

template <GgmlType T>
void dot_legacy(int64_t n, const uint8_t* w, const uint8_t* a, size_t a_stride, int nc, float* y, size_t ys) {
  const size_t bb = traits(T).block_bytes;
  const int64_t nb = n / 32;
  float acc[4] = {0, 0, 0, 0};
  LegacyBlock blk;
  for (int64_t b = 0; b < nb; b++) {
    decode_legacy(T, w + size_t(b) * bb, blk);
    for (int c = 0; c < nc; c++) {
      const ActQ8_32& x = reinterpret_cast<const ActQ8_32*>(a + size_t(c) * a_stride)[b];
      int32_t s = 0, sq = 0;
      for (int l = 0; l < 32; l++) {
        s += int32_t(blk.u[l]) * x.q[l];
        sq += x.q[l];
      }
      // MXFP4's d = 2^(e − 128) makes d·dx a float32 subnormal for e < ~10 (digits lost): its offset
      // folds into the integer sum (exact: |s| ≤ 32·255·127) and d multiplies last.
      if constexpr (T == GgmlType::MXFP4) acc[c] += blk.d * (x.d * float(s - blk.off * sq));
      else acc[c] += blk.d * x.d * float(s) + (blk.m - blk.d * float(blk.off)) * x.ds;
    }
  }
  for (int c = 0; c < nc; c++) y[size_t(c) * ys] = acc[c];
}

template <GgmlType T>
void dot_k(int64_t n, const uint8_t* w, const uint8_t* a, size_t a_stride, int nc, float* y, size_t ys) {
  const size_t bb = traits(T).block_bytes;
  const int64_t nb = n / 256;
  float acc[4] = {0, 0, 0, 0};
  KBlock blk;
  for (int64_t b = 0; b < nb; b++) {
    decode_k(T, w + size_t(b) * bb, blk);
    for (int c = 0; c < nc; c++) {
      const ActQ8_256& x = reinterpret_cast<const ActQ8_256*>(a + size_t(c) * a_stride)[b];
      int32_t si = 0, sm = 0;
      for (int i = 0; i < 16; i++) {
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += int32_t(blk.u[16 * i + l]) * x.qs[16 * i + l];
        si += blk.s[i] * (s - blk.off * x.bsums[i]);
        sm += blk.mn[i] * x.bsums[i];
      }
      acc[c] += x.d * (blk.d * float(si) - blk.dmin * float(sm));
    }
  }
  for (int c = 0; c < nc; c++) y[size_t(c) * ys] = acc[c];
}

template <GgmlType T>
float load_float(const uint8_t* w, int64_t k) {
  if constexpr (T == GgmlType::F32) {
    float v;
    std::memcpy(&v, w + 4 * k, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, w + 2 * k, 2);
    return T == GgmlType::F16 ? fp16_to_f32(h) : bf16_to_f32(h);
  }
}

template <GgmlType T>
void dot_float(int64_t n, const uint8_t* w, const uint8_t* a, size_t a_stride, int nc, float* y, size_t ys) {
  for (int c = 0; c < nc; c++) {
    const float* x = reinterpret_cast<const float*>(a + size_t(c) * a_stride);
    float acc[8] = {};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
      for (int l = 0; l < 8; l++) acc[l] += load_float<T>(w, k + l) * x[k + l];
    for (; k < n; k++) acc[0] += load_float<T>(w, k) * x[k];
    y[size_t(c) * ys] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
}

KernelTable make_table() {
  KernelTable t;
  auto set = [&](GgmlType type, DotFn f) {
    t.dot[int(type)] = f;
    t.act[int(type)] = is_legacy_quant(type) ? ActKind::Q8_32 : is_k_quant(type) ? ActKind::Q8_256 : ActKind::Float;
  };
  set(GgmlType::F32, dot_float<GgmlType::F32>);
  set(GgmlType::F16, dot_float<GgmlType::F16>);
  set(GgmlType::BF16, dot_float<GgmlType::BF16>);
  set(GgmlType::Q4_0, dot_legacy<GgmlType::Q4_0>);
  set(GgmlType::Q4_1, dot_legacy<GgmlType::Q4_1>);
  set(GgmlType::Q5_0, dot_legacy<GgmlType::Q5_0>);
  set(GgmlType::Q5_1, dot_legacy<GgmlType::Q5_1>);
  set(GgmlType::Q8_0, dot_legacy<GgmlType::Q8_0>);
  set(GgmlType::Q2_K, dot_k<GgmlType::Q2_K>);
  set(GgmlType::Q3_K, dot_k<GgmlType::Q3_K>);
  set(GgmlType::Q4_K, dot_k<GgmlType::Q4_K>);
  set(GgmlType::Q5_K, dot_k<GgmlType::Q5_K>);
  set(GgmlType::Q6_K, dot_k<GgmlType::Q6_K>);
  set(GgmlType::IQ4_NL, dot_legacy<GgmlType::IQ4_NL>);
  set(GgmlType::IQ4_XS, dot_k<GgmlType::IQ4_XS>);
  set(GgmlType::MXFP4, dot_legacy<GgmlType::MXFP4>);
  t.quant[int(ActKind::Q8_32)] = quant_q8_32;
  t.quant[int(ActKind::Q8_256)] = quant_q8_256;
  return t;
}

}  // namespace

const KernelTable& kernels_scalar() {
  static const KernelTable t = make_table();
  return t;
}

}  // namespace baton::cpu
