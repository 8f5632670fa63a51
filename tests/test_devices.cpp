// --devices parsing against a fake machine, sizes, and the CPU probe.
#include "gguf/error.h"
#include "helpers.h"
#include "runtime/devices.h"

using namespace baton;

namespace {

constexpr uint64_t MiB = 1ull << 20, GiB = 1ull << 30;

// A machine with 64 GiB of RAM and two GPUs, the second with more free memory.
std::vector<ProbedDevice> machine() {
  ProbedDevice c{DeviceKind::Cpu, 0, "cpu", 64 * GiB, 48 * GiB};
  ProbedDevice g0{DeviceKind::Cuda, 0, "gpu zero", 24 * GiB, 10 * GiB, 8, 9, 0, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"};
  ProbedDevice g1{DeviceKind::Cuda, 1, "gpu one", 24 * GiB, 20 * GiB, 8, 9, 0, "GPU-89a1b2c3-0000-4106-c12f-20bd9faed9f7"};
  return {c, g0, g1};
}

std::string usage_error(const std::string& spec, bool hyp = false) {
  try {
    parse_devices(spec, machine(), hyp);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::Usage);
    return e.what();
  }
  FAIL("no error for '" << spec << "'");
  return "";
}

}  // namespace

TEST_CASE("sizes") {
  CHECK(parse_size("512MiB") == 512 * MiB);
  CHECK(parse_size("20GiB") == 20 * GiB);
  CHECK(parse_size("20gib") == 20 * GiB);
  CHECK(parse_size("1.5GB") == 1500000000ull);
  CHECK(parse_size("1.5GiB") == 3 * GiB / 2);
  CHECK(parse_size("1000000") == 1000000);
  CHECK(parse_size("2K") == 2048);
  CHECK(parse_size("2M") == 2 * MiB);
  CHECK(parse_size("18446744073709551615") == 18446744073709551615ull);
  for (const char* bad : {"", "GiB", "12XB", "1.2.3", "-5", "0.5", "1e9", "99999999999999999999", "20 GiB x"})
    CHECK_THROWS_AS(parse_size(bad), Error);
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(1536 * MiB) == "1.50 GiB");
  CHECK(format_bytes(24 * GiB) == "24.0 GiB");
  CHECK(format_bytes(512 * MiB) == "512 MiB");
}

TEST_CASE("a GPU's runtime reserve: measured at probing (whole MiB + margin), else the estimate") {
  std::vector<ProbedDevice> m = machine();
  m[2].runtime_bytes = 100 * MiB + 5;  // cuda:1 measured, cuda:0 not
  const auto d = parse_devices("cuda:0,cuda:1", m, false);
  REQUIRE(d.size() == 2);
  CHECK(d[0].runtime_reserve == kCudaWorkspaceReserve);
  CHECK(d[1].runtime_reserve == 101 * MiB + kCudaReserveMargin);
  CHECK(format_devices(m, {}, true).find("117 MiB (measured 100 MiB)") != std::string::npos);
  CHECK(format_devices(m, {}, true).find("64.0 MiB (estimate)") != std::string::npos);
}

TEST_CASE("auto: GPUs by free memory, then the CPU; budgets are free memory") {
  const auto d = parse_devices("auto", machine(), false);
  REQUIRE(d.size() == 3);
  CHECK(d[0].label == "cuda:1");
  CHECK(d[0].budget == 20 * GiB);
  CHECK(d[0].runtime_reserve == kCudaWorkspaceReserve);
  CHECK(d[1].label == "cuda:0");
  CHECK(d[2].label == "cpu");
  CHECK(d[2].budget == 48 * GiB);
  CHECK(d[2].runtime_reserve == 0);
  for (const auto& x : d) CHECK(x.present);

  // A CPU-only machine: just the CPU.
  const auto c = parse_devices("auto", {machine()[0]}, false);
  REQUIRE(c.size() == 1);
  CHECK(c[0].label == "cpu");
}

