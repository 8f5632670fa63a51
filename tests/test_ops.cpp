// CPU transformer ops on every ISA level the CPU has, against double-precision references:
// the gate activations (gpt-oss's clamped SwiGLU too), blocked attention (head dims 64 and 256,
// GQA, sliding window, attention sinks), and the fused several-matrices matmul (same bits as one
// matmul per matrix).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "helpers.h"
#include "kernels/cpu/matmul_multi.h"
#include "kernels/cpu/packed.h"
#include "kernels/cpu/ops.h"
#include "quant/quant.h"

using namespace baton;
using namespace baton::cpu;

namespace {

std::vector<Isa> isas() {
  std::vector<Isa> v;
  for (int i = 0; i <= int(detected_isa()); ++i) v.push_back(Isa(i));
  return v;
}

struct IsaGuard {  // restores "no limit" however the section ends
  explicit IsaGuard(Isa i) { set_isa_limit(i); }
  ~IsaGuard() { set_isa_limit(Isa::Avx512); }
};

std::vector<float> randoms(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST_CASE("gate activations match their definitions on every ISA, tails included") {
  std::mt19937 rng(7);
  const int n = 16 * 5 + 11;  // a tail on every vector width
  std::vector<float> g = randoms(n, -12.f, 12.f, rng), u = randoms(n, -2.f, 2.f, rng);
  g[0] = 0.f, g[1] = -90.f, g[2] = 95.f, g[3] = 1e-4f;
  for (Isa isa : isas()) {
    IsaGuard guard(isa);
    INFO("isa " << isa_name(isa));
    std::vector<float> y(n, -1.f);
    gelu_tanh_gate(g.data(), u.data(), y.data(), n);
    for (int i = 0; i < n; ++i) {
      const double x = g[size_t(i)];
      const double z = std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x);
      // 0.5 x (1 + tanh z) written as x / (1 + e^-2z): the same function without 1 + tanh's
      // cancellation for negative z, so the reference stays accurate where gelu is tiny.
      const double ref = x / (1 + std::exp(-2 * z)) * u[size_t(i)];
      CHECK(ref == Approx(0.5 * x * (1 + std::tanh(z)) * u[size_t(i)]).margin(1e-12));
      // A float argument of e^-2z carries a relative error that grows with |2z|, as in any float version.
      CHECK(std::abs(y[size_t(i)] - ref) <= 2e-7 * (4 + std::abs(2 * z)) * std::abs(ref) + 1e-30);
    }
    silu_gate(g.data(), u.data(), y.data(), n);
    for (int i = 0; i < n; ++i) {
      const double x = g[size_t(i)];
      const double ref = x / (1 + std::exp(-x)) * u[size_t(i)];
      CHECK(std::abs(y[size_t(i)] - ref) <= 2e-7 * (4 + std::abs(x)) * std::abs(ref) + 1e-30);
    }
  }
}

TEST_CASE("gpt-oss's clamped SwiGLU matches its definition on every ISA, around and beyond the clamps") {
  std::mt19937 rng(17);
  const int n = 16 * 6 + 13;
  std::vector<float> g = randoms(n, -12.f, 12.f, rng), u = randoms(n, -11.f, 11.f, rng);
  // Gates at and around the clamp (only from above), far out, tiny and negative; up values at
  // and beyond both clamps and where u + 1 cancels.
  const float gs[] = {0.f, -0.f, 1e-4f, -1e-4f, 6.999f, 7.f, 7.001f, 8.f, 95.f, -7.f, -7.5f, -30.f, -90.f, 3.f};
  const float us[] = {0.f, -1.f, -0.999f, 7.f, 7.001f, -7.f, -7.001f, 20.f, -20.f, 6.5f, -6.5f, 1.f, -2.f, 9.f};
  for (size_t i = 0; i < std::size(gs); ++i) g[i] = gs[i], u[i] = us[i];
  for (size_t i = 0; i < std::size(gs); ++i) g[20 + i] = gs[i], u[20 + i] = us[std::size(us) - 1 - i];
  for (Isa isa : isas()) {
    IsaGuard guard(isa);
    INFO("isa " << isa_name(isa));
    std::vector<float> y(n, -1.f);
    swiglu_oai_gate(g.data(), u.data(), y.data(), n);
    for (int i = 0; i < n; ++i) {
      const double x = std::min(double(g[size_t(i)]), 7.0), uc = std::clamp(double(u[size_t(i)]), -7.0, 7.0);
      const double ref = x / (1 + std::exp(-1.702 * x)) * (uc + 1);
      INFO("g " << g[size_t(i)] << " u " << u[size_t(i)]);
      // As for silu: a float argument of e^-αx carries a relative error growing with |αx|.
      CHECK(std::abs(y[size_t(i)] - ref) <= 2e-7 * (4 + std::abs(1.702 * x)) * std::abs(ref) + 1e-30);
    }
    // NaN in either input stays NaN (a clamp must not turn it into the bound); infinities clamp.
    const float nan = std::nanf(""), inf = INFINITY;
    const float g2[] = {nan, 1.f, inf, 2.f, -2.f, nan};
    const float u2[] = {1.f, nan, 3.f, inf, -inf, nan};
    float y2[6];
    swiglu_oai_gate(g2, u2, y2, 6);
    CHECK(std::isnan(y2[0]));
    CHECK(std::isnan(y2[1]));
    CHECK(std::isnan(y2[5]));
    const float g3[] = {7.f, 2.f, -2.f}, u3[] = {3.f, 7.f, -7.f};
    float y3[3];
    swiglu_oai_gate(g3, u3, y3, 3);
    CHECK(y2[2] == y3[0]);
    CHECK(y2[3] == y3[1]);
    CHECK(y2[4] == y3[2]);
  }
}

TEST_CASE("softmax matches a double reference on every ISA, tails included") {
  std::mt19937 rng(11);
  for (int n : {1, 7, 16, 45, 300}) {
    const std::vector<float> x = randoms(size_t(n), -30.f, 30.f, rng);
    double mx = -1e300, sum = 0;
    for (float v : x) mx = std::max(mx, double(v));
    for (float v : x) sum += std::exp(v - mx);
    for (Isa isa : isas()) {
      IsaGuard guard(isa);
      INFO("isa " << isa_name(isa) << " n " << n);
      std::vector<float> y = x;
      softmax(y.data(), n);
      double total = 0;
      for (int i = 0; i < n; ++i) {
        const double ref = std::exp(x[size_t(i)] - mx) / sum;
        // x - max is rounded to float first: a relative error growing with its size, as in any float version.
        CHECK(std::abs(y[size_t(i)] - ref) <= 2e-7 * (8 + std::abs(x[size_t(i)] - mx)) * ref + 1e-30);
        total += y[size_t(i)];
      }
      CHECK(total == Approx(1.0).epsilon(1e-5));
    }
  }
}

TEST_CASE("log_sum_exp matches a double reference on every ISA, long rows and tails included") {
  std::mt19937 rng(12);
  for (int n : {1, 7, 9, 17, 1000, 1024 + 16 * 3 + 5, 262147}) {
    std::vector<float> x = randoms(size_t(n), -30.f, 30.f, rng);
    x[size_t(n) / 2] += 200;  // far from zero: the max is subtracted
    double mx = -1e300, sum = 0;
    for (float v : x) mx = std::max(mx, double(v));
    for (float v : x) sum += std::exp(double(v) - mx);
    const double ref = mx + std::log(sum);
    for (Isa isa : isas()) {
      IsaGuard guard(isa);
      INFO("isa " << isa_name(isa) << " n " << n);
      CHECK(log_sum_exp(x.data(), n) == Approx(ref).margin(2e-6));
    }
  }
}

TEST_CASE("attention over staged F16 and Q8_0 rows matches a double reference on every ISA") {
  for (GgmlType kvt : {GgmlType::F16, GgmlType::Q8_0})
  for (int dk : {64, 256}) {
    for (int window : {0, 5}) {
      // 150 tokens span five query blocks of 32 and three key chunks of 64 (the P·V chains continue
      // across chunks; with the window the single-token runs cut the chunks elsewhere).
      const int n_head = 4, n_kv = 1 + (dk == 64), n_tok = 150;
      std::mt19937 rng(uint32_t(dk + window));
      std::vector<float> q = randoms(size_t(n_tok) * n_head * dk, -1.f, 1.f, rng);
      std::vector<float> k = randoms(size_t(n_tok) * n_kv * dk, -1.f, 1.f, rng);
      std::vector<float> v = randoms(size_t(n_tok) * n_kv * dk, -1.f, 1.f, rng);
      const size_t row = row_bytes(kvt, int64_t(n_kv) * dk);
      std::vector<uint8_t> k16(row * n_tok), v16(row * n_tok), cache(row * 4);
      for (int t = 0; t < n_tok; ++t) {
        kv_convert(kvt, k.data() + size_t(t) * n_kv * dk, k16.data() + row * t, n_kv * dk);
        kv_convert(kvt, v.data() + size_t(t) * n_kv * dk, v16.data() + row * t, n_kv * dk);
      }
      std::vector<float> kf(k.size()), vf(v.size());  // what the cache holds, back in float
      dequantize_row(kvt, k16.data(), kf.data(), int64_t(kf.size()));
      dequantize_row(kvt, v16.data(), vf.data(), int64_t(vf.size()));
      std::vector<int32_t> pos(n_tok), seq(n_tok, 0), first(n_tok, 0), row0(n_tok, 0);
      for (int t = 0; t < n_tok; ++t) pos[size_t(t)] = t;
      const float scale = 1.f / std::sqrt(float(dk));

      std::vector<double> ref(size_t(n_tok) * n_head * dk);
      for (int t = 0; t < n_tok; ++t)
        for (int h = 0; h < n_head; ++h) {
          const int g = h / (n_head / n_kv), lo = window ? std::max(0, t - window + 1) : 0;
          std::vector<double> s;
          double mx = -1e300, sum = 0;
          for (int j = lo; j <= t; ++j) {
            double d = 0;
            for (int i = 0; i < dk; ++i)
              d += double(q[(size_t(t) * n_head + h) * dk + i]) * kf[(size_t(j) * n_kv + g) * dk + i];
            s.push_back(d * scale);
            mx = std::max(mx, s.back());
          }
          for (double& x : s) sum += (x = std::exp(x - mx));
          for (int j = lo; j <= t; ++j)
            for (int i = 0; i < dk; ++i)
              ref[(size_t(t) * n_head + h) * dk + i] += s[size_t(j - lo)] / sum * vf[(size_t(j) * n_kv + g) * dk + i];
        }

      for (Isa isa : isas()) {
        IsaGuard guard(isa);
        INFO("isa " << isa_name(isa) << " kv " << type_name(kvt) << " head_dim " << dk << " window " << window);
        for (int threads : {1, 2}) {
          ThreadPool pool(threads);
          std::vector<float> out(ref.size(), 0.f);
          AttentionArgs a;
          a.n_tokens = n_tok;
          a.q = q.data();
          a.q_stride = size_t(n_head) * dk;
          a.out = out.data();
          a.out_stride = size_t(n_head) * dk;
          a.pos = pos.data(), a.seq = seq.data(), a.first = first.data(), a.row0 = row0.data();
          a.k_new = k16.data(), a.v_new = v16.data();
          a.n_head = n_head;
          a.scale = scale;
          a.window = window;
          a.kv.type = kvt;
          a.kv.k = a.kv.v = cache.data();
          a.kv.k_row = a.kv.v_row = row;
          a.kv.n_cells = 4;
          a.kv.n_head_kv = n_kv, a.kv.head_dim_k = a.kv.head_dim_v = dk;
          attention(a, pool);
          double worst = 0;
          for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::abs(out[i] - ref[i]));
          CHECK(worst < 2e-5);
          // Each token alone (a decode step, which reads the F16 rows in place on AVX-512) gives
          // the bits it got inside the batch (converted tiles shared by a block of queries).
          std::vector<float> one(size_t(n_head) * dk);
          int differ = 0;
          for (int t = 0; t < n_tok; ++t) {
            AttentionArgs b = a;
            b.n_tokens = 1;
            b.q = q.data() + size_t(t) * a.q_stride;
            b.out = one.data();
            b.pos = pos.data() + t, b.seq = seq.data() + t, b.first = first.data() + t, b.row0 = row0.data() + t;
            attention(b, pool);
            differ += std::memcmp(one.data(), out.data() + size_t(t) * a.out_stride, one.size() * 4) != 0;
          }
          CHECK(differ == 0);
        }
      }
    }
  }
}

