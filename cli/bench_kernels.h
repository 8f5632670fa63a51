// `baton bench-kernels`: the CPU kernels (bench_kernels.cpp) and, with --device cuda:N, the CUDA
// matmuls (bench_kernels_cuda.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace baton::cli {

struct CudaKernelBench {
  int device = 0;
  std::vector<std::string> types;  // weight type names; checked against cuda_supports
  int64_t rows = 14336, cols = 4096;
  int mib = 512;   // the copies of the matrix add up to at least this much
  int reps = 20;   // sweeps per timed round
  bool json = false;
};
int run_cuda_kernel_bench(const CudaKernelBench& o);

}  // namespace baton::cli
