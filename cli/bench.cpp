// `baton bench`: end-to-end speed of a model, in the shape of llama-bench's table so the two can
// be read side by side. pp: one batch of p tokens from an empty cache; tg: n single-token decode
// steps from an empty cache. With a depth d (llama-bench's -d), each repetition first fills the
// cache with d tokens, untimed, and the test runs after them ("pp512 @ d4096"). Each test runs once
// to warm up, then r timed repetitions (mean ± sd).
// For tg also the weight bytes streamed per token × tok/s, and that as a share of the machine's
// measured read bandwidth. A benchmark, not a test: the tokens are random ids.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/error.h"
#include "gguf/file_type.h"
#include "gguf/gguf.h"
#include "kernels/cpu/packed.h"
#include "kernels/cpu/threadpool.h"
#include "runtime/config.h"
#include "runtime/devices.h"

namespace baton::cli {
namespace {

struct BenchOpts {
  ModelFlags model;
  int n_prompt = 512;
  int n_gen = 128;
  int depth = 0;  // tokens in the cache before each test
  int reps = 3;
  int parallel = 1;  // > 1: tg is that many sequences decoding together (aggregate t/s)
  bool json = false;
  bool no_bandwidth = false;
};

// CPU seconds of the whole process (every thread, user + system): on a loaded machine the CPU
// time per token still says what the work costs when the wall clock does not.
double cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Stats {
  double mean = 0, sd = 0;
};
Stats stats(const std::vector<double>& v) {
  Stats s;
  for (double x : v) s.mean += x;
  s.mean /= double(v.size());
  if (v.size() > 1) {
    double q = 0;
    for (double x : v) q += (x - s.mean) * (x - s.mean);
    s.sd = std::sqrt(q / double(v.size() - 1));
  }
  return s;
}

// What describes the model in the table: size (tensor bytes), parameters, the weight type (the
// file type, e.g. Q4_K_M, as llama-bench names models), and the weight bytes one generated token
// streams: every tensor once, except the token embedding, of which one row is read (unless the
// output head reuses it, then all of it), and of a mixture's stacked experts the k a token uses.
struct ModelInfo {
  std::string label;
  uint64_t size_bytes = 0;
  uint64_t params = 0;
  uint64_t bytes_per_token = 0;
};

ModelInfo describe(const Pipeline& p) {
  ModelInfo m;
  const ModelConfig& c = p.config();
  const gguf::TensorInfo* embd = nullptr;
  uint64_t active_params = 0;
  for (const auto& t : p.file().tensors()) {
    m.size_bytes += t.nbytes;
    m.params += uint64_t(t.nelements());
    const bool experts = c.is_moe() && t.name.find("_exps.") != std::string::npos;
    m.bytes_per_token += experts ? t.nbytes / uint64_t(c.n_expert) * uint64_t(c.n_expert_used) : t.nbytes;
    active_params += experts ? uint64_t(t.nelements()) / uint64_t(c.n_expert) * uint64_t(c.n_expert_used)
                             : uint64_t(t.nelements());
    if (t.name == "token_embd.weight") embd = &t;
  }
  if (embd && !c.tied_output && embd->ne[1] > 0) m.bytes_per_token -= embd->nbytes - embd->nbytes / uint64_t(embd->ne[1]);
  auto count = [](double n) { return n >= 1e9 ? fmt::format("{:.1f}B", n / 1e9) : fmt::format("{:.0f}M", n / 1e6); };
  m.label = fmt::format("{} {}{} {}", c.arch, count(double(m.params)),
                        c.is_moe() ? " A" + count(double(active_params)) : "", gguf::weight_type_label(p.file()));
  return m;
}

// Read bandwidth of the machine with `threads` threads: each sums its share of a buffer far
// larger than the last-level cache; best of a few passes (the least disturbed one).
double read_bandwidth_gbs(int threads) {
  const size_t n = (size_t(256) << 20) / sizeof(uint64_t);
  // Allocated as packed weights are (huge pages where the OS gives them), so the bandwidth is the
  // one the weight stream can reach.
  const cpu::PackedBuffer mem = cpu::alloc_packed(n * sizeof(uint64_t));
  uint64_t* buf = reinterpret_cast<uint64_t*>(mem.get());
  for (size_t i = 0; i < n; ++i) buf[i] = i;
  std::vector<uint64_t> sink(size_t(threads) * 8, 0);
  double best = 1e300;
  for (int pass = 0; pass < 4; ++pass) {
    const double t0 = now_s();
    const size_t per = (n + size_t(threads) - 1) / size_t(threads);
    cpu::run_on_threads(threads, [&](int t) {
      const size_t b = size_t(t) * per, e = std::min(n, b + per);
      uint64_t a[8] = {};
      size_t i = b;
      for (; i + 8 <= e; i += 8)
        for (int k = 0; k < 8; ++k) a[k] += buf[i + size_t(k)];
      for (; i < e; ++i) a[0] += buf[i];
      for (int k = 0; k < 8; ++k) sink[size_t(t) * 8 + size_t(k)] = a[k];
    });
    if (pass > 0) best = std::min(best, now_s() - t0);  // the first pass also starts the threads
  }
  volatile uint64_t keep = 0;
  for (uint64_t s : sink) keep = keep + s;
  return double(n * sizeof(uint64_t)) / best / 1e9;
}

struct TestResult {
  std::string name;
  int n_prompt = 0, n_gen = 0;
  std::vector<double> tps;
  double cpu_ms_per_token = 0;  // process CPU time over the timed repetitions, per token
  std::vector<double> stage_busy;  // several stages: each one's time at work over the timed wall time
  // Distributed, one stream: µs per token in the process links (beyond the ranks' compute). With
  // several micro-batches in flight that time would include waiting for a busy rank: not measured.
  double link_us = -1;
};

std::vector<double> busy_seconds(const Pipeline& p) {
  std::vector<double> v;
  for (const auto& st : p.stages()) v.push_back(st.busy_s);
  return v;
}

// The context a test starts from: sequence seq emptied, then `depth` tokens decoded in batches of
// at most `batch` (untimed).
struct Depth {
  std::vector<int32_t> tokens;
  int batch = 1;
  int n() const { return int(tokens.size()); }
  std::string suffix() const { return tokens.empty() ? "" : fmt::format(" @ d{}", tokens.size()); }
  void fill(Pipeline& p, int seq) const {
    p.truncate_seq(seq);
    std::vector<float> logits(size_t(p.n_vocab()));
    Batch b;
    for (int i0 = 0; i0 < n(); i0 += batch) {
      b.clear();
      const int i1 = std::min(n(), i0 + batch);
      for (int i = i0; i < i1; ++i) b.add(tokens[size_t(i)], i, seq, i + 1 == i1);
      p.decode(b, logits.data());
    }
  }
};

TestResult run_pp(Pipeline& p, const std::vector<int32_t>& tokens, const Depth& depth, int reps) {
  TestResult r{fmt::format("pp{}{}", tokens.size(), depth.suffix()), int(tokens.size()), 0, {}};
  Batch b;
  for (size_t i = 0; i < tokens.size(); ++i) b.add(tokens[i], depth.n() + int32_t(i), 0, i + 1 == tokens.size());
  std::vector<float> logits(size_t(p.n_vocab()));
  for (int rep = -1; rep < reps; ++rep) {  // rep -1: warm-up, not counted
    depth.fill(p, 0);
    const double t0 = now_s();
    p.decode(b, logits.data());
    const double dt = now_s() - t0;
    if (rep >= 0) r.tps.push_back(double(tokens.size()) / dt);
  }
  return r;
}

TestResult run_tg(Pipeline& p, const std::vector<int32_t>& tokens, const Depth& depth, int reps) {
  TestResult r{fmt::format("tg{}{}", tokens.size(), depth.suffix()), 0, int(tokens.size()), {}};
  std::vector<float> logits(size_t(p.n_vocab()));
  Batch b;
  auto generate = [&](size_t n) {
    for (size_t i = 0; i < n; ++i) {
      b.clear();
      b.add(tokens[i], depth.n() + int32_t(i), 0, true);
      p.decode(b, logits.data());
    }
  };
  depth.fill(p, 0);
  generate(std::min<size_t>(tokens.size(), 8));  // warm-up: a few steps (as llama-bench does), not counted
  double cpu = 0, link_s = 0;
  uint64_t link_batches = 0;
  for (int rep = 0; rep < reps; ++rep) {
    depth.fill(p, 0);  // untimed
    const Pipeline::LinkStats links0 = p.link_stats();
    const double t0 = now_s(), c0 = cpu_s();
    generate(tokens.size());
    r.tps.push_back(double(tokens.size()) / (now_s() - t0));
    cpu += cpu_s() - c0;
    const Pipeline::LinkStats links1 = p.link_stats();
    link_s += links1.seconds - links0.seconds;
    link_batches += links1.micro_batches - links0.micro_batches;
  }
  r.cpu_ms_per_token = cpu * 1e3 / double(tokens.size() * size_t(reps));
  if (link_batches > 0) r.link_us = link_s * 1e6 / double(link_batches);
  return r;
}

// n_seq sequences generating n tokens each, kept rotating through the pipeline in as many groups
// as it wants in flight (as the engine does): while one group's step is in the stages, the next
// group's step is submitted. Rate: all sequences' tokens over the wall time.
TestResult run_tg_parallel(Pipeline& p, const std::vector<int32_t>& tokens, const Depth& depth, int n_seq, int reps) {
  TestResult r{fmt::format("tg{}x{}{}", tokens.size(), n_seq, depth.suffix()), 0, int(tokens.size()), {}};
  const size_t G = size_t(std::clamp(p.max_in_flight(), 1, n_seq));
  std::vector<std::vector<float>> logits(G);
  std::vector<Batch> batches(G);
  std::vector<uint64_t> tickets(G);
  auto fill = [&] {
    for (int s = 0; s < n_seq; ++s) depth.fill(p, s);
  };
  auto generate = [&](size_t n) {
    // Group g holds sequences g, g + G, ...; step i of group g is submitted once step i - 1 of
    // the same group is back.
    auto submit = [&](size_t g, size_t i) {
      batches[g].clear();
      for (int s = int(g); s < n_seq; s += int(G))
        batches[g].add(tokens[(i + size_t(s)) % tokens.size()], depth.n() + int32_t(i), s, true);
      logits[g].resize(size_t(batches[g].size()) * size_t(p.n_vocab()));
      tickets[g] = p.submit(batches[g], logits[g].data());
    };
    for (size_t g = 0; g < G; ++g) submit(g, 0);
    for (size_t i = 1; i <= n; ++i)
      for (size_t g = 0; g < G; ++g) {
        p.wait(tickets[g]);
        if (i < n) submit(g, i);
      }
  };
  fill();
  generate(std::min<size_t>(tokens.size(), 8));  // warm-up, not counted
  double wall = 0, cpu = 0;
  std::vector<double> busy(p.stages().size(), 0.0);
  for (int rep = 0; rep < reps; ++rep) {
    fill();  // untimed
    const std::vector<double> busy0 = busy_seconds(p);
    const double t0 = now_s(), c0 = cpu_s();
    generate(tokens.size());
    const double dt = now_s() - t0;
    cpu += cpu_s() - c0;
    wall += dt;
    const std::vector<double> busy1 = busy_seconds(p);
    for (size_t k = 0; k < busy.size(); ++k) busy[k] += busy1[k] - busy0[k];
    r.tps.push_back(double(tokens.size()) * n_seq / dt);
  }
  if (busy.size() > 1)
    for (double b : busy) r.stage_busy.push_back(b / wall);
  r.cpu_ms_per_token = cpu * 1e3 / double(tokens.size() * size_t(n_seq) * size_t(reps));
  return r;
}

std::string size_str(uint64_t bytes) {
  const double b = double(bytes);
  return b >= double(1ull << 30) ? fmt::format("{:.2f} GiB", b / double(1ull << 30)) : fmt::format("{:.2f} MiB", b / double(1ull << 20));
}
std::string params_str(uint64_t n) {
  const double x = double(n);
  return x >= 1e9 ? fmt::format("{:.2f} B", x / 1e9) : fmt::format("{:.2f} M", x / 1e6);
}

int run(const BenchOpts& o) {
  if (o.n_prompt < 0) fail(ErrorKind::Usage, "-p {}: the prompt length cannot be negative", o.n_prompt);
  if (o.n_gen < 0) fail(ErrorKind::Usage, "-n {}: the generation length cannot be negative", o.n_gen);
  if (o.n_prompt == 0 && o.n_gen == 0) fail(ErrorKind::Usage, "-p 0 and -n 0: nothing to measure");
  if (o.reps < 1) fail(ErrorKind::Usage, "-r {}: need at least one repetition", o.reps);
  if (o.parallel < 1) fail(ErrorKind::Usage, "--parallel {}: need at least one sequence", o.parallel);
  if (o.depth < 0) fail(ErrorKind::Usage, "-d {}: the depth cannot be negative", o.depth);
  const int64_t longest = int64_t(o.depth) + std::max(o.n_prompt, o.n_gen);
  if (longest > (int64_t(1) << 24)) fail(ErrorKind::Usage, "-d {}: {} tokens of context is too many", o.depth, longest);
  if (o.model.ctx > 0 && o.model.ctx < longest)
    fail(ErrorKind::Usage, "--ctx {} is shorter than the longest test ({} tokens{})", o.model.ctx, longest,
         o.depth > 0 ? fmt::format(", {} of depth", o.depth) : "");

  // The depth is filled in batches of up to 512 tokens (or the prompt test's size).
  const int depth_batch = std::max(1, std::min(o.depth, std::max(512, o.n_prompt)));
  ModelFlags mf = o.model;
  mf.batch = std::max({1, o.n_prompt, o.parallel, depth_batch});  // pp is one batch, as in llama-bench's default -b
  if (mf.ctx == 0) mf.ctx = int(std::max<int64_t>(longest, 16));
  Loaded m = load_model(mf, o.parallel, o.parallel);
  Pipeline& p = *m.pipe;
  const ModelInfo info = describe(p);
  // Threads as run: the stages' pools together (with several stages, threads per stage × stages).
  int threads = 0;
  std::string per_stage;
  for (const auto& st : p.stages()) {
    threads += st.n_threads;
    per_stage += (per_stage.empty() ? "" : "+") + std::to_string(st.n_threads);
  }
  if (threads == 0) threads = mf.threads > 0 ? mf.threads : int(std::max(1u, std::thread::hardware_concurrency()));

  // Random token ids (fixed seed), away from the first few ids where special tokens live.
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> pick(std::min(100, p.n_vocab() - 1), p.n_vocab() - 1);
  auto draw = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = pick(rng);
    return v;
  };