TEST_CASE("attention sinks: one more logit per head, small or larger than every score, on every ISA") {
  // 100 staged tokens (two key chunks), 8 query heads over 2 KV heads, with and without a window.
  // q is large enough that the scores spread over several units, so the sinks below, around and
  // above them all matter; head 6's sink is above every score it meets, head 7's above by 40.
  const int n_head = 8, n_kv = 2, dk = 64, n_tok = 100, n_rep = n_head / n_kv;
  std::mt19937 rng(23);
  const std::vector<float> q = randoms(size_t(n_tok) * n_head * dk, -3.f, 3.f, rng);
  const std::vector<float> k = randoms(size_t(n_tok) * n_kv * dk, -1.f, 1.f, rng);
  const std::vector<float> v = randoms(size_t(n_tok) * n_kv * dk, -1.f, 1.f, rng);
  const size_t row = row_bytes(GgmlType::F16, int64_t(n_kv) * dk);
  std::vector<uint8_t> k16(row * n_tok), v16(row * n_tok), cache(row * 4);
  for (int t = 0; t < n_tok; ++t) {
    kv_convert(GgmlType::F16, k.data() + size_t(t) * n_kv * dk, k16.data() + row * t, n_kv * dk);
    kv_convert(GgmlType::F16, v.data() + size_t(t) * n_kv * dk, v16.data() + row * t, n_kv * dk);
  }
  std::vector<float> kf(k.size()), vf(v.size());
  dequantize_row(GgmlType::F16, k16.data(), kf.data(), int64_t(kf.size()));
  dequantize_row(GgmlType::F16, v16.data(), vf.data(), int64_t(vf.size()));
  std::vector<int32_t> pos(n_tok), seq(n_tok, 0), first(n_tok, 0), row0(n_tok, 0);
  for (int t = 0; t < n_tok; ++t) pos[size_t(t)] = t;
  const float scale = 1.f / std::sqrt(float(dk));
  auto score = [&](int t, int h, int j) {
    double d = 0;
    for (int i = 0; i < dk; ++i)
      d += double(q[(size_t(t) * n_head + h) * dk + i]) * kf[(size_t(j) * n_kv + h / n_rep) * dk + i];
    return d * scale;
  };

  for (int window : {0, 7}) {
    auto lo_of = [&](int t) { return window ? std::max(0, t - window + 1) : 0; };
    std::vector<float> sinks = {-30.f, -2.f, 0.f, 0.5f, 1.5f, 3.f, 0.f, 0.f};
    double top = -1e300;  // head 6's largest score
    for (int t = 0; t < n_tok; ++t)
      for (int j = lo_of(t); j <= t; ++j) top = std::max(top, score(t, 6, j));
    sinks[6] = float(top + 1.0);
    sinks[7] = float(top + 40.0);  // (head 7's scores are of the same size)

    // out = Σ e^(s_j − M) v_j / (Σ e^(s_j − M) + e^(sink − M)), M the largest of the scores and the sink.
    std::vector<double> ref(size_t(n_tok) * n_head * dk, 0.0);
    for (int t = 0; t < n_tok; ++t)
      for (int h = 0; h < n_head; ++h) {
        std::vector<double> s;
        double mx = sinks[size_t(h)];
        for (int j = lo_of(t); j <= t; ++j) mx = std::max(mx, s.emplace_back(score(t, h, j)));
        double sum = std::exp(double(sinks[size_t(h)]) - mx);
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int j = lo_of(t); j <= t; ++j)
          for (int i = 0; i < dk; ++i)
            ref[(size_t(t) * n_head + h) * dk + i] += s[size_t(j - lo_of(t))] / sum * vf[(size_t(j) * n_kv + h / n_rep) * dk + i];
      }

    for (Isa isa : isas()) {
      IsaGuard guard(isa);
      for (int threads : {1, 2}) {
        INFO("isa " << isa_name(isa) << " window " << window << " threads " << threads);
        ThreadPool pool(threads);
        std::vector<float> out(ref.size(), 0.f);
        AttentionArgs a;
        a.n_tokens = n_tok;
        a.q = q.data(), a.q_stride = size_t(n_head) * dk;
        a.out = out.data(), a.out_stride = size_t(n_head) * dk;
        a.pos = pos.data(), a.seq = seq.data(), a.first = first.data(), a.row0 = row0.data();
        a.k_new = k16.data(), a.v_new = v16.data();
        a.n_head = n_head;
        a.scale = scale;
        a.window = window;
        a.sinks = sinks.data();
        a.kv.type = GgmlType::F16;
        a.kv.k = a.kv.v = cache.data();
        a.kv.k_row = a.kv.v_row = row;
        a.kv.n_cells = 4;
        a.kv.n_head_kv = n_kv, a.kv.head_dim_k = a.kv.head_dim_v = dk;
        attention(a, pool);
        // Relative to each (token, head) row's size: head 7's outputs are about e^-40 of the others.
        int bad = 0;
        for (size_t r = 0; r < size_t(n_tok) * n_head; ++r) {
          double size = 0;
          for (int i = 0; i < dk; ++i) size = std::max(size, std::abs(ref[r * dk + size_t(i)]));
          for (int i = 0; i < dk; ++i) bad += !(std::abs(out[r * dk + size_t(i)] - ref[r * dk + size_t(i)]) <= 3e-5 * size);
        }
        CHECK(bad == 0);
        // Sinks of -inf weigh nothing: the bits of no sinks at all.
        std::vector<float> plain(out.size()), none(out.size());
        const std::vector<float> ninf(size_t(n_head), -INFINITY);
        a.out = plain.data(), a.sinks = ninf.data();
        attention(a, pool);
        a.out = none.data(), a.sinks = nullptr;
        attention(a, pool);
        CHECK(std::memcmp(plain.data(), none.data(), plain.size() * 4) == 0);
      }
    }
  }
}

