// The packed device layout of weights (kernels/cuda/layout.h) is host code: it runs without a GPU,
// in every build that has the CUDA backend.
#include <cstring>
#include <random>
#include <vector>

#include "gguf/error.h"
#include "helpers.h"
#include "kernels/cuda/layout.h"
#include "quant/quant.h"

using namespace baton;
namespace cu = baton::cuda;

TEST_CASE("packed weight layout round-trips every CUDA weight type") {
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> byte(0, 255);
  const GgmlType types[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K,
                            GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                            GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS, GgmlType::MXFP4, GgmlType::F16,  GgmlType::BF16,
                            GgmlType::F32};
  for (GgmlType t : types) {
    REQUIRE(cu::cuda_supports(t));
    const int64_t rows = 3, cols = traits(t).block_elems == 1 ? 40 : 512;
    std::vector<uint8_t> w(row_bytes(t, cols) * rows);
    for (auto& b : w) b = uint8_t(byte(rng));
    const size_t stride = cu::packed_row_bytes(t, cols);
    CHECK(stride % 16 == 0);
    CHECK(stride >= row_bytes(t, cols));
    CHECK(stride < row_bytes(t, cols) + 16);
    std::vector<uint8_t> packed(stride * rows), back(w.size());
    cu::pack_rows(t, w.data(), packed.data(), rows, cols);
    cu::unpack_rows(t, packed.data(), back.data(), rows, cols);
    CHECK(back == w);
    if (t == GgmlType::Q4_0) {  // quant bytes first (16 per block), then the fp16 scales
      CHECK(std::memcmp(packed.data(), w.data() + 2, 16) == 0);
      CHECK(std::memcmp(packed.data() + (cols / 32) * 16, w.data(), 2) == 0);
    }
    if (t == GgmlType::MXFP4) {  // quant bytes first, then one exponent byte per block, in order
      for (int64_t b = 0; b < cols / 32; b++) {
        CHECK(std::memcmp(packed.data() + b * 16, w.data() + b * 17 + 1, 16) == 0);
        CHECK(packed[size_t((cols / 32) * 16 + b)] == w[size_t(b * 17)]);
      }
    }
  }
}

TEST_CASE("packed layout rejects types and shapes the kernels do not handle") {
  CHECK_FALSE(cu::cuda_supports(GgmlType::IQ2_XS));
  CHECK_THROWS_AS(cu::packed_row_bytes(GgmlType::IQ2_XS, 256), Error);
  CHECK_THROWS_AS(cu::packed_row_bytes(GgmlType::Q4_0, 48), Error);   // not whole blocks
  CHECK_THROWS_AS(cu::packed_row_bytes(GgmlType::F16, 12), Error);    // float rows: multiples of 8
}
