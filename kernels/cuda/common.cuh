// Shared by every .cu file of the CUDA backend: error checks that name the failing call and the
// device, and small device helpers (warp reductions, fp16/bf16 loads).
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "kernels/cuda/errors.h"
#include "quant/blocks.h"  // plain packed structs: compile under nvcc as under g++

namespace baton::cuda {

template <class... A>
std::string cat(const A&... a) {
  std::ostringstream o;
  (o << ... << a);
  return o.str();
}

}  // namespace baton::cuda

#define CUDA_CHECK(call)                                                                      \
  do {                                                                                        \
    const cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess)                                                                  \
      ::baton::cuda::cuda_fail(#call, __FILE__, __LINE__, int(err_), cudaGetErrorString(err_)); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                    \
  do {                                                                                        \
    const cublasStatus_t st_ = (call);                                                        \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ::baton::cuda::cuda_fail(#call, __FILE__, __LINE__, int(st_),                           \
                               ::baton::cuda::cublas_status_name(st_));                       \
  } while (0)

// Internal invariant (as BATON_CHECK in gguf/error.h, which .cu files cannot include).
namespace baton { [[noreturn]] void panic(const char* file, int line, const std::string& msg); }
#define CUDA_ASSERT(cond) \
  do { if (!(cond)) ::baton::panic(__FILE__, __LINE__, "check failed: " #cond); } while (0)

// After a kernel launch: catches bad launch configurations at the launch site.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace baton::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// V consecutive floats (V = 4: one 16-byte access, p 16-byte aligned; or V = 1).
template <int V>
__device__ __forceinline__ void load_v(const float* p, float (&v)[V]) {
  static_assert(V == 1 || V == 4);
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
    v[0] = *p;
  }
}
template <int V>
__device__ __forceinline__ void store_v(float* p, const float (&v)[V]) {
  static_assert(V == 1 || V == 4);
  if constexpr (V == 4) *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  else *p = v[0];
}

// The 8-bit grid of the integer paths for V consecutive values per lane, 32 / V lanes (the first
// at a multiple of 32 values) to a block: d = max|x| / 127, q = round(x / d), ties to even (a max:
// the same grid however the lanes hold the block). Every lane of the warp calls it (the max
// shuffles the whole warp). The GEMM's FP16 activations take q * d.
template <int V>
__device__ __forceinline__ float q8_grid(const float (&v)[V], int (&q)[V]) {
  static_assert(V == 1 || V == 4);
  constexpr int G = 32 / V;  // lanes per block of 32 values
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < V; e++) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o));
  const float d = amax / 127.0f;
#pragma unroll
  for (int e = 0; e < V; e++) q[e] = amax > 0.0f ? __float2int_rn(v[e] / d) : 0;
  return d;
}

// quantize_act's 8-bit activations of v[e] at flat index i0 + e (the grid above, d and d·Σq per
// block; an integer sum, so the same bytes however the lanes hold them); `live` false: a lane past
// the end, whose whole group of 32 / V lanes is past it, stores nothing. V = 4: three shuffle
// rounds per reduction instead of five, one 4-byte store of quants.
template <int V>
__device__ __forceinline__ void q8_store_v(const float (&v)[V], int64_t i0, bool live, int8_t* __restrict__ qs,
                                           float2* __restrict__ ds) {
  constexpr int G = 32 / V;
  int q[V], sum = 0;
  const float d = q8_grid<V>(v, q);
#pragma unroll
  for (int e = 0; e < V; e++) sum += q[e];
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
  if (!live) return;
  if constexpr (V == 4) *reinterpret_cast<char4*>(qs + i0) = make_char4(q[0], q[1], q[2], q[3]);
  else qs[i0] = int8_t(q[0]);
  if (threadIdx.x % G == 0) ds[i0 / 32] = make_float2(d, d * float(sum));
}

