// Greedy and top-k selection on the device, so decode does not copy the vocabulary row to the
// host every token. One block per row (argmax: several for long rows).
//  - argmax: strided scan + tree reduction; ties go to the lowest index (as the CPU sampler).
//    Long rows: a block per slice, the last block of a row picks from the slices' best.
//  - top_k: radix select of the k-th largest value (4 passes of 8 bits over order-preserving
//    keys), one collection pass in index order (ties at the threshold: lowest indices first),
//    then a rank sort of the k candidates in shared memory. Long rows: the same per slice, and
//    the row's last block selects from the slices' candidates.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace baton::cuda {

namespace {

constexpr int kSelThreads = 1024;
constexpr int kSliceThreads = 256;  // argmax's blocks per slice: small, to start beside the GEMV before
constexpr int kMaxTopK = 256;

// Whether (v, i) ranks before (bv, bi): larger value, then lower index; NaN ranks after every
// number (and NaNs among themselves by index), so argmax never picks one and top_k sorts them last.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  if (isnan(v) || isnan(bv)) return isnan(bv) && (!isnan(v) || i < bi);
  return v > bv || (v == bv && i < bi);
}

// The best (value, index) over the warp, in every lane.
__device__ __forceinline__ void warp_best(float& bv, int& bi) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, bv, o);
    const int i = __shfl_xor_sync(kFullMask, bi, o);
    if (better(v, i, bv, bi)) { bv = v; bi = i; }
  }
}

// The best (value, index) of x[begin, end) over the block, in every thread of warp 0. kArgmaxLoads
// loads in flight per thread (a loop of single loads waits out the memory latency once per
// 1024 values). The order of the comparisons does not matter: better() is a total order.
constexpr int kArgmaxLoads = 8;
__device__ __forceinline__ void block_best(const float* __restrict__ x, int begin, int end, float& bv, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  bv = -INFINITY;
  bi = INT32_MAX;
  for (int i0 = begin + int(threadIdx.x); i0 < end; i0 += kArgmaxLoads * int(blockDim.x)) {
    float v[kArgmaxLoads];
#pragma unroll
    for (int k = 0; k < kArgmaxLoads; k++) {
      const int i = i0 + k * int(blockDim.x);
      v[k] = i < end ? x[i] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kArgmaxLoads; k++) {
      const int i = i0 + k * int(blockDim.x);
      if (i < end && better(v[k], i, bv, bi)) { bv = v[k]; bi = i; }
    }
  }
  warp_best(bv, bi);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
  __syncthreads();
  if (warp == 0) {
    bv = lane < int(blockDim.x / 32) ? sv[lane] : -INFINITY;
    bi = lane < int(blockDim.x / 32) ? si[lane] : INT32_MAX;
    warp_best(bv, bi);
  }
}

// One block per row.
__global__ void __launch_bounds__(kSelThreads) argmax_kernel(const float* __restrict__ logits, int n_vocab, int32_t* out) {
  griddep_release();
  griddep_wait();
  float bv;
  int bi;
  block_best(logits + size_t(blockIdx.x) * n_vocab, 0, n_vocab, bv, bi);
  if (threadIdx.x == 0) out[blockIdx.x] = bi == INT32_MAX ? 0 : bi;  // all NaN: token 0
}

// Block (s, r) takes slice s of row r (one block would read a 128k row at one SM's bandwidth):
// its best goes to part[r][s], and the block that finishes a row last (counters[r] counts them)
// picks the row's best from the slices' and resets the counter. The same token as argmax_kernel.
__global__ void __launch_bounds__(kSliceThreads)
argmax_split_kernel(const float* __restrict__ logits, int n_vocab, int chunk, float2* part, uint32_t* counters,
                    int32_t* out) {
  __shared__ bool last;
  griddep_release();
  griddep_wait();
  const int s = blockIdx.x, r = blockIdx.y, n_split = gridDim.x;
  float bv;
  int bi;
  block_best(logits + size_t(r) * n_vocab, s * chunk, min(n_vocab, (s + 1) * chunk), bv, bi);
  if (threadIdx.x == 0) {
    part[size_t(r) * n_split + s] = make_float2(bv, __int_as_float(bi));
    __threadfence();  // the slice's best is visible before the count says so
    last = atomicAdd(&counters[r], 1u) == uint32_t(n_split - 1);
  }
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  __threadfence();
  bv = -INFINITY;
  bi = INT32_MAX;
  for (int k = int(threadIdx.x); k < n_split; k += 32) {
    const float2 p = __ldcg(&part[size_t(r) * n_split + k]);  // from the L2: other blocks wrote it
    const int i = __float_as_int(p.y);
    if (better(p.x, i, bv, bi)) { bv = p.x; bi = i; }
  }
  warp_best(bv, bi);
  if (threadIdx.x == 0) {
    out[r] = bi == INT32_MAX ? 0 : bi;
    counters[r] = 0;  // for the next launch
  }
}

