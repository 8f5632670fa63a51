// Pre-tokenizers for byte-level BPE vocabularies: the text is cut into words before merging, the
// way the regular expression named by `tokenizer.ggml.pre` would cut it. Each regex is written out
// by hand as a splitter over code points (no regex engine), which is faster and does not depend on
// a regex library's Unicode support.
#pragma once
#include <string_view>
#include <vector>

namespace baton {

enum class PreTokenizer {
  Default,    // llama.cpp's fallback for `default`: punctuation runs, GPT-2 words, digit runs, then 3-digit groups
  Gpt2,       // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  Falcon,     // punctuation/symbol runs, then GPT-2 words, then [0-9]{3} groups
  Starcoder,  // every \p{N} alone, then GPT-2 words (also SmolLM, Refact, Command-R)
  Llama3,     // the Llama 3 regex: case-insensitive contractions, \p{N}{1,3}, newline-aware whitespace
  Qwen2,      // the Llama 3 regex with single digits
  Gpt4o,      // GPT-4o's (o200k): words split by case (CamelCase parts), contractions after words, \p{N}{1,3}
};

// Maps a `tokenizer.ggml.pre` value to its splitter; unknown names are an Error(Model).
PreTokenizer pretokenizer_from_name(std::string_view name);
const char* pretokenizer_name(PreTokenizer p);

// Cuts `text` into consecutive, non-empty pieces that together are exactly `text`. Works on any
// bytes: malformed UTF-8 is carried through byte by byte.
std::vector<std::string_view> pretokenize(PreTokenizer p, std::string_view text);

}  // namespace baton