// One value per lane: a warp holds 32 consecutive values, starting at a multiple of 32.
__device__ __forceinline__ void q8_store(float v, int64_t i, int8_t* __restrict__ qs, float2* __restrict__ ds) {
  const float a[1] = {v};
  q8_store_v<1>(a, i, true, qs, ds);
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and in the simulator, which runs the
// kernels of a stream one after the other). A kernel launched with launch_early() may start before
// the kernel ahead of it on the stream has finished: griddep_wait() blocks until that kernel is
// done and its writes are visible, so nothing it writes may be read, and nothing it reads may be
// written, before the call. griddep_release() (early in a kernel) lets such a dependent launch.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Asks the L2 for the 128-byte line holding p (no register waits for it; a no-op in the simulator).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// kernel<<<grid, block, 0, s>>>(args...), as a programmatic dependent launch when `early` (see
// above: the kernel must call griddep_wait() before it touches its predecessor's data).
template <class... P, class... A>
void launch_early(bool early, void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t s, A... args) {
#ifdef __CUDA_SIM__
  (void)early;
  kernel<<<grid, block, 0, s>>>(args...);
#else
  if (!early) {
    kernel<<<grid, block, 0, s>>>(args...);
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
#endif
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // part[] may still be read by a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nw ? part[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float half_bits_to_float(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(uint32_t(b) << 16);
}

// Gemma 2's attention soft-cap: a score s becomes cap·tanh(s / cap); cap 0 leaves it.
__device__ __forceinline__ float softcap_score(float s, float cap) { return cap > 0.0f ? cap * tanhf(s / cap) : s; }

// The denominator of an attention output accumulated against its online softmax's final max m and
// sum l: l; with gpt-oss's attention sink of head h (sinks: n_head floats or null), one more logit
// that takes probability mass and adds no value, l + e^(sink − m). That is the sink's term at the
// scores' max instead of the joint max M = max(m, sink): acc·c / (l·c + e^(sink − M)) with
// c = e^(m − M) is acc / (l + e^(sink − m)), and a term that overflows to inf gives 0, the limit.
// Applied once per head, when it is finished (as cpu::attention).
__device__ __forceinline__ float softmax_denom(float m, float l, const float* sinks, int h) {
  return sinks ? l + expf(sinks[h] - m) : l;
}

// The rotation of pair (a, b) by the angle with cosine c and sine s: (a·c − b·s, a·s + b·c), each
// product rounded before the sum (never fused), so that every kernel that rotates gets the same bits.
__device__ __forceinline__ float2 rotate_pair(float a, float b, float c, float s) {
  return make_float2(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)), __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)));
}

// RoPE: pair i of a head is elements (2i, 2i + 1), or (i, i + half) NeoX-style, rotated by the
// angle pos · freq (taken in double, as on the CPU) and multiplied by mscale (1 but for LongRoPE's
// attention factor: cos and sin times mscale, as cpu::rope_angles). Returns the pair's new values.
__device__ __forceinline__ float2 rope_rotate(const float* head, int i, int half, bool neox, int pos, float freq,
                                              float mscale, int& i0, int& i1) {
  i0 = neox ? i : 2 * i;
  i1 = neox ? i + half : 2 * i + 1;
  double sd, cd;
  sincos(double(pos) * double(freq), &sd, &cd);
  return rotate_pair(head[i0], head[i1], __fmul_rn(float(cd), mscale), __fmul_rn(float(sd), mscale));
}
__device__ __forceinline__ void rope_in_place(float* head, int i, int half, bool neox, int pos, float freq,
                                              float mscale) {
  int i0, i1;
  const float2 r = rope_rotate(head, i, half, neox, pos, freq, mscale, i0, i1);
  head[i0] = r.x;
  head[i1] = r.y;
}

// Element e of a head after RoPE (e ≥ rope_dim: as it is): the rotated value of e's pair, computed
// from the unrotated head (which stays as it is), the same bits as rope_in_place.
__device__ __forceinline__ float rope_value(const float* head, int e, int rope_dim, bool neox, int pos,
                                            const float* freqs, float mscale) {
  if (e >= rope_dim) return head[e];
  const int half = rope_dim / 2, i = neox ? e % half : e / 2;  // e's pair, and e its first or second element
  int i0, i1;
  const float2 r = rope_rotate(head, i, half, neox, pos, freqs[i], mscale, i0, i1);
  return e == i0 ? r.x : r.y;
}

// KV cache rows (F16 or Q8_0), as cpu::kv_convert writes them. F16: element e of `row`.
__device__ __forceinline__ void kv_store_f16(uint8_t* row, int e, float x) {
  reinterpret_cast<__half*>(row)[e] = __float2half_rn(x);
}
// Q8_0: value x of element blk * 32 + lane of `row`; the whole warp holds the block, d = max|x|/127
// stored as fp16, the same arithmetic as the CPU's quantizer (byte-identical blocks). Blocks are 34
// bytes, so 2-byte aligned (the callers check the rows): written in 16-bit words, the scale by
// lane 0 and each pair of codes by the even lane. (Byte stores of the scale read back with its low
// byte 0 on an H200, CUDA 13.0: every block wrong.)
__device__ __forceinline__ void kv_store_q8(uint8_t* row, int blk, int lane, float x) {
  const float amax = warp_max(fabsf(x));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  uint16_t* o = reinterpret_cast<uint16_t*>(row + size_t(blk) * sizeof(BlockQ8_0));
  const int q = int(fminf(127.0f, fmaxf(-127.0f, roundf(x * id))));  // half away from zero, as quant/quantize.cpp
  const int q_next = __shfl_down_sync(kFullMask, q, 1);
  if (lane % 2 == 0) o[1 + lane / 2] = uint16_t((q & 0xFF) | ((q_next & 0xFF) << 8));
  if (lane == 0) o[0] = __half_as_ushort(__float2half_rn(d));
}

inline unsigned ceil_div(int64_t a, int64_t b) { return unsigned((a + b - 1) / b); }

}  // namespace baton::cuda
