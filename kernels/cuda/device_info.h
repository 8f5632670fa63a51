// What the CUDA runtime reports about each visible GPU (CUDA_VISIBLE_DEVICES honoured by the driver).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace baton::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;      // after our context exists (cudaMemGetInfo needs one)
  // What a stage's runtime objects take beyond the context, measured: free memory before and
  // after creating a stream and a cuBLAS handle and running one FP16 GEMM through it (cuBLAS
  // allocates its workspace on first use). 0 when the measurement failed.
  uint64_t runtime_bytes = 0;
  std::string uuid;  // as nvidia-smi -L prints it: "GPU-" and 32 hex digits in 8-4-4-4-12 groups
};

// Empty when the build has no CUDA, no driver is loaded or no GPU is visible.
std::vector<DeviceInfo> list_devices();

// The copy paths from one GPU to another: direct peer-to-peer (when the driver allows peer
// access) and staged through pinned host memory (device -> host -> device), each measured by
// copying `bytes` a few times (best run, GB/s = 1e9 bytes/s). 0 when a path is not possible or
// the measurement failed (error says why).
struct LinkInfo {
  int from = 0, to = 0;
  bool peer_access = false;
  double p2p_gbs = 0;
  double staged_gbs = 0;
  double p2p_us = 0, staged_us = 0;  // latency: a 16 KiB copy (one token's hidden state)
  std::string error;
};
// Device memory bandwidth of `device` as a copy measures it: a device-to-device cudaMemcpy of
// `bytes`, best of 3 after a warm-up, counting what it reads and what it writes (2·bytes per copy).
// 0 when the measurement failed (no memory, no device).
double copy_bandwidth_gbs(int device, size_t bytes = size_t(1) << 30);

// Every ordered pair of the visible GPUs, each GPU with itself too (two stages on one GPU: a
// device-to-device copy as its "P2P"); empty without GPUs.
std::vector<LinkInfo> measure_links(size_t bytes = size_t(64) << 20);

}  // namespace baton::cuda
