// Text embeddings from decoder models (`baton embed`): each input's final hidden states after the
// output norm (kHidden rows of the pipeline: no output matmul), pooled per input as the file's
// `{arch}.pooling_type` says (llama.cpp's enum) or as asked, then normalized as llama-embedding's
// --embd-normalize. Inputs run through the pipeline's sequence slots, several at once, each from
// an empty cache.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

namespace baton {

class Pipeline;
namespace gguf { class File; }

// llama.cpp's llama_pooling_type values, as `{arch}.pooling_type` stores them.
enum class Pooling { None = 0, Mean = 1, Cls = 2, Last = 3, Rank = 4 };
const char* to_string(Pooling p);  // "none", "mean", "cls", "last", "rank"
// "none", "mean", "cls" or "last"; Error(Usage) otherwise ("rank" named as unsupported).
Pooling parse_pooling(std::string_view name);
// The file's `{arch}.pooling_type`, or nullopt when it has none (llama.cpp then pools nothing: one
// vector per token). Error(Model) for a value outside the enum.
std::optional<Pooling> file_pooling(const gguf::File& f);

// llama-embedding's --embd-normalize: -1 none, 0 scaled so the largest magnitude is 32760 (an
// int16 range), 1 taxicab, 2 Euclidean (L2), p > 2 the p-norm. An all-zero vector stays zero; one
// with NaN or infinity in it becomes all NaN (it has no size), except with -1.
// check_normalize: Error(Usage) for values below -1.
void check_normalize(int norm);
void normalize_embedding(float* v, int n, int norm);

struct EmbedOptions {
  Pooling pooling = Pooling::Last;  // Rank is refused
  int normalize = 2;
  int batch_tokens = 512;           // most tokens per forward (over all the inputs in it)
};

struct Embedding {
  size_t index = 0;                 // the input's position in the list
  int n_tokens = 0;
  // Pooled: n_embd values. Pooling::None: n_tokens rows of n_embd values (each normalized alone).
  std::vector<float> values;
};

// Embeds token sequences through the pipeline: up to n_seq() of them at once (each in its own
// slot, emptied first), in forwards of at most batch_tokens tokens; a long input takes several.
// `done` gets each result in input order, as soon as it and every input before it are finished.
// Every input must be non-empty and fit the context (Error(Usage) naming the first that does not,
// before anything runs). With the cancel flag set, stops between forwards (what is finished has
// been handed on).
void embed_sequences(Pipeline& p, const std::vector<std::vector<int32_t>>& inputs, const EmbedOptions& opt,
                     const std::function<void(Embedding&&)>& done, const std::atomic<bool>* cancel = nullptr);

}  // namespace baton
