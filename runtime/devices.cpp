#include "runtime/devices.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>

#include "gguf/error.h"
#if defined(BATON_HAVE_CUDA)
#include "kernels/cuda/device_info.h"
#else
#include "kernels/cuda/ops.h"  // the host emulation's device_count()
#endif

namespace baton {

bool have_cuda_backend() {
#if defined(BATON_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

bool cuda_emulated() {
#if defined(BATON_HAVE_CUDA)
  return false;
#else
  return cuda::device_count() > 0;
#endif
}

ProbedDevice probe_cpu() {
  ProbedDevice d;
  d.kind = DeviceKind::Cpu;
  d.name = "cpu";
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kb = 0;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemTotal:") d.total_bytes = kb * 1024;
    else if (key == "MemAvailable:") d.free_bytes = kb * 1024;
  }
  if (d.total_bytes == 0) {  // no /proc: ask the C library
    const long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) d.total_bytes = uint64_t(pages) * uint64_t(page);
    if (avail > 0 && page > 0) d.free_bytes = uint64_t(avail) * uint64_t(page);
  }
  if (d.free_bytes == 0 || d.free_bytes > d.total_bytes) d.free_bytes = d.total_bytes;
  return d;
}

uint64_t cuda_runtime_reserve(const ProbedDevice& gpu) {
  if (gpu.runtime_bytes == 0) return kCudaWorkspaceReserve;
  const uint64_t mib = 1ull << 20;
  return (gpu.runtime_bytes + mib - 1) / mib * mib + kCudaReserveMargin;
}

std::vector<ProbedDevice> probe_devices() {
  std::vector<ProbedDevice> out{probe_cpu()};
#if defined(BATON_HAVE_CUDA)
  for (const auto& g : cuda::list_devices()) {
    ProbedDevice d;
    d.kind = DeviceKind::Cuda;
    d.index = g.index;
    d.name = g.name;
    d.total_bytes = g.total_bytes;
    d.free_bytes = g.free_bytes;
    d.cc_major = g.cc_major;
    d.cc_minor = g.cc_minor;
    d.runtime_bytes = g.runtime_bytes;
    d.uuid = g.uuid;
    out.push_back(d);
  }
#else
  for (int i = 0; i < cuda::device_count(); ++i) {  // emulated (tests): 8 GiB each
    ProbedDevice d;
    d.kind = DeviceKind::Cuda;
    d.index = i;
    d.name = "host emulation (BATON_CUDA_EMULATE)";
    d.total_bytes = d.free_bytes = uint64_t(8) << 30;
    d.uuid = fmt::format("GPU-e0e0e0e0-e0e0-e0e0-e0e0-e0e0e0e0e0{:02x}", i);
    out.push_back(d);
  }
#endif
  return out;
}

std::vector<DeviceLink> probe_links(size_t bytes) {
  std::vector<DeviceLink> out;
#if defined(BATON_HAVE_CUDA)
  for (const auto& l : cuda::measure_links(bytes))
    out.push_back({l.from, l.to, l.peer_access, l.p2p_gbs, l.staged_gbs, l.p2p_us, l.staged_us, l.error});
#else
  (void)bytes;
#endif
  return out;
}

double gpu_copy_bandwidth_gbs(int index) {
#if defined(BATON_HAVE_CUDA)
  return cuda::copy_bandwidth_gbs(index);
#else
  (void)index;
  return 0;
#endif
}

