// `baton devices`: what this machine offers (the CPU always, GPUs when built with CUDA).
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "runtime/devices.h"

namespace baton::cli {
namespace {

int run_devices(bool json) {
  const auto devs = probe_devices();
  if (json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& d : devs)
      j.push_back({{"kind", d.kind == DeviceKind::Cuda ? "cuda" : "cpu"}, {"index", d.index}, {"name", d.name},
                   {"total_bytes", d.total_bytes}, {"free_bytes", d.free_bytes},
                   {"compute_capability", d.kind == DeviceKind::Cuda ? fmt::format("{}.{}", d.cc_major, d.cc_minor) : std::string()}});
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%-8s %-32s %11s %11s  %s\n", "device", "name", "total", "free", "compute");
  for (const auto& d : devs) {
    const std::string label = d.kind == DeviceKind::Cuda ? fmt::format("cuda:{}", d.index) : "cpu";
    const std::string cc = d.kind == DeviceKind::Cuda ? fmt::format("sm {}.{}", d.cc_major, d.cc_minor) : "-";
    std::printf("%-8s %-32s %11s %11s  %s\n", label.c_str(), d.name.c_str(), format_bytes(d.total_bytes).c_str(),
                format_bytes(d.free_bytes).c_str(), cc.c_str());
  }
  if (!have_cuda_backend()) std::printf("(this build has no CUDA backend: GPUs are not listed)\n");
  else if (devs.size() == 1) std::printf("(no CUDA GPU visible)\n");
  return 0;
}

Register reg{{"devices", "List the devices Baton can use, with total and free memory",
              [](CLI::App& app) {
                auto json = std::make_shared<bool>(false);
                app.add_flag("--json", *json, "Print as JSON");
                return [json] { return run_devices(*json); };
              }}};

}  // namespace
}  // namespace baton::cli
