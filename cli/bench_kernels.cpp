// `baton bench-kernels`: CPU kernel throughput in one run. First the machine's read bandwidth
// (a sum over a buffer far larger than the last-level cache), then for each weight type GEMV
// (one column: GB/s of weight bytes streamed, compared with that bandwidth) and GEMM (64 and
// 512 columns: GFLOP/s), each at every requested thread count. With --device cuda:N the CUDA
// matmuls instead (bench_kernels_cuda.cpp). A benchmark, not a test.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/bench_kernels.h"
#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/packed.h"
#include "quant/quant.h"

namespace baton::cli {

// A matrix of `rows` × `cols` in type t: a few MiB of properly quantized random rows, repeated.
std::vector<uint8_t> make_matrix(GgmlType t, int64_t rows, int64_t cols) {
  const size_t rb = row_bytes(t, cols);
  const int64_t uniq = std::min<int64_t>(rows, std::max<int64_t>(1, int64_t((4u << 20) / rb)));
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> src(static_cast<size_t>(cols));
  std::vector<uint8_t> m(rb * size_t(rows));
  for (int64_t r = 0; r < uniq; r++) {
    for (auto& v : src) v = d(rng);
    quantize_row(t, src.data(), m.data() + size_t(r) * rb, cols);
  }
  for (int64_t r = uniq; r < rows; r++) std::memcpy(m.data() + size_t(r) * rb, m.data() + size_t(r % uniq) * rb, rb);
  return m;
}

namespace {

struct Options {
  bool json = false;
  std::vector<int> threads;          // default: 1 and 2
  std::vector<std::string> types;    // default: every compute type
  int read_mib = 512;
  int gemv_mib = 256;
  int gemm_rows = 2048;
  int cols = 4096;
  std::string isa;
  bool cpu_time = false;  // time by process CPU time / threads instead of the wall clock
  bool no_pack = false;
  std::string device = "cpu";  // or cuda:N
  int64_t rows = 14336;        // CUDA: rows of the matrix
  int reps = 20;               // CUDA: sweeps per timed round
};

// --device cuda:N: the CUDA matmuls (every weight type the backend computes with by default).
int run_cuda(const Options& o) {
  CudaKernelBench b;
  const std::string& d = o.device;
  size_t used = 0;
  try {
    b.device = std::stoi(d.substr(5), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || 5 + used != d.size()) fail(ErrorKind::Usage, "--device {}: expected cpu or cuda:N", d);
  b.types = o.types;
  if (b.types.empty())
    for (const char* t : {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
                          "F16", "BF16", "F32"})
      b.types.push_back(t);
  b.rows = o.rows;
  b.cols = o.cols;
  b.mib = o.gemv_mib;
  b.reps = o.reps;
  b.json = o.json;
  return run_cuda_kernel_bench(b);
}

// Packs W as a model load would (when this process packs its type); W then reads the packed copy.
cpu::PackedBuffer maybe_pack(cpu::QMatrix& W, bool no_pack) {
  if (no_pack || !cpu::packing_enabled(W.type, W.cols)) return {};
  cpu::PackedBuffer buf = cpu::alloc_packed(cpu::packed_bytes(W.type, W.rows, W.cols));
  cpu::pack_matrix(W, buf.get());
  W.packed = buf.get();
  return buf;
}

// The clock: wall time, or (--cpu-time) the CPU time the process got divided by its threads. On a
// machine shared with other busy processes the wall clock mostly measures the scheduler; CPU
// time measures the code (memory is shared too, so it remains an estimate).
int g_threads = 1;
bool g_cpu_time = false;
double now() {
  if (g_cpu_time) {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9) / g_threads;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best time of `reps` runs (after one warm-up): the least disturbed measurement on a shared box.
template <class F>
double best_of(int reps, F&& f) {
  f();
  double best = 1e300;
  for (int i = 0; i < reps; i++) {
    const double t0 = now();
    f();
    best = std::min(best, now() - t0);
  }
  return best;
}

// A pool whose size the clock knows about.
struct BenchPool {
  cpu::ThreadPool pool;
  explicit BenchPool(int n) : pool(n) { g_threads = n; }
};

// Read bandwidth: each thread sums its contiguous share of the buffer with several independent
// accumulators (auto-vectorized), the way a GEMV streams its rows.
double read_bandwidth(const uint64_t* buf, size_t n, cpu::ThreadPool& pool) {
  const size_t per = (n + size_t(pool.size()) - 1) / size_t(pool.size());
  std::vector<uint64_t> sink(size_t(pool.size()) * 8);
  const double t = best_of(10, [&] {
    pool.run(pool.size(), [&](int task, int) {
      const size_t b = size_t(task) * per, e = std::min(n, b + per);
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      size_t i = b;
      for (; i + 4 <= e; i += 4) {
        s0 += buf[i];
        s1 += buf[i + 1];
        s2 += buf[i + 2];
        s3 += buf[i + 3];
      }
      for (; i < e; i++) s0 += buf[i];
      sink[size_t(task) * 8] = s0 + s1 + s2 + s3;
    });
  });
  return double(n * 8) / t / 1e9;
}

struct Row {
  std::string op, type;
  int threads, cols;
  double seconds, gbps, gflops, read_gbps;
};

void print_row(const Row& r, bool json) {
  if (json) {
    nlohmann::json j = {{"op", r.op},           {"type", r.type}, {"threads", r.threads},
                        {"cols", r.cols},       {"seconds", r.seconds}, {"gbps", r.gbps},
                        {"gflops", r.gflops},   {"read_gbps", r.read_gbps}};
    std::printf("%s\n", j.dump().c_str());
  } else if (r.op == "read") {
    std::printf("%-5s %-5s %7d %5s %10.5f %8.2f %9s %7s\n", r.op.c_str(), "-", r.threads, "-", r.seconds, r.gbps, "-", "100%");
  } else {
    const std::string pct = r.op == "gemv" ? fmt::format("{:.0f}%", 100.0 * r.gbps / r.read_gbps) : "-";
    std::printf("%-5s %-5s %7d %5d %10.5f %8.2f %9.2f %7s\n", r.op.c_str(), r.type.c_str(), r.threads, r.cols, r.seconds,
                r.gbps, r.gflops, pct.c_str());
  }
  check_stdout();  // an output that failed ends the run, with the reason, instead of minutes more
}

int run_bench(const Options& o) {
  if (o.device.rfind("cuda:", 0) == 0) return run_cuda(o);
  if (o.device != "cpu") fail(ErrorKind::Usage, "--device {}: expected cpu or cuda:N", o.device);
  g_cpu_time = o.cpu_time;
  if (!o.isa.empty()) {
    cpu::Isa isa;
    if (!cpu::parse_isa(o.isa.c_str(), isa)) fail(ErrorKind::Usage, "--cpu-isa {}: expected scalar, avx2 or avx512", o.isa);
    cpu::set_isa_limit(isa);
  }
  std::vector<int> threads = o.threads.empty() ? std::vector<int>{1, 2} : o.threads;
  for (int t : threads)
    if (t < 1) fail(ErrorKind::Usage, "-t {}: thread counts must be at least 1", t);
  std::vector<GgmlType> types;
  if (o.types.empty()) {
    types.assign(std::begin(kComputeTypes), std::end(kComputeTypes));
  } else {
    for (const auto& name : o.types) {
      const TypeTraits* tt = type_by_name(name);
      if (!tt || !tt->compute) fail(ErrorKind::Usage, "--types: {} is not a weight type Baton computes with", name);
      types.push_back(tt->type);
    }
  }
  if (o.cols % 256 != 0 || o.cols <= 0) fail(ErrorKind::Usage, "--cols {}: must be a positive multiple of 256", o.cols);

  if (!o.json) {
    std::printf("clock: %s\n", o.cpu_time ? "process CPU time / threads" : "wall");
    std::printf("isa %s; read buffer %d MiB; GEMV matrices ~%d MiB (%d columns); GEMM %d x %d\n",
                cpu::isa_name(cpu::active_isa()), o.read_mib, o.gemv_mib, o.cols, o.gemm_rows, o.cols);
    std::printf("%-5s %-5s %7s %5s %10s %8s %9s %7s\n", "op", "type", "threads", "cols", "seconds", "GB/s", "GFLOP/s", "%read");
  }

  std::vector<double> read_gbps(threads.size());
  {
    // Allocated as packed weights are (huge pages where the OS gives them).
    const size_t n = size_t(o.read_mib) << 17;
    const cpu::PackedBuffer mem = cpu::alloc_packed(n * sizeof(uint64_t));
    uint64_t* buf = reinterpret_cast<uint64_t*>(mem.get());
    for (size_t i = 0; i < n; i++) buf[i] = i * 0x9E3779B97F4A7C15ull;  // touch every page
    for (size_t i = 0; i < threads.size(); i++) {
      BenchPool bp(threads[i]);
      read_gbps[i] = read_bandwidth(buf, n, bp.pool);
      print_row({"read", "-", threads[i], 0, double(n * 8) / read_gbps[i] / 1e9, read_gbps[i], 0, read_gbps[i]}, o.json);
    }
  }

  const int64_t cols = o.cols;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  std::vector<float> X(size_t(cols) * 512);
  for (auto& v : X) v = ud(rng);
  for (GgmlType t : types) {
    const size_t rb = row_bytes(t, cols);
    const int64_t rows = std::max<int64_t>(256, int64_t((size_t(o.gemv_mib) << 20) / rb) / 16 * 16);
    {
      const auto m = make_matrix(t, rows, cols);
      cpu::QMatrix W{t, m.data(), rows, cols, rb};
      const cpu::PackedBuffer packed = maybe_pack(W, o.no_pack);
      // 1 column (one stream) and 8 (a decode micro-batch): the matrix streams from DRAM once.
      std::vector<float> Y(static_cast<size_t>(rows) * 8);
      for (int n : {1, 8})
        for (size_t i = 0; i < threads.size(); i++) {
          BenchPool bp(threads[i]);
          cpu::ThreadPool& pool = bp.pool;
          const double s = best_of(10, [&] { cpu::matmul(W, X.data(), n, Y.data(), pool); });
          const double bytes = double(rb) * double(rows);
          print_row({"gemv", type_name(t), threads[i], n, s, bytes / s / 1e9,
                     2.0 * double(rows) * double(cols) * n / s / 1e9, read_gbps[i]},
                    o.json);
        }
    }
    const int64_t grows = o.gemm_rows;
    const auto m = make_matrix(t, grows, cols);
    cpu::QMatrix W{t, m.data(), grows, cols, rb};
    const cpu::PackedBuffer packed = maybe_pack(W, o.no_pack);
    std::vector<float> Y(size_t(grows) * 512);
    for (int n : {64, 512}) {
      for (size_t i = 0; i < threads.size(); i++) {
        BenchPool bp(threads[i]);
        cpu::ThreadPool& pool = bp.pool;
        const double s = best_of(2, [&] { cpu::matmul(W, X.data(), n, Y.data(), pool); });
        print_row({"gemm", type_name(t), threads[i], n, s, double(rb) * double(grows) / s / 1e9,
                   2.0 * double(grows) * double(cols) * n / s / 1e9, read_gbps[i]},
                  o.json);
      }
    }
  }
  return 0;
}

Register reg{{"bench-kernels", "Measure read bandwidth and matmul kernel throughput (GEMV GB/s, GEMM GFLOP/s; CPU or CUDA)",
              [](CLI::App& app) {
                auto o = std::make_shared<Options>();
                app.add_flag("--json", o->json, "One JSON object per measurement");
                app.add_option("-t,--threads", o->threads, "Thread counts to measure (default: 1 2)");
                app.add_option("--types", o->types, "Weight types (default: all 16)");
                app.add_option("--read-mib", o->read_mib, "Read-bandwidth buffer size in MiB")->check(in_range(64, 65536));
                app.add_option("--gemv-mib", o->gemv_mib, "GEMV matrix size in MiB")->check(in_range(1, 65536));
                app.add_option("--gemm-rows", o->gemm_rows, "GEMM matrix rows")->check(in_range(16, 1 << 20));
                app.add_option("--cols", o->cols, "Matrix columns (row length), a multiple of 256");
                app.add_flag("--no-pack", o->no_pack, "Keep the GGUF row layout (by default packable types are packed, as a model load does)");
                app.add_flag("--cpu-time", o->cpu_time, "Time by process CPU time / threads (busy shared machines)");
                app.add_option("--cpu-isa", o->isa, "Limit the instruction set: scalar, avx2 or avx512");
                app.add_option("--device", o->device,
                               "cpu (default) or cuda:N: the CUDA GEMV per column count and its cut-over to the GEMM");
                app.add_option("--rows", o->rows, "CUDA: matrix rows (default 14336; --cols 4096: a Llama 3 8B FFN "
                                                  "projection); --gemv-mib: the copies' total")
                    ->check(in_range(16, int64_t(1) << 24));
                app.add_option("--reps", o->reps, "CUDA: sweeps over the copies per timed round (default 20)")
                    ->check(in_range(1, 100000));
                return [o] { return run_bench(*o); };
              }}};

}  // namespace
}  // namespace baton::cli
