// `baton quantize` (runtime/quantize_model.h): the plan follows llama-quantize's recipes (the
// expected types below are what llama-quantize wrote for the same shapes, docs/BENCHMARKS.md
// "Session 41"), the written file keeps the metadata and holds each row as quant/ quantizes it
// whatever the thread count, and the quantized model runs close to the original.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "helpers.h"
#include "quant/quant.h"
#include "runtime/batch.h"
#include "runtime/pipeline.h"
#include "runtime/quantize_model.h"
#include "runtime/shape.h"
#include "runtime/synth.h"

using namespace baton;

namespace {

// A llama of `layers` layers whose rows fit the k-quants' 256-element blocks (F16 weights).
ShapePreset shape(uint32_t layers, uint32_t n_head_kv, bool tied = false, uint32_t n_expert = 0) {
  ShapePreset p = find_preset("smollm2-135m");
  p.name = "test";
  p.n_layer = layers;
  p.n_embd = 256;
  p.n_head = 4;
  p.n_head_kv = n_head_kv;
  p.head_dim = 64;
  p.n_ff = 512;
  p.n_vocab = 512;
  p.tied = tied;
  p.n_expert = n_expert;
  p.n_expert_used = n_expert ? 2 : 0;
  p.n_ff_exp = n_expert ? 256 : 0;
  return p;
}

struct Model {
  std::vector<uint8_t> bytes;
  std::unique_ptr<gguf::File> file;
};
Model model(const ShapePreset& p, GgmlType type = GgmlType::F16) {
  SynthOptions o;
  o.type = type;
  o.seed = 7;
  Model m;
  m.bytes = synth_writer(p, o).to_bytes();
  m.file = gguf::File::parse(m.bytes.data(), m.bytes.size());
  return m;
}

// Each tensor's planned type by name.
std::map<std::string, GgmlType> types(const gguf::File& f, QuantizeOptions o) {
  std::map<std::string, GgmlType> out;
  for (const TensorPlan& p : plan_quantization(f, o)) out[p.tensor->name] = p.to;
  return out;
}

// The layers of `part` (e.g. "attn_v.weight") planned as `t`.
std::set<int> layers_of(const std::map<std::string, GgmlType>& m, const std::string& part, GgmlType t) {
  std::set<int> out;
  for (const auto& [name, type] : m) {
    int layer = -1;
    if (type == t && name.find("." + part) != std::string::npos && std::sscanf(name.c_str(), "blk.%d.", &layer) == 1)
      out.insert(layer);
  }
  return out;
}

QuantizeOptions as(const char* type) {
  QuantizeOptions o;
  o.type = type;
  return o;
}

}  // namespace