// Unsigned key with the order of the floats (larger float, larger key). -0 and +0 get one key (they
// are equal, and ties go by index); NaN gets the lowest key, below -inf's, so NaNs are selected only
// when a row has fewer than k other values.
__device__ __forceinline__ uint32_t order_key(float f) {
  if (isnan(f)) return 0;
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive rank of this thread's flag among the block's set flags, and their total.
__device__ __forceinline__ int block_rank(bool flag, int& total, int* warp_counts) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  const unsigned ballot = __ballot_sync(kFullMask, flag);
  const int in_warp = __popc(ballot & ((1u << lane) - 1));
  __syncthreads();  // warp_counts may still be read by the previous call
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < nw; w++) {
    if (w < warp) before += warp_counts[w];
    total += warp_counts[w];
  }
  return before + in_warp;
}

// The k best of n values (value load(i), index id(i); ids rise with i among equal values) to
// idx_out/val_out, best first: a radix select of the k-th largest key (4 passes of 8 bits), one
// collection pass in i order (ties at the threshold: lowest ids first), a rank sort in shared
// memory. The whole block calls it.
template <class Load, class Id>
__device__ __forceinline__ void block_top_k(int n, int k, Load load, Id id, int32_t* idx_out, float* val_out) {
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ uint32_t s_mask;
  __shared__ int s_remaining;
  __shared__ int warp_counts[32];
  __shared__ float cv[kMaxTopK];
  __shared__ int ci[kMaxTopK];
  __syncthreads();  // the shared arrays may still be read by a previous call
  if (threadIdx.x == 0) { s_prefix = 0; s_mask = 0; s_remaining = k; }

  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix, mask = s_mask;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint32_t u = order_key(load(i));
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // walk the bins from the top until the k-th value's bin
      int above = 0, b = 255;
      for (; b > 0 && above + hist[b] < s_remaining; b--) above += hist[b];
      s_prefix = prefix | (uint32_t(b) << shift);
      s_mask = mask | (255u << shift);
      s_remaining -= above;
    }
    __syncthreads();
  }
  const uint32_t thr = s_prefix;  // key of the k-th largest value
  const int need_eq = s_remaining, n_greater = k - need_eq;

  int base_gt = 0, base_eq = 0;
  for (int i0 = 0; i0 < n; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    const float v = i < n ? load(i) : 0.0f;
    const uint32_t u = i < n ? order_key(v) : 0;
    const bool gt = i < n && u > thr, eq = i < n && u == thr;
    int tot_gt, tot_eq;
    const int r_gt = block_rank(gt, tot_gt, warp_counts);
    const int r_eq = block_rank(eq, tot_eq, warp_counts);
    if (gt) { cv[base_gt + r_gt] = v; ci[base_gt + r_gt] = id(i); }
    if (eq && base_eq + r_eq < need_eq) { cv[n_greater + base_eq + r_eq] = v; ci[n_greater + base_eq + r_eq] = id(i); }
    base_gt += tot_gt;
    base_eq += tot_eq;
  }
  __syncthreads();
  if (int(threadIdx.x) < k) {
    const float v = cv[threadIdx.x];
    const int i = ci[threadIdx.x];
    int rank = 0;
    for (int j = 0; j < k; j++) rank += better(cv[j], ci[j], v, i);
    idx_out[rank] = i;
    val_out[rank] = v;
  }
}

// One block per row.
__global__ void __launch_bounds__(kSelThreads)
top_k_kernel(const float* __restrict__ logits, int n_vocab, int k, int32_t* idx_out, float* val_out) {
  griddep_release();
  griddep_wait();
  const float* x = logits + size_t(blockIdx.x) * n_vocab;
  block_top_k(n_vocab, k, [&](int i) { return x[i]; }, [](int i) { return i; }, idx_out + size_t(blockIdx.x) * k,
              val_out + size_t(blockIdx.x) * k);
}