  std::vector<TestResult> results;
  const Depth depth{draw(o.depth), depth_batch};
  if (o.n_prompt > 0) results.push_back(run_pp(p, draw(o.n_prompt), depth, o.reps));
  if (o.n_gen > 0)
    results.push_back(o.parallel > 1 ? run_tg_parallel(p, draw(o.n_gen), depth, o.parallel, o.reps)
                                     : run_tg(p, draw(o.n_gen), depth, o.reps));
  // The bandwidth the weight stream is held against: the CPU's read bandwidth, or on GPU stages
  // (all of them) the first GPU's copy bandwidth (read + write of a device-to-device copy).
  int gpu = -1;
  bool all_gpu = !p.stages().empty();
  for (const auto& st : p.stages()) {
    const size_t at = st.device.find("cuda:");
    all_gpu &= at != std::string::npos;
    if (at != std::string::npos && gpu < 0) gpu = std::atoi(st.device.c_str() + at + 5);
  }
  double bw = 0;
  if (!o.no_bandwidth && o.n_gen > 0) bw = all_gpu ? gpu_copy_bandwidth_gbs(gpu) : read_bandwidth_gbs(threads);
  const std::string bw_what = all_gpu ? fmt::format("copy bandwidth of cuda:{} (read + write)", gpu)
                                      : fmt::format("read bandwidth ({} threads)", threads);

