// baton synth: files our reader loads, with the shape of their preset, deterministic per seed, that
// the CPU forward runs with sane activations; and the planner's KV/scratch sizes equal what that
// forward allocates.
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "gguf/file_type.h"
#include "gguf/gguf.h"
#include "helpers.h"
#include "weight_bytes.h"
#include "models/llama.h"
#include "runtime/buffers.h"
#include "runtime/config.h"
#include "runtime/kv_cache.h"
#include "runtime/pipeline.h"
#include "runtime/shape.h"
#include "runtime/synth.h"
#include "runtime/tokenizer.h"

using namespace baton;

namespace {

// Small shapes of the eight architectures (llama twice: dense and with experts) (same fields as the presets, a fraction of the size).
const ShapePreset kTinyLlama{"tiny-llama", "llama", "test", 3, 128, 4, 2, 32, 256, 600, 512, false, 0, 0, 10000.f, 1e-5f, false};
const ShapePreset kTinyQwen{"tiny-qwen2", "qwen2", "test", 2, 96, 3, 1, 32, 192, 700, 1024, false, 0, 0, 1e6f, 1e-6f, true};
// (qwen3: 4 heads of 64 on a 128-wide residual, as Qwen3's heads are wider than n_embd / n_head)
const ShapePreset kTinyQwen3{"tiny-qwen3", "qwen3", "test", 2, 128, 4, 2, 64, 256, 800, 1024, true, 0, 0, 1e6f, 1e-6f, false};
const ShapePreset kTinyGemma{"tiny-gemma3", "gemma3", "test", 7, 64, 2, 1, 64, 256, 1000, 2048, true, 16, 6, 1e6f, 1e-6f, false};
// (phi3: fused q/k/v and gate/up, LongRoPE factors past a context of 32, 24 of 32 head dims rotated)
const ShapePreset kTinyGemma2{"tiny-gemma2", "gemma2", "test", 4, 64, 2, 1, 64, 256, 1000, 2048, true, 16, 2, 1e4f, 1e-6f, false};
// (gemma: Gemma 1, heads wider than n_embd / n_head as the 7B's, one KV head as the 2B's)
const ShapePreset kTinyGemma1{"tiny-gemma", "gemma", "test", 2, 64, 2, 1, 64, 256, 1000, 2048, true, 0, 0, 1e4f, 1e-6f, false};
// (glm4: post-norms, q/k/v biases, fused gate/up, half of each head rotated)
const ShapePreset kTinyGlm4{"tiny-glm4", "glm4", "test", 2, 64, 2, 1, 32, 256, 1000, 2048, false, 0, 0, 1e4f, 1e-5f, true, 0, 16};
const ShapePreset kTinyPhi3{"tiny-phi3", "phi3", "test", 2, 128, 4, 2, 32, 256, 700, 1024, false, 0, 0, 1e4f, 1e-5f, false, 32, 24};
// (mixtures of experts: Mixtral-style llama 2 of 4; qwen3moe 3 of 8 narrow ones; qwen2moe 2 of 6
// and a shared expert)
const ShapePreset kTinyMixtral{"tiny-mixtral", "llama", "test", 2, 128, 4, 2, 32, 256, 600, 512, false, 0, 0, 1e6f, 1e-5f, false, 0, 0, 4, 2, 256};
const ShapePreset kTinyQwen3Moe{"tiny-qwen3moe", "qwen3moe", "test", 2, 128, 4, 2, 64, 256, 700, 1024, false, 0, 0, 1e6f, 1e-6f, false, 0, 0, 8, 3, 64};
const ShapePreset kTinyQwen2Moe{"tiny-qwen2moe", "qwen2moe", "test", 2, 96, 3, 3, 32, 192, 700, 1024, false, 0, 0, 1e6f, 1e-6f, true, 0, 0, 6, 2, 96, 192};
const ShapePreset* const kTiny[] = {&kTinyLlama, &kTinyQwen, &kTinyQwen3, &kTinyGemma, &kTinyPhi3, &kTinyGemma2,
                                    &kTinyGemma1, &kTinyGlm4, &kTinyMixtral, &kTinyQwen3Moe, &kTinyQwen2Moe};

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("synth writes files whose shape equals the preset's") {
  const std::string dir = test::temp_dir();
  for (const ShapePreset* p : kTiny) {
    for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K}) {
      INFO(p->name << " " << type_name(t));
      const std::string path = dir + "/" + p->name + "-" + type_name(t) + ".gguf";
      SynthOptions o;
      o.type = t;
      synth_write(*p, o, path);
      const auto f = gguf::File::open(path);
      const ModelShape from_file = shape_from_gguf(*f);
      const ModelShape from_preset = shape_from_preset(*p, t);
      CHECK(from_file == from_preset);
      CHECK(from_file.tied_output == p->tied);
      // Every byte of tensor data is accounted for exactly once (a matrix as the larger of a CPU
      // stage's packed copy — whole groups of 16 rows — and a GPU stage's rows padded to 16 bytes).
      uint64_t sum = 0;
      for (const auto& ti : f->tensors()) sum += test::expected_used_bytes(ti);
      CHECK(from_file.total_weight_bytes() == sum);
      // The runtime's own reader accepts it too.
      const ModelConfig c = ModelConfig::from_gguf(*f);
      CHECK(c.n_layer == int(p->n_layer));
      CHECK(c.n_vocab == int(p->n_vocab));
      // general.file_type says what the weights are, so tools name the model by it.
      CHECK(f->get<uint32_t>("general.file_type") == gguf::file_type_for(t).value());
      CHECK(gguf::weight_type_label(*f) == (t == GgmlType::Q4_K ? std::string("Q4_K_S") : std::string(type_name(t))));
    }
  }
}

