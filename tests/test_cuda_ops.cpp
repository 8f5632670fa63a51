// Every CUDA op against its CPU twin on random data: all weight types of the CUDA backend,
// awkward shapes (rows not a multiple of the warps per block, 1/3/7/8/9/64 columns), tolerances
// derived per type from what each path rounds. Exits with 77 (ctest: skipped) without a GPU.
// Rope, KV conversion and attention are in cuda_ops_attention.cpp (the same executable).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_ops_helpers.h"
#include "helpers.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "quant/quant.h"

using namespace baton;
using namespace baton::cuda_ops_test;
namespace cu = baton::cuda;

namespace {

// Runs before Catch2's main: with no GPU there is nothing to test.
[[maybe_unused]] const bool kHaveGpu = [] {
  if (cu::device_count() == 0) {
    std::printf("no CUDA device: skipping the CUDA op tests (exit code 77)\n");
    std::fflush(stdout);
    std::exit(77);
  }
  return true;
}();

std::vector<uint8_t> random_weights(GgmlType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const size_t bytes = row_bytes(t, cols) * size_t(rows);
  std::vector<uint8_t> m(bytes);
  if (t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16) {
    const auto f = random_floats(size_t(rows * cols), rng);
    quantize_row(t, f.data(), m.data(), rows * cols);
    return m;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.002f, 0.02f);
  for (auto& b : m) b = uint8_t(byte(rng));
  const uint32_t bb = traits(t).block_bytes;
  for (size_t blk = 0; blk < bytes / bb; blk++)
    for (int off : test::fp16_fields(t)) {
      float s = scale(rng);
      if ((t == GgmlType::Q4_1 || t == GgmlType::Q5_1) && off == 2) s *= -8.0f;  // mins are usually negative
      const uint16_t h = f32_to_fp16(s);
      std::memcpy(&m[blk * bb + size_t(off)], &h, 2);
    }
  for (size_t blk = 0; blk < bytes / bb; blk++)
    for (int off : test::e8m0_fields(t)) m[blk * bb + size_t(off)] = test::random_e8m0(rng);
  return m;
}

std::vector<float> dequantize(GgmlType t, const std::vector<uint8_t>& w, int64_t rows, int64_t cols) {
  std::vector<float> f(size_t(rows * cols));
  for (int64_t r = 0; r < rows; r++)
    dequantize_row(t, w.data() + size_t(r) * row_bytes(t, cols), f.data() + size_t(r * cols), cols);
  return f;
}

bool is_float(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

const GgmlType kTypes[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                           GgmlType::Q2_K, GgmlType::Q3_K,
                           GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS,
                           GgmlType::MXFP4, GgmlType::F16, GgmlType::BF16, GgmlType::F32};

// Checks Y (rows x n, column j at j*rows) against the exact product of the dequantized weights.
// Per-path bounds: the GEMV rounds each activation to an 8-bit grid (error <= d/2 per value, d the
// 32-value block's max/127) and sums in F32; the GEMM rounds weights and activations to FP16
// (2^-11 relative each); float weights on the GEMV path only round the F32 sums. With `cpu` (the
// CPU twin's output, first column only) the two must agree within both bounds; the CPU quantizes
// k-quant activations per 256 values, so its bound uses 256-value blocks.
void check_product(GgmlType t, const std::vector<float>& Wf, const std::vector<float>& X, int64_t rows,
                   int64_t cols, int n, const std::vector<float>& Y, bool gemm, const char* what,
                   const std::vector<float>* cpu = nullptr) {
  int bad = 0, bad_cpu = 0;
  double worst = 0;
  auto half_steps = [&](const float* x, int block) {
    std::vector<double> h(size_t(cols / block), 0.0);
    for (int64_t b = 0; b < cols / block; b++) {
      float amax = 0;
      for (int i = 0; i < block; i++) amax = std::max(amax, std::fabs(x[b * block + i]));
      h[size_t(b)] = amax / 127.0 / 2.0;
    }
    return h;
  };
  for (int j = 0; j < n; j++) {
    const float* x = X.data() + size_t(j) * cols;
    const auto h32 = half_steps(x, 32);
    const auto h256 = cols % 256 == 0 ? half_steps(x, 256) : h32;
    const int blk256 = cols % 256 == 0 ? 256 : 32;
    for (int64_t r = 0; r < rows; r++) {
      const float* w = Wf.data() + size_t(r * cols);
      double ref = 0, mag = 0, q8 = 0, q8cpu = 0;
      for (int64_t i = 0; i < cols; i++) {
        ref += double(w[i]) * x[i];
        mag += std::fabs(double(w[i]) * x[i]);
        q8 += std::fabs(double(w[i])) * h32[size_t(i / 32)];
        q8cpu += std::fabs(double(w[i])) * h256[size_t(i / blk256)];
      }
      double tol;
      if (gemm) tol = 2.5e-3 * mag + 1e-5;
      else if (is_float(t)) tol = 2e-5 * mag + 1e-6;
      else tol = 1.02 * q8 + 2e-5 * mag + 1e-6;
      const double y = Y[size_t(j * rows + r)];
      const double err = std::fabs(y - ref);
      worst = std::max(worst, err / tol);
      if (err > tol && bad++ < 5)
        UNSCOPED_INFO(what << " " << type_name(t) << " row " << r << " col " << j << ": got " << y
                           << " want " << ref << " (tol " << tol << ")");
      if (cpu && j == 0) {
        const double tol_cpu = tol + (is_float(t) ? tol : 1.02 * q8cpu + 2e-5 * mag + 1e-6);
        const double d = std::fabs(y - (*cpu)[size_t(r)]);
        if (d > tol_cpu && bad_cpu++ < 5)
          UNSCOPED_INFO(what << " " << type_name(t) << " row " << r << ": GPU " << y << " CPU twin "
                             << (*cpu)[size_t(r)] << " (tol " << tol_cpu << ")");
      }
    }
  }
  INFO(what << " " << type_name(t) << " " << rows << "x" << cols << " n=" << n << " worst err/tol " << worst);
  CHECK(bad == 0);
  CHECK(bad_cpu == 0);
}

}  // namespace

TEST_CASE("activation quantization: 8-bit blocks within half a step, sums consistent") {
  std::mt19937 rng(2);
  const int64_t cols = 320;
  const int n = 3;
  auto x = random_floats(size_t(cols * n), rng, -3.0f, 3.0f);
  auto dx = to_dev(x);
  cu::DeviceBuffer dq(size_t(cols * n)), dd(size_t(cols / 32 * n) * 8);
  cu::quantize_act(ctx(), dx.as<float>(), cols, n, dq.as<int8_t>(), dd.as<float>());
  const auto q = to_host<int8_t>(dq, size_t(cols * n));
  const auto ds = to_host<float>(dd, size_t(cols / 32 * n) * 2);
  for (int64_t b = 0; b < cols / 32 * n; b++) {
    const float d = ds[size_t(2 * b)];
    int sum = 0;
    for (int i = 0; i < 32; i++) {
      const size_t k = size_t(b * 32 + i);
      CHECK(std::fabs(q[k] * d - x[k]) <= d * 0.5f * 1.0001f);
      sum += q[k];
    }
    CHECK(ds[size_t(2 * b + 1)] == Approx(d * float(sum)).margin(1e-6));
  }
}

TEST_CASE("matmul: GEMV and GEMM paths for every weight type and awkward shapes") {
  struct Shape { int64_t rows, cols; std::vector<int> ns; };
  const std::vector<Shape> shapes = {
      {37, 768, {1, 3, 7, 8, 9, 64}},   // few rows: several warps per row
      {2501, 512, {1, 8}},              // mid-size: two warps per row on big GPUs
      {4501, 1024, {1, 2}},             // enough rows for a warp per row
  };
  std::mt19937 rng(3);
  for (GgmlType t : kTypes) {
    for (const Shape& s : shapes) {
      const auto w = random_weights(t, s.rows, s.cols, rng);
      const auto Wf = dequantize(t, w, s.rows, s.cols);
      cu::Weight W;
      cu::DeviceBuffer dw = cu::upload_weight(t, w.data(), s.rows, s.cols, W);
      for (int n : s.ns) {
        const auto X = random_floats(size_t(s.cols * n), rng);
        auto dx = to_dev(X);
        cu::DeviceBuffer dy(size_t(s.rows * n) * sizeof(float));
        cu::matmul(ctx(), W, dx.as<float>(), n, dy.as<float>());
        const auto Y = to_host<float>(dy, size_t(s.rows * n));
        std::vector<float> ycpu(size_t(s.rows));  // the CPU twin, first column
        cpu::QMatrix Q{t, w.data(), s.rows, s.cols, row_bytes(t, s.cols)};
        cpu::matmul(Q, X.data(), 1, ycpu.data(), pool());
        check_product(t, Wf, X, s.rows, s.cols, n, Y, n > ctx().gemv_max_cols, "matmul", &ycpu);
        if (n == 9) {  // the GEMV path in two launches (8 + 1 columns) as well
          cu::gemv(ctx(), W, dx.as<float>(), n, dy.as<float>());
          check_product(t, Wf, X, s.rows, s.cols, n, to_host<float>(dy, size_t(s.rows * n)), false, "gemv9");
        }
      }
    }
  }
}

// matmul_n (q, k, v; gate, up): one quantization of X, one launch per run of one type, rows of
// different heights (different warps per row) in one grid; bit-identical to separate matmuls.
TEST_CASE("matmul_n equals separate matmuls, bit for bit, for same and mixed types") {
  std::mt19937 rng(14);
  const int64_t cols = 512;
  struct Case { GgmlType a, b, c; };
  for (const Case& k : {Case{GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q4_0}, Case{GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K},
                        Case{GgmlType::Q8_0, GgmlType::F16, GgmlType::Q8_0}}) {
    const GgmlType types[3] = {k.a, k.b, k.c};
    const int64_t rows[3] = {4501, 37, 300};  // heights that take different warps per row
    std::vector<cu::DeviceBuffer> keep;
    cu::Weight W[3];
    for (int i = 0; i < 3; i++) {
      const auto w = random_weights(types[i], rows[i], cols, rng);
      keep.push_back(cu::upload_weight(types[i], w.data(), rows[i], cols, W[i]));
    }
    for (int n : {1, 5, 8, 24}) {
      INFO(type_name(k.a) << "/" << type_name(k.b) << "/" << type_name(k.c) << ", " << n << " columns");
      auto dx = to_dev(random_floats(size_t(cols * n), rng));
      std::vector<cu::DeviceBuffer> sep, fused;
      for (int i = 0; i < 3; i++) {
        sep.emplace_back(size_t(rows[i] * n) * sizeof(float));
        fused.emplace_back(size_t(rows[i] * n) * sizeof(float));
        cu::matmul(ctx(), W[i], dx.as<float>(), n, sep.back().as<float>());
      }
      cu::matmul_n(ctx(), {{&W[0], fused[0].as<float>()}, {&W[1], fused[1].as<float>()}, {&W[2], fused[2].as<float>()}},
                   dx.as<float>(), n);
      for (int i = 0; i < 3; i++) {
        const auto a = to_host<float>(sep[size_t(i)], size_t(rows[i] * n)), b = to_host<float>(fused[size_t(i)], size_t(rows[i] * n));
        CHECK(std::all_of(b.begin(), b.end(), [](float v) { return std::isfinite(v); }));
        CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      }
    }
  }
}

// The GEMV's other shapes against one warp per row (gemv_split_rows off): gemv_rows_per_warp = 2
// (a warp loads two rows before it sums either; launches of 1-2 columns) and gemv_stream (a grid
// of one wave, each warp a run of rows with its next batch of weights loaded before the current one
// is summed). Each row still sums in one warp in the same order, so the products are equal bit for
// bit, from separate launches and from one matmul_n. Rows 5120 wide take 2-5 batches per lane (the
// last one partial); 701 and 37 rows leave the last warp of a pair one row; a streamed grid of 64
// warps gives each 17 rows, crossing from q to k to v inside a run, one of 300 warps 4 (its last
// warp fewer); 5 columns run the 5-column kernels. All within the CPU's bounds.
TEST_CASE("GEMV with two rows per warp or streamed equals one row per warp, bit for bit") {
  std::mt19937 rng(16);
  const int64_t cols = 5120;
  const int64_t heights[3] = {701, 37, 300};
  struct Form {
    const char* name;
    int rows_per_warp, stream_warps;  // stream_warps 0: not streamed
  };
  const Form forms[] = {{"one row per warp", 1, 0}, {"two rows per warp", 2, 0}, {"streamed, 64 warps", 1, 64},
                        {"streamed, 300 warps", 1, 300}};
  for (GgmlType t : kTypes) {
    INFO(type_name(t));
    std::vector<cu::DeviceBuffer> keep;
    cu::Weight W[3];
    std::vector<std::vector<float>> Wf;
    for (int i = 0; i < 3; i++) {
      const auto w = random_weights(t, heights[i], cols, rng);
      Wf.push_back(dequantize(t, w, heights[i], cols));
      keep.push_back(cu::upload_weight(t, w.data(), heights[i], cols, W[i]));
    }
    for (int n : {1, 2, 5}) {
      INFO(n << " columns");
      const auto X = random_floats(size_t(cols * n), rng);
      auto dx = to_dev(X);
      std::vector<std::vector<float>> want;  // [matrix], from the first form
      for (const Form& f : forms) {
        INFO(f.name);
        ctx().gemv_split_rows = false;
        ctx().gemv_rows_per_warp = f.rows_per_warp;
        ctx().gemv_stream = f.stream_warps > 0;
        ctx().gemv_stream_warps = f.stream_warps;
        std::vector<cu::DeviceBuffer> y, yn;  // separate launches, one matmul_n
        for (int i = 0; i < 3; i++) {
          y.emplace_back(size_t(heights[i] * n) * 4);
          yn.emplace_back(size_t(heights[i] * n) * 4);
          cu::matmul(ctx(), W[i], dx.as<float>(), n, y.back().as<float>());
        }
        cu::matmul_n(ctx(), {{&W[0], yn[0].as<float>()}, {&W[1], yn[1].as<float>()}, {&W[2], yn[2].as<float>()}},
                     dx.as<float>(), n);
        for (int i = 0; i < 3; i++) {
          const auto got = to_host<float>(y[size_t(i)], size_t(heights[i] * n));
          CHECK(to_host<float>(yn[size_t(i)], size_t(heights[i] * n)) == got);
          if (want.size() < 3) {
            check_product(t, Wf[size_t(i)], X, heights[i], cols, n, got, false, f.name);
            want.push_back(got);
          } else {
            CHECK(std::memcmp(got.data(), want[size_t(i)].data(), got.size() * sizeof(float)) == 0);
          }
        }
      }
      ctx().gemv_split_rows = true;
      ctx().gemv_rows_per_warp = 1;
      ctx().gemv_stream = false;
      ctx().gemv_stream_warps = 0;
    }
  }
}

// Which form a GEMV launch takes: gemv_force, else a measured entry for its (type, rows of all its
// matrices, width, columns), else the flags; two rows per warp only up to 2 columns.
TEST_CASE("GEMV forms: forced, then measured, then the flags") {
  cu::Context c(0);
  using F = cu::GemvForm;
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 1) == F::Split);
  c.gemv_split_rows = false;
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 1) == F::Whole);
  c.gemv_rows_per_warp = 2;
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 2) == F::Pairs);
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 3) == F::Whole);
  c.gemv_stream = true;
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 1) == F::Stream);
  c.gemv_split_rows = true, c.gemv_rows_per_warp = 1, c.gemv_stream = false;
  c.gemv_forms = {{GgmlType::Q4_0, 300, 512, 1, F::Stream}, {GgmlType::Q4_K, 300, 512, 4, F::Pairs}};
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 1) == F::Stream);
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 2) == F::Split);  // another column count
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 301, 512, 1) == F::Split);
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 1024, 1) == F::Split);
  CHECK(cu::gemv_form(c, GgmlType::Q8_0, 300, 512, 1) == F::Split);
  CHECK(cu::gemv_form(c, GgmlType::Q4_K, 300, 512, 4) == F::Split);  // pairs take at most 2 columns
  c.gemv_force = int(F::Whole);
  CHECK(cu::gemv_form(c, GgmlType::Q4_0, 300, 512, 1) == F::Whole);
}