  // The devices the stages run on, as loaded ("auto" resolved): cpu, cuda:0, cuda:0,cpu, …
  std::string backend;
  for (const auto& st : p.stages()) backend += (backend.empty() ? "" : ",") + st.device;
  if (o.json) {
    for (const auto& r : results) {
      const Stats s = stats(r.tps);
      nlohmann::json j = {{"model", info.label},          {"model_path", m.path},
                          {"model_size", info.size_bytes}, {"model_n_params", info.params},
                          {"backend", backend},            {"n_threads", threads},
                          {"threads_per_stage", per_stage}, {"n_parallel", o.parallel},
                          {"test", r.name},                {"n_prompt", r.n_prompt},
                          {"n_gen", r.n_gen},              {"n_depth", o.depth},
                          {"repetitions", o.reps},
                          {"samples_ts", r.tps},           {"avg_ts", s.mean},
                          {"stddev_ts", s.sd},            {"cpu_ms_per_token", r.cpu_ms_per_token}};
      if (!r.stage_busy.empty()) j["stage_busy"] = r.stage_busy;
      if (r.link_us >= 0) j["link_us_per_micro_batch"] = r.link_us;
      if (r.n_gen > 0 && o.parallel == 1) {
        j["weight_bytes_per_token"] = info.bytes_per_token;
        j["weights_gb_per_s"] = double(info.bytes_per_token) * s.mean / 1e9;
        if (bw > 0) {
          j[all_gpu ? "gpu_copy_bandwidth_gb_per_s" : "read_bandwidth_gb_per_s"] = bw;
          j["bandwidth_fraction"] = double(info.bytes_per_token) * s.mean / 1e9 / bw;
        }
      }
      std::printf("%s\n", j.dump().c_str());
    }
    return 0;
  }

