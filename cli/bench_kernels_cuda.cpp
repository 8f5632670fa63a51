// `baton bench-kernels --device cuda:N`: the CUDA matmuls on their own. The device's copy
// bandwidth first (the roofline the GEMV is held against), then per weight type
//   - GEMV at 1, 2, 4 and 8 columns: GB/s of weight bytes, and its share of that bandwidth;
//     at 1 and 2 columns also with two rows per warp ("gemv2r", Context::gemv_rows_per_warp),
//     and at 1, 2 and 4 columns as the streamed grid ("gemvS", Context::gemv_stream);
//   - GEMV (8 columns per pass) against dequantize + cuBLAS GEMM from 8 to 128 columns: the
//     column count from which the GEMM is faster, i.e. what Context::gemv_max_cols should be;
//   - the GEMM at 512 columns (a prompt chunk) with FP16 slabs of 8 MiB to the whole matrix: the
//     slab size (Context::gemm_slab_bytes) at which it runs fastest. Slabs small enough to stay in
//     L2 spare the HBM the FP16 copy's write and read; too small, and one GEMM does not fill the GPU.
// The matrices are copies of one rows × cols weight (default 14336 × 4096, a Llama 3 8B FFN
// projection), enough copies to exceed the L2 cache many times over: each sweep runs the op once
// on every copy, as a decode step reads every layer's weights once, so the weights stream from
// memory. GEMV sweeps are replayed from a CUDA graph (as decode is); GEMM sweeps are launched.
// A benchmark, not a test.
#include "cli/bench_kernels.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/options.h"
#include "gguf/error.h"
#include "quant/quant.h"

#ifdef BATON_HAVE_CUDA
#include "kernels/cuda/device_info.h"
#include "kernels/cuda/ops.h"
#endif

namespace baton::cli {

#ifndef BATON_HAVE_CUDA

int run_cuda_kernel_bench(const CudaKernelBench&) {
  fail(ErrorKind::Usage, "bench-kernels --device cuda: this build has no CUDA backend (configure with -DBATON_CUDA=ON)");
}

#else

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Seconds per sweep: one warm-up sweep (it also sizes the scratch), then the best of 3 rounds
// of `reps` sweeps, each round timed from its first launch to the stream's end.
double time_sweep(cuda::Context& c, int reps, bool graph, const std::function<void()>& sweep) {
  sweep();
  c.synchronize();
  cuda::Graph g;
  if (graph) g = cuda::capture(c, sweep);
  double best = 1e300;
  for (int round = 0; round < 3; ++round) {
    const double t0 = seconds_now();
    for (int r = 0; r < reps; ++r) {
      if (graph) cuda::launch(c, g);
      else sweep();
    }
    c.synchronize();
    best = std::min(best, (seconds_now() - t0) / reps);
  }
  return best;
}

void print(bool json, const nlohmann::json& j, const std::string& text) {
  std::printf("%s\n", json ? j.dump().c_str() : text.c_str());
  // Not a bare fflush: the first failed flush is the one that knows why (errno), and an output
  // that failed ends the run with that reason (cli/options.h).
  check_stdout();
}

}  // namespace