// tune_gemv times the forms that run other kernels over a stage's calls and records the fastest
// for every launch those calls make. Whole, Pairs and Stream give one set of bits, Split (whose
// short matrices here spread rows over 2-4 warps) another: with same_bits only the forms of the
// switches' class are timed.
TEST_CASE("tune_gemv times the forms and records the fastest per launch") {
  std::mt19937 rng(23);
  const int64_t cols = 5120;
  const int64_t heights[3] = {701, 37, 300};  // q and k Q4_0 (one launch of 738 rows), v Q6_K
  const GgmlType types[3] = {GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q6_K};
  std::vector<cu::DeviceBuffer> keep;
  cu::Weight W[2][3];  // two layers
  for (auto& layer : W)
    for (int i = 0; i < 3; i++)
      keep.push_back(cu::upload_weight(types[i], random_weights(types[i], heights[i], cols, rng).data(), heights[i], cols, layer[i]));
  cu::Context& c = ctx();
  c.gemv_stream_warps = 64;  // the streamed form applies to 738 and 300 rows
  using F = cu::GemvForm;
  for (int n : {1, 3}) {
    INFO(n << " columns");
    auto dx = to_dev(random_floats(size_t(cols * n), rng));
    std::vector<cu::DeviceBuffer> y;
    for (int i = 0; i < 3; i++) y.emplace_back(size_t(heights[i] * n) * 4);
    auto products = [&](int l) {
      cu::matmul_n(c, {{&W[l][0], y[0].as<float>()}, {&W[l][1], y[1].as<float>()}, {&W[l][2], y[2].as<float>()}},
                   dx.as<float>(), n);
      std::vector<float> out;
      for (int i = 0; i < 3; i++) {
        const auto h = to_host<float>(y[size_t(i)], size_t(heights[i] * n));
        out.insert(out.end(), h.begin(), h.end());
      }
      return out;
    };
    c.gemv_forms.clear();
    c.gemv_force = int(F::Whole);
    const std::vector<float> whole[2] = {products(0), products(1)};
    c.gemv_force = -1;
    const std::vector<float> split[2] = {products(0), products(1)};  // the switches' form
    CHECK(split[0] != whole[0]);
    std::vector<std::vector<cu::MatmulOut>> calls;
    for (auto& layer : W)
      calls.push_back({{&layer[0], y[0].as<float>()}, {&layer[1], y[1].as<float>()}, {&layer[2], y[2].as<float>()}});
    auto timed = [](const cu::GemvTiming& t) {
      std::string s;
      for (int f = 0; f < cu::kGemvForms; f++)
        if (t.us[f] > 0.0f) s += std::string(s.empty() ? "" : " ") + cu::gemv_form_name(F(f));
      CHECK(t.us[int(t.best)] > 0.0f);
      for (float us : t.us) CHECK((us < 0.0f || t.us[int(t.best)] <= us));
      return s;
    };
    // Any form: each runs other kernels (pairs only up to 2 columns: beyond, it is split).
    const cu::GemvTiming any = cu::tune_gemv(c, calls, dx.as<float>(), n, /*same_bits=*/false, 1);
    CHECK(c.gemv_force == -1);
    CHECK(timed(any) == (n <= 2 ? "split whole pairs stream" : "split whole stream"));
    REQUIRE(c.gemv_forms.size() == 2);
    CHECK(c.gemv_forms[0].type == GgmlType::Q4_0);
    CHECK(c.gemv_forms[0].rows == 738);
    CHECK(c.gemv_forms[1].type == GgmlType::Q6_K);
    CHECK(c.gemv_forms[1].rows == 300);
    for (const cu::GemvChoice& g : c.gemv_forms) {
      CHECK(g.cols == cols);
      CHECK(g.n == n);
      CHECK(g.form == any.best);
    }
    // Each form in turn as the measured one: Split's bits or the one-warp rows' bits.
    for (int f = 0; f < cu::kGemvForms; f++) {
      INFO(cu::gemv_form_name(F(f)));
      for (cu::GemvChoice& g : c.gemv_forms) g.form = F(f);
      const bool splits = f == int(F::Split) || (f == int(F::Pairs) && n > 2);
      const std::vector<float>* want = splits ? split : whole;
      CHECK(products(0) == want[0]);
      CHECK(products(1) == want[1]);
    }
    // Same bits: with split rows only Split (a second tuning replaces the first's entries); with
    // one warp per row the one-warp forms.
    CHECK(timed(cu::tune_gemv(c, calls, dx.as<float>(), n, true, 1)) == "split");
    CHECK(c.gemv_forms.size() == 2);
    CHECK(products(0) == split[0]);
    c.gemv_split_rows = false;
    const cu::GemvTiming one = cu::tune_gemv(c, calls, dx.as<float>(), n, true, 1);
    CHECK(timed(one) == (n <= 2 ? "whole pairs stream" : "whole stream"));
    CHECK(products(0) == whole[0]);
    CHECK(products(1) == whole[1]);
    c.gemv_split_rows = true;
    c.gemv_forms.clear();
  }
  c.gemv_stream_warps = 0;
}

