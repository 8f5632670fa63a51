// CPU matmul and thread pool: every weight type on every ISA level the CPU has, awkward shapes,
// against a double-precision reference built from the scalar dequantizer.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "helpers.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed.h"
#include "kernels/cpu/threadpool.h"
#include "quant/quant.h"

using namespace baton;
using namespace baton::cpu;

namespace {

// A random row-major matrix in type t with sane scales (no zeros, no infinities).
std::vector<uint8_t> random_matrix(GgmlType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const size_t rb = row_bytes(t, cols);
  std::vector<uint8_t> m(rb * size_t(rows));
  std::uniform_real_distribution<float> val(-1.0f, 1.0f), scale(0.002f, 0.02f);
  std::uniform_int_distribution<int> byte(0, 255);
  auto put16 = [&](size_t off, uint16_t v) { std::memcpy(&m[off], &v, 2); };
  if (t == GgmlType::F32) {
    for (size_t i = 0; i < m.size(); i += 4) {
      float v = val(rng);
      std::memcpy(&m[i], &v, 4);
    }
    return m;
  }
  if (t == GgmlType::F16 || t == GgmlType::BF16) {
    for (size_t i = 0; i < m.size(); i += 2) put16(i, t == GgmlType::F16 ? f32_to_fp16(val(rng)) : f32_to_bf16(val(rng)));
    return m;
  }
  for (auto& b : m) b = uint8_t(byte(rng));
  const TypeTraits& tt = traits(t);
  const auto fields = test::fp16_fields(t);
  for (size_t blk = 0; blk < m.size() / tt.block_bytes; blk++)
    for (int off : fields) {
      float s = scale(rng);
      if (t == GgmlType::Q4_1 || t == GgmlType::Q5_1) s = off == 0 ? s : -8 * s * val(rng);  // min
      put16(blk * tt.block_bytes + size_t(off), f32_to_fp16(s));
    }
  for (size_t blk = 0; blk < m.size() / tt.block_bytes; blk++)
    for (int off : test::e8m0_fields(t)) m[blk * tt.block_bytes + size_t(off)] = test::random_e8m0(rng);
  return m;
}

std::vector<float> random_floats(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = d(rng);
    if (x == 0.0f) x = 0.5f;
  }
  return v;
}

bool is_float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

