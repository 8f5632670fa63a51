// The attention side of the CUDA op tests (the rest, with the no-GPU exit, in test_cuda_ops.cpp;
// one executable): rope, the KV rows' conversion and staging, and attention (split over the KV
// cache and tiled prefill, windows, softcaps, sinks) against kernels/cpu/ops on random data.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_ops_helpers.h"
#include "helpers.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"
#include "quant/quant.h"

using namespace baton;
using namespace baton::cuda_ops_test;
namespace cu = baton::cuda;

TEST_CASE("rope (adjacent pairs and NeoX) matches kernels/cpu/ops") {
  std::mt19937 rng(6);
  for (bool neox : {false, true}) {
    for (int head_dim : {64, 128}) {
      const int n_head = 5, n_tok = 7, rope_dim = head_dim == 64 ? 64 : 96;  // partial rotation too
      const float mscale = head_dim == 64 ? 1.f : 1.19f;  // LongRoPE's attention factor (Phi-4-mini's)
      const size_t stride = size_t(n_head * head_dim);
      auto x = random_floats(stride * n_tok, rng);
      std::vector<float> freqs(size_t(rope_dim / 2));
      for (int i = 0; i < rope_dim / 2; i++) freqs[size_t(i)] = float(std::pow(10000.0, -2.0 * i / rope_dim));
      const std::vector<int32_t> pos = {0, 1, 5, 17, 300, 4095, 70000};
      auto dx = to_dev(x), df = to_dev(freqs), dp = to_dev(pos);
      cu::rope(ctx(), dx.as<float>(), n_tok, stride, n_head, head_dim, rope_dim, dp.as<int32_t>(), df.as<float>(), neox,
               mscale);
      for (int t = 0; t < n_tok; t++)
        cpu::rope(x.data() + size_t(t) * stride, n_head, head_dim, rope_dim, pos[size_t(t)], freqs.data(), neox, mscale);
      const auto y = to_host<float>(dx, x.size());
      int bad = 0;
      for (size_t i = 0; i < y.size(); i++) bad += std::fabs(y[i] - x[i]) > 2e-6f;
      INFO("neox " << neox << " head_dim " << head_dim << ": " << bad << " values off");
      CHECK(bad == 0);
    }
  }
}

// The decode step's paired launches: q and k rotated in one launch, k and v rows converted in
// one, each bit-identical to its two single calls (different head counts and widths, as GQA has).
TEST_CASE("rope_qk and kv_convert_kv equal two single calls") {
  std::mt19937 rng(15);
  const int head_dim = 64, rope_dim = 64, n_tok = 5, hq = 8, hk = 2;
  const size_t sq = size_t(hq * head_dim) + 32, sk = size_t(hk * head_dim) + 32;  // padded rows
  std::vector<float> freqs(size_t(rope_dim / 2));
  for (int i = 0; i < rope_dim / 2; i++) freqs[size_t(i)] = float(std::pow(10000.0, -2.0 * i / rope_dim));
  const std::vector<int32_t> pos = {3, 4, 5, 900, 901};
  auto df = to_dev(freqs), dp = to_dev(pos);
  for (bool neox : {false, true}) {
    const auto q = random_floats(sq * n_tok, rng), k = random_floats(sk * n_tok, rng);
    auto q1 = to_dev(q), k1 = to_dev(k), q2 = to_dev(q), k2 = to_dev(k);
    cu::rope(ctx(), q1.as<float>(), n_tok, sq, hq, head_dim, rope_dim, dp.as<int32_t>(), df.as<float>(), neox);
    cu::rope(ctx(), k1.as<float>(), n_tok, sk, hk, head_dim, rope_dim, dp.as<int32_t>(), df.as<float>(), neox);
    cu::rope_qk(ctx(), {q2.as<float>(), sq, hq}, {k2.as<float>(), sk, hk}, n_tok, head_dim, rope_dim, dp.as<int32_t>(),
                df.as<float>(), neox);
    CHECK(to_host<float>(q1, q.size()) == to_host<float>(q2, q.size()));
    CHECK(to_host<float>(k1, k.size()) == to_host<float>(k2, k.size()));
    CHECK(to_host<float>(q1, q.size()) != q);  // it did rotate
  }
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    const int wk = 128, wv = 256, n = 6;
    const size_t rk = row_bytes(kt, wk), rv = row_bytes(kt, wv);
    auto dk = to_dev(random_floats(300 * n, rng, -2.0f, 2.0f)), dv = to_dev(random_floats(300 * n, rng, -2.0f, 2.0f));
    cu::DeviceBuffer k1(rk * n), v1(rv * n), k2(rk * n), v2(rv * n);
    cu::kv_convert(ctx(), kt, dk.as<float>(), 300, k1.as<uint8_t>(), rk, wk, n);
    cu::kv_convert(ctx(), kt, dv.as<float>(), 300, v1.as<uint8_t>(), rv, wv, n);
    cu::kv_convert_kv(ctx(), kt, {dk.as<float>(), 300, k2.as<uint8_t>(), rk, wk}, {dv.as<float>(), 300, v2.as<uint8_t>(), rv, wv}, n);
    CHECK(to_host<uint8_t>(k1, rk * n) == to_host<uint8_t>(k2, rk * n));
    CHECK(to_host<uint8_t>(v1, rv * n) == to_host<uint8_t>(v2, rv * n));
  }
}

