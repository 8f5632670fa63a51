// Just enough Unicode for tokenizers: UTF-8 decoding/encoding that never throws on bad bytes, the
// general category class of a code point and a letter's case (from a generated range table), and
// White_Space.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace baton::unicode {

// General category, first letter only (\p{L}, \p{N}, ...). None = unassigned.
enum class Cat : uint8_t { None = 0, Letter = 1, Number = 2, Punct = 3, Symbol = 4, Mark = 5, Separator = 6, Control = 7 };

Cat category(uint32_t cp);
// A letter's case: Upper (Lu, Lt), Lower (Ll), Other (Lm, Lo: no case); None for non-letters.
enum class LetterCase : uint8_t { None, Upper, Lower, Other };
LetterCase letter_case(uint32_t cp);
inline bool is_letter(uint32_t cp) { return category(cp) == Cat::Letter; }
inline bool is_number(uint32_t cp) { return category(cp) == Cat::Number; }
inline bool is_punct(uint32_t cp) { return category(cp) == Cat::Punct; }
// The Unicode White_Space property (what \s means in the tokenizers' regexes).
bool is_whitespace(uint32_t cp);

// Length of the UTF-8 sequence that starts with byte `b` (1 for a stray continuation byte).
inline size_t utf8_len(uint8_t b) {
  if (b < 0x80) return 1;
  if ((b & 0xE0) == 0xC0) return 2;
  if ((b & 0xF0) == 0xE0) return 3;
  if ((b & 0xF8) == 0xF0) return 4;
  return 1;
}

// Decode one code point at s[pos]; advances pos. Invalid or truncated sequences decode to the
// single byte's value (as Latin-1) and advance by one, so every input byte is accounted for.
uint32_t decode_one(std::string_view s, size_t& pos);
std::vector<uint32_t> decode(std::string_view s);

// The text with each byte that does not start a complete UTF-8 sequence (a stray continuation
// byte, 0xF8..0xFF, a sequence cut short or broken) replaced by U+FFFD, one per byte, as
// llama.cpp reads text for its BPE tokenizers. `s` itself when it is valid (nothing copied).
std::string_view with_invalid_replaced(std::string_view s, std::string& storage);
void append_utf8(std::string& out, uint32_t cp);
std::string encode(const std::vector<uint32_t>& cps);

// Number of bytes at the end of `s` that are the start of a valid but unfinished UTF-8 sequence
// (0..3). A streaming printer holds these back until the rest arrives.
size_t incomplete_utf8_tail(std::string_view s);

}  // namespace baton::unicode
