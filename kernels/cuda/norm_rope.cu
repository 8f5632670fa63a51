// RMSNorm and RoPE (adjacent pairs and NeoX halves), as kernels/cpu/ops.cpp computes them.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace baton::cuda {

// One block per row; float sums in a fixed tree order.
__global__ void rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ w, float* y,
                                int n, float eps) {
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w ? xr[i] * inv * w[i] : xr[i] * inv;
}

void rms_norm(Context& c, const float* x, const float* w, float* y, int rows, int n, float eps) {
  if (rows <= 0 || n <= 0) return;
  const int threads = n >= 1024 ? 256 : (n >= 256 ? 128 : 32);
  rms_norm_kernel<<<rows, threads, 0, static_cast<cudaStream_t>(c.stream())>>>(x, w, y, n, eps);
  CUDA_CHECK_LAUNCH();
}

// Block per token; thread i handles pair i of every head (cos/sin computed once, in double).
__global__ void rope_kernel(float* x, size_t stride, int n_head, int head_dim, int rope_dim,
                            const int32_t* __restrict__ pos, const float* __restrict__ freqs, bool neox) {
  const int half = rope_dim / 2;
  const int i = threadIdx.x;
  if (i >= half) return;
  float* xt = x + size_t(blockIdx.x) * stride;
  double sd, cd;
  sincos(double(pos[blockIdx.x]) * double(freqs[i]), &sd, &cd);
  const float cs = float(cd), sn = float(sd);
  const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
  for (int h = 0; h < n_head; h++) {
    float* v = xt + size_t(h) * head_dim;
    const float a = v[i0], b = v[i1];
    v[i0] = a * cs - b * sn;
    v[i1] = a * sn + b * cs;
  }
}

void rope(Context& c, float* x, int n_tok, size_t stride, int n_head, int head_dim, int rope_dim,
          const int32_t* pos, const float* freqs, bool neox) {
  if (rope_dim <= 0 || rope_dim % 2 != 0 || rope_dim > head_dim || rope_dim > 2048)
    input_error(cat("CUDA rope: rope_dim ", rope_dim, " must be even and at most head_dim ", head_dim));
  if (n_tok <= 0) return;
  const int threads = (rope_dim / 2 + 31) / 32 * 32;
  rope_kernel<<<n_tok, threads, 0, static_cast<cudaStream_t>(c.stream())>>>(
      x, stride, n_head, head_dim, rope_dim, pos, freqs, neox);
  CUDA_CHECK_LAUNCH();
}

}  // namespace baton::cuda
