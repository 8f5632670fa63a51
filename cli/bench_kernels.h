// `baton bench-kernels`: the CPU kernels (bench_kernels.cpp) and, with --device cuda:N, the CUDA
// matmuls (bench_kernels_cuda.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "quant/types.h"

namespace baton::cli {

// A rows × cols matrix of type t: a few MiB of properly quantized random rows, repeated.
std::vector<uint8_t> make_matrix(GgmlType t, int64_t rows, int64_t cols);

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
