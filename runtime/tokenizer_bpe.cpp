// Byte-level BPE (GPT-2 style): every byte of a pre-tokenized word is written as one printable
// code point, then the word's symbols are merged pairwise, lowest merge rank first.
#include <algorithm>
#include <optional>

#include "runtime/byte_level.h"
#include "runtime/symbol_merge.h"
#include "runtime/tokenizer.h"
#include "runtime/unicode.h"

namespace baton {
namespace {

// GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes are
// moved to U+0100.. in byte order so that no byte maps to whitespace or a control character.
struct ByteMap {
  uint32_t to_cp[256];
  int16_t to_byte[512];  // code point -> byte, -1 if the code point is not in the alphabet
  ByteMap() {
    for (auto& b : to_byte) b = -1;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_cp[b] = printable ? b : next++;
      to_byte[to_cp[b]] = int16_t(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

}  // namespace

std::string byte_level_encode(std::string_view bytes) {
  const ByteMap& m = byte_map();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) unicode::append_utf8(out, m.to_cp[uint8_t(c)]);
  return out;
}

std::string byte_level_decode(std::string_view text) {
  const ByteMap& m = byte_map();
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    size_t start = pos;
    uint32_t cp = unicode::decode_one(text, pos);
    if (cp < 512 && m.to_byte[cp] >= 0)
      out += char(m.to_byte[cp]);
    else  // not from the byte alphabet (a hand-added token): keep it as it is
      out.append(text.substr(start, pos - start));
  }
  return out;
}

void Tokenizer::encode_bpe(std::string_view text, std::vector<int32_t>& out) const {
  // Bytes that are not UTF-8 become U+FFFD first (llama.cpp's reading): a vocabulary learned
  // from text may lack the byte tokens of 0xF8..0xFF, and the fallback below would drop them or
  // put <unk> (often the end-of-text token) into a prompt.
  std::string valid;
  text = unicode::with_invalid_replaced(text, valid);
  std::vector<SymbolSpan> sym;
  std::string key;
  for (std::string_view piece : pretokenize(pre_, text)) {
    const std::string word = byte_level_encode(piece);
    if (ignore_merges_) {
      if (auto id = text_.find(word)) {
        out.push_back(*id);
        continue;
      }
    }
    sym.clear();
    for (size_t pos = 0; pos < word.size();) {
      size_t n = std::min(unicode::utf8_len(uint8_t(word[pos])), word.size() - pos);
      sym.push_back({pos, n});
      pos += n;
    }

    // Merge rules are "left right"; the lowest rank merges first.
    merge_symbols(sym, [&](const SymbolSpan& l, const SymbolSpan& r) -> std::optional<double> {
      key.assign(word, l.off, l.len);
      key += ' ';
      key.append(word, r.off, r.len);
      const auto rank = merges_.find(key);
      if (!rank) return std::nullopt;
      return -double(*rank);
    });
    for (const SymbolSpan& sp : sym) {
      const std::string_view s = std::string_view(word).substr(sp.off, sp.len);
      if (auto id = text_.find(s)) {
        out.push_back(*id);
        continue;
      }
      // Not in the vocabulary (a damaged vocab): fall back to single characters, then <unk>.
      for (size_t pos = 0; pos < s.size();) {
        size_t n = std::min(unicode::utf8_len(uint8_t(s[pos])), s.size() - pos);
        if (auto id = text_.find(s.substr(pos, n)))
          out.push_back(*id);
        else if (unk_ >= 0)
          out.push_back(unk_);
        pos += n;
      }
    }
  }
}

}  // namespace baton