// Checks Y against double references. The integer paths quantize each activation block of size
// `ablk` to 8 bits (scale amax/127), so element k may be off by amax/254: against the exact
// activations the bound adds that up (times a hair for float rounding); against activations
// rounded the same way the kernels must agree to float accumulation error (2e-5 of Σ|w·x|).
// With pack, W is multiplied in the packed (row-interleaved) layout. wbytes: the matrix (random
// when empty); tiny: the absolute tolerance (outputs near zero, or subnormal ones).
void check_matmul(GgmlType t, int64_t rows, int64_t cols, int n, std::mt19937& rng, ThreadPool& pool,
                  bool pack = false, std::vector<uint8_t> wbytes = {}, double tiny = 1e-30) {
  if (wbytes.empty()) wbytes = random_matrix(t, rows, cols, rng);
  const auto x = random_floats(size_t(cols) * size_t(n), rng);
  QMatrix W{t, wbytes.data(), rows, cols, row_bytes(t, cols)};
  PackedBuffer packed;
  if (pack) {
    packed = alloc_packed(packed_bytes(t, rows, cols));
    pack_matrix(W, packed.get(), &pool);
    W.packed = packed.get();
  }
  std::vector<float> y(size_t(rows) * size_t(n), std::nanf(""));
  matmul(W, x.data(), n, y.data(), pool);

  // Packed weights (any type) read 32-element activation blocks; row kernels the weight's block.
  const int64_t ablk = !pack && traits(t).block_elems >= 256 ? 256 : 32;
  std::vector<float> w(static_cast<size_t>(cols));
  int bad = 0;
  for (int64_t r = 0; r < rows; r++) {
    dequantize_row(t, W.row(r), w.data(), cols);
    for (int j = 0; j < n; j++) {
      const float* xj = x.data() + size_t(j) * size_t(cols);
      // ref: exact activations; refq: the activations after the documented 8-bit rounding
      // (d = amax/127, q = round-half-even(x·127/amax)), which the kernels must match closely.
      double ref = 0, refq = 0, mag = 0, qerr = 0;
      for (int64_t k0 = 0; k0 < cols; k0 += ablk) {
        const int64_t k1 = std::min(cols, k0 + ablk);
        float amax = 0;
        double wabs = 0;
        for (int64_t k = k0; k < k1; k++) amax = std::max(amax, std::fabs(xj[k]));
        const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
        for (int64_t k = k0; k < k1; k++) {
          const double wk = w[size_t(k)];
          const double xq = is_float_type(t) ? xj[k] : double(std::nearbyint(xj[k] * id)) * d;
          ref += wk * xj[k];
          refq += wk * xq;
          mag += std::fabs(wk * xj[k]);
          wabs += std::fabs(wk);
        }
        qerr += wabs * amax / 254.0;
      }
      const double tol = (is_float_type(t) ? 0.0 : qerr * 1.001) + 2e-5 * mag + tiny;
      const double tolq = 2e-5 * mag + tiny;
      const double got = y[size_t(j) * size_t(rows) + size_t(r)];
      if (!(std::fabs(got - ref) <= tol && std::fabs(got - refq) <= tolq) && bad++ < 5)
        FAIL_CHECK(type_name(t) << " " << isa_name(active_isa()) << " rows=" << rows << " cols=" << cols << " n=" << n
                                << " r=" << r << " j=" << j << ": got " << got << " want " << ref << " (quantized x: "
                                << refq << ") tol " << tol << " / " << tolq);
    }
  }
  CHECK(bad == 0);
}

std::vector<Isa> isa_levels() {
  std::vector<Isa> v;
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    if (int(i) <= int(detected_isa())) v.push_back(i);
    else WARN("CPU lacks " << isa_name(i) << ": that path is not tested here");
  }
  return v;
}

}  // namespace

TEST_CASE("thread pool runs every task exactly once on exactly n threads") {
  for (int threads = 1; threads <= 4; threads++) {
    ThreadPool pool(threads);
    REQUIRE(pool.size() == threads);
    for (int n_tasks : {0, 1, 2, 3, 7, 64, 1000}) {
      for (int rep = 0; rep < 3; rep++) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n_tasks));
        std::vector<std::atomic<int>> by_thread(static_cast<size_t>(threads));
        std::atomic<int> bad_thread{0};  // Catch2's assertions are not thread-safe: count, check after
        pool.run(n_tasks, [&](int task, int thread) {
          if (thread < 0 || thread >= threads) {
            bad_thread.fetch_add(1);
            return;
          }
          hits[size_t(task)].fetch_add(1);
          by_thread[size_t(thread)].fetch_add(1);
        });
        CHECK(bad_thread.load() == 0);
        int total = 0;
        for (auto& h : hits) CHECK(h.load() == 1);
        for (auto& b : by_thread) total += b.load();
        CHECK(total == n_tasks);
      }
    }
  }
}

TEST_CASE("thread pool uses its workers and survives many small jobs") {
  ThreadPool pool(3);
  // Each task holds its thread until three tasks run at once, which needs all three threads
  // (the caller alone could never get there). A timeout turns a broken pool into a failure.
  std::atomic<int> arrived{0};
  std::vector<std::atomic<int>> seen(3);
  pool.run(3, [&](int, int thread) {
    seen[size_t(thread)].fetch_add(1);
    arrived.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (arrived.load() < 3 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  });
  CHECK(arrived.load() == 3);
  for (auto& s : seen) CHECK(s.load() == 1);
  std::atomic<long> sum{0};
  for (int i = 0; i < 2000; i++) pool.run(4, [&](int task, int) { sum += task; });
  CHECK(sum.load() == 2000L * 6);
}

TEST_CASE("isa names parse back and the limit lowers the active level") {
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    Isa back = Isa::Scalar;
    REQUIRE(parse_isa(isa_name(i), back));
    CHECK(back == i);
  }
  Isa dummy;
  CHECK_FALSE(parse_isa("sse9", dummy));
  set_isa_limit(Isa::Scalar);
  CHECK(active_isa() == Isa::Scalar);
  set_isa_limit(Isa::Avx512);
  CHECK(active_isa() == detected_isa());
}

