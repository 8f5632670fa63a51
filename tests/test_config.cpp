// The attention scale: 1/sqrt(query_pre_attn_scalar) as each published Gemma 3 config sets it,
// checked on the real sizes' shapes, and through ModelConfig::from_gguf on a tiny 62-layer file.
#include <cmath>

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
