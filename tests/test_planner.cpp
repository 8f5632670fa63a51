// The planner: exact bytes, contiguous in-order blocks, spills, overrides, refusals, and property
// tests against an independent cost model and a brute-force search.
#include <algorithm>
#include <functional>
#include <random>

#include <nlohmann/json.hpp>

#include "gguf/error.h"
#include "helpers.h"
#include "runtime/buffers.h"
#include "runtime/planner.h"

using namespace baton;

namespace {

constexpr uint64_t MiB = 1ull << 20, GiB = 1ull << 30;

DeviceSpec dev(DeviceKind kind, uint64_t budget, uint64_t reserve = 0) {
  DeviceSpec d;
  d.kind = kind;
  d.index = kind == DeviceKind::Cuda ? -1 : 0;
  d.present = false;
  d.label = kind == DeviceKind::Cuda ? "cuda" : "cpu";
  d.budget = budget;
  d.runtime_reserve = reserve;
  d.budget_given = true;
  return d;
}
DeviceSpec gpu(uint64_t budget, uint64_t reserve = 0) { return dev(DeviceKind::Cuda, budget, reserve); }
DeviceSpec cpu(uint64_t budget) { return dev(DeviceKind::Cpu, budget); }

// A small llama-like shape with hand-set byte counts (dims only matter for KV and scratch).
ModelShape toy(uint32_t L, uint64_t layer_bytes, uint64_t emb, bool tied, uint64_t out = 0) {
  ModelShape s;
  s.name = "toy";
  s.architecture = "llama";
  s.n_layer = L;
  s.n_embd = 64;
  s.n_head = 4;
  s.head_dim_k = s.head_dim_v = 16;
  s.n_ff = 128;
  s.n_vocab = 1000;
  s.n_ctx_train = 2048;
  s.layers.assign(L, LayerShape{2, 0, layer_bytes});
  s.embedding_bytes = emb;
  s.tied_output = tied;
  s.output_bytes = tied ? emb : out;
  s.output_norm_bytes = 256;
  return s;
}

// Independent cost of a stage, written from the definition in docs/PLACEMENT.md.
uint64_t stage_cost(const ModelShape& s, const PlanOptions& o, const DeviceSpec& d, uint64_t user_reserve,
                    uint32_t begin, uint32_t end, bool emb, bool head) {
  uint64_t c = d.runtime_reserve + user_reserve + s.shared_bytes;
  for (uint32_t i = begin; i < end; i++) c += s.layers[i].weight_bytes + kv_layer_bytes(s, i, o.n_ctx, o.n_parallel, o.kv_type);
  if (emb) c += s.embedding_bytes;
  if (head) c += s.output_norm_bytes + ((s.tied_output && emb) ? 0 : s.output_bytes);
  const uint32_t nb = std::min<uint64_t>(o.n_batch, uint64_t(o.n_ctx) * o.n_parallel);
  const uint32_t rows = o.n_outputs == 0 ? nb : std::min(o.n_outputs, nb);  // logit rows a step
  c += scratch_bytes(s, nb, head, o.kv_type, rows, o.n_threads);
  if (d.is_gpu()) c -= scratch_layout(s, nb, head, o.kv_type, rows, o.n_threads).att;  // CPU attention's
  if (d.is_gpu() && !emb) c += gpu_link_bytes(s, nb);  // a P2P link's slots may arrive here
  if (d.is_gpu() && head) c += gpu_sampling_bytes(s, rows);  // argmax ids, top-k candidates
  return c + (d.is_gpu() ? gpu_ops_scratch_bytes(s, nb, head, rows) : 0);  // the CUDA ops' shared scratch
}

// Structural checks every plan must pass.
void check_structure(const Plan& p, const ModelShape& s, const PlanOptions& o) {
  REQUIRE(!p.stages.empty());
  uint32_t next = 0;
  int emb = 0, head = 0;
  for (size_t i = 0; i < p.stages.size(); i++) {
    const Stage& st = p.stages[i];
    INFO("stage " << i << " [" << st.layer_begin << "," << st.layer_end << ")");
    REQUIRE(st.layer_begin == next);  // contiguous and in order: every layer exactly once
    REQUIRE(st.layer_end >= st.layer_begin);
    REQUIRE((st.n_layers() > 0 || st.has_output));
    next = st.layer_end;
    emb += st.has_embedding;
    head += st.has_output;
    REQUIRE(st.has_embedding == (i == 0));
    REQUIRE(st.has_output == (i + 1 == p.stages.size()));
    REQUIRE(st.budget == p.devices[st.device].budget);
    const uint64_t user = o.reserve.empty() ? 0 : o.reserve.size() == 1 ? o.reserve[0] : o.reserve[st.device];
    REQUIRE(st.total_bytes() ==
            stage_cost(s, o, p.devices[st.device], user, st.layer_begin, st.layer_end, st.has_embedding, st.has_output));
    if (i > 0) REQUIRE(st.device != p.stages[i - 1].device);
  }
  REQUIRE(next == s.n_layer);
  REQUIRE(emb == 1);
  REQUIRE(head == 1);
  bool over = false;
  for (const auto& st : p.stages) over |= st.free_bytes() < 0;
  REQUIRE(p.fits == !over);
  REQUIRE(p.shortfalls.empty() == p.fits);
  for (const auto& sf : p.shortfalls) {
    const auto it = std::find_if(p.stages.begin(), p.stages.end(), [&](const Stage& st) { return st.device == sf.device; });
    REQUIRE(it != p.stages.end());
    REQUIRE(sf.bytes == uint64_t(-it->free_bytes()));
  }
}

// Cost of the first-stage fixed parts and one layer, to size budgets in examples.
uint64_t per_layer(const ModelShape& s, const PlanOptions& o, uint32_t i = 0) {
  return s.layers[i].weight_bytes + kv_layer_bytes(s, i, o.n_ctx, o.n_parallel, o.kv_type);
}

}  // namespace

