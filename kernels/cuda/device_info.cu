// CUDA device discovery. Compiled whenever the CUDA backend is on, so toolchain breakage shows early.
#include <cuda_runtime.h>

#include "kernels/cuda/device_info.h"

namespace baton::cuda {

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
    size_t free_b = 0, total_b = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      d.free_bytes = free_b;
    out.push_back(d);
  }
  return out;
}

}  // namespace baton::cuda

namespace baton::cuda {
namespace {

// Best of a few timed runs of `copy` on `stream` (one untimed warm-up), in GB/s.
template <class F>
double best_gbs(size_t bytes, cudaStream_t stream, F copy, std::string& error) {
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
  return best_ms > 0 ? double(bytes) / (double(best_ms) * 1e-3) / 1e9 : 0;
}

LinkInfo measure(int from, int to, size_t bytes) {
  LinkInfo l;
  l.from = from;
  l.to = to;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, to, from) == cudaSuccess) l.peer_access = can != 0;
  cudaGetLastError();
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
      const cudaError_t e = cudaDeviceEnablePeerAccess(from, 0);  // lets `to` read `from`'s memory
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else check(e);
      l.p2p_gbs = best_gbs(bytes, stream, [&] { return cudaMemcpyPeerAsync(dst, to, src, from, bytes, stream); }, l.error);
    }
    // Host-staged: both halves on one stream, as a link without peer access moves a hidden state.
    l.staged_gbs = best_gbs(bytes, stream, [&] {
      const cudaError_t e = cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream);
      return e != cudaSuccess ? e : cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream);
    }, l.error);
  }
  if (host) cudaFreeHost(host);
  if (stream) cudaStreamDestroy(stream);
  if (dst) { cudaSetDevice(to); cudaFree(dst); }
  if (src) { cudaSetDevice(from); cudaFree(src); }
  cudaGetLastError();
  return l;
}

}  // namespace

std::vector<LinkInfo> measure_links(size_t bytes) {
  std::vector<LinkInfo> out;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return out;
  }
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++)
      if (i != j) out.push_back(measure(i, j, bytes));
  return out;
}

}  // namespace baton::cuda