// The norms and gates can write the next GEMV's 8-bit activations along with their output
// (cuda::Q8Act): the same bytes quantize_act writes, and a matmul told so (x_q8) gives the product
// of quantizing X itself, bit for bit.
TEST_CASE("norms and gates that write the 8-bit activations equal quantize_act, and the GEMV that takes them") {
  std::mt19937 rng(15);
  // Rows of 768 values (24 blocks of 32): rms_norm runs 64 threads of 3 float4s; 800: a quarter
  // of a warp in its last slice; 16896: rows longer than its registers hold (it loops); `skew`:
  // the vectors one float past 16-byte alignment, so the kernels take one value per thread.
  struct Shape { int64_t cols; int skew; };
  for (const Shape sh : {Shape{768, 0}, Shape{800, 0}, Shape{16896, 0}, Shape{768, 1}})
  for (int n : {1, 3, 8}) {
    const int64_t cols = sh.cols;
    const size_t m = size_t(cols) * size_t(n);
    const auto x = random_floats(m, rng, -3.0f, 3.0f), d = random_floats(m, rng), u = random_floats(m, rng);
    const auto w = random_floats(size_t(cols), rng, 0.5f, 1.5f);
    auto skewed = [&](const std::vector<float>& v) {  // on the device, sh.skew floats into the buffer
      std::vector<float> s(size_t(sh.skew), 0.0f);
      s.insert(s.end(), v.begin(), v.end());
      return to_dev(s);
    };
    auto dw = skewed(w), du = skewed(u);
    const GgmlType wt_type = cols % 256 == 0 ? GgmlType::Q4_K : GgmlType::Q4_0;
    const auto wt = random_weights(wt_type, 300, cols, rng);
    cu::Weight W;
    cu::DeviceBuffer keep = cu::upload_weight(wt_type, wt.data(), 300, cols, W);
    for (int op = 0; op < 5; op++) {  // rms_norm, add_rms_norm, silu_gate, gelu_tanh_gate, swiglu_oai_gate
      INFO("op " << op << ", rows of " << cols << ", skew " << sh.skew << ", " << n << " columns");
      auto dx = skewed(x), dd = skewed(d);
      cu::DeviceBuffer dy_buf((m + size_t(sh.skew)) * 4);
      float* const px = dx.as<float>() + sh.skew;
      float* const pd = dd.as<float>() + sh.skew;
      float* const pw = dw.as<float>() + sh.skew;
      float* const pu = du.as<float>() + sh.skew;
      float* const py = dy_buf.as<float>() + sh.skew;
      const cu::Q8Act q8 = cu::q8_scratch(ctx(), cols, n);
      if (op == 0) cu::rms_norm(ctx(), px, pw, py, n, int(cols), 1e-6f, q8);
      if (op == 1) cu::add_rms_norm(ctx(), px, pd, pw, py, n, int(cols), 1e-6f, q8);
      if (op == 2) cu::silu_gate(ctx(), px, pu, py, int64_t(m), q8);
      if (op == 3) cu::gelu_tanh_gate(ctx(), px, pu, py, int64_t(m), q8);
      if (op == 4) cu::swiglu_oai_gate(ctx(), px, pu, py, int64_t(m), q8);
      // What the op left in the scratch, against quantize_act of its output.
      std::vector<int8_t> qs(m);
      std::vector<float> ds(m / 16);  // a (d, d * sum) pair per 32 values
      cu::copy_to_host(ctx(), qs.data(), q8.qs, m);
      cu::copy_to_host(ctx(), ds.data(), q8.ds, ds.size() * 4);
      ctx().synchronize();
      cu::DeviceBuffer rq(m), rd(ds.size() * 4);
      cu::quantize_act(ctx(), py, cols, n, rq.as<int8_t>(), rd.as<float>());
      CHECK(to_host<int8_t>(rq, m) == qs);
      CHECK(to_host<float>(rd, ds.size()) == ds);
      CHECK(std::count(qs.begin(), qs.end(), int8_t(0)) < int64_t(m / 4));  // not an empty buffer (GELU has many near 0)
      // The GEMV on the staged activations (nothing has used the scratch since the op) and on X.
      cu::DeviceBuffer y1(300 * size_t(n) * 4), y2(300 * size_t(n) * 4), y3(300 * size_t(n) * 4);
      cu::matmul(ctx(), W, py, n, y1.as<float>(), true);
      cu::matmul(ctx(), W, py, n, y2.as<float>());
      const auto a = to_host<float>(y1, 300 * size_t(n)), b = to_host<float>(y2, 300 * size_t(n));
      CHECK(std::all_of(a.begin(), a.end(), [](float v) { return std::isfinite(v); }));
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      // And it does take them: with the scratch's quants zeroed, x_q8 gives another product.
      const std::vector<int8_t> zeros(m, 0);
      const cu::Q8Act z = cu::q8_scratch(ctx(), cols, n);
      cu::copy_to_device(ctx(), z.qs, zeros.data(), m);
      cu::matmul(ctx(), W, py, n, y3.as<float>(), true);
      CHECK(to_host<float>(y3, 300 * size_t(n)) != b);
    }
  }
}