std::string format_devices(const std::vector<ProbedDevice>& devices, const std::vector<DeviceLink>& links,
                           bool cuda_backend) {
  std::string out = fmt::format("{:<8} {:<32} {:>11} {:>11}  {:<8} {:<28} {}\n", "device", "name", "total", "free",
                                "compute", "runtime reserve", "uuid");
  size_t gpus = 0;
  for (const auto& d : devices) {
    const bool gpu = d.kind == DeviceKind::Cuda;
    gpus += gpu;
    const std::string reserve = !gpu ? "-"
                                : d.runtime_bytes ? fmt::format("{} (measured {})", format_bytes(cuda_runtime_reserve(d)),
                                                                format_bytes(d.runtime_bytes))
                                                  : fmt::format("{} (estimate)", format_bytes(cuda_runtime_reserve(d)));
    out += fmt::format("{:<8} {:<32} {:>11} {:>11}  {:<8} {:<28} {}\n", gpu ? fmt::format("cuda:{}", d.index) : "cpu",
                       d.name, format_bytes(d.total_bytes), format_bytes(d.free_bytes),
                       gpu ? fmt::format("sm {}.{}", d.cc_major, d.cc_minor) : "-", reserve,
                       gpu && !d.uuid.empty() ? d.uuid : "-");
  }
  if (!cuda_backend) out += "no CUDA devices: this build has no CUDA backend (build with -DBATON_CUDA=ON)\n";
  else if (gpus == 0) out += "no CUDA devices: none visible (no driver, no GPU, or CUDA_VISIBLE_DEVICES hides them)\n";
  if (!links.empty()) {
    // The link a pipeline builds between stages on these GPUs with --p2p auto, and both paths.
    out += fmt::format("\n{:<16} {:<13} {:>9} {:>8} {:>17} {:>15}\n", "stage link", "--p2p auto", "P2P GB/s",
                       "P2P us", "host-staged GB/s", "host-staged us");
    for (const auto& l : links) {
      const std::string gbs = l.peer_access ? fmt::format("{:.1f}", l.p2p_gbs) : "-";
      const std::string us = l.peer_access ? fmt::format("{:.1f}", l.p2p_us) : "-";
      out += fmt::format("{:<16} {:<13} {:>9} {:>8} {:>17.1f} {:>15.1f}{}\n", fmt::format("cuda:{} -> cuda:{}", l.from, l.to),
                         l.peer_access ? "peer-to-peer" : "host-staged", gbs, us, l.staged_gbs, l.staged_us,
                         l.error.empty() ? "" : "  (" + l.error + ")");
    }
  }
  return out;
}

// ---- sizes --------------------------------------------------------------------------------------

uint64_t parse_size(std::string_view text, std::string_view what) {
  auto bad = [&](const char* why) -> uint64_t {
    fail(ErrorKind::Usage, "{} '{}' is not a valid size ({}): use e.g. 512MiB, 20GiB, 1.5GB or a byte count", what,
         text, why);
  };
  size_t i = 0;
  while (i < text.size() && (std::isdigit((unsigned char)text[i]) || text[i] == '.')) i++;
  const std::string num(text.substr(0, i));
  std::string unit(text.substr(i));
  for (char& c : unit) c = char(std::tolower((unsigned char)c));
  if (num.empty() || std::count(num.begin(), num.end(), '.') > 1 || num == ".") return bad("no number");
  // 1e9, 1e30GiB: an exponent, which sizes do not take (the "e30GiB" was called an unknown unit).
  if (i + 1 < text.size() && (text[i] == 'e' || text[i] == 'E') &&
      (std::isdigit((unsigned char)text[i + 1]) || text[i + 1] == '+' || text[i + 1] == '-'))
    return bad("no exponents");
  struct Unit { const char* name; double mult; };
  static const Unit units[] = {
    {"", 1}, {"b", 1},
    {"k", 1024.0}, {"kib", 1024.0}, {"kb", 1e3},
    {"m", 1048576.0}, {"mib", 1048576.0}, {"mb", 1e6},
    {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
    {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12},
  };
  const Unit* u = nullptr;
  for (const Unit& x : units)
    if (unit == x.name) u = &x;
  if (!u) return bad("unknown unit");
  const bool integral = num.find('.') == std::string::npos;
  if (integral && u->mult == 1) {  // plain byte counts stay exact
    uint64_t v = 0;
    const auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
    if (ec != std::errc() || p != num.data() + num.size()) return bad("too large");
    return v;
  }
  const double v = std::strtod(num.c_str(), nullptr) * u->mult;
  if (!std::isfinite(v) || v >= 1.8e19) return bad("too large");
  if (u->mult == 1 && v != std::floor(v)) return bad("a fraction of a byte");
  return uint64_t(std::llround(v));
}

std::string format_bytes(uint64_t b) {
  static const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int k = 0;
  while (v >= 1024 && k < 4) { v /= 1024; k++; }
  if (k == 0) return fmt::format("{} B", b);
  return fmt::format("{:.{}f} {}", v, v >= 100 ? 0 : v >= 10 ? 1 : 2, names[k]);
}

// ---- --devices ----------------------------------------------------------------------------------

namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace((unsigned char)s[b])) b++;
  while (e > b && std::isspace((unsigned char)s[e - 1])) e--;
  return std::string(s.substr(b, e - b));
}

