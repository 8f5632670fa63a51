// Prefill matmul (more than gemv_max_cols columns): expand the weight to FP16 in row slabs and
// multiply on the tensor cores with cublasGemmEx (FP16 inputs, FP32 accumulation and output).
#include <algorithm>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant.cuh"

namespace baton::cuda {

// One thread per unit of the slab: load it with the GEMV loader, expand it to FP16 in shared
// memory; then the block's units, which cover consecutive elements of the slab (256 units: whole
// super-blocks), go out as consecutive 16-byte words (a thread's own unit written straight out
// would be 2..8 strided words per thread, half sectors per store). Word w of the block's span sits
// at (w / V) * V + (w % V ^ swz(w / V)), so that eight threads storing word k of their (consecutive)
// units hit eight different 16-byte bank groups.
constexpr int kDequantThreads = 256;

template <class T>
__global__ void __launch_bounds__(kDequantThreads)
dequant_f16_kernel(const uint8_t* __restrict__ W, size_t stride, int64_t cols, int64_t n_units_total,
                   __half* __restrict__ dst) {
  constexpr int V = T::unit / 8;  // 16-byte words of FP16 per unit
  __shared__ uint4 tile[kDequantThreads * V];
  auto swz = [](int t) { return (t * V / 8) % V; };
  const int64_t i0 = int64_t(blockIdx.x) * kDequantThreads, i = i0 + threadIdx.x;
  if (i < n_units_total) {
    const int units = int(cols / T::unit);
    const int64_t r = i / units;
    const int u = int(i % units);
    const typename T::W w = T::load(W + r * stride, cols, u);
    const int64_t base = r * cols - i0 * T::unit;  // row start, in elements from the block's first
    T::dequant(w, u, [&](int e0, const float (&v)[8]) {
      uint4 pk;
      __half2* h = reinterpret_cast<__half2*>(&pk);
#pragma unroll
      for (int k = 0; k < 4; k++) h[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
      const int word = int((base + e0) / 8);  // a unit's elements need not be consecutive (Q6_K)
      tile[(word / V) * V + ((word % V) ^ swz(word / V))] = pk;
    });
  }
  __syncthreads();
  const int64_t left = n_units_total - i0;
  const int n = int(left < kDequantThreads ? left : kDequantThreads) * V;
  uint4* out = reinterpret_cast<uint4*>(dst) + i0 * V;  // unit i starts at element i * unit
  for (int k = threadIdx.x; k < n; k += kDequantThreads) out[k] = tile[(k / V) * V + ((k % V) ^ swz(k / V))];
}

// The activations in FP16. With q8 (quantized weights) each block of 32 is first rounded to the
// 8-bit grid that the GEMV and the CPU use (quantize_act: d = max|x| / 127), so that a prompt gives
// the same logits in one batch as token by token. n is then a multiple of 32: whole warps are in.
__global__ void act_to_f16_kernel(const float* __restrict__ x, int64_t n, bool q8, __half* __restrict__ y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = x[i];
  if (q8) {
    const float a[1] = {v};
    int q[1];
    const float d = q8_grid<1>(a, q);
    v = float(q[0]) * d;
  }
  // Saturate: an activation past FP16's range becomes ±65504, not inf (and then NaN in Y).
  y[i] = __float2half_rn(fminf(fmaxf(v, -65504.0f), 65504.0f));
}

template <class T>
static void dequant_type(Context& c, const Weight& W, int64_t row0, int64_t nrows, __half* dst) {
  const int64_t total = nrows * (W.cols / T::unit);
  if (total == 0) return;
  const uint8_t* w = static_cast<const uint8_t*>(W.data) + row0 * W.row_stride;
  dequant_f16_kernel<T><<<ceil_div(total, kDequantThreads), kDequantThreads, 0, static_cast<cudaStream_t>(c.stream())>>>(
      w, W.row_stride, W.cols, total, dst);
  CUDA_CHECK_LAUNCH();
}

#define BATON_INSTANTIATE(T) template void dequant_type<T>(Context&, const Weight&, int64_t, int64_t, __half*);
BATON_CUDA_WEIGHT_TYPES(BATON_INSTANTIATE)
#undef BATON_INSTANTIATE

void dequantize_f16(Context& c, const Weight& W, int64_t row0, int64_t nrows, uint16_t* dst) {
  CUDA_ASSERT(row0 >= 0 && nrows >= 0 && row0 + nrows <= W.rows);
  with_weight_type(W.type, [&](auto t) {
    dequant_type<decltype(t)>(c, W, row0, nrows, reinterpret_cast<__half*>(dst));
  });
}

// Rows per FP16 slab: the whole matrix when it fits in gemm_slab_bytes, else a multiple of 128.
static int64_t slab_rows(const Context& c, const Weight& W) {
  const int64_t fit = int64_t(c.gemm_slab_bytes / (size_t(W.cols) * 2));
  if (fit >= W.rows) return W.rows;
  return std::max<int64_t>(128, fit / 128 * 128);
}

static size_t align256(size_t b) { return (b + 255) / 256 * 256; }

// gemm's scratch: X in FP16, then one FP16 slab of W.
static size_t gemm_scratch_bytes(const Context& c, const Weight& W, int n) {
  return align256(size_t(n) * W.cols * 2) + size_t(std::min(slab_rows(c, W), W.rows)) * W.cols * 2;
}

size_t matmul_scratch_bytes(const Context& c, const Weight& W, int n) {
  if (n <= c.gemv_max_cols) return q8_act_bytes(W.cols, n);
  return gemm_scratch_bytes(c, W, n);
}

// Matrices of one width that multiply the same X (q, k and v; gate and up) share its FP16 copy:
// converted once, again only where the next matrix wants the other rounding (q8 or not).
void gemm_n(Context& c, const Weight* const* W, float* const* Y, int count, const float* X, int n) {
  if (n <= 0 || count <= 0) return;
  size_t bytes = 0;
  for (int i = 0; i < count; i++) {
    const Weight& w = *W[i];
    if (!cuda_supports(w.type) || w.row_stride != packed_row_bytes(w.type, w.cols))
      input_error(cat("CUDA gemm: bad weight (", type_name(w.type), " ", w.rows, " x ", w.cols, ")"));
    if (w.cols > INT32_MAX || w.rows > INT32_MAX)
      input_error(cat("CUDA gemm: weight ", w.rows, " x ", w.cols, " too large for cuBLAS"));
    if (w.cols != W[0]->cols)
      input_error(cat("CUDA gemm: matrices of one input differ in width (", W[0]->cols, " and ", w.cols, ")"));
    bytes = std::max(bytes, gemm_scratch_bytes(c, w, n));
  }
  const int64_t cols = W[0]->cols, nx = int64_t(n) * cols;
  auto* base = static_cast<uint8_t*>(c.scratch(bytes));  // also when n <= gemv_max_cols
  __half* xh = reinterpret_cast<__half*>(base);
  __half* wh = reinterpret_cast<__half*>(base + align256(size_t(nx) * 2));
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  cublasHandle_t h = static_cast<cublasHandle_t>(c.cublas());
  const float alpha = 1.0f, beta = 0.0f;
  int x_q8 = -1;  // the rounding xh holds (-1: none yet)
  for (int i = 0; i < count; i++) {
    const Weight& w = *W[i];
    const bool q8 = q8_activations(w.type);
    if (x_q8 != int(q8)) {
      act_to_f16_kernel<<<ceil_div(nx, 256), 256, 0, s>>>(X, nx, q8, xh);
      CUDA_CHECK_LAUNCH();
      x_q8 = int(q8);
    }
    const int64_t slab = slab_rows(c, w);
    for (int64_t r0 = 0; r0 < w.rows; r0 += slab) {
      const int64_t nr = std::min(slab, w.rows - r0);
      dequantize_f16(c, w, r0, nr, reinterpret_cast<uint16_t*>(wh));
      // Column-major view: the slab is cols x nr (lda = cols), X is cols x n, Y is rows x n.
      // Y[r0 .. r0+nr, :] = slab^T · X.
      CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(nr), n, int(cols), &alpha, wh, CUDA_R_16F, int(cols),
                                xh, CUDA_R_16F, int(cols), &beta, Y[i] + r0, CUDA_R_32F, int(w.rows), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
    }
  }
}

void gemm(Context& c, const Weight& W, const float* X, int n, float* Y) {
  const Weight* w = &W;
  gemm_n(c, &w, &Y, 1, X, n);
}

}  // namespace baton::cuda
