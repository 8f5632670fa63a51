// Error path of the CUDA backend, plain C++ (defined in errors.cpp).
#pragma once
#include <string>

#if !BATON_CUDA_HOST_EMULATION  // the host emulation (kernels/cuda_host) has no CUDA headers
#include <cublas_api.h>
#endif

namespace baton::cuda {

// nvcc cannot compile fmt (gguf/error.h), so .cu files raise baton::Error through these
// functions, defined in errors.cpp. input_error: ErrorKind::Model; usage_error: ErrorKind::Usage;
// oom_error: ErrorKind::OutOfMemory. cuda_fail names the call, the current device and CUDA's
// own message.
[[noreturn]] void input_error(const std::string& msg);
[[noreturn]] void usage_error(const std::string& msg);
[[noreturn]] void oom_error(const std::string& msg);
#if !BATON_CUDA_HOST_EMULATION
[[noreturn]] void cuda_fail(const char* call, const char* file, int line, int code, const char* what);
const char* cublas_status_name(cublasStatus_t s);
#endif

}  // namespace baton::cuda
