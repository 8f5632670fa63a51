// `baton synth`: write a deterministic random-weight GGUF of a real model's shape (or a custom one).
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/options.h"
#include "gguf/gguf.h"
#include "runtime/config.h"
#include "runtime/devices.h"
#include "runtime/lora.h"
#include "runtime/model_files.h"
#include "runtime/embed.h"
#include "runtime/shape.h"
#include "runtime/synth.h"

namespace baton::cli {
namespace {

struct SynthArgs {
  std::string shape, arch, type, out, vocab, pooling;
  uint64_t seed = 0;
  std::optional<uint32_t> n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, ctx;
  std::optional<uint32_t> n_expert, n_expert_used, n_ff_exp, n_ff_shexp, sliding_window;
  bool tied = false, attn_bias = false;
  // --lora-of BASE: a random LoRA adapter for BASE instead of a model.
  std::string lora_of, lora_targets = "all";
  int rank = 16;
  float alpha = 0.f, amplitude = 0.5f;
};

std::string preset_names() {
  std::string names;
  for (const ShapePreset& p : shape_presets()) names += std::string(names.empty() ? "" : ", ") + p.name;
  return names;
}

// A random adapter for a.lora_of (runtime/lora.h): its pairs for the named per-layer matrices
// (attn_q, ffn_down, ...: every layer that has one; "all": every adaptable layer matrix) and for
// output / token_embd when named.
int write_lora(const SynthArgs& a, bool model_flags) {
  if (model_flags) fail(ErrorKind::Usage, "--lora-of writes an adapter for that model: the shape flags do not apply");
  const auto base = gguf::File::open(resolve_model(a.lora_of));
  const ModelConfig cfg = ModelConfig::from_gguf(*base);
  LoraSynthOptions o;
  o.rank = a.rank;
  o.alpha = a.alpha;
  o.amplitude = a.amplitude;
  o.seed = a.seed;
  o.type = GgmlType::F16;
  if (!a.type.empty()) {
    const TypeTraits* t = type_by_name(a.type);
    if (!t) fail(ErrorKind::Usage, "--type '{}' is not a known type", a.type);
    o.type = t->type;
  }
  static const LayerTensor kAll[] = {LayerTensor::Wq, LayerTensor::Wk, LayerTensor::Wv, LayerTensor::Wqkv,
                                     LayerTensor::Wo, LayerTensor::Gate, LayerTensor::Up, LayerTensor::Down};
  for (const std::string& name : split_commas(a.lora_targets)) {
    if (name == "output" || name == "token_embd") {
      o.targets.push_back(name + ".weight");
      continue;
    }
    size_t found = o.targets.size();
    for (LayerTensor t : kAll)
      if (name == "all" || name == layer_tensor_name(t))
        for (int l = 0; l < cfg.n_layer; ++l)
          if (base->tensor(layer_tensor_key(l, t))) o.targets.push_back(layer_tensor_key(l, t));
    if (o.targets.size() == found)
      fail(ErrorKind::Usage, "--lora-targets: '{}' names no matrix of {} (attn_q, attn_k, attn_v, attn_qkv, attn_output, "
           "ffn_gate, ffn_up, ffn_down, output, token_embd or all)", name, base->path());
  }
  const gguf::Writer w = lora_synth_writer(*base, o);
  std::fprintf(stderr, "writing %s: a rank-%d %s LoRA adapter of %zu matrices for %s, %s, seed %llu\n", a.out.c_str(), o.rank,
               type_name(o.type), o.targets.size(), base->path().c_str(), format_bytes(w.file_size()).c_str(),
               (unsigned long long)a.seed);
  w.write(a.out);
  return 0;
}

int run_synth(const SynthArgs& a) {
  const bool custom = a.n_embd || a.n_layer || a.n_head || a.n_head_kv || a.head_dim || a.n_ff || a.n_vocab || a.ctx ||
                      !a.arch.empty() || a.tied || a.attn_bias || a.sliding_window || a.n_expert || a.n_expert_used || a.n_ff_exp || a.n_ff_shexp;
  if (!a.lora_of.empty()) return write_lora(a, custom || !a.shape.empty() || !a.vocab.empty() || !a.pooling.empty());
  ShapePreset p{};
  if (!a.shape.empty()) {
    p = find_preset(a.shape);
  } else {
    if (!a.n_embd || !a.n_layer || !a.n_head || !a.n_ff || !a.n_vocab)
      fail(ErrorKind::Usage, "give --shape NAME, or at least --n-embd, --n-layer, --n-head, --n-ff and --n-vocab");
    p = {"custom", "llama", "custom shape", 0, 0, 0, 0, 0, 0, 0, 4096, false, 0, 0, 10000.f, 1e-5f, false};
  }
  if (custom) {
    if (!a.shape.empty()) p.name = "custom";
    if (!a.arch.empty()) {
      if (a.arch == "llama") p.architecture = "llama";
      else if (a.arch == "qwen2") p.architecture = "qwen2", p.qkv_bias = true;
      else if (a.arch == "qwen3") p.architecture = "qwen3", p.qkv_bias = false;
      else if (a.arch == "phi3") p.architecture = "phi3", p.qkv_bias = false;
      else if (a.arch == "qwen3moe") p.architecture = "qwen3moe", p.qkv_bias = false;
      else if (a.arch == "qwen2moe") p.architecture = "qwen2moe", p.qkv_bias = true;
      else if (a.arch == "granite") p.architecture = "granite", p.qkv_bias = false;  // (Granite 3's multipliers)
      else if (a.arch == "granitemoe") p.architecture = "granitemoe", p.qkv_bias = false;
      else if (a.arch == "smollm3") p.architecture = "smollm3", p.qkv_bias = false;  // (every 4th layer NoPE)
      else if (a.arch == "olmo2") p.architecture = "olmo2", p.qkv_bias = false, p.swa_period = 4;  // (--sliding-window: OLMo 3)
      else if (a.arch == "olmoe") p.architecture = "olmoe", p.qkv_bias = false;
      else if (a.arch == "ernie4_5") p.architecture = "ernie4_5", p.qkv_bias = false;  // (--attn-bias: use_bias)
      else if (a.arch == "exaone4") p.architecture = "exaone4", p.qkv_bias = false, p.swa_period = 4;  // (--sliding-window: 32B's layout)
      else if (a.arch == "gemma") p.architecture = "gemma", p.qkv_bias = false, p.tied = true;  // (Gemma 1: its head is tied)
      else if (a.arch == "glm4") p.architecture = "glm4", p.qkv_bias = true;  // (half of each head rotated: below)
      else if (a.arch == "gpt-oss") {  // every other layer sliding, 128 tokens unless --sliding-window says
        p.architecture = "gpt-oss", p.qkv_bias = true, p.swa_period = 2;
        if (!p.sliding_window) p.sliding_window = 128;
      } else
        fail(ErrorKind::Usage,
             "--arch '{}': custom shapes are llama, qwen2, qwen3, phi3, qwen3moe, qwen2moe, gpt-oss, granite, granitemoe, "
             "smollm3, olmo2, olmoe, ernie4_5, exaone4, gemma or glm4 (gemma2 and gemma3 through --shape)",
             a.arch);
    }
    if (a.sliding_window) p.sliding_window = *a.sliding_window;
    if (a.n_expert) p.n_expert = *a.n_expert;
    if (a.n_expert_used) p.n_expert_used = *a.n_expert_used;
    if (a.n_ff_exp) p.n_ff_exp = *a.n_ff_exp;
    if (a.n_ff_shexp) p.n_ff_shexp = *a.n_ff_shexp;
    if (a.n_embd) p.n_embd = *a.n_embd;
    if (a.n_layer) p.n_layer = *a.n_layer;
    if (a.n_head) p.n_head = *a.n_head;
    p.n_head_kv = a.n_head_kv ? *a.n_head_kv : (a.n_head ? p.n_head : p.n_head_kv);
    if (a.n_ff) p.n_ff = *a.n_ff;
    const bool ff_wide_experts = p.architecture == std::string_view("granitemoe") || p.architecture == std::string_view("olmoe");
    if (p.n_expert > 0 && (!p.n_ff_exp || (ff_wide_experts && !a.n_ff_exp)))
      p.n_ff_exp = p.n_ff;  // (as a file without the key reads; granitemoe's and olmoe's experts are n_ff wide)
    if (a.n_vocab) p.n_vocab = *a.n_vocab;
    if (a.ctx) p.n_ctx_train = *a.ctx;
    if (a.tied) p.tied = true;
    if (a.attn_bias) p.qkv_bias = p.out_bias = true;
    if (a.head_dim) p.head_dim = *a.head_dim;
    else if (a.n_embd || a.n_head || a.shape.empty()) p.head_dim = p.n_head ? p.n_embd / p.n_head : 0;
    if (p.architecture == std::string_view("glm4")) p.rope_dim = p.head_dim / 2;  // (partial_rotary_factor 0.5)
  }
  if (a.type.empty()) fail(ErrorKind::Usage, "--type is required (e.g. Q4_K, Q8_0, F16)");
  const TypeTraits* t = type_by_name(a.type);
  if (!t) fail(ErrorKind::Usage, "--type '{}' is not a known type", a.type);
  SynthOptions o;
  o.type = t->type;
  o.seed = a.seed;
  o.vocab_from = a.vocab.empty() ? "" : resolve_model(a.vocab);  // a path or a known name, as -m takes
  if (!a.pooling.empty()) o.pooling = int(parse_pooling(a.pooling));  // (rank and unknown names: an error)
  const ModelShape s = shape_from_preset((check_shape(p), p), o.type);
  std::fprintf(stderr, "writing %s: %s (%s), %u layers, %s of weights, seed %llu\n", a.out.c_str(), p.name,
               p.architecture, p.n_layer, format_bytes(s.total_weight_bytes()).c_str(), (unsigned long long)a.seed);
  synth_write(p, o, a.out);
  return 0;
}

Register reg{{"synth", "Write a random-weight GGUF of a real model's shape (deterministic per seed)",
              [](CLI::App& app) {
                auto a = std::make_shared<SynthArgs>();
                app.add_option("--shape", a->shape, "Preset: " + preset_names());
                app.add_option("--type", a->type,
                               "Weight type: F32, F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, or MXFP4 (as "
                               "gpt-oss files: the expert matrices MXFP4 — without experts the FFN matrices — and "
                               "the other matrices Q8_0; rows must be multiples of 32); with --lora-of the adapter's "
                               "(default F16)");
                app.add_option("--out", a->out, "Output file")->required()->check(not_empty("the path"));
                // Not -1 (run's random seed): the file follows from its seed, and leaving it out is 0.
                app.add_option("--seed", a->seed, "Random seed, 0 to 2^64-1 (default 0)")
                    ->check(CLI::Validator(
                        [](std::string& v) {
                          if (v.find('-') == std::string::npos) return check_seed(v);
                          return fmt::format("{} is not allowed (must be 0 to {}: the weights follow from the seed)", v,
                                             UINT64_MAX);
                        },
                        ""));
                app.add_option("--vocab", a->vocab, "Copy the tokenizer from this GGUF, a path or a known name (same token count)");
                app.add_option("--pooling", a->pooling,
                               "An embedding model: write {arch}.pooling_type none, mean, cls or last (last also "
                               "sets tokenizer.ggml.add_eos_token)");
                app.add_option("--arch", a->arch,
                               "Custom shapes: llama (default), qwen2, qwen3, phi3, qwen3moe, qwen2moe, gpt-oss, granite "
                               "(Granite 3's multipliers: embeddings x12, branches x0.22, q.k x1/head_dim, logits /8), "
                               "granitemoe, smollm3 (every 4th layer without RoPE), olmo2 (OLMo 2; with "
                               "--sliding-window OLMo 3: 3 of 4 layers sliding, YaRN on the others), olmoe, ernie4_5 (ERNIE 4.5 "
                               "dense), exaone4 (with --sliding-window the 32B's layout: 3 of 4 layers sliding, "
                               "the others without RoPE), gemma (Gemma 1: tied head; give --head-dim for its 256) or "
                               "glm4 (GLM-4-0414: post-norms, q/k/v biases, fused gate/up, half of each head rotated)");
                app.add_option("--sliding-window", a->sliding_window,
                               "Custom shape: the sliding-window layers' window (gemma2/gemma3 presets, gpt-oss, olmo2, exaone4)");
                app.add_option("--n-embd", a->n_embd, "Custom shape: embedding width")->check(at_least(1));
                app.add_option("--n-layer", a->n_layer, "Custom shape: layers")->check(at_least(1));
                app.add_option("--n-head", a->n_head, "Custom shape: query heads")->check(at_least(1));
                app.add_option("--n-head-kv", a->n_head_kv, "Custom shape: KV heads (default n_head)")->check(at_least(1));
                app.add_option("--head-dim", a->head_dim, "Custom shape: head width (default n_embd / n_head)")->check(at_least(1));
                app.add_option("--n-ff", a->n_ff, "Custom shape: FFN width")->check(at_least(1));
                app.add_option("--n-vocab", a->n_vocab, "Custom shape: vocabulary size (>= 259)")->check(at_least(1));
                app.add_option("--ctx", a->ctx, "Custom shape: trained context length (default 4096)")->check(at_least(1));
                app.add_flag("--tied", a->tied, "Custom shape: no output.weight (the head uses token_embd)");
                app.add_flag("--attn-bias", a->attn_bias,
                             "Custom shape: q/k/v and attn_output biases in every layer (ernie4_5's use_bias)");
                app.add_option("--n-expert", a->n_expert, "Custom shape: experts per layer (a mixture of experts)")->check(at_least(0));
                app.add_option("--n-expert-used", a->n_expert_used, "Custom shape: experts per token")->check(at_least(0));
                app.add_option("--n-ff-exp", a->n_ff_exp, "Custom shape: an expert's FFN width (default n_ff)")->check(at_least(0));
                app.add_option("--n-ff-shexp", a->n_ff_shexp, "Custom shape: the shared expert's FFN width (qwen2moe)")->check(at_least(0));
                app.add_option("--lora-of", a->lora_of,
                               "Write a random LoRA adapter for this model (a path or a known name) instead of a model");
                app.add_option("--lora-targets", a->lora_targets,
                               "With --lora-of: the matrices adapted, per layer (attn_q, attn_k, attn_v, attn_qkv, "
                               "attn_output, ffn_gate, ffn_up, ffn_down) or output, token_embd; all: every layer matrix")
                    ->capture_default_str();
                app.add_option("--rank", a->rank, "With --lora-of: the adapter's rank")->capture_default_str()->check(at_least(1));
                app.add_option("--alpha", a->alpha, "With --lora-of: adapter.lora.alpha (0: none written, scale 1)");
                app.add_option("--amplitude", a->amplitude,
                               "With --lora-of: B·A·x about this times W·x for synth's weights")->capture_default_str();
                return [a] { return run_synth(*a); };
              }}};

}  // namespace
}  // namespace baton::cli