TEST_CASE("a real preset (smollm2-135m) round-trips through a synthetic file") {
  const ShapePreset& p = find_preset("smollm2-135m");
  const std::string path = test::temp_dir() + "/smol.gguf";
  SynthOptions o;
  o.type = GgmlType::Q4_0;
  synth_write(p, o, path);
  const auto f = gguf::File::open(path);
  CHECK(shape_from_gguf(*f) == shape_from_preset(p, GgmlType::Q4_0));
  CHECK(f->get_strings("tokenizer.ggml.tokens").size() == 49152);
  // 576-wide rows do not fit Q4_K's 256 blocks: the substitute is Q5_0, as in real files.
  CHECK(weight_type_for_row(GgmlType::Q4_K, 576) == GgmlType::Q5_0);
  CHECK(weight_type_for_row(GgmlType::Q6_K, 576) == GgmlType::Q8_0);
  CHECK(weight_type_for_row(GgmlType::Q4_K, 1536) == GgmlType::Q4_K);
  CHECK(weight_type_for_row(GgmlType::Q4_0, 48) == GgmlType::F16);
}

TEST_CASE("synth is deterministic for a seed and differs between seeds") {
  SynthOptions o;
  o.type = GgmlType::Q4_K;
  o.seed = 7;
  const auto a = synth_writer(kTinyLlama, o).to_bytes();
  const auto b = synth_writer(kTinyLlama, o).to_bytes();
  CHECK(a == b);
  // Streaming to a file gives the same bytes as building it in memory.
  const std::string path = test::temp_dir() + "/det.gguf";
  synth_write(kTinyLlama, o, path);
  CHECK(read_all(path) == a);
  o.seed = 8;
  const auto c = synth_writer(kTinyLlama, o).to_bytes();
  REQUIRE(c.size() == a.size());
  const auto fa = gguf::File::parse(a.data(), a.size()), fc = gguf::File::parse(c.data(), c.size());
  for (const auto& t : fa->tensors()) {
    const auto& u = fc->require_tensor(t.name);
    const bool same = std::memcmp(t.data, u.data, t.nbytes) == 0;
    INFO(t.name);
    // Weights change with the seed; norms are all ones whatever the seed.
    if (t.name.find("norm") != std::string::npos) CHECK(same);
    else CHECK_FALSE(same);
  }
}

TEST_CASE("synthetic models run through the CPU forward with sane logits") {
  const std::string dir = test::temp_dir();
  for (const ShapePreset* p : kTiny) {
    INFO(p->name);
    const std::string path = dir + "/" + p->name + ".gguf";
    SynthOptions o;
    o.type = GgmlType::Q8_0;
    o.seed = 3;
    synth_write(*p, o, path);
    LoadOptions lo;
    lo.n_ctx = 64;
    lo.n_threads = 2;
    auto pipe = Pipeline::load(path, lo);
    // Tokenize with the file's synthetic vocabulary (byte fallback covers any text).
    const auto ids = pipe->tokenizer().encode("the quick brown fox, 42!", true, false);
    REQUIRE(ids.size() >= 3);
    Batch b;
    for (size_t i = 0; i < ids.size(); i++) b.add(ids[i], int(i), 0, true);
    std::vector<float> logits(ids.size() * size_t(p->n_vocab));
    pipe->decode(b, logits.data());
    for (size_t r = 0; r < ids.size(); r++) {
      double sum = 0, sq = 0;
      for (uint32_t v = 0; v < p->n_vocab; v++) {
        const float x = logits[r * p->n_vocab + v];
        REQUIRE(std::isfinite(x));
        sum += x;
        sq += double(x) * x;
      }
      const double mean = sum / p->n_vocab, sd = std::sqrt(sq / p->n_vocab - mean * mean);
      CHECK(sd > 0.3);
      CHECK(sd < 5.0);
    }
  }
}

