// Elementwise ops (gates, residual add, scale, softcap), the embedding row lookup and the KV
// cache conversion. Memory-bound one-pass kernels: 16-byte accesses where alignment allows.
#include <algorithm>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.cuh"
#include "kernels/swiglu_oai.h"

namespace baton::cuda {

namespace {

enum class Ew { Silu, Gelu, SwigluOai, Add, Scale, Softcap };

template <Ew op>
__device__ __forceinline__ float ew(float a, float b, float s) {
  if constexpr (op == Ew::Silu) return a / (1.0f + expf(-a)) * b;
  if constexpr (op == Ew::Gelu) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * a * (1.0f + tanhf(k * (a + 0.044715f * a * a * a))) * b;
  }
  if constexpr (op == Ew::SwigluOai) {  // fminf/fmaxf would turn a NaN into the bound: compare instead
    const float x = a > kSwigluOaiLimit ? kSwigluOaiLimit : a;
    const float u = b > kSwigluOaiLimit ? kSwigluOaiLimit : b < -kSwigluOaiLimit ? -kSwigluOaiLimit : b;
    return x / (1.0f + expf(-kSwigluOaiAlpha * x)) * (u + 1.0f);
  }
  if constexpr (op == Ew::Add) return a + s * b;  // (s = 1: exactly a + b)
  if constexpr (op == Ew::Scale) return a * s;
  return s * tanhf(a / s);  // Softcap
}

// Thread per V consecutive values (V = 4: 16-byte accesses, and a block of 8-bit activations is 8
// lanes). With qs: y's 8-bit activations too (n a multiple of 32: whole groups pass the bound).
template <Ew op, int V>
__global__ void ew_kernel(const float* a, const float* b, float* y, float s, int64_t n, int8_t* __restrict__ qs,
                          float2* __restrict__ ds) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  griddep_release();  // a GEMV after this (the down projection after the gate) may start
  griddep_wait();
  if (i - int64_t(threadIdx.x % 32) * V >= n) return;  // whole warps leave together
  const bool live = i < n;
  float v[V] = {};
  if (live) {
    float x[V], z[V] = {};
    load_v<V>(a + i, x);
    if (b) load_v<V>(b + i, z);
#pragma unroll
    for (int e = 0; e < V; e++) v[e] = ew<op>(x[e], z[e], s);
    store_v<V>(y + i, v);
  }
  if (qs) q8_store_v<V>(v, i, live, qs, ds);
}

template <Ew op>
void launch_ew(Context& c, const float* a, const float* b, float* y, float s, int64_t n, Q8Act q8 = {}) {
  if (n <= 0) return;
  if (q8.qs && n % 32 != 0) input_error(cat("CUDA gate: 8-bit activations of ", n, " values (not a multiple of 32)"));
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  cudaStream_t st = static_cast<cudaStream_t>(c.stream());
  auto* ds = reinterpret_cast<float2*>(q8.ds);
  if (n % 4 == 0 && aligned(a) && aligned(y) && (!b || aligned(b)))
    launch_early(c.early_launch, ew_kernel<op, 4>, ceil_div(n / 4, 256), 256, st, a, b, y, s, n, q8.qs, ds);
  else
    launch_early(c.early_launch, ew_kernel<op, 1>, ceil_div(n, 256), 256, st, a, b, y, s, n, q8.qs, ds);
  CUDA_CHECK_LAUNCH();
}

// y[i] += bias[i % width]: a bias added to each of n / width rows.
__global__ void add_rows_kernel(float* __restrict__ y, const float* __restrict__ bias, int64_t width, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  griddep_release();
  griddep_wait();
  if (i < n) y[i] += bias[i % width];
}

}  // namespace

void add_rows(Context& c, float* y, const float* bias, int rows, int64_t width) {
  const int64_t n = int64_t(rows) * width;
  if (n <= 0) return;
  launch_early(c.early_launch, add_rows_kernel, ceil_div(n, 256), 256, static_cast<cudaStream_t>(c.stream()), y, bias,
               width, n);
  CUDA_CHECK_LAUNCH();
}

void silu_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8) {
  launch_ew<Ew::Silu>(c, g, u, y, 0, n, q8);
}
void gelu_tanh_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8) {
  launch_ew<Ew::Gelu>(c, g, u, y, 0, n, q8);
}
void swiglu_oai_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8) {
  launch_ew<Ew::SwigluOai>(c, g, u, y, 0, n, q8);
}
void add(Context& c, float* y, const float* x, int64_t n, float s) { launch_ew<Ew::Add>(c, y, x, y, s, n); }
void scale(Context& c, float* y, float s, int64_t n) { launch_ew<Ew::Scale>(c, y, nullptr, y, s, n); }
void softcap(Context& c, float* y, float cap, int64_t n) { launch_ew<Ew::Softcap>(c, y, nullptr, y, cap, n); }

// ---- embedding rows: thread per unit of the requested rows ----