TEST_CASE("a model that fits on the first device stays there, with exact bytes") {
  const ModelShape s = shape_from_preset(find_preset("smollm2-135m"), GgmlType::Q8_0);
  PlanOptions o;
  o.n_ctx = 2048;
  const std::vector<DeviceSpec> d = {gpu(24 * GiB, 512 * MiB), gpu(24 * GiB, 512 * MiB)};
  const Plan p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE(p.fits);
  REQUIRE(p.stages.size() == 1);
  const Stage& st = p.stages[0];
  CHECK(st.device == 0);
  CHECK(st.layer_begin == 0);
  CHECK(st.layer_end == 30);
  // Tied head on the embedding's stage: the file's bytes, counted once.
  CHECK(st.weight_bytes() == s.total_weight_bytes());
  // KV: 30 layers × 2048 cells × 3 KV heads × (64 + 64) × 2 bytes.
  CHECK(st.kv_bytes == 30ull * 2048 * 3 * 128 * 2);
  // The forward's buffers and logits but not the CPU attention's per-thread buffers, and on a GPU
  // the CUDA ops' shared scratch: a 64 MiB FP16 weight slab (the head is larger) + 512 FP16
  // columns of the widest input (1536), in whole MiB.
  const ScratchLayout cpu_layout = scratch_layout(s, 512, true);
  CHECK(cpu_layout.att > 0);
  CHECK(st.scratch_bytes ==
        cpu_layout.total() - cpu_layout.att + gpu_ops_scratch_bytes(s, 512, true) + gpu_sampling_bytes(s, 512));
  CHECK(gpu_ops_scratch_bytes(s, 512, true) == 66 * MiB);
  // Sampling on the device: 512 argmax ids and 512 × 256 candidate ids and logits.
  CHECK(gpu_sampling_bytes(s, 512) == 512 * 4 + 2 * 512 * 256 * 4);
  CHECK(st.reserve_bytes == 512 * MiB);
  CHECK(st.free_bytes() == int64_t(24 * GiB) - int64_t(st.total_bytes()));

  // --spread uses both cards, in proportion to their memory.
  o.spread = true;
  const Plan q = plan(s, d, o);
  check_structure(q, s, o);
  REQUIRE(q.fits);
  REQUIRE(q.stages.size() == 2);
  // Filled to the same fraction of their memory: the totals differ by less than one unit (a
  // layer, or the head with its logits).
  const int64_t head_unit = int64_t(s.output_bytes + s.output_norm_bytes + scratch_layout(s, 512, true).logits);
  const int64_t unit = std::max<int64_t>(int64_t(per_layer(s, o)), head_unit);
  CHECK(std::llabs(int64_t(q.stages[0].total_bytes()) - int64_t(q.stages[1].total_bytes())) <= unit);
}

TEST_CASE("fill spills across two and three devices at exactly the right layer") {
  const ModelShape s = toy(12, 10 * MiB, 3 * MiB, false, 4 * MiB);
  PlanOptions o;
  o.n_ctx = 256;
  const uint64_t first4 = stage_cost(s, o, gpu(0), 0, 0, 4, true, false);
  const uint64_t mid4 = stage_cost(s, o, gpu(0), 0, 4, 8, false, false);
  SECTION("two devices") {
    // Device 0 holds exactly 4 layers (one byte short of a fifth), device 1 the rest.
    const std::vector<DeviceSpec> d = {gpu(first4 + per_layer(s, o) - 1), gpu(1 * GiB)};
    const Plan p = plan(s, d, o);
    check_structure(p, s, o);
    REQUIRE(p.fits);
    REQUIRE(p.stages.size() == 2);
    CHECK(p.stages[0].layer_end == 4);
    CHECK(p.stages[0].free_bytes() == int64_t(per_layer(s, o) - 1));
    CHECK(p.stages[1].layer_begin == 4);
    CHECK(p.stages[1].has_output);
  }
  SECTION("three devices, the head alone on the third") {
    const uint64_t last4 = stage_cost(s, o, gpu(0), 0, 8, 12, false, false);
    const std::vector<DeviceSpec> d = {gpu(first4), gpu(mid4), gpu(last4 + 1), gpu(1 * GiB)};
    const Plan p = plan(s, d, o);
    check_structure(p, s, o);
    REQUIRE(p.fits);
    REQUIRE(p.stages.size() == 4);
    CHECK(p.stages[0].free_bytes() == 0);  // a budget equal to the need is enough
    CHECK(p.stages[1].layer_begin == 4);
    CHECK(p.stages[2].layer_begin == 8);
    CHECK(p.stages[2].layer_end == 12);
    CHECK(p.stages[3].n_layers() == 0);  // the output head could not join layers 8-11
    CHECK(p.stages[3].has_output);
    CHECK(p.stages[3].output_bytes == s.output_bytes + s.output_norm_bytes);
  }
}