TEST_CASE("the plan: llama-quantize's recipes by tensor, layer and head grouping") {
  using T = GgmlType;
  const Model m = model(shape(24, 1));  // 24 layers, 4 query heads over 1 KV head (n_gqa 4)
  const std::set<int> more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23};  // the layers that get more bits
  std::set<int> rest;
  for (int i = 0; i < 24; i++)
    if (!more.count(i)) rest.insert(i);
  auto all = [](int n) { std::set<int> s; for (int i = 0; i < n; i++) s.insert(i); return s; };

  auto q4km = types(*m.file, as("Q4_K_M"));
  CHECK(q4km["output.weight"] == T::Q6_K);
  CHECK(q4km["token_embd.weight"] == T::Q4_K);
  CHECK(q4km["output_norm.weight"] == T::F32);  // norms stay
  CHECK(q4km["blk.3.attn_norm.weight"] == T::F32);
  CHECK(layers_of(q4km, "attn_v.weight", T::Q6_K) == more);
  CHECK(layers_of(q4km, "attn_v.weight", T::Q4_K) == rest);
  CHECK(layers_of(q4km, "ffn_down.weight", T::Q6_K) == more);
  for (const char* part : {"attn_q.weight", "attn_k.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight"})
    CHECK(layers_of(q4km, part, T::Q4_K) == all(24));

  auto q3km = types(*m.file, as("q3_k_m"));  // any case
  CHECK(layers_of(q3km, "attn_v.weight", T::Q5_K) == std::set<int>{0, 1});
  CHECK(layers_of(q3km, "ffn_down.weight", T::Q5_K) == std::set<int>{0});  // the first 24/16 layers
  CHECK(layers_of(q3km, "ffn_down.weight", T::Q4_K).size() == 23);
  CHECK(layers_of(q3km, "attn_output.weight", T::Q4_K) == all(24));
  CHECK(layers_of(q3km, "ffn_up.weight", T::Q3_K) == all(24));

  auto q4ks = types(*m.file, as("Q4_K_S"));
  CHECK(layers_of(q4ks, "attn_v.weight", T::Q5_K) == std::set<int>{0, 1, 2, 3});
  CHECK(layers_of(q4ks, "ffn_down.weight", T::Q5_K) == std::set<int>{0, 1, 2});

  auto q2k = types(*m.file, as("Q2_K"));
  CHECK(layers_of(q2k, "attn_v.weight", T::Q4_K) == all(24));  // 4 query heads per KV head
  CHECK(layers_of(q2k, "ffn_down.weight", T::Q3_K) == all(24));
  CHECK(layers_of(q2k, "attn_output.weight", T::Q3_K) == all(24));
  CHECK(layers_of(q2k, "attn_q.weight", T::Q2_K) == all(24));
  const Model mha = model(shape(4, 4));  // no grouping: Q2_K's attn_v is Q3_K
  CHECK(layers_of(types(*mha.file, as("Q2_K")), "attn_v.weight", T::Q3_K) == all(4));

  // Plain types: every weight the type, the head Q6_K (Q8_0 keeps its own); float types: no mix.
  auto q40 = types(*m.file, as("Q4_0"));
  CHECK(q40["output.weight"] == T::Q6_K);
  CHECK(layers_of(q40, "attn_v.weight", T::Q4_0) == all(24));
  CHECK(types(*m.file, as("Q8_0"))["output.weight"] == T::Q8_0);
  CHECK(types(*m.file, as("BF16"))["output.weight"] == T::BF16);
  CHECK(types(*m.file, as("F32"))["blk.0.ffn_up.weight"] == T::F32);

  // Options: --pure, --leave-output-tensor, the two type overrides.
  QuantizeOptions o = as("Q4_K_M");
  o.pure = true;
  auto pure = types(*m.file, o);
  CHECK(pure["output.weight"] == T::Q4_K);
  CHECK(layers_of(pure, "attn_v.weight", T::Q4_K) == all(24));
  o = as("Q4_K_M");
  o.leave_output = true;
  CHECK(types(*m.file, o)["output.weight"] == T::F16);
  o = as("Q4_K_M");
  o.output_type = T::Q8_0;
  o.embedding_type = T::Q6_K;
  auto over = types(*m.file, o);
  CHECK(over["output.weight"] == T::Q8_0);
  CHECK(over["token_embd.weight"] == T::Q6_K);

  // A tied embedding is the head: it gets the head's type.
  const Model tied = model(shape(4, 4, true));
  CHECK(types(*tied.file, as("Q4_K_M"))["token_embd.weight"] == T::Q6_K);

  // Eight experts: attn_v and attn_k Q8_0, attn_output Q5_K; the router is not quantized.
  const Model moe = model(shape(8, 4, false, 8));
  auto em = types(*moe.file, as("Q4_K_M"));
  CHECK(layers_of(em, "attn_v.weight", T::Q8_0) == all(8));
  CHECK(layers_of(em, "attn_k.weight", T::Q8_0) == all(8));
  CHECK(layers_of(em, "attn_output.weight", T::Q5_K) == all(8));
  CHECK(layers_of(em, "ffn_gate_inp.weight", T::F32) == all(8));
  CHECK(layers_of(em, "ffn_down_exps.weight", T::Q6_K) == std::set<int>{0, 3, 6, 7});
  CHECK(layers_of(em, "ffn_up_exps.weight", T::Q4_K) == all(8));

  // A fused q/k/v (Phi-3): Q4_K_M gives it Q5_K, Q5_K_M Q6_K, Q3_K_M and Q3_K_L Q4_K.
  ShapePreset phi = shape(4, 4);
  phi.architecture = "phi3";
  const Model fused = model(phi);
  REQUIRE(fused.file->tensor("blk.0.attn_qkv.weight") != nullptr);
  for (const auto& [type, want] : std::vector<std::pair<const char*, T>>{
           {"Q4_K_M", T::Q5_K}, {"Q5_K_M", T::Q6_K}, {"Q3_K_M", T::Q4_K}, {"Q3_K_L", T::Q4_K}, {"Q4_K_S", T::Q4_K}})
    CHECK(layers_of(types(*fused.file, as(type)), "attn_qkv.weight", want) == all(4));

  // Rows that do not fit: SmolLM2's 576-wide rows take llama-quantize's stand-ins.
  ShapePreset wide = shape(4, 3);
  wide.n_embd = 576, wide.n_head = 9, wide.n_head_kv = 3, wide.n_ff = 1536;
  const Model smol = model(wide);
  int stand_ins = 0;
  for (const TensorPlan& p : plan_quantization(*smol.file, as("Q4_K_M"))) {
    if (!p.fallback) continue;
    stand_ins++;
    CHECK((p.to == T::Q5_0 || p.to == T::Q8_0));  // Q4_K -> Q5_0, Q6_K -> Q8_0 (attn_v, more bits)
  }
  // token_embd, and q, k, v, o, gate and up of each layer (ffn_down's 1536-wide rows fit); the
  // head's own rule makes it Q8_0 when Q6_K does not fit, no stand-in.
  CHECK(stand_ins == 1 + 4 * 6);
  for (const TensorPlan& p : plan_quantization(*smol.file, as("Q2_K")))
    if (p.fallback) CHECK((p.to == T::IQ4_NL || p.to == T::Q8_0));
}

