#include "runtime/synth.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <thread>
#include <vector>

#include "gguf/error.h"
#include "gguf/file_type.h"
#include "kernels/cpu/threadpool.h"
#include "quant/quant.h"

namespace baton {
namespace {

// splitmix64: a tiny, well-mixed generator; exact integer arithmetic, so identical everywhere.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-0.5, 0.5), exactly representable.
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f) - 0.5f; }
  // Sum of four uniforms scaled to unit variance: a bounded, platform-exact stand-in for a normal.
  float normal() { return (uniform() + uniform() + uniform() + uniform()) * 1.7320508f; }
};

uint64_t hash_name(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

enum class Init { Normal, One, Bias, RopeShort, RopeLong };

// Fills a tensor: row r gets its own stream, rows are split over threads.
void fill_tensor(const TensorSpec& t, Init init, uint64_t seed, uint8_t* dst, size_t nbytes) {
  const int64_t cols = t.dims[0];
  int64_t rows = 1;
  for (size_t i = 1; i < t.dims.size(); i++) rows *= t.dims[i];
  const size_t rb = row_bytes(t.type, cols);
  BATON_CHECK(rb * size_t(rows) == nbytes);
  const float sigma = init == Init::Bias ? 0.02f : 1.0f / std::sqrt(float(cols));
  const uint64_t base = hash_name(seed, t.name);
  auto work = [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = r0; r < r1; r++) {
      Rng rng{base ^ (uint64_t(r) * 0xd1b54a32d192ed03ull)};
      for (size_t i = 0; i < row.size(); i++) {
        // LongRoPE divisors shaped like Phi-3.5's: near 1 for short contexts, growing to ~30 for long.
        const float at = float(i) / float(cols);
        row[i] = init == Init::One ? 1.0f : init == Init::RopeShort ? 1.0f + 0.05f * at
               : init == Init::RopeLong ? 1.0f + 30.0f * at * at : rng.normal() * sigma;
      }
      quantize_row(t.type, row.data(), dst + size_t(r) * rb, cols);
    }
  };
  const int64_t n_threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 64);
  if (rows < 64 || n_threads == 1) return work(0, rows);
  const int64_t per = (rows + n_threads - 1) / n_threads;
  const int parts = int((rows + per - 1) / per);
  // synth has no --threads: the error names the limit only.
  cpu::run_on_threads(parts, [&](int k) { work(k * per, std::min(rows, (k + 1) * per)); }, nullptr);
}

Init init_for(const std::string& name) {
  auto ends_with = [&](const char* s) {
    const std::string_view n(name), suf(s);
    return n.size() >= suf.size() && n.substr(n.size() - suf.size()) == suf;
  };
  if (ends_with(".bias")) return Init::Bias;
  if (name == "rope_factors_short.weight") return Init::RopeShort;
  if (name == "rope_factors_long.weight") return Init::RopeLong;
  if (ends_with("norm.weight")) return Init::One;
  return Init::Normal;
}

// Specials, 256 byte tokens, then pieces over the letters, shortest first, each with and without
// the SentencePiece word marker. Scores fall with rank, so merges prefer short common pieces.
void synthetic_vocab(gguf::Writer& w, uint32_t n_vocab) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; b++) {
    tokens.push_back(fmt::format("<0x{:02X}>", b));
    types.push_back(6);
  }
  const std::string letters = "etaoinshrdlucmfwypvbgkjqxz";
  const std::string marker = "\xe2\x96\x81";  // U+2581, SentencePiece's space
  std::vector<std::string> level = {""};
  while (tokens.size() < n_vocab) {
    std::vector<std::string> next;
    for (const auto& stem : level)
      for (char c : letters) next.push_back(stem + c);
    for (const auto& p : next) {
      for (const std::string& t : {marker + p, p}) {
        if (tokens.size() >= n_vocab) break;
        tokens.push_back(t);
        types.push_back(1);
      }
      if (tokens.size() >= n_vocab) break;
    }
    level = std::move(next);
  }
  std::vector<float> scores(n_vocab, 0.f);
  for (uint32_t i = 259; i < n_vocab; i++) scores[i] = -float(i - 259);
  w.set("tokenizer.ggml.model", gguf::Value::of_str("llama"));
  w.set("tokenizer.ggml.pre", gguf::Value::of_str("default"));
  w.set("tokenizer.ggml.tokens", gguf::Value::of_strs(gguf::StringList(tokens)));
  w.set("tokenizer.ggml.scores", gguf::Value::of_f32s(scores));
  w.set("tokenizer.ggml.token_type", gguf::Value::of_i32s(types));
  w.set("tokenizer.ggml.unknown_token_id", gguf::Value::of_u32(0));
  w.set("tokenizer.ggml.bos_token_id", gguf::Value::of_u32(1));
  w.set("tokenizer.ggml.eos_token_id", gguf::Value::of_u32(2));
  w.set("tokenizer.ggml.add_bos_token", gguf::Value::of_bool(true));
  w.set("tokenizer.ggml.add_eos_token", gguf::Value::of_bool(false));
  w.set("tokenizer.ggml.add_space_prefix", gguf::Value::of_bool(true));
}