TEST_CASE("an entry passed over is explained with what one layer would take there") {
  const ModelShape s = toy(12, 10 * MiB, 3 * MiB, false, 4 * MiB);
  PlanOptions o;
  o.n_ctx = 256;
  o.n_batch = 64;
  const uint64_t first1 = stage_cost(s, o, gpu(0, 64 * MiB), 0, 0, 1, true, false);
  // The GPU is one byte short of the embedding and layer 0 (with its reserve): all goes to the CPU.
  const Plan p = plan(s, {gpu(first1 - 1, 64 * MiB), cpu(4 * GiB)}, o);
  check_structure(p, s, o);
  REQUIRE(p.fits);
  REQUIRE(p.stages.size() == 1);
  CHECK(p.stages[0].label == "cpu");
  for (const auto& n : p.notes) UNSCOPED_INFO(n);
  REQUIRE(p.notes.size() == 1);
  CHECK_THAT(p.notes[0], Catch::Contains("cuda (entry 0) holds nothing: the embedding and layer 0 there would take " +
                                         format_bytes(first1) + " (reserve 64.0 MiB"));
  // With one byte more it takes them, and no note; an unneeded entry at the end gets none either.
  const Plan q = plan(s, {gpu(first1, 64 * MiB), cpu(4 * GiB), cpu(4 * GiB)}, o);
  CHECK(q.stages[0].label == "cuda");
  CHECK(q.notes.empty());
  const Plan r = plan(s, {cpu(4 * GiB), gpu(1 * GiB)}, o);
  CHECK(r.stages.size() == 1);
  CHECK(r.notes.empty());
  // Every layer fits the first entry, the head neither it nor the second: the note names the head.
  const uint64_t layers = stage_cost(s, o, gpu(0), 0, 0, 12, true, false);
  const Plan h = plan(s, {gpu(layers), gpu(1 * MiB), gpu(1 * GiB)}, o);
  check_structure(h, s, o);
  REQUIRE(h.stages.size() == 2);
  CHECK(h.stages[1].device == 2);
  REQUIRE(h.notes.size() == 1);
  CHECK_THAT(h.notes[0], Catch::Contains("cuda (entry 1) holds nothing: the output head there would take"));
}

TEST_CASE("layers spill to the CPU, and --no-cpu-spill refuses instead") {
  const ModelShape s = shape_from_preset(find_preset("llama3-8b"), GgmlType::Q4_K);
  PlanOptions o;
  o.n_ctx = 8192;
  const std::vector<DeviceSpec> d = {gpu(3 * GiB, 512 * MiB), cpu(64 * GiB)};
  const Plan p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE(p.fits);
  REQUIRE(p.stages.size() == 2);
  CHECK(p.stages[0].label == "cuda");
  CHECK(p.stages[1].label == "cpu");
  CHECK(p.stages[0].n_layers() > 0);
  CHECK(p.stages[1].has_output);
  // The GPU is full: one more layer would not have fitted.
  CHECK(p.stages[0].free_bytes() < int64_t(per_layer(s, o, p.stages[0].layer_end)));

  o.no_cpu_spill = true;
  const Plan q = plan(s, d, o);
  check_structure(q, s, o);
  REQUIRE_FALSE(q.fits);
  REQUIRE(q.stages.size() == 1);  // everything forced onto the GPU, over its budget
  REQUIRE(q.shortfalls.size() == 1);
  CHECK(q.shortfalls[0].label == "cuda");
  CHECK(q.shortfalls[0].bytes == q.stages[0].total_bytes() - 3 * GiB);
  CHECK_THAT(shortfall_message(q), Catch::Contains("cuda (entry 0) is short by"));
}

TEST_CASE("a model that fits nowhere is refused with the device and the bytes") {
  const ModelShape s = shape_from_preset(find_preset("llama3-70b"), GgmlType::Q4_K);
  PlanOptions o;
  const std::vector<DeviceSpec> d = {gpu(16 * GiB, 576 * MiB), gpu(16 * GiB, 576 * MiB)};
  const Plan p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE_FALSE(p.fits);
  REQUIRE(p.shortfalls.size() == 1);
  CHECK(p.shortfalls[0].device == 1);  // the first card is full, the rest is charged to the last
  CHECK(p.stages[0].free_bytes() >= 0);
  CHECK(p.shortfalls[0].bytes == p.stages[1].total_bytes() - 16 * GiB);
  CHECK(p.stages[0].free_bytes() < int64_t(per_layer(s, o, p.stages[0].layer_end)));
  const std::string table = format_plan(p, s);
  CHECK_THAT(table, Catch::Contains("fits: NO"));
  CHECK_THAT(table, Catch::Contains(std::to_string(p.shortfalls[0].bytes) + " bytes"));
  const auto j = plan_to_json(p, s);
  CHECK(j["fits"] == false);
  CHECK(j["shortfalls"][0]["bytes"] == p.shortfalls[0].bytes);
  CHECK(j["stages"].size() == 2);
}

TEST_CASE("--tensor-split distributes layers by proportion") {
  const ModelShape s = toy(32, 8 * MiB, 2 * MiB, true);
  PlanOptions o;
  o.n_ctx = 512;
  std::vector<DeviceSpec> d = {gpu(10 * GiB), gpu(10 * GiB), cpu(10 * GiB)};
  o.tensor_split = {3, 1};
  Plan p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE(p.fits);
  REQUIRE(p.stages.size() == 2);
  CHECK(p.stages[0].n_layers() == 24);
  CHECK(p.stages[1].n_layers() == 8);
  CHECK(p.policy == "tensor-split");
  // Tied head on another stage than the embedding: a second copy of token_embd.
  CHECK(p.stages[1].output_bytes == s.embedding_bytes + s.output_norm_bytes);

  o.tensor_split = {1, 1, 1};  // 32 / 3: largest remainders go to the first entries
  p = plan(s, d, o);
  check_structure(p, s, o);
  CHECK(p.stages[0].n_layers() == 11);
  CHECK(p.stages[1].n_layers() == 11);
  CHECK(p.stages[2].n_layers() == 10);

  // An override is honoured and checked: a device pushed over its budget is reported.
  d[1].budget = 100 * MiB;
  o.tensor_split = {1, 3};
  p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE_FALSE(p.fits);
  REQUIRE(p.shortfalls.size() == 1);
  CHECK(p.shortfalls[0].device == 1);

  o.tensor_split = {0, 0};
  CHECK_THROWS_AS(plan(s, d, o), Error);
  o.tensor_split = {1, 1, 1, 1};
  CHECK_THROWS_AS(plan(s, d, o), Error);
}

