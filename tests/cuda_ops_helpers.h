// Helpers shared by the two source files of test_cuda_ops (tests/test_cuda_ops.cpp: quantization,
// matmuls, norms, mixtures of experts, argmax and top-k; tests/cuda_ops_attention.cpp: rope,
// KV conversion and attention). Inline, so the executable has one Context and one thread pool.
// The no-GPU exit (77) is in tests/test_cuda_ops.cpp.
#pragma once
#include <cstddef>
#include <random>
#include <vector>

#include "kernels/cpu/threadpool.h"
#include "kernels/cuda/ops.h"

namespace baton::cuda_ops_test {

inline cuda::Context& ctx() {
  static cuda::Context c(0);
  return c;
}

inline cpu::ThreadPool& pool() {
  static cpu::ThreadPool p(4);
  return p;
}

template <class T>
cuda::DeviceBuffer to_dev(const std::vector<T>& v) {
  cuda::DeviceBuffer b(v.size() * sizeof(T));
  b.upload(v.data(), v.size() * sizeof(T));
  return b;
}

template <class T>
std::vector<T> to_host(const cuda::DeviceBuffer& b, size_t n) {
  ctx().synchronize();
  std::vector<T> v(n);
  b.download(v.data(), n * sizeof(T));
  return v;
}

template <class T>
std::vector<T> to_host_ptr(const void* p, size_t n) {
  std::vector<T> v(n);
  cuda::copy_to_host(ctx(), v.data(), p, n * sizeof(T));
  ctx().synchronize();
  return v;
}

inline std::vector<float> random_floats(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = d(rng);
    if (x == 0.0f) x = 0.5f * hi;  // never zeros
  }
  return v;
}

}  // namespace baton::cuda_ops_test
