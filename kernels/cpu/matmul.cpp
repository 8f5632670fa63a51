// Y = W·X on the CPU: ISA selection, activation quantization, and the one outer loop (rows split
// over the pool, columns in groups of 4) that drives the per-type kernels of the active table.
#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "gguf/error.h"
#include "kernels/cpu/matmul_multi.h"
#include "kernels/cpu/packed.h"
#include "kernels/cpu/qkernels.h"

namespace baton::cpu {

// ---- instruction-set selection ----

Isa detected_isa() {
  static const Isa isa = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
#ifdef BATON_AVX512_EMULATED  // the test build whose AVX-512 kernels run on SIMDe (avx512_emulated.h)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::Avx512;
#endif
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      return Isa::Avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::Avx2;
#endif
    return Isa::Scalar;
  }();
  return isa;
}

#if !defined(__x86_64__)
// Not an x86 CPU: dot_avx2.cpp and dot_avx512.cpp compile to nothing and detected_isa() never
// picks their levels; these tables only satisfy the linker (the scalar kernels).
const KernelTable& kernels_avx2() { return kernels_scalar(); }
const KernelTable& kernels_avx512() { return kernels_scalar(); }
#endif

namespace {
Isa env_limit() {
  const char* e = std::getenv("BATON_CPU_ISA");
  Isa v = Isa::Avx512;
  if (e && *e && !parse_isa(e, v)) fail(ErrorKind::Usage, "BATON_CPU_ISA={} is not one of scalar, avx2, avx512", e);
  return v;
}
std::atomic<int> g_limit{-1};  // -1: not set yet (read the environment on first use)
}  // namespace

Isa active_isa() {
  int lim = g_limit.load(std::memory_order_relaxed);
  if (lim < 0) {
    lim = int(env_limit());
    g_limit.store(lim, std::memory_order_relaxed);
  }
  const Isa d = detected_isa();
  return int(d) < lim ? d : Isa(lim);
}

void set_isa_limit(Isa limit) { g_limit.store(int(limit), std::memory_order_relaxed); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

bool parse_isa(const char* s, Isa& out) {
  if (!s) return false;
  if (!std::strcmp(s, "scalar")) out = Isa::Scalar;
  else if (!std::strcmp(s, "avx2")) out = Isa::Avx2;
  else if (!std::strcmp(s, "avx512")) out = Isa::Avx512;
  else return false;
  return true;
}

// ---- matmul ----

namespace {

const KernelTable& table_for(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return kernels_avx512();
    case Isa::Avx2: return kernels_avx2();
    case Isa::Scalar: break;
  }
  return kernels_scalar();
}

}  // namespace

namespace {

// Quantizes the n activation columns into the calling thread's scratch (which only grows).
const uint8_t* quantize_columns(const KernelTable& kt, ActKind kind, const float* X, int64_t cols, int n,
                                size_t a_stride, ThreadPool& pool) {
  if (kind == ActKind::Float) return reinterpret_cast<const uint8_t*>(X);
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < a_stride * size_t(n)) scratch.resize(a_stride * size_t(n));
  uint8_t* out = scratch.data();
  const QuantFn q = kt.quant[int(kind)];
  auto quant_col = [&](int j) { q(X + int64_t(j) * cols, cols, out + size_t(j) * a_stride); };
  auto quant_task = [&](int j, int) { quant_col(j); };
  if (n >= 4 && pool.size() > 1) pool.run(n, std::ref(quant_task));
  else for (int j = 0; j < n; j++) quant_col(j);
  return out;
}

}  // namespace

void run_rows(const RowFn& fn, int n, ThreadPool& pool) {
  auto task = [&](int j, int) { fn(j); };
  if (n >= 4 && pool.size() > 1) pool.run(n, std::ref(task));
  else for (int j = 0; j < n; j++) fn(j);
}

void matmul(const QMatrix& W, const float* X, int n, float* Y, ThreadPool& pool, const RowFn* pre) {
  BATON_CHECK(n >= 1 && W.cols % traits(W.type).block_elems == 0);
  BATON_CHECK(W.row_bytes == row_bytes(W.type, W.cols));
  const KernelTable& kt = table_for(active_isa());
  if (W.packed) {
    const MatmulTarget one{&W, Y};
    return matmul_packed_targets(&one, 1, X, n, pool, pre);
  }
  if (pre) run_rows(*pre, n, pool);
  BATON_CHECK(int(W.type) < kTypeSlots && kt.dot[int(W.type)] != nullptr);  // a compute type
  const int64_t rows = W.rows, cols = W.cols;
  const size_t y_stride = size_t(rows);

  const DotFn dot = kt.dot[int(W.type)];
  const ActKind kind = kt.act[int(W.type)];
  const size_t a_stride = act_bytes(kind, cols);
  const uint8_t* A = quantize_columns(kt, kind, X, cols, n, a_stride, pool);

  // Rows are split into chunks handed out dynamically. One column at a time streams the weights
  // (memory bound): chunks big enough for long sequential reads, enough of them to balance. With
  // many columns each chunk's weights stay in L2 while every group of 4 columns passes over them.
  int64_t chunk;
  if (n <= 4) {
    chunk = std::max<int64_t>(16, rows / (int64_t(pool.size()) * 8));
  } else {
    chunk = std::clamp<int64_t>(int64_t(64 * 1024 / std::max<size_t>(W.row_bytes, 1)), 4, 64);
    while (chunk > 4 && (rows + chunk - 1) / chunk < 4 * pool.size()) chunk /= 2;
  }
  const int n_tasks = int((rows + chunk - 1) / chunk);
  // Passed by std::ref so the std::function wraps a reference: no allocation per call.
  auto body = [&](int task, int) {
    const int64_t r0 = task * chunk, r1 = std::min(rows, r0 + chunk);
    for (int j = 0; j < n; j += 4) {
      const int nc = std::min(4, n - j);
      const uint8_t* a = A + size_t(j) * a_stride;
      for (int64_t r = r0; r < r1; r++) dot(cols, W.row(r), a, a_stride, nc, Y + size_t(j) * y_stride + size_t(r), y_stride);
    }
  };
  pool.run(n_tasks, std::ref(body));
}

}  // namespace baton::cpu
