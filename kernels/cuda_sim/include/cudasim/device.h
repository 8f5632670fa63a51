// The CUDA simulator's device side: built-in variables, intrinsics and the launch object that
// the rewritten `k<<<...>>>(args)` calls. Included by the stand-in cuda_runtime.h.
#pragma once
#include <stdint.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// Built-in variables of the GPU thread that is running (the simulator runs one at a time).
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
constexpr int warpSize = 32;

namespace cudasim {

enum class WarpOp { Xor, Idx, Down, Up, Ballot };

// Block barrier (at `file`:`line`) and warp exchange: the calling fiber waits until its block (or
// the lanes of `mask`) arrive, then gets the value of the lane the op names. Divergent use aborts with the
// kernel, block and thread named.
void syncthreads(const char* file, int line);
uint64_t warp_exchange(WarpOp op, unsigned mask, uint64_t value, int param, int width);

// Called after each `__shared__` declaration (added by cmake/cudasim_rewrite.cmake): the first
// thread of a block to pass it fills the variable with 0xFF bytes (NaN as F32, -1 as int), so
// that shared memory read before the block wrote it shows up.
void shared_declared(void* p, size_t bytes);

template <class T>
T warp_value(WarpOp op, unsigned mask, T v, int param, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type over 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  b = warp_exchange(op, mask, b, param, width);
  T r;
  std::memcpy(&r, &b, sizeof(T));
  return r;
}

// One kernel launch as the runtime queues it. `pointers`: the launch's pointer arguments, which
// must be null or memory the launching device can reach.
struct Launch {
  const char* name;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  std::function<void()> thread_body;  // one GPU thread: the kernel called with the launch's arguments
  std::vector<const void*> pointers;
};
void enqueue(Launch&& l);

template <class F>
struct Launcher;

template <class... P>
struct Launcher<void (*)(P...)> {
  void (*kernel)(P...);
  const char* name;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;

  template <class... A>
  void operator()(A&&... a) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
    // Arguments are copied at launch, as the driver copies them into the launch's parameter space.
    auto args = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(a)...);
    std::vector<const void*> ptrs;
    std::apply([&](const auto&... v) { (add_pointer(ptrs, v), ...); }, *args);
    auto k = kernel;
    enqueue(Launch{name, grid, block, smem, stream, [k, args] { std::apply(k, *args); }, std::move(ptrs)});
  }

 private:
  template <class V>
  static void add_pointer(std::vector<const void*>& out, const V& v) {
    if constexpr (std::is_pointer_v<V>) out.push_back(static_cast<const void*>(v));
  }
};

template <class... P>
Launcher<void (*)(P...)> launch(void (*kernel)(P...), const char* name, dim3 grid, dim3 block, size_t smem = 0,
                                cudaStream_t stream = nullptr) {
  return {kernel, name, grid, block, smem, stream};
}

}  // namespace cudasim

// ---- intrinsics ----
// A macro, so that the simulator knows which barrier each thread waits at.
#define __syncthreads() ::cudasim::syncthreads(__FILE__, __LINE__)
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return cudasim::warp_value(cudasim::WarpOp::Xor, mask, v, lane_mask, width);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return cudasim::warp_value(cudasim::WarpOp::Idx, mask, v, src_lane, width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return cudasim::warp_value(cudasim::WarpOp::Down, mask, v, int(delta), width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return cudasim::warp_value(cudasim::WarpOp::Up, mask, v, int(delta), width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return unsigned(cudasim::warp_exchange(cudasim::WarpOp::Ballot, mask, pred != 0, 0, 32));
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }

template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
// Blocks run one after another: every write is visible to the blocks after it.
inline void __threadfence() {}

inline int __dp4a(int a, int b, int c) {  // four signed byte products
  for (int i = 0; i < 4; i++) c += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
  return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
  for (int i = 0; i < 4; i++) c += ((a >> (8 * i)) & 0xFF) * ((b >> (8 * i)) & 0xFF);
  return c;
}
inline unsigned __vsub4(unsigned a, unsigned b) {  // per-byte wrap-around subtraction
  unsigned r = 0;
  for (int i = 0; i < 4; i++) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xFFu) << (8 * i);
  return r;
}
// Byte n of the result: byte ((s >> 4n) & 7) of the pool x (bytes 0..3), y (bytes 4..7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long pool = x | (static_cast<unsigned long long>(y) << 32);
  unsigned r = 0;
  for (int n = 0; n < 4; n++) r |= unsigned((pool >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline int __float2int_rn(float f) { return int(std::nearbyint(f)); }  // default mode: to nearest even
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }  // rounded, never fused
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
// CUDA's device min/max overloads (integers and floats).
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
using std::isnan;
using std::isinf;

// Blocks run one at a time and so do their threads: an atomic is a read-modify-write. Built with
// ThreadSanitizer (BATON_TSAN, the race check of fibers.cpp) it is done as an atomic operation,
// so that TSan does not take two threads' atomics on one address for a race; it orders nothing.
namespace cudasim {
template <class T, class F>
inline T atomic_update(T* p, F f) {
#if defined(__SANITIZE_THREAD__)
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics of 4 or 8 bytes");
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* q = reinterpret_cast<U*>(p);
  U seen = __atomic_load_n(q, __ATOMIC_RELAXED);
  for (;;) {
    T old, now;
    std::memcpy(&old, &seen, sizeof(T));
    now = f(old);
    U bits;
    std::memcpy(&bits, &now, sizeof(T));
    if (__atomic_compare_exchange_n(q, &seen, bits, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
  }
#else
  const T old = *p;
  *p = f(old);
  return old;
#endif
}
}  // namespace cudasim
template <class T>
inline T atomicAdd(T* p, T v) { return cudasim::atomic_update(p, [v](T o) { return T(o + v); }); }
template <class T>
inline T atomicMax(T* p, T v) { return cudasim::atomic_update(p, [v](T o) { return v > o ? v : o; }); }
template <class T>
inline T atomicMin(T* p, T v) { return cudasim::atomic_update(p, [v](T o) { return v < o ? v : o; }); }
template <class T>
inline T atomicExch(T* p, T v) { return cudasim::atomic_update(p, [v](T) { return v; }); }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
  return cudasim::atomic_update(p, [cmp, v](unsigned o) { return o == cmp ? v : o; });
}
inline int atomicCAS(int* p, int cmp, int v) {
  return cudasim::atomic_update(p, [cmp, v](int o) { return o == cmp ? v : o; });
}
