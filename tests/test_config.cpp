// The attention scale: 1/sqrt(query_pre_attn_scalar) as each published Gemma 3 config sets it,
// checked on the real sizes' shapes, and through ModelConfig::from_gguf on a tiny 62-layer file.
#include <cmath>
#include <cstring>
#include <functional>

#include "gguf/gguf.h"
#include "helpers.h"
#include "runtime/config.h"
#include "runtime/shape.h"
#include "runtime/synth.h"

using namespace baton;

namespace {

// Gemma 3 as published: layers, hidden size, heads, head_dim, query_pre_attn_scalar.
struct Published {
  const char* name;
  int n_layer, n_embd, n_head, head_dim, query_pre_attn_scalar;
};
constexpr Published kGemma3[] = {
    {"270m", 18, 640, 4, 256, 256},  {"1b", 26, 1152, 4, 256, 256},   {"4b", 34, 2560, 8, 256, 256},
    {"12b", 48, 3840, 16, 256, 256}, {"27b", 62, 5376, 32, 128, 168},
};

}  // namespace

TEST_CASE("the attention scale is 1/sqrt(query_pre_attn_scalar) at every Gemma 3 size") {
  for (const Published& g : kGemma3) {
    INFO("gemma3 " << g.name);
    CHECK(attention_scale("gemma3", g.n_layer, g.n_embd, g.n_head, g.head_dim) ==
          Approx(1.0 / std::sqrt(double(g.query_pre_attn_scalar))).epsilon(1e-6));
  }
  // Why no single shape formula does: n_embd / n_head is the scalar only at 27B, the head
  // dimension everywhere but 27B.
  for (const Published& g : kGemma3) {
    INFO("gemma3 " << g.name);
    const bool is_27b = g.n_layer == 62;
    CHECK((g.n_embd / g.n_head == g.query_pre_attn_scalar) == is_27b);
    CHECK((g.head_dim == g.query_pre_attn_scalar) == !is_27b);
  }
  // Other families: always the head dimension, whatever the layer count.
  CHECK(attention_scale("llama", 62, 5376, 32, 128) == Approx(1.0 / std::sqrt(128.0)));
  CHECK(attention_scale("qwen2", 28, 1536, 12, 128) == Approx(1.0 / std::sqrt(128.0)));
}

TEST_CASE("ModelConfig gives a 62-layer Gemma 3 the 27B's scale and other depths the head dim's") {
  // Tiny widths (n_embd / n_head = 32, head_dim 64) so the two candidate scales differ.
  for (uint32_t layers : {61u, 62u}) {
    INFO(layers << " layers");
    const ShapePreset p{"tiny-gemma3", "gemma3", "test", layers, 64, 2, 1, 64, 64, 300, 256,
                        true, 16, 6, 1e6f, 1e-6f, false};
    SynthOptions o;
    o.type = GgmlType::F32;
    const std::vector<uint8_t> bytes = synth_writer(p, o).to_bytes();
    const auto f = gguf::File::parse(bytes.data(), bytes.size(), "tiny-gemma3.gguf");
    const ModelConfig c = ModelConfig::from_gguf(*f);
    REQUIRE(c.head_dim_k == 64);
    CHECK(c.attn_scale == Approx(layers == 62 ? 1.0 / std::sqrt(32.0) : 1.0 / 8.0).epsilon(1e-6));
  }
}

namespace {

// The tensors of a small phi3 file (fused q/k/v and gate/up, LongRoPE factors), filled with ones,
// after `edit` renamed, reshaped or dropped (empty name) some, with `extra` tensors of twos; the
// config's verdict on it.
ModelConfig phi3_config(const std::function<void(TensorSpec&)>& edit, const std::vector<TensorSpec>& extra = {}) {
  const ShapePreset p{"tiny-phi3", "phi3", "test", 2, 128, 4, 2, 32, 256, 300, 1024, false, 0, 0, 1e4f, 1e-5f, false,
                      32, 24};
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::of_str("phi3"));
  const std::pair<const char*, uint32_t> keys[] = {
      {"phi3.block_count", 2}, {"phi3.embedding_length", 128}, {"phi3.feed_forward_length", 256},
      {"phi3.attention.head_count", 4}, {"phi3.attention.head_count_kv", 2}, {"phi3.context_length", 1024},
      {"phi3.rope.dimension_count", 24}, {"phi3.vocab_size", 300}, {"phi3.rope.scaling.original_context_length", 32}};
  for (const auto& [k, v] : keys) w.set(k, gguf::Value::of_u32(v));
  w.set("phi3.rope.scaling.attn_factor", gguf::Value::of_f32(1.19f));
  auto filled = [](float x) {
    return [x](uint8_t* d, size_t n) {
      for (size_t i = 0; i + 4 <= n; i += 4) std::memcpy(d + i, &x, 4);
    };
  };
  for (TensorSpec t : preset_tensors(p, GgmlType::F32)) {
    edit(t);
    if (!t.name.empty()) w.add_tensor_lazy(t.name, t.type, t.dims, filled(1.f));
  }
  for (const TensorSpec& t : extra) w.add_tensor_lazy(t.name, t.type, t.dims, filled(2.f));
  const auto bytes = w.to_bytes();
  return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
}

}  // namespace