TEST_CASE("--n-gpu-layers caps the GPU part, the rest goes to the CPU") {
  const ModelShape s = toy(20, 8 * MiB, 2 * MiB, false, 2 * MiB);
  PlanOptions o;
  o.n_ctx = 512;
  const std::vector<DeviceSpec> d = {gpu(10 * GiB), gpu(10 * GiB), cpu(10 * GiB)};
  o.n_gpu_layers = 7;
  Plan p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE(p.fits);
  REQUIRE(p.stages.size() == 2);
  CHECK(p.stages[0].layer_end == 7);
  CHECK(p.stages[1].label == "cpu");
  CHECK(p.stages[1].layer_begin == 7);

  o.n_gpu_layers = 0;
  p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE(p.stages.size() == 1);
  CHECK(p.stages[0].label == "cpu");

  o.n_gpu_layers = 20;  // every layer: the head may join them on the GPU
  p = plan(s, d, o);
  REQUIRE(p.stages.size() == 1);
  CHECK(p.stages[0].label == "cuda");

  // With a split: the GPUs share their 8 layers 3:1, the CPU takes the rest.
  o.n_gpu_layers = 8;
  o.tensor_split = {3, 1};
  p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE(p.stages.size() == 3);
  CHECK(p.stages[0].n_layers() == 6);
  CHECK(p.stages[1].n_layers() == 2);
  CHECK(p.stages[2].layer_begin == 8);
  CHECK(p.stages[2].label == "cpu");

  // No CPU to take the rest: a usage error, not a silent change.
  o.tensor_split.clear();
  CHECK_THROWS_AS(plan(s, {gpu(10 * GiB)}, o), Error);
  o.no_cpu_spill = true;
  CHECK_THROWS_AS(plan(s, d, o), Error);
}

TEST_CASE("--cpu-moe: every layer's experts charged once to the CPU entry, no stage's weights count them") {
  ModelShape s = toy(8, 100 * MiB, 4 * MiB, true);
  s.n_expert = 8;
  s.n_expert_used = 2;
  s.n_ff_exp = 128;
  for (auto& l : s.layers) l.expert_bytes = 80 * MiB;  // of the 100 MiB a layer holds
  PlanOptions o;
  o.n_ctx = 256;
  // A GPU too small for the layers with their experts holds all of them without.
  const std::vector<DeviceSpec> d = {gpu(500 * MiB), cpu(2 * GiB)};
  const Plan plain = plan(s, d, o);
  REQUIRE(plain.stages.size() == 2);  // the layers spill
  o.cpu_moe = true;
  const Plan p = plan(s, d, o);
  REQUIRE(p.fits);
  REQUIRE(p.stages.size() == 1);
  CHECK(p.devices[p.stages[0].device].is_gpu());
  CHECK(p.stages[0].layer_weight_bytes == 8 * 20 * MiB);
  CHECK(p.host_expert_bytes == 8 * 80 * MiB);
  CHECK(p.host_expert_device == 1);
  CHECK(p.devices[1].budget == 2 * GiB - 8 * 80 * MiB);  // what is left for stages there
  CHECK(p.stages[0].total_bytes() == stage_cost(s, p.options, d[0], 0, 0, 8, true, true) - 8 * 80 * MiB);
  // Experts that do not fit the host are a shortfall there, not an error.
  const Plan tight = plan(s, {gpu(500 * MiB), cpu(512 * MiB)}, o);
  CHECK_FALSE(tight.fits);
  REQUIRE(tight.shortfalls.size() == 1);
  CHECK(tight.shortfalls[0].device == 1);
  CHECK(tight.shortfalls[0].bytes == 8 * 80 * MiB - 512 * MiB);
  // No CPU entry to keep them: refused. A dense model ignores the flag.
  CHECK_THROWS_WITH(plan(s, {gpu(20 * GiB)}, o), Catch::Matchers::Contains("--devices must list cpu"));
  s.n_expert = 0;
  CHECK(plan(s, d, o).host_expert_bytes == 0);
}

