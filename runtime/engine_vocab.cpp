// The engine's view of a real tokenizer: end-of-generation ids and a streaming detokenizer per
// request (control tokens hidden, no half characters, SentencePiece's leading space dropped).
#include <mutex>

#include "runtime/engine.h"
#include "runtime/tokenizer.h"

namespace baton {
namespace {

class DetokStream final : public TokenStream {
 public:
  DetokStream(const Tokenizer& t) : d_(t, /*show_special=*/false, /*strip_leading_space=*/t.kind() == VocabKind::Spm) {}
  std::string push(int32_t id) override { return d_.push(id); }
  std::string flush() override { return d_.flush(); }

 private:
  Detokenizer d_;
};

class TokenizerVocab final : public Vocab {
 public:
  explicit TokenizerVocab(const Tokenizer& t) : t_(t) {}
  bool is_eog(int32_t id) const override { return t_.is_eog(id); }
  std::unique_ptr<TokenStream> stream() const override { return std::make_unique<DetokStream>(t_); }
  std::string_view piece(int32_t id) const override {
    std::call_once(pieces_once_, [this] {  // only requests with a grammar need the table
      pieces_.resize(size_t(t_.n_vocab()));
      for (int32_t i = 0; i < t_.n_vocab(); i++) pieces_[size_t(i)] = t_.decode_piece(i);
    });
    return pieces_.at(size_t(id));
  }
  bool strips_first_space() const override { return t_.kind() == VocabKind::Spm; }

 private:
  const Tokenizer& t_;
  mutable std::once_flag pieces_once_;
  mutable std::vector<std::string> pieces_;
};

}  // namespace

std::unique_ptr<Vocab> tokenizer_vocab(const Tokenizer& tok) { return std::make_unique<TokenizerVocab>(tok); }

}  // namespace baton
