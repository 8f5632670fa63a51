// `baton quantize`: a GGUF model rewritten with its weights in a quantized type, as llama-quantize
// does without an importance matrix. A file type names a recipe ("Q4_K_M": Q4_K weights, Q6_K for
// the output head and some attn_v/ffn_down layers), and the plan — which type each tensor gets —
// is a pure function of the file's tensors and a few hyperparameters, shown before anything is
// written. Each row goes through quant/'s reference quantizers, which follow ggml's rounding and
// search, so a tensor comes out with the bytes llama-quantize writes for the same type.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "quant/types.h"

namespace baton {

// A file type `baton quantize` writes: its general.file_type value, the type most weights get, and
// whether llama-quantize's mix rules apply (every quantized type but the plain ones).
struct QuantFileType {
  const char* name;   // "Q4_K_M"
  uint32_t ftype;     // general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_*)
  GgmlType base;      // what a weight gets unless a rule says otherwise
  const char* about;  // for --help and the docs
};
const std::vector<QuantFileType>& quant_file_types();
// By name, any case ("q4_k_m"); nullptr when there is none.
const QuantFileType* find_quant_file_type(const std::string& name);

struct QuantizeOptions {
  std::string type;                       // a quant_file_types() name
  bool pure = false;                      // every quantized weight in the base type (no mix rules)
  bool allow_requantize = false;          // quantized input tensors may be quantized again (lossy twice)
  bool leave_output = false;              // output.weight as it is (--leave-output-tensor)
  std::optional<GgmlType> output_type;    // --output-tensor-type
  std::optional<GgmlType> embedding_type; // --token-embedding-type
};

// What happens to one tensor.
struct TensorPlan {
  const gguf::TensorInfo* tensor = nullptr;  // in the input file
  GgmlType to = GgmlType::F32;               // == tensor->type: copied as it is
  bool fallback = false;  // the recipe's type did not fit the rows: weight_type_for_row's stand-in
  uint64_t bytes = 0;     // in the output
};

// The type of every tensor of `in` under `o`, in the file's order: weights are the tensors whose
// name ends in "weight" with at least 2 dimensions, but norms, routers (ffn_gate_inp) and position
// or token-type embeddings; they get the recipe's type, adjusted as llama-quantize adjusts it
// (by tensor name, layer and the model's attention-head grouping). Error(Usage) for an unknown
// type, a quantized input tensor without allow_requantize, a type Baton cannot write.
std::vector<TensorPlan> plan_quantization(const gguf::File& in, const QuantizeOptions& o);

// Writes `out` (through a temporary file, renamed at the end): the input's metadata with
// general.file_type and general.quantization_version set, and each tensor as planned, its rows
// quantized on `threads` threads. `progress(done, total)` counts tensors.
void quantize_model(const gguf::File& in, const std::vector<TensorPlan>& plan, const QuantizeOptions& o,
                    const std::string& out, int threads,
                    const std::function<void(size_t done, size_t total)>& progress = {});

}  // namespace baton