TEST_CASE("phi3: fused matrices and LongRoPE read from the file; what is wrong with them is named") {
  const ModelConfig c = phi3_config([](TensorSpec&) {});
  CHECK(c.fused_qkv);
  CHECK(c.fused_gate_up);
  CHECK(c.rope_dim == 24);
  CHECK(c.rope_long_ctx == 32);
  CHECK(c.rope_attn_factor == 1.19f);
  REQUIRE(c.rope_freqs.size() == 12);
  REQUIRE(c.rope_freqs_long.size() == 12);
  CHECK(c.rope_freqs[3] == Approx(std::pow(1e4, -6.0 / 24)));  // the factors are ones here
  ModelConfig longer = c;
  longer.use_context(32);
  CHECK(longer.rope_freqs == c.rope_freqs);
  longer.use_context(33);
  CHECK(longer.rope_freqs == c.rope_freqs_long);

  auto error_of = [](const std::function<void(TensorSpec&)>& edit) {
    try {
      phi3_config(edit);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error_of([](TensorSpec& t) { if (t.name == "blk.1.attn_qkv.weight") t.name = "blk.1.attn_q.weight"; }),
             Catch::Contains("missing tensor blk.1.attn_qkv.weight"));
  CHECK_THAT(error_of([](TensorSpec& t) { if (t.name == "blk.0.ffn_up.weight") t.dims = {128, 256}; }),
             Catch::Contains("tensor blk.0.ffn_up.weight has shape [128, 256], expected [128, 512]"));
  CHECK_THAT(error_of([](TensorSpec& t) { if (t.name == "rope_factors_long.weight") t.dims = {16}; }),
             Catch::Contains("rope_factors_long.weight must be F32 [12]"));

  // Llama 3's rope_freqs.weight divides first, the LongRoPE factors after (any family reads it).
  const ModelConfig l3 = phi3_config([](TensorSpec&) {}, {{"rope_freqs.weight", GgmlType::F32, {12}}});
  CHECK(l3.rope_freqs[3] == Approx(std::pow(1e4, -6.0 / 24) / 2));
  CHECK(l3.rope_freqs_long[3] == Approx(std::pow(1e4, -6.0 / 24) / 2));
  try {
    phi3_config([](TensorSpec&) {}, {{"rope_freqs.weight", GgmlType::F32, {13}}});
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("rope_freqs.weight must be F32 [12], found F32 [13]"));
  }
}