TEST_CASE("the plan refuses what it cannot do, naming it") {
  const Model m = model(shape(2, 4));
  CHECK_THROWS_WITH(plan_quantization(*m.file, as("Q4_K_X")), Catch::Contains("unknown type 'Q4_K_X'"));
  CHECK_THROWS_WITH(plan_quantization(*m.file, as("IQ2_XS")), Catch::Contains("unknown type"));
  QuantizeOptions o = as("Q4_0");
  o.output_type = GgmlType::IQ2_XS;
  CHECK_THROWS_WITH(plan_quantization(*m.file, o), Catch::Contains("--output-tensor-type: Baton cannot write IQ2_XS"));
  // Already quantized: refused unless asked, and then each row is dequantized first.
  const Model q = model(shape(2, 4), GgmlType::Q8_0);
  CHECK_THROWS_WITH(plan_quantization(*q.file, as("Q4_K_M")),
                    Catch::Contains("is already Q8_0") && Catch::Contains("--allow-requantize"));
  o = as("Q4_K_M");
  o.allow_requantize = true;
  CHECK(plan_quantization(*q.file, o).size() == q.file->tensors().size());
  CHECK_NOTHROW(plan_quantization(*q.file, as("Q8_0")));  // nothing to convert
}

TEST_CASE("the written model: metadata kept, each row as quant/ quantizes it at any thread count, and it runs") {
  const std::string dir = test::temp_dir();
  const std::string src = dir + "/f32.gguf";
  {
    SynthOptions so;
    so.type = GgmlType::F32;
    so.seed = 7;
    synth_write(shape(4, 2), so, src);
  }
  const auto in = gguf::File::open(src);
  for (const char* type : {"Q8_0", "Q4_K_M", "IQ4_XS"}) {
    INFO(type);
    const QuantizeOptions o = as(type);
    const auto plan = plan_quantization(*in, o);
    size_t calls = 0;
    quantize_model(*in, plan, o, dir + "/a.gguf", 3, [&](size_t done, size_t total) {
      calls++;
      CHECK(done == calls);
      CHECK(total == plan.size());
    });
    CHECK(calls == plan.size());
    quantize_model(*in, plan, o, dir + "/b.gguf", 1);
    const auto a = gguf::File::open(dir + "/a.gguf"), b = gguf::File::open(dir + "/b.gguf");
    CHECK(a->get<uint32_t>("general.file_type") == find_quant_file_type(type)->ftype);
    CHECK(a->get<uint32_t>("general.quantization_version") == 2);
    for (const auto& [key, value] : in->metadata())
      if (key != "general.file_type" && key != "general.quantization_version") CHECK(*a->find(key) == value);
    REQUIRE(a->tensors().size() == plan.size());
    int converted = 0;
    for (size_t i = 0; i < plan.size(); i++) {
      const gguf::TensorInfo &x = a->tensors()[i], &y = b->tensors()[i], &src_t = *plan[i].tensor;
      REQUIRE(x.name == src_t.name);
      CHECK(x.type == plan[i].to);
      CHECK(x.nbytes == plan[i].bytes);
      REQUIRE(x.nbytes == y.nbytes);
      CHECK(std::equal(x.data, x.data + x.nbytes, y.data));  // 3 threads or 1: the same bytes
      if (x.type == src_t.type) {
        CHECK(std::equal(x.data, x.data + x.nbytes, src_t.data));
        continue;
      }
      converted++;
      // Rows 0 and the last, quantized here from the F32 source.
      const int64_t cols = src_t.ne[0];
      std::vector<uint8_t> want(row_bytes(x.type, cols));
      for (int64_t r : {int64_t(0), src_t.nrows() - 1}) {
        quantize_row(x.type, reinterpret_cast<const float*>(src_t.data) + r * cols, want.data(), cols);
        CHECK(std::equal(want.begin(), want.end(), x.data + size_t(r) * want.size()));
      }
    }
    CHECK(converted > 20);
  }
  // The Q8_0 model runs, its logits close to the F32 model's.
  quantize_model(*in, plan_quantization(*in, as("Q8_0")), as("Q8_0"), dir + "/q8.gguf", 2);
  auto logits = [](const std::string& path) {
    LoadOptions lo;
    lo.n_ctx = 64;
    auto p = Pipeline::load(path, lo);
    Batch b;
    for (int i = 0; i < 8; i++) b.add(int32_t(10 + 7 * i), i, 0, i == 7);
    std::vector<float> out(size_t(p->n_vocab()));
    p->decode(b, out.data());
    return out;
  };
  const auto f = logits(src), q = logits(dir + "/q8.gguf");
  double max_d = 0, sum_d = 0, sd = 0;
  for (size_t i = 0; i < f.size(); i++) {
    const double d = std::fabs(double(f[i]) - double(q[i]));
    max_d = std::max(max_d, d), sum_d += d, sd += double(f[i]) * f[i];
  }
  sd = std::sqrt(sd / double(f.size()));
  const double mean_d = sum_d / double(f.size());
  INFO("max |d| " << max_d << " mean |d| " << mean_d << " logit rms " << sd);
  CHECK(max_d < 0.25 * sd);  // (8-bit weights and the Q8_0 path's 8-bit activations)
  CHECK(mean_d < 0.05 * sd);
  CHECK(max_d > 0);  // it was quantized
}