namespace {

// Three quantized matrices of one width (row layout; packed copies made on request).
struct MultiCase {
  int64_t cols;
  GgmlType types[3];
  int64_t rows[3] = {96, 40, 300};
  std::vector<uint8_t> data[3];
  PackedBuffer packed[3];
  QMatrix W[3];
  MultiCase(int64_t c, GgmlType a, GgmlType b, GgmlType d, std::mt19937& rng) : cols(c), types{a, b, d} {
    for (int i = 0; i < 3; ++i) {
      std::vector<float> f = randoms(size_t(rows[i] * cols), -1.f, 1.f, rng);
      const size_t rb = row_bytes(types[i], cols);
      data[i].resize(rb * size_t(rows[i]));
      for (int64_t r = 0; r < rows[i]; ++r) quantize_row(types[i], f.data() + r * cols, data[i].data() + r * rb, cols);
      W[i] = QMatrix{types[i], data[i].data(), rows[i], cols, rb};
    }
  }
  void pack(ThreadPool& pool) {
    for (int i = 0; i < 3; ++i) {
      packed[i] = alloc_packed(packed_bytes(types[i], rows[i], cols));
      pack_matrix(W[i], packed[i].get(), &pool);
    }
  }
  // matmul_multi over the three against one matmul per matrix, bit for bit, for n columns.
  void check(int n, ThreadPool& pool, std::mt19937& rng) {
    std::vector<float> X = randoms(size_t(n * cols), -1.f, 1.f, rng);
    std::vector<std::vector<float>> single(3), fused(3);
    MatmulTarget t[3];
    for (int i = 0; i < 3; ++i) {
      single[size_t(i)].assign(size_t(n * rows[i]), 0.f);
      fused[size_t(i)].assign(size_t(n * rows[i]), -7.f);
      matmul(W[i], X.data(), n, single[size_t(i)].data(), pool);
      t[i] = {&W[i], fused[size_t(i)].data()};
    }
    matmul_multi(t, 3, X.data(), n, pool);
    for (int i = 0; i < 3; ++i)
      CHECK(std::memcmp(single[size_t(i)].data(), fused[size_t(i)].data(), single[size_t(i)].size() * 4) == 0);

    // The same with X produced by a row prologue (pre(j) writes column j from other data): each
    // column made exactly once, before it was read, through matmul_multi and through matmul.
    std::vector<float> raw = randoms(size_t(n * cols), -1.f, 1.f, rng), made(raw.size(), 99.f), expect(raw.size());
    for (size_t e = 0; e < raw.size(); ++e) expect[e] = raw[e] * 0.5f + 0.25f;
    std::vector<std::atomic<int>> calls(static_cast<size_t>(n));
    const RowFn pre = [&](int j) {
      for (int64_t e = j * cols; e < (j + 1) * cols; ++e) made[size_t(e)] = raw[size_t(e)] * 0.5f + 0.25f;
      calls[size_t(j)]++;
    };
    for (int i = 0; i < 3; ++i) {
      matmul(W[i], expect.data(), n, single[size_t(i)].data(), pool);
      std::fill(fused[size_t(i)].begin(), fused[size_t(i)].end(), -7.f);
    }
    matmul_multi(t, 3, made.data(), n, pool, &pre);
    for (int i = 0; i < 3; ++i)
      CHECK(std::memcmp(single[size_t(i)].data(), fused[size_t(i)].data(), single[size_t(i)].size() * 4) == 0);
    for (auto& c : calls) CHECK(c.exchange(0) == 1);
    std::fill(made.begin(), made.end(), 99.f);
    std::fill(fused[1].begin(), fused[1].end(), -7.f);
    matmul(W[1], made.data(), n, fused[1].data(), pool, &pre);
    CHECK(std::memcmp(single[1].data(), fused[1].data(), single[1].size() * 4) == 0);
    for (auto& c : calls) CHECK(c.load() == 1);

    // Nine targets (a mixture of experts' decode: its k down matrices), most with their own
    // inputs, every fourth on the shared one.
    constexpr int kTargets = 9;
    std::vector<std::vector<float>> xs(kTargets), want(kTargets), got(kTargets);
    MatmulTarget own[kTargets];
    for (int i = 0; i < kTargets; ++i) {
      const bool shared = i % 4 == 3;
      xs[size_t(i)] = randoms(size_t(n * cols), -1.f, 1.f, rng);
      const float* in = shared ? X.data() : xs[size_t(i)].data();
      want[size_t(i)].assign(size_t(n * rows[i % 3]), 0.f);
      got[size_t(i)].assign(want[size_t(i)].size(), -7.f);
      matmul(W[i % 3], in, n, want[size_t(i)].data(), pool);
      own[i] = {&W[i % 3], got[size_t(i)].data(), shared ? nullptr : in};
    }
    matmul_multi(own, kTargets, X.data(), n, pool);
    for (int i = 0; i < kTargets; ++i) {
      INFO("target " << i);
      CHECK(std::memcmp(want[size_t(i)].data(), got[size_t(i)].data(), want[size_t(i)].size() * 4) == 0);
    }
  }
};

}  // namespace

