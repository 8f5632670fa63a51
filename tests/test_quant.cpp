// Reference quantization: bit-exact agreement with the PyPI `gguf` package (fixtures made by
// tests/gen_quant_fixtures.py), round-trip error bounds, and exhaustive fp16/bf16 checks.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "quant/quant.h"
#include "tests/helpers.h"

using namespace baton;

namespace {

const std::string kFixtures = std::string(BATON_TEST_DATA) + "/quant/";

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::vector<float> read_floats(const std::string& path) {
  std::vector<uint8_t> b = read_bytes(path);
  REQUIRE(b.size() % 4 == 0);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

bool exists(const std::string& path) { return std::filesystem::exists(path); }

// Relative RMS error of quantize -> dequantize for one type on the given row.
double roundtrip_error(GgmlType t, const std::vector<float>& x) {
  std::vector<uint8_t> q(row_bytes(t, int64_t(x.size())));
  std::vector<float> y(x.size());
  quantize_row(t, x.data(), q.data(), int64_t(x.size()));
  dequantize_row(t, q.data(), y.data(), int64_t(y.size()));
  double se = 0, sx = 0;
  for (size_t i = 0; i < x.size(); i++) {
    se += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
    sx += double(x[i]) * x[i];
  }
  return sx > 0 ? std::sqrt(se / sx) : std::sqrt(se);
}

std::vector<float> gaussian_row(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = g(rng);
  return x;
}

constexpr GgmlType kQuantTypes[] = {
  GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0,
  GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
  GgmlType::Q6_K, GgmlType::Q8_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS, GgmlType::MXFP4,
};

}  // namespace

TEST_CASE("dequantize is bit-identical to the gguf package for every compute type", "[quant]") {
  for (GgmlType t : kComputeTypes) {
    const std::string name = type_name(t);
    INFO("type " << name);
    const std::vector<uint8_t> blocks = read_bytes(kFixtures + name + ".dq.bin");
    const std::vector<float> want = read_floats(kFixtures + name + ".dq.f32");
    const TypeTraits& tt = traits(t);
    REQUIRE(blocks.size() % tt.block_bytes == 0);
    const int64_t n = int64_t(blocks.size() / tt.block_bytes) * tt.block_elems;
    REQUIRE(size_t(n) == want.size());
    REQUIRE(n >= 256);

    std::vector<float> got(size_t(n), std::nanf(""));
    dequantize_row(t, blocks.data(), got.data(), n);
    int64_t mismatches = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
      if (bits_from_f32(got[size_t(i)]) != bits_from_f32(want[size_t(i)])) {
        if (first < 0) first = i;
        mismatches++;
      }
    }
    if (first >= 0)
      FAIL(name << ": " << mismatches << " of " << n << " floats differ; first at element " << first
                << " (block " << first / tt.block_elems << "): got " << got[size_t(first)] << " want "
                << want[size_t(first)]);
  }
}

namespace {

// Quantizes the fixture input `stem`.f32 and compares with `stem`.bin byte for byte.
void check_quantize_fixture(GgmlType t, const std::string& stem) {
  const std::string name = type_name(t);
  INFO("fixture " << stem);
  const std::vector<float> x = read_floats(stem + ".f32");
  const std::vector<uint8_t> want = read_bytes(stem + ".bin");
  const TypeTraits& tt = traits(t);
  REQUIRE(x.size() % tt.block_elems == 0);
  REQUIRE(row_bytes(t, int64_t(x.size())) == want.size());
  std::vector<uint8_t> got(want.size(), 0xAA);
  quantize_row(t, x.data(), got.data(), int64_t(x.size()));
  size_t mismatches = 0, first = want.size();
  for (size_t i = 0; i < want.size(); i++) {
    if (got[i] != want[i]) {
      if (first == want.size()) first = i;
      mismatches++;
    }
  }
  if (first != want.size())
    FAIL(name << ": " << mismatches << " of " << want.size() << " bytes differ; first at byte " << first
              << " (block " << first / tt.block_bytes << ", offset " << first % tt.block_bytes
              << "): got " << int(got[first]) << " want " << int(want[first]));
}

}  // namespace