int run_cuda_kernel_bench(const CudaKernelBench& o) {
  const int n_dev = cuda::device_count();
  if (o.device < 0 || o.device >= n_dev)
    fail(ErrorKind::Usage, "--device cuda:{}: {} CUDA device(s) visible", o.device, n_dev);
  if (o.rows < 16 || o.cols % 256 != 0 || o.cols <= 0)
    fail(ErrorKind::Usage, "--rows {} --cols {}: rows must be >= 16, cols a positive multiple of 256", o.rows, o.cols);
  std::vector<GgmlType> types;
  for (const auto& name : o.types) {
    const TypeTraits* tt = type_by_name(name);
    if (!tt || !cuda::cuda_supports(tt->type))
      fail(ErrorKind::Usage, "--types: {} is not a weight type the CUDA backend computes with", name);
    types.push_back(tt->type);
  }

  cuda::Context c(o.device);
  std::string name = fmt::format("cuda:{}", o.device);
  for (const auto& d : cuda::list_devices())
    if (d.index == o.device) name += " " + d.name;
  const double copy_gbs = cuda::copy_bandwidth_gbs(o.device, size_t(std::max(o.mib, 64)) << 20);
  if (!o.json) {
    std::printf("%s: copy bandwidth %.0f GB/s (device-to-device, read + write)\n", name.c_str(), copy_gbs);
    std::printf("matrices %lld x %lld, copies of >= %d MiB in all (streamed from memory, not L2)\n",
                static_cast<long long>(o.rows), static_cast<long long>(o.cols), o.mib);
    std::printf("%-7s %-5s %4s %11s %9s %7s %9s\n", "op", "type", "cols", "us/matrix", "GB/s", "%copy", "TFLOP/s");
  }

  const int max_n = 128, prefill_n = 512;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  std::vector<float> hx(size_t(o.cols) * prefill_n);
  for (auto& v : hx) v = ud(rng);
  cuda::DeviceBuffer X(hx.size() * sizeof(float)), Y(size_t(o.rows) * prefill_n * sizeof(float));
  X.upload(hx.data(), hx.size() * sizeof(float));

  for (GgmlType t : types) {
    // One matrix of random quantized rows, uploaded once and copied on the device.
    const size_t rb = row_bytes(t, o.cols);
    const std::vector<uint8_t> host = make_matrix(t, o.rows, o.cols);
    cuda::Weight w0;
    std::vector<cuda::DeviceBuffer> bufs;
    bufs.push_back(cuda::upload_weight(t, host.data(), o.rows, o.cols, w0));
    const size_t dev_bytes = w0.row_stride * size_t(o.rows);
    const size_t copies = std::max<size_t>(2, ((size_t(o.mib) << 20) + dev_bytes - 1) / dev_bytes);
    std::vector<cuda::Weight> ws{w0};
    while (ws.size() < copies) {
      bufs.emplace_back(dev_bytes);
      cuda::copy_on_device(c, bufs.back().get(), w0.data, dev_bytes);
      cuda::Weight w = w0;
      w.data = bufs.back().get();
      ws.push_back(w);
    }
    const size_t default_slab = c.gemm_slab_bytes, whole = size_t(o.rows) * size_t(o.cols) * 2;
    c.gemm_slab_bytes = whole;  // the largest scratch any slab size below needs
    c.reserve(std::max(cuda::q8_act_bytes(o.cols, max_n), cuda::matmul_scratch_bytes(c, w0, prefill_n)));
    c.gemm_slab_bytes = default_slab;
    c.synchronize();
    const double weight_bytes = double(rb) * double(o.rows);  // the GGUF bytes a decode step reads
    const double flop1 = 2.0 * double(o.rows) * double(o.cols);
    const float* x = X.as<float>();
    float* y = Y.as<float>();
    auto gemv_sweep = [&](int n) { return [&, n] { for (const auto& w : ws) cuda::gemv(c, w, x, n, y); }; };
    auto gemm_sweep = [&](int n) { return [&, n] { for (const auto& w : ws) cuda::gemm(c, w, x, n, y); }; };
    auto row = [&](const char* op, int n, double sweep_s) {
      const double s = sweep_s / double(ws.size());
      const double gbs = weight_bytes / s / 1e9, pct = copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0;
      print(o.json,
            {{"op", op}, {"type", type_name(t)}, {"cols", n}, {"us", s * 1e6}, {"gbps", gbs},
             {"copy_fraction", pct / 100.0}, {"tflops", flop1 * n / s / 1e12}, {"device", name}},
            fmt::format("{:<7} {:<5} {:>4} {:>11.1f} {:>9.0f} {:>6.0f}% {:>9.2f}", op, type_name(t), n, s * 1e6, gbs, pct,
                        flop1 * n / s / 1e12));
      return s;
    };

    for (int n : {1, 2, 4}) row("gemv", n, time_sweep(c, o.reps, true, gemv_sweep(n)));
    // Two rows per warp (Context::gemv_rows_per_warp) against the rows above.
    const int rpw = c.gemv_rows_per_warp;
    c.gemv_rows_per_warp = 2;
    for (int n : {1, 2}) row("gemv2r", n, time_sweep(c, o.reps, true, gemv_sweep(n)));
    c.gemv_rows_per_warp = rpw;
    // The streamed grid (Context::gemv_stream), when the matrix has a row for every warp it holds.
    const bool stream = c.gemv_stream;
    c.gemv_stream = true;
    cuda::gemv_stream_prepare();  // the sweeps are captured
    for (int n : {1, 2, 4}) row("gemvS", n, time_sweep(c, o.reps, true, gemv_sweep(n)));
    c.gemv_stream = stream;
    // The cut-over: from which column count is dequantize + GEMM faster than GEMV passes?
    int cut = 0;
    std::string line;
    for (int n : {8, 12, 16, 24, 32, 48, 64, 96, 128}) {
      const double v = row("gemv", n, time_sweep(c, o.reps, true, gemv_sweep(n)));
      const double m = row("gemm", n, time_sweep(c, std::max(1, o.reps / 4), false, gemm_sweep(n)));
      line += fmt::format(" {}:{:.2f}", n, v / m);
      if (cut == 0 && m < v) cut = n;
    }
    const std::string verdict = cut == 8 ? std::string("GEMM faster already at 8 columns")
                                : cut    ? fmt::format("GEMM faster from {} columns", cut)
                                         : std::string("GEMV faster up to 128 columns");
    print(o.json, {{"op", "cutover"}, {"type", type_name(t)}, {"gemm_from_cols", cut}, {"device", name}},
          fmt::format("cut-over {}: gemv/gemm time{} -> {}", type_name(t), line, verdict));

    // The FP16 slab size for prompt chunks (rows "gemm" at 512 columns, one per slab size).
    size_t best_slab = 0;
    double best_s = 1e300;
    line.clear();
    for (size_t mib : {8, 16, 32, 64, 0}) {
      const size_t slab = mib ? std::min(mib << 20, whole) : whole;
      if (mib && slab == whole) continue;  // the matrix fits in this slab: same as the whole
      c.gemm_slab_bytes = slab;
      const std::string op = mib ? fmt::format("gemm/{}M", mib) : std::string("gemm/all");
      const double m = row(op.c_str(), prefill_n, time_sweep(c, std::max(1, o.reps / 4), false, gemm_sweep(prefill_n)));
      line += fmt::format(" {}:{:.0f}", mib ? fmt::format("{}M", mib) : std::string("all"),
                          flop1 * prefill_n / m / 1e12);
      if (m < best_s) best_s = m, best_slab = mib;
    }
    c.gemm_slab_bytes = default_slab;
    print(o.json, {{"op", "slab"}, {"type", type_name(t)}, {"cols", prefill_n}, {"best_slab_mib", best_slab}, {"device", name}},
          fmt::format("slab {}: TFLOP/s at {} columns by FP16 slab{} -> best {}", type_name(t), prefill_n, line,
                      best_slab ? fmt::format("{} MiB", best_slab) : std::string("whole matrix")));
  }
  return 0;
}

#endif

}  // namespace baton::cli
