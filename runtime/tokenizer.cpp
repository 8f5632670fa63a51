#include "runtime/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <optional>
#include <utility>

#include "gguf/gguf.h"
#include "runtime/byte_level.h"
#include "runtime/symbol_merge.h"
#include "runtime/unicode.h"

namespace baton {
namespace {

const std::string kSpace = "\xE2\x96\x81";  // U+2581 '▁', SentencePiece's space

std::string escape_spaces(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (char c : s) {
    if (c == ' ')
      out += kSpace;
    else
      out += c;
  }
  return out;
}

std::string unescape_spaces(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (s.compare(i, kSpace.size(), kSpace) == 0) {
      out += ' ';
      i += kSpace.size();
    } else {
      out += s[i++];
    }
  }
  return out;
}

// "<0x41>" -> 0x41; -1 if the text is not a byte token.
int parse_byte_token(std::string_view t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

int32_t optional_id(const gguf::File& f, const char* key, int32_t n_vocab) {
  if (!f.has(key)) return -1;
  int64_t v = f.get<int64_t>(key);
  if (v == -1) return -1;  // some converters write -1 for "none"
  if (v < 0 || v >= n_vocab)
    fail(ErrorKind::Model, "{}: {} = {} is outside the vocabulary (0..{})", f.path(), key, v, n_vocab - 1);
  return int32_t(v);
}

}  // namespace

Tokenizer Tokenizer::from_gguf(const gguf::File& f) {
  Tokenizer t;
  const std::string model = f.get<std::string>("tokenizer.ggml.model");
  if (model == "llama") {
    t.kind_ = VocabKind::Spm;
  } else if (model == "gpt2") {
    t.kind_ = VocabKind::Bpe;
  } else {
    fail(ErrorKind::Model, "{}: tokenizer.ggml.model '{}' is not supported (supported: llama, gpt2)", f.path(), model);
  }
  t.text_ = StringTable(f.get_strings("tokenizer.ggml.tokens"));
  const auto n = int32_t(t.text_.size());
  if (n == 0) fail(ErrorKind::Model, "{}: tokenizer.ggml.tokens is empty", f.path());

  if (f.has("tokenizer.ggml.scores")) {
    t.score_ = f.get_floats("tokenizer.ggml.scores");
    if (int32_t(t.score_.size()) != n)
      fail(ErrorKind::Model, "{}: tokenizer.ggml.scores has {} entries, tokenizer.ggml.tokens has {}", f.path(),
           t.score_.size(), n);
  } else if (t.kind_ == VocabKind::Spm) {
    fail(ErrorKind::Model, "{}: a SentencePiece (llama) vocabulary needs tokenizer.ggml.scores", f.path());
  }
  t.type_.assign(size_t(n), TokenType::Normal);
  if (f.has("tokenizer.ggml.token_type")) {
    auto types = f.get_ints("tokenizer.ggml.token_type");
    if (int32_t(types.size()) != n)
      fail(ErrorKind::Model, "{}: tokenizer.ggml.token_type has {} entries, tokenizer.ggml.tokens has {}", f.path(),
           types.size(), n);
    for (int32_t i = 0; i < n; ++i) {
      if (types[size_t(i)] < 0 || types[size_t(i)] > 6)
        fail(ErrorKind::Model, "{}: tokenizer.ggml.token_type[{}] = {} is not a token type", f.path(), i,
             types[size_t(i)]);
      t.type_[size_t(i)] = TokenType(types[size_t(i)]);
    }
  }
  if (t.kind_ == VocabKind::Bpe) {
    const auto& merges = f.get_strings("tokenizer.ggml.merges");  // (a reference: no copy of the list)
    for (size_t i = 0; i < merges.size(); ++i) {
      // A merge is "left right"; search from 1 so that a left part that is itself a space survives.
      if (merges[i].find(' ', 1) == std::string::npos)
        fail(ErrorKind::Model, "{}: tokenizer.ggml.merges[{}] = '{}' is not two symbols", f.path(), i, merges[i]);
    }
    t.merges_ = StringTable(merges);  // a repeated merge ranks at its first place
    t.pre_ = pretokenizer_from_name(f.get_or<std::string>("tokenizer.ggml.pre", "default"));
    t.ignore_merges_ = t.pre_ == PreTokenizer::Llama3;
  }

  t.bos_ = optional_id(f, "tokenizer.ggml.bos_token_id", n);
  t.eos_ = optional_id(f, "tokenizer.ggml.eos_token_id", n);
  t.eot_ = optional_id(f, "tokenizer.ggml.eot_token_id", n);
  t.eom_ = optional_id(f, "tokenizer.ggml.eom_token_id", n);
  t.unk_ = optional_id(f, "tokenizer.ggml.unknown_token_id", n);
  t.pad_ = optional_id(f, "tokenizer.ggml.padding_token_id", n);
  const bool spm = t.kind_ == VocabKind::Spm;
  t.add_bos_ = f.get_or<bool>("tokenizer.ggml.add_bos_token", spm || t.pre_ == PreTokenizer::Llama3);
  t.add_eos_ = f.get_or<bool>("tokenizer.ggml.add_eos_token", false);
  t.add_space_prefix_ = f.get_or<bool>("tokenizer.ggml.add_space_prefix", spm);
  if (t.add_bos_ && t.bos_ < 0)
    fail(ErrorKind::Model, "{}: add_bos_token is set but tokenizer.ggml.bos_token_id is missing", f.path());
  if (t.add_eos_ && t.eos_ < 0)
    fail(ErrorKind::Model, "{}: add_eos_token is set but tokenizer.ggml.eos_token_id is missing", f.path());
  t.finish_setup();
  // Phi-3: every special but <unk>, <s> and <|endoftext|> (and </s> too) strips the whitespace
  // that follows it, as the tokenizer.json of Phi-3 marks its added tokens rstrip.
  std::string name = f.get_or<std::string>("general.name", "");
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
  if (name.find("phi-3") != std::string::npos || name.find("phi3") != std::string::npos) {
    t.rstrip_.assign(size_t(n), false);
    for (int32_t id : t.specials_) t.rstrip_[size_t(id)] = true;
    for (const char* s : {"</s>"})
      if (auto id = t.find_token(s)) t.rstrip_[size_t(*id)] = true;
    for (const char* s : {"<unk>", "<s>", "<|endoftext|>"})
      if (auto id = t.find_token(s)) t.rstrip_[size_t(*id)] = false;
  }
  return t;
}

void Tokenizer::finish_setup() {
  const auto n = int32_t(text_.size());
  std::fill(std::begin(byte_id_), std::end(byte_id_), -1);
  for (int32_t i = 0; i < n; ++i) {
    if (type_[size_t(i)] == TokenType::Byte) {
      int b = parse_byte_token(text_[size_t(i)]);
      if (b >= 0 && byte_id_[b] < 0) byte_id_[b] = i;
    }
    TokenType ty = type_[size_t(i)];
    if ((ty == TokenType::Control || ty == TokenType::UserDefined || ty == TokenType::Unknown) &&
        !text_[size_t(i)].empty())
      specials_.push_back(i);
  }
  // Longest text first, so that "<|im_start|>" is found before a shorter token inside it.
  std::stable_sort(specials_.begin(), specials_.end(),
                   [&](int32_t a, int32_t b) { return text_[size_t(a)].size() > text_[size_t(b)].size(); });

  // End of generation: the ids the metadata names, plus end-of-turn control tokens by their text.
  for (int32_t id : {eos_, eot_, eom_})
    if (id >= 0) eog_.push_back(id);
  static const char* const kEndTexts[] = {"<|eot_id|>",    "<|im_end|>", "<|end|>",   "<end_of_turn>", "<|endoftext|>",
                                          "<|eom_id|>",    "<EOT>",      "<|end_of_text|>", "<｜end▁of▁sentence｜>"};
  for (const char* s : kEndTexts) {
    const auto id = text_.find(s);
    if (id && type_[size_t(*id)] == TokenType::Control) eog_.push_back(*id);
  }
  // OpenAI's harmony vocabulary (o200k_harmony, gpt-oss): a reply ends at <|return|> (answered) or
  // <|call|> (a tool call), while <|end|> only closes one message of the reply — the reasoning
  // before the answer — so it must not end generation, whatever the metadata names.
  const auto ret = find_token("<|return|>"), call = find_token("<|call|>");
  if (ret && call) {
    eog_.insert(eog_.end(), {*ret, *call});
    if (auto end = find_token("<|end|>")) eog_.erase(std::remove(eog_.begin(), eog_.end(), *end), eog_.end());
  }
  harmony_ = ret && call && find_token("<|start|>") && find_token("<|channel|>") && find_token("<|message|>");
  std::sort(eog_.begin(), eog_.end());
  eog_.erase(std::unique(eog_.begin(), eog_.end()), eog_.end());
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const { return text_.find(text); }

size_t Tokenizer::checked(int32_t id) const {
  if (id < 0 || id >= n_vocab()) fail(ErrorKind::Usage, "token id {} is outside the vocabulary (0..{})", id, n_vocab() - 1);
  return size_t(id);
}

bool Tokenizer::is_eog(int32_t id) const { return std::binary_search(eog_.begin(), eog_.end(), id); }

bool Tokenizer::is_control(int32_t id) const {
  return id >= 0 && id < n_vocab() && type_[size_t(id)] == TokenType::Control;
}

int32_t Tokenizer::byte_token(uint8_t b) const {
  if (byte_id_[b] >= 0) return byte_id_[b];
  // Vocabularies without <0xNN> tokens may still hold the byte as a one-character token.
  if (b < 0x80) {
    const char c = char(b);
    if (auto id = find_token(std::string_view(&c, 1))) return *id;
  }
  return unk_;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  // Cut special-token text out first. A fragment is either raw text or one special token.
  struct Frag {
    int32_t id;  // -1 for raw text
    size_t begin, end;
  };
  std::vector<Frag> frags;
  if (!text.empty()) frags.push_back({-1, 0, text.size()});
  for (int32_t sid : specials_) {
    const TokenType ty = type_[size_t(sid)];
    if (!parse_special && ty != TokenType::UserDefined) continue;
    const std::string_view s = text_[size_t(sid)];
    if (text.find(s) == std::string_view::npos) continue;
    std::vector<Frag> next;
    next.reserve(frags.size() + 2);
    for (const Frag& fr : frags) {
      if (fr.id >= 0) {
        next.push_back(fr);
        continue;
      }
      size_t pos = fr.begin;
      while (pos < fr.end) {
        size_t hit = text.substr(0, fr.end).find(s, pos);
        if (hit == std::string_view::npos) break;
        if (hit > pos) next.push_back({-1, pos, hit});
        next.push_back({sid, hit, hit + s.size()});
        pos = hit + s.size();
      }
      if (pos < fr.end) next.push_back({-1, pos, fr.end});
    }
    frags.swap(next);
  }

  std::vector<int32_t> out;
  if (add_special && add_bos_) out.push_back(bos_);
  bool prev_special = true;  // SentencePiece puts a space before the first word and after specials
  bool strip = false;        // the special before swallows the whitespace after it
  for (const Frag& fr : frags) {
    if (fr.id >= 0) {
      out.push_back(fr.id);
      prev_special = true;
      strip = !rstrip_.empty() && rstrip_[size_t(fr.id)];
      continue;
    }
    std::string_view raw = text.substr(fr.begin, fr.end - fr.begin);
    if (std::exchange(strip, false)) {
      while (!raw.empty() && std::isspace(static_cast<unsigned char>(raw.front()))) raw.remove_prefix(1);
      if (raw.empty()) continue;
    }
    if (kind_ == VocabKind::Spm) {
      std::string s = add_space_prefix_ && prev_special ? " " : "";
      s += raw;
      encode_spm(escape_spaces(s), out);
    } else {
      encode_bpe(raw, out);
    }
    prev_special = false;
  }
  if (add_special && add_eos_) out.push_back(eos_);
  return out;
}

// SentencePiece BPE: start from single characters and repeatedly merge the adjacent pair whose
// concatenation is the vocabulary entry with the highest score (leftmost on ties). Characters that
// end up outside the vocabulary are spelled as <0xNN> byte tokens.
void Tokenizer::encode_spm(std::string_view s, std::vector<int32_t>& out) const {
  if (s.empty()) return;
  std::vector<SymbolSpan> sym;
  for (size_t pos = 0; pos < s.size();) {
    // One symbol per character; a malformed sequence is split into single bytes (which then
    // take the byte fallback) so that it cannot swallow the start of the next character.
    const size_t start = pos;
    unicode::decode_one(s, pos);
    sym.push_back({start, pos - start});
  }

  merge_symbols(sym, [&](const SymbolSpan& l, const SymbolSpan& r) -> std::optional<double> {
    const auto id = text_.find(s.substr(l.off, l.len + r.len));
    if (!id) return std::nullopt;
    return double(score_[size_t(*id)]);
  });
  for (const SymbolSpan& piece : sym) {
    const std::string_view key = s.substr(piece.off, piece.len);
    if (auto id = text_.find(key)) {
      out.push_back(*id);
      continue;
    }
    for (char c : key) {
      int32_t id = byte_token(uint8_t(c));
      if (id >= 0) out.push_back(id);
    }
  }
}

std::string Tokenizer::decode_piece(int32_t id, bool show_special) const {
  const std::string_view t = text_[checked(id)];
  switch (type_[size_t(id)]) {
    case TokenType::Control:
    case TokenType::Unused:
      return show_special ? std::string(t) : std::string();
    case TokenType::Unknown:
      return show_special ? std::string(t) : std::string("\xEF\xBF\xBD");  // U+FFFD
    case TokenType::Byte: {
      int b = parse_byte_token(t);
      if (b >= 0) return std::string(1, char(b));
      return std::string(t);
    }
    case TokenType::UserDefined:
      // Converters store user-defined tokens as plain text already.
      return kind_ == VocabKind::Spm ? unescape_spaces(t) : std::string(t);
    case TokenType::Normal:
    case TokenType::Undefined:
      break;
  }
  return kind_ == VocabKind::Spm ? unescape_spaces(t) : byte_level_decode(t);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool show_special) const {
  Detokenizer d(*this, show_special, kind_ == VocabKind::Spm && add_space_prefix_);
  std::string out;
  for (int32_t id : ids) out += d.push(id);
  out += d.flush();
  return out;
}

std::string Detokenizer::push(int32_t id) {
  std::string piece = tok_->decode_piece(id, show_special_);
  if (piece.empty()) return {};
  if (!started_) {
    started_ = true;
    if (strip_ && piece[0] == ' ') piece.erase(0, 1);
  }
  pending_ += piece;
  size_t keep = unicode::incomplete_utf8_tail(pending_);
  std::string ready = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  return ready;
}

std::string Detokenizer::flush() {
  std::string rest;
  rest.swap(pending_);
  return rest;
}

}  // namespace baton