// The decode step's fused launch: rope on q and k, then k and v staged, as the three calls do,
// byte for byte; k's F32 rows untouched (GQA shapes, both rope styles, partial rotation).
TEST_CASE("rope_stage equals rope_qk then kv_convert_kv") {
  std::mt19937 rng(16);
  const int n_tok = 5, hq = 8, hk = 2;
  const std::vector<int32_t> pos = {3, 4, 5, 900, 70001};
  auto dp = to_dev(pos);
  for (int head_dim : {64, 128})
    for (bool neox : {false, true})
      for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
        const int rope_dim = head_dim == 64 ? 64 : 96, wk = hk * head_dim, wv = hk * head_dim;
        const float mscale = head_dim == 64 ? 1.f : 1.19f;
        const size_t sq = size_t(hq * head_dim) + 32, sk = size_t(wk) + 32, sv = size_t(wv) + 64;  // padded rows
        std::vector<float> freqs(size_t(rope_dim / 2));
        for (int i = 0; i < rope_dim / 2; i++) freqs[size_t(i)] = float(std::pow(10000.0, -2.0 * i / rope_dim));
        auto df = to_dev(freqs);
        const auto q = random_floats(sq * n_tok, rng), k = random_floats(sk * n_tok, rng, -2.0f, 2.0f);
        const auto v = random_floats(sv * n_tok, rng, -2.0f, 2.0f);
        const size_t rk = row_bytes(kt, wk), rv = row_bytes(kt, wv);
        auto q1 = to_dev(q), k1 = to_dev(k), q2 = to_dev(q), k2 = to_dev(k), dv = to_dev(v);
        cu::DeviceBuffer kn1(rk * n_tok), vn1(rv * n_tok), kn2(rk * n_tok), vn2(rv * n_tok);
        cu::rope_qk(ctx(), {q1.as<float>(), sq, hq}, {k1.as<float>(), sk, hk}, n_tok, head_dim, rope_dim, dp.as<int32_t>(),
                    df.as<float>(), neox, mscale);
        cu::kv_convert_kv(ctx(), kt, {k1.as<float>(), sk, kn1.as<uint8_t>(), rk, wk},
                          {dv.as<float>(), sv, vn1.as<uint8_t>(), rv, wv}, n_tok);
        cu::rope_stage(ctx(), kt, {q2.as<float>(), sq, hq}, {k2.as<float>(), sk, kn2.as<uint8_t>(), rk, wk},
                       {dv.as<float>(), sv, vn2.as<uint8_t>(), rv, wv}, n_tok, head_dim, rope_dim, dp.as<int32_t>(),
                       df.as<float>(), neox, mscale);
        INFO(type_name(kt) << " head_dim " << head_dim << " neox " << neox);
        CHECK(to_host<float>(q1, q.size()) == to_host<float>(q2, q.size()));
        CHECK(to_host<uint8_t>(kn1, rk * n_tok) == to_host<uint8_t>(kn2, rk * n_tok));
        CHECK(to_host<uint8_t>(vn1, rv * n_tok) == to_host<uint8_t>(vn2, rv * n_tok));
        CHECK(to_host<float>(k2, k.size()) == k);  // the F32 rows as they were
        CHECK(to_host<float>(q1, q.size()) != q);  // it did rotate
      }
}