void copied_vocab(gguf::Writer& w, const std::string& path, uint32_t n_vocab) {
  const auto f = gguf::File::open(path);
  const size_t n = f->get_strings("tokenizer.ggml.tokens").size();
  if (n != n_vocab)
    fail(ErrorKind::Usage, "vocabulary file '{}' has {} tokens but the shape has n_vocab {}", path, n, n_vocab);
  for (const auto& [k, v] : f->metadata())
    if (k.rfind("tokenizer.", 0) == 0) w.set(k, v);
}

}  // namespace

void check_shape(const ShapePreset& p) {
  auto need = [](bool ok, const char* what) {
    if (!ok) fail(ErrorKind::Usage, "synthetic shape: {}", what);
  };
  need(p.n_layer > 0 && p.n_embd > 0 && p.n_head > 0 && p.n_head_kv > 0 && p.head_dim > 0 && p.n_ff > 0,
       "n_layer, n_embd, n_head, n_head_kv, head_dim and n_ff must all be positive");
  need(p.n_head % p.n_head_kv == 0, "n_head must be a multiple of n_head_kv");
  need(p.n_vocab >= 259, "n_vocab must be at least 259 (3 specials and 256 byte tokens)");
  // Three metadata values a token (text, score, type) under the reader's limit, with room for the rest.
  need(p.n_vocab <= (gguf::kMaxMetadataValues - 4096) / 3,
       "n_vocab must be at most 5,591,040 (a GGUF reader holds 2^24 metadata values, three a token)");
  need(p.n_ctx_train > 0, "the context length must be positive");
  need(p.head_dim % 2 == 0, "head_dim must be even (rotary pairs)");
  need(p.rope_dim % 2 == 0 && p.rope_dim <= p.head_dim, "the rotated dims must be even and at most head_dim");
  need(p.n_embd % 32 == 0 && p.n_ff % 32 == 0 && (uint64_t(p.n_head) * p.head_dim) % 32 == 0,
       "n_embd, n_ff and n_head × head_dim must be multiples of 32");
  const std::string_view a = p.architecture;
  need(a == "llama" || a == "qwen2" || a == "qwen3" || a == "gemma3" || a == "gemma2" || a == "gemma" || a == "phi3" ||
           a == "qwen3moe" || a == "qwen2moe" || a == "gpt-oss" || a == "granite" || a == "granitemoe" || a == "smollm3" ||
           a == "olmo2" || a == "olmoe" || a == "ernie4_5" || a == "exaone4" || a == "glm4",
       "architecture must be llama, qwen2, qwen3, gemma3, gemma2, gemma, phi3, qwen3moe, qwen2moe, gpt-oss, granite, granitemoe, "
       "smollm3, olmo2, olmoe, ernie4_5, exaone4 or glm4");
  need(!p.out_bias || a == "ernie4_5", "an optional output bias is for ernie4_5 (--attn-bias)");
  const bool moe_arch = a == "qwen3moe" || a == "qwen2moe" || a == "gpt-oss" || a == "granitemoe" || a == "olmoe";
  need(p.n_expert > 0 || !moe_arch, "qwen3moe, qwen2moe, gpt-oss, granitemoe and olmoe need experts (--n-expert)");
  need(p.n_expert == 0 || a == "llama" || moe_arch,
       "experts are for llama (Mixtral), qwen3moe, qwen2moe, gpt-oss, granitemoe and olmoe");
  need((a != "granitemoe" && a != "olmoe") || p.n_ff_exp == p.n_ff,
       "granitemoe's and olmoe's experts are n_ff wide (their files say no other width)");
  need(p.embedding_scale >= 0 && p.residual_scale >= 0 && p.attention_scale >= 0 && p.logit_scale >= 0,
       "Granite's multipliers must be >= 0");
  need((a != "gpt-oss" && a != "glm4") || p.qkv_bias, "gpt-oss and glm4 have q/k/v biases");
  need(p.n_expert == 0 || (p.n_expert <= 4096 && p.n_expert_used >= 1 && p.n_expert_used <= p.n_expert),
       "experts used per token must be between 1 and the expert count (at most 4096)");
  need(p.n_expert == 0 || (p.n_ff_exp > 0 && p.n_ff_exp % 32 == 0 && p.n_ff_shexp % 32 == 0),
       "expert FFN widths must be positive multiples of 32");
  need((p.n_ff_shexp > 0) == (a == "qwen2moe"), "a shared expert (--n-ff-shexp) is what qwen2moe has, and only it");
  need(p.rope_long_ctx == 0 || (a == "phi3" && p.rope_long_ctx < p.n_ctx_train),
       "LongRoPE factors are for phi3, from a context shorter than the trained one");
  need(p.sliding_window == 0 || a == "gemma3" || a == "gemma2" || a == "gpt-oss" || a == "olmo2" || a == "exaone4",
       "a sliding window is only supported for gemma3, gemma2, gpt-oss, olmo2 (OLMo 3) and exaone4");
}

