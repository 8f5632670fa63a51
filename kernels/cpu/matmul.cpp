// Y = W·X on the CPU. First version: each thread dequantizes its rows with the scalar reference
// and takes float dot products. Correct for every compute type; the fast paths come next.
#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gguf/error.h"
#include "quant/quant.h"

namespace baton::cpu {

// ---- instruction-set selection ----

Isa detected_isa() {
  static const Isa isa = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
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

void matmul(const QMatrix& W, const float* X, int n, float* Y, ThreadPool& pool) {
  BATON_CHECK(n >= 1 && W.cols % traits(W.type).block_elems == 0);
  BATON_CHECK(W.row_bytes == row_bytes(W.type, W.cols));
  const int64_t rows = W.rows, cols = W.cols;
  constexpr int64_t kChunk = 16;
  const int n_tasks = int((rows + kChunk - 1) / kChunk);
  pool.run(n_tasks, [&](int task, int) {
    thread_local std::vector<float> buf;
    if (buf.size() < size_t(cols)) buf.resize(size_t(cols));
    const int64_t r0 = task * kChunk, r1 = std::min(rows, r0 + kChunk);
    for (int64_t r = r0; r < r1; r++) {
      dequantize_row(W.type, W.row(r), buf.data(), cols);
      for (int j = 0; j < n; j++) {
        const float* x = X + int64_t(j) * cols;
        float s = 0;
        for (int64_t k = 0; k < cols; k++) s += buf[size_t(k)] * x[k];
        Y[int64_t(j) * rows + r] = s;
      }
    }
  });
}

}  // namespace baton::cpu