// A weight larger than Context::gemm_slab_bytes in FP16 is expanded and multiplied in row slabs
// (here 128, 128 and 44 rows): the same product as in one slab, up to cuBLAS's choice of
// summation order per GEMM shape.
TEST_CASE("GEMM in row slabs equals the GEMM in one slab") {
  std::mt19937 rng(13);
  const int64_t rows = 300, cols = 512;
  const int n = 24;
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q6_K}) {
    const auto w = random_weights(t, rows, cols, rng);
    cu::Weight W;
    cu::DeviceBuffer dw = cu::upload_weight(t, w.data(), rows, cols, W);
    auto dx = to_dev(random_floats(size_t(cols * n), rng));
    cu::DeviceBuffer d1(size_t(rows * n) * sizeof(float)), d3(size_t(rows * n) * sizeof(float));
    cu::gemm(ctx(), W, dx.as<float>(), n, d1.as<float>());
    const size_t saved = ctx().gemm_slab_bytes;
    ctx().gemm_slab_bytes = size_t(128) * size_t(cols) * 2;
    cu::gemm(ctx(), W, dx.as<float>(), n, d3.as<float>());
    ctx().gemm_slab_bytes = saved;
    const auto a = to_host<float>(d1, size_t(rows * n)), b = to_host<float>(d3, size_t(rows * n));
    float scale = 0, diff = 0;
    for (size_t i = 0; i < a.size(); i++) scale = std::max(scale, std::fabs(a[i])), diff = std::max(diff, std::fabs(a[i] - b[i]));
    INFO(type_name(t) << ": max |y| " << scale << ", max |d| " << diff);
    CHECK(scale > 0);
    CHECK(diff <= 1e-4f * scale);
  }
}