TEST_CASE("matmul matches the reference for every type, ISA level and awkward shape") {
  std::mt19937 rng(1234);
  ThreadPool pool(2);
  for (Isa isa : isa_levels()) {
    set_isa_limit(isa);
    REQUIRE(active_isa() == isa);
    for (GgmlType t : kComputeTypes) {
      const int64_t blk = traits(t).block_elems == 1 ? 32 : traits(t).block_elems;
      INFO("type " << type_name(t) << " isa " << isa_name(isa));
      check_matmul(t, 1, blk, 1, rng, pool);         // one row, one block
      check_matmul(t, 37, blk, 3, rng, pool);        // rows not a multiple of any SIMD width
      check_matmul(t, 19, blk * 9, 1, rng, pool);    // many blocks, odd count
      check_matmul(t, 70, blk * 2, 257, rng, pool);  // prefill-sized column count
      check_matmul(t, 5, blk * 3, 17, rng, pool);
    }
  }
  set_isa_limit(Isa::Avx512);
}

TEST_CASE("legacy formats match the reference for 1..70 columns and rows off the tile grid") {
  // The kernels group columns by 4 and blocks by 4 (Q4x4) or 2 (Q8x2): every count below leaves
  // some remainder in one of those.
  std::mt19937 rng(4321);
  ThreadPool pool(2);
  const int64_t row_counts[] = {1, 3, 5, 6, 7, 13, 37};
  const int64_t block_counts[] = {1, 5, 18, 8};
  for (Isa isa : isa_levels()) {
    set_isa_limit(isa);
    for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                       GgmlType::IQ4_NL, GgmlType::MXFP4}) {
      INFO("type " << type_name(t) << " isa " << isa_name(isa));
      int i = 0;
      for (int n = 1; n <= 70; n += (n < 10 ? 1 : 7), i++)
        check_matmul(t, row_counts[i % 7], 32 * block_counts[i % 4], n, rng, pool);
      check_matmul(t, 9, 4096, 70, rng, pool);  // more columns than one activation block
    }
  }
  set_isa_limit(Isa::Avx512);
}

TEST_CASE("matmul is deterministic across thread counts") {
  std::mt19937 rng(99);
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::F16}) {
    const int64_t rows = 131, cols = 512;
    const auto wbytes = random_matrix(t, rows, cols, rng);
    for (int n : {5, 37}) {
      const auto x = random_floats(size_t(cols) * size_t(n), rng);
      QMatrix W{t, wbytes.data(), rows, cols, row_bytes(t, cols)};
      std::vector<float> y1(size_t(rows) * size_t(n)), y4(size_t(rows) * size_t(n));
      ThreadPool p1(1), p4(4);
      matmul(W, x.data(), n, y1.data(), p1);
      matmul(W, x.data(), n, y4.data(), p4);
      CHECK(std::memcmp(y1.data(), y4.data(), y1.size() * 4) == 0);
    }
  }
}