  int tw = 7;  // the test column: "tg128 @ d4096" is wider than "tg128"
  for (const auto& r : results) tw = std::max(tw, int(r.name.size()));
  std::printf("| %-22s | %10s | %10s | %-7s | %7s | %*s | %20s | %16s |\n", "model", "size", "params", "devices", "threads",
              tw, "test", "t/s", "weights GB/s");
  std::printf("| %s | %s: | %s: | %s | %s: | %s: | %s: | %s: |\n", std::string(22, '-').c_str(), std::string(9, '-').c_str(),
              std::string(9, '-').c_str(), std::string(7, '-').c_str(), std::string(6, '-').c_str(),
              std::string(size_t(tw) - 1, '-').c_str(), std::string(19, '-').c_str(), std::string(15, '-').c_str());
  for (const auto& r : results) {
    const Stats s = stats(r.tps);
    std::string gbs;
    if (r.n_gen > 0 && o.parallel == 1) {  // with several sequences a weight read serves a group
      const double g = double(info.bytes_per_token) * s.mean / 1e9;
      gbs = bw > 0 ? fmt::format("{:.2f} ({:.0f}%)", g, 100.0 * g / bw) : fmt::format("{:.2f}", g);
    }
    std::fputs(fmt::format("| {:<22} | {:>10} | {:>10} | {:<7} | {:>7} | {:>{}} | {:>20} | {:>16} |\n", info.label,
                           size_str(info.size_bytes), params_str(info.params), backend,
                           per_stage.find('+') != std::string::npos ? per_stage : std::to_string(threads), r.name, tw,
                           fmt::format("{:.2f} ± {:.2f}", s.mean, s.sd), gbs)
                   .c_str(),
               stdout);
  }
  std::printf("\nweights read per generated token: %s", size_str(info.bytes_per_token).c_str());
  if (bw > 0) std::printf("; measured %s: %.2f GB/s", bw_what.c_str(), bw);
  std::printf("\n");
  for (const auto& r : results) {
    if (r.stage_busy.empty()) continue;
    std::string b;
    for (double f : r.stage_busy) b += fmt::format("{}{:.0f}%", b.empty() ? "" : ", ", 100 * f);
    std::printf("%s: stages busy %s of the time (an idle stage waits for another: move layers with --tensor-split)\n",
                r.name.c_str(), b.c_str());
  }
  for (const auto& r : results)
    if (r.link_us >= 0)
      std::printf("%s: process links %.0f us per micro-batch (handed on by rank 0 until its logits are back, less "
                  "the other ranks' compute)\n", r.name.c_str(), r.link_us);
  return 0;
}

Register reg{{"bench", "Measure prompt processing and generation speed (tokens/s, like llama-bench)",
  [](CLI::App& app) {
    auto o = std::make_shared<BenchOpts>();
    add_model_flags(app, o->model);
    app.add_option("-p,--n-prompt", o->n_prompt, "prompt tokens evaluated in one batch (0: skip pp)")->capture_default_str();
    app.add_option("-n,--n-gen", o->n_gen, "tokens generated one at a time (0: skip tg)")->capture_default_str();
    app.add_option("-d,--depth", o->depth,
                   "tokens in the context before each test, filled untimed (as llama-bench -d: \"tg128 @ d4096\")")
        ->capture_default_str();
    app.add_option("-r,--repetitions", o->reps, "timed repetitions of each test (after one warm-up)")->capture_default_str();
    app.add_option("--parallel", o->parallel,
                   "tg with N sequences decoding together, pipelined over the stages (aggregate t/s)")->capture_default_str();
    app.add_flag("--json", o->json, "one JSON object per test instead of the table");
    app.add_flag("--no-bandwidth", o->no_bandwidth, "skip measuring the machine's read bandwidth");
    return [o] { return run(*o); };
  }}};

}  // namespace
}  // namespace baton::cli