// A NoPE layer (smollm3's every 4th) rotates 0 dims: q and k as they are, the staging unchanged.
TEST_CASE("rope_dim 0 rotates nothing: rope_qk leaves q and k, rope_stage only stages k and v") {
  std::mt19937 rng(17);
  const int n_tok = 3, hq = 4, hk = 2, head_dim = 64, wk = hk * head_dim;
  const std::vector<int32_t> pos = {5, 6, 700};
  const std::vector<float> freqs = {1.f};  // (read by nothing)
  auto dp = to_dev(pos), df = to_dev(freqs);
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    const size_t sq = size_t(hq * head_dim), rk = row_bytes(kt, wk);
    const auto q = random_floats(sq * n_tok, rng), k = random_floats(size_t(wk) * n_tok, rng, -2.0f, 2.0f);
    const auto v = random_floats(size_t(wk) * n_tok, rng, -2.0f, 2.0f);
    auto q1 = to_dev(q), k1 = to_dev(k), dv = to_dev(v);
    cu::rope_qk(ctx(), {q1.as<float>(), sq, hq}, {k1.as<float>(), size_t(wk), hk}, n_tok, head_dim, 0, dp.as<int32_t>(),
                df.as<float>(), false);
    CHECK(to_host<float>(q1, q.size()) == q);
    CHECK(to_host<float>(k1, k.size()) == k);
    cu::DeviceBuffer kn1(rk * n_tok), vn1(rk * n_tok), kn2(rk * n_tok), vn2(rk * n_tok);
    cu::kv_convert_kv(ctx(), kt, {k1.as<float>(), size_t(wk), kn1.as<uint8_t>(), rk, wk},
                      {dv.as<float>(), size_t(wk), vn1.as<uint8_t>(), rk, wk}, n_tok);
    cu::rope_stage(ctx(), kt, {q1.as<float>(), sq, hq}, {k1.as<float>(), size_t(wk), kn2.as<uint8_t>(), rk, wk},
                   {dv.as<float>(), size_t(wk), vn2.as<uint8_t>(), rk, wk}, n_tok, head_dim, 0, dp.as<int32_t>(),
                   df.as<float>(), true);
    INFO(type_name(kt));
    CHECK(to_host<float>(q1, q.size()) == q);
    CHECK(to_host<uint8_t>(kn1, rk * n_tok) == to_host<uint8_t>(kn2, rk * n_tok));
    CHECK(to_host<uint8_t>(vn1, rk * n_tok) == to_host<uint8_t>(vn2, rk * n_tok));
  }
}

TEST_CASE("KV conversion is byte-identical to the CPU's, commit writes the ring cells") {
  std::mt19937 rng(7);
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    const int width = 256, n = 6;
    const size_t src_stride = 300, rowb = row_bytes(kt, width);
    auto x = random_floats(src_stride * n, rng, -2.0f, 2.0f);
    auto dx = to_dev(x);
    cu::DeviceBuffer dk(rowb * n);
    cu::kv_convert(ctx(), kt, dx.as<float>(), src_stride, dk.as<uint8_t>(), rowb, width, n);
    const auto got = to_host<uint8_t>(dk, rowb * n);
    std::vector<uint8_t> ref(rowb * n);
    for (int r = 0; r < n; r++) cpu::kv_convert(kt, x.data() + size_t(r) * src_stride, ref.data() + size_t(r) * rowb, width);
    size_t bad = 0, first = got.size();
    for (size_t i = 0; i < got.size(); i++)
      if (got[i] != ref[i]) bad++, first = std::min(first, i);
    std::string where;
    if (bad) where = "first at byte " + std::to_string(first) + " (byte " + std::to_string(first % rowb) + " of row " +
                     std::to_string(first / rowb) + "): " + std::to_string(got[first]) + " instead of " +
                     std::to_string(ref[first]);
    INFO(type_name(kt) << ": " << bad << " of " << got.size() << " bytes differ; " << where);
    CHECK(bad == 0);
  }
}

namespace {

// A layer's cache with random history for two sequences, plus staged rows for the batch. The GPU
// cache is position-major (cell rows of all KV heads), the CPU cache head-major (per sequence
// and KV head, its cells' rows): the same values, laid out as each backend reads them.
struct AttnCase {
  GgmlType type;
  int head_dim, n_cells, n_head = 8, n_kv = 2, n_seq = 2;
  size_t k_row = 0;
  std::vector<uint8_t> k, v, k_new, v_new;
  std::vector<uint8_t> k_hm, v_hm;  // the CPU's head-major copies of k and v
  cu::DeviceBuffer dk, dv, dkn, dvn;

