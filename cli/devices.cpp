// `baton devices`: what this machine offers (the CPU always, GPUs when built with CUDA).
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "runtime/devices.h"

namespace baton::cli {
namespace {

int run_devices(bool json, bool links) {
  const auto devs = probe_devices();
  const auto pairs = links ? probe_links() : std::vector<DeviceLink>{};
  if (json) {
    nlohmann::json j;
    j["cuda_backend"] = have_cuda_backend();
    j["devices"] = nlohmann::json::array();
    for (const auto& d : devs)
      j["devices"].push_back({{"kind", d.kind == DeviceKind::Cuda ? "cuda" : "cpu"}, {"index", d.index}, {"name", d.name},
                   {"total_bytes", d.total_bytes}, {"free_bytes", d.free_bytes},
                   {"compute_capability", d.kind == DeviceKind::Cuda ? fmt::format("{}.{}", d.cc_major, d.cc_minor) : std::string()},
                   {"runtime_bytes_measured", d.runtime_bytes},
                   {"runtime_reserve_bytes", d.kind == DeviceKind::Cuda ? cuda_runtime_reserve(d) : 0},
                   {"uuid", d.uuid}});
    j["links"] = nlohmann::json::array();
    for (const auto& l : pairs)
      j["links"].push_back({{"from", l.from}, {"to", l.to}, {"peer_access", l.peer_access}, {"p2p_gb_per_s", l.p2p_gbs},
                            {"host_staged_gb_per_s", l.staged_gbs}, {"p2p_latency_us", l.p2p_us},
                            {"host_staged_latency_us", l.staged_us}, {"error", l.error}});
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::fputs(format_devices(devs, pairs, have_cuda_backend()).c_str(), stdout);
  return 0;
}

Register reg{{"devices", "List the devices Baton can use: memory, compute capability, GPU-to-GPU copy paths",
              [](CLI::App& app) {
                auto json = std::make_shared<bool>(false);
                auto no_links = std::make_shared<bool>(false);
                app.add_flag("--json", *json, "Print as JSON");
                app.add_flag("--no-links", *no_links, "skip measuring the copy paths between GPUs");
                return [json, no_links] { return run_devices(*json, !*no_links); };
              }}};

}  // namespace
}  // namespace baton::cli
