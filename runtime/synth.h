// Synthetic models of real shapes: a deterministic random-weight GGUF for a preset (or custom)
// shape, loadable by our reader and forward, so big-model behaviour (placement, memory, speed) can
// be tested where real model files are not at hand. Tensors are streamed to disk one at a time.
#pragma once
#include <cstdint>
#include <string>

#include "gguf/gguf.h"
#include "quant/types.h"
#include "runtime/shape.h"

namespace baton {

struct SynthOptions {
  GgmlType type = GgmlType::Q8_0;  // 2-D weights (rows that do not fit its block use the substitute
                                   // of weight_type_for_row); norms and biases are F32
  uint64_t seed = 0;
  // A GGUF whose tokenizer.* metadata to copy (its token count must equal n_vocab). Empty: a
  // synthetic SentencePiece-style vocabulary (specials, 256 byte tokens, then letter pieces).
  std::string vocab_from;
  // Embedding models: `{arch}.pooling_type` to write (llama.cpp's enum: 0 none, 1 mean, 2 cls,
  // 3 last; -1 writes no key). With 3 (last), tokenizer.ggml.add_eos_token is set too, as in
  // Qwen3-Embedding's files: the last token, whose state is the embedding, is EOS.
  int pooling = -1;
};

// The file's metadata and lazy tensors; nothing is generated until written. Weights are
// uniform-sum approximations of normal(0, 1/sqrt(fan_in)) (fan_in = row length), norms are 1,
// biases normal(0, 0.02): activations stay O(1) through any depth. Each row has its own random
// stream (seed, tensor name, row), so the bytes do not depend on thread count or order.
// Throws Error(Usage) for shapes that cannot be a model (zero dims, heads that do not divide, ...).
gguf::Writer synth_writer(const ShapePreset& shape, const SynthOptions& opt);
void synth_write(const ShapePreset& shape, const SynthOptions& opt, const std::string& path);

// Checks a custom or preset shape: Error(Usage) naming the field.
void check_shape(const ShapePreset& shape);

}  // namespace baton
