// The engine's view of a real tokenizer: end-of-generation ids and a streaming detokenizer per
// request (control tokens hidden — harmony's markers excepted, for the engine's channel parser —
// no half characters, SentencePiece's leading space dropped).
#include <algorithm>
#include <mutex>

#include "runtime/engine.h"
#include "runtime/harmony.h"
#include "runtime/tokenizer.h"

namespace baton {
namespace {

class DetokStream final : public TokenStream {
 public:
  DetokStream(const Tokenizer& t)
      : t_(t), d_(t, /*show_special=*/false, /*strip_leading_space=*/t.kind() == VocabKind::Spm) {
    if (t.harmony())
      for (std::string_view m : kHarmonyMarkers)
        if (auto id = t.find_token(m)) markers_.push_back(*id);
  }
  std::string push(int32_t id) override {
    // A harmony marker is written out for the engine's channel parser (after any bytes held back).
    if (std::find(markers_.begin(), markers_.end(), id) != markers_.end()) return d_.flush().append(t_.token_text(id));
    return d_.push(id);
  }
  std::string flush() override { return d_.flush(); }

 private:
  const Tokenizer& t_;
  Detokenizer d_;
  std::vector<int32_t> markers_;  // harmony vocabularies: the marker tokens' ids
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
  bool harmony() const override { return t_.harmony(); }

 private:
  const Tokenizer& t_;
  mutable std::once_flag pieces_once_;
  mutable std::vector<std::string> pieces_;
};

}  // namespace

std::unique_ptr<Vocab> tokenizer_vocab(const Tokenizer& tok) { return std::make_unique<TokenizerVocab>(tok); }

}  // namespace baton