struct Entry {
  DeviceKind kind;
  int index;       // -1: no index given
  bool has_budget;
  uint64_t budget;
  std::string text;
  std::string uuid = {};  // a GPU named by (a unique start of) its UUID, lower case: "gpu-5a5a..."
};

Entry parse_entry(const std::string& text) {
  Entry e{DeviceKind::Cpu, -1, false, 0, text};
  std::string dev = text;
  if (const size_t eq = text.find('='); eq != std::string::npos) {
    dev = trim(text.substr(0, eq));
    e.has_budget = true;
    e.budget = parse_size(trim(text.substr(eq + 1)), fmt::format("budget of device '{}'", dev));
    if (e.budget == 0) fail(ErrorKind::Usage, "device '{}' has a budget of 0 bytes", text);
  }
  std::string lower = dev;
  for (char& c : lower) c = char(std::tolower((unsigned char)c));
  std::string name = lower, idx;
  if (const size_t colon = lower.find(':'); colon != std::string::npos) {
    name = lower.substr(0, colon);
    idx = lower.substr(colon + 1);
  }
  if (lower.starts_with("gpu-")) {  // a UUID, as nvidia-smi -L and CUDA_VISIBLE_DEVICES write it
    if (lower.size() == 4 || lower.find_first_not_of("0123456789abcdef-", 4) != std::string::npos)
      fail(ErrorKind::Usage, "device '{}': a GPU UUID is GPU- and hex digits, as `baton devices` or nvidia-smi -L shows it",
           text);
    e.kind = DeviceKind::Cuda;
    e.uuid = lower;
    return e;
  }
  if (name == "cpu") {
    if (!idx.empty()) fail(ErrorKind::Usage, "device '{}': the CPU takes no index (write 'cpu' or 'cpu=SIZE')", text);
    e.kind = DeviceKind::Cpu;
    e.index = 0;
  } else if (name == "cuda" || name == "gpu") {
    e.kind = DeviceKind::Cuda;
    if (lower.find(':') != std::string::npos) {
      if (idx.empty() || idx.size() > 3 || !std::all_of(idx.begin(), idx.end(), [](char c) { return std::isdigit((unsigned char)c); }))
        fail(ErrorKind::Usage, "device '{}': the GPU index must be a number, as in cuda:0", text);
      e.index = std::stoi(idx);
    }
  } else {
    fail(ErrorKind::Usage, "unknown device '{}' (use auto, cpu, cuda:N, cuda, each optionally =SIZE)", text);
  }
  return e;
}

std::string label_of(DeviceKind kind, int index) {
  if (kind == DeviceKind::Cpu) return "cpu";
  return index < 0 ? std::string("cuda") : fmt::format("cuda:{}", index);
}

}  // namespace