TEST_CASE("matmul_multi gives the same bits as one matmul per matrix") {
  std::mt19937 rng(3);
  ThreadPool pool(2);
  MultiCase rows_only(256, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, rng);
  for (Isa isa : isas()) {
    IsaGuard guard(isa);
    for (int n : {1, 3, 4, 9}) {
      INFO("isa " << isa_name(isa) << " columns " << n);
      rows_only.check(n, pool, rng);
    }
  }
}

TEST_CASE("matmul_multi on packed matrices gives the same bits as one matmul per matrix") {
  // All packed: one quantization and one job at any column count (prefill-sized included). With
  // one matrix left unpacked the mixed path runs instead; both must match matmul() bit for bit.
  std::mt19937 rng(4);
  ThreadPool pool(2);
  MultiCase c(512, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, rng);
  c.pack(pool);
  for (Isa isa : isas()) {
    IsaGuard guard(isa);
    for (bool mixed : {false, true}) {
      for (int i = 0; i < 3; ++i) c.W[i].packed = mixed && i == 1 ? nullptr : c.packed[i].get();
      for (int n : {1, 3, 8, 9, 16, 37}) {
        if (mixed && n > 4) continue;  // the mixed path fuses decode only
        INFO("isa " << isa_name(isa) << " columns " << n << (mixed ? " mixed" : " packed"));
        c.check(n, pool, rng);
      }
    }
  }
}

