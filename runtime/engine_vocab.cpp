// The engine's view of a real tokenizer: end-of-generation ids and a streaming detokenizer per
// request (control tokens hidden, no half characters, SentencePiece's leading space dropped).
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

 private:
  const Tokenizer& t_;
};

}  // namespace

std::unique_ptr<Vocab> tokenizer_vocab(const Tokenizer& tok) { return std::make_unique<TokenizerVocab>(tok); }

}  // namespace baton
