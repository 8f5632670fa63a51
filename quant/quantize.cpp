// Scalar reference quantization into the ggml block formats.
//
// Every format follows ggml's quantizers exactly, rounding rules and search order included: the
// reference ones (quantize_row_*_ref), and for IQ4_NL/IQ4_XS the search llama-quantize runs
// without an importance matrix (quantize_iq4_nl/_xs). tests/test_quant.cpp checks the bytes
// against two outside sources: the PyPI `gguf` package for F16, BF16 and Q4_0 … Q8_0, and ggml's
// own quantizers for the k-quants, Q8_K and the IQ4 formats (the package has none). The k-quants
// search a few candidate scales per group: a weighted least-squares fit of scale (and min), then
// the group scales are quantized against the largest and the codes re-rounded against the scales
// as stored.
//
// One deliberate difference: ggml's rounding helper is only defined for |v| < 2^22 (it asserts);
// here out-of-range ratios are clamped, so extreme outliers give defined (not ggml's) bytes.
//
// Floating point here must be evaluated exactly as written (no contraction into FMA, no
// fast-math): a one-ulp difference in a scale changes the bytes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "quant/quant.h"

namespace baton {
namespace {

constexpr float kGroupEps = 1e-15f;  // a group whose values are all below this quantizes to zero

// Round half to even, clamped to [lo, hi]. The clamp happens in float so that huge or non-finite
// ratios cannot overflow the int conversion. Within the clamp (|v| < 2^22) adding 1.5·2^23 leaves
// v's integer part, rounded half to even by the addition itself, in the low mantissa bits: the
// same integer as std::nearbyint, without a libm call per value (a quarter of Q4_K's time).
inline int round_clamp(float v, int lo, int hi) {
  if (!(v > float(lo))) return lo;  // also catches NaN
  if (v >= float(hi)) return hi;
  const float shifted = v + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  return (bits & 0x007fffff) - 0x00400000;
}

// Truncation toward zero capped to [0, top], as the legacy formats round (x + 0.5 truncated).
inline uint8_t trunc_cap(float v, int top) {
  if (!(v >= 0.0f)) return 0;
  if (v >= float(top)) return uint8_t(top);
  return uint8_t(int(v));
}

inline uint16_t f2h(float f) { return f32_to_fp16(f); }
inline float h2f(uint16_t h) { return fp16_to_f32(h); }

// ---- legacy 32-element blocks ----

// Element l goes to the low nibble of byte l, element l+16 to its high nibble; for 5-bit types
// bit 4 of element l goes to bit l of the little-endian 32-bit qh.
void pack_nibbles(const uint8_t q[QK], uint8_t qs[QK / 2]) {
  for (int l = 0; l < QK / 2; l++) qs[l] = uint8_t((q[l] & 0x0F) | ((q[l + QK / 2] & 0x0F) << 4));
}
void pack_high_bits(const uint8_t q[QK], uint8_t qh[4]) {
  uint32_t h = 0;
  for (int l = 0; l < QK; l++) h |= uint32_t((q[l] >> 4) & 1) << l;
  for (int k = 0; k < 4; k++) qh[k] = uint8_t(h >> (8 * k));
}

// Symmetric formats: the value of largest magnitude (first one on ties, sign kept) maps to
// -2^(bits-1); codes are trunc(x/d + offset + 0.5), i.e. round half up, capped at the top code.
template <int kBits>
float symmetric_codes(const float* x, uint8_t q[QK]) {
  constexpr int kHalf = 1 << (kBits - 1), kTop = (1 << kBits) - 1;
  float amax = 0.0f, max = 0.0f;
  for (int l = 0; l < QK; l++) {
    if (std::fabs(x[l]) > amax) {
      amax = std::fabs(x[l]);
      max = x[l];
    }
  }
  const float d = max / float(-kHalf);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const float offset = float(kHalf) + 0.5f;
  for (int l = 0; l < QK; l++) {
    const float v = x[l] * id + offset;  // in [0.5, 2^bits + 0.5] by construction
    q[l] = trunc_cap(v, kTop);
  }
  return d;
}

// Asymmetric formats: d = (max - min) / top, codes = trunc((x - min)/d + 0.5) capped at top.
template <int kBits>
void affine_codes(const float* x, uint8_t q[QK], float& d, float& min) {
  constexpr int kTop = (1 << kBits) - 1;
  float lo = x[0], hi = x[0];
  for (int l = 1; l < QK; l++) {
    lo = std::min(lo, x[l]);
    hi = std::max(hi, x[l]);
  }
  d = (hi - lo) / float(kTop);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int l = 0; l < QK; l++) {
    const float v = (x[l] - lo) * id + 0.5f;
    q[l] = trunc_cap(v, kTop);
  }
  min = lo;
}

void quant_q4_0(const float* x, BlockQ4_0* b, int64_t nb) {
  uint8_t q[QK];
  for (int64_t i = 0; i < nb; i++, x += QK) {
    b[i].d = f2h(symmetric_codes<4>(x, q));
    pack_nibbles(q, b[i].qs);
  }
}

void quant_q5_0(const float* x, BlockQ5_0* b, int64_t nb) {
  uint8_t q[QK];
  for (int64_t i = 0; i < nb; i++, x += QK) {
    b[i].d = f2h(symmetric_codes<5>(x, q));
    pack_high_bits(q, b[i].qh);
    pack_nibbles(q, b[i].qs);
  }
}

void quant_q4_1(const float* x, BlockQ4_1* b, int64_t nb) {
  uint8_t q[QK];
  for (int64_t i = 0; i < nb; i++, x += QK) {
    float d, m;
    affine_codes<4>(x, q, d, m);
    b[i].d = f2h(d);
    b[i].m = f2h(m);
    pack_nibbles(q, b[i].qs);
  }
}

void quant_q5_1(const float* x, BlockQ5_1* b, int64_t nb) {
  uint8_t q[QK];
  for (int64_t i = 0; i < nb; i++, x += QK) {
    float d, m;
    affine_codes<5>(x, q, d, m);
    b[i].d = f2h(d);
    b[i].m = f2h(m);
    pack_high_bits(q, b[i].qh);
    pack_nibbles(q, b[i].qs);
  }
}

// Q8_0 rounds half away from zero (roundf), unlike the k-quants.
void quant_q8_0(const float* x, BlockQ8_0* b, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, x += QK) {
    float amax = 0.0f;
    for (int l = 0; l < QK; l++) amax = std::max(amax, std::fabs(x[l]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = f2h(d);
    for (int l = 0; l < QK; l++) {
      const float r = std::round(x[l] * id);  // |r| <= 127 for finite input
      b[i].qs[l] = int8_t(r >= -127.0f && r <= 127.0f ? r : (r > 0.0f ? 127.0f : -127.0f));
    }
  }
}

// ---- k-quant helpers: scale searches over one small group ----

// Signed-scale fit for symmetric codes in [-nmax, nmax-1]: start from the scale that maps the
// largest-magnitude value to -nmax, then try 18 nearby scales and keep the one maximizing the
// weighted fit (sum w·x·l)² / (sum w·l²), weights w = x² (emphasise large values). Codes are
// written offset by nmax. Returns the least-squares scale.
float fit_symmetric(int n, int nmax, const float* x, int8_t* codes) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; i++) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax < kGroupEps) {
    std::fill(codes, codes + n, int8_t(0));
    return 0.0f;
  }
  // Weighted sums for one candidate inverse scale; optionally writes its codes.
  auto evaluate = [&](float iscale, float& sumlx, float& suml2, bool write) {
    sumlx = suml2 = 0.0f;
    for (int i = 0; i < n; i++) {
      const int l = round_clamp(iscale * x[i], -nmax, nmax - 1);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * float(l);
      suml2 += w * float(l) * float(l);
      if (write) codes[i] = int8_t(l + nmax);
    }
  };
  float sumlx, suml2;
  evaluate(float(-nmax) / max, sumlx, suml2, true);
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int step = -9; step <= 9; step++) {
    if (step == 0) continue;
    const float iscale = -(float(nmax) + 0.1f * float(step)) / max;
    evaluate(iscale, sumlx, suml2, false);
    if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
      evaluate(iscale, sumlx, suml2, true);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q3_K's group fit: start from the max-magnitude scale, then greedily move single codes to
// their best value given the others while that improves the x²-weighted fit (a few passes).
// Codes are written offset by nmax.
float fit_symmetric_greedy(int n, int nmax, const float* x, int8_t* codes) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; i++) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax < kGroupEps) {
    std::fill(codes, codes + n, int8_t(0));
    return 0.0f;
  }
  const float iscale = float(-nmax) / max;
  float sumlx = 0.0f, suml2 = 0.0f;
  for (int i = 0; i < n; i++) {
    const int l = round_clamp(iscale * x[i], -nmax, nmax - 1);
    codes[i] = int8_t(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * float(l);
    suml2 += w * float(l) * float(l);
  }
  for (int pass = 0; pass < 5; pass++) {
    int changed = 0;
    for (int i = 0; i < n; i++) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * float(codes[i]);
      if (!(slx > 0.0f)) continue;
      float sl2 = suml2 - w * float(codes[i]) * float(codes[i]);
      const int l = round_clamp(x[i] * sl2 / slx, -nmax, nmax - 1);
      if (l == codes[i]) continue;
      slx += w * x[i] * float(l);
      sl2 += w * float(l) * float(l);
      // Accept when slx²/sl2 > sumlx²/suml2, written without divisions.
      if (sl2 > 0.0f && slx * slx * suml2 > sumlx * sumlx * sl2) {
        codes[i] = int8_t(l);
        sumlx = slx;
        suml2 = sl2;
        changed++;
      }
    }
    if (!changed) break;
  }
  for (int i = 0; i < n; i++) codes[i] = int8_t(codes[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// Affine fit x ≈ scale·l - neg_min for codes l in [0, nmax] with per-element weights w. The
// group min is clamped to <= 0 (so the stored min is non-negative). Starts from the min/max
// spread, then tries nstep+1 inverse scales (nmax + rmin + rdelta·k)/(max - min); for each, the
// codes fixed, it solves the weighted least squares for scale and min and keeps the lowest
// weighted error (squared, or absolute when use_abs). Later candidates are measured from the
// best min found so far, not the original one (ggml does the same; byte-compatibility depends
// on it). Returns scale; neg_min gets -min.
float fit_affine(int n, int nmax, const float* x, const float* w, uint8_t* codes, float& neg_min,
                 float rmin, float rdelta, int nstep, bool use_abs) {
  float min = x[0], max = x[0], sum_w = w[0], sum_x = w[0] * x[0];
  for (int i = 1; i < n; i++) {
    min = std::min(min, x[i]);
    max = std::max(max, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0.0f) min = 0.0f;
  if (max == min) {
    std::fill(codes, codes + n, uint8_t(0));
    neg_min = -min;
    return 0.0f;
  }
  auto error_of = [&](const uint8_t* l, float scale, float m) {
    float err = 0.0f;
    for (int i = 0; i < n; i++) {
      const float diff = scale * float(l[i]) + m - x[i];
      err += w[i] * (use_abs ? std::fabs(diff) : diff * diff);
    }
    return err;
  };
  float iscale = float(nmax) / (max - min);
  float scale = 1.0f / iscale;
  for (int i = 0; i < n; i++) codes[i] = uint8_t(round_clamp(iscale * (x[i] - min), 0, nmax));
  float best = error_of(codes, scale, min);

  uint8_t trial[QK_K];
  for (int k = 0; k <= nstep; k++) {
    iscale = (rmin + rdelta * float(k) + float(nmax)) / (max - min);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; i++) {
      const int l = round_clamp(iscale * (x[i] - min), 0, nmax);
      trial[i] = uint8_t(l);
      sum_l += w[i] * float(l);
      sum_l2 += w[i] * float(l) * float(l);
      sum_xl += w[i] * float(l) * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (!(det > 0.0f)) continue;
    float s = (sum_w * sum_xl - sum_x * sum_l) / det;
    float m = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (m > 0.0f) {  // a positive min cannot be stored: refit the scale alone with min 0
      m = 0.0f;
      s = sum_xl / sum_l2;
    }
    const float err = error_of(trial, s, m);
    if (err < best) {
      std::copy(trial, trial + n, codes);
      best = err;
      scale = s;
      min = m;
    }
  }
  neg_min = -min;
  return scale;
}

// ---- k-quant super-blocks (256 elements) ----

// Q4_K/Q5_K 6-bit scale/min packing (inverse of k_scale_min).
void pack_scale_min(int j, uint8_t sc, uint8_t mn, uint8_t* s) {
  if (j < 4) {
    s[j] = sc;
    s[j + 4] = mn;
  } else {
    s[j + 4] = uint8_t((sc & 0x0F) | ((mn & 0x0F) << 4));
    s[j - 4] |= uint8_t((sc >> 4) << 6);
    s[j] |= uint8_t((mn >> 4) << 6);
  }
}

// Shared by Q4_K and Q5_K: eight 32-element groups, each an affine fit with weights
// rms(group) + |x|; the group scales and mins are then quantized to 6 bits against the largest
// of each, and the final codes re-rounded against the scales as stored. Returns codes in L.
void k_affine_superblock(const float* x, int nmax, float rmin, int nstep, uint16_t& d_out,
                         uint16_t& dmin_out, uint8_t scales[K_SCALE_SIZE], uint8_t L[QK_K]) {
  float group_scale[8], group_min[8], w[32];
  float max_scale = 0.0f, max_min = 0.0f;
  for (int j = 0; j < 8; j++) {
    const float* g = x + 32 * j;
    float sum_x2 = 0.0f;
    for (int l = 0; l < 32; l++) sum_x2 += g[l] * g[l];
    const float rms = std::sqrt(sum_x2 / 32.0f);
    for (int l = 0; l < 32; l++) w[l] = rms + std::fabs(g[l]);
    group_scale[j] = fit_affine(32, nmax, g, w, L + 32 * j, group_min[j], rmin, 0.1f, nstep, false);
    max_scale = std::max(max_scale, group_scale[j]);
    max_min = std::max(max_min, group_min[j]);
  }
  const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  std::memset(scales, 0, K_SCALE_SIZE);
  for (int j = 0; j < 8; j++) {
    const uint8_t ls = uint8_t(round_clamp(inv_scale * group_scale[j], 0, 63));
    const uint8_t lm = uint8_t(round_clamp(inv_min * group_min[j], 0, 63));
    pack_scale_min(j, ls, lm, scales);
  }
  d_out = f2h(max_scale / 63.0f);
  dmin_out = f2h(max_min / 63.0f);
  const float d = h2f(d_out), dmin = h2f(dmin_out);
  for (int j = 0; j < 8; j++) {
    uint8_t sc, mn;
    k_scale_min(j, scales, sc, mn);
    const float dl = d * float(sc);
    if (dl == 0.0f) continue;
    const float ml = dmin * float(mn);
    for (int l = 0; l < 32; l++) L[32 * j + l] = uint8_t(round_clamp((x[32 * j + l] + ml) / dl, 0, nmax));
  }
}

void quant_q4_k(const float* x, BlockQ4_K* b, int64_t nb) {
  uint8_t L[QK_K];
  for (int64_t i = 0; i < nb; i++, x += QK_K) {
    k_affine_superblock(x, 15, -1.0f, 20, b[i].d, b[i].dmin, b[i].scales, L);
    // 64 elements per 32 bytes: group 2c in the low nibbles, group 2c+1 in the high ones.
    for (int c = 0; c < 4; c++)
      for (int l = 0; l < 32; l++)
        b[i].qs[32 * c + l] = uint8_t(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
  }
}

void quant_q5_k(const float* x, BlockQ5_K* b, int64_t nb) {
  uint8_t L[QK_K];
  for (int64_t i = 0; i < nb; i++, x += QK_K) {
    k_affine_superblock(x, 31, -0.5f, 15, b[i].d, b[i].dmin, b[i].scales, L);
    std::memset(b[i].qh, 0, sizeof b[i].qh);
    // Bit 4 of group g's element l lands in bit g of qh[l].
    for (int c = 0; c < 4; c++) {
      for (int l = 0; l < 32; l++) {
        const uint8_t lo = L[64 * c + l], hi = L[64 * c + 32 + l];
        b[i].qs[32 * c + l] = uint8_t((lo & 0x0F) | ((hi & 0x0F) << 4));
        b[i].qh[l] |= uint8_t(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
      }
    }
  }
}

// 2-bit codes in qs: per 128 elements, 32 bytes; element 32k+l of that half sits at bits 2k.
void pack_2bit(const uint8_t L[QK_K], uint8_t qs[QK_K / 4]) {
  for (int h = 0; h < 2; h++)
    for (int l = 0; l < 32; l++) {
      const uint8_t* g = L + 128 * h + l;
      qs[32 * h + l] = uint8_t(g[0] | (g[32] << 2) | (g[64] << 4) | (g[96] << 6));
    }
}

void quant_q2_k(const float* x, BlockQ2_K* b, int64_t nb) {
  uint8_t L[QK_K];
  float w[16], group_scale[16], group_min[16];
  for (int64_t i = 0; i < nb; i++, x += QK_K) {
    float max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 16; j++) {
      const float* g = x + 16 * j;
      for (int l = 0; l < 16; l++) w[l] = std::fabs(g[l]);
      group_scale[j] = fit_affine(16, 3, g, w, L + 16 * j, group_min[j], -0.5f, 0.1f, 15, true);
      max_scale = std::max(max_scale, group_scale[j]);
      max_min = std::max(max_min, group_min[j]);
    }
    // 4-bit scale in the low nibble, 4-bit min in the high nibble.
    if (max_scale > 0.0f) {
      const float iscale = 15.0f / max_scale;
      for (int j = 0; j < 16; j++) b[i].scales[j] = uint8_t(round_clamp(iscale * group_scale[j], 0, 15));
      b[i].d = f2h(max_scale / 15.0f);
    } else {
      std::memset(b[i].scales, 0, sizeof b[i].scales);
      b[i].d = f2h(0.0f);
    }
    if (max_min > 0.0f) {
      const float imin = 15.0f / max_min;
      for (int j = 0; j < 16; j++) b[i].scales[j] |= uint8_t(round_clamp(imin * group_min[j], 0, 15) << 4);
      b[i].dmin = f2h(max_min / 15.0f);
    } else {
      b[i].dmin = f2h(0.0f);
    }
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    for (int j = 0; j < 16; j++) {
      const float dl = d * float(b[i].scales[j] & 0x0F);
      if (dl == 0.0f) continue;
      const float ml = dmin * float(b[i].scales[j] >> 4);
      for (int l = 0; l < 16; l++) L[16 * j + l] = uint8_t(round_clamp((x[16 * j + l] + ml) / dl, 0, 3));
    }
    pack_2bit(L, b[i].qs);
  }
}

// Q3_K 6-bit signed scales: low nibbles in bytes 0..7 (groups 0..7 low, 8..15 high half),
// the top two bits of group j at bits 2·(j/4) of byte 8 + j%4.
void pack_q3_scale(int j, int v, uint8_t s[12]) {
  if (j < 8) s[j] |= uint8_t(v & 0x0F);
  else s[j - 8] |= uint8_t((v & 0x0F) << 4);
  s[8 + j % 4] |= uint8_t((v >> 4) << (2 * (j / 4)));
}
int unpack_q3_scale(int j, const uint8_t s[12]) {
  const int low = j < 8 ? (s[j] & 0x0F) : (s[j - 8] >> 4);
  const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

void quant_q3_k(const float* x, BlockQ3_K* b, int64_t nb) {
  int8_t codes[QK_K];
  uint8_t L[QK_K];
  float group_scale[16];
  for (int64_t i = 0; i < nb; i++, x += QK_K) {
    float amax = 0.0f, max_scale = 0.0f;
    for (int j = 0; j < 16; j++) {
      group_scale[j] = fit_symmetric_greedy(16, 4, x + 16 * j, codes + 16 * j);
      if (std::fabs(group_scale[j]) > amax) {
        amax = std::fabs(group_scale[j]);
        max_scale = group_scale[j];
      }
    }
    std::memset(b[i].scales, 0, sizeof b[i].scales);
    if (max_scale != 0.0f) {
      const float iscale = -32.0f / max_scale;
      for (int j = 0; j < 16; j++) pack_q3_scale(j, round_clamp(iscale * group_scale[j], -32, 31) + 32, b[i].scales);
      b[i].d = f2h(1.0f / iscale);
    } else {
      b[i].d = f2h(0.0f);
    }
    const float d = h2f(b[i].d);
    for (int j = 0; j < 16; j++) {
      const float dl = d * float(unpack_q3_scale(j, b[i].scales));
      for (int l = 0; l < 16; l++) {
        const int k = 16 * j + l;
        L[k] = dl == 0.0f ? uint8_t(codes[k]) : uint8_t(round_clamp(x[k] / dl, -4, 3) + 4);
      }
    }
    // Codes 4..7 set their hmask bit and store code-4; codes 0..3 leave it clear (dequant
    // subtracts 4). Element k's bit: byte k%32, bit k/32.
    std::memset(b[i].hmask, 0, sizeof b[i].hmask);
    for (int k = 0; k < QK_K; k++) {
      if (L[k] > 3) {
        b[i].hmask[k % 32] |= uint8_t(1u << (k / 32));
        L[k] = uint8_t(L[k] - 4);
      }
    }
    pack_2bit(L, b[i].qs);
  }
}

void quant_q6_k(const float* x, BlockQ6_K* b, int64_t nb) {
  int8_t L[QK_K];
  float group_scale[16];
  for (int64_t i = 0; i < nb; i++, x += QK_K) {
    float amax = 0.0f, max_scale = 0.0f;
    for (int j = 0; j < 16; j++) {
      group_scale[j] = fit_symmetric(16, 32, x + 16 * j, L + 16 * j);
      if (std::fabs(group_scale[j]) > amax) {
        amax = std::fabs(group_scale[j]);
        max_scale = group_scale[j];
      }
    }
    if (amax < kGroupEps) {
      std::memset(&b[i], 0, sizeof b[i]);
      continue;
    }
    // 8-bit signed scales: the largest maps to -128 (+127 is the cap on the other side).
    const float iscale = -128.0f / max_scale;
    b[i].d = f2h(1.0f / iscale);
    for (int j = 0; j < 16; j++) b[i].scales[j] = int8_t(std::min(127, int(std::nearbyint(iscale * group_scale[j]))));
    const float d = h2f(b[i].d);
    for (int j = 0; j < 16; j++) {
      const float dl = d * float(b[i].scales[j]);
      if (dl == 0.0f) continue;
      for (int l = 0; l < 16; l++) L[16 * j + l] = int8_t(round_clamp(x[16 * j + l] / dl, -32, 31) + 32);
    }
    // Per 128 elements: ql holds low nibbles (elements l and l+64 share byte l, l+32 and l+96
    // byte l+32), qh the top two bits of l, l+32, l+64, l+96 at bits 0, 2, 4, 6 of byte l.
    for (int h = 0; h < 2; h++) {
      uint8_t* ql = b[i].ql + 64 * h;
      uint8_t* qh = b[i].qh + 32 * h;
      const int8_t* g = L + 128 * h;
      for (int l = 0; l < 32; l++) {
        const uint8_t q1 = uint8_t(g[l]), q2 = uint8_t(g[l + 32]), q3 = uint8_t(g[l + 64]), q4 = uint8_t(g[l + 96]);
        ql[l] = uint8_t((q1 & 0x0F) | ((q3 & 0x0F) << 4));
        ql[l + 32] = uint8_t((q2 & 0x0F) | ((q4 & 0x0F) << 4));
        qh[l] = uint8_t((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
      }
    }
  }
}

// Q8_K is the activation format for k-quant dot products: float scale, int8 codes, and the
// sums of each 16 codes (bsums) precomputed.
void quant_q8_k(const float* x, BlockQ8_K* b, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, x += QK_K) {
    float amax = 0.0f, max = 0.0f;
    for (int l = 0; l < QK_K; l++) {
      if (std::fabs(x[l]) > amax) {
        amax = std::fabs(x[l]);
        max = x[l];
      }
    }
    if (amax == 0.0f) {
      std::memset(&b[i], 0, sizeof b[i]);
      continue;
    }
    const float iscale = -127.0f / max;
    for (int l = 0; l < QK_K; l++) b[i].qs[l] = int8_t(round_clamp(iscale * x[l], -128, 127));
    for (int j = 0; j < QK_K / 16; j++) {
      int sum = 0;
      for (int l = 0; l < 16; l++) sum += b[i].qs[16 * j + l];
      b[i].bsums[j] = int16_t(sum);
    }
    b[i].d = 1.0f / iscale;
  }
}

// ---- IQ4_NL / IQ4_XS: 4-bit indices into the fixed non-linear levels kIQ4Values ----
//
// As llama-quantize writes them without an importance matrix (ggml's quantize_iq4_nl/_xs): per
// 32-element group, weights w = x², a first scale mapping the largest-magnitude value to a level
// end, a weighted least-squares refit, then 15 candidate scales (the largest value on level
// ±(127 − t), t = −7..7) keeping the best (Σw·x·q)² / Σw·q². IQ4_XS then stores the group scales
// as 6-bit multiples of the super-block's d = −(largest group scale) / 32 and re-picks every level.

// Nearest level to v (kIQ4Values is ascending); a tie takes the upper level. The lower neighbour is
// found by counting the levels at or below v (no branches to mispredict: the search runs 16 times
// per value); the same floats are compared as by a binary search, NaN included (level 15).
int iq4_level(float v) {
  const int8_t* lv = kIQ4Values;
  if (v <= float(lv[0])) return 0;
  if (!(v < float(lv[15]))) return 15;
  int lo = 0;
  for (int i = 1; i < 15; i++) lo += float(lv[i]) <= v;
  return v - float(lv[lo]) < float(lv[lo + 1]) - v ? lo : lo + 1;
}

// The weighted sums of the fit for one candidate inverse scale: Σw·q·x and Σw·q².
void iq4_fit_sums(const float* x, const float* w, float inv, float& sqx, float& sq2) {
  sqx = sq2 = 0.0f;
  for (int j = 0; j < 32; j++) {
    const float q = float(kIQ4Values[iq4_level(inv * x[j])]);
    sqx += w[j] * q * x[j];
    sq2 += w[j] * q * q;
  }
}

// The scale of one 32-element group (0 for an empty group).
float iq4_group_scale(const float* x) {
  float w[32], amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; j++) {
    w[j] = x[j] * x[j];
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  if (amax < kGroupEps) return 0.0f;
  const int8_t end = kIQ4Values[0];
  float sqx, sq2;
  iq4_fit_sums(x, w, 1.0f / (-max / float(end)), sqx, sq2);
  float d = sq2 > 0.0f ? sqx / sq2 : 0.0f, best = d * sqx;
  for (int t = -7; t <= 7; t++) {
    iq4_fit_sums(x, w, float(t + end) / max, sqx, sq2);
    if (sq2 > 0.0f && sqx * sqx > best * sq2) {
      d = sqx / sq2;
      best = d * sqx;
    }
  }
  return d;
}

// Levels of 32 values for scale d, packed as the formats store them (low nibbles first 16).
void iq4_pack_group(const float* x, float d, uint8_t qs[16]) {
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < 16; j++)
    qs[j] = uint8_t(iq4_level(inv * x[j]) | (iq4_level(inv * x[j + 16]) << 4));
}

void quant_iq4_nl(const float* x, BlockIQ4_NL* b, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, x += QK) {
    const float d = iq4_group_scale(x);
    b[i].d = f2h(d);
    iq4_pack_group(x, d, b[i].qs);
  }
}

void quant_iq4_xs(const float* x, BlockIQ4_XS* b, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, x += QK_K) {
    float scales[8], max_scale = 0.0f, amax_scale = 0.0f;
    for (int ib = 0; ib < 8; ib++) {
      scales[ib] = iq4_group_scale(x + 32 * ib);
      if (std::fabs(scales[ib]) > amax_scale) {
        amax_scale = std::fabs(scales[ib]);
        max_scale = scales[ib];
      }
    }
    const float d = -max_scale / 32.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    b[i].d = f2h(d);
    b[i].scales_h = 0;
    std::memset(b[i].scales_l, 0, sizeof b[i].scales_l);
    for (int ib = 0; ib < 8; ib++) {
      const int l = round_clamp(inv * scales[ib], -32, 31);
      iq4_pack_group(x + 32 * ib, d * float(l), b[i].qs + 16 * ib);
      b[i].scales_l[ib / 2] = uint8_t(b[i].scales_l[ib / 2] | (((l + 32) & 0x0F) << (4 * (ib % 2))));
      b[i].scales_h = uint16_t(b[i].scales_h | (((l + 32) >> 4) << (2 * ib)));
    }
  }
}

// ---- MXFP4: a power-of-two scale and the E2M1 levels ----
//
// As ggml and the gguf package write it: the exponent puts the block's largest magnitude amax in
// [4, 8)·2^(e − 127), i.e. e = floor(log2 amax) − 2 + 127 (clamped to 0..254; 0 for an all-zero
// block), so values past 6·2^(e − 127) clip to ±6; each value takes the level nearest to it, the
// first in kMXFP4Values order on a tie (the smaller magnitude, +0 for zero).
void quant_mxfp4(const float* x, BlockMXFP4* b, int64_t nb) {
  for (int64_t i = 0; i < nb; i++, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = std::max(amax, std::fabs(x[j]));
    // clamped as a float: an infinite amax (a block holding inf) must not reach the int conversion
    const float ef = amax > 0.0f ? std::clamp(std::floor(std::log2(amax)) - 2.0f + 127.0f, 0.0f, 254.0f) : 0.0f;
    b[i].e = uint8_t(ef);
    const float d = mxfp4_scale(b[i].e);
    uint8_t q[QK];
    for (int j = 0; j < QK; j++) {
      int best = 0;
      float best_err = std::fabs(d * float(kMXFP4Values[0]) - x[j]);
      for (int k = 1; k < 16; k++) {
        const float err = std::fabs(d * float(kMXFP4Values[k]) - x[j]);
        if (err < best_err) {
          best = k;
          best_err = err;
        }
      }
      q[j] = uint8_t(best);
    }
    for (int j = 0; j < QK / 2; j++) b[i].qs[j] = uint8_t(q[j] | (q[j + QK / 2] << 4));
  }
}

}  // namespace

bool has_quantize(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16:
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q8_0: case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K:
    case GgmlType::Q5_K: case GgmlType::Q6_K: case GgmlType::Q8_K: case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS: case GgmlType::MXFP4:
      return true;
    default:
      return false;
  }
}

void quantize_row(GgmlType t, const float* src, void* dst, int64_t n) {
  const int64_t be = int64_t(traits(t).block_elems);
  const int64_t nb = n / be;
  if (!has_quantize(t) || nb * be != n) {
    std::fprintf(stderr, "baton: internal error: quantize_row(%s) of %lld elements\n", type_name(t), (long long)n);
    std::abort();
  }
  switch (t) {
    case GgmlType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case GgmlType::F16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; i++) d[i] = f32_to_fp16(src[i]);
      return;
    }
    case GgmlType::BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case GgmlType::Q4_0: return quant_q4_0(src, static_cast<BlockQ4_0*>(dst), nb);
    case GgmlType::Q4_1: return quant_q4_1(src, static_cast<BlockQ4_1*>(dst), nb);
    case GgmlType::Q5_0: return quant_q5_0(src, static_cast<BlockQ5_0*>(dst), nb);
    case GgmlType::Q5_1: return quant_q5_1(src, static_cast<BlockQ5_1*>(dst), nb);
    case GgmlType::Q8_0: return quant_q8_0(src, static_cast<BlockQ8_0*>(dst), nb);
    case GgmlType::Q2_K: return quant_q2_k(src, static_cast<BlockQ2_K*>(dst), nb);
    case GgmlType::Q3_K: return quant_q3_k(src, static_cast<BlockQ3_K*>(dst), nb);
    case GgmlType::Q4_K: return quant_q4_k(src, static_cast<BlockQ4_K*>(dst), nb);
    case GgmlType::Q5_K: return quant_q5_k(src, static_cast<BlockQ5_K*>(dst), nb);
    case GgmlType::Q6_K: return quant_q6_k(src, static_cast<BlockQ6_K*>(dst), nb);
    case GgmlType::Q8_K: return quant_q8_k(src, static_cast<BlockQ8_K*>(dst), nb);
    case GgmlType::IQ4_NL: return quant_iq4_nl(src, static_cast<BlockIQ4_NL*>(dst), nb);
    case GgmlType::IQ4_XS: return quant_iq4_xs(src, static_cast<BlockIQ4_XS*>(dst), nb);
    case GgmlType::MXFP4: return quant_mxfp4(src, static_cast<BlockMXFP4*>(dst), nb);
    default: break;
  }
  std::abort();  // unreachable: has_quantize checked above
}

}  // namespace baton
