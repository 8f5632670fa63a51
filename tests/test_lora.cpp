// LoRA adapters (runtime/lora.h): a model with adapters gives the logits of the same model with the
// adapters merged into its weights (W + s·B·A, computed here in double and written as F32), for a
// llama-shaped model and a phi3-shaped one (fused q/k/v and gate/up: one pair split with its
// tensor), several adapters add up, a scale of 0 changes no bit, the planner and the stages count
// the adapters' bytes, and every malformed adapter is refused with a message naming the problem.
// Control vectors (runtime/control_vector.h; their sums checked against a float reference in
// test_model_tiny): a GPU stage adds them as a CPU stage does, the CLI takes them, bad files and
// flags are refused.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <random>

#include "gguf/gguf.h"
#include "helpers.h"
#include "quant/quant.h"
#include "runtime/lora.h"
#include "runtime/pipeline.h"
#include "runtime/synth.h"
#include "tests/cli_helpers.h"

using namespace baton;

namespace {

// 2 layers, untied head, F32 weights (a merged model then holds W + s·B·A exactly).
const ShapePreset kLlama{"lora-llama", "llama", "test", 2, 128, 4, 2, 32, 256, 400, 2048, false, 0, 0, 1e4f, 1e-5f, false};
const ShapePreset kPhi3{"lora-phi3", "phi3", "test", 2, 128, 4, 2, 32, 256, 400, 2048, false, 0, 0, 1e4f, 1e-5f, false};

std::string base_model(const ShapePreset& shape) {
  const std::string path = test::temp_dir() + "/" + shape.name + ".gguf";
  SynthOptions o;
  o.type = GgmlType::F32;
  o.seed = 11;
  synth_write(shape, o, path);
  return path;
}

std::string write_adapter(const std::string& base, const std::string& name, const LoraSynthOptions& opt) {
  const auto f = gguf::File::open(base);
  const std::string path = test::temp_dir() + "/" + name + ".gguf";
  lora_synth_writer(*f, opt).write(path);
  return path;
}

std::vector<float> rows_of(const gguf::TensorInfo& t) {
  std::vector<float> v(size_t(t.nelements()));
  for (int64_t r = 0; r < t.nrows(); ++r)
    dequantize_row(t.type, t.data + size_t(r) * row_bytes(t.type, t.ne[0]), v.data() + size_t(r * t.ne[0]), t.ne[0]);
  return v;
}

// The base with each adapter (path, user scale) merged into its F32 weights.
std::string merged_model(const std::string& base, const std::vector<LoraFile>& adapters, const std::string& name) {
  const auto f = gguf::File::open(base);
  std::map<std::string, std::vector<double>> w;  // adapted tensors, merged so far
  for (const LoraFile& lf : adapters) {
    const auto a = gguf::File::open(lf.path);
    const float alpha = a->get_or<float>("adapter.lora.alpha", 0.f);
    for (const auto& t : a->tensors()) {
      if (t.name.size() < 7 || t.name.substr(t.name.size() - 7) != ".lora_a") continue;
      const std::string target = t.name.substr(0, t.name.size() - 7);
      const gguf::TensorInfo& bt = a->require_tensor(target + ".lora_b");
      const gguf::TensorInfo& wt = f->require_tensor(target);
      REQUIRE(wt.type == GgmlType::F32);
      if (!w.count(target)) {
        const float* p = reinterpret_cast<const float*>(wt.data);
        w[target].assign(p, p + wt.nelements());
      }
      const std::vector<float> A = rows_of(t), B = rows_of(bt);
      const int64_t r = bt.ne[0], cols = wt.ne[0], rows = wt.ne[1];
      const double s = alpha != 0.f ? double(lf.scale) * alpha / double(r) : lf.scale;
      std::vector<double>& W = w[target];
      const bool embd = target == "token_embd.weight";  // A [r, n_vocab], B [r, n_embd]
      for (int64_t o = 0; o < rows; ++o)
        for (int64_t i = 0; i < cols; ++i) {
          double d = 0;
          for (int64_t k = 0; k < r; ++k)
            d += embd ? double(B[size_t(i * r + k)]) * A[size_t(o * r + k)]
                      : double(B[size_t(o * r + k)]) * A[size_t(k * cols + i)];
          W[size_t(o * cols + i)] += s * d;
        }
    }
  }
  gguf::Writer out;
  for (const auto& [k, v] : f->metadata()) out.set(k, v);
  for (const auto& t : f->tensors()) {
    std::vector<int64_t> dims(t.ne, t.ne + t.n_dims);
    const auto it = w.find(t.name);
    if (it == w.end()) {
      out.add_tensor(t.name, t.type, dims, t.data, t.nbytes);
    } else {
      const std::vector<float> merged(it->second.begin(), it->second.end());
      out.add_tensor(t.name, GgmlType::F32, dims, merged.data(), merged.size() * sizeof(float));
    }
  }
  const std::string path = test::temp_dir() + "/" + name + ".gguf";
  out.write(path);
  return path;
}

constexpr int kTokens = 12;

// Every position's logits for a fixed prompt (`split`: the layers shared evenly by the devices).
std::vector<float> logits(const std::string& model, const std::vector<LoraFile>& lora, const std::string& devices = "cpu",
                          bool split = false) {
  LoadOptions o;
  o.n_ctx = 64;
  o.n_threads = 2;
  o.devices = devices;
  o.lora = lora;
  if (split) o.tensor_split.assign(size_t(std::count(devices.begin(), devices.end(), ',') + 1), 1.0);
  const auto p = Pipeline::load(model, o);
  for (const StageInfo& st : p->stages()) {  // planned as held (the adapters' bytes on either kind of device)
    CHECK(st.planned_bytes >= st.measured_bytes);
    CHECK(st.planned_bytes - st.measured_bytes <= std::max<uint64_t>(st.planned_bytes * 3 / 100, uint64_t(64) << 20));
  }
  Batch b;
  for (int i = 0; i < kTokens; ++i) b.add(int32_t(7 + 23 * i % 390), i, 0, kLogitsRow);
  std::vector<float> out(size_t(kTokens) * size_t(p->n_vocab()));
  p->decode(b, out.data());
  return out;
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

std::vector<std::string> every_matrix(int n_layer, const std::vector<std::string>& per_layer) {
  std::vector<std::string> names = {"token_embd.weight", "output.weight"};
  for (int l = 0; l < n_layer; ++l)
    for (const std::string& t : per_layer) names.push_back("blk." + std::to_string(l) + "." + t + ".weight");
  return names;
}

// The two shapes the merged-weights tests adapt, with their per-layer matrices (phi3's fused).
struct AdaptedShape {
  ShapePreset shape;
  std::vector<std::string> per_layer;
};
const AdaptedShape kAdaptedShapes[] = {
    {kLlama, {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}},
    {kPhi3, {"attn_qkv", "attn_output", "ffn_up", "ffn_down"}},
};
// A rank-8 F16 adapter (the type adapters come in, and the one they are multiplied in) with alpha
// 16 on every matrix of each layer, the embedding and the head.
LoraSynthOptions every_matrix_adapter(const AdaptedShape& as) {
  LoraSynthOptions lo;
  lo.targets = every_matrix(int(as.shape.n_layer), as.per_layer);
  lo.rank = 8;
  lo.alpha = 16;
  lo.type = GgmlType::F16;
  lo.seed = 3;
  return lo;
}

std::string error_of(const std::string& model, const std::vector<LoraFile>& lora) {
  try {
    logits(model, lora);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("lora: an adapted model gives the merged model's logits (llama; phi3's fused tensors split)") {
  for (const AdaptedShape& as : kAdaptedShapes) {
    const ShapePreset& shape = as.shape;
    INFO(shape.name);
    const std::string base = base_model(shape);
    const LoraSynthOptions lo = every_matrix_adapter(as);
    const std::string a = write_adapter(base, std::string(shape.name) + "-a", lo);
    const std::vector<LoraFile> adapters = {{a, 0.7f}};
    const std::vector<float> plain = logits(base, {}), adapted = logits(base, adapters);
    const std::vector<float> merged = logits(merged_model(base, adapters, std::string(shape.name) + "-merged"), {});
    const float moved = max_diff(plain, merged), off = max_diff(adapted, merged);
    INFO("base vs merged " << moved << ", adapted vs merged " << off);
    CHECK(moved > 0.5f);   // the adapter matters
    CHECK(off < 2e-3f);    // and is applied as merged (float rounding apart)
  }
}

TEST_CASE("lora: two adapters add up, on two CPU stages as on one; scale 0 changes no bit") {
  const std::string base = base_model(kLlama);
  LoraSynthOptions lo;
  lo.targets = {"blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output.weight"};
  lo.seed = 5;
  const std::string a = write_adapter(base, "two-a", lo);
  lo.targets = {"blk.0.attn_q.weight", "blk.1.attn_v.weight", "token_embd.weight"};
  lo.type = GgmlType::F16;
  lo.rank = 4;
  lo.seed = 6;
  const std::string b = write_adapter(base, "two-b", lo);
  const std::vector<LoraFile> both = {{a, 1.f}, {b, -1.5f}};
  // The F16 pair merged from its F16 values: the same numbers the adapted run multiplies by.
  const std::vector<float> merged = logits(merged_model(base, both, "two-merged"), {});
  const std::vector<float> one = logits(base, both), two = logits(base, both, "cpu,cpu");
  CHECK(max_diff(one, merged) < 2e-3f);
  CHECK(max_diff(one, two) == 0.f);  // each stage holds the pairs of its layers (and embedding, head)
  CHECK(max_diff(logits(base, {{a, 0.f}}), logits(base, {})) == 0.f);
}

TEST_CASE("lora: the planner and the stages count the adapters' bytes") {
  const std::string base = base_model(kLlama);
  LoraSynthOptions lo;
  lo.targets = every_matrix(2, {"attn_q", "ffn_up"});
  const std::string a = write_adapter(base, "bytes-a", lo);
  const auto f = gguf::File::open(a);
  uint64_t adapter_bytes = 0;
  for (const auto& t : f->tensors()) adapter_bytes += t.nbytes;
  auto stage_bytes = [&](const std::vector<LoraFile>& lora) {
    LoadOptions o;
    o.n_ctx = 64;
    o.n_threads = 2;
    o.devices = "cpu,cpu";
    o.lora = lora;
    const auto p = Pipeline::load(base, o);
    std::pair<uint64_t, uint64_t> planned_measured{0, 0};
    for (const StageInfo& s : p->stages()) {
      planned_measured.first += s.planned_bytes;
      planned_measured.second += s.measured_bytes;
    }
    return planned_measured;
  };
  const auto [p0, m0] = stage_bytes({});
  const auto [p1, m1] = stage_bytes({{a, 1.f}});
  // Held: F16 copies of the pairs (2 bytes a value) with the rank (8) padded to 32: A [128, 32],
  // B [32, n_out]; the embedding's A [8, 400] stays as mapped (F32). Planned as the larger of
  // that and what a GPU stage holds: the same, but the embedding's A is padded too ([32, 400] F32).
  auto pair = [](uint64_t n_out) { return 2 * 32 * 128 + 2 * 32 * n_out; };
  const uint64_t held = 2 * (pair(128) + pair(256)) + pair(400) + (4 * 8 * 400 + 2 * 32 * 128);
  const uint64_t planned = held - 4 * 8 * 400 + 4 * 32 * 400;
  CHECK(adapter_bytes < held);
  CHECK(p1 - p0 == planned);
  CHECK(m1 - m0 == held);
  // baton plan --lora prints the plan loading makes.
  auto plan_bytes = [&](const std::string& flags) {
    const test::Out o = test::run_command(std::string(BATON_BINARY) + " plan -m " + base + " --devices cpu,cpu --ctx 64 --json" + flags);
    INFO(o.err);
    REQUIRE(o.code == 0);
    uint64_t total = 0;
    const nlohmann::json plan = nlohmann::json::parse(o.out);
    for (const auto& st : plan["stages"]) total += st["weight_bytes"].get<uint64_t>();
    return total;
  };
  const uint64_t with = plan_bytes(" --lora " + a), without = plan_bytes("");
  CHECK(with - without == planned);
  // An adapter given as the model: said so.
  const test::Out as_model = test::run_command(std::string(BATON_BINARY) + " run -m " + a + " -p hi");
  CHECK(as_model.code == 2);
  CHECK_THAT(as_model.err, Catch::Contains("a LoRA adapter, not a model: give the model with -m and this file with --lora"));
}

TEST_CASE("lora: malformed adapters are refused, naming the file and the problem") {
  const std::string base = base_model(kLlama);
  const auto bf = gguf::File::open(base);
  auto with = [&](const std::string& name, const std::function<void(gguf::Writer&)>& edit) {
    LoraSynthOptions lo;
    lo.targets = {"blk.0.attn_q.weight"};
    gguf::Writer w = lora_synth_writer(*bf, lo);
    edit(w);
    const std::string path = test::temp_dir() + "/" + name + ".gguf";
    w.write(path);
    return path;
  };
  auto matrix = [](gguf::Writer& w, const std::string& name, int64_t cols, int64_t rows) {
    const std::vector<float> v(size_t(cols * rows), 0.01f);
    w.add_tensor(name, GgmlType::F32, {cols, rows}, v.data(), v.size() * sizeof(float));
  };
  CHECK_THAT(error_of(base, {{base, 1.f}}), Catch::Contains("not a LoRA adapter (general.type is '(none)'"));
  CHECK_THAT(error_of(base, {{with("arch", [](gguf::Writer& w) { w.set("general.architecture", gguf::Value::of_str("qwen2")); }), 1.f}}),
             Catch::Contains("an adapter for architecture 'qwen2', the model is 'llama'"));
  CHECK_THAT(error_of(base, {{with("kind", [](gguf::Writer& w) { w.set("adapter.type", gguf::Value::of_str("control_vector")); }), 1.f}}),
             Catch::Contains("adapter.type is 'control_vector'"));
  CHECK_THAT(error_of(base, {{with("half", [&](gguf::Writer& w) { matrix(w, "blk.1.attn_q.weight.lora_a", 128, 8); }), 1.f}}),
             Catch::Contains("'blk.1.attn_q.weight' has a .lora_a but no .lora_b"));
  CHECK_THAT(error_of(base, {{with("absent", [&](gguf::Writer& w) {
                                matrix(w, "blk.7.attn_q.weight.lora_a", 128, 8);
                                matrix(w, "blk.7.attn_q.weight.lora_b", 8, 128);
                              }), 1.f}}),
             Catch::Contains("'blk.7.attn_q.weight' is not a tensor of the model"));
  CHECK_THAT(error_of(base, {{with("shape", [&](gguf::Writer& w) {
                                matrix(w, "blk.1.attn_k.weight.lora_a", 128, 8);
                                matrix(w, "blk.1.attn_k.weight.lora_b", 8, 128);  // attn_k has 64 rows
                              }), 1.f}}),
             Catch::Contains("'blk.1.attn_k.weight' is [128, 64] but its pair is"));
  CHECK_THAT(error_of(base, {{with("norm", [&](gguf::Writer& w) {
                                matrix(w, "blk.0.attn_norm.weight.lora_a", 128, 8);
                                matrix(w, "blk.0.attn_norm.weight.lora_b", 8, 1);
                              }), 1.f}}),
             Catch::Contains("'blk.0.attn_norm.weight': Baton adapts only the attention and dense FFN matrices"));
  CHECK_THAT(error_of(base, {{with("stray", [&](gguf::Writer& w) { matrix(w, "blk.0.attn_q.weight", 128, 128); }), 1.f}}),
             Catch::Contains("tensor 'blk.0.attn_q.weight' is neither a .lora_a nor a .lora_b"));
  CHECK_THAT(error_of(base, {{test::temp_dir() + "/no-such-adapter.gguf", 1.f}}), Catch::Contains("no-such-adapter.gguf"));
}

TEST_CASE("lora: baton run --lora and --lora-scaled; bad values are usage errors") {
  const std::string base = base_model(kLlama);
  LoraSynthOptions lo;
  lo.targets = every_matrix(2, {"attn_v", "ffn_down"});
  lo.amplitude = 2.f;
  const std::string a = write_adapter(base, "cli-a", lo);
  const std::string run = std::string(BATON_BINARY) + " run -m " + base + " -p 'hello there' -n 8 --temp 0 --devices cpu";
  const test::Out plain = test::run_command(run), adapted = test::run_command(run + " --lora " + a),
                  zero = test::run_command(run + " --lora-scaled " + a + " 0");
  REQUIRE(plain.code == 0);
  REQUIRE(adapted.code == 0);
  REQUIRE(zero.code == 0);
  CHECK(adapted.out != plain.out);
  CHECK(zero.out == plain.out);
  const test::Out bad = test::run_command(run + " --lora-scaled " + a + " much");
  CHECK(bad.code == 1);
  CHECK_THAT(bad.err, Catch::Contains("--lora-scaled " + a + " much: the scale must be a number"));
  const test::Out missing = test::run_command(run + " --lora " + test::temp_dir() + "/none.gguf");
  CHECK(missing.code == 2);
  CHECK_THAT(missing.err, Catch::Contains("none.gguf"));
#if BATON_CUDA_HOST_EMULATION  // the host emulation stands in for a GPU (a CUDA build without one has none)
  const test::Out gpu = test::run_command("BATON_CUDA_EMULATE=1 " + std::string(BATON_BINARY) + " run -m " + base +
                                          " -p hi -n 2 --devices cuda:0 --lora " + a);
  INFO(gpu.err);
  CHECK(gpu.code == 0);
#endif
}

#if BATON_CUDA_HOST_EMULATION
// A GPU stage (here the host emulation of the CUDA ops, kernels/cuda_host) adds the pairs as the
// merged weights would: every matrix, the embedding and the head adapted by two adapters (F16 and
// F32, one with alpha), alone and beside a CPU stage, with the products in chunks of a few columns
// (BATON_LORA_CHUNK_FLOATS) as in whole steps.
TEST_CASE("lora: a GPU stage gives the merged model's logits (llama; phi3's fused tensors), beside a CPU stage too") {
  setenv("BATON_CUDA_EMULATE", "1", 1);
  for (const AdaptedShape& as : kAdaptedShapes) {
    const ShapePreset& shape = as.shape;
    INFO(shape.name);
    const std::string base = base_model(shape);
    LoraSynthOptions lo = every_matrix_adapter(as);
    const std::string a = write_adapter(base, std::string(shape.name) + "-gpu-a", lo);
    lo.targets = {"blk.1.attn_output.weight", "output.weight", "token_embd.weight"};
    lo.rank = 4;
    lo.alpha = 0;
    lo.type = GgmlType::F32;
    lo.seed = 4;
    const std::string b = write_adapter(base, std::string(shape.name) + "-gpu-b", lo);
    const std::vector<LoraFile> both = {{a, 0.7f}, {b, -1.5f}};
    const std::string merged = merged_model(base, both, std::string(shape.name) + "-gpu-merged");
    // (The F32 adapter's pairs are multiplied in F16 by both kinds of stage, its embedding rows as
    // F32: the CPU stage's logits are the tight bound, the merged model's a loose one.)
    const std::vector<float> plain = logits(base, {}, "cuda:0"), want = logits(merged, {}, "cuda:0");
    const std::vector<float> cpu = logits(base, both);
    CHECK(max_diff(plain, want) > 0.5f);
    CHECK(max_diff(cpu, want) < 1e-2f);
    for (const char* devices : {"cuda:0", "cuda:0,cpu", "cpu,cuda:0"})
      for (const char* chunk : {"", "1000"}) {
        INFO(devices << ", BATON_LORA_CHUNK_FLOATS=" << chunk);
        setenv("BATON_LORA_CHUNK_FLOATS", chunk, 1);
        const auto got = logits(base, both, devices, true);
        CHECK(max_diff(got, cpu) < 1e-3f);
        CHECK(max_diff(got, want) < 1e-2f);
      }
    unsetenv("BATON_LORA_CHUNK_FLOATS");
  }
  unsetenv("BATON_CUDA_EMULATE");
}
#endif

TEST_CASE("lora: baton synth --lora-of writes the adapter named by --lora-targets, --rank and --alpha") {
  const std::string base = base_model(kPhi3);
  const std::string out = test::temp_dir() + "/synth-lora.gguf";
  const test::Out o = test::run_command(std::string(BATON_BINARY) + " synth --lora-of " + base + " --out " + out +
                                        " --rank 4 --alpha 8 --lora-targets attn_qkv,ffn_down,output --seed 2");
  REQUIRE(o.code == 0);
  const auto f = gguf::File::open(out);
  CHECK(f->get<std::string>("general.type") == "adapter");
  CHECK(f->get<float>("adapter.lora.alpha") == 8.f);
  CHECK(f->tensors().size() == 2 * (2 + 2 + 1));  // a pair each: 2 layers' attn_qkv and ffn_down, the head
  const gguf::TensorInfo& b = f->require_tensor("blk.1.attn_qkv.weight.lora_b");
  CHECK(b.type == GgmlType::F16);
  CHECK((b.ne[0] == 4 && b.ne[1] == 128 + 2 * 64));
  CHECK(max_diff(logits(base, {{out, 1.f}}), logits(base, {})) > 0.1f);
  const test::Out bad = test::run_command(std::string(BATON_BINARY) + " synth --lora-of " + base + " --out " + out +
                                          " --lora-targets ffn_gate");  // (phi3: gate and up in ffn_up)
  CHECK(bad.code == 1);
  CHECK_THAT(bad.err, Catch::Contains("--lora-targets: 'ffn_gate' names no matrix of"));
}

namespace {

// A control vector file for a model of width E: direction.L for each given layer, normal(0, sd).
std::string control_vector(const std::string& name, int E, const std::vector<int>& layers, uint32_t seed,
                           float sd = 0.6f, GgmlType type = GgmlType::F32) {
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::of_str("controlvector"));
  w.set("controlvector.model_hint", gguf::Value::of_str("llama"));
  w.set("controlvector.layer_count", gguf::Value::of_u32(uint32_t(layers.size())));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, sd);
  for (int l : layers) {
    std::vector<float> v(static_cast<size_t>(E));
    for (float& x : v) x = normal(rng);
    std::vector<uint8_t> bytes(row_bytes(type, E));
    quantize_row(type, v.data(), bytes.data(), E);
    w.add_tensor("direction." + std::to_string(l), type, {int64_t(E)}, bytes.data(), bytes.size());
  }
  const std::string path = test::temp_dir() + "/" + name + ".gguf";
  w.write(path);
  return path;
}

std::string control_error(const std::string& model, const std::vector<ControlVectorFile>& cv, int first = -1, int last = -1) {
  try {
    LoadOptions o;
    o.n_ctx = 64;
    o.n_threads = 2;
    o.devices = "cpu";
    o.control_vectors = cv;
    o.control_first = first;
    o.control_last = last;
    Pipeline::load(model, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("control vectors: refused files and ranges name the problem; baton run takes them") {
  const std::string base = base_model(kLlama);  // 2 layers, n_embd 128: only layer 1 can be steered
  CHECK_THAT(control_error(base, {{control_vector("cv-l0", 128, {0}, 1), 1.f}}),
             Catch::Contains("'direction.0' steers layer 0, and the model's layers that can be steered are 1..1"));
  CHECK_THAT(control_error(base, {{control_vector("cv-l2", 128, {2}, 1), 1.f}}), Catch::Contains("steers layer 2"));
  CHECK_THAT(control_error(base, {{control_vector("cv-w", 64, {1}, 1), 1.f}}),
             Catch::Contains("'direction.1' must be 128 F32 values (the model's width); it is 64 F32"));
  CHECK_THAT(control_error(base, {{control_vector("cv-f16", 128, {1}, 1, 0.6f, GgmlType::F16), 1.f}}),
             Catch::Contains("it is 128 F16"));
  CHECK_THAT(control_error(base, {{base, 1.f}}), Catch::Contains("not a control vector (general.architecture is 'llama'"));
  const std::string cv = control_vector("cv-ok", 128, {1}, 2);
  CHECK_THAT(control_error(base, {{cv, 1.f}}, 1, 0), Catch::Contains("the first layer is after the last"));
  CHECK_THAT(control_error(base, {}, 1, 1), Catch::Contains("--control-vector-layer-range needs --control-vector"));
  CHECK(control_error(base, {{cv, 1.f}}) == "(no error)");

  const std::string run = std::string(BATON_BINARY) + " run -m " + base + " -p hi -n 4 --temp 0 --raw";
  const test::Out plain = test::run_command(run), zero = test::run_command(run + " --control-vector-scaled " + cv + " 0");
  const test::Out steered = test::run_command(run + " --control-vector " + cv + " --control-vector-layer-range 1 1");
  INFO(steered.err);
  CHECK(steered.code == 0);
  CHECK(zero.code == 0);
  CHECK(zero.out == plain.out);  // scale 0 adds nothing
  const test::Out bad = test::run_command(run + " --control-vector-scaled " + cv + " much");
  CHECK(bad.code == 1);
  CHECK_THAT(bad.err, Catch::Contains("--control-vector-scaled " + cv + " much: the scale must be a number"));
  const test::Out range = test::run_command(run + " --control-vector " + cv + " --control-vector-layer-range 1");
  CHECK(range.code != 0);
  CHECK_THAT(range.err, Catch::Contains("--control-vector-layer-range"));
}

#if BATON_CUDA_HOST_EMULATION
// A GPU stage (the host emulation) adds the vectors as the CPU stage does, alone and beside a CPU stage.
TEST_CASE("control vectors: a GPU stage gives the CPU stage's logits") {
  setenv("BATON_CUDA_EMULATE", "1", 1);
  const ShapePreset shape{"cv-llama", "llama", "test", 3, 128, 4, 2, 32, 256, 400, 2048, false, 0, 0, 1e4f, 1e-5f, false};
  const std::string base = base_model(shape);
  const std::vector<ControlVectorFile> cv = {{control_vector("cv-gpu-a", 128, {1, 2}, 3), 0.9f},
                                             {control_vector("cv-gpu-b", 128, {2}, 4), -0.4f}};
  auto logits_cv = [&](const std::string& devices, const std::vector<ControlVectorFile>& c) {
    LoadOptions o;
    o.n_ctx = 64;
    o.n_threads = 2;
    o.devices = devices;
    o.control_vectors = c;
    if (devices.find(',') != std::string::npos) o.tensor_split = {1.0, 2.0};
    const auto p = Pipeline::load(base, o);
    Batch b;
    for (int i = 0; i < kTokens; ++i) b.add(int32_t(5 + 19 * i % 390), i, 0, kLogitsRow);
    std::vector<float> out(size_t(kTokens) * size_t(p->n_vocab()));
    p->decode(b, out.data());
    return out;
  };
  const std::vector<float> cpu = logits_cv("cpu", cv);
  CHECK(max_diff(cpu, logits_cv("cpu", {})) > 0.5f);
  for (const char* devices : {"cuda:0", "cuda:0,cpu", "cpu,cuda:0"}) {
    INFO(devices);
    CHECK(max_diff(logits_cv(devices, cv), cpu) < 1e-3f);
  }
  unsetenv("BATON_CUDA_EMULATE");
}
#endif
