// RMSNorm and RoPE (adjacent pairs and NeoX halves), as kernels/cpu/ops.cpp computes them.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace baton::cuda {

// One block per row; float sums in a fixed tree order. With d: x += d first (the residual add,
// written back), then the norm of the sum. With qs: y's 8-bit activations too (n a multiple of
// 32, so a warp's 32 values are one block of them). Rows of up to kNormPer values per thread are
// read once into registers, every load issued before any is used (a decode step's single row
// is one block: its loads must overlap, not queue); longer rows loop and read x twice.
constexpr int kNormPer = 8, kNormMaxThreads = 1024;
__global__ void __launch_bounds__(kNormMaxThreads)
rms_norm_kernel(float* x, const float* d, const float* __restrict__ w, float* y, int n, float eps,
                int8_t* __restrict__ qs, float2* __restrict__ ds) {
  griddep_release();  // the GEMV after the norm may start loading its weights
  griddep_wait();     // launched early itself: x and d come from the ops before
  float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  const float* dr = d ? d + int64_t(blockIdx.x) * n : nullptr;
  const bool cached = n <= kNormPer * int(blockDim.x);
  float v[kNormPer], wv[kNormPer];  // wv: the weights, loaded with x (they do not depend on the sum)
  float ss = 0.0f;
  if (cached) {
#pragma unroll
    for (int k = 0; k < kNormPer; k++) {
      const int i = threadIdx.x + k * blockDim.x;
      v[k] = i < n ? xr[i] : 0.0f;
      wv[k] = i < n && w ? w[i] : 1.0f;
    }
    if (dr) {
#pragma unroll
      for (int k = 0; k < kNormPer; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) v[k] += dr[i];
      }
#pragma unroll
      for (int k = 0; k < kNormPer; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) xr[i] = v[k];
      }
    }
#pragma unroll
    for (int k = 0; k < kNormPer; k++) ss += v[k] * v[k];
  } else if (dr) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float s = xr[i] + dr[i];
      xr[i] = s;
      ss += s * s;
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  }
  ss = block_sum(ss);  // also orders the x writes above before the reads below (same thread anyway)
  const float inv = 1.0f / sqrtf(ss / float(n) + eps);
  if (cached) {
#pragma unroll
    for (int k = 0; k < kNormPer; k++) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i >= n) break;  // whole warps: n and blockDim.x are multiples of 32 where qs is used
      const float o = w ? v[k] * inv * wv[k] : v[k] * inv;
      yr[i] = o;
      if (qs) q8_store(o, int64_t(blockIdx.x) * n + i, qs, ds);
    }
    return;
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float o = w ? xr[i] * inv * w[i] : xr[i] * inv;
    yr[i] = o;
    if (qs) q8_store(o, int64_t(blockIdx.x) * n + i, qs, ds);  // whole warps: n % 32 == 0
  }
}

static void rms_norm_launch(Context& c, float* x, const float* d, const float* w, float* y, int rows, int n, float eps,
                            Q8Act q8) {
  if (rows <= 0 || n <= 0) return;
  if (q8.qs && n % 32 != 0) input_error(cat("CUDA rms_norm: 8-bit activations of rows of ", n, " (not a multiple of 32)"));
  // About 4 values per thread (8 at most, up to 8192 per row), whole warps.
  const int threads = int(std::min<int64_t>(kNormMaxThreads, std::max<int64_t>(32, ceil_div(ceil_div(n, 4), 32) * 32)));
  launch_early(c.early_launch, rms_norm_kernel, rows, threads, static_cast<cudaStream_t>(c.stream()), x, d, w, y, n, eps,
               q8.qs, reinterpret_cast<float2*>(q8.ds));
  CUDA_CHECK_LAUNCH();
}

void rms_norm(Context& c, const float* x, const float* w, float* y, int rows, int n, float eps, Q8Act q8) {
  rms_norm_launch(c, const_cast<float*>(x), nullptr, w, y, rows, n, eps, q8);  // x is only read without d
}

void add_rms_norm(Context& c, float* x, const float* d, const float* w, float* y, int rows, int n, float eps,
                  Q8Act q8) {
  rms_norm_launch(c, x, d, w, y, rows, n, eps, q8);
}

// Thread per rotated pair of one head: blockIdx.x the token, blockIdx.y q or k, thread j of the
// blocks along z the pair j % (rope_dim / 2) of head j / (rope_dim / 2). cos/sin in double.
constexpr int kRopeThreads = 256;
__global__ void __launch_bounds__(kRopeThreads)
rope_kernel(RopeRows q, RopeRows k, int head_dim, int rope_dim, const int32_t* __restrict__ pos,
            const float* __restrict__ freqs, bool neox) {
  griddep_release();
  griddep_wait();
  const int half = rope_dim / 2;
  const RopeRows p = blockIdx.y ? k : q;
  const int j = int(blockIdx.z) * blockDim.x + threadIdx.x;
  if (j >= half * p.n_head) return;
  const int h = j / half, i = j % half;
  rope_in_place(p.x + size_t(blockIdx.x) * p.stride + size_t(h) * head_dim, i, half, neox, pos[blockIdx.x], freqs[i]);
}

static void rope_launch(Context& c, const RopeRows& q, const RopeRows* k, int n_tok, int head_dim, int rope_dim,
                        const int32_t* pos, const float* freqs, bool neox) {
  if (rope_dim <= 0 || rope_dim % 2 != 0 || rope_dim > head_dim || rope_dim > 2048)
    input_error(cat("CUDA rope: rope_dim ", rope_dim, " must be even and at most head_dim ", head_dim));
  if (n_tok <= 0) return;
  const int heads = std::max(q.n_head, k ? k->n_head : 0);
  const dim3 grid(unsigned(n_tok), k ? 2u : 1u, unsigned(ceil_div(int64_t(heads) * (rope_dim / 2), kRopeThreads)));
  launch_early(c.early_launch, rope_kernel, grid, kRopeThreads, static_cast<cudaStream_t>(c.stream()), q, k ? *k : q,
               head_dim, rope_dim, pos, freqs, neox);
  CUDA_CHECK_LAUNCH();
}

void rope(Context& c, float* x, int n_tok, size_t stride, int n_head, int head_dim, int rope_dim,
          const int32_t* pos, const float* freqs, bool neox) {
  rope_launch(c, {x, stride, n_head}, nullptr, n_tok, head_dim, rope_dim, pos, freqs, neox);
}

void rope_qk(Context& c, const RopeRows& q, const RopeRows& k, int n_tok, int head_dim, int rope_dim,
             const int32_t* pos, const float* freqs, bool neox) {
  rope_launch(c, q, &k, n_tok, head_dim, rope_dim, pos, freqs, neox);
}

}  // namespace baton::cuda
