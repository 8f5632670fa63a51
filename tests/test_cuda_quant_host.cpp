// The CUDA kernels' per-type code (kernels/cuda/quant.cuh: 16-byte unit loads from the packed
// layout, dp4a dot products with 8-bit activations, dequantization) compiled for the host with
// stand-ins for the intrinsics, and checked against the scalar reference. Runs without a GPU, so
// the bit logic of every format is verified in every CUDA build; the GPU tests add the rest.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "helpers.h"
#include "kernels/cuda/layout.h"
#include "kernels/cuda/quant.cuh"
#include "quant/quant.h"

using namespace baton;
using namespace baton::cuda;

namespace {

// Random bytes with sane fp16 scales: every code of the format appears.
std::vector<uint8_t> random_row(GgmlType t, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> w(row_bytes(t, cols));
  std::uniform_real_distribution<float> val(-1.0f, 1.0f);
  if (t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16) {
    std::vector<float> f(static_cast<size_t>(cols));
    for (auto& x : f) x = val(rng);
    quantize_row(t, f.data(), w.data(), cols);
    return w;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w) b = uint8_t(byte(rng));
  const uint32_t bb = traits(t).block_bytes;
  for (size_t blk = 0; blk < w.size() / bb; blk++)
    for (int off : test::fp16_fields(t)) {
      const uint16_t h = f32_to_fp16(0.01f * (1.0f + val(rng)));
      std::memcpy(&w[blk * bb + size_t(off)], &h, 2);
    }
  for (size_t blk = 0; blk < w.size() / bb; blk++)
    for (int off : test::e8m0_fields(t)) w[blk * bb + size_t(off)] = test::random_e8m0(rng);
  return w;
}

template <class T>
void check_type(std::mt19937& rng) {
  const GgmlType t = T::type;
  const int64_t cols = 768;
  const auto w = random_row(t, cols, rng);
  std::vector<float> ref(static_cast<size_t>(cols));
  dequantize_row(t, w.data(), ref.data(), cols);
  std::vector<uint8_t> packed(packed_row_bytes(t, cols));
  pack_rows(t, w.data(), packed.data(), 1, cols);
  const int units = int(cols / T::unit);

  // Dequantize: every element written once, equal to the reference.
  std::vector<float> got(size_t(cols), NAN);
  for (int u = 0; u < units; u++) {
    const auto W = T::load(packed.data(), cols, u);
    T::dequant(W, u, [&](int e0, const float (&v)[8]) {
      for (int i = 0; i < 8; i++) got[size_t(e0 + i)] = v[i];
    });
  }
  int bad = 0;
  for (int64_t i = 0; i < cols; i++)
    bad += !(std::fabs(got[size_t(i)] - ref[size_t(i)]) <= 1e-6f * std::fabs(ref[size_t(i)]) + 1e-9f);
  INFO(type_name(t) << ": dequantized values off: " << bad);
  CHECK(bad == 0);

  // Dot with 8-bit activations (or F32 for float weights) = the reference row · the same activations.
  std::uniform_real_distribution<float> val(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(cols)), xq(static_cast<size_t>(cols));
  for (auto& v : x) v = val(rng);
  std::vector<int8_t> q(static_cast<size_t>(cols));
  std::vector<baton::cuda::float2> ds(static_cast<size_t>(cols / 32));
  for (int64_t b = 0; b < cols / 32; b++) {
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[size_t(b * 32 + i)]));
    const float d = amax / 127.0f;
    int s = 0;
    for (int i = 0; i < 32; i++) {
      const size_t k = size_t(b * 32 + i);
      q[k] = int8_t(std::lrint(x[k] / d));
      s += q[k];
      xq[k] = float(q[k]) * d;
    }
    ds[size_t(b)] = {d, d * float(s)};
  }
  Act a;
  a.qs = q.data();
  a.ds = ds.data();
  a.x = x.data();
  a.cols = cols;
  double want = 0, mag = 0, dot = 0;
  for (int64_t i = 0; i < cols; i++) {
    want += double(ref[size_t(i)]) * (T::q8 ? xq[size_t(i)] : x[size_t(i)]);
    mag += std::fabs(double(ref[size_t(i)]) * x[size_t(i)]);
  }
  for (int u = 0; u < units; u++) dot += T::dot(T::load(packed.data(), cols, u), a, 0, u);
  INFO(type_name(t) << ": dot " << dot << " want " << want);
  CHECK(std::fabs(dot - want) <= 1e-5 * mag + 1e-6);
}

}  // namespace