std::vector<DeviceSpec> parse_devices(std::string_view spec_in, const std::vector<ProbedDevice>& probed,
                                      bool allow_hypothetical) {
  const std::string spec = trim(spec_in);
  if (spec.empty()) fail(ErrorKind::Usage, "--devices is empty (use auto, or a list such as cuda:0,cpu)");

  const ProbedDevice* cpu = nullptr;
  std::vector<const ProbedDevice*> gpus;
  for (const auto& p : probed) {
    if (p.kind == DeviceKind::Cpu) cpu = &p;
    else gpus.push_back(&p);
  }

  std::vector<Entry> entries;
  if (spec == "auto") {
    // GPUs by free memory, largest first (ties: lower ordinal first), then the CPU.
    std::stable_sort(gpus.begin(), gpus.end(), [](auto* a, auto* b) { return a->free_bytes > b->free_bytes; });
    for (auto* g : gpus) entries.push_back({DeviceKind::Cuda, g->index, false, 0, fmt::format("cuda:{}", g->index)});
    entries.push_back({DeviceKind::Cpu, 0, false, 0, "cpu"});
  } else {
    // (getline reads no item after a trailing comma: "cpu," is refused as ",cpu" is)
    if (spec.back() == ',') fail(ErrorKind::Usage, "--devices '{}' has an empty entry", spec);
    std::stringstream ss(spec);
    std::string item;
    while (std::getline(ss, item, ',')) {
      item = trim(item);
      if (item.empty()) fail(ErrorKind::Usage, "--devices '{}' has an empty entry", spec);
      if (item == "auto") fail(ErrorKind::Usage, "--devices: 'auto' cannot be combined with other entries");
      entries.push_back(parse_entry(item));
    }
  }

  // GPUs named by UUID (or a unique start of one) become their index.
  for (Entry& e : entries) {
    if (e.uuid.empty()) continue;
    std::vector<const ProbedDevice*> match;
    std::string known;
    for (const ProbedDevice* g : gpus) {
      std::string u = g->uuid;
      for (char& c : u) c = char(std::tolower((unsigned char)c));
      if (!u.empty() && u.starts_with(e.uuid)) match.push_back(g);
      known += fmt::format("{}{} {}", known.empty() ? "" : ", ", label_of(DeviceKind::Cuda, g->index),
                           g->uuid.empty() ? "(no UUID)" : g->uuid);
    }
    if (match.empty())
      fail(ErrorKind::Usage, "device '{}': no visible GPU has that UUID ({})", e.text,
           gpus.empty() ? std::string("no GPU visible") : known);
    if (match.size() > 1)
      fail(ErrorKind::Usage, "device '{}': the UUID start fits {} and {}: give more of it ({})", e.text,
           label_of(DeviceKind::Cuda, match[0]->index), label_of(DeviceKind::Cuda, match[1]->index), known);
    e.index = match[0]->index;
  }

  auto find_probed = [&](const Entry& e) -> const ProbedDevice* {
    if (e.kind == DeviceKind::Cpu) return cpu;
    if (e.index < 0) return nullptr;
    for (auto* g : gpus)
      if (g->index == e.index) return g;
    return nullptr;
  };

  // How many entries share each physical device: they split its free memory when unbudgeted.
  std::map<std::pair<int, int>, int> unbudgeted;
  std::map<std::pair<int, int>, uint64_t> budgeted;
  for (const Entry& e : entries) {
    if (!find_probed(e)) continue;
    const auto key = std::make_pair(int(e.kind), e.index);
    if (e.has_budget) budgeted[key] += e.budget;
    else unbudgeted[key]++;
  }

  std::vector<DeviceSpec> out;
  for (const Entry& e : entries) {
    DeviceSpec d;
    d.kind = e.kind;
    d.index = e.index;
    d.label = label_of(e.kind, e.index);
    d.budget_given = e.has_budget;
    const ProbedDevice* p = find_probed(e);
    if (!p) {
      const std::string where = have_cuda_backend() ? fmt::format("{} GPU(s) visible", gpus.size())
                                                    : std::string("this build has no CUDA backend");
      if (!allow_hypothetical)
        fail(ErrorKind::Usage, "unknown device '{}' ({}); hypothetical devices are only for `baton plan`", e.text, where);
      if (!e.has_budget)
        fail(ErrorKind::Usage, "device '{}' is not present ({}): give it a budget to plan with, as in {}=24GiB", e.text,
             where, d.label);
      d.present = false;
      d.budget = e.budget;
      d.runtime_reserve = e.kind == DeviceKind::Cuda ? kCudaContextEstimate + kCudaWorkspaceReserve : 0;
      out.push_back(d);
      continue;
    }
    d.present = true;
    d.total_bytes = p->total_bytes;
    d.free_bytes = p->free_bytes;
    const auto key = std::make_pair(int(e.kind), e.index);
    if (e.has_budget) {
      if (e.budget > p->total_bytes)
        fail(ErrorKind::Usage, "device '{}': budget {} is larger than the device ({} in total)", e.text,
             format_bytes(e.budget), format_bytes(p->total_bytes));
      if (budgeted[key] > p->total_bytes)
        fail(ErrorKind::Usage, "the budgets given for {} add up to {}, more than the device has ({})", d.label,
             format_bytes(budgeted[key]), format_bytes(p->total_bytes));
      d.budget = e.budget;
    } else {
      // Unbudgeted entries share what is free after the budgeted ones.
      const uint64_t rest = p->free_bytes > budgeted[key] ? p->free_bytes - budgeted[key] : 0;
      d.budget = rest / uint64_t(unbudgeted[key]);
    }
    d.runtime_reserve = e.kind == DeviceKind::Cuda ? cuda_runtime_reserve(*p) : 0;
    out.push_back(d);
  }
  return out;
}

}  // namespace baton