TEST_CASE("quantize is byte-identical to the gguf package where it quantizes", "[quant]") {
  // The package quantizes these (F32 is a copy and needs no fixture); a missing fixture fails.
  const GgmlType compared[] = {GgmlType::F16,  GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,
                               GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::MXFP4};
  for (GgmlType t : compared) check_quantize_fixture(t, kFixtures + type_name(t) + ".q");
  // Guard against the fixture set silently growing types we do not compare.
  for (GgmlType t : kComputeTypes) {
    if (exists(kFixtures + type_name(t) + ".q.bin")) {
      INFO("fixture exists for " << type_name(t));
      CHECK(std::find(std::begin(compared), std::end(compared), t) != std::end(compared));
    }
  }
}

TEST_CASE("k-quant and IQ4 quantize is byte-identical to ggml's quantizers", "[quant]") {
  // The gguf package has no k-quant or IQ4 quantizers; these fixtures come from ggml-quants.c
  // itself (tests/gen_ggml_quant_fixtures.sh).
  for (GgmlType t : {GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K,
                     GgmlType::Q8_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS})
    check_quantize_fixture(t, kFixtures + type_name(t) + ".ggml.q");
}

TEST_CASE("quantize -> dequantize round trip stays within per-type error bounds", "[quant]") {
  // Relative RMS error bounds on Gaussian data, about 20 % above what the quantizers reach
  // (measured: F16 2.1e-4, BF16 1.7e-3, Q8_0 .0054, Q8_K .0070, Q6_K .0177, Q5_0 .0426,
  // Q5_1 .0376, Q5_K .0362, Q4_0 .0865, Q4_1 .0782, Q4_K .0718, Q3_K .152, Q2_K .299,
  // IQ4_NL .0765, IQ4_XS .0770, MXFP4 .115: power-of-two scales waste up to half its levels' range).
  const std::map<GgmlType, double> bound = {
    {GgmlType::F32, 0.0},     {GgmlType::F16, 2.6e-4},  {GgmlType::BF16, 2.1e-3},
    {GgmlType::Q8_0, 0.0065}, {GgmlType::Q8_K, 0.0085}, {GgmlType::Q6_K, 0.021},
    {GgmlType::Q5_0, 0.051},  {GgmlType::Q5_1, 0.045},  {GgmlType::Q5_K, 0.043},
    {GgmlType::Q4_0, 0.104},  {GgmlType::Q4_1, 0.094},  {GgmlType::Q4_K, 0.086},
    {GgmlType::Q3_K, 0.18},   {GgmlType::Q2_K, 0.36},   {GgmlType::IQ4_NL, 0.092},
    {GgmlType::IQ4_XS, 0.093}, {GgmlType::MXFP4, 0.14},
  };
  const std::vector<float> x = gaussian_row(256 * 64, 1234);
  std::map<GgmlType, double> err;
  for (GgmlType t : kQuantTypes) {
    REQUIRE(has_quantize(t));
    err[t] = roundtrip_error(t, x);
    INFO(type_name(t) << " relative RMS error " << err[t] << " bound " << bound.at(t));
    CHECK(err[t] <= bound.at(t));
  }
  // More bits must mean less error among the k-quants, and each k-quant must beat the legacy
  // format of the same width (that is what the scale search is for).
  CHECK(err[GgmlType::Q2_K] > err[GgmlType::Q3_K]);
  CHECK(err[GgmlType::Q3_K] > err[GgmlType::Q4_K]);
  CHECK(err[GgmlType::Q4_K] > err[GgmlType::Q5_K]);
  CHECK(err[GgmlType::Q5_K] > err[GgmlType::Q6_K]);
  CHECK(err[GgmlType::Q6_K] > err[GgmlType::Q8_0]);
  CHECK(err[GgmlType::Q4_K] < err[GgmlType::Q4_1]);
  CHECK(err[GgmlType::Q5_K] < err[GgmlType::Q5_1]);
  CHECK(err[GgmlType::IQ4_NL] < err[GgmlType::Q4_0]);  // same 4.5 bits, levels denser near zero
  CHECK(err[GgmlType::IQ4_XS] < err[GgmlType::Q4_0]);  // fewer bits (4.25), still better

  SECTION("scale invariance: tiny and large magnitudes keep the same relative error") {
    for (GgmlType t : kQuantTypes) {
      if (t == GgmlType::F16 || t == GgmlType::BF16 || t == GgmlType::F32) continue;
      for (float sigma : {1e-3f, 1e2f}) {
        const double e = roundtrip_error(t, gaussian_row(256 * 8, 99, sigma));
        INFO(type_name(t) << " sigma " << sigma << " error " << e);
        CHECK(e <= bound.at(t) * 1.1);
      }
    }
  }
  SECTION("non-uniform rows: per-block magnitudes spanning 6 decades and heavy tails") {
    std::mt19937 rng(7);
    std::vector<float> y(256 * 16);
    std::student_t_distribution<float> heavy(3.0f);
    for (size_t i = 0; i < y.size(); i++) y[i] = heavy(rng) * std::pow(10.0f, float((i / 256) % 7) - 3.0f);
    for (GgmlType t : kQuantTypes) {
      // Error is measured per 256-block so the large blocks cannot hide the small ones.
      double worst = 0;
      for (size_t b = 0; b < y.size() / 256; b++) {
        std::vector<float> blk(y.begin() + long(256 * b), y.begin() + long(256 * (b + 1)));
        worst = std::max(worst, roundtrip_error(t, blk));
      }
      INFO(type_name(t) << " worst block error " << worst);
      CHECK(worst <= std::max(3.0 * bound.at(t), 1e-3));
    }
  }
}