  AttnCase(GgmlType t, int hd, int staged_rows, std::mt19937& rng, int cells = 80) : type(t), head_dim(hd), n_cells(cells) {
    const int width = n_kv * head_dim;
    k_row = row_bytes(type, width);
    auto fill = [&](std::vector<uint8_t>& dst, int rows) {
      dst.resize(k_row * size_t(rows));
      const auto f = random_floats(size_t(width) * rows, rng, -1.5f, 1.5f);
      for (int r = 0; r < rows; r++) cpu::kv_convert(type, f.data() + size_t(r) * width, dst.data() + size_t(r) * k_row, width);
    };
    fill(k, n_seq * n_cells);
    fill(v, n_seq * n_cells);
    fill(k_new, staged_rows);
    fill(v_new, staged_rows);
    dk = to_dev(k); dv = to_dev(v); dkn = to_dev(k_new); dvn = to_dev(v_new);
    const size_t hb = k_row / size_t(n_kv);
    auto head_major = [&](const std::vector<uint8_t>& pm, std::vector<uint8_t>& hm) {
      hm.resize(pm.size());
      for (int sq = 0; sq < n_seq; sq++)
        for (int g = 0; g < n_kv; g++)
          for (int c = 0; c < n_cells; c++)
            std::memcpy(hm.data() + ((size_t(sq) * n_kv + g) * n_cells + c) * hb,
                        pm.data() + (size_t(sq) * n_cells + c) * k_row + size_t(g) * hb, hb);
    };
    head_major(k, k_hm);
    head_major(v, v_hm);
  }
  cpu::KvLayerView cpu_view() {
    cpu::KvLayerView kv;
    kv.type = type; kv.k = k_hm.data(); kv.v = v_hm.data(); kv.k_row = kv.v_row = k_row; kv.n_cells = n_cells;
    kv.n_head_kv = n_kv; kv.head_dim_k = kv.head_dim_v = head_dim;
    return kv;
  }
  // The cache after staged row t is committed to token t's cell (seq[t], pos[t]), for every t.
  void committed(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq, std::vector<uint8_t>& ck,
                 std::vector<uint8_t>& cv) const {
    ck = k, cv = v;
    for (size_t t = 0; t < pos.size(); t++) {
      const size_t cell = size_t(seq[t]) * size_t(n_cells) + size_t(pos[t] % n_cells);
      std::memcpy(ck.data() + cell * k_row, k_new.data() + t * k_row, k_row);
      std::memcpy(cv.data() + cell * k_row, v_new.data() + t * k_row, k_row);
    }
  }
  void restore() {  // the device cache's history back
    cu::copy_to_device(ctx(), dk.get(), k.data(), k.size());
    cu::copy_to_device(ctx(), dv.get(), v.data(), v.size());
  }
  cu::KvLayer gpu_view() {
    cu::KvLayer kv;
    kv.type = type; kv.k = dk.as<uint8_t>(); kv.v = dv.as<uint8_t>(); kv.k_row = kv.v_row = k_row;
    kv.n_cells = n_cells; kv.n_head_kv = n_kv; kv.head_dim = head_dim;
    return kv;
  }
};

// A batch of queries over an AttnCase: random q, cpu::attention's output for it (`ref`), and the
// device's arguments (q, the int arrays, the sinks and an output buffer on the device).
struct AttnBatch {
  std::vector<int32_t> pos, seq, first, row0;
  int n;
  size_t qs;
  std::vector<float> q, ref, sinks;
  cu::DeviceBuffer dq, dpos, dseq, dfirst, drow0, dout, dsinks;
  cu::AttentionArgs g;
  AttnBatch(AttnCase& C, std::vector<int32_t> pos_, std::vector<int32_t> seq_, std::vector<int32_t> first_,
            std::vector<int32_t> row0_, int window, std::mt19937& rng, float softcap = 0.0f,
            std::vector<float> sinks_ = {})  // empty: no sinks
      : pos(std::move(pos_)), seq(std::move(seq_)), first(std::move(first_)), row0(std::move(row0_)), n(int(pos.size())),
        qs(size_t(C.n_head * C.head_dim)), q(random_floats(qs * size_t(n), rng, -1.0f, 1.0f)), ref(qs * size_t(n)),
        sinks(std::move(sinks_)) {
    cpu::AttentionArgs a;
    a.n_tokens = n; a.q = q.data(); a.q_stride = qs; a.out = ref.data(); a.out_stride = qs;
    a.pos = pos.data(); a.seq = seq.data(); a.first = first.data(); a.row0 = row0.data();
    a.k_new = C.k_new.data(); a.v_new = C.v_new.data(); a.n_head = C.n_head;
    a.scale = 1.0f / std::sqrt(float(C.head_dim)); a.window = window; a.kv = C.cpu_view(); a.softcap = softcap;
    a.sinks = sinks.empty() ? nullptr : sinks.data();
    cpu::attention(a, pool());
    if (!sinks.empty()) dsinks = to_dev(sinks);
    dq = to_dev(q), dpos = to_dev(pos), dseq = to_dev(seq), dfirst = to_dev(first), drow0 = to_dev(row0);
    dout = cu::DeviceBuffer(ref.size() * 4);
    g.n_tokens = n; g.q = dq.as<float>(); g.q_stride = qs; g.out = dout.as<float>(); g.out_stride = qs;
    g.pos = dpos.as<int32_t>(); g.seq = dseq.as<int32_t>(); g.first = dfirst.as<int32_t>(); g.row0 = drow0.as<int32_t>();
    g.k_new = C.dkn.as<uint8_t>(); g.v_new = C.dvn.as<uint8_t>(); g.n_head = C.n_head;
    g.scale = a.scale; g.window = window; g.kv = C.gpu_view(); g.softcap = softcap;
    g.sinks = sinks.empty() ? nullptr : dsinks.as<float>();
  }
};

// As check_close, the tolerance relative to the largest value of each run of `row` values (an
// attention head's output), so that heads a strong sink scales down are checked as closely.
void check_close_rows(const std::vector<float>& got, const std::vector<float>& want, size_t row, float tol,
                      const char* what) {
  int bad = 0;
  for (size_t r = 0; r < got.size(); r += row) {
    float size = 0;
    for (size_t i = r; i < r + row; i++) size = std::max(size, std::fabs(want[i]));
    for (size_t i = r; i < r + row; i++) bad += !(std::fabs(got[i] - want[i]) <= tol * size);  // NaN: bad
  }
  INFO(what << ": " << bad << " of " << got.size() << " values off");
  CHECK(bad == 0);
}

void check_close(const std::vector<float>& got, const std::vector<float>& want, float tol, const char* what) {
  int bad = 0;
  float worst = 0;
  for (size_t i = 0; i < got.size(); i++) {
    const float e = std::fabs(got[i] - want[i]);
    worst = std::max(worst, e);
    bad += !(e <= tol);  // NaN counts as bad
  }
  INFO(what << ": " << bad << " of " << got.size() << " values off, worst " << worst);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("attention (split over the KV cache) matches cpu::attention on mixed batches") {
  std::mt19937 rng(8);
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    for (int hd : {32, 64, 96, 128, 256}) {
      for (int window : {0, 9, 300}) {
        // Sequence 0 decodes one token at position 75 (or 900: keys in many splits, a window of
        // 300 in several); sequence 1 runs positions 3..9 (staged).
        const int p0 = window == 300 || hd == 128 ? 900 : 75;
        AttnCase C(kt, hd, 8, rng, p0 + 5);
        const float softcap = window == 9 ? 0.6f : 0.0f;  // Gemma 2's cap, small enough to bite here
        AttnBatch B(C, {p0, 3, 4, 5, 6, 7, 8, 9}, {0, 1, 1, 1, 1, 1, 1, 1}, {p0, 3, 3, 3, 3, 3, 3, 3},
                    {0, 1, 1, 1, 1, 1, 1, 1}, window, rng, softcap);
        const int n = B.n;
        const size_t qs = B.qs;
        const auto& ref = B.ref;
        cu::DeviceBuffer& dout = B.dout;
        const cu::AttentionArgs& g = B.g;
        // max_len: as many splits as fill the GPU, at most one per 128 keys; beyond the cells (the
        // fused commit then waits for every block). One launch, or the combine kernel after it.
        for (int max_len : {p0 + 1, 2000})
        for (bool one_launch : {true, false}) {
          ctx().fused_attention = one_launch;
          cu::attention(ctx(), g, max_len);
          INFO(type_name(kt) << " head_dim " << hd << " window " << window << " softcap " << softcap << " max_len "
                             << max_len << (one_launch ? " fused" : " with the combine kernel"));
          const auto out = to_host<float>(dout, ref.size());
          check_close(out, ref, 2e-5f, "attention");
          if (one_launch) {  // the same sums in the same order
            ctx().fused_attention = false;
            cu::attention(ctx(), g, max_len);
            CHECK(to_host<float>(dout, ref.size()) == out);
            ctx().fused_attention = true;
          }
          // With q8_out the combine also leaves the output's 8-bit activations where the output
          // projection's GEMV takes them: the same bytes as quantize_act, the same output.
          cu::attention(ctx(), g, max_len, true);
          const size_t m = qs * size_t(n);
          const cu::Q8Act q8 = cu::q8_scratch(ctx(), int64_t(qs), n);
          std::vector<int8_t> got_q(m);
          std::vector<float> got_d(m / 16);
          cu::copy_to_host(ctx(), got_q.data(), q8.qs, m);
          cu::copy_to_host(ctx(), got_d.data(), q8.ds, got_d.size() * 4);
          ctx().synchronize();
          check_close(to_host<float>(dout, ref.size()), ref, 2e-5f, "attention with q8_out");
          cu::DeviceBuffer rq(m), rd(got_d.size() * 4);
          cu::quantize_act(ctx(), dout.as<float>(), int64_t(qs), n, rq.as<int8_t>(), rd.as<float>());
          CHECK(to_host<int8_t>(rq, m) == got_q);
          CHECK(to_host<float>(rd, got_d.size()) == got_d);
          // The commit in the combine's launch (a decode step's): the same output, and the staged
          // rows in their cells, as kv_commit after the attention leaves them.
          std::vector<int32_t> crow(static_cast<size_t>(n));
          for (int t = 0; t < n; t++) crow[size_t(t)] = t;
          auto dcrow = to_dev(crow);
          const cu::KvCommit cm{C.dkn.as<uint8_t>(), C.dvn.as<uint8_t>(), dcrow.as<int32_t>(), g.seq, g.pos, n};
          std::vector<uint8_t> want_k, want_v;
          C.committed(B.pos, B.seq, want_k, want_v);
          for (bool fused : {true, false}) {
            INFO((fused ? "commit in the combine" : "kv_commit"));
            if (fused) {
              cu::attention(ctx(), g, max_len, true, cm);
            } else {
              cu::attention(ctx(), g, max_len, true);
              cu::kv_commit(ctx(), g.kv, cm);
            }
            check_close(to_host<float>(dout, ref.size()), ref, 2e-5f, "attention with the commit");
            CHECK(to_host<uint8_t>(C.dk, want_k.size()) == want_k);
            CHECK(to_host<uint8_t>(C.dv, want_v.size()) == want_v);
            C.restore();
          }
        }
        ctx().fused_attention = true;
      }
    }
  }
}

TEST_CASE("attention's commit overwrites ring cells only after every query has read them") {
  // A ring of 10 cells with a window of 9: sequence 1 runs positions 20..26, whose commit writes
  // cells 0..6 while its first tokens read positions 12..19 from cells 2..9; sequence 0 decodes at
  // position 30 (its keys 22..29 from the cache, in every cell but 0 and 1).
  std::mt19937 rng(11);
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    AttnCase C(kt, 64, 8, rng, 10);
    AttnBatch B(C, {30, 20, 21, 22, 23, 24, 25, 26}, {0, 1, 1, 1, 1, 1, 1, 1}, {30, 20, 20, 20, 20, 20, 20, 20},
                {0, 1, 1, 1, 1, 1, 1, 1}, /*window=*/9, rng);
    const std::vector<int32_t> crow = {0, 1, 2, 3, 4, 5, 6, 7};
    auto dcrow = to_dev(crow);
    const cu::KvCommit cm{C.dkn.as<uint8_t>(), C.dvn.as<uint8_t>(), dcrow.as<int32_t>(), B.g.seq, B.g.pos, B.n};
    std::vector<uint8_t> want_k, want_v;
    C.committed(B.pos, B.seq, want_k, want_v);
    for (bool one_launch : {true, false}) {
      INFO(type_name(kt) << (one_launch ? " fused" : " with the combine kernel"));
      ctx().fused_attention = one_launch;
      for (int rep = 0; rep < 2; rep++) {  // the second: the counters were left at zero
        cu::attention(ctx(), B.g, 31, true, cm);
        check_close(to_host<float>(B.dout, B.ref.size()), B.ref, 2e-5f, "attention over a ring with the commit");
        CHECK(to_host<uint8_t>(C.dk, want_k.size()) == want_k);
        CHECK(to_host<uint8_t>(C.dv, want_v.size()) == want_v);
        C.restore();
      }
    }
    ctx().fused_attention = true;
  }
}

