// CUDA device discovery. Compiled whenever the CUDA backend is on, so toolchain breakage shows early.
#include <algorithm>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/device_info.h"
#include "kernels/cuda/ops.h"

namespace baton::cuda {

namespace {

// Free bytes on the current device, 0 on failure.
uint64_t free_now() {
  size_t free_b = 0, total_b = 0;
  return cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? uint64_t(free_b) : 0;
}

// The memory a stage's stream, cuBLAS handle with its workspace (set up as Context does) and its
// first GEMM take on the current device (the objects are released again). 0 when something
// failed (the estimate is used then).
uint64_t measure_runtime_bytes(int cc_major) {
  const uint64_t before = free_now();
  if (before == 0) return 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t h = nullptr;
  __half* buf = nullptr;
  void* workspace = nullptr;
  const size_t ws = cublas_workspace_bytes(cc_major);
  uint64_t used = 0;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess && cublasCreate(&h) == CUBLAS_STATUS_SUCCESS &&
      cublasSetStream(h, stream) == CUBLAS_STATUS_SUCCESS && cudaMalloc(&workspace, ws) == cudaSuccess &&
      cublasSetWorkspace(h, workspace, ws) == CUBLAS_STATUS_SUCCESS &&
      cudaMalloc(&buf, 3 * 64 * 64 * sizeof(__half)) == cudaSuccess &&
      cudaMemsetAsync(buf, 0, 3 * 64 * 64 * sizeof(__half), stream) == cudaSuccess) {
    const float alpha = 1.0f, beta = 0.0f;
    float* c = reinterpret_cast<float*>(buf + 2 * 64 * 64);  // 64 x 32 floats in the last third
    if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, 64, 32, 64, &alpha, buf, CUDA_R_16F, 64, buf + 64 * 64, CUDA_R_16F,
                     64, &beta, c, CUDA_R_32F, 64, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS &&
        cudaStreamSynchronize(stream) == cudaSuccess) {
      const uint64_t after = free_now();
      const uint64_t mine = 3 * 64 * 64 * sizeof(__half);
      if (after > 0 && after <= before) used = before - after > mine ? before - after - mine : 0;
    }
  }
  if (buf) cudaFree(buf);
  if (h) cublasDestroy(h);
  if (workspace) cudaFree(workspace);
  if (stream) cudaStreamDestroy(stream);
  cudaGetLastError();  // a failed measurement leaves no sticky error behind
  return used;
}

}  // namespace

// 16 bytes as nvidia-smi writes a GPU's UUID: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
static std::string format_uuid(const unsigned char* b) {
  static const char hex[] = "0123456789abcdef";
  std::string s = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += hex[b[i] >> 4];
    s += hex[b[i] & 15];
  }
  return s;
}

std::vector<DeviceInfo> list_devices() {
  std::vector<DeviceInfo> out;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return out;
  }
  for (int i = 0; i < n; i++) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    DeviceInfo d;
    d.index = i;
    d.name = p.name;
    d.cc_major = p.major;
    d.cc_minor = p.minor;
    d.total_bytes = p.totalGlobalMem;
    d.uuid = format_uuid(reinterpret_cast<const unsigned char*>(p.uuid.bytes));
    if (cudaSetDevice(i) == cudaSuccess && cudaFree(nullptr) == cudaSuccess) {  // the context, then measure
      d.runtime_bytes = measure_runtime_bytes(p.major);
      d.free_bytes = free_now();
    }
    out.push_back(d);
  }
  return out;
}

}  // namespace baton::cuda