TEST_CASE("quantize handles zero, constant and one-sided rows", "[quant]") {
  for (GgmlType t : kQuantTypes) {
    INFO("type " << type_name(t));
    const int64_t n = 256;
    std::vector<uint8_t> q(row_bytes(t, n));
    std::vector<float> y(n);

    std::vector<float> zero(n, 0.0f);
    quantize_row(t, zero.data(), q.data(), n);
    dequantize_row(t, q.data(), y.data(), n);
    for (float v : y) REQUIRE(v == 0.0f);

    // A constant row: every format represents it to within its own step size.
    std::vector<float> c(n, 0.731f);
    CHECK(roundtrip_error(t, c) < 0.07);

    // All-positive rows exercise the min clamp of the affine formats.
    std::vector<float> pos = gaussian_row(n, 5);
    for (float& v : pos) v = std::fabs(v) + 0.5f;
    const double e = roundtrip_error(t, pos);
    CHECK(std::isfinite(e));
    CHECK(e < 0.25);
  }
}

TEST_CASE("non-finite and huge inputs stay inside their own block", "[quant]") {
  // A block holding NaN, inf or values far beyond fp16 range gives unspecified values, but the
  // quantizer must not misbehave (the sanitizer build checks float->int conversions) and must
  // not disturb the blocks around it.
  for (GgmlType t : kQuantTypes) {
    INFO("type " << type_name(t));
    const int64_t be = traits(t).block_elems == 1 ? 256 : traits(t).block_elems;
    const std::vector<float> clean = gaussian_row(size_t(3 * be), 11);
    std::vector<uint8_t> want(row_bytes(t, 3 * be)), got(want.size());
    quantize_row(t, clean.data(), want.data(), 3 * be);
    const size_t mid0 = row_bytes(t, be), mid1 = row_bytes(t, 2 * be);
    for (float bad : {std::nanf(""), INFINITY, -INFINITY, 3e38f, -1e30f, 1e-40f}) {
      std::vector<float> x = clean;
      x[size_t(be + be / 3)] = bad;
      quantize_row(t, x.data(), got.data(), 3 * be);
      CHECK(std::equal(got.begin(), got.begin() + long(mid0), want.begin()));
      CHECK(std::equal(got.begin() + long(mid1), got.end(), want.begin() + long(mid1)));
      std::vector<float> y(size_t(3 * be));
      dequantize_row(t, got.data(), y.data(), 3 * be);
    }
  }
}

