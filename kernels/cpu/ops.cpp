// CPU transformer ops. Plain C++ written so the compiler can vectorize the inner loops (independent
// lanes, no reductions in a single accumulator); no fast-math, so results are reproducible.
#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "gguf/error.h"
#include "quant/blocks.h"
#include "quant/quant.h"

namespace baton::cpu {

namespace {

// Sum of a[i]*b[i] in 8 independent lanes (vectorizable), then a fixed-order reduction.
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// F16 -> F32 by table: exact, and fast without relying on F16C being enabled at compile time.
const float* fp16_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(65536);
    for (uint32_t h = 0; h < 65536; ++h) v[h] = fp16_to_f32(uint16_t(h));
    return v;
  }();
  return t.data();
}

// n floats of one head from a cache row in `type`, starting at element `first` (a block boundary).
inline void load_head(GgmlType type, const uint8_t* row, int first, int n, float* dst, const float* f16) {
  if (type == GgmlType::F16) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + first;
    for (int i = 0; i < n; ++i) dst[i] = f16[h[i]];
  } else {  // Q8_0
    const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row) + first / QK;
    for (int blk = 0; blk < n / QK; ++blk) {
      const float d = f16[b[blk].d];
      for (int i = 0; i < QK; ++i) dst[blk * QK + i] = d * float(b[blk].qs[i]);
    }
  }
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + size_t(r) * n;
    float* yr = y + size_t(r) * n;
    const float ms = dot(xr, xr, n) / float(n);
    const float inv = 1.f / std::sqrt(ms + eps);
    if (w) {
      for (int i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i];
    } else {
      for (int i = 0; i < n; ++i) yr[i] = xr[i] * inv;
    }
  }
}

void rope(float* x, int n_head, int head_dim, int rope_dim, int pos, const float* freqs, bool neox) {
  const int half = rope_dim / 2;
  float cs[512], sn[512];  // rope_dim <= 1024 is checked by the caller's config (head dims are small)
  BATON_CHECK(half <= 512);
  for (int i = 0; i < half; ++i) {
    const double a = double(pos) * double(freqs[i]);
    cs[i] = float(std::cos(a));
    sn[i] = float(std::sin(a));
  }
  for (int h = 0; h < n_head; ++h) {
    float* v = x + size_t(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
      const float a = v[i0], b = v[i1];
      v[i0] = a * cs[i] - b * sn[i];
      v[i1] = a * sn[i] + b * cs[i];
    }
  }
}

void softmax(float* x, int n) {
  float mx = x[0];
  for (int i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

void silu_gate(const float* g, const float* u, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void gelu_tanh_gate(const float* g, const float* u, float* y, int n) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  for (int i = 0; i < n; ++i) {
    const float x = g[i];
    y[i] = 0.5f * x * (1.f + std::tanh(k * (x + 0.044715f * x * x * x))) * u[i];
  }
}

void add(float* y, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += x[i];
}

void scale(float* y, float s, int n) {
  for (int i = 0; i < n; ++i) y[i] *= s;
}

void softcap(float* y, float cap, int n) {
  for (int i = 0; i < n; ++i) y[i] = cap * std::tanh(y[i] / cap);
}

void embed_rows(const QMatrix& emb, const int32_t* ids, int n, float* out, float s) {
  for (int i = 0; i < n; ++i) {
    float* o = out + size_t(i) * emb.cols;
    dequantize_row(emb.type, emb.row(ids[i]), o, emb.cols);
    if (s != 1.f) scale(o, s, int(emb.cols));
  }
}

void kv_convert(GgmlType type, const float* src, uint8_t* dst, int n) {
  if (type == GgmlType::F16) {
    uint16_t* h = reinterpret_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) h[i] = f32_to_fp16(src[i]);
  } else {
    BATON_CHECK(type == GgmlType::Q8_0);
    quantize_row(GgmlType::Q8_0, src, dst, n);
  }
}

void attention(const AttentionArgs& a, ThreadPool& pool) {
  const KvLayerView& kv = a.kv;
  BATON_CHECK(kv.type == GgmlType::F16 || kv.type == GgmlType::Q8_0);
  const int n_rep = a.n_head / kv.n_head_kv;
  const int dk = kv.head_dim_k, dv = kv.head_dim_v;
  // One task = one query token × a group of query heads sharing a KV head, so each cached K/V row
  // is converted once per group. With few tokens (decode), split groups so every thread has work.
  int heads_per_task = n_rep;
  while (heads_per_task > 1 && a.n_tokens * (a.n_head / heads_per_task) < 2 * pool.size()) {
    int h = heads_per_task - 1;
    while (n_rep % h) --h;
    heads_per_task = h;
  }
  const int tasks_per_token = a.n_head / heads_per_task;
  const float* f16 = fp16_table();

  pool.run(a.n_tokens * tasks_per_token, [&](int task, int) {
    const int t = task / tasks_per_token;
    const int h0 = (task % tasks_per_token) * heads_per_task;  // first query head
    const int g = h0 / n_rep;                                   // its KV head
    const int p = a.pos[t], s = a.seq[t], first = a.first[t], row0 = a.row0[t];
    const int lo = a.window > 0 ? std::max(0, p - a.window + 1) : 0;
    const int n = p - lo + 1;
    BATON_CHECK(lo >= first - kv.n_cells);  // every older position is still in the ring
    auto key_at = [&](int j) { return j >= first ? a.k_new + size_t(row0 + j - first) * kv.k_row : kv.k_cell(s, j); };
    auto val_at = [&](int j) { return j >= first ? a.v_new + size_t(row0 + j - first) * kv.v_row : kv.v_cell(s, j); };

    thread_local std::vector<float> buf;
    buf.resize(size_t(heads_per_task) * n + size_t(std::max(dk, dv)));
    float* scores = buf.data();                         // [heads_per_task][n]
    float* row = scores + size_t(heads_per_task) * n;   // one converted K or V head

    const float* q = a.q + size_t(t) * a.q_stride + size_t(h0) * dk;
    for (int j = 0; j < n; ++j) {
      load_head(kv.type, key_at(lo + j), g * dk, dk, row, f16);
      for (int r = 0; r < heads_per_task; ++r) scores[size_t(r) * n + j] = dot(q + size_t(r) * dk, row, dk) * a.scale;
    }
    for (int r = 0; r < heads_per_task; ++r) softmax(scores + size_t(r) * n, n);

    float* out = a.out + size_t(t) * a.out_stride + size_t(h0) * dv;
    std::fill(out, out + size_t(heads_per_task) * dv, 0.f);
    for (int j = 0; j < n; ++j) {
      load_head(kv.type, val_at(lo + j), g * dv, dv, row, f16);
      for (int r = 0; r < heads_per_task; ++r) axpy(out + size_t(r) * dv, scores[size_t(r) * n + j], row, dv);
    }
  });
}

}  // namespace baton::cpu