template <class T>
__global__ void embed_kernel(const uint8_t* __restrict__ W, size_t stride, int64_t cols,
                             const int32_t* __restrict__ ids, int n, float s, float* __restrict__ out) {
  griddep_release();
  griddep_wait();
  const int units = int(cols / T::unit);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * units) return;
  const int t = int(i / units), u = int(i % units);
  const typename T::W w = T::load(W + size_t(ids[t]) * stride, cols, u);
  float* o = out + int64_t(t) * cols;
  T::dequant(w, u, [&](int e0, const float (&v)[8]) {
    float4* p = reinterpret_cast<float4*>(o + e0);
    p[0] = make_float4(v[0] * s, v[1] * s, v[2] * s, v[3] * s);
    p[1] = make_float4(v[4] * s, v[5] * s, v[6] * s, v[7] * s);
  });
}

template <class T>
static void embed_type(Context& c, const Weight& W, const int32_t* ids, int n, float* out, float s) {
  const int64_t total = int64_t(n) * (W.cols / T::unit);
  launch_early(c.early_launch, embed_kernel<T>, ceil_div(total, 128), 128, static_cast<cudaStream_t>(c.stream()),
               static_cast<const uint8_t*>(W.data), W.row_stride, W.cols, ids, n, s, out);
  CUDA_CHECK_LAUNCH();
}

#define BATON_INSTANTIATE(T) template void embed_type<T>(Context&, const Weight&, const int32_t*, int, float*, float);
BATON_CUDA_WEIGHT_TYPES(BATON_INSTANTIATE)
#undef BATON_INSTANTIATE

void embed_rows(Context& c, const Weight& table, const int32_t* ids, int n, float* out, float s) {
  if (n <= 0) return;
  with_weight_type(table.type, [&](auto t) { embed_type<decltype(t)>(c, table, ids, n, out, s); });
}

// ---- a mixture of experts' rows: thread per value ----

__global__ void gather_rows_kernel(const float* __restrict__ x, const int32_t* __restrict__ rows, int m, int width,
                                   float* __restrict__ y) {
  griddep_release();
  griddep_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(m) * width) return;
  const int j = int(i / width), e = int(i % width);
  y[i] = x[int64_t(rows[j]) * width + e];
}

__global__ void scatter_add_rows_kernel(float* __restrict__ acc, const float* __restrict__ y,
                                        const int32_t* __restrict__ rows, const float* __restrict__ w, bool sigmoid_w,
                                        int m, int width) {
  griddep_release();
  griddep_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(m) * width) return;
  const int j = int(i / width), e = int(i % width);
  const float f = sigmoid_w ? 1.0f / (1.0f + expf(-w[j])) : w[j];
  float* a = acc + int64_t(rows ? rows[j] : j) * width + e;
  *a += f * y[i];
}

void gather_rows(Context& c, const float* x, const int32_t* rows, int m, int width, float* y) {
  if (m <= 0) return;
  launch_early(c.early_launch, gather_rows_kernel, ceil_div(int64_t(m) * width, 256), 256,
               static_cast<cudaStream_t>(c.stream()), x, rows, m, width, y);
  CUDA_CHECK_LAUNCH();
}

void scatter_add_rows(Context& c, float* acc, const float* y, const int32_t* rows, const float* w, bool sigmoid_w,
                      int m, int width) {
  if (m <= 0) return;
  launch_early(c.early_launch, scatter_add_rows_kernel, ceil_div(int64_t(m) * width, 256), 256,
               static_cast<cudaStream_t>(c.stream()), acc, y, rows, w, sigmoid_w, m, width);
  CUDA_CHECK_LAUNCH();
}

// ---- KV cache rows ----

// F16: thread per value. Q8_0: warp per 32-value block (kv_store_f16 / kv_store_q8, common.cuh).
// blockIdx.y: k or v.
__global__ void kv_f16_kernel(KvRows k, KvRows v, int n) {
  griddep_release();
  griddep_wait();
  const KvRows p = blockIdx.y ? v : k;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(p.width) * n) return;
  const int r = int(i / p.width), e = int(i % p.width);
  kv_store_f16(p.dst + size_t(r) * p.dst_row, e, p.src[size_t(r) * p.src_stride + e]);
}

__global__ void kv_q8_kernel(KvRows k, KvRows v, int n) {
  griddep_release();
  griddep_wait();
  const KvRows p = blockIdx.y ? v : k;
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32, nb = p.width / 32;
  if (b >= int64_t(nb) * n) return;  // whole warps leave together
  const int r = int(b / nb), blk = int(b % nb);
  kv_store_q8(p.dst + size_t(r) * p.dst_row, blk, lane, p.src[size_t(r) * p.src_stride + size_t(blk) * 32 + lane]);
}