TEST_CASE("attention with the rope and staging of a decode step equals rope_stage then attention, bit for bit") {
  // Two sequences decoding one token each (position 75: one split; 300: keys over several when
  // max_len allows); max_len 310 (the cells: the kernel writes each token's cell) or 2000 (the
  // grid's last block commits the staged rows); one launch or the combine kernel after it.
  std::mt19937 rng(12);
  const int n = 2;
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0})
    for (int hd : {64, 128, 256})
      for (bool neox : {false, true}) {
        const int rope_dim = neox ? hd / 2 : hd;  // partial rotary with NeoX pairs
        const float mscale = neox ? 1.19f : 1.f;  // and LongRoPE's attention factor
        AttnCase C(kt, hd, n, rng, 310);
        AttnBatch B(C, {75, 300}, {0, 1}, {75, 300}, {0, 1}, 0, rng);
        const std::vector<float>& q = B.q;
        const size_t qs = B.qs;
        cu::DeviceBuffer& dout = B.dout;
        const cu::AttentionArgs& g = B.g;
        const int wk = C.n_kv * hd;
        const size_t sk = size_t(wk) + 16, sv = size_t(wk) + 48;  // padded rows
        const auto k = random_floats(sk * n, rng, -2.0f, 2.0f), v = random_floats(sv * n, rng, -2.0f, 2.0f);
        std::vector<float> freqs(size_t(rope_dim / 2));
        for (int i = 0; i < rope_dim / 2; i++) freqs[size_t(i)] = float(std::pow(10000.0, -2.0 * i / rope_dim));
        auto dk = to_dev(k), dv = to_dev(v), df = to_dev(freqs);
        const cu::KvCommit cm{C.dkn.as<uint8_t>(), C.dvn.as<uint8_t>(), g.row0, g.seq, g.pos, n};
        const cu::RopeStage rope{dk.as<float>(), sk, dv.as<float>(), sv, rope_dim, df.as<float>(), neox, mscale};
        const size_t staged = C.k_row * n;
        auto reset = [&] {  // the cache's history back; staged rows and output overwritten with junk
          C.restore();
          const std::vector<uint8_t> junk(staged, 0x5A);
          cu::copy_to_device(ctx(), C.dkn.get(), junk.data(), staged);
          cu::copy_to_device(ctx(), C.dvn.get(), junk.data(), staged);
          const std::vector<float> nan(qs * n, NAN);
          cu::copy_to_device(ctx(), dout.get(), nan.data(), nan.size() * 4);
        };
        for (int max_len : {310, 2000})
          for (bool one_launch : {true, false}) {
            INFO(type_name(kt) << " head_dim " << hd << (neox ? " NeoX" : "") << " rope_dim " << rope_dim << " max_len "
                               << max_len << (one_launch ? " fused" : " with the combine kernel"));
            ctx().fused_attention = one_launch;
            // Reference: rope_stage (q rotated in a copy), then the attention with its commit.
            reset();
            auto q2 = to_dev(q);
            cu::rope_stage(ctx(), kt, {q2.as<float>(), qs, C.n_head}, {dk.as<float>(), sk, C.dkn.as<uint8_t>(), C.k_row, wk},
                           {dv.as<float>(), sv, C.dvn.as<uint8_t>(), C.k_row, wk}, n, hd, rope_dim, g.pos,
                           df.as<float>(), neox, mscale);
            cu::AttentionArgs g2 = g;
            g2.q = q2.as<float>();
            cu::attention(ctx(), g2, max_len, true, cm);
            const auto want_out = to_host<float>(dout, qs * n);
            const cu::Q8Act act = cu::q8_scratch(ctx(), int64_t(qs), n);
            const auto want_q8 = to_host_ptr<int8_t>(act.qs, qs * n);
            const auto want_kn = to_host<uint8_t>(C.dkn, staged), want_vn = to_host<uint8_t>(C.dvn, staged);
            const auto want_k = to_host<uint8_t>(C.dk, C.k.size()), want_v = to_host<uint8_t>(C.dv, C.v.size());
            // The same in one op.
            reset();
            cu::attention(ctx(), g, max_len, true, cm, rope);
            CHECK(to_host<float>(dout, qs * n) == want_out);
            CHECK(to_host_ptr<int8_t>(act.qs, qs * n) == want_q8);
            CHECK(to_host<uint8_t>(C.dkn, staged) == want_kn);
            CHECK(to_host<uint8_t>(C.dvn, staged) == want_vn);
            CHECK(to_host<uint8_t>(C.dk, C.k.size()) == want_k);
            CHECK(to_host<uint8_t>(C.dv, C.v.size()) == want_v);
            CHECK(to_host<float>(B.dq, q.size()) == q);  // q read, not rotated in place
          }
        ctx().fused_attention = true;
      }
}