TEST_CASE("explicit lists, budgets and repeated entries") {
  auto d = parse_devices("cuda:0=8GiB, cpu=8GiB", machine(), false);
  REQUIRE(d.size() == 2);
  CHECK(d[0].index == 0);
  CHECK(d[0].budget == 8 * GiB);
  CHECK(d[0].budget_given);
  CHECK(d[1].budget == 8 * GiB);

  // The same device twice: two stages that share its free memory.
  d = parse_devices("cpu,cpu", machine(), false);
  REQUIRE(d.size() == 2);
  CHECK(d[0].budget == 24 * GiB);
  CHECK(d[1].budget == 24 * GiB);
  d = parse_devices("cpu=2GiB,cpu=2GiB", machine(), false);
  CHECK(d[0].budget == 2 * GiB);
  CHECK(d[1].budget == 2 * GiB);
  d = parse_devices("cpu=8GiB,cpu", machine(), false);  // the unbudgeted entry gets the rest
  CHECK(d[1].budget == 40 * GiB);
  d = parse_devices("cuda:1=12GiB,cuda:1=12GiB", machine(), false);
  CHECK(d.size() == 2);

  // A budget above free memory (but within the device) is allowed and remembered for a note.
  d = parse_devices("cuda:0=20GiB", machine(), false);
  CHECK(d[0].free_bytes == 10 * GiB);
}

TEST_CASE("hypothetical devices only for planning, and only with a budget") {
  const auto d = parse_devices("cuda=24GiB,cuda=24GiB", machine(), true);
  REQUIRE(d.size() == 2);
  CHECK_FALSE(d[0].present);
  CHECK(d[0].label == "cuda");
  CHECK(d[0].index == -1);
  CHECK(d[0].budget == 24 * GiB);
  CHECK(d[0].runtime_reserve == kCudaContextEstimate + kCudaWorkspaceReserve);
  const auto e = parse_devices("cuda:7=80GiB,cpu", machine(), true);
  CHECK_FALSE(e[0].present);
  CHECK(e[0].label == "cuda:7");
  CHECK(e[1].present);

  CHECK_THAT(usage_error("cuda=24GiB"), Catch::Contains("only for `baton plan`"));
  CHECK_THAT(usage_error("cuda:7"), Catch::Contains("unknown device"));
  CHECK_THAT(usage_error("cuda:7", true), Catch::Contains("give it a budget"));
}

TEST_CASE("bad device lists are usage errors that name the problem") {
  CHECK_THAT(usage_error("tpu:0"), Catch::Contains("unknown device 'tpu:0'"));
  CHECK_THAT(usage_error("cuda:0=12XB"), Catch::Contains("not a valid size"));
  CHECK_THAT(usage_error("cuda:0="), Catch::Contains("not a valid size"));
  CHECK_THAT(usage_error("cpu=0"), Catch::Contains("0 bytes"));
  CHECK_THAT(usage_error("cuda:0=30GiB"), Catch::Contains("larger than the device"));
  CHECK_THAT(usage_error("cpu=40GiB,cpu=40GiB"), Catch::Contains("add up to"));
  CHECK_THAT(usage_error("cpu:1"), Catch::Contains("takes no index"));
  CHECK_THAT(usage_error("cuda:x"), Catch::Contains("index must be a number"));
  CHECK_THAT(usage_error("cpu,,cpu"), Catch::Contains("empty entry"));
  CHECK_THAT(usage_error("cpu,"), Catch::Contains("--devices 'cpu,' has an empty entry"));  // (getline: no item)
  CHECK_THAT(usage_error("cuda:0, "), Catch::Contains("has an empty entry"));
  CHECK_THAT(usage_error("cpu=1e30GiB"), Catch::Contains("'1e30GiB' is not a valid size (no exponents)"));  // not "unit"
  CHECK_THAT(usage_error("cpu=99999999999GiB"), Catch::Contains("(too large)"));
  CHECK_THAT(usage_error(""), Catch::Contains("empty"));
  CHECK_THAT(usage_error("auto,cpu"), Catch::Contains("cannot be combined"));
}

// As CUDA_VISIBLE_DEVICES takes them: a GPU by its UUID (nvidia-smi -L, baton devices), or by a
// start of it that fits one GPU only, in any case, with or without a budget.
TEST_CASE("GPUs named by UUID, or by a unique start of one") {
  auto labels = [](const std::string& spec) {
    std::string out;
    for (const DeviceSpec& d : parse_devices(spec, machine(), false)) out += d.label + (d.budget_given ? "=" : "") + " ";
    return out;
  };
  CHECK(labels("GPU-89a1b2c3-0000-4106-c12f-20bd9faed9f7,cpu") == "cuda:1 cpu ");
  CHECK(labels("gpu-8932F937,GPU-89a=4GiB") == "cuda:0 cuda:1= ");
  const auto d = parse_devices("GPU-89a=4GiB", machine(), false);
  CHECK(d[0].budget == 4 * GiB);
  CHECK(d[0].index == 1);
  CHECK_THAT(usage_error("GPU-89"), Catch::Contains("the UUID start fits cuda:0 and cuda:1: give more of it"));
  CHECK_THAT(usage_error("GPU-77"), Catch::Contains("no visible GPU has that UUID (cuda:0 GPU-8932f937-d72c-4106-c12f-20bd9faed9f6, "
                                                    "cuda:1 GPU-89a1b2c3-0000-4106-c12f-20bd9faed9f7)"));
  CHECK_THAT(usage_error("GPU-77=4GiB", true), Catch::Contains("no visible GPU has that UUID"));  // not hypothetical
  CHECK_THAT(usage_error("GPU-"), Catch::Contains("a GPU UUID is GPU- and hex digits"));
  CHECK_THAT(usage_error("GPU-xyz"), Catch::Contains("a GPU UUID is GPU- and hex digits"));
}