TEST_CASE("a huge vocabulary: the head is bigger than a layer and is placed like one") {
  const ModelShape s = shape_from_preset(find_preset("gemma3-270m"), GgmlType::Q8_0);
  REQUIRE(s.tied_output);
  REQUIRE(s.output_bytes > 10 * s.layers[0].weight_bytes);
  PlanOptions o;
  o.n_ctx = 4096;
  // Device 0 fits the embedding and every layer but not the head (and its logits); device 1 takes
  // the head alone, with its own copy of the tied embedding matrix.
  const uint64_t all_layers = stage_cost(s, o, gpu(0), 0, 0, s.n_layer, true, false);
  const std::vector<DeviceSpec> d = {gpu(all_layers + 1 * MiB), gpu(2 * GiB)};
  const Plan p = plan(s, d, o);
  check_structure(p, s, o);
  REQUIRE(p.fits);
  REQUIRE(p.stages.size() == 2);
  CHECK(p.stages[0].layer_end == s.n_layer);
  CHECK(p.stages[1].n_layers() == 0);
  CHECK(p.stages[1].output_bytes == s.embedding_bytes + s.output_norm_bytes);
  CHECK(p.stages[1].scratch_bytes > p.stages[0].scratch_bytes);  // logits: 512 × 262144 floats
  // Stage 1 also keeps the slots of the peer-to-peer link from stage 0's GPU.
  CHECK(p.stages[1].scratch_bytes - p.stages[0].scratch_bytes ==
        512ull * 262144 * 4 + gpu_ops_scratch_bytes(s, 512, true) - gpu_ops_scratch_bytes(s, 512, false) +
            gpu_sampling_bytes(s, 512) + gpu_link_bytes(s, 512));
  // One logit row a step (what `baton run` asks): 511 rows of 262144 floats less, and the device
  // sampling's buffers for one row.
  PlanOptions one = o;
  one.n_outputs = 1;
  const Plan q = plan(s, d, one);
  check_structure(q, s, one);
  REQUIRE(q.stages.size() == 2);
  CHECK(q.options.n_outputs == 1);
  CHECK(p.options.n_outputs == 512);
  CHECK(q.stages[0].scratch_bytes == p.stages[0].scratch_bytes);
  CHECK(p.stages[1].scratch_bytes - q.stages[1].scratch_bytes ==
        511ull * 262144 * 4 + gpu_sampling_bytes(s, 512) - gpu_sampling_bytes(s, 1) +
            gpu_ops_scratch_bytes(s, 512, true) - gpu_ops_scratch_bytes(s, 512, true, 1));
}

TEST_CASE("sliding-window layers keep only the window in the KV cache") {
  const ModelShape s = shape_from_preset(find_preset("gemma3-1b"), GgmlType::Q4_K);
  int globals = 0;
  for (uint32_t i = 0; i < s.n_layer; i++) {
    CHECK(s.layers[i].sliding_window == ((i + 1) % 6 == 0 ? 0u : 512u));
    globals += s.layers[i].sliding_window == 0;
  }
  REQUIRE(globals == 4);  // layers 5, 11, 17, 23
  PlanOptions o;
  o.n_ctx = 8192;
  o.n_parallel = 2;
  const Plan p = plan(s, {cpu(16 * GiB)}, o);
  check_structure(p, s, o);
  // Per cell: 1 KV head × (256 + 256) × 2 bytes = 1 KiB. A ring keeps kRingRewind - 1 cells beyond
  // its window (the positions a rewind returns to).
  const uint64_t ring = 512 + kRingRewind - 1;
  CHECK(p.kv_bytes() == (22ull * ring + 4ull * 8192) * 2 * 1024);
  CHECK(kv_cells(s, 0, 8192, 2) == 2 * ring);
  CHECK(kv_cells(s, 5, 8192, 2) == 16384);
  CHECK(kv_cells(s, 0, 300, 1) == 300);  // a context shorter than the window
  o.kv_type = GgmlType::Q8_0;            // 34 bytes per 32 elements
  CHECK(plan(s, {cpu(16 * GiB)}, o).kv_bytes() == (22ull * ring + 4ull * 8192) * 2 * (512 / 32 * 34));
}

TEST_CASE("reserve, batch clamp and option errors") {
  const ModelShape s = toy(4, 1 * MiB, 1 * MiB, true);
  PlanOptions o;
  o.n_ctx = 64;
  o.n_batch = 512;
  o.reserve = {100 * MiB};
  Plan p = plan(s, {cpu(1 * GiB)}, o);
  check_structure(p, s, o);
  CHECK(p.options.n_batch == 64);  // a step never holds more tokens than the cache
  CHECK(p.stages[0].reserve_bytes == 100 * MiB);
  o.reserve = {1, 2, 3};
  CHECK_THROWS_AS(plan(s, {cpu(1 * GiB)}, o), Error);
  o.reserve.clear();
  o.n_ctx = 0;
  CHECK_THROWS_AS(plan(s, {cpu(1 * GiB)}, o), Error);
  o.n_ctx = 64;
  o.kv_type = GgmlType::Q4_0;
  CHECK_THROWS_AS(plan(s, {cpu(1 * GiB)}, o), Error);
  o.kv_type = GgmlType::F16;
  CHECK_THROWS_AS(plan(s, {}, o), Error);
}

TEST_CASE("a context beyond the trained one and a budget above free memory are warnings, not notes") {
  ModelShape s = toy(4, 1 * MiB, 1 * MiB, true);
  s.n_ctx_train = 128;
  PlanOptions o;
  o.n_ctx = 128;
  o.n_batch = 64;
  DeviceSpec c = cpu(1 * GiB);
  c.present = true;
  c.free_bytes = 2 * GiB;
  CHECK(plan(s, {c}, o).warnings.empty());
  o.n_ctx = 129;
  c.free_bytes = 512 * MiB;
  const Plan p = plan(s, {c}, o);
  REQUIRE(p.fits);
  REQUIRE(p.warnings.size() == 2);
  CHECK_THAT(p.warnings[0], Catch::Contains("budget 1.00 GiB is more than the 512 MiB free right now"));
  CHECK_THAT(p.warnings[1], Catch::Contains("context 129 is beyond the 128 tokens the model was trained for"));
  CHECK(p.notes.empty());
  CHECK_THAT(format_plan(p, s), Catch::Contains("warning: context 129"));
  CHECK(plan_to_json(p, s)["warnings"].size() == 2);
}

// ---- properties -------------------------------------------------------------------------------