TEST_CASE("Q8_K carries block sums that match its codes", "[quant]") {
  const std::vector<float> x = gaussian_row(256 * 4, 42);
  std::vector<BlockQ8_K> b(4);
  quantize_row(GgmlType::Q8_K, x.data(), b.data(), int64_t(x.size()));
  for (const BlockQ8_K& blk : b) {
    int amax = 0;
    for (int j = 0; j < QK_K / 16; j++) {
      int s = 0;
      for (int l = 0; l < 16; l++) {
        s += blk.qs[16 * j + l];
        amax = std::max(amax, std::abs(int(blk.qs[16 * j + l])));
      }
      CHECK(blk.bsums[j] == s);
    }
    CHECK(amax == 127);  // the largest value uses the full range
  }
}

// ---- fp16 / bf16 conversions ----

namespace {

// fp16 value from first principles: sign, exponent and mantissa read off the bits.
double half_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0) return s * std::ldexp(double(m), -24);
  if (e == 31) return m ? std::nan("") : s * INFINITY;
  return s * std::ldexp(double(1024 + m), e - 25);
}

// Correctly rounded float -> fp16 by search over the (sorted) magnitudes of all finite halves,
// 65536 standing in for infinity (code 0x7c00) so that overflow follows the same tie rule.
uint16_t reference_f32_to_fp16(float f) {
  static const std::vector<double> mags = [] {
    std::vector<double> v(0x7c01);
    for (uint32_t h = 0; h < 0x7c00; h++) v[h] = half_value(uint16_t(h));
    v[0x7c00] = 65536.0;
    return v;
  }();
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return 0;  // not used for NaN
  const double a = std::fabs(double(f));
  if (a >= 65536.0) return sign | 0x7c00;
  const size_t hi = size_t(std::upper_bound(mags.begin(), mags.end(), a) - mags.begin());  // mags[hi] > a
  const size_t lo = hi - 1;                                                                  // mags[lo] <= a
  const double dl = a - mags[lo], dh = mags[hi] - a;
  size_t pick = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  return uint16_t(sign | pick);
}

// Correctly rounded float -> bf16: the two candidates around f, compared in double.
uint16_t reference_f32_to_bf16(float f) {
  const uint32_t u = bits_from_f32(f);
  const uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);
  if ((u & 0xffff) == 0) return lo;
  const double x = std::fabs(double(f));
  const double vl = std::fabs(double(bf16_to_f32(lo)));
  // The upper candidate may be the next binade or infinity; both are exact in double.
  const double vh = (hi & 0x7fff) == 0x7f80 ? std::ldexp(1.0, 128) : std::fabs(double(bf16_to_f32(hi)));
  const double dl = x - vl, dh = vh - x;
  return dl < dh ? lo : dh < dl ? hi : ((lo & 1) == 0 ? lo : hi);
}

}  // namespace

TEST_CASE("fp16 -> f32 is exact for all 65536 halves and round-trips", "[quant][fp16]") {
  for (uint32_t h = 0; h < 65536; h++) {
    const float f = fp16_to_f32(uint16_t(h));
    const double want = half_value(uint16_t(h));
    const bool is_nan = ((h >> 10) & 0x1f) == 31 && (h & 0x3ff);
    if (is_nan) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::signbit(f) == bool(h & 0x8000));
      const uint16_t back = f32_to_fp16(f);
      REQUIRE((back & 0x7c00) == 0x7c00);
      REQUIRE((back & 0x3ff) != 0);
      REQUIRE((back & 0x8000) == (h & 0x8000));
      continue;
    }
    INFO("half 0x" << std::hex << h);
    REQUIRE(double(f) == want);
    REQUIRE(std::signbit(f) == bool(h & 0x8000));  // -0 stays -0
    REQUIRE(f32_to_fp16(f) == h);
  }
}

