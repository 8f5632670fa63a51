// Tokenizers built from GGUF metadata: SentencePiece-style (`tokenizer.ggml.model = llama`: score-
// driven merges over characters, `▁` for spaces, `<0xNN>` byte fallback) and byte-level BPE (`gpt2`:
// ranked merges over the GPT-2 byte alphabet after a pre-tokenizer split). Special tokens (control,
// user-defined) are cut out of the text before either algorithm runs; control tokens only when the
// caller asks (`parse_special`), user-defined ones always.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/pretokenizer.h"
#include "runtime/string_table.h"

namespace baton {
namespace gguf { class File; }

// `tokenizer.ggml.token_type` values.
enum class TokenType : uint8_t { Undefined = 0, Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };

enum class VocabKind { Spm, Bpe };

class Tokenizer {
 public:
  // Throws Error(Model) naming the key when the tokenizer metadata is missing or inconsistent.
  static Tokenizer from_gguf(const gguf::File& f);

  // Text -> ids. add_special: BOS/EOS as the model's add_bos_token/add_eos_token say.
  // parse_special: control-token text in `text` (e.g. "<|im_start|>") becomes that token.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;

  // The bytes one token stands for (may be part of a UTF-8 character). Control and unused tokens
  // are empty unless show_special. Throws Error(Usage) for an id outside the vocabulary.
  std::string decode_piece(int32_t id, bool show_special = false) const;
  // Whole sequence -> text. Drops the space SentencePiece put in front of the first word.
  std::string decode(const std::vector<int32_t>& ids, bool show_special = false) const;

  int32_t n_vocab() const { return int32_t(text_.size()); }
  // Throws Error(Usage) for an id outside the vocabulary.
  std::string_view token_text(int32_t id) const { return text_[checked(id)]; }
  TokenType token_type(int32_t id) const { return type_.at(size_t(id)); }
  float token_score(int32_t id) const { return score_.empty() ? 0.0f : score_.at(size_t(id)); }
  std::optional<int32_t> find_token(std::string_view text) const;

  VocabKind kind() const { return kind_; }
  PreTokenizer pre() const { return pre_; }
  int32_t bos() const { return bos_; }  // -1 when the model has none
  int32_t eos() const { return eos_; }
  int32_t eot() const { return eot_; }
  int32_t unk() const { return unk_; }
  int32_t pad() const { return pad_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  bool add_space_prefix() const { return add_space_prefix_; }
  // End of generation: EOS, EOT/EOM, and end-of-turn control tokens (<|im_end|>, <end_of_turn>, ...).
  bool is_eog(int32_t id) const;
  const std::vector<int32_t>& eog_ids() const { return eog_; }
  // OpenAI's harmony format (gpt-oss): the vocabulary has <|start|>, <|channel|>, <|message|>,
  // <|return|> and <|call|>. Replies then carry their reasoning and answer in channels
  // (runtime/harmony.h), and end at <|return|> or <|call|>, not at <|end|>.
  bool harmony() const { return harmony_; }
  // Control tokens are hidden when detokenizing.
  bool is_control(int32_t id) const;

 private:
  Tokenizer() = default;
  void finish_setup();
  void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
  int32_t byte_token(uint8_t b) const;
  size_t checked(int32_t id) const;  // id as an index; Error(Usage) outside the vocabulary

  VocabKind kind_ = VocabKind::Spm;
  PreTokenizer pre_ = PreTokenizer::Default;
  StringTable text_;    // the tokens' texts, found by text (the lowest id of a repeated one)
  std::vector<float> score_;
  std::vector<TokenType> type_;
  StringTable merges_;  // BPE: "left right", the position is the rank
  std::vector<int32_t> specials_;  // control/user-defined/unknown, longest text first
  // Specials that swallow the whitespace after them when parsed from text (Phi-3's added tokens
  // are rstrip; GGUF files do not store it, so the model's name decides, as llama.cpp does).
  std::vector<bool> rstrip_;
  std::vector<int32_t> eog_;
  int32_t byte_id_[256];                                 // SPM <0xNN> tokens (-1 if absent)
  int32_t bos_ = -1, eos_ = -1, eot_ = -1, eom_ = -1, unk_ = -1, pad_ = -1;
  bool add_bos_ = false, add_eos_ = false, add_space_prefix_ = false, ignore_merges_ = false;
  bool harmony_ = false;
};

// Streams ids to printable text: never returns half a UTF-8 character, hides control tokens.
class Detokenizer {
 public:
  // strip_leading_space: drop the SentencePiece space in front of the very first word.
  explicit Detokenizer(const Tokenizer& tok, bool show_special = false, bool strip_leading_space = false)
      : tok_(&tok), show_special_(show_special), strip_(strip_leading_space) {}
  // Text that is now complete; bytes of an unfinished character wait for the next call.
  std::string push(int32_t id);
  // Whatever is still held back (an unfinished character at the end of the stream).
  std::string flush();
  void reset() { pending_.clear(); started_ = false; }

 private:
  const Tokenizer* tok_;
  bool show_special_, strip_;
  bool started_ = false;
  std::string pending_;
};

}  // namespace baton
