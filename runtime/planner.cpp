// Placement policy (docs/PLACEMENT.md). The layer stack plus the output head form a row of
// "units": unit i < n_layer is layer i, unit n_layer is the head. Every policy below produces
// contiguous blocks of units, in pipeline order; evaluate() then prices each block exactly.
#include "runtime/planner.h"

#include <algorithm>
#include <string_view>
#include <cmath>
#include <numeric>
#include <utility>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "runtime/buffers.h"

namespace baton {
namespace {

struct Block {
  size_t device;
  uint32_t begin, end;  // units [begin, end); end == n_layer + 1 includes the head
};

// A layer's weight bytes on the device that holds it: with --cpu-moe its experts are charged to
// the host once (plan), not here.
uint64_t layer_bytes(const ModelShape& s, uint32_t i, const PlanOptions& o) {
  return s.layers[i].weight_bytes - (o.cpu_moe ? s.layers[i].expert_bytes : 0);
}

struct Pricing {
  const ModelShape& s;
  const std::vector<DeviceSpec>& dev;
  uint32_t L;                    // layers; units are 0..L
  std::vector<uint64_t> prefix;  // prefix[i]: weights + KV of layers [0, i)
  std::vector<uint64_t> kv;      // KV per layer
  uint64_t scratch_mid, scratch_last;
  uint64_t cpu_att = 0;  // the CPU attention's per-thread buffers (in both; a GPU stage is not charged them)
  uint64_t gpu_ops_mid, gpu_ops_last;  // GPU stages also hold the CUDA ops' shared scratch (+ sampling)
  uint64_t gpu_link;                   // and, past layer 0, the slots of a link from a GPU stage
  std::vector<uint64_t> reserve;  // per device entry

  Pricing(const ModelShape& shape, const std::vector<DeviceSpec>& devices, const PlanOptions& o)
      : s(shape), dev(devices), L(shape.n_layer) {
    prefix.assign(L + 1, 0);
    kv.resize(L);
    for (uint32_t i = 0; i < L; i++) {
      kv[i] = kv_layer_bytes(s, i, o.n_ctx, o.n_parallel, o.kv_type);
      prefix[i + 1] = prefix[i] + layer_bytes(s, i, o) + kv[i];
    }
    const ScratchLayout mid = scratch_layout(s, o.n_batch, false, o.kv_type, o.n_outputs, o.n_threads);
    scratch_mid = mid.total();
    scratch_last = scratch_bytes(s, o.n_batch, true, o.kv_type, o.n_outputs, o.n_threads);
    cpu_att = mid.att;
    gpu_ops_mid = gpu_ops_scratch_bytes(s, o.n_batch, false) + s.lora_gpu_buffer;
    gpu_ops_last = gpu_ops_scratch_bytes(s, o.n_batch, true, o.n_outputs) + gpu_sampling_bytes(s, o.n_outputs) + s.lora_gpu_buffer;
    gpu_link = gpu_link_bytes(s, o.n_batch);
    for (size_t d = 0; d < dev.size(); d++) {
      const uint64_t user = o.reserve.empty() ? 0 : o.reserve.size() == 1 ? o.reserve[0] : o.reserve[d];
      reserve.push_back(dev[d].runtime_reserve + user);
    }
  }