// The GEMM path (dequantize + cuBLAS) inside a CUDA graph: the Context hands cuBLAS its own
// workspace, so a capture allocates nothing (the simulator refuses a captured GEMM on a handle
// without one), and the replay gives the op-by-op bits (cuBLAS is bit-reproducible on one GPU).
TEST_CASE("a captured GEMM replays the op-by-op product") {
  std::mt19937 rng(12);
  const int64_t rows = 300, cols = 512;
  const int n = 24;
  REQUIRE(n > ctx().gemv_max_cols);
  const auto w = random_weights(GgmlType::Q4_K, rows, cols, rng);
  cu::Weight W;
  cu::DeviceBuffer dw = cu::upload_weight(GgmlType::Q4_K, w.data(), rows, cols, W);
  auto dx = to_dev(random_floats(size_t(cols * n), rng));
  cu::DeviceBuffer dy(size_t(rows * n) * sizeof(float)), dg(size_t(rows * n) * sizeof(float));
  ctx().reserve(cu::matmul_scratch_bytes(ctx(), W, n));
  cu::matmul(ctx(), W, dx.as<float>(), n, dy.as<float>());
  const cu::Graph g = cu::capture(ctx(), [&] { cu::matmul(ctx(), W, dx.as<float>(), n, dg.as<float>()); });
  for (int rep = 0; rep < 2; rep++) cu::launch(ctx(), g);
  const auto a = to_host<float>(dy, size_t(rows * n)), b = to_host<float>(dg, size_t(rows * n));
  CHECK(std::all_of(a.begin(), a.end(), [](float v) { return std::isfinite(v); }));
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE("weights uploaded through small pinned staging buffers equal upload_weight's") {
  std::mt19937 rng(8);
  for (GgmlType t : kTypes) {
    const int64_t rows = 301, cols = 512;
    const auto w = random_weights(t, rows, cols, rng);
    cu::Weight A, B, C;
    cu::DeviceBuffer a = cu::upload_weight(t, w.data(), rows, cols, A);
    std::vector<cu::DeviceBuffer> keep;
    {
      // 7 rows per slab: 43 slabs alternating between the two buffers, and a second matrix after.
      cu::WeightUploader up(ctx(), 7 * cu::packed_row_bytes(t, cols));
      keep.push_back(up.upload(t, w.data(), rows, cols, B));
      keep.push_back(up.upload(t, w.data(), 5, cols, C));
      up.finish();
    }
    REQUIRE(B.row_stride == A.row_stride);
    const size_t bytes = A.row_stride * size_t(rows);
    CHECK(to_host<uint8_t>(a, bytes) == to_host<uint8_t>(keep[0], bytes));
    CHECK(to_host<uint8_t>(a, A.row_stride * 5) == to_host<uint8_t>(keep[1], A.row_stride * 5));
  }
}

TEST_CASE("dequantize to FP16 and embedding rows match the scalar dequantizer") {
  std::mt19937 rng(4);
  for (GgmlType t : kTypes) {
    const int64_t rows = 19, cols = 512;
    const auto w = random_weights(t, rows, cols, rng);
    const auto Wf = dequantize(t, w, rows, cols);
    cu::Weight W;
    cu::DeviceBuffer dw = cu::upload_weight(t, w.data(), rows, cols, W);

    cu::DeviceBuffer dh(size_t(rows * cols) * 2);
    cu::dequantize_f16(ctx(), W, 0, rows, dh.as<uint16_t>());
    const auto h = to_host<uint16_t>(dh, size_t(rows * cols));
    int bad = 0;
    for (size_t i = 0; i < h.size(); i++)
      if (h[i] != f32_to_fp16(Wf[i]) && std::fabs(fp16_to_f32(h[i]) - Wf[i]) > 1e-3f * std::fabs(Wf[i]) + 1e-7f) bad++;
    INFO(type_name(t) << " FP16 values off by more than rounding: " << bad);
    CHECK(bad == 0);

    const std::vector<int32_t> ids = {18, 0, 7, 7, 3};
    auto dids = to_dev(ids);
    cu::DeviceBuffer dout(ids.size() * size_t(cols) * sizeof(float));
    const float s = 1.75f;
    cu::embed_rows(ctx(), W, dids.as<int32_t>(), int(ids.size()), dout.as<float>(), s);
    const auto out = to_host<float>(dout, ids.size() * size_t(cols));
    std::vector<float> ref(out.size());
    cpu::QMatrix Q{t, w.data(), rows, cols, row_bytes(t, cols)};
    cpu::embed_rows(Q, ids.data(), int(ids.size()), ref.data(), s);
    bad = 0;
    for (size_t i = 0; i < out.size(); i++)
      if (std::fabs(out[i] - ref[i]) > 1e-6f * std::fabs(ref[i]) + 1e-9f) bad++;
    INFO(type_name(t) << " embedding values off: " << bad);
    CHECK(bad == 0);
  }
}

TEST_CASE("rms_norm, gates, add, add_rows, scale, softcap match kernels/cpu/ops") {
  std::mt19937 rng(5);
  auto close = [](const std::vector<float>& a, const std::vector<float>& b, float rel, const char* what) {
    int bad = 0;
    for (size_t i = 0; i < a.size(); i++)
      if (std::fabs(a[i] - b[i]) > rel * std::fabs(b[i]) + 1e-6f) bad++;
    INFO(what << ": " << bad << " of " << a.size() << " values off");
    CHECK(bad == 0);
  };
  for (int n : {7, 64, 576, 2049, 4096, 9000, 17001, 20000}) {  // float4s from 576; loops from 17001
    const int rows = 5;
    auto x = random_floats(size_t(rows * n), rng, -4.0f, 4.0f);
    auto w = random_floats(size_t(n), rng, 0.5f, 1.5f);
    auto dx = to_dev(x), dw = to_dev(w);
    cu::DeviceBuffer dy(x.size() * 4);
    std::vector<float> ref(x.size());
    for (bool weighted : {true, false}) {
      cu::rms_norm(ctx(), dx.as<float>(), weighted ? dw.as<float>() : nullptr, dy.as<float>(), rows, n, 1e-6f);
      cpu::rms_norm(x.data(), weighted ? w.data() : nullptr, ref.data(), rows, n, 1e-6f);
      close(to_host<float>(dy, x.size()), ref, 1e-5f, "rms_norm");
    }
    // The residual add fused with the norm, the output over the addend (as the forward calls it):
    // bit-identical to add, then rms_norm.
    const auto d = random_floats(x.size(), rng, -1.0f, 1.0f);
    auto x1 = to_dev(x), x2 = to_dev(x), d1 = to_dev(d), d2 = to_dev(d);
    cu::add(ctx(), x1.as<float>(), d1.as<float>(), int64_t(x.size()));
    cu::rms_norm(ctx(), x1.as<float>(), dw.as<float>(), d1.as<float>(), rows, n, 1e-6f);
    cu::add_rms_norm(ctx(), x2.as<float>(), d2.as<float>(), dw.as<float>(), d2.as<float>(), rows, n, 1e-6f);
    CHECK(to_host<float>(x1, x.size()) == to_host<float>(x2, x.size()));
    CHECK(to_host<float>(d1, x.size()) == to_host<float>(d2, x.size()));
    // With a residual scale (granite: x += 0.22·d): add with that scale, then rms_norm, bit for bit,
    // and the CPU's scaled add.
    auto x3 = to_dev(x), x4 = to_dev(x), d3 = to_dev(d), d4 = to_dev(d);
    cu::add(ctx(), x3.as<float>(), d3.as<float>(), int64_t(x.size()), 0.22f);
    cu::rms_norm(ctx(), x3.as<float>(), dw.as<float>(), d3.as<float>(), rows, n, 1e-6f);
    cu::add_rms_norm(ctx(), x4.as<float>(), d4.as<float>(), dw.as<float>(), d4.as<float>(), rows, n, 1e-6f, {}, 0.22f);
    CHECK(to_host<float>(x3, x.size()) == to_host<float>(x4, x.size()));
    CHECK(to_host<float>(d3, x.size()) == to_host<float>(d4, x.size()));
    std::vector<float> scaled = x, normed(x.size());
    cpu::add(scaled.data(), d.data(), int(x.size()), 0.22f);
    close(to_host<float>(x4, x.size()), scaled, 1e-6f, "add_rms_norm's scaled add");
    cpu::rms_norm(scaled.data(), w.data(), normed.data(), rows, n, 1e-6f);
    close(to_host<float>(d4, x.size()), normed, 1e-5f, "add_rms_norm with a residual scale");
    CHECK(to_host<float>(x4, x.size()) != to_host<float>(x2, x.size()));  // the scale is applied
  }
  const int64_t n = 10001;
  auto g = random_floats(size_t(n), rng, -8.0f, 8.0f), u = random_floats(size_t(n), rng, -2.0f, 2.0f);
  auto dg = to_dev(g), du = to_dev(u);
  cu::DeviceBuffer dy(size_t(n) * 4);
  std::vector<float> ref(static_cast<size_t>(n));
  cu::silu_gate(ctx(), dg.as<float>(), du.as<float>(), dy.as<float>(), n);
  cpu::silu_gate(g.data(), u.data(), ref.data(), int(n));
  close(to_host<float>(dy, size_t(n)), ref, 1e-5f, "silu_gate");
  cu::gelu_tanh_gate(ctx(), dg.as<float>(), du.as<float>(), dy.as<float>(), n);
  cpu::gelu_tanh_gate(g.data(), u.data(), ref.data(), int(n));
  close(to_host<float>(dy, size_t(n)), ref, 1e-5f, "gelu_tanh_gate");
  // gpt-oss's gate: g beyond its clamp at 7 (from above only), u beyond ±7 and through -1 (u + 1 = 0).
  const auto g9 = random_floats(size_t(n), rng, -10.0f, 10.0f), u9 = random_floats(size_t(n), rng, -9.0f, 9.0f);
  auto dg9 = to_dev(g9), du9 = to_dev(u9);
  cu::swiglu_oai_gate(ctx(), dg9.as<float>(), du9.as<float>(), dy.as<float>(), n);
  cpu::swiglu_oai_gate(g9.data(), u9.data(), ref.data(), int(n));
  close(to_host<float>(dy, size_t(n)), ref, 1e-5f, "swiglu_oai_gate");

  ref = g;
  cpu::add(ref.data(), u.data(), int(n));
  cpu::scale(ref.data(), 0.37f, int(n));
  cpu::softcap(ref.data(), 5.0f, int(n));
  cu::add(ctx(), dg.as<float>(), du.as<float>(), n);
  cu::scale(ctx(), dg.as<float>(), 0.37f, n);
  cu::softcap(ctx(), dg.as<float>(), 5.0f, n);
  close(to_host<float>(dg, size_t(n)), ref, 1e-5f, "add+scale+softcap");

  // A bias row added to every row (q/k/v, output and expert biases): the CPU's add per row, bit for bit.
  for (int width : {1, 7, 64, 2880}) {
    const int rows = 13;
    const auto y = random_floats(size_t(rows) * size_t(width), rng, -3.0f, 3.0f);
    const auto bias = random_floats(size_t(width), rng, -1.0f, 1.0f);
    auto dyr = to_dev(y), db = to_dev(bias);
    cu::add_rows(ctx(), dyr.as<float>(), db.as<float>(), rows, width);
    std::vector<float> want = y;
    for (int r = 0; r < rows; ++r) cpu::add(want.data() + size_t(r) * size_t(width), bias.data(), width);
    CHECK(to_host<float>(dyr, y.size()) == want);
  }
}

TEST_CASE("a mixture of experts' gather, weighted scatter-add and zero match kernels/cpu/ops") {
  std::mt19937 rng(15);
  for (int width : {7, 96, 2048}) {
    const int n = 11;
    const auto x = random_floats(size_t(n * width), rng, -2.0f, 2.0f);
    const std::vector<int32_t> rows = {9, 0, 4, 10, 2};  // one expert's tokens, distinct
    const int m = int(rows.size());
    const auto y = random_floats(size_t(m * width), rng, -1.0f, 1.0f), acc0 = random_floats(x.size(), rng, -1.0f, 1.0f);
    const auto w = random_floats(size_t(n), rng, -3.0f, 3.0f);
    auto dx = to_dev(x), drows = to_dev(rows), dy = to_dev(y), dw = to_dev(w);
    cu::DeviceBuffer dg(size_t(m * width) * 4);
    cu::gather_rows(ctx(), dx.as<float>(), drows.as<int32_t>(), m, width, dg.as<float>());
    std::vector<float> ref(size_t(m * width));
    cpu::gather_rows(x.data(), rows.data(), m, width, ref.data());
    CHECK(to_host<float>(dg, ref.size()) == ref);  // copies: exact
    for (bool sigmoid_w : {false, true}) {
      for (bool identity : {false, true}) {
        INFO("width " << width << (sigmoid_w ? " sigmoid" : "") << (identity ? " rows j" : ""));
        const int count = identity ? n : m;
        const auto yy = identity ? random_floats(x.size(), rng, -1.0f, 1.0f) : y;
        auto dacc = to_dev(acc0), dyy = to_dev(yy);
        cu::scatter_add_rows(ctx(), dacc.as<float>(), dyy.as<float>(), identity ? nullptr : drows.as<int32_t>(),
                             dw.as<float>(), sigmoid_w, count, width);
        std::vector<float> want = acc0;
        cpu::scatter_add_rows(want.data(), yy.data(), identity ? nullptr : rows.data(), w.data(), sigmoid_w, count, width);
        const auto got = to_host<float>(dacc, want.size());
        int bad = 0;
        for (size_t i = 0; i < want.size(); i++)
          if (std::fabs(got[i] - want[i]) > 1e-6f * std::fabs(want[i]) + 1e-6f) bad++;
        CHECK(bad == 0);
        size_t untouched = 0;  // rows no token of the launch names keep their values
        for (int r = 0; r < n && !identity; ++r)
          if (std::find(rows.begin(), rows.end(), r) == rows.end())
            for (int e = 0; e < width; ++e) untouched += got[size_t(r * width + e)] == acc0[size_t(r * width + e)];
        if (!identity) CHECK(untouched == size_t((n - m) * width));
      }
    }
    cu::zero(ctx(), dx.get(), x.size() * 4);
    CHECK(to_host<float>(dx, x.size()) == std::vector<float>(x.size(), 0.f));
  }
}

// The decode steps of a mixture of experts route on the device (runtime/gpu_stage.cpp,
// moe_on_device): the routing against cpu::moe_route (ids exact, NaN and all -inf rows, ties to
// the lower id), each (token, expert) pair's GEMV against cuda::gemv of that expert alone, the
// experts' biases by id and the weighted sum against the CPU's scatter-add in rank order.
TEST_CASE("a mixture of experts routed on the device matches kernels/cpu/ops and per-expert GEMVs") {
  std::mt19937 rng(16);
  struct Route { int n_expert, k; bool renorm; };
  for (const Route& r : {Route{8, 2, true}, Route{60, 4, false}, Route{128, 8, true}, Route{32, 4, true},
                         Route{512, 8, true}, Route{5, 8, true}, Route{33, 1, false}}) {
    INFO(r.n_expert << " experts, top " << r.k << (r.renorm ? ", renormalized" : ""));
    const int n = 13, X = r.n_expert, K = r.k;
    auto logits = random_floats(size_t(n * X), rng, -4.0f, 4.0f);
    logits[size_t(1 * X + X / 2)] = std::nanf("");                                 // a NaN counts as -inf
    std::fill(logits.begin() + 2 * X, logits.begin() + 3 * X, -INFINITY);           // no finite logit
    logits[size_t(4 * X + X - 1)] = logits[size_t(4 * X)] = 6.0f;                   // a tie at the top
    auto dl = to_dev(logits);
    cu::DeviceBuffer dids(size_t(n * K) * 4), dw(size_t(n * K) * 4);
    cu::moe_route(ctx(), dl.as<float>(), n, X, K, r.renorm, dids.as<int32_t>(), dw.as<float>());
    const auto ids = to_host<int32_t>(dids, size_t(n * K));
    const auto w = to_host<float>(dw, size_t(n * K));
    CHECK(to_host<float>(dl, logits.size())[size_t(X)] == logits[size_t(X)]);  // the logits are not changed
    std::vector<int32_t> want_ids(size_t(n * K));
    std::vector<float> want_w(size_t(n * K)), row(static_cast<size_t>(X));
    for (int t = 0; t < n; ++t) {
      std::copy(logits.begin() + t * X, logits.begin() + (t + 1) * X, row.begin());
      cpu::moe_route(row.data(), X, K, r.renorm, want_ids.data() + t * K, want_w.data() + t * K);
    }
    CHECK(ids == want_ids);
    int bad = 0;
    for (size_t i = 0; i < w.size(); ++i) bad += std::fabs(w[i] - want_w[i]) > 2e-6f * std::fabs(want_w[i]) + 1e-7f;
    CHECK(bad == 0);
    CHECK(ids[size_t(2 * K)] == -1);
    if (K > 1 && X > 1) CHECK(ids[size_t(4 * K)] == 0);
  }
  // Gate and up of 3 tokens x 2 experts (one pair without an expert) in one launch, and down with a
  // column per pair; every CUDA weight type.
  const int n_exp = 5, F = 37, E = 256, n = 3, K = 2, P = n * K;
  const std::vector<int32_t> ids = {3, 0, 4, -1, 1, 3};
  auto did = to_dev(ids);
  for (GgmlType t : kTypes) {
    INFO(type_name(t));
    std::vector<uint8_t> wg, wu;
    for (int e = 0; e < n_exp; ++e) {
      const auto a = random_weights(t, F, E, rng), b = random_weights(t, F, E, rng);
      wg.insert(wg.end(), a.begin(), a.end());
      wu.insert(wu.end(), b.begin(), b.end());
    }
    cu::Weight Wg, Wu;
    cu::DeviceBuffer bg = cu::upload_weight(t, wg.data(), int64_t(F) * n_exp, E, Wg);
    cu::DeviceBuffer bu = cu::upload_weight(t, wu.data(), int64_t(F) * n_exp, E, Wu);
    cu::ExpertWeights gate{Wg, size_t(F) * Wg.row_stride}, up{Wu, size_t(F) * Wu.row_stride};
    gate.first.rows = up.first.rows = F;
    for (int x_div : {K, 1}) {
      INFO("x_div " << x_div);
      const int n_x = P / x_div;
      const auto x = random_floats(size_t(n_x * E), rng);
      auto dx = to_dev(x);
      const std::vector<float> sentinel(size_t(P * F), 7.0f);
      auto dg = to_dev(sentinel), du = to_dev(sentinel);
      const cu::ExpertOut outs[] = {{&gate, dg.as<float>()}, {&up, du.as<float>()}};
      cu::gemv_experts(ctx(), outs, 2, dx.as<float>(), x_div, did.as<int32_t>(), P);
      const auto yg = to_host<float>(dg, sentinel.size()), yu = to_host<float>(du, sentinel.size());
      cu::DeviceBuffer one(size_t(F) * 4);
      for (int p = 0; p < P; ++p) {
        for (int m = 0; m < 2; ++m) {
          const std::vector<float>& got = m ? yu : yg;
          if (ids[size_t(p)] < 0) {
            CHECK(std::equal(got.begin() + p * F, got.begin() + (p + 1) * F, sentinel.begin()));  // not written
            continue;
          }
          cu::Weight v = (m ? up : gate).first;
          v.data = static_cast<const uint8_t*>(v.data) + size_t(ids[size_t(p)]) * (m ? up : gate).expert_bytes;
          cu::gemv(ctx(), v, dx.as<float>() + size_t(p / x_div) * E, 1, one.as<float>());
          const auto want = to_host<float>(one, size_t(F));
          float scale = 0;
          for (float y : want) scale = std::max(scale, std::fabs(y));
          int bad = 0;
          for (int i = 0; i < F; ++i) bad += std::fabs(got[size_t(p * F + i)] - want[size_t(i)]) > 1e-5f * scale + 1e-7f;
          INFO("pair " << p << (m ? " up" : " gate"));
          CHECK(bad == 0);
        }
      }
    }
  }
  // Biases by id, then each token's weighted sum in ascending expert id.
  const int W = 96;
  const auto bias = random_floats(size_t(n_exp * W), rng), y0 = random_floats(size_t(P * W), rng);
  const auto wt = random_floats(size_t(P), rng, 0.0f, 1.0f);
  auto db = to_dev(bias), dy = to_dev(y0), dwt = to_dev(wt);
  cu::add_rows_id(ctx(), dy.as<float>(), db.as<float>(), did.as<int32_t>(), P, W);
  std::vector<float> y = y0;
  for (int p = 0; p < P; ++p)
    if (ids[size_t(p)] >= 0) cpu::add(y.data() + p * W, bias.data() + ids[size_t(p)] * W, W);
  CHECK(to_host<float>(dy, y.size()) == y);  // one add each: exact
  std::vector<float> nan_row = y;
  std::fill(nan_row.begin() + 3 * W, nan_row.begin() + 4 * W, std::nanf(""));  // the pair without an expert is never read
  auto dyn = to_dev(nan_row);
  cu::DeviceBuffer dacc(size_t(n * W) * 4);
  cu::moe_combine(ctx(), dacc.as<float>(), dyn.as<float>(), did.as<int32_t>(), dwt.as<float>(), n, K, W);
  std::vector<float> want(size_t(n * W), 0.0f);
  for (int t = 0; t < n; ++t) {  // each token's experts in ascending id
    std::vector<int> order(static_cast<size_t>(K));
    for (int j = 0; j < K; ++j) order[size_t(j)] = t * K + j;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[size_t(a)] < ids[size_t(b)]; });
    for (int p : order)
      if (ids[size_t(p)] >= 0) cpu::scatter_add_rows(want.data(), y.data() + p * W, &t, wt.data() + p, false, 1, W);
  }
  const auto got = to_host<float>(dacc, want.size());
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += !(std::fabs(got[i] - want[i]) <= 1e-6f * std::fabs(want[i]) + 1e-7f);
  CHECK(bad == 0);
}