gguf::Writer synth_writer(const ShapePreset& p, const SynthOptions& opt) {
  check_shape(p);
  if (!has_quantize(opt.type) || !traits(opt.type).compute)
    fail(ErrorKind::Usage,
         "weight type {} cannot be written (use F32, F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, MXFP4)",
         type_name(opt.type));
  gguf::Writer w;
  const std::string a = p.architecture;
  auto key = [&](const char* suffix) { return a + "." + suffix; };
  w.set("general.architecture", gguf::Value::of_str(a));
  w.set("general.name", gguf::Value::of_str(p.name));
  w.set("general.description", gguf::Value::of_str(fmt::format(
      "baton synth: random weights, seed {}, type {}", opt.seed, type_name(opt.type))));
  w.set("general.quantization_version", gguf::Value::of_u32(2));
  if (const auto ft = gguf::file_type_for(opt.type))  // what tools call the model (Q4_0, Q4_K_S, ...)
    w.set("general.file_type", gguf::Value::of_u32(*ft));
  w.set(key("context_length"), gguf::Value::of_u32(p.n_ctx_train));
  w.set(key("embedding_length"), gguf::Value::of_u32(p.n_embd));
  w.set(key("block_count"), gguf::Value::of_u32(p.n_layer));
  w.set(key("feed_forward_length"), gguf::Value::of_u32(p.n_ff));
  w.set(key("attention.head_count"), gguf::Value::of_u32(p.n_head));
  w.set(key("attention.head_count_kv"), gguf::Value::of_u32(p.n_head_kv));
  const bool gemma = a == "gemma3" || a == "gemma2" || a == "gemma";  // (as their converters write them)
  if (gemma || p.head_dim * p.n_head != p.n_embd) {
    w.set(key("attention.key_length"), gguf::Value::of_u32(p.head_dim));
    w.set(key("attention.value_length"), gguf::Value::of_u32(p.head_dim));
  }
  if (!gemma) {
    w.set(key("rope.dimension_count"), gguf::Value::of_u32(p.rope_dim ? p.rope_dim : p.head_dim));
    w.set(key("vocab_size"), gguf::Value::of_u32(p.n_vocab));
  }
  w.set(key("rope.freq_base"), gguf::Value::of_f32(p.rope_base));
  if (a == "gemma2") {  // Gemma 2's published soft-caps
    w.set(key("attn_logit_softcapping"), gguf::Value::of_f32(50.f));
    w.set(key("final_logit_softcapping"), gguf::Value::of_f32(30.f));
  }
  if (p.rope_long_ctx) {  // as the Phi-3 converter writes LongRoPE: the original context and a magnitude
    const double scale = double(p.n_ctx_train) / p.rope_long_ctx;
    w.set(key("rope.scaling.original_context_length"), gguf::Value::of_u32(p.rope_long_ctx));
    w.set(key("rope.scaling.attn_factor"),
          gguf::Value::of_f32(float(std::sqrt(1 + std::log(scale) / std::log(double(p.rope_long_ctx))))));
  }
  if (a == "gpt-oss") {  // gpt-oss's YaRN: 32× from a 4096-token original context
    w.set(key("rope.scaling.type"), gguf::Value::of_str("yarn"));
    w.set(key("rope.scaling.factor"), gguf::Value::of_f32(32.f));
    w.set(key("rope.scaling.original_context_length"), gguf::Value::of_u32(4096));
  }
  if (a == "olmo2" && p.sliding_window) {  // OLMo 3: YaRN 8x from 8192 (its global layers only), as
    w.set(key("rope.scaling.type"), gguf::Value::of_str("yarn"));  // its converter writes it
    w.set(key("rope.scaling.factor"), gguf::Value::of_f32(8.f));
    w.set(key("rope.scaling.original_context_length"), gguf::Value::of_u32(8192));
    w.set(key("rope.scaling.yarn_attn_factor"), gguf::Value::of_f32(float(1 + 0.1 * std::log(8.0))));
  }
  w.set(key("attention.layer_norm_rms_epsilon"), gguf::Value::of_f32(p.rms_eps));
  if (a == "granite" || a == "granitemoe") {  // its multipliers, as the converter names them
    w.set(key("embedding_scale"), gguf::Value::of_f32(p.embedding_scale > 0 ? p.embedding_scale : 12.f));
    w.set(key("residual_scale"), gguf::Value::of_f32(p.residual_scale > 0 ? p.residual_scale : 0.22f));
    w.set(key("attention.scale"), gguf::Value::of_f32(p.attention_scale > 0 ? p.attention_scale : 1.f / float(p.head_dim)));
    w.set(key("logit_scale"), gguf::Value::of_f32(p.logit_scale > 0 ? p.logit_scale : 8.f));
  }
  if (p.n_expert > 0) {  // (Mixtral's llama files and granitemoe's carry no expert width: it is n_ff)
    w.set(key("expert_count"), gguf::Value::of_u32(p.n_expert));
    w.set(key("expert_used_count"), gguf::Value::of_u32(p.n_expert_used));
    if ((a != "llama" && a != "granitemoe" && a != "olmoe") || p.n_ff_exp != p.n_ff)
      w.set(key("expert_feed_forward_length"), gguf::Value::of_u32(p.n_ff_exp));
    if (p.n_ff_shexp > 0) w.set(key("expert_shared_feed_forward_length"), gguf::Value::of_u32(p.n_ff_shexp));
  }
  if (p.sliding_window) {
    w.set(key("attention.sliding_window"), gguf::Value::of_u32(p.sliding_window));
    if (a == "olmo2" || a == "exaone4") {  // OLMo 3's and EXAONE 4's converters write one flag per layer (true: sliding)
      std::vector<gguf::Value> sliding;
      for (uint32_t l = 0; l < p.n_layer; l++) sliding.push_back(gguf::Value::of_bool(!layer_is_global(l, p.swa_period)));
      w.set(key("attention.sliding_window_pattern"), gguf::Value::of_array(gguf::ValueType::BOOL, std::move(sliding)));
    } else if (p.swa_period != default_swa_period(a)) {  // gemma's periods are implied, as in real files
      w.set(key("attention.sliding_window_pattern"), gguf::Value::of_u32(p.swa_period));
    }
  }
  if (opt.vocab_from.empty()) synthetic_vocab(w, p.n_vocab);
  else copied_vocab(w, opt.vocab_from, p.n_vocab);
  if (opt.pooling >= 0) {  // an embedding model
    if (opt.pooling > 3) fail(ErrorKind::Usage, "pooling type {}: use 0 (none), 1 (mean), 2 (cls) or 3 (last)", opt.pooling);
    w.set(key("pooling_type"), gguf::Value::of_u32(uint32_t(opt.pooling)));
    if (opt.pooling == 3) w.set("tokenizer.ggml.add_eos_token", gguf::Value::of_bool(true));
  }

  for (const TensorSpec& t : preset_tensors(p, opt.type)) {
    const Init init = init_for(t.name);
    const uint64_t seed = opt.seed;
    w.add_tensor_lazy(t.name, t.type, t.dims,
                      [t, init, seed](uint8_t* dst, size_t nbytes) { fill_tensor(t, init, seed, dst, nbytes); });
  }
  return w;
}

void synth_write(const ShapePreset& p, const SynthOptions& opt, const std::string& path) {
  const gguf::Writer w = synth_writer(p, opt);
  // Refused before a byte is written: a file that cannot fit the disk would fail hours later.
  const uint64_t bytes = w.file_size();
  const std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
  std::error_code ec;
  const auto space = std::filesystem::space(dir, ec);
  if (!ec && bytes > space.available)
    fail(ErrorKind::Model, "writing '{}' needs {:.1f} GiB, and {} has {:.1f} GiB free", path, double(bytes) / (1 << 30),
         dir.string(), double(space.available) / (1 << 30));
  w.write(path);
}

}  // namespace baton