// The decode step's rope and staging in one launch: blockIdx.x the token, blockIdx.y the part.
// q (0): rotated in place, a thread per pair (as rope_kernel). k (1): a thread per value of the
// row, its rotated value computed from its pair in the F32 row (left as it was) and stored as the
// KV type, warps of 32 values for Q8_0. v (2): stored as the KV type. rope_dim 0 (a NoPE layer):
// the q blocks have no pair to rotate and k's values pass through rope_value unrotated.
template <bool Q8>
__global__ void __launch_bounds__(256)
rope_stage_kernel(RopeRows q, KvRows k, KvRows v, int head_dim, int rope_dim, const int32_t* __restrict__ pos,
                  const float* __restrict__ freqs, bool neox, float mscale) {
  griddep_release();
  griddep_wait();
  const int t = blockIdx.x, half = rope_dim / 2;
  const int j = int(blockIdx.z) * blockDim.x + threadIdx.x;
  if (blockIdx.y == 0) {
    if (j >= half * q.n_head) return;
    const int h = j / half, i = j % half;
    rope_in_place(q.x + size_t(t) * q.stride + size_t(h) * head_dim, i, half, neox, pos[t], freqs[i], mscale);
    return;
  }
  const KvRows p = blockIdx.y == 1 ? k : v;
  if ((Q8 ? j - int(threadIdx.x % 32) : j) >= p.width) return;  // Q8_0: whole warps (widths are multiples of 32)
  const float* src = p.src + size_t(t) * p.src_stride;
  const int e = j % head_dim;
  const float x = blockIdx.y == 1 ? rope_value(src + (j - e), e, rope_dim, neox, pos[t], freqs, mscale) : src[j];
  if constexpr (Q8) kv_store_q8(p.dst + size_t(t) * p.dst_row, j / 32, j % 32, x);
  else kv_store_f16(p.dst + size_t(t) * p.dst_row, j, x);
}

static void kv_convert_launch(Context& c, GgmlType type, const KvRows& k, const KvRows* v, int n) {
  if (n <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  const int64_t width = std::max(k.width, v ? v->width : 0);
  const unsigned parts = v ? 2u : 1u;
  if (type == GgmlType::F16) {
    launch_early(c.early_launch, kv_f16_kernel, dim3(unsigned(ceil_div(width * n, 256)), parts), 256, s, k, v ? *v : k, n);
  } else if (type == GgmlType::Q8_0) {
    for (int w : {k.width, v ? v->width : 32})
      if (w % 32) input_error(cat("CUDA kv_convert: Q8_0 rows need a multiple of 32 values, got ", w));
    for (const KvRows* r : {&k, v})
      if (r && (reinterpret_cast<uintptr_t>(r->dst) % 2 || r->dst_row % 2))
        input_error("CUDA kv_convert: Q8_0 rows must start at even addresses");
    launch_early(c.early_launch, kv_q8_kernel, dim3(unsigned(ceil_div(width * n, 256)), parts), 256, s, k, v ? *v : k, n);
  } else {
    input_error(cat("CUDA kv_convert: KV type ", type_name(type), " is not F16 or Q8_0"));
  }
  CUDA_CHECK_LAUNCH();
}

void kv_convert(Context& c, GgmlType type, const float* src, size_t src_stride, uint8_t* dst,
                size_t dst_row, int width, int n) {
  kv_convert_launch(c, type, {src, src_stride, dst, dst_row, width}, nullptr, n);
}

void kv_convert_kv(Context& c, GgmlType type, const KvRows& k, const KvRows& v, int n) {
  kv_convert_launch(c, type, k, &v, n);
}

void rope_stage(Context& c, GgmlType type, const RopeRows& q, const KvRows& k, const KvRows& v, int n_tok, int head_dim,
                int rope_dim, const int32_t* pos, const float* freqs, bool neox, float mscale) {
  if (rope_dim < 0 || rope_dim % 2 != 0 || rope_dim > head_dim || rope_dim > 2048)
    input_error(cat("CUDA rope_stage: rope_dim ", rope_dim, " must be even and at most head_dim ", head_dim));
  if (type != GgmlType::F16 && type != GgmlType::Q8_0)
    input_error(cat("CUDA rope_stage: KV type ", type_name(type), " is not F16 or Q8_0"));
  if (k.width % head_dim != 0)
    input_error(cat("CUDA rope_stage: k rows of ", k.width, " values are not whole heads of ", head_dim));
  if (type == GgmlType::Q8_0) {
    for (int w : {k.width, v.width})
      if (w % 32) input_error(cat("CUDA rope_stage: Q8_0 rows need a multiple of 32 values, got ", w));
    for (const KvRows* r : {&k, &v})
      if (reinterpret_cast<uintptr_t>(r->dst) % 2 || r->dst_row % 2)
        input_error("CUDA rope_stage: Q8_0 rows must start at even addresses");
  }
  if (n_tok <= 0) return;
  const int64_t most = std::max<int64_t>({int64_t(q.n_head) * (rope_dim / 2), k.width, v.width});
  const dim3 grid(unsigned(n_tok), 3u, ceil_div(most, 256));
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  if (type == GgmlType::Q8_0)
    launch_early(c.early_launch, rope_stage_kernel<true>, grid, 256, s, q, k, v, head_dim, rope_dim, pos, freqs, neox,
                 mscale);
  else
    launch_early(c.early_launch, rope_stage_kernel<false>, grid, 256, s, q, k, v, head_dim, rope_dim, pos, freqs, neox,
                 mscale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace baton::cuda
