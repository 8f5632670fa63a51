// ModelShape from the real files: the presets match their published configs, Gemma 3's sliding
// layers are read right, every tensor byte is counted, and plan sizes equal the CPU forward's.
#include "gguf/gguf.h"
#include "helpers.h"
#include "weight_bytes.h"
#include "models/llama.h"
#include "runtime/buffers.h"
#include "runtime/config.h"
#include "runtime/kv_cache.h"
#include "runtime/planner.h"
#include "runtime/shape.h"

using namespace baton;

namespace {

void check_against_preset(const std::string& path, const char* preset) {
  const auto f = gguf::File::open(path);
  const ModelShape s = shape_from_gguf(*f);
  const ModelShape p = shape_from_preset(find_preset(preset), GgmlType::Q8_0);
  // Dimensions come from the published config; bytes differ (the real file mixes quant types).
  CHECK(s.architecture == p.architecture);
  CHECK(s.n_layer == p.n_layer);
  CHECK(s.n_embd == p.n_embd);
  CHECK(s.n_head == p.n_head);
  CHECK(s.head_dim_k == p.head_dim_k);
  CHECK(s.head_dim_v == p.head_dim_v);
  CHECK(s.n_ff == p.n_ff);
  CHECK(s.n_vocab == p.n_vocab);
  CHECK(s.n_ctx_train == p.n_ctx_train);
  CHECK(s.tied_output == p.tied_output);
  REQUIRE(s.layers.size() == p.layers.size());
  for (size_t i = 0; i < s.layers.size(); i++) {
    CHECK(s.layers[i].n_head_kv == p.layers[i].n_head_kv);
    CHECK(s.layers[i].sliding_window == p.layers[i].sliding_window);
  }
  // Every tensor counted once, a matrix as the larger of its CPU packed copy and its GPU rows
  // (padded to 16 bytes: SmolLM2's 576-wide Q8_0 rows are 612 bytes in the file, 624 on a GPU).
  uint64_t file = 0, sum = 0;
  for (const auto& t : f->tensors()) {
    file += t.nbytes;
    sum += test::expected_used_bytes(t);
  }
  CHECK(s.total_weight_bytes() == sum);
  CHECK(sum >= file);
  CHECK(sum <= file + file * 3 / 100);
  CHECK(s.output_bytes == s.embedding_bytes);  // both tied

  // The forward's own sizes agree with the planner's.
  const ModelConfig c = ModelConfig::from_gguf(*f);
  for (GgmlType kv : {GgmlType::F16, GgmlType::Q8_0}) {
    CHECK(scratch_layout(s, 512, true, kv).forward_scratch() == Scratch::bytes(c, 512, kv));
    KvCacheShape ks;
    ks.layer_end = int(s.n_layer);
    ks.n_seq = 2;
    ks.n_ctx = 4096;
    ks.type = kv;
    PlanOptions o;
    o.n_ctx = 4096;
    o.n_parallel = 2;
    o.kv_type = kv;
    DeviceSpec cpu;
    cpu.label = "cpu";
    cpu.budget = 8ull << 30;
    const Plan pl = plan(s, {cpu}, o);
    REQUIRE(pl.fits);
    CHECK(pl.kv_bytes() == KvCache::bytes(c, ks));
  }
}

}  // namespace

TEST_CASE("SmolLM2 135M: shape of the real file") {
  const std::string path = test::smollm2();
  if (path.empty()) return;
  check_against_preset(path, "smollm2-135m");
}

TEST_CASE("Gemma 3 270M: shape of the real file, every 6th layer global") {
  const std::string path = test::gemma3();
  if (path.empty()) return;
  check_against_preset(path, "gemma3-270m");
  const ModelShape s = shape_from_gguf(*gguf::File::open(path));
  for (uint32_t i = 0; i < s.n_layer; i++) CHECK(s.layers[i].sliding_window == (i == 5 || i == 11 || i == 17 ? 0u : 512u));
}
