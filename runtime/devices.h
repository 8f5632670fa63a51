// Devices are values. Probing reports what this machine has; parse_devices turns a `--devices`
// string into the ordered list of stage candidates the planner fills, each with a byte budget.
//
//   auto                         every CUDA GPU by free memory (largest first), then the CPU
//   cuda:0,cuda:1,cpu            explicit order; budgets default to free memory
//   cuda:0=20GiB,cpu=8GiB        explicit budgets
//   cpu=2GiB,cpu=2GiB            the same device twice: two stages (virtual devices)
//   cuda=24GiB,cuda=24GiB        hypothetical GPUs (planning only: `baton plan`)
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace baton {

enum class DeviceKind { Cpu, Cuda };

// What probing found on this machine.
struct ProbedDevice {
  DeviceKind kind = DeviceKind::Cpu;
  int index = 0;             // CUDA ordinal (after CUDA_VISIBLE_DEVICES); 0 for the CPU
  std::string name;          // "NVIDIA H100 80GB HBM3", "cpu"
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;   // CPU: MemAvailable; CUDA: cudaMemGetInfo after our context exists
  int cc_major = 0, cc_minor = 0;
  uint64_t runtime_bytes = 0;  // CUDA: a stage's stream + cuBLAS handle + workspace, measured (0: unknown)
  std::string uuid;            // CUDA: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it
};

// The CPU (always first in the list), then every visible GPU when built with CUDA.
std::vector<ProbedDevice> probe_devices();
// Total and available memory from /proc/meminfo (falls back to sysconf when it is unreadable).
ProbedDevice probe_cpu();
bool have_cuda_backend();  // compiled with CUDA
// Tests of a build without CUDA: BATON_CUDA_EMULATE=N shows N GPUs whose ops run on the host
// (kernels/cuda_host), so pipelines with GPU stages and links run in the CPU tests. Always false
// in a CUDA build.
bool cuda_emulated();

// A copy path between two GPUs (from -> to): whether peer access is possible and the measured
// bandwidth of a direct peer copy and of a copy staged through pinned host memory (GB/s, 0 when
// the path is not possible; error when a measurement failed).
struct DeviceLink {
  int from = 0, to = 0;
  bool peer_access = false;
  double p2p_gbs = 0;
  double staged_gbs = 0;
  double p2p_us = 0, staged_us = 0;  // latency of a 16 KiB copy
  std::string error;
};
// Every ordered pair of visible GPUs, each GPU with itself included (two stages on one GPU),
// measured now (copies of `bytes`); empty without CUDA or GPUs.
std::vector<DeviceLink> probe_links(size_t bytes = size_t(64) << 20);

// Memory bandwidth of CUDA device `index` from a device-to-device copy (read + write bytes per
// second, GB/s); 0 without CUDA or when it cannot be measured.
double gpu_copy_bandwidth_gbs(int index);

// The `baton devices` listing: one line per device (total / free memory, compute capability),
// then the GPU pairs' links, and a line saying why no GPU is listed when there is none.
std::string format_devices(const std::vector<ProbedDevice>& devices, const std::vector<DeviceLink>& links,
                           bool cuda_backend);

// Memory the CUDA runtime itself holds on a GPU, outside our tensors. For a present GPU the
// context already exists when free memory is measured, and probing measures what a stage's
// stream, cuBLAS handle and cuBLAS workspace take on top (ProbedDevice::runtime_bytes): that,
// rounded up to whole MiB plus 16 MiB for what the driver grows later (kernel images loaded on
// first launch), is the reserve. When the measurement failed, and for a hypothetical GPU, these
// estimates stand in (a hypothetical GPU also reserves one for the context out of its budget).
inline constexpr uint64_t kCudaWorkspaceReserve = 64ull << 20;
inline constexpr uint64_t kCudaContextEstimate = 512ull << 20;
inline constexpr uint64_t kCudaReserveMargin = 16ull << 20;
uint64_t cuda_runtime_reserve(const ProbedDevice& gpu);

// One entry of the device list: one pipeline stage candidate.
struct DeviceSpec {
  DeviceKind kind = DeviceKind::Cpu;
  int index = 0;                 // CUDA ordinal; -1 for a hypothetical `cuda` without one
  bool present = true;           // false: not on this machine (planning only)
  std::string label;             // "cpu", "cuda:0", "cuda" (hypothetical), for tables
  uint64_t budget = 0;           // bytes the plan may use on this entry, runtime reserve included
  uint64_t runtime_reserve = 0;  // part of the budget held by the runtime itself (see above)
  bool budget_given = false;     // budget came from the user (=SIZE)
  uint64_t total_bytes = 0;      // physical memory of the device; 0 when hypothetical
  uint64_t free_bytes = 0;       // free when probed; a budget above it is allowed but flagged

  bool is_gpu() const { return kind == DeviceKind::Cuda; }
};

// Parse a --devices string against the probed devices. allow_hypothetical: `cuda` without an
// index, or an index that is not present, is accepted when it has a budget (for `baton plan`).
// Entries without a budget split the device's free memory evenly between them. Throws
// Error(Usage) for unknown devices, malformed sizes, and budgets larger than the device.
std::vector<DeviceSpec> parse_devices(std::string_view spec, const std::vector<ProbedDevice>& probed,
                                      bool allow_hypothetical);

// "512MiB", "20GiB", "1.5GB", "1000000", "2K" -> bytes. Binary (KiB, MiB, GiB, TiB) and decimal
// (KB, MB, GB, TB; K/M/G/T alone are binary) units. Error(Usage) naming `what` on bad input.
uint64_t parse_size(std::string_view text, std::string_view what = "size");
// 1536 MiB -> "1.50 GiB": three significant digits, binary units.
std::string format_bytes(uint64_t bytes);

}  // namespace baton
