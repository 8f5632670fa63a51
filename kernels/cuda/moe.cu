// A mixture of experts routed on the device: the routing (softmax, top k, renormalization), the
// experts' biases by routed id, and the weighted sum of each token's experts. With the experts'
// GEMV (gemv_experts, gemv.cu) a decode step's experts never wait for the host, so the step is
// captured in a graph like a dense model's.
#include <cmath>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/common.cuh"

namespace baton::cuda {

namespace {

constexpr int kRouteThreads = 128;                      // 4 tokens per block, a warp each
constexpr int kRoutePerLane = kMoeRouteMaxExperts / 32;  // logits a lane holds

// (value, id) a is better than b: larger value, then lower id (cpu::top_k's order).
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

// One warp per token: lane l holds experts l, l + 32, ... Probabilities as cpu::moe_route computes
// them (NaN logits count as -inf; exp(x - max) / sum), then k rounds of a warp-wide best (value,
// id) pick; lane 0 writes the picks and renormalizes them in pick order.
__global__ void __launch_bounds__(kRouteThreads)
moe_route_kernel(const float* __restrict__ logits, int n, int n_expert, int k, bool renorm, int32_t* __restrict__ ids,
                 float* __restrict__ w) {
  griddep_release();
  griddep_wait();
  const int t = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
  if (t >= n) return;  // whole warps
  const float* l = logits + int64_t(t) * n_expert;
  float p[kRoutePerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; i++) {
    const int e = lane + 32 * i;
    float x = e < n_expert ? l[e] : -INFINITY;
    if (isnan(x)) x = -INFINITY;
    p[i] = x;
    mx = fmaxf(mx, x);
  }
  mx = warp_max(mx);
  int32_t* id = ids + int64_t(t) * k;
  float* wt = w + int64_t(t) * k;
  if (mx == -INFINITY) {  // no finite logit: no expert (cpu::moe_route's -1 and 0)
    for (int j = lane; j < k; j += 32) id[j] = -1, wt[j] = 0.0f;
    return;
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; i++) {
    p[i] = expf(p[i] - mx);  // exp(-inf) = 0
    sum += p[i] * float(lane + 32 * i < n_expert);
  }
  const float inv = 1.0f / warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kRoutePerLane; i++) p[i] = lane + 32 * i < n_expert ? p[i] * inv : -1.0f;  // -1: never picked
  float picked_sum = 0.0f;
  const int found = min(k, n_expert);
  for (int j = 0; j < found; j++) {
    float bv = -2.0f;
    int bi = INT32_MAX;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; i++)
      if (better(p[i], lane + 32 * i, bv, bi)) bv = p[i], bi = lane + 32 * i;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, bv, o);
      const int oi = __shfl_xor_sync(kFullMask, bi, o);
      if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
#pragma unroll
    for (int i = 0; i < kRoutePerLane; i++)
      if (lane + 32 * i == bi) p[i] = -1.0f;  // taken
    if (lane == 0) id[j] = bi, wt[j] = bv;
    picked_sum += bv;
  }
  if (lane != 0) return;
  for (int j = found; j < k; j++) id[j] = -1, wt[j] = 0.0f;
  if (!renorm) return;
  const float s = fmaxf(picked_sum, 6.103515625e-5f);  // cpu::moe_route's floor
  for (int j = 0; j < found; j++) wt[j] /= s;
}

__global__ void add_rows_id_kernel(float* __restrict__ y, const float* __restrict__ bias,
                                   const int32_t* __restrict__ ids, int pairs, int width) {
  griddep_release();
  griddep_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(pairs) * width) return;
  const int p = int(i / width), c = int(i % width);
  const int e = ids[p];
  if (e >= 0) y[i] += bias[int64_t(e) * width + c];
}

__global__ void moe_combine_kernel(float* __restrict__ acc, const float* __restrict__ ye,
                                   const int32_t* __restrict__ ids, const float* __restrict__ w, int n, int k,
                                   int width) {
  griddep_release();
  griddep_wait();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * width) return;
  const int t = int(i / width), c = int(i % width);
  const int32_t* tid = ids + int64_t(t) * k;
  float s = 0.0f;
  // The token's experts in ascending id (the CPU stage's order in every step, and this stage's
  // prompt path's), equal ids by rank: each round picks the next (id, rank) pair; a skipped pair
  // (-1) is never read.
  for (int last = -1, last_r = k;;) {
    int j = -1;
    for (int r = 0; r < k; r++) {
      const bool after = tid[r] > last || (tid[r] == last && r > last_r);
      if (after && tid[r] >= 0 && (j < 0 || tid[r] < tid[j])) j = r;
    }
    if (j < 0) break;
    last = tid[j];
    last_r = j;
    const int64_t p = int64_t(t) * k + j;
    s += w[p] * ye[p * width + c];
  }
  acc[i] = s;
}

}  // namespace

void moe_route(Context& c, const float* logits, int n, int n_expert, int k, bool renorm, int32_t* ids, float* w) {
  if (n_expert < 1 || n_expert > kMoeRouteMaxExperts || k < 1)
    input_error(cat("CUDA moe_route: ", n_expert, " experts, ", k, " used (the kernel takes 1 to ", kMoeRouteMaxExperts,
                    " experts)"));
  if (n <= 0) return;
  launch_early(c.early_launch, moe_route_kernel, ceil_div(int64_t(n) * 32, kRouteThreads), kRouteThreads,
               static_cast<cudaStream_t>(c.stream()), logits, n, n_expert, k, renorm, ids, w);
  CUDA_CHECK_LAUNCH();
}

void add_rows_id(Context& c, float* y, const float* bias, const int32_t* ids, int pairs, int width) {
  if (pairs <= 0 || width <= 0) return;
  launch_early(c.early_launch, add_rows_id_kernel, ceil_div(int64_t(pairs) * width, 256), 256,
               static_cast<cudaStream_t>(c.stream()), y, bias, ids, pairs, width);
  CUDA_CHECK_LAUNCH();
}

void moe_combine(Context& c, float* acc, const float* ye, const int32_t* ids, const float* w, int n, int k, int width) {
  if (n <= 0 || width <= 0) return;
  launch_early(c.early_launch, moe_combine_kernel, ceil_div(int64_t(n) * width, 256), 256,
               static_cast<cudaStream_t>(c.stream()), acc, ye, ids, w, n, k, width);
  CUDA_CHECK_LAUNCH();
}

}  // namespace baton::cuda