namespace {

ModelShape random_shape(std::mt19937_64& rng) {
  auto pick = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  ModelShape s = toy(uint32_t(pick(1, 40)), 0, pick(1, 64) * MiB, pick(0, 1) == 1, pick(1, 64) * MiB);
  s.n_embd = uint32_t(pick(1, 16) * 32);
  s.n_head = uint32_t(pick(1, 8));
  s.head_dim_k = s.head_dim_v = uint32_t(pick(1, 4) * 32);
  s.n_ff = uint32_t(pick(1, 32) * 32);
  s.n_vocab = uint32_t(pick(300, 200000));
  s.shared_bytes = pick(0, 1) ? pick(0, 4096) : 0;
  const uint32_t window = pick(0, 1) ? uint32_t(pick(16, 1024)) : 0;
  for (uint32_t i = 0; i < s.n_layer; i++) {
    s.layers[i].weight_bytes = pick(1, 80) * MiB + pick(0, 4095);
    s.layers[i].n_head_kv = uint32_t(pick(1, s.n_head));
    s.layers[i].sliding_window = window && !layer_is_global(i, 3) ? window : 0;
  }
  return s;
}

// Does any in-order assignment of contiguous blocks (each device at most one, devices may be
// skipped) fit? Exhaustive; only for small models.
bool brute_force_fits(const ModelShape& s, const std::vector<DeviceSpec>& d, const PlanOptions& o,
                      const std::vector<size_t>& cand) {
  const uint32_t U = s.n_layer + 1;
  std::function<bool(size_t, uint32_t)> go = [&](size_t k, uint32_t begin) -> bool {
    if (begin == U) return true;
    if (k == cand.size()) return false;
    if (go(k + 1, begin)) return true;  // skip this device
    for (uint32_t end = begin + 1; end <= U; end++) {
      const bool head = end == U;
      const uint64_t c = stage_cost(s, o, d[cand[k]], 0, begin, std::min(end, s.n_layer), begin == 0, head);
      if (c <= d[cand[k]].budget && go(k + 1, end)) return true;
    }
    return false;
  };
  return go(0, 0);
}

}  // namespace

TEST_CASE("property: random shapes and budgets give well-formed, honest plans") {
  std::mt19937_64 rng(20261202);
  auto pick = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  int fitted = 0, refused = 0, usage = 0;
  for (int iter = 0; iter < 1500; iter++) {
    const ModelShape s = random_shape(rng);
    std::vector<DeviceSpec> d;
    const size_t n_dev = pick(1, 4);
    for (size_t k = 0; k < n_dev; k++) {
      const bool g = pick(0, 2) > 0;
      const uint64_t budget = pick(10, 3000) * MiB + pick(0, MiB);
      d.push_back(g ? gpu(budget, pick(0, 1) ? pick(0, 300) * MiB : 0) : cpu(budget));
    }
    PlanOptions o;
    o.n_ctx = uint32_t(pick(1, 4096));
    o.n_parallel = uint32_t(pick(1, 4));
    o.n_batch = uint32_t(pick(1, 1024));
    if (pick(0, 1)) o.n_outputs = uint32_t(pick(1, 1100));
    o.kv_type = pick(0, 1) ? GgmlType::F16 : GgmlType::Q8_0;
    const int mode = int(pick(0, 5));
    if (mode == 1) o.spread = true;
    if (mode == 2) o.no_cpu_spill = true;
    if (mode == 3) o.n_gpu_layers = int(pick(0, s.n_layer + 1));
    if (mode == 4)
      for (size_t k = 0; k < pick(1, n_dev); k++) o.tensor_split.push_back(double(pick(0, 4)));
    if (mode == 5 && pick(0, 1)) o.reserve = {pick(0, 64) * MiB};
    INFO("iteration " << iter << " mode " << mode << " layers " << s.n_layer << " devices " << n_dev);
    Plan p;
    try {
      p = plan(s, d, o);
    } catch (const Error& e) {
      usage++;
      // Only contradictory overrides are errors: GPU layers capped with no CPU to take the rest,
      // or a split that gives every device 0.
      INFO(e.what());
      const bool has_cpu = std::any_of(d.begin(), d.end(), [](auto& x) { return !x.is_gpu(); });
      const bool has_gpu = std::any_of(d.begin(), d.end(), [](auto& x) { return x.is_gpu(); });
      const bool capped_no_cpu = mode == 3 && has_gpu && !has_cpu && uint32_t(o.n_gpu_layers) < s.n_layer;
      const bool split_zero = mode == 4 && std::all_of(o.tensor_split.begin(), o.tensor_split.end(), [](double x) { return x == 0; });
      REQUIRE((capped_no_cpu || split_zero));
      continue;
    }
    check_structure(p, s, o);
    if (p.fits) {
      fitted++;
      for (const auto& st : p.stages) REQUIRE(st.total_bytes() <= st.budget);
    } else {
      refused++;
    }
    if (mode == 0 || mode == 2) {
      // Fill: every stage but the last is full (its next unit would not have fitted)...
      for (size_t i = 0; i + 1 < p.stages.size(); i++) {
        const Stage& st = p.stages[i];
        const uint32_t end = st.has_output ? s.n_layer + 1 : st.layer_end;
        const bool next_is_head = end == s.n_layer;
        const uint64_t grown = stage_cost(s, o, d[st.device], 0, st.layer_begin, next_is_head ? s.n_layer : end + 1,
                                          st.has_embedding, next_is_head);
        REQUIRE(grown > st.budget);
      }
      // ...and it refuses only when no in-order contiguous placement exists at all.
      if (s.n_layer <= 6) {
        std::vector<size_t> cand;
        bool any_gpu = false;
        for (const auto& x : d) any_gpu |= x.is_gpu();
        for (size_t k = 0; k < d.size(); k++)
          if (!(mode == 2 && any_gpu && !d[k].is_gpu())) cand.push_back(k);
        REQUIRE(p.fits == brute_force_fits(s, d, o, cand));
      }
      // A model that fits on the first candidate alone stays there.
      const bool first_is_candidate = mode == 0 || d[0].is_gpu() ||
                                      std::none_of(d.begin(), d.end(), [](auto& x) { return x.is_gpu(); });
      if (first_is_candidate && stage_cost(s, o, d[0], 0, 0, s.n_layer, true, true) <= d[0].budget)
        REQUIRE(p.stages.size() == 1);
    }
    if (mode == 1 && std::is_partitioned(d.begin(), d.end(), [](auto& x) { return x.is_gpu(); })) {
      // Spreading never refuses what filling would fit; when the GPUs hold everything, it fills
      // them at most as unevenly: its largest used fraction of a device's usable memory is no
      // larger than fill's (the fraction spread minimises; fill's placement is one candidate).
      PlanOptions f = o;
      f.spread = false;
      const Plan q = plan(s, d, f);
      REQUIRE(p.fits == q.fits);
      auto max_fraction = [&](const Plan& x) {
        double m = 0;
        for (const auto& st : x.stages) {
          const double fixed = double(st.reserve_bytes + st.shared_bytes + scratch_bytes(s, x.options.n_batch, false, o.kv_type));
          m = std::max(m, (double(st.total_bytes()) - fixed) / (double(st.budget) - fixed));
        }
        return m;
      };
      const bool gpus_only = std::all_of(q.stages.begin(), q.stages.end(), [&](auto& st) { return d[st.device].is_gpu(); });
      if (q.fits && gpus_only) REQUIRE(max_fraction(p) <= max_fraction(q) + 1e-9);
    }
    if (mode == 3 && o.n_gpu_layers >= 0 && uint32_t(o.n_gpu_layers) < s.n_layer) {
      uint32_t on_gpu = 0;
      for (const auto& st : p.stages)
        if (d[st.device].is_gpu()) on_gpu += st.n_layers() + st.has_output;
      REQUIRE(on_gpu <= uint32_t(o.n_gpu_layers));
    }
  }
  // The generator must exercise both outcomes (and some refusals of contradictory options).
  CHECK(fitted > 100);
  CHECK(refused > 100);
  CHECK(usage > 0);
}