TEST_CASE("argmax and top-k on the device skip NaN and treat -0 and +0 as equal, as the CPU does") {
  std::mt19937 rng(11);
  // 3000: argmax in 2 slices, top_k in one block per row; 20000: argmax in 10 slices, top_k in 2;
  // 16394: top_k's last slice of 10 values (fewer than k: padded).
  for (const int n_vocab : {3000, 20000, 16394}) {
  INFO(n_vocab << " values per row");
  const int k = 40;
  auto x = random_floats(size_t(n_vocab) * 3, rng, -20.0f, 20.0f);
  float* r0 = x.data();  // NaNs at the top and spread through the row
  r0[5] = r0[2999] = std::nanf("");
  for (int i = 0; i < n_vocab; i += 97) r0[i] = std::nanf("");
  float* r1 = x.data() + n_vocab;  // the k-th place among zeros of both signs
  for (int i = 0; i < n_vocab; i++) r1[i] = i < 30 ? 1.0f + float(i) : (i % 2 ? -0.0f : 0.0f);
  float* r2 = x.data() + 2 * n_vocab;  // fewer than k values that are not NaN
  const int every = n_vocab > 3000 ? 1000 : 100;
  for (int i = 0; i < n_vocab; i++) r2[i] = i % every == 3 ? float(i) : std::nanf("");
  auto dx = to_dev(x);
  cu::DeviceBuffer dam(3 * 4), di(size_t(3 * k) * 4), dv(size_t(3 * k) * 4);
  cu::argmax(ctx(), dx.as<float>(), n_vocab, 3, dam.as<int32_t>());
  cu::top_k(ctx(), dx.as<float>(), n_vocab, 3, k, di.as<int32_t>(), dv.as<float>());
  const auto am = to_host<int32_t>(dam, 3);
  const auto idx = to_host<int32_t>(di, size_t(3 * k));
  const auto val = to_host<float>(dv, size_t(3 * k));
  for (int r = 0; r < 3; r++) {
    INFO("row " << r);
    const float* row = x.data() + size_t(r) * n_vocab;
    CHECK(am[size_t(r)] == cpu::argmax(row, n_vocab));
    std::vector<int32_t> ci(size_t(k), -1);
    std::vector<float> cv(size_t(k), 0.0f);
    const int found = cpu::top_k(row, n_vocab, k, ci.data(), cv.data());
    for (int i = 0; i < k; i++) {
      if (i < found) {
        CHECK(idx[size_t(r * k + i)] == ci[size_t(i)]);
        CHECK(val[size_t(r * k + i)] == cv[size_t(i)]);
      } else {
        CHECK(std::isnan(val[size_t(r * k + i)]));  // the rest of the row's k: NaNs, in index order
        if (i > found) CHECK(idx[size_t(r * k + i)] > idx[size_t(r * k + i - 1)]);
      }
    }
    for (int i = 0; i < k; i++) CHECK(idx[size_t(r * k + i)] < n_vocab);
    if (r == 2) CHECK(found == (n_vocab + every - 4) / every);
  }
  }
}