TEST_CASE("attention scores: every score has the bits of its own lane reduction, whatever the block") {
  // On AVX-512 each (head, key) dot product is 16 lane sums, FMAs along d, then lanes i + 8, i + 4,
  // i + 2, i + 1 folded in (the order of _mm512_reduce_add_ps); blocks of keys are folded together
  // by a transposed tree that must keep exactly that order. AVX2: 8 lane sums folded by a fixed
  // tree, 2 rows × 4 keys at a time. Emulated here in scalar code for every row count up to 7 and
  // key count up to 40 (blocks and tails). Scalar: close to the double sum.
  std::mt19937 rng(9);
  const int d = 64;
  for (int nh = 1; nh <= 7; ++nh)
    for (int n = 1; n <= 40; ++n) {
      std::vector<float> q = randoms(size_t(nh * d), -1.f, 1.f, rng), K = randoms(size_t(n * d), -1.f, 1.f, rng);
      std::vector<float> got(size_t(nh * n), -1.f);
      const float scale = 0.125f;
      for (Isa isa : isas()) {
        IsaGuard guard(isa);
        INFO("isa " << isa_name(isa) << " heads " << nh << " keys " << n);
        attention_scores(q.data(), nh, K.data(), n, d, scale, got.data());
        for (int h = 0; h < nh; ++h)
          for (int j = 0; j < n; ++j) {
            const float* qh = q.data() + h * d;
            const float* kj = K.data() + j * d;
            if (isa == Isa::Avx512) {
              float lane[16];
              for (int l = 0; l < 16; ++l) {
                lane[l] = 0.f;
                for (int i = 0; i < d; i += 16) lane[l] = std::fma(qh[i + l], kj[i + l], lane[l]);
              }
              for (int l = 0; l < 8; ++l) lane[l] = lane[l + 8] + lane[l];
              for (int l = 0; l < 4; ++l) lane[l] = lane[l + 4] + lane[l];
              for (int l = 0; l < 2; ++l) lane[l] = lane[l] + lane[l + 2];
              const float want = (lane[0] + lane[1]) * scale;
              CHECK(std::memcmp(&want, &got[size_t(h * n + j)], 4) == 0);
            } else if (isa == Isa::Avx2) {
              // 8 lanes of FMAs along d, folded as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
              float lane[8];
              for (int l = 0; l < 8; ++l) {
                lane[l] = 0.f;
                for (int i = 0; i < d; i += 8) lane[l] = std::fma(qh[i + l], kj[i + l], lane[l]);
              }
              const float want = (((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) * scale;
              CHECK(std::memcmp(&want, &got[size_t(h * n + j)], 4) == 0);
            } else {
              double ref = 0;
              for (int i = 0; i < d; ++i) ref += double(qh[i]) * kj[i];
              CHECK(std::abs(got[size_t(h * n + j)] - ref * scale) < 1e-5);
            }
          }
      }
    }
}

TEST_CASE("argmax: the largest value, ties to the lowest index, NaN never picked, on every ISA") {
  std::mt19937 rng(11);
  auto reference = [](const std::vector<float>& x) {
    int best = -1;
    for (int i = 0; i < int(x.size()); ++i)
      if (!std::isnan(x[size_t(i)]) && (best < 0 || x[size_t(i)] > x[size_t(best)])) best = i;
    return best < 0 ? 0 : best;
  };
  for (int n : {1, 2, 15, 16, 17, 33, 100, 49152}) {
    for (int trial = 0; trial < 20; ++trial) {
      // Few distinct values so that the maximum is often tied, some NaNs and infinities.
      std::vector<float> x(static_cast<size_t>(n));
      for (float& v : x) {
        const unsigned r = rng() % 20;
        v = r == 0 ? NAN : r == 1 ? -INFINITY : float(int(rng() % 7) - 3);
      }
      if (trial == 1) std::fill(x.begin(), x.end(), NAN);
      if (trial == 2) std::fill(x.begin(), x.end(), -INFINITY);
      if (trial == 3 && n > 1) x[0] = NAN, std::fill(x.begin() + 1, x.end(), -INFINITY);
      for (Isa isa : isas()) {
        IsaGuard guard(isa);
        INFO("isa " << isa_name(isa) << " n " << n << " trial " << trial);
        CHECK(argmax(x.data(), n) == reference(x));
      }
    }
  }
}

TEST_CASE("top_k: the k largest, by value then lowest index, NaN skipped, on every ISA") {
  std::mt19937 rng(12);
  for (int n : {1, 5, 16, 17, 40, 100, 1000, 49152}) {
    for (int k : {1, 3, 40, 64, 256}) {
      for (int trial = 0; trial < 6; ++trial) {
        std::vector<float> x(static_cast<size_t>(n));
        for (float& v : x) {
          const unsigned r = rng() % 25;
          // Trials 0-2: few distinct values (many ties at the cut), then spread values.
          v = r == 0 ? NAN : r == 1 ? -INFINITY : trial < 3 ? float(int(rng() % 9) - 4) : float(rng() % 100000) * 0.01f;
        }
        if (trial == 1) std::fill(x.begin(), x.end(), NAN);
        // The reference: every non-NaN value with its index, fully sorted.
        std::vector<std::pair<float, int32_t>> ref;
        for (int i = 0; i < n; ++i)
          if (!std::isnan(x[size_t(i)])) ref.push_back({x[size_t(i)], i});
        std::sort(ref.begin(), ref.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
        const size_t want = std::min(ref.size(), size_t(k));
        for (Isa isa : isas()) {
          IsaGuard guard(isa);
          INFO("isa " << isa_name(isa) << " n " << n << " k " << k << " trial " << trial);
          std::vector<int32_t> idx(static_cast<size_t>(k), -1);
          std::vector<float> val(static_cast<size_t>(k));
          REQUIRE(top_k(x.data(), n, k, idx.data(), val.data()) == int(want));
          for (size_t j = 0; j < want; ++j) {
            CHECK(idx[j] == ref[j].second);
            CHECK(val[j] == ref[j].first);
          }
        }
      }
    }
  }
}

TEST_CASE("moe_route: softmax, the k most probable experts, weights renormalized or as they are") {
  std::mt19937 rng(21);
  for (int n_expert : {4, 8, 60, 128}) {
    for (int k : {1, 2, 4, 8}) {
      if (k > n_expert) continue;
      for (bool renorm : {false, true}) {
        std::vector<float> logits = randoms(size_t(n_expert), -3.f, 3.f, rng), x = logits;
        // The reference in double: probabilities, ranked (ties to the lower id).
        double z = 0;
        for (float v : logits) z += std::exp(double(v));
        std::vector<int> order(static_cast<size_t>(n_expert));
        for (int e = 0; e < n_expert; ++e) order[size_t(e)] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[size_t(a)] > logits[size_t(b)]; });
        double chosen = 0;
        for (int i = 0; i < k; ++i) chosen += std::exp(double(logits[size_t(order[size_t(i)])])) / z;
        std::vector<int32_t> ids(static_cast<size_t>(k));
        std::vector<float> w(static_cast<size_t>(k));
        moe_route(x.data(), n_expert, k, renorm, ids.data(), w.data());
        double sum = 0;
        for (int i = 0; i < k; ++i) {
          INFO("experts " << n_expert << " k " << k << " renorm " << renorm << " place " << i);
          CHECK(ids[size_t(i)] == order[size_t(i)]);
          const double p = std::exp(double(logits[size_t(order[size_t(i)])])) / z;
          CHECK(w[size_t(i)] == Approx(renorm ? p / chosen : p).epsilon(1e-5));
          sum += w[size_t(i)];
        }
        if (renorm) CHECK(sum == Approx(1.0).epsilon(1e-5));
      }
    }
  }
  // A NaN router logit is never chosen, on every ISA; with nothing left to rank, no expert is.
  for (Isa isa : isas()) {
    IsaGuard guard(isa);
    INFO("isa " << isa_name(isa));
    std::vector<float> bad{0.5f, NAN, 1.f, -2.f};
    int32_t ids[2];
    float w[2];
    moe_route(bad.data(), 4, 2, true, ids, w);
    CHECK(ids[0] == 2);
    CHECK(ids[1] == 0);
    CHECK(w[0] + w[1] == Approx(1.0));
    std::vector<float> none{NAN, -INFINITY, NAN, NAN};
    moe_route(none.data(), 4, 2, false, ids, w);
    CHECK(ids[0] == -1);
    CHECK(w[1] == 0.f);
  }
}

TEST_CASE("moe_group: every routed (token, weight) under its expert, tokens in order, skipped places left out") {
  // 4 tokens, k = 2, 5 experts; token 2's second place is empty (-1).
  const int32_t ids[] = {3, 0, 0, 3, 4, -1, 3, 1};
  const float w[] = {.6f, .4f, .7f, .3f, 1.f, 0.f, .5f, .5f};
  int32_t first[6], rows[8];
  float weights[8];
  moe_group(ids, w, 4, 2, 5, first, rows, weights);
  const std::vector<int32_t> want_first{0, 2, 3, 3, 6, 7};
  CHECK(std::vector<int32_t>(first, first + 6) == want_first);
  const std::vector<int32_t> want_rows{0, 1, 3, 0, 1, 3, 2};  // expert 0: tokens 0, 1; 1: 3; 3: 0, 1, 3; 4: 2
  CHECK(std::vector<int32_t>(rows, rows + 7) == want_rows);
  const std::vector<float> want_w{.4f, .7f, .5f, .6f, .3f, .5f, 1.f};
  CHECK(std::vector<float>(weights, weights + 7) == want_w);
}

TEST_CASE("kv_convert to F16 gives the software rounding's bits on every ISA") {
  // Values across the half range: normals, subnormals, ties, overflow to infinity, signed zeros.
  std::mt19937 rng(5);
  std::vector<float> x;
  for (int e = -30; e <= 17; ++e)
    for (int i = 0; i < 64; ++i) {
      const uint32_t mant = rng() & 0x7fffffu;
      const uint32_t bits = (uint32_t(e + 127) << 23) | mant | (i % 2 ? 0x80000000u : 0u);
      float f;
      std::memcpy(&f, &bits, 4);
      x.push_back(f);
    }
  for (float t : {0.f, -0.f, 65504.f, 65520.f, 1e9f, -1e9f, 1.f + 1.f / 2048.f, 1.f + 3.f / 2048.f}) x.push_back(t);
  const int n = int(x.size());
  std::vector<uint16_t> want(x.size()), got(x.size());
  for (int i = 0; i < n; ++i) want[size_t(i)] = f32_to_fp16(x[size_t(i)]);
  for (Isa isa : isas()) {
    IsaGuard g(isa);
    INFO(isa_name(isa));
    kv_convert(GgmlType::F16, x.data(), reinterpret_cast<uint8_t*>(got.data()), n);
    CHECK(std::memcmp(want.data(), got.data(), want.size() * 2) == 0);
  }
}