// Block (s, r) takes slice s of row r: its k best (fewer when the slice is shorter: the rest
// (NaN, INT32_MAX), which ranks after everything) go to the row's candidates, slice after slice.
// The block that finishes a row last (counters[r]) selects the row's k best from the candidates
// (every one of them is among its slice's k best) and resets the counter. As top_k_kernel: the
// candidates of equal value stand in index order (slices in order, each best first, ties by index).
__global__ void __launch_bounds__(kSelThreads)
top_k_split_kernel(const float* __restrict__ logits, int n_vocab, int chunk, int k, int32_t* cand_idx, float* cand_val,
                   uint32_t* counters, int32_t* idx_out, float* val_out) {
  __shared__ bool last;
  griddep_release();
  griddep_wait();
  const int s = blockIdx.x, r = blockIdx.y, n_split = gridDim.x;
  const int begin = s * chunk, len = min(n_vocab, begin + chunk) - begin, ks = min(k, len);
  const float* x = logits + size_t(r) * n_vocab + begin;
  int32_t* ri = cand_idx + (size_t(r) * n_split + s) * k;
  float* rv = cand_val + (size_t(r) * n_split + s) * k;
  block_top_k(len, ks, [&](int i) { return x[i]; }, [&](int i) { return begin + i; }, ri, rv);
  for (int j = ks + int(threadIdx.x); j < k; j += blockDim.x) {
    ri[j] = INT32_MAX;
    rv[j] = __int_as_float(0x7fc00000);  // NaN
  }
  __threadfence();  // every thread's candidates are visible on the device before the count says so
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&counters[r], 1u) == uint32_t(n_split - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int32_t* ai = cand_idx + size_t(r) * n_split * k;  // other blocks wrote them: from the L2
  const float* av = cand_val + size_t(r) * n_split * k;
  block_top_k(n_split * k, k, [&](int i) { return __ldcg(av + i); }, [&](int i) { return __ldcg(ai + i); },
              idx_out + size_t(r) * k, val_out + size_t(r) * k);
  if (threadIdx.x == 0) counters[r] = 0;  // for the next launch
}

}  // namespace

static size_t argmax_scratch_bytes(int n_vocab, int n) {
  const int64_t chunk = int64_t(kArgmaxLoads) * kSliceThreads;
  const int64_t split = (int64_t(n_vocab) + chunk - 1) / chunk;
  return split > 1 && n <= Context::kCounters ? size_t(split) * size_t(n) * sizeof(float2) : 0;
}

void argmax(Context& c, const float* logits, int n_vocab, int n, int32_t* out) {
  if (n <= 0) return;
  if (n_vocab <= 0) input_error(cat("CUDA argmax: empty rows (n_vocab ", n_vocab, ")"));
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  // Rows longer than one pass of a slice's block (2048 values) take a block per 2048-value slice.
  const size_t part = argmax_scratch_bytes(n_vocab, n);
  if (part == 0) {
    launch_early(c.early_launch, argmax_kernel, n, kSelThreads, s, logits, n_vocab, out);
  } else {
    const int chunk = kArgmaxLoads * kSliceThreads;
    const dim3 grid(ceil_div(n_vocab, chunk), unsigned(n));
    launch_early(c.early_launch, argmax_split_kernel, grid, kSliceThreads, s, logits, n_vocab, chunk,
                 static_cast<float2*>(c.scratch(part)), c.counters(), out);
  }
  CUDA_CHECK_LAUNCH();
}

// Slices of long rows for top_k: kTopKChunk values each (a few passes of a block; the merge reads
// n_split * k candidates).
constexpr int kTopKChunk = 16384;
static int top_k_split(int n_vocab, int n, int k) {
  const int split = int(ceil_div(n_vocab, kTopKChunk));
  return split > 1 && n <= Context::kCounters && int64_t(split) * k < n_vocab ? split : 1;
}

size_t sampling_scratch_bytes(int n_vocab, int n, int k) {
  const int split = top_k_split(n_vocab, n, k);
  const size_t top = split > 1 ? size_t(split) * size_t(n) * size_t(k) * (sizeof(int32_t) + sizeof(float)) : 0;
  return std::max(top, argmax_scratch_bytes(n_vocab, n));
}

void top_k(Context& c, const float* logits, int n_vocab, int n, int k, int32_t* idx, float* val) {
  if (k < 1 || k > kMaxTopK || k > n_vocab)
    input_error(cat("CUDA top_k: k = ", k, " must be within 1..", std::min(kMaxTopK, n_vocab)));
  if (n <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  const int split = top_k_split(n_vocab, n, k);
  if (split == 1) {
    launch_early(c.early_launch, top_k_kernel, n, kSelThreads, s, logits, n_vocab, k, idx, val);
  } else {
    const size_t m = size_t(split) * size_t(n) * size_t(k);
    auto* cand = static_cast<uint8_t*>(c.scratch(m * (sizeof(int32_t) + sizeof(float))));
    launch_early(c.early_launch, top_k_split_kernel, dim3(unsigned(split), unsigned(n)), kSelThreads, s, logits, n_vocab,
                 kTopKChunk, k, reinterpret_cast<int32_t*>(cand), reinterpret_cast<float*>(cand + m * sizeof(int32_t)),
                 c.counters(), idx, val);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace baton::cuda