TEST_CASE("mixtures of experts: counts, widths and stacked experts read from the file; what is wrong is named") {
  auto config_of = [](const gguf::Writer& w) {
    const auto bytes = w.to_bytes();
    return ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
  };
  auto error_of = [&](const gguf::Writer& w) {
    try {
      config_of(w);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const ShapePreset q3{"tiny-qwen3moe", "qwen3moe", "test", 2, 128, 4, 2, 64, 256, 700, 1024, false, 0, 0, 1e6f, 1e-6f,
                       false, 0, 0, 8, 3, 64};
  const ModelConfig c = config_of(synth_writer(q3, {}));
  CHECK(c.is_moe());
  CHECK(c.n_expert == 8);
  CHECK(c.n_expert_used == 3);
  CHECK(c.n_ff_exp == 64);
  CHECK(c.n_ff_shexp == 0);
  CHECK(c.expert_weights_norm);
  CHECK(c.qk_norm);
  CHECK(!c.has(LayerTensor::Gate));
  CHECK(!c.has(LayerTensor::Down));
  CHECK(c.has(LayerTensor::DownExps));
  CHECK(!c.has(LayerTensor::GateShexp));

  ShapePreset q2{"tiny-qwen2moe", "qwen2moe", "test", 2, 96, 3, 3, 32, 192, 700, 1024, false, 0, 0, 1e6f, 1e-6f, true,
                 0, 0, 6, 2, 96, 192};
  const ModelConfig c2 = config_of(synth_writer(q2, {}));
  CHECK(!c2.expert_weights_norm);  // Qwen2-MoE: the top-k probabilities as they are
  CHECK(c2.n_ff_shexp == 192);
  CHECK(c2.has(LayerTensor::GateInpShexp));
  gguf::Writer w2 = synth_writer(q2, {});
  w2.set("qwen2moe.expert_weights_norm", gguf::Value::of_bool(true));  // the file's key overrides the family
  CHECK(config_of(w2).expert_weights_norm);

  // A llama file with experts is Mixtral's layout: no expert width key, the experts are n_ff wide.
  const ShapePreset mx{"tiny-mixtral", "llama", "test", 2, 128, 4, 2, 32, 256, 600, 512, false, 0, 0, 1e6f, 1e-5f,
                       false, 0, 0, 4, 2, 256};
  const ModelConfig cm = config_of(synth_writer(mx, {}));
  CHECK(cm.n_expert == 4);
  CHECK(cm.n_ff_exp == cm.n_ff);

  gguf::Writer bad = synth_writer(q3, {});
  bad.set("qwen3moe.expert_used_count", gguf::Value::of_u32(9));
  CHECK_THAT(error_of(bad), Catch::Contains("expert_used_count 9 must be in [1, expert_count 8]"));
  bad = synth_writer(q3, {});
  bad.set("qwen3moe.expert_feed_forward_length", gguf::Value::of_u32(128));
  CHECK_THAT(error_of(bad),
             Catch::Contains("tensor blk.0.ffn_gate_exps.weight has shape [128, 64, 8], expected [128, 128, 8]"));
  bad = synth_writer(q3, {});
  bad.set("qwen3moe.expert_count", gguf::Value::of_u32(0));  // qwen3moe without experts
  CHECK_THAT(error_of(bad), Catch::Contains("expert_count = 0 is out of range"));
  bad = synth_writer(q3, {});
  bad.set("qwen3moe.expert_gating_func", gguf::Value::of_u32(2));  // sigmoid gating (DeepSeek V3)
  CHECK_THAT(error_of(bad), Catch::Contains("only softmax gating (1) is supported"));

  // An old Mixtral conversion: each expert its own tensor.
  gguf::Writer old;
  const auto mx_bytes = synth_writer(mx, {}).to_bytes();
  const auto mx_file = gguf::File::parse(mx_bytes.data(), mx_bytes.size());
  for (const auto& [k, v] : mx_file->metadata()) old.set(k, v);
  auto zeros = [](uint8_t* d, size_t n) { std::memset(d, 0, n); };
  for (const TensorSpec& t : preset_tensors(mx, GgmlType::F32)) {
    if (t.name.find("_exps.") == std::string::npos) {
      old.add_tensor_lazy(t.name, t.type, t.dims, zeros);
      continue;
    }
    const std::string stem = t.name.substr(0, t.name.find("_exps."));
    for (int e = 0; e < 4; ++e)
      old.add_tensor_lazy(stem + "." + std::to_string(e) + ".weight", t.type, {t.dims[0], t.dims[1]}, zeros);
  }
  CHECK_THAT(error_of(old), Catch::Contains("an old Mixtral conversion"));
}

TEST_CASE("a count of 0, below 0 or past 2^24 is named, never divided by (head_count 0 was a SIGFPE)") {
  const ShapePreset tiny{"tiny-llama", "llama", "test", 2, 128, 4, 2, 32, 256, 600, 512, false, 0, 0, 1e6f, 1e-5f, false};
  const auto good = synth_writer(tiny, {}).to_bytes();
  const auto file = gguf::File::parse(good.data(), good.size());
  for (const char* key : {"block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                          "feed_forward_length", "context_length", "rope.dimension_count"}) {
    for (const gguf::Value& bad : {gguf::Value::of_u32(0), gguf::Value::of_i32(-1), gguf::Value::of_u64(1ull << 32)}) {
      // The file's keys without the head widths, so that the widths come from embedding / heads.
      gguf::Writer w;
      for (const auto& [k, v] : file->metadata())
        if (k != "llama.attention.key_length" && k != "llama.attention.value_length") w.set(k, v);
      w.set(std::string("llama.") + key, bad);
      const auto bytes = w.to_bytes();
      const std::string shown = bad.type == gguf::ValueType::INT32 ? std::to_string(bad.i) : std::to_string(bad.u);
      INFO(key << " = " << shown);
      try {
        ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
        FAIL("no error");
      } catch (const Error& e) {
        CHECK_THAT(e.what(), Catch::Contains(std::string(key) + " = " + shown + " is out of range"));
      }
    }
  }
}

TEST_CASE("yarn: only the settings that are wrong are named") {
  const ShapePreset tiny{"tiny-llama", "llama", "test", 2, 128, 4, 2, 32, 256, 600, 512, false, 0, 0, 1e6f, 1e-5f, false};
  gguf::Writer w = synth_writer(tiny, {});
  w.set("llama.rope.scaling.type", gguf::Value::of_str("yarn"));
  w.set("llama.rope.scaling.factor", gguf::Value::of_f32(4.f));
  w.set("llama.rope.scaling.original_context_length", gguf::Value::of_u32(0));
  const auto bytes = w.to_bytes();
  try {
    ModelConfig::from_gguf(*gguf::File::parse(bytes.data(), bytes.size()));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("original_context_length 0 must be > 0"));
    CHECK_THAT(e.what(), !Catch::Contains("beta_fast") && !Catch::Contains("ext_factor"));
  }
}
