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
  uint64_t free_bytes = 0;
};

// Empty when the build has no CUDA, no driver is loaded or no GPU is visible.
std::vector<DeviceInfo> list_devices();

}  // namespace baton::cuda
