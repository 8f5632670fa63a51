// LoRA adapters (GGUF files as llama.cpp's convert_lora_to_gguf.py writes them): for a base matrix
// W, a pair of low-rank matrices A (`<name>.lora_a`, [n_in, r]) and B (`<name>.lora_b`, [r, n_out])
// so that the adapted layer computes W·x + s·B·(A·x), s = scale · alpha / r (scale: what the user
// gives, 1 by default; alpha: adapter.lora.alpha, 0 or absent meaning s = scale). The token
// embedding's pair is stored the other way round (A [r, n_vocab], B [r, n_embd]): a token's row of
// A through B is added to its embedding row. The files stay mapped; nothing is merged into the
// base weights, so any base type takes any adapter and several adapters add up.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf.h"

namespace baton {

struct ModelConfig;
struct ModelShape;

// Adapters at most in one run (a matmul job holds 3 base matrices and their pairs' A: 15 of 16 targets).
constexpr int kMaxLoraFiles = 4;

// An adapter as the user names it: --lora FILE (scale 1) or --lora-scaled FILE SCALE.
struct LoraFile {
  std::string path;
  float scale = 1.f;
};

// One adapted base tensor of one adapter: B·A (or, for token_embd.weight, A's rows through B)
// times `scale` is added to what the base tensor computes.
struct LoraTensor {
  std::string name;  // the base tensor: "blk.3.attn_q.weight", "output.weight", "token_embd.weight"
  const gguf::TensorInfo* a = nullptr;  // in the adapter's file (mapped while the LoraAdapters live)
  const gguf::TensorInfo* b = nullptr;
  float scale = 1.f;  // the user's scale × alpha / rank
};

// The bytes of a pair (A and B as mapped).
uint64_t lora_pair_bytes(const LoraTensor& t);
// The rank as the CPU forward multiplies it: rounded up to 32 (the float tiles' block), the extra
// rows of A and columns of B zero.
int64_t lora_padded_rank(int64_t rank);
// The bytes a CPU stage holds for a pair: A and B as F16 copies of the padded rank in the packed
// layout's size (the embedding's A stays as mapped: its bytes as in the file).
uint64_t lora_cpu_bytes(const LoraTensor& t);
// The bytes a GPU stage holds for a pair: A and B as F16 rows of the padded rank in the device
// layout (kernels/cuda/layout.h; the embedding's A too, [n_vocab rows, padded rank], in the type
// lora_embd_gpu_type gives: the rows a CPU stage reads as mapped, and the GPU's the same values).
uint64_t lora_gpu_bytes(const LoraTensor& t);
inline GgmlType lora_embd_gpu_type(GgmlType file_type) { return file_type == GgmlType::F16 ? GgmlType::F16 : GgmlType::F32; }
// A GPU stage runs a pair's products on at most this many columns at once, A·x and B·(A·x) of
// each column in one buffer of these floats (a step's columns in chunks: an adapted head's rows
// are n_vocab wide). The planner charges the buffer to every GPU stage of a run with adapters.
constexpr uint64_t kLoraChunkFloats = uint64_t(1) << 20;

class LoraAdapters {
 public:
  // Maps each file and checks it against the base model: general.type "adapter", adapter.type
  // "lora", the base's architecture, every tensor a .lora_a/.lora_b pair of a base tensor that
  // Baton adapts (attention and dense FFN matrices, the output head, the token embedding) with
  // matching shapes and a type the CPU matmul reads. Norm adapters (*_norm.weight) are skipped, as
  // llama.cpp does (warnings() says so). Error(Model) names the file and the tensor.
  LoraAdapters(const std::vector<LoraFile>& files, const gguf::File& base, const ModelConfig& cfg);
  ~LoraAdapters();

  const std::vector<LoraTensor>& tensors() const { return tensors_; }
  const std::vector<std::string>& warnings() const { return warnings_; }
  // The adapters' bytes added to the shape the planner places (the larger of lora_cpu_bytes and
  // lora_gpu_bytes, as every weight's): each block's pairs to its layer, the embedding's and the
  // head's to theirs; and a GPU stage's buffer of their products (ModelShape::lora_gpu_buffer).
  void add_to(ModelShape& shape) const;

 private:
  std::vector<std::unique_ptr<gguf::File>> files_;
  std::vector<LoraTensor> tensors_;
  std::vector<std::string> warnings_;
};

// A random adapter for a base model (tests, benchmarks: `baton synth --lora-of`): for each named
// base tensor, A with values of about 1/sqrt(n_in) and B of about `amplitude`/sqrt(rank), so that
// B·A·x is about `amplitude` times as large as W·x for the synth's weights. Deterministic per seed.
struct LoraSynthOptions {
  std::vector<std::string> targets;  // base tensor names ("blk.0.attn_q.weight", "output.weight", ...)
  int rank = 8;
  float alpha = 0.f;                 // adapter.lora.alpha (0: none written)
  GgmlType type = GgmlType::F32;     // of A and B (rows must fit its blocks)
  float amplitude = 0.5f;
  uint64_t seed = 0;
};
// Error(Usage) for a target the base lacks or a type whose blocks do not fit the rows.
gguf::Writer lora_synth_writer(const gguf::File& base, const LoraSynthOptions& opt);

}  // namespace baton