TEST_CASE("plans of the preset shapes are printable as a table and JSON") {
  for (const auto& pr : shape_presets()) {
    const ModelShape s = shape_from_preset(pr, GgmlType::Q4_K);
    PlanOptions o;
    const Plan p = plan(s, {gpu(24 * GiB, 576 * MiB), gpu(24 * GiB, 576 * MiB), cpu(64 * GiB)}, o);
    check_structure(p, s, o);
    CHECK(p.fits);
    const auto j = plan_to_json(p, s);
    CHECK(j["stages"].size() == p.stages.size());
    CHECK(j["stages"][0]["layer_begin"] == 0);
    CHECK(j["stages"].back()["layer_end"] == s.n_layer);
    CHECK_THAT(format_plan(p, s), Catch::Contains(pr.name));
  }
}

TEST_CASE("balanced_split gives CPU stages equal work, the head counted with the last") {
  ModelShape s;
  s.n_layer = 10;
  s.layers.assign(10, LayerShape{1, 0, 100});
  s.output_bytes = 400;  // the head weighs four layers
  // 1400 bytes over 2 stages: 7 layers | 3 layers + head (700 each).
  CHECK(balanced_split(s, 2) == std::vector<double>{7, 3});
  // Over 3: the best largest block is 500 (5 | 4 | 1 + head).
  const auto three = balanced_split(s, 3);
  REQUIRE(three.size() == 3);
  CHECK(three[0] + three[1] + three[2] == 10);
  CHECK(three[2] == 1);
  s.output_bytes = 0;
  CHECK(balanced_split(s, 2) == std::vector<double>{5, 5});
  CHECK(balanced_split(s, 1) == std::vector<double>{10});
  CHECK(balanced_split(s, 11) == std::vector<double>(11, 1.0));  // more stages than layers
}

TEST_CASE("balanced_split weighs multiply-adds, not bytes, when the shape has element counts") {
  // SmolLM2-like: a Q8_0 head of 8 layers' elements but 14 layers' bytes (1.7 bytes per element
  // against ~0.6 for Q4 layers). By bytes the cut would be 22 | 8 + head; by work it is 19 | 11 + head.
  ModelShape s;
  s.n_layer = 30;
  s.layers.assign(30, LayerShape{3, 0, 2200, 3540});
  s.output_bytes = 30000;
  s.output_elems = 28300;
  CHECK(balanced_split(s, 2) == std::vector<double>{19, 11});
  for (auto& l : s.layers) l.weight_elems = 0;  // no element counts: bytes decide
  CHECK(balanced_split(s, 2) == std::vector<double>{22, 8});
}