TEST_CASE("a column's result does not depend on how many columns came with it") {
  // The pipeline and the engine rely on this: a sequence decoded alone, in a batch of 16, or in a
  // micro-batch of 6 gets the same bits, whichever kernel (per-row dot or GEMM) the count selects.
  std::mt19937 rng(7);
  ThreadPool pool(2);
  for (Isa isa : isa_levels()) {
    set_isa_limit(isa);
    for (GgmlType t : kComputeTypes) {
      INFO("type " << type_name(t) << " isa " << isa_name(isa));
      const int64_t blk = traits(t).block_elems == 1 ? 32 : traits(t).block_elems;
      for (int64_t cols : {blk * 18, blk * 7}) {  // whole groups of four blocks, and a tail
        const int64_t rows = 21;
        const int n = 19;
        const auto wbytes = random_matrix(t, rows, cols, rng);
        const auto x = random_floats(size_t(cols) * size_t(n), rng);
        QMatrix W{t, wbytes.data(), rows, cols, row_bytes(t, cols)};
        std::vector<float> all(size_t(rows) * size_t(n)), one(static_cast<size_t>(rows));
        matmul(W, x.data(), n, all.data(), pool);
        for (int j = 0; j < n; j++) {
          matmul(W, x.data() + size_t(j) * size_t(cols), 1, one.data(), pool);
          CHECK(std::memcmp(one.data(), all.data() + size_t(j) * size_t(rows), one.size() * 4) == 0);
        }
      }
    }
  }
  set_isa_limit(Isa::Avx512);
}

// ---- packed (row-interleaved) weights ----

namespace {

constexpr GgmlType kPackable[] = {GgmlType::Q4_0,   GgmlType::Q4_1,  GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                                  GgmlType::Q2_K,   GgmlType::Q3_K,  GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K,
                                  GgmlType::IQ4_NL, GgmlType::IQ4_XS, GgmlType::MXFP4, GgmlType::F16,
                                  GgmlType::BF16};

// The row-length unit of a packed type: its block (32, or a 256-element k-quant super-block; the
// float types' tiles span 32 elements).
int64_t unit(GgmlType t) { return is_float_type(t) ? 32 : traits(t).block_elems; }

struct Packed {
  std::vector<uint8_t> bytes;
  PackedBuffer buf;
  QMatrix W;
};
Packed make_packed(GgmlType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  Packed p;
  p.bytes = random_matrix(t, rows, cols, rng);
  p.W = QMatrix{t, p.bytes.data(), rows, cols, row_bytes(t, cols)};
  p.buf = alloc_packed(packed_bytes(t, rows, cols));
  pack_matrix(p.W, p.buf.get());
  p.W.packed = p.buf.get();
  return p;
}

}  // namespace

TEST_CASE("packed weights: same bytes as the file, every row recovered exactly") {
  std::mt19937 rng(11);
  for (GgmlType t : kPackable) {
    INFO(type_name(t));
    CHECK(packed_bytes(t, 32, 256) == 32 * row_bytes(t, 256));  // no overhead on whole groups
    CHECK(packed_bytes(t, 17, 256) == 32 * row_bytes(t, 256));  // padded to two groups
    const Packed p = make_packed(t, 37, unit(t) * 7, rng);
    std::vector<float> want(size_t(p.W.cols)), got(size_t(p.W.cols));
    for (int64_t r = 0; r < p.W.rows; r++) {
      dequantize_row(t, p.W.row(r), want.data(), p.W.cols);
      unpack_row(p.W, r, got.data());
      CHECK(std::memcmp(want.data(), got.data(), want.size() * 4) == 0);
    }
  }
}

TEST_CASE("packed weights match the reference on every ISA level and awkward shapes") {
  std::mt19937 rng(2468);
  ThreadPool pool(2);
  for (Isa isa : isa_levels()) {
    set_isa_limit(isa);
    for (GgmlType t : kPackable) {
      INFO("type " << type_name(t) << " isa " << isa_name(isa));
      const int64_t u = unit(t);
      check_matmul(t, 1, u, 1, rng, pool, true);
      check_matmul(t, 15, u * 3, 2, rng, pool, true);
      check_matmul(t, 16, u * 5, 8, rng, pool, true);
      check_matmul(t, 17, u * 9, 9, rng, pool, true);
      check_matmul(t, 37, u * 18, 3, rng, pool, true);
      check_matmul(t, 70, u * 2, 257, rng, pool, true);
      check_matmul(t, 9, 4096, 20, rng, pool, true);
    }
  }
  set_isa_limit(Isa::Avx512);
}