namespace baton::cuda {
namespace {

// The best of 3 timed runs (after one warm-up) of copy(), in milliseconds; 0 when it failed.
template <class F>
double best_ms(cudaStream_t stream, F copy, std::string& error) {
  cudaEvent_t a = nullptr, b = nullptr;
  if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) {
    error = cudaGetErrorString(cudaGetLastError());
    if (a) cudaEventDestroy(a);
    return 0;
  }
  float best_ms = 0;
  for (int run = 0; run < 4; run++) {
    cudaEventRecord(a, stream);
    const cudaError_t e = copy();
    cudaEventRecord(b, stream);
    if (e != cudaSuccess || cudaEventSynchronize(b) != cudaSuccess) {
      error = cudaGetErrorString(e != cudaSuccess ? e : cudaGetLastError());
      best_ms = 0;
      break;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (run > 0 && ms > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best_ms;
}

// Bandwidth (GB/s) of a copy of `bytes` and latency (µs) of a copy of `small` bytes.
template <class F>
void time_path(size_t bytes, size_t small, cudaStream_t stream, F copy, double& gbs, double& us, std::string& error) {
  const double ms = best_ms(stream, [&] { return copy(bytes); }, error);
  gbs = ms > 0 ? double(bytes) / (ms * 1e-3) / 1e9 : 0;
  us = best_ms(stream, [&] { return copy(small); }, error) * 1e3;
}

LinkInfo measure(int from, int to, size_t bytes) {
  LinkInfo l;
  l.from = from;
  l.to = to;
  int can = 0;
  if (from == to) l.peer_access = true;  // two stages on one GPU: a device-to-device copy
  else if (cudaDeviceCanAccessPeer(&can, to, from) == cudaSuccess) l.peer_access = can != 0;
  cudaGetLastError();
  const size_t small = std::min<size_t>(bytes, 16 << 10);  // one token's hidden state of a large model
  void *src = nullptr, *dst = nullptr, *host = nullptr;
  cudaStream_t stream = nullptr;
  auto check = [&](cudaError_t e) {
    if (e != cudaSuccess && l.error.empty()) l.error = cudaGetErrorString(e);
    return e == cudaSuccess;
  };
  if (check(cudaSetDevice(from)) && check(cudaMalloc(&src, bytes)) && check(cudaMemset(src, 1, bytes)) &&
      check(cudaSetDevice(to)) && check(cudaMalloc(&dst, bytes)) && check(cudaStreamCreate(&stream)) &&
      check(cudaMallocHost(&host, bytes))) {
    if (l.peer_access) {
      if (from != to) {
        const cudaError_t e = cudaDeviceEnablePeerAccess(from, 0);  // lets `to` read `from`'s memory
        if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
        else check(e);
      }
      time_path(bytes, small, stream, [&](size_t n) { return cudaMemcpyPeerAsync(dst, to, src, from, n, stream); },
                l.p2p_gbs, l.p2p_us, l.error);
    }
    // Host-staged: both halves on one stream, as a link without peer access moves a hidden state.
    time_path(bytes, small, stream, [&](size_t n) {
      const cudaError_t e = cudaMemcpyAsync(host, src, n, cudaMemcpyDeviceToHost, stream);
      return e != cudaSuccess ? e : cudaMemcpyAsync(dst, host, n, cudaMemcpyHostToDevice, stream);
    }, l.staged_gbs, l.staged_us, l.error);
  }
  if (host) cudaFreeHost(host);
  if (stream) cudaStreamDestroy(stream);
  if (dst) { cudaSetDevice(to); cudaFree(dst); }
  if (src) { cudaSetDevice(from); cudaFree(src); }
  cudaGetLastError();
  return l;
}

}  // namespace

double copy_bandwidth_gbs(int device, size_t bytes) {
  void *a = nullptr, *b = nullptr;
  cudaStream_t stream = nullptr;
  std::string error;
  double gbs = 0;
  if (cudaSetDevice(device) == cudaSuccess && cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess &&
      cudaMemset(a, 1, bytes) == cudaSuccess && cudaStreamCreate(&stream) == cudaSuccess) {
    const double ms = best_ms(stream, [&] { return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream); }, error);
    gbs = ms > 0 ? 2.0 * double(bytes) / (ms * 1e-3) / 1e9 : 0;
  }
  if (stream) cudaStreamDestroy(stream);
  if (a) cudaFree(a);
  if (b) cudaFree(b);
  cudaGetLastError();
  return gbs;
}

std::vector<LinkInfo> measure_links(size_t bytes) {
  std::vector<LinkInfo> out;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return out;
  }
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) out.push_back(measure(i, j, bytes));  // i == j: two stages on one GPU
  return out;
}

}  // namespace baton::cuda