TEST_CASE("f32 -> fp16 rounds to nearest even, including subnormals and overflow", "[quant][fp16]") {
  int64_t checked = 0;
  auto check = [&](float f) {
    if (std::isnan(f)) return;
    const uint16_t got = f32_to_fp16(f), want = reference_f32_to_fp16(f);
    if (got != want) FAIL("f32_to_fp16(" << f << " = 0x" << std::hex << bits_from_f32(f) << ") = 0x" << got
                                         << ", want 0x" << want);
    checked++;
  };
  // Every midpoint between adjacent halves (exact in float), and one float ulp either side.
  for (uint32_t h = 0; h < 0x7c00; h++) {
    const double mid = (half_value(uint16_t(h)) + (h == 0x7bff ? 65536.0 : half_value(uint16_t(h + 1)))) / 2;
    const float m = float(mid);
    REQUIRE(double(m) == mid);
    for (float v : {m, std::nextafter(m, 0.0f), std::nextafter(m, INFINITY)}) {
      check(v);
      check(-v);
    }
  }
  // Random bit patterns (all exponents) and random values concentrated in the fp16 range.
  std::mt19937 rng(2026);
  for (int i = 0; i < 300000; i++) check(f32_from_bits(rng()));
  std::uniform_real_distribution<float> expo(-30.0f, 17.0f);
  for (int i = 0; i < 300000; i++) check(std::exp2(expo(rng)) * (rng() & 1 ? 1.0f : -1.0f));
  for (float v : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e30f, INFINITY, -INFINITY,
                  std::ldexp(1.0f, -24), std::ldexp(1.0f, -25), std::ldexp(1.0f, -26),
                  std::ldexp(1.5f, -25), std::numeric_limits<float>::denorm_min()})
    check(v);
  CHECK(f32_to_fp16(65520.0f) == 0x7c00);
  CHECK(f32_to_fp16(std::ldexp(1.0f, -25)) == 0x0000);      // tie between 0 and the smallest subnormal
  CHECK(f32_to_fp16(std::ldexp(1.5f, -24)) == 0x0002);      // tie 1.5 ulp -> even (2)
  CHECK(f32_to_fp16(std::nanf("")) == 0x7e00);
  INFO(checked << " values checked");
  CHECK(checked > 700000);
}