TEST_CASE("attention_prefill (tiled, causal) matches cpu::attention") {
  std::mt19937 rng(9);
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    for (int hd : {32, 64, 96, 128, 256}) {
      for (auto [window, n] : {std::pair{0, 37}, std::pair{13, 37}, std::pair{0, 150}, std::pair{45, 150}}) {
        if (n > 37 && hd != 64 && hd != 256) continue;  // several query blocks and key tiles: one mma size, the F32 kernel
        const int pos0 = 20, row0 = 2, s = 1;  // 20 cached positions, n staged rows
        std::vector<int32_t> pos(n), seq(n, s), first(n, pos0), rows(n, row0);
        std::iota(pos.begin(), pos.end(), pos0);
        AttnCase C(kt, hd, row0 + n, rng);
        const size_t qs = size_t(C.n_head * hd) + 8;  // strided rows
        auto q = random_floats(qs * n, rng, -1.0f, 1.0f);
        std::vector<float> ref(qs * n, 0.0f);
        cpu::AttentionArgs a;
        a.n_tokens = n; a.q = q.data(); a.q_stride = qs; a.out = ref.data(); a.out_stride = qs;
        a.pos = pos.data(); a.seq = seq.data(); a.first = first.data(); a.row0 = rows.data();
        a.k_new = C.k_new.data(); a.v_new = C.v_new.data(); a.n_head = C.n_head;
        a.scale = 1.0f / std::sqrt(float(hd)); a.window = window; a.kv = C.cpu_view();
        a.softcap = window == 13 || window == 45 ? 0.6f : 0.0f;  // Gemma 2's cap, small enough to bite here
        cpu::attention(a, pool());

        auto dq = to_dev(q);
        cu::DeviceBuffer dout(ref.size() * 4);
        std::vector<float> zeros(ref.size(), 0.0f);
        dout.upload(zeros.data(), zeros.size() * 4);
        cu::AttentionArgs g;
        g.n_tokens = n; g.q = dq.as<float>(); g.q_stride = qs; g.out = dout.as<float>(); g.out_stride = qs;
        g.k_new = C.dkn.as<uint8_t>(); g.v_new = C.dvn.as<uint8_t>(); g.n_head = C.n_head;
        g.scale = a.scale; g.window = window; g.kv = C.gpu_view(); g.softcap = a.softcap;
        cu::attention_prefill(ctx(), g, s, pos0, row0);
        INFO(type_name(kt) << " head_dim " << hd << " window " << window << " softcap " << a.softcap << " tokens " << n);
        // Up to 128 the tensor cores take Q (scaled) and the probabilities in F16: a few 1e-4 off
        // the F32 reference at most (2.5e-4 seen); the F32 kernel (256) is within float rounding.
        const float tol = hd <= 128 && ctx().mma_prefill ? 1e-3f : 2e-5f;
        check_close(to_host<float>(dout, ref.size()), ref, tol, "attention_prefill");
      }
    }
  }
}