TEST_CASE("packed: a column's bits do not depend on the column count, the threads or the ISA kernel") {
  std::mt19937 rng(97);
  for (GgmlType t : kPackable) {
    INFO(type_name(t));
    const int64_t rows = 53, cols = unit(t) * 11;
    const Packed p = make_packed(t, rows, cols, rng);
    // Counts past one 8-column pass: 19 = 8 + 8 + 3, and 9..15.
    for (int n : {19, 9, 10, 11, 12, 13, 14, 15}) {
      INFO("columns " << n);
      const auto x = random_floats(size_t(cols) * size_t(n), rng);
      std::vector<float> all(size_t(rows) * size_t(n)), other(size_t(rows) * size_t(n));
      std::vector<float> one(static_cast<size_t>(rows));
      ThreadPool p1(1), p3(3);
      matmul(p.W, x.data(), n, all.data(), p3);
      matmul(p.W, x.data(), n, other.data(), p1);
      CHECK(std::memcmp(all.data(), other.data(), all.size() * 4) == 0);
      for (int j = 0; j < n; j++) {
        matmul(p.W, x.data() + size_t(j) * size_t(cols), 1, one.data(), p1);
        CHECK(std::memcmp(one.data(), all.data() + size_t(j) * size_t(rows), one.size() * 4) == 0);
      }
      // The SIMD tiles (AVX-512's, AVX2's where it has them) perform the portable kernel's
      // operations in the same order: same bits.
      set_isa_limit(Isa::Scalar);
      matmul(p.W, x.data(), n, other.data(), p3);
      for (Isa isa : isa_levels()) {
        INFO("isa " << isa_name(isa));
        set_isa_limit(isa);
        matmul(p.W, x.data(), n, all.data(), p3);
        CHECK(std::memcmp(all.data(), other.data(), all.size() * 4) == 0);
      }
      set_isa_limit(Isa::Avx512);
    }
  }
}

TEST_CASE("MXFP4: every exponent the kernels can meet, e = 0 and 1 (subnormal scales) included") {
  // Row r's blocks all have exponent kE[r % 10]: e = 0 and 1 scale by the float32 subnormals 2^-128
  // and 2^-127 (what ggml reads them as), which every kernel keeps exact; their outputs (~1e-38,
  // subnormal too) are checked against the double reference to a few units of 2^-149, so a kernel
  // that flushed them to zero or read e = 0 as "no scale" fails here. e = 200 is far from overflow
  // (|w| ≤ 12·2^72); every level and sign appears through the random nibbles.
  constexpr uint8_t kE[] = {0, 1, 2, 3, 100, 126, 127, 128, 160, 200};
  std::mt19937 rng(3939);
  ThreadPool pool(2);
  const GgmlType t = GgmlType::MXFP4;
  for (Isa isa : isa_levels()) {
    set_isa_limit(isa);
    for (bool pack : {false, true}) {
      INFO("isa " << isa_name(isa) << (pack ? " packed" : " rows"));
      for (int64_t cols : {int64_t(32), int64_t(96), int64_t(4096)}) {
        const int64_t rows = 23;  // a whole group of 16 and 7 rows of the next
        std::vector<uint8_t> w = random_matrix(t, rows, cols, rng);
        const size_t rb = row_bytes(t, cols);
        for (int64_t r = 0; r < rows; r++)
          for (size_t b = 0; b < rb / sizeof(BlockMXFP4); b++) w[size_t(r) * rb + b * sizeof(BlockMXFP4)] = kE[r % 10];
        check_matmul(t, rows, cols, 3, rng, pool, pack, w, 1e-43);
      }
    }
  }
  set_isa_limit(Isa::Avx512);
}