TEST_CASE("a pipeline's plan takes equal work per stage when it fits, else fills in order") {
  const ModelShape s = shape_from_preset(find_preset("llama3-8b"), GgmlType::Q4_0);
  PlanOptions o;
  o.n_ctx = 64;
  o.n_batch = 64;
  // Two roomy entries of one kind: equal work (the head counts with the second stage's layers).
  for (const auto& two : {std::vector<DeviceSpec>{gpu(40 * GiB, 512 * MiB), gpu(40 * GiB, 512 * MiB)},
                          std::vector<DeviceSpec>{cpu(64 * GiB), cpu(64 * GiB)}}) {
    const Plan even = plan_pipeline(s, two, o);
    check_structure(even, s, o);
    REQUIRE(even.fits);
    REQUIRE(even.stages.size() == 2);
    CHECK(even.policy == "equal work");
    CHECK(even.stages[0].n_layers() >= 16);
    CHECK(even.stages[1].n_layers() >= 12);
  }
  // A GPU and the CPU: the GPU holds what it can, the CPU is the spill. A roomy GPU takes it all
  // (equal work would have put half of the layers on the far slower CPU).
  const Plan gpu_only = plan_pipeline(s, {gpu(40 * GiB, 512 * MiB), cpu(64 * GiB)}, o);
  check_structure(gpu_only, s, o);
  REQUIRE(gpu_only.fits);
  REQUIRE(gpu_only.stages.size() == 1);
  CHECK(gpu_only.devices[gpu_only.stages[0].device].is_gpu());
  CHECK(gpu_only.policy == "fill");
  // MPI ranks (every_entry_shares): a GPU rank and a CPU rank each serve a stage of equal work.
  const Plan ranks = plan_pipeline(s, {gpu(40 * GiB, 512 * MiB), cpu(64 * GiB)}, o, /*every_entry_shares=*/true);
  check_structure(ranks, s, o);
  REQUIRE(ranks.fits);
  REQUIRE(ranks.stages.size() == 2);
  CHECK(ranks.policy == "equal work");
  // Two GPUs and the CPU: the GPUs share the work, the CPU takes none while they hold it all.
  const Plan two_gpus = plan_pipeline(s, {gpu(40 * GiB, 512 * MiB), gpu(40 * GiB, 512 * MiB), cpu(64 * GiB)}, o);
  check_structure(two_gpus, s, o);
  REQUIRE(two_gpus.fits);
  REQUIRE(two_gpus.stages.size() == 2);
  CHECK(two_gpus.policy == "equal work");
  for (const Stage& st : two_gpus.stages) CHECK(two_gpus.devices[st.device].is_gpu());
  CHECK(two_gpus.stages[0].n_layers() >= 16);
  // A GPU of 2 GiB cannot hold the model: it takes what fits, the CPU the rest (as the GPU
  // check's `cuda:0=2GiB,cpu` run on an H200).
  const std::vector<DeviceSpec> small = {gpu(2 * GiB, 512 * MiB), cpu(64 * GiB)};
  const Plan filled = plan_pipeline(s, small, o);
  check_structure(filled, s, o);
  REQUIRE(filled.fits);
  REQUIRE(filled.stages.size() == 2);
  CHECK(filled.stages[0].n_layers() > 0);
  CHECK(filled.stages[0].n_layers() < 16);
  CHECK(filled.stages[0].free_bytes() < int64_t(per_layer(s, o, filled.stages[0].layer_end)));
  // Two GPUs of 2 GiB and the CPU: equal work on the GPUs does not fit, so the entries fill in
  // order, and the plan says so.
  const Plan spilled = plan_pipeline(s, {gpu(2 * GiB, 512 * MiB), gpu(2 * GiB, 512 * MiB), cpu(64 * GiB)}, o);
  check_structure(spilled, s, o);
  REQUIRE(spilled.fits);
  REQUIRE(spilled.stages.size() == 3);
  CHECK_THAT(format_plan(spilled, s), Catch::Contains("filled in order"));
  // An explicit split is taken as it is, even when it does not fit.
  o.tensor_split = {1, 1};
  CHECK_FALSE(plan_pipeline(s, small, o).fits);
}

TEST_CASE("--devices auto fills in order: a model one GPU holds stays there; --spread uses them all") {
  const ModelShape s = shape_from_preset(find_preset("llama3-8b"), GgmlType::Q4_0);
  PlanOptions o;
  o.n_ctx = 64;
  o.n_batch = 64;
  o.auto_devices = true;
  const std::vector<DeviceSpec> two = {gpu(40 * GiB, 512 * MiB), gpu(40 * GiB, 512 * MiB), cpu(64 * GiB)};
  const Plan one = plan_pipeline(s, two, o);
  check_structure(one, s, o);
  REQUIRE(one.fits);
  REQUIRE(one.stages.size() == 1);
  CHECK(one.stages[0].device == 0);
  CHECK(one.policy == "fill");
  CHECK_THAT(format_plan(one, s), Catch::Contains("cuda left idle") && Catch::Contains("--spread"));
  CHECK(one.idle_gpus == std::vector<std::string>{"cuda"});  // what loading for several sequences prints
  // Small GPUs: the model spills from the first GPU to the second, then to the CPU; nothing idle.
  const Plan spill = plan_pipeline(s, {gpu(2 * GiB, 512 * MiB), gpu(2 * GiB, 512 * MiB), cpu(64 * GiB)}, o);
  check_structure(spill, s, o);
  REQUIRE(spill.fits);
  REQUIRE(spill.stages.size() == 3);
  CHECK(spill.stages[0].free_bytes() < int64_t(per_layer(s, o, spill.stages[0].layer_end)));
  CHECK_THAT(format_plan(spill, s), !Catch::Contains("idle"));
  CHECK(spill.idle_gpus.empty());
  // --spread: both GPUs, no note.
  o.spread = true;
  const Plan spread = plan_pipeline(s, two, o);
  REQUIRE(spread.fits);
  CHECK(spread.stages.size() == 2);
  CHECK_THAT(format_plan(spread, s), !Catch::Contains("idle"));
  CHECK(spread.idle_gpus.empty());
  // MPI ranks share the work whatever the list came from.
  o.spread = false;
  CHECK(plan_pipeline(s, two, o, /*every_entry_shares=*/true).stages.size() == 3);
}