TEST_CASE("the planner's KV and scratch bytes equal the CPU forward's allocations") {
  const std::string dir = test::temp_dir();
  for (const ShapePreset* p : kTiny) {
    const std::string path = dir + "/" + p->name + ".gguf";
    synth_write(*p, SynthOptions{}, path);
    const auto f = gguf::File::open(path);
    const ModelConfig c = ModelConfig::from_gguf(*f);
    const ModelShape s = shape_from_gguf(*f);
    for (GgmlType kv : {GgmlType::F16, GgmlType::Q8_0})
      for (int n_batch : {1, 7, 512})
        for (int n_ctx : {5, 16, 300}) {
          INFO(p->name << " kv " << type_name(kv) << " batch " << n_batch << " ctx " << n_ctx);
          CHECK(scratch_layout(s, uint32_t(n_batch), false, kv).forward_scratch() ==
                Scratch::bytes(c, n_batch, kv));
          KvCacheShape ks;
          ks.layer_begin = 1;
          ks.layer_end = int(s.n_layer);
          ks.n_seq = 3;
          ks.n_ctx = n_ctx;
          ks.type = kv;
          uint64_t planned = 0;
          for (uint32_t i = 1; i < s.n_layer; i++) planned += kv_layer_bytes(s, i, uint32_t(n_ctx), 3, kv);
          CHECK(planned == KvCache::bytes(c, ks));
        }
  }
}

TEST_CASE("synth options: copied vocabulary and shape errors") {
  ShapePreset p = kTinyLlama;
  p.n_vocab = 32000;
  SynthOptions o;
  o.vocab_from = test::peer("tokenizer/ggml-vocab-llama-spm.gguf");
  const auto bytes = synth_writer(p, o).to_bytes();
  const auto f = gguf::File::parse(bytes.data(), bytes.size());
  const auto peer = gguf::File::open(o.vocab_from);
  CHECK(f->get_strings("tokenizer.ggml.tokens") == peer->get_strings("tokenizer.ggml.tokens"));
  CHECK(f->get<std::string>("tokenizer.ggml.model") == "llama");

  p.n_vocab = 1000;  // the vocabulary file has 32000 tokens
  CHECK_THROWS_AS(synth_writer(p, o), Error);

  ShapePreset bad = kTinyLlama;
  bad.n_head_kv = 3;  // 4 heads are not a multiple of 3
  CHECK_THROWS_AS(check_shape(bad), Error);
  bad = kTinyLlama;
  bad.n_vocab = 100;
  CHECK_THROWS_AS(check_shape(bad), Error);
  bad = kTinyLlama;
  bad.n_vocab = 6000000;  // more tokens than a reader holds metadata values for (2^24, three a token)
  CHECK_THAT(test::usage_error([&] { check_shape(bad); }), Catch::Contains("n_vocab must be at most 5,591,040"));
  bad.n_vocab = 5591040;
  CHECK_NOTHROW(check_shape(bad));
  bad = kTinyLlama;
  bad.sliding_window = 8;  // only gemma3 runs sliding windows
  CHECK_THROWS_AS(check_shape(bad), Error);
  bad = kTinyQwen3Moe;
  bad.n_expert_used = 9;  // of 8
  CHECK_THROWS_AS(check_shape(bad), Error);
  bad = kTinyQwen3Moe;
  bad.n_expert = 0;  // qwen3moe without experts
  CHECK_THROWS_AS(check_shape(bad), Error);
  bad = kTinyQwen3Moe;
  bad.n_ff_shexp = 64;  // a shared expert is qwen2moe's
  CHECK_THROWS_AS(check_shape(bad), Error);
  bad = kTinyQwen;
  bad.n_expert = 4;  // experts in a qwen2 file
  bad.n_expert_used = 2;
  bad.n_ff_exp = 64;
  CHECK_THROWS_AS(check_shape(bad), Error);
  SynthOptions q;
  q.type = GgmlType::IQ2_XS;
  CHECK_THROWS_AS(synth_writer(kTinyLlama, q), Error);
}
