// RMSNorm and RoPE (adjacent pairs and NeoX halves), as kernels/cpu/ops.cpp computes them.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace baton::cuda {

// One block per row; float sums in a fixed tree order. With d: x += ds·d first (the residual add,
// written back; ds = 1 but for granite's residual scale), then the norm of the sum. With qs: y's 8-bit activations too (n a multiple of
// 32). A thread holds V consecutive values of each slice of V·blockDim (V = 4: 16-byte loads and
// stores, and a block of 8-bit activations is 8 lanes, q8_store_v). Rows of up to kNormSlices
// slices are read once into registers, every load issued before any is used (a decode step's
// single row is one block: its loads must overlap, not queue); longer rows loop and read x twice.
// Blocks are as small as that allows (256 threads for 4096 values): launched early behind a
// GEMV, a block can only start on an SM with that many threads' registers free, and a 1024-thread
// block waits for most of an SM's GEMV blocks to finish.
constexpr int kNormSlices = 4, kNormMaxThreads = 1024;

template <int V>
__global__ void __launch_bounds__(kNormMaxThreads)
rms_norm_kernel(float* x, const float* d, float d_scale, const float* __restrict__ w, float* y, int n, float eps,
                int8_t* __restrict__ qs, float2* __restrict__ ds) {
  griddep_release();  // the GEMV after the norm may start loading its weights
  griddep_wait();     // launched early itself: x and d come from the ops before
  float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  const float* dr = d ? d + int64_t(blockIdx.x) * n : nullptr;
  const int per = V * int(blockDim.x), i_first = V * int(threadIdx.x);
  const int warp_first = V * int(threadIdx.x / 32 * 32);  // the warp's first value in a slice
  // Writes value run [i, i + V) of the output (and its 8-bit activations); called by whole warps
  // when qs (i uniform up to the lane: the warp is past the end only as a whole).
  auto put = [&](int i, const float (&v)[V], const float (&wv)[V], float inv) {
    float o[V];
#pragma unroll
    for (int e = 0; e < V; e++) o[e] = w ? v[e] * inv * wv[e] : v[e] * inv;
    if (i < n) store_v<V>(yr + i, o);
    if (qs) q8_store_v<V>(o, int64_t(blockIdx.x) * n + i, i < n, qs, ds);
  };
  float ss = 0.0f;
  if (n <= kNormSlices * per) {
    float v[kNormSlices][V], wv[kNormSlices][V];  // wv: the weights, loaded with x (they do not depend on the sum)
#pragma unroll
    for (int k = 0; k < kNormSlices; k++) {
      const int i = i_first + k * per;
#pragma unroll
      for (int e = 0; e < V; e++) v[k][e] = 0.0f, wv[k][e] = 1.0f;
      if (i < n) {
        load_v<V>(xr + i, v[k]);
        if (w) load_v<V>(w + i, wv[k]);
      }
    }
    if (dr) {
#pragma unroll
      for (int k = 0; k < kNormSlices; k++) {
        const int i = i_first + k * per;
        if (i >= n) continue;
        float dv[V];
        load_v<V>(dr + i, dv);
#pragma unroll
        for (int e = 0; e < V; e++) v[k][e] += d_scale * dv[e];
        store_v<V>(xr + i, v[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kNormSlices; k++)
#pragma unroll
      for (int e = 0; e < V; e++) ss += v[k][e] * v[k][e];
    ss = block_sum(ss);  // also orders the x writes above before the reads below (same thread anyway)
    const float inv = 1.0f / sqrtf(ss / float(n) + eps);
#pragma unroll
    for (int k = 0; k < kNormSlices; k++) {
      if (warp_first + k * per >= n) break;  // the whole warp
      put(i_first + k * per, v[k], wv[k], inv);
    }
    return;
  }
  for (int i = i_first; i < n; i += per) {
    float v[V];
    load_v<V>(xr + i, v);
    if (dr) {
      float dv[V];
      load_v<V>(dr + i, dv);
#pragma unroll
      for (int e = 0; e < V; e++) v[e] += d_scale * dv[e];
      store_v<V>(xr + i, v);
    }
#pragma unroll
    for (int e = 0; e < V; e++) ss += v[e] * v[e];
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(n) + eps);
  for (int i0 = warp_first; i0 < n; i0 += per) {  // whole warps
    const int i = i0 + (i_first - warp_first);
    float v[V], wv[V];
#pragma unroll
    for (int e = 0; e < V; e++) v[e] = 0.0f, wv[e] = 1.0f;
    if (i < n) {
      load_v<V>(xr + i, v);
      if (w) load_v<V>(w + i, wv);
    }
    put(i, v, wv, inv);
  }
}

static void rms_norm_launch(Context& c, float* x, const float* d, float d_scale, const float* w, float* y, int rows,
                            int n, float eps, Q8Act q8) {
  if (rows <= 0 || n <= 0) return;
  if (q8.qs && n % 32 != 0) input_error(cat("CUDA rms_norm: 8-bit activations of rows of ", n, " (not a multiple of 32)"));
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = n % 4 == 0 && aligned(x) && aligned(y) && (!d || aligned(d)) && (!w || aligned(w));
  const int V = vec ? 4 : 1;
  // kNormSlices·V values per thread (up to kNormSlices·V·1024 per row), whole warps.
  const int threads =
      int(std::min<int64_t>(kNormMaxThreads, std::max<int64_t>(32, ceil_div(ceil_div(n, V * kNormSlices), 32) * 32)));
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  auto* ds = reinterpret_cast<float2*>(q8.ds);
  if (vec) launch_early(c.early_launch, rms_norm_kernel<4>, rows, threads, s, x, d, d_scale, w, y, n, eps, q8.qs, ds);
  else launch_early(c.early_launch, rms_norm_kernel<1>, rows, threads, s, x, d, d_scale, w, y, n, eps, q8.qs, ds);
  CUDA_CHECK_LAUNCH();
}

void rms_norm(Context& c, const float* x, const float* w, float* y, int rows, int n, float eps, Q8Act q8) {
  rms_norm_launch(c, const_cast<float*>(x), nullptr, 1.f, w, y, rows, n, eps, q8);  // x is only read without d
}

void add_rms_norm(Context& c, float* x, const float* d, const float* w, float* y, int rows, int n, float eps,
                  Q8Act q8, float ds) {
  rms_norm_launch(c, x, d, ds, w, y, rows, n, eps, q8);
}

// Thread per rotated pair of one head: blockIdx.x the token, blockIdx.y q or k, thread j of the
// blocks along z the pair j % (rope_dim / 2) of head j / (rope_dim / 2). cos/sin in double.
constexpr int kRopeThreads = 256;
__global__ void __launch_bounds__(kRopeThreads)
rope_kernel(RopeRows q, RopeRows k, int head_dim, int rope_dim, const int32_t* __restrict__ pos,
            const float* __restrict__ freqs, bool neox, float mscale) {
  griddep_release();
  griddep_wait();
  const int half = rope_dim / 2;
  const RopeRows p = blockIdx.y ? k : q;
  const int j = int(blockIdx.z) * blockDim.x + threadIdx.x;
  if (j >= half * p.n_head) return;
  const int h = j / half, i = j % half;
  rope_in_place(p.x + size_t(blockIdx.x) * p.stride + size_t(h) * head_dim, i, half, neox, pos[blockIdx.x], freqs[i],
                mscale);
}

static void rope_launch(Context& c, const RopeRows& q, const RopeRows* k, int n_tok, int head_dim, int rope_dim,
                        const int32_t* pos, const float* freqs, bool neox, float mscale) {
  if (rope_dim < 0 || rope_dim % 2 != 0 || rope_dim > head_dim || rope_dim > 2048)
    input_error(cat("CUDA rope: rope_dim ", rope_dim, " must be even and at most head_dim ", head_dim));
  if (n_tok <= 0 || rope_dim == 0) return;  // (0: a NoPE layer, nothing rotates)
  const int heads = std::max(q.n_head, k ? k->n_head : 0);
  const dim3 grid(unsigned(n_tok), k ? 2u : 1u, unsigned(ceil_div(int64_t(heads) * (rope_dim / 2), kRopeThreads)));
  launch_early(c.early_launch, rope_kernel, grid, kRopeThreads, static_cast<cudaStream_t>(c.stream()), q, k ? *k : q,
               head_dim, rope_dim, pos, freqs, neox, mscale);
  CUDA_CHECK_LAUNCH();
}

void rope(Context& c, float* x, int n_tok, size_t stride, int n_head, int head_dim, int rope_dim,
          const int32_t* pos, const float* freqs, bool neox, float mscale) {
  rope_launch(c, {x, stride, n_head}, nullptr, n_tok, head_dim, rope_dim, pos, freqs, neox, mscale);
}

void rope_qk(Context& c, const RopeRows& q, const RopeRows& k, int n_tok, int head_dim, int rope_dim,
             const int32_t* pos, const float* freqs, bool neox, float mscale) {
  rope_launch(c, q, &k, n_tok, head_dim, rope_dim, pos, freqs, neox, mscale);
}

}  // namespace baton::cuda