TEST_CASE("bf16 conversions: exhaustive round trip and nearest-even rounding", "[quant][bf16]") {
  for (uint32_t b = 0; b < 65536; b++) {
    const float f = bf16_to_f32(uint16_t(b));
    REQUIRE(bits_from_f32(f) == b << 16);
    if (std::isnan(f)) {
      const uint16_t back = f32_to_bf16(f);
      REQUIRE(std::isnan(bf16_to_f32(back)));
      REQUIRE((back & 0x40) != 0);  // quiet
    } else {
      REQUIRE(f32_to_bf16(f) == b);
    }
  }
  std::mt19937 rng(77);
  for (int i = 0; i < 500000; i++) {
    const uint32_t u = rng();
    const float f = f32_from_bits(i % 8 == 0 ? ((u & 0xffff0000u) | 0x8000u) : u);  // many exact ties
    if (std::isnan(f)) {
      REQUIRE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    const uint16_t got = f32_to_bf16(f), want = reference_f32_to_bf16(f);
    if (got != want) FAIL("f32_to_bf16(0x" << std::hex << u << ") = 0x" << got << ", want 0x" << want);
  }
}

TEST_CASE("MXFP4 dequantizes hand-made blocks: every nibble, the extreme exponents", "[quant]") {
  // The E2M1 values, from the OCP MX spec's table (sign bit 3, exponent bits 2..1, mantissa bit 0:
  // 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6), times 2^(e − 127), written out independently of
  // kMXFP4Values. ggml (and the gguf package) read e = 255 as the scale 2^128, not as NaN (so
  // |values| ≥ 2 overflow to inf in float32 there), and e = 0 as 2^−127 (0.5 of it is 2^−128, a
  // float32 subnormal).
  const double e2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int e : {0, 1, 2, 100, 126, 127, 128, 200, 253, 254, 255}) {
    INFO("e = " << e);
    BlockMXFP4 b{};
    b.e = uint8_t(e);
    for (int j = 0; j < 16; j++) b.qs[j] = uint8_t(j | ((15 - j) << 4));  // every nibble, low and high
    float y[32];
    dequantize_row(GgmlType::MXFP4, &b, y, 32);
    for (int j = 0; j < 32; j++) {
      const double want = e2m1[j < 16 ? j : 31 - j] * std::ldexp(1.0, e - 127);
      const float wantf = float(want);  // overflows to ±inf only where the value does (6·2^128)
      INFO("element " << j << " want " << want << " got " << y[j]);
      if (std::isinf(wantf)) CHECK(y[j] == wantf);
      else CHECK(double(y[j]) == want);  // exact: a power of two times a short integer
      if (want != 0.0) CHECK(std::signbit(y[j]) == std::signbit(wantf));  // nibble 8 (−0) reads +0, as in ggml
    }
  }
  // The smallest non-zero value of the format: 0.5 · 2^−127 = 2^−128, a float32 subnormal.
  BlockMXFP4 tiny{};
  tiny.qs[0] = 1;
  float y[32];
  dequantize_row(GgmlType::MXFP4, &tiny, y, 32);
  CHECK(y[0] == std::ldexp(1.0f, -128));
  CHECK(y[0] > 0.0f);
}

TEST_CASE("MXFP4 quantize: exponent from the block maximum, nearest level, zero block", "[quant]") {
  float x[32] = {};
  BlockMXFP4 b;
  quantize_row(GgmlType::MXFP4, x, &b, 32);
  CHECK(b.e == 0);
  for (uint8_t q : b.qs) CHECK(q == 0);
  // amax 6: floor(log2 6) = 2, e = 127 and the scale 1: the E2M1 values come back as they are.
  const float levels[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int j = 0; j < 32; j++) x[j] = (j % 2 ? -1.0f : 1.0f) * levels[j % 8];
  quantize_row(GgmlType::MXFP4, x, &b, 32);
  CHECK(b.e == 127);
  float y[32];
  dequantize_row(GgmlType::MXFP4, &b, y, 32);
  for (int j = 0; j < 32; j++) CHECK(y[j] == x[j]);
  // Between levels: 2.4 -> 2, 2.6 -> 3, 5.1 -> 6, 7 clips to 6 (amax 7: still e = 127); ties go to
  // the smaller magnitude (2.5 -> 2, -5 -> -4) as in ggml.
  const float in[6] = {2.4f, 2.6f, 5.1f, 7.0f, 2.5f, -5.0f}, out[6] = {2, 3, 6, 6, 2, -4};
  std::fill(std::begin(x), std::end(x), 0.0f);
  std::copy(std::begin(in), std::end(in), x);
  quantize_row(GgmlType::MXFP4, x, &b, 32);
  CHECK(b.e == 127);
  dequantize_row(GgmlType::MXFP4, &b, y, 32);
  for (int j = 0; j < 6; j++) CHECK(y[j] == out[j]);
  // Scaled by 2^-20 and 2^40 the same codes come back with e moved by the same amount.
  for (int k : {-20, 40}) {
    float xs[32];
    for (int j = 0; j < 32; j++) xs[j] = std::ldexp(x[j], k);
    BlockMXFP4 bs;
    quantize_row(GgmlType::MXFP4, xs, &bs, 32);
    CHECK(int(bs.e) == 127 + k);
    CHECK(std::memcmp(bs.qs, b.qs, 16) == 0);
  }
}