TEST_CASE("CUDA per-type unit code (host build) matches the scalar reference") {
  std::mt19937 rng(11);
  for (int rep = 0; rep < 4; rep++) {
#define BATON_CHECK_TYPE(T) check_type<T>(rng);
    BATON_CUDA_WEIGHT_TYPES(BATON_CHECK_TYPE)
#undef BATON_CHECK_TYPE
  }
}

TEST_CASE("with_weight_type dispatches each supported type and rejects the others") {
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K,
                     GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                     GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS, GgmlType::MXFP4, GgmlType::F16,
                     GgmlType::BF16, GgmlType::F32}) {
    GgmlType seen = GgmlType::I8;
    with_weight_type(t, [&](auto tag) { seen = decltype(tag)::type; });
    CHECK(seen == t);
    CHECK(cuda_supports(t));
  }
  CHECK_THROWS(with_weight_type(GgmlType::IQ2_XS, [](auto) {}));
}

TEST_CASE("CUDA MXFP4 unit code keeps every exponent exact, e = 0, 1 and 255 included") {
  // Block b of a 7-block row (its exponent word straddles the run's end: the row padding) has
  // exponent kE[b]; every nibble appears. Dequantized values equal the reference's bits (inf for
  // e = 255's large levels, subnormals for e = 0, 1); the dot of a block of e = 0 or 1 alone is
  // d·(dx·Σ level·q) with d last, so it keeps the digits a subnormal d·dx would lose.
  constexpr uint8_t kE[] = {0, 1, 2, 127, 200, 254, 255};
  const int64_t cols = 32 * 7;
  std::vector<uint8_t> w(row_bytes(GgmlType::MXFP4, cols));
  for (int b = 0; b < 7; b++) {
    w[size_t(b) * 17] = kE[b];
    for (int j = 0; j < 16; j++) w[size_t(b) * 17 + 1 + size_t(j)] = uint8_t((j + b) % 16 | ((15 - j) << 4));
  }
  std::vector<float> ref(static_cast<size_t>(cols)), got(static_cast<size_t>(cols));
  dequantize_row(GgmlType::MXFP4, w.data(), ref.data(), cols);
  std::vector<uint8_t> packed(packed_row_bytes(GgmlType::MXFP4, cols));
  pack_rows(GgmlType::MXFP4, w.data(), packed.data(), 1, cols);
  for (int u = 0; u < 7; u++)
    TMXFP4::dequant(TMXFP4::load(packed.data(), cols, u), u, [&](int e0, const float (&v)[8]) {
      for (int i = 0; i < 8; i++) got[size_t(e0 + i)] = v[i];
    });
  CHECK(std::memcmp(got.data(), ref.data(), got.size() * 4) == 0);
  CHECK(ref[1] == std::ldexp(1.0f, -128));  // e = 0, nibble 1: 0.5 · 2^-127

  std::vector<int8_t> q(static_cast<size_t>(cols));
  for (size_t k = 0; k < q.size(); k++) q[k] = int8_t(int(k * 37 % 255) - 127);
  std::vector<baton::cuda::float2> ds(7, {0.01f, 0.0f});
  Act a;
  a.qs = q.data();
  a.ds = ds.data();
  a.cols = cols;
  for (int u = 0; u < 2; u++) {  // e = 0 and 1: results near 1e-38, float32 subnormals
    double want = 0;
    for (int i = 0; i < 32; i++) want += double(ref[size_t(32 * u + i)]) * 0.01f * q[size_t(32 * u + i)];
    const float dot = TMXFP4::dot(TMXFP4::load(packed.data(), cols, u), a, 0, u);
    INFO("block " << u << ": dot " << dot << " want " << want);
    CHECK(want != 0.0);
    CHECK(std::fabs(dot - want) <= 1e-6 * std::fabs(want) + 2e-45);
  }
}
