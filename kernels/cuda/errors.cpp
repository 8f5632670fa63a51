// The CUDA backend's error path, in plain C++ because nvcc cannot compile fmt: every failing
// CUDA or cuBLAS call becomes a baton::Error naming the call, the device and CUDA's message.
#if !BATON_CUDA_HOST_EMULATION  // also built, without CUDA, for the host emulation (kernels/cuda_host)
#include <cuda_runtime.h>
#endif

#include "gguf/error.h"
#include "kernels/cuda/errors.h"

namespace baton::cuda {

void input_error(const std::string& msg) { throw Error(ErrorKind::Model, msg); }
void usage_error(const std::string& msg) { throw Error(ErrorKind::Usage, msg); }
void oom_error(const std::string& msg) { throw Error(ErrorKind::OutOfMemory, msg); }

#if !BATON_CUDA_HOST_EMULATION
void cuda_fail(const char* call, const char* file, int line, int code, const char* what) {
  int dev = -1;
  cudaGetDevice(&dev);
  cudaGetLastError();  // a failed call may leave a non-sticky error behind
  fail(ErrorKind::Model, "CUDA error on device {}: {} failed with {} ({}) at {}:{}", dev, call, what,
       code, file, line);
}

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
  }
}
#endif

}  // namespace baton::cuda