// A new Context's first argmax of long rows: the slices' counters must be zero on its stream
// before any kernel runs (a memset on the legacy stream, which a non-blocking stream does not wait
// for, lost this race on the simulator).
TEST_CASE("a fresh context's first argmax over slices finds the maximum") {
  std::mt19937 rng(12);
  const int n_vocab = 50000, rows = 2;
  const auto x = random_floats(size_t(n_vocab) * rows, rng, -5.0f, 5.0f);
  cu::Context c(0);
  cu::DeviceBuffer dx(x.size() * 4), dam(rows * 4);
  cu::copy_to_device(c, dx.get(), x.data(), x.size() * 4);
  cu::argmax(c, dx.as<float>(), n_vocab, rows, dam.as<int32_t>());
  std::vector<int32_t> am(rows);
  cu::copy_to_host(c, am.data(), dam.get(), rows * 4);
  c.synchronize();
  for (int r = 0; r < rows; r++) {
    const float* row = x.data() + size_t(r) * n_vocab;
    CHECK(am[size_t(r)] == int(std::max_element(row, row + n_vocab) - row));
  }
}

TEST_CASE("argmax and top-k on the device match a host sort, ties to the lowest index") {
  std::mt19937 rng(10);
  for (int n_vocab : {1, 37, 1000, 262144}) {
    const int rows = 3;
    auto x = random_floats(size_t(n_vocab) * rows, rng, -20.0f, 20.0f);
    if (n_vocab >= 1000) {  // plant exact ties at the top and at the k-th place
      for (int r = 0; r < rows; r++) {
        float* row = x.data() + size_t(r) * n_vocab;
        row[n_vocab - 1] = row[n_vocab / 2] = row[7] = 30.0f;
        for (int i = 100; i < 140; i++) row[i] = 25.0f;
      }
    }
    auto dx = to_dev(x);
    cu::DeviceBuffer dam(rows * 4);
    for (int rep = 0; rep < 2; rep++) {  // again: the long rows' counters are back at 0
      const std::vector<int32_t> none(size_t(rows), -1);
      cu::copy_to_device(ctx(), dam.get(), none.data(), none.size() * 4);
      cu::argmax(ctx(), dx.as<float>(), n_vocab, rows, dam.as<int32_t>());
      const auto am = to_host<int32_t>(dam, rows);
      for (int r = 0; r < rows; r++) {
        const float* row = x.data() + size_t(r) * n_vocab;
        CHECK(am[size_t(r)] == int(std::max_element(row, row + n_vocab) - row));  // first of the maxima
      }
    }
    for (int k : {1, 5, 40, 256}) {
      if (k > n_vocab) continue;
      cu::DeviceBuffer di(size_t(rows * k) * 4), dv(size_t(rows * k) * 4);
      cu::top_k(ctx(), dx.as<float>(), n_vocab, rows, k, di.as<int32_t>(), dv.as<float>());
      const auto idx = to_host<int32_t>(di, size_t(rows * k));
      const auto val = to_host<float>(dv, size_t(rows * k));
      for (int r = 0; r < rows; r++) {
        const float* row = x.data() + size_t(r) * n_vocab;
        std::vector<int> order(static_cast<size_t>(n_vocab));
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
          return row[a] > row[b] || (row[a] == row[b] && a < b);
        });
        INFO("n_vocab " << n_vocab << " k " << k << " row " << r);
        for (int i = 0; i < k; i++) {
          CHECK(idx[size_t(r * k + i)] == order[size_t(i)]);
          CHECK(val[size_t(r * k + i)] == row[order[size_t(i)]]);
        }
      }
    }
  }
}