  // Everything device d needs to hold units [begin, end). The first block (begin 0) holds the
  // embedding; a tied head on that same stage reuses it, on any other stage it is a second copy.
  uint64_t cost(size_t d, uint32_t begin, uint32_t end) const {
    const bool emb = begin == 0, head = end > L;
    const uint32_t le = std::min(end, L);
    uint64_t c = reserve[d] + s.shared_bytes + prefix[le] - prefix[std::min(begin, le)];
    if (emb) c += s.embedding_bytes;
    if (head) c += s.output_norm_bytes + (s.tied_output && emb ? 0 : s.output_bytes);
    return c + scratch(d, head) + (dev[d].is_gpu() && !emb ? gpu_link : 0);
  }
  // A GPU stage's attention runs on the GPU: no CPU attention buffers there.
  uint64_t scratch(size_t d, bool head) const {
    return (head ? scratch_last : scratch_mid) + (dev[d].is_gpu() ? (head ? gpu_ops_last : gpu_ops_mid) - cpu_att : 0);
  }
};

struct Fill {
  std::vector<Block> blocks;
  uint32_t next = 0;  // units [0, next) are placed
};

// Fill the candidates in order, each with as many units as fit under its limit (and below its
// max_end), starting at unit `start`.
Fill fill(const Pricing& P, const std::vector<size_t>& cand, const std::vector<uint64_t>& limit,
          const std::vector<uint32_t>& max_end, uint32_t start, Fill acc = {}) {
  const uint32_t U = P.L + 1;
  acc.next = start;
  for (size_t d : cand) {
    if (acc.next >= U) break;
    uint32_t e = acc.next;
    while (e < U && e + 1 <= max_end[d] && P.cost(d, acc.next, e + 1) <= limit[d]) e++;
    if (e > acc.next) {
      acc.blocks.push_back({d, acc.next, e});
      acc.next = e;
    }
  }
  return acc;
}

// Units nobody could take go to the last candidate, over its budget: the plan then reports how
// much that device is short.
void place_leftover(Fill& f, const std::vector<size_t>& cand, uint32_t U) {
  if (f.next >= U) return;
  BATON_CHECK(!cand.empty());
  const size_t last = cand.back();
  if (!f.blocks.empty() && f.blocks.back().device == last) f.blocks.back().end = U;
  else f.blocks.push_back({last, f.next, U});
  f.next = U;
}

// Split n units into counts proportional to weights (largest remainder, ties to the earlier).
std::vector<uint32_t> proportional(uint32_t n, const std::vector<double>& w) {
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  std::vector<uint32_t> out(w.size(), 0);
  std::vector<std::pair<double, size_t>> rem;
  uint32_t given = 0;
  for (size_t i = 0; i < w.size(); i++) {
    const double exact = n * w[i] / sum;
    out[i] = uint32_t(std::floor(exact));
    given += out[i];
    rem.push_back({exact - out[i], i});
  }
  std::stable_sort(rem.begin(), rem.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (size_t k = 0; given < n; k++, given++) out[rem[k % rem.size()].second]++;
  return out;
}

}  // namespace

uint64_t Plan::total_bytes() const {
  uint64_t t = 0;
  for (const auto& s : stages) t += s.total_bytes();
  return t;
}

uint64_t Plan::kv_bytes() const {
  uint64_t t = 0;
  for (const auto& s : stages) t += s.kv_bytes;
  return t;
}

Plan plan(const ModelShape& shape, const std::vector<DeviceSpec>& devices_in, const PlanOptions& options) {
  PlanOptions o = options;
  std::vector<DeviceSpec> devices = devices_in;
  const size_t D = devices.size();
  const uint32_t L = shape.n_layer, U = L + 1;
  if (L == 0 || shape.layers.size() != L) fail(ErrorKind::Model, "model '{}' has no layers to place", shape.name);
  if (D == 0) fail(ErrorKind::Usage, "no devices to plan for");
  if (o.n_ctx == 0) fail(ErrorKind::Usage, "--ctx must be at least 1");
  if (o.n_parallel == 0) fail(ErrorKind::Usage, "--parallel must be at least 1");
  if (o.n_batch == 0) fail(ErrorKind::Usage, "--batch must be at least 1");
  if (!is_kv_type(o.kv_type)) fail(ErrorKind::Usage, "KV type {} is not supported (use f16 or q8_0)", type_name(o.kv_type));
  if (o.reserve.size() > 1 && o.reserve.size() != D)
    fail(ErrorKind::Usage, "--reserve has {} values for {} devices (give one value, or one per device)", o.reserve.size(), D);
  if (o.tensor_split.size() > D)
    fail(ErrorKind::Usage, "--tensor-split has {} proportions for {} devices", o.tensor_split.size(), D);
  for (double x : o.tensor_split)
    if (!(x >= 0) || !std::isfinite(x)) fail(ErrorKind::Usage, "--tensor-split proportions must be numbers >= 0");
  // A step never holds more tokens than the cache has cells.
  o.n_batch = uint32_t(std::min<uint64_t>(o.n_batch, uint64_t(o.n_ctx) * o.n_parallel));
  o.n_outputs = output_rows(o.n_outputs, o.n_batch);  // logit rows per step

  // --cpu-moe: every layer's experts in host memory, charged once to the first CPU entry.
  const bool cpu_moe_unused = o.cpu_moe && shape.n_expert == 0;  // warned below: the flag does nothing
  o.cpu_moe = o.cpu_moe && shape.n_expert > 0;
  uint64_t host_short = 0;
  size_t host_dev = 0;
  if (o.cpu_moe) {
    while (host_dev < D && devices[host_dev].is_gpu()) ++host_dev;
    if (host_dev == D) fail(ErrorKind::Usage, "--cpu-moe keeps the experts in host memory: --devices must list cpu");
    const uint64_t e = shape.expert_bytes();
    DeviceSpec& h = devices[host_dev];
    host_short = e > h.budget ? e - h.budget : 0;
    h.budget -= std::min(e, h.budget);
  }

  Plan p;
  p.model = shape.name;
  p.n_layer = L;
  p.options = o;
  p.devices = devices;
  if (o.cpu_moe) {
    p.host_expert_bytes = shape.expert_bytes();
    p.host_expert_device = host_dev;
  }
  const Pricing P(shape, devices, o);

  bool any_gpu = false, any_cpu = false;
  for (const auto& d : devices) (d.is_gpu() ? any_gpu : any_cpu) = true;
  // Candidates: every entry, or only the GPUs when spilling to the CPU is forbidden.
  std::vector<size_t> cand;
  for (size_t d = 0; d < D; d++)
    if (!(o.no_cpu_spill && any_gpu && !devices[d].is_gpu())) cand.push_back(d);
  const bool cpu_usable = any_cpu && !(o.no_cpu_spill && any_gpu);

  // n_gpu_layers: GPU entries may hold units [0, N) only; N >= n_layer leaves them uncapped.
  const bool capped = any_gpu && o.n_gpu_layers >= 0 && uint32_t(o.n_gpu_layers) < L;
  if (capped && !cpu_usable)
    fail(ErrorKind::Usage, "--n-gpu-layers {} leaves {} layers for the CPU, but {}", o.n_gpu_layers,
         L - uint32_t(o.n_gpu_layers), any_cpu ? "--no-cpu-spill forbids it" : "--devices lists no cpu");
  // With a GPU cap or --spread the GPU entries come first and the CPU entries after them, so the
  // layers the GPUs leave (and any overflow) land on the CPU at the end of the pipeline.
  if (capped || o.spread)
    std::stable_partition(cand.begin(), cand.end(), [&](size_t d) { return devices[d].is_gpu(); });
  std::vector<uint32_t> max_end(D, U);
  for (size_t d = 0; d < D; d++)
    if (capped && devices[d].is_gpu()) max_end[d] = uint32_t(o.n_gpu_layers);
  std::vector<uint64_t> budgets;
  for (const auto& d : devices) budgets.push_back(d.budget);

  std::string cap_note = capped ? fmt::format(" + n-gpu-layers {}", o.n_gpu_layers) : "";
  Fill f;
  const bool split = std::any_of(o.tensor_split.begin(), o.tensor_split.end(), [](double x) { return x > 0; });
  if (!o.tensor_split.empty() && !split) fail(ErrorKind::Usage, "--tensor-split gives every device 0");

  if (split) {
    // Layers by proportion over the entries; with a GPU cap the GPU entries share the first N and
    // the CPU entries the rest (by their proportions, or filled in order when they have none).
    p.policy = "tensor-split" + cap_note;
    std::vector<double> w(D, 0.0);
    for (size_t d = 0; d < o.tensor_split.size(); d++) w[d] = o.tensor_split[d];
    for (size_t d = 0; d < D; d++)
      if (o.no_cpu_spill && any_gpu && !devices[d].is_gpu() && w[d] > 0)
        fail(ErrorKind::Usage, "--tensor-split gives {} (entry {}) layers, but --no-cpu-spill forbids the CPU", devices[d].label, d);
    auto by_counts = [&](uint32_t begin, uint32_t n, std::vector<double> ws) {
      const auto counts = proportional(n, ws);
      for (size_t d = 0; d < D; d++) {
        if (counts[d] == 0) continue;
        f.blocks.push_back({d, begin, begin + counts[d]});
        begin += counts[d];
      }
      f.next = begin;
    };
    if (!capped) {
      by_counts(0, L, w);
      f.blocks.back().end = U;  // the head stays with the last layer
      f.next = U;
    } else {
      const uint32_t N = uint32_t(o.n_gpu_layers);
      std::vector<double> wg(D, 0.0), wc(D, 0.0);
      for (size_t d = 0; d < D; d++) (devices[d].is_gpu() ? wg : wc)[d] = w[d];
      if (N > 0) {
        if (std::accumulate(wg.begin(), wg.end(), 0.0) == 0)
          fail(ErrorKind::Usage, "--tensor-split gives the GPUs nothing, but --n-gpu-layers {} asks for GPU layers", N);
        by_counts(0, N, wg);
      }
      if (std::accumulate(wc.begin(), wc.end(), 0.0) > 0) {
        by_counts(f.next, L - N, wc);
        f.blocks.back().end = U;
        f.next = U;
      } else {
        std::vector<size_t> cpus;
        for (size_t d : cand)
          if (!devices[d].is_gpu()) cpus.push_back(d);
        f = fill(P, cpus, budgets, max_end, f.next, f);
        place_leftover(f, cpus, U);
      }
    }
  } else if (o.spread) {
    // Balance the GPUs (or, with none listed, every entry): the smallest equal fraction c of each
    // one's usable memory that still holds the group's units, found by bisection.
    p.policy = "spread" + cap_note;
    std::vector<size_t> group, rest;
    for (size_t d : cand) (!any_gpu || devices[d].is_gpu() ? group : rest).push_back(d);
    const uint32_t target = any_gpu && capped ? uint32_t(o.n_gpu_layers) : U;
    auto limits = [&](double c) {
      std::vector<uint64_t> lim(budgets);
      for (size_t d : group) {
        const uint64_t fixed = P.reserve[d] + shape.shared_bytes + P.scratch_mid;
        const uint64_t usable = budgets[d] > fixed ? budgets[d] - fixed : 0;
        lim[d] = std::min(budgets[d], fixed + uint64_t(c * double(usable)));
      }
      return lim;
    };
    if (fill(P, group, budgets, max_end, 0).next >= target) {
      double lo = 0, hi = 1;
      for (int it = 0; it < 60; it++) {
        const double mid = (lo + hi) / 2;
        (fill(P, group, limits(mid), max_end, 0).next >= target ? hi : lo) = mid;
      }
      f = fill(P, group, limits(hi), max_end, 0);
      f = fill(P, rest, budgets, max_end, f.next, f);
    } else {
      p.notes.push_back("--spread: the GPUs cannot hold their layers even when full; filled in order instead");
      f = fill(P, cand, budgets, max_end, 0);
    }
    place_leftover(f, cand, U);
  } else {
    p.policy = "fill" + cap_note;
    f = fill(P, cand, budgets, max_end, 0);
    place_leftover(f, cand, U);
    // An entry passed over for a later one: say what a single unit would have cost there.
    for (size_t k = 0; k < cand.size(); k++) {
      const size_t d = cand[k];
      auto later = std::find_if(f.blocks.begin(), f.blocks.end(), [&](const Block& b) {
        return std::find(cand.begin() + long(k) + 1, cand.end(), b.device) != cand.end();
      });
      const bool used = std::any_of(f.blocks.begin(), f.blocks.end(), [&](const Block& b) { return b.device == d; });
      if (used || later == f.blocks.end() || later->begin >= max_end[d]) continue;
      const uint64_t need = P.cost(d, later->begin, later->begin + 1);
      p.notes.push_back(fmt::format("{} (entry {}) holds nothing: {} there would take {} (reserve {}, scratch {}), its "
                                    "budget is {}", devices[d].label, d,
                                    later->begin == 0   ? std::string("the embedding and layer 0")
                                    : later->begin == L ? std::string("the output head")
                                                        : fmt::format("layer {}", later->begin),
                                    format_bytes(need), format_bytes(P.reserve[d]),
                                    format_bytes(P.scratch(d, later->begin + 1 > L) +
                                                 (devices[d].is_gpu() && later->begin > 0 ? P.gpu_link : 0)),
                                    format_bytes(devices[d].budget)));
    }
  }

  // The blocks must tile units [0, U) in order: an internal invariant of every policy above.
  BATON_CHECK(!f.blocks.empty() && f.blocks.front().begin == 0 && f.blocks.back().end == U);
  for (size_t i = 0; i < f.blocks.size(); i++) {
    BATON_CHECK(f.blocks[i].end > f.blocks[i].begin);
    if (i > 0) BATON_CHECK(f.blocks[i].begin == f.blocks[i - 1].end);
  }

  for (const Block& b : f.blocks) {
    Stage st;
    const DeviceSpec& dev = devices[b.device];
    st.device = b.device;
    st.label = dev.label;
    st.layer_begin = b.begin;
    st.layer_end = std::min(b.end, L);
    st.has_embedding = b.begin == 0;
    st.has_output = b.end > L;
    for (uint32_t i = st.layer_begin; i < st.layer_end; i++) {
      st.layer_weight_bytes += layer_bytes(shape, i, o);
      st.kv_bytes += P.kv[i];
    }
    st.embedding_bytes = st.has_embedding ? shape.embedding_bytes : 0;
    st.output_bytes = st.has_output ? shape.output_norm_bytes + (shape.tied_output && st.has_embedding ? 0 : shape.output_bytes) : 0;
    st.shared_bytes = shape.shared_bytes;
    st.scratch_bytes = P.scratch(b.device, st.has_output) + (dev.is_gpu() && !st.has_embedding ? P.gpu_link : 0);
    st.reserve_bytes = P.reserve[b.device];
    st.budget = dev.budget;
    BATON_CHECK(st.total_bytes() == P.cost(b.device, b.begin, b.end));
    uint64_t short_by = st.free_bytes() < 0 ? uint64_t(-st.free_bytes()) : 0;
    if (o.cpu_moe && b.device == host_dev) short_by += std::exchange(host_short, 0);
    if (short_by > 0) p.shortfalls.push_back({b.device, dev.label, short_by});
    p.stages.push_back(st);
  }
  if (host_short > 0) p.shortfalls.push_back({host_dev, devices[host_dev].label, host_short});  // no stage there
  p.fits = p.shortfalls.empty();
  if (o.cpu_moe)
    p.notes.push_back(fmt::format("--cpu-moe: {} of experts in host memory, charged to {} (entry {}): its budget "
                                  "shown is what is left for stages", format_bytes(p.host_expert_bytes),
                                  devices[host_dev].label, host_dev));

  for (const auto& d : devices)
    if (d.present && d.budget_given && d.free_bytes > 0 && d.budget > d.free_bytes)
      p.warnings.push_back(fmt::format("{}: budget {} is more than the {} free right now", d.label,
                                       format_bytes(d.budget), format_bytes(d.free_bytes)));
  if (cpu_moe_unused)
    p.warnings.push_back("--cpu-moe does nothing: the model has no experts (it is not a mixture of experts)");
  if (shape.n_ctx_train > 0 && o.n_ctx > shape.n_ctx_train)
    p.warnings.push_back(fmt::format("context {} is beyond the {} tokens the model was trained for (its output may "
                                     "degrade past them)", o.n_ctx, shape.n_ctx_train));
  if (o.n_batch != options.n_batch)
    p.notes.push_back(fmt::format("batch lowered to {}: a step cannot hold more tokens than the cache", o.n_batch));
  return p;
}

Plan plan_pipeline(const ModelShape& shape, const std::vector<DeviceSpec>& devices, const PlanOptions& options,
                   bool every_entry_shares) {
  if (!options.tensor_split.empty() || options.spread) return plan(shape, devices, options);
  if (options.auto_devices && !every_entry_shares) {
    Plan p = plan(shape, devices, options);
    std::vector<std::string> idle;
    for (size_t d = 0; d < devices.size(); d++)
      if (devices[d].is_gpu() && std::none_of(p.stages.begin(), p.stages.end(), [&](const Stage& st) { return st.device == d; }))
        idle.push_back(devices[d].label);
    if (p.fits && !idle.empty()) {
      p.notes.push_back(fmt::format("{} left idle: the GPUs before hold the model (--spread, or a list such as "
                                    "--devices cuda:0,cuda:1, splits it over every GPU for more batch throughput)",
                                    fmt::join(idle, ", ")));
      p.idle_gpus = std::move(idle);
    }
    return p;
  }
  const bool any_gpu = std::any_of(devices.begin(), devices.end(), [](const DeviceSpec& d) { return d.is_gpu(); });
  const bool any_cpu = std::any_of(devices.begin(), devices.end(), [](const DeviceSpec& d) { return !d.is_gpu(); });
  std::vector<size_t> sharing;  // the entries that share the work
  for (size_t d = 0; d < devices.size(); d++)
    if (every_entry_shares || !(any_gpu && any_cpu) || devices[d].is_gpu()) sharing.push_back(d);
  if (sharing.size() < 2) return plan(shape, devices, options);
  PlanOptions even = options;
  even.tensor_split.assign(devices.size(), 0.0);
  const std::vector<double> counts = balanced_split(shape, sharing.size());
  for (size_t k = 0; k < sharing.size(); k++) even.tensor_split[sharing[k]] = counts[k];
  Plan p = plan(shape, devices, even);
  constexpr std::string_view kSplit = "tensor-split";  // plan()'s name for a given split: this one is ours
  if (p.policy.starts_with(kSplit)) p.policy.replace(0, kSplit.size(), "equal work");
  if (p.fits) return p;
  Plan filled = plan(shape, devices, options);
  if (!filled.fits) return p;
  filled.notes.push_back("equal work per stage does not fit the budgets: the entries are filled in order");
  return filled;
}

std::vector<double> balanced_split(const ModelShape& shape, size_t n) {
  const size_t L = shape.layers.size();
  if (n == 0 || n > L) return std::vector<double>(n, 1.0);
  // best[k][i]: the smallest largest block when layers [0, i) form k blocks; the head rides with
  // layer L-1. O(n·L²) over at most a few hundred layers.
  // Work is multiply-adds per token (weight elements): the stages of a pipeline overlap when
  // several micro-batches are in flight, and a batch's decode is compute-bound in the packed
  // kernels, where a Q8_0 head costs per element what a Q4 layer does (its extra bytes do not).
  // Shapes without element counts fall back to bytes.
  const bool by_elems = shape.layer_elems_known();
  std::vector<uint64_t> prefix(L + 1, 0);
  for (size_t i = 0; i < L; i++)
    prefix[i + 1] = prefix[i] + (by_elems ? shape.layers[i].weight_elems : shape.layers[i].weight_bytes);
  const uint64_t head = by_elems ? shape.output_elems : shape.output_bytes;
  auto cost = [&](size_t a, size_t b) { return prefix[b] - prefix[a] + (b == L ? head : 0); };
  const uint64_t inf = UINT64_MAX;
  std::vector<std::vector<uint64_t>> best(n + 1, std::vector<uint64_t>(L + 1, inf));
  std::vector<std::vector<size_t>> cut(n + 1, std::vector<size_t>(L + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= n; k++)
    for (size_t i = k; i <= L; i++)
      for (size_t j = k - 1; j < i; j++) {
        if (best[k - 1][j] == inf) continue;
        const uint64_t m = std::max(best[k - 1][j], cost(j, i));
        if (m < best[k][i]) best[k][i] = m, cut[k][i] = j;
      }
  std::vector<double> counts(n);
  for (size_t k = n, i = L; k > 0; i = cut[k][i], k--) counts[k - 1] = double(i - cut[k][i]);
  return counts;
}

std::string shortfall_message(const Plan& p) {
  std::string out;
  for (const auto& s : p.shortfalls)
    out += fmt::format("{}{} (entry {}) is short by {} ({} bytes)", out.empty() ? "" : "; ", s.label, s.device,
                       format_bytes(s.bytes), s.bytes);
  return out;
}

std::string format_plan(const Plan& p, const ModelShape& s) {
  const PlanOptions& o = p.options;
  std::string out;
  out += fmt::format("model    {} ({}, {} layers, {} weights, vocab {}{}{})\n", s.name, s.architecture, s.n_layer,
                     format_bytes(s.total_weight_bytes()), s.n_vocab, s.tied_output ? ", tied head" : "",
                     s.n_expert ? fmt::format(", {} of {} experts per token", s.n_expert_used, s.n_expert) : "");
  const uint32_t rows = o.n_outputs ? o.n_outputs : o.n_batch;
  out += fmt::format("context  {} tokens x {} sequence{}, batch {} ({} logit row{}), KV {} ({} in all)\n", o.n_ctx,
                     o.n_parallel, o.n_parallel == 1 ? "" : "s", o.n_batch, rows, rows == 1 ? "" : "s",
                     o.kv_type == GgmlType::F16 ? "f16" : "q8_0", format_bytes(p.kv_bytes()));
  out += fmt::format("policy   {}\n\n", p.policy);
  out += fmt::format("{:<6}{:<10}{:<12}{:<6}{:>11}{:>11}{:>11}{:>11}{:>11}{:>11}{:>11}\n", "stage", "device", "layers",
                     "holds", "weights", "kv", "scratch", "reserve", "total", "budget", "free");
  for (size_t i = 0; i < p.stages.size(); i++) {
    const Stage& st = p.stages[i];
    const std::string layers = st.n_layers() == 0 ? "-" : fmt::format("{}-{}", st.layer_begin, st.layer_end - 1);
    const char* holds = st.has_embedding ? (st.has_output ? "EH" : "E") : (st.has_output ? "H" : "-");
    const int64_t fr = st.free_bytes();
    const std::string free = fr >= 0 ? format_bytes(uint64_t(fr)) : fmt::format("-{}", format_bytes(uint64_t(-fr)));
    out += fmt::format("{:<6}{:<10}{:<12}{:<6}{:>11}{:>11}{:>11}{:>11}{:>11}{:>11}{:>11}\n", i, st.label,
                       layers, holds, format_bytes(st.weight_bytes()), format_bytes(st.kv_bytes),
                       format_bytes(st.scratch_bytes), format_bytes(st.reserve_bytes), format_bytes(st.total_bytes()),
                       format_bytes(st.budget), free);
  }
  for (size_t d = 0; d < p.devices.size(); d++) {
    const bool used = std::any_of(p.stages.begin(), p.stages.end(), [&](const Stage& st) { return st.device == d; });
    if (!used) out += fmt::format("{:<6}{:<10}{:<12}{:<6}{:>77}\n", "-", p.devices[d].label, "unused", "-", format_bytes(p.devices[d].budget));
  }
  out += "\n(holds: E token embedding, H output head; layers inclusive; free = budget - total)\n";
  for (const auto& n : p.notes) out += fmt::format("note: {}\n", n);
  for (const auto& w : p.warnings) out += fmt::format("warning: {}\n", w);
  if (p.fits) out += fmt::format("fits: yes, {} stage{}, {} planned in all{}\n", p.stages.size(),
                                 p.stages.size() == 1 ? "" : "s", format_bytes(p.total_bytes() + p.host_expert_bytes),
                                 p.host_expert_bytes ? fmt::format(" ({} of experts in host memory)",
                                                                   format_bytes(p.host_expert_bytes)) : "");
  else out += fmt::format("fits: NO: {}\n", shortfall_message(p));
  return out;
}

nlohmann::json plan_to_json(const Plan& p, const ModelShape& s) {
  using nlohmann::json;
  const PlanOptions& o = p.options;
  json j;
  j["model"] = {{"name", s.name}, {"architecture", s.architecture}, {"n_layer", s.n_layer}, {"n_vocab", s.n_vocab},
                {"weight_bytes", s.total_weight_bytes()}, {"tied_output", s.tied_output}};
  if (s.n_expert) j["model"]["experts"] = {{"count", s.n_expert}, {"used", s.n_expert_used}, {"n_ff", s.n_ff_exp}};
  if (p.host_expert_bytes) j["host_experts"] = {{"bytes", p.host_expert_bytes}, {"device", p.host_expert_device}};
  j["options"] = {{"n_ctx", o.n_ctx}, {"n_parallel", o.n_parallel}, {"n_batch", o.n_batch},
                  {"n_outputs", o.n_outputs == 0 ? o.n_batch : o.n_outputs}, {"kv_type", o.kv_type == GgmlType::F16 ? "f16" : "q8_0"}, {"n_threads", o.n_threads}, {"n_gpu_layers", o.n_gpu_layers},
                  {"no_cpu_spill", o.no_cpu_spill}, {"spread", o.spread}, {"tensor_split", o.tensor_split},
                  {"reserve", o.reserve}};
  j["policy"] = p.policy;
  j["devices"] = json::array();
  for (const auto& d : p.devices)
    j["devices"].push_back({{"label", d.label}, {"kind", d.is_gpu() ? "cuda" : "cpu"}, {"index", d.index},
                            {"present", d.present}, {"budget", d.budget}, {"runtime_reserve", d.runtime_reserve},
                            {"total_bytes", d.total_bytes}, {"free_bytes", d.free_bytes}});
  j["stages"] = json::array();
  for (const auto& st : p.stages)
    j["stages"].push_back({{"device", st.device}, {"label", st.label}, {"layer_begin", st.layer_begin},
                           {"layer_end", st.layer_end}, {"has_embedding", st.has_embedding}, {"has_output", st.has_output},
                           {"weight_bytes", st.weight_bytes()}, {"layer_weight_bytes", st.layer_weight_bytes},
                           {"embedding_bytes", st.embedding_bytes}, {"output_bytes", st.output_bytes},
                           {"shared_bytes", st.shared_bytes}, {"kv_bytes", st.kv_bytes}, {"scratch_bytes", st.scratch_bytes},
                           {"reserve_bytes", st.reserve_bytes}, {"total_bytes", st.total_bytes()}, {"budget", st.budget},
                           {"free_bytes", st.free_bytes()}});
  j["fits"] = p.fits;
  j["shortfalls"] = json::array();
  for (const auto& sf : p.shortfalls) j["shortfalls"].push_back({{"device", sf.device}, {"label", sf.label}, {"bytes", sf.bytes}});
  j["notes"] = p.notes;
  j["warnings"] = p.warnings;
  return j;
}

}  // namespace baton