TEST_CASE("attention sinks: the split (fused and combined) and both prefill kernels match cpu::attention") {
  std::mt19937 rng(21);
  // The scores here are within about ±2: sinks below them, among them, and far above them all
  // (head 7's outputs are about e^-28 of the others; checked relative to each head's size).
  const std::vector<float> sinks = {-30.0f, -1.0f, 0.0f, 0.3f, 1.0f, 2.0f, 4.0f, 30.0f};
  auto dsinks = to_dev(sinks);
  for (GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    for (int hd : {64, 256}) {
      // Split: sequence 0 decodes at 75 (one split: the head's output written at once) or 900
      // (several, merged: by the head's last block, or the combine kernel); sequence 1 runs 3..9.
      for (auto [p0, window] : {std::pair{75, 0}, std::pair{900, 300}}) {
        AttnCase C(kt, hd, 8, rng, p0 + 5);
        AttnBatch B(C, {p0, 3, 4, 5, 6, 7, 8, 9}, {0, 1, 1, 1, 1, 1, 1, 1}, {p0, 3, 3, 3, 3, 3, 3, 3},
                    {0, 1, 1, 1, 1, 1, 1, 1}, window, rng, 0.0f, sinks);
        for (int max_len : {p0 + 1, 2000})
          for (bool one_launch : {true, false}) {
            INFO(type_name(kt) << " head_dim " << hd << " window " << window << " max_len " << max_len
                               << (one_launch ? " fused" : " with the combine kernel"));
            ctx().fused_attention = one_launch;
            cu::attention(ctx(), B.g, max_len, true);
            check_close_rows(to_host<float>(B.dout, B.ref.size()), B.ref, size_t(hd), 2e-5f, "attention with sinks");
          }
        ctx().fused_attention = true;
      }
      // Prefill: 37 or 150 tokens of sequence 1 after 20 cached positions, with and without a
      // window; the tensor-core kernel (head dims up to 128) and the F32 one.
      for (auto [window, n] : {std::pair{0, 37}, std::pair{45, 150}}) {
        const int pos0 = 20, row0 = 2, s = 1;
        std::vector<int32_t> pos(n), seq(n, s), first(n, pos0), rows(n, row0);
        std::iota(pos.begin(), pos.end(), pos0);
        AttnCase C(kt, hd, row0 + n, rng);
        const size_t qs = size_t(C.n_head * hd);
        const auto q = random_floats(qs * n, rng, -1.0f, 1.0f);
        std::vector<float> ref(qs * n, 0.0f);
        cpu::AttentionArgs a;
        a.n_tokens = n; a.q = q.data(); a.q_stride = qs; a.out = ref.data(); a.out_stride = qs;
        a.pos = pos.data(); a.seq = seq.data(); a.first = first.data(); a.row0 = rows.data();
        a.k_new = C.k_new.data(); a.v_new = C.v_new.data(); a.n_head = C.n_head;
        a.scale = 1.0f / std::sqrt(float(hd)); a.window = window; a.kv = C.cpu_view(); a.sinks = sinks.data();
        cpu::attention(a, pool());
        auto dq = to_dev(q);
        cu::DeviceBuffer dout(ref.size() * 4);
        cu::AttentionArgs g;
        g.n_tokens = n; g.q = dq.as<float>(); g.q_stride = qs; g.out = dout.as<float>(); g.out_stride = qs;
        g.k_new = C.dkn.as<uint8_t>(); g.v_new = C.dvn.as<uint8_t>(); g.n_head = C.n_head;
        g.scale = a.scale; g.window = window; g.kv = C.gpu_view(); g.sinks = dsinks.as<float>();
        const bool mma = ctx().mma_prefill;
        for (bool tensor_cores : {true, false}) {
          if (tensor_cores && (hd > 128 || !mma)) continue;
          ctx().mma_prefill = tensor_cores;
          cu::attention_prefill(ctx(), g, s, pos0, row0);
          INFO(type_name(kt) << " head_dim " << hd << " window " << window << " tokens " << n
                             << (tensor_cores ? " tensor cores" : " F32"));
          // As in the test above: Q and the probabilities in F16 on the tensor cores.
          check_close_rows(to_host<float>(dout, ref.size()), ref, size_t(hd), tensor_cores ? 1e-3f : 2e-5f,
                           "attention_prefill with sinks");
        }
        ctx().mma_prefill = mma;
      }
    }
  }
}