TEST_CASE("the CPU probe reads /proc/meminfo") {
  const ProbedDevice c = probe_cpu();
  CHECK(c.kind == DeviceKind::Cpu);
  CHECK(c.total_bytes > 64 * MiB);
  CHECK(c.free_bytes > 0);
  CHECK(c.free_bytes <= c.total_bytes);
  const auto all = probe_devices();
  REQUIRE(!all.empty());
  CHECK(all[0].kind == DeviceKind::Cpu);
  if (!have_cuda_backend()) CHECK(all.size() == 1);
}

TEST_CASE("baton devices: without a GPU the listing says so and has no links") {
  const auto devs = probe_devices();
  const auto links = probe_links(size_t(1) << 20);
  size_t gpus = 0;
  for (const auto& d : devs) gpus += d.kind == DeviceKind::Cuda;
  const std::string text = format_devices(devs, links, have_cuda_backend());
  CHECK(text.find("\ncpu ") != std::string::npos);
  if (gpus == 0) {
    CHECK(links.empty());
    CHECK(text.find("no CUDA devices") != std::string::npos);
    CHECK(text.find(have_cuda_backend() ? "none visible" : "no CUDA backend") != std::string::npos);
  }
  CHECK(links.size() == size_t(gpus) * size_t(gpus));  // every ordered pair, each GPU with itself too
}

TEST_CASE("baton devices: GPUs with compute capability, and each pair's copy paths") {
  ProbedDevice cpu = probe_cpu();
  ProbedDevice g0{DeviceKind::Cuda, 0, "NVIDIA H100 80GB HBM3", 80ull << 30, 79ull << 30, 9, 0};
  ProbedDevice g1{DeviceKind::Cuda, 1, "NVIDIA A100-SXM4-40GB", 40ull << 30, 39ull << 30, 8, 0};
  std::vector<DeviceLink> links{{0, 0, true, 1500.0, 22.0, 4.5, 23.0, ""},
                                {0, 1, true, 180.25, 21.5, 6.5, 24.25, ""},
                                {1, 0, false, 0, 19.75, 0, 23.5, ""}};
  g1.uuid = "GPU-89a1b2c3-0000-4106-c12f-20bd9faed9f7";
  const std::string text = format_devices({cpu, g0, g1}, links, true);
  CHECK(text.find("cuda:0") != std::string::npos);
  CHECK(text.find("sm 9.0") != std::string::npos);
  CHECK(text.find("sm 8.0") != std::string::npos);
  CHECK(text.find("80.0 GiB") != std::string::npos);
  CHECK(text.find("no CUDA devices") == std::string::npos);
  const auto line = [&](const std::string& start) {
    const size_t at = text.find(start);
    REQUIRE(at != std::string::npos);
    return text.substr(at, text.find('\n', at) - at);
  };
  CHECK(line("cuda:1 ").find("GPU-89a1b2c3-0000-4106-c12f-20bd9faed9f7") != std::string::npos);
  const std::string fwd = line("cuda:0 -> cuda:1"), back = line("cuda:1 -> cuda:0");
  CHECK(fwd.find("peer-to-peer") != std::string::npos);
  CHECK(fwd.find("180.2") != std::string::npos);
  CHECK(fwd.find("21.5") != std::string::npos);
  CHECK(fwd.find("6.5") != std::string::npos);
  CHECK(fwd.find("24.2") != std::string::npos);
  CHECK(back.find("host-staged") != std::string::npos);
  CHECK(back.find("19.8") != std::string::npos);
  CHECK(back.find("23.5") != std::string::npos);
  // Two stages on one GPU: the device-to-device copy is its peer-to-peer path.
  CHECK(line("cuda:0 -> cuda:0").find("peer-to-peer") != std::string::npos);
  CHECK(line("cuda:0 -> cuda:0").find("1500.0") != std::string::npos);
}
