#include "runtime/unicode.h"

#include <algorithm>
#include <array>

namespace baton::unicode {
namespace {

struct Range {
  uint32_t first, last;
  uint8_t cls;
};

const Range kRanges[] = {
#include "runtime/unicode_tables.inc"
};

// The table's class of a code point (0: unassigned); letters are 1 (Lm, Lo), 8 (Lu, Lt), 9 (Ll).
uint8_t table_class(uint32_t cp) {
  const Range* end = kRanges + std::size(kRanges);
  const Range* it = std::upper_bound(kRanges, end, cp, [](uint32_t c, const Range& r) { return c < r.first; });
  if (it == kRanges) return 0;
  --it;
  return cp <= it->last ? it->cls : 0;
}
constexpr uint8_t kUpper = 8, kLower = 9;

// ASCII is by far the most common input: answer it from a small table.
const std::array<uint8_t, 128> kAscii = [] {
  std::array<uint8_t, 128> a{};
  for (uint32_t c = 0; c < 128; ++c) a[c] = table_class(c);
  return a;
}();

uint8_t class_of(uint32_t cp) { return cp < 128 ? kAscii[cp] : table_class(cp); }

}  // namespace

Cat category(uint32_t cp) {
  const uint8_t c = class_of(cp);
  return c == kUpper || c == kLower ? Cat::Letter : Cat(c);
}

LetterCase letter_case(uint32_t cp) {
  switch (class_of(cp)) {
    case kUpper: return LetterCase::Upper;
    case kLower: return LetterCase::Lower;
    case uint8_t(Cat::Letter): return LetterCase::Other;
    default: return LetterCase::None;
  }
}

bool is_whitespace(uint32_t cp) {
  if (cp < 128) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

uint32_t decode_one(std::string_view s, size_t& pos) {
  const auto b0 = uint8_t(s[pos]);
  size_t n = utf8_len(b0);
  if (n == 1 || pos + n > s.size()) {
    ++pos;
    return b0;
  }
  uint32_t cp = n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (size_t i = 1; i < n; ++i) {
    const auto b = uint8_t(s[pos + i]);
    if ((b & 0xC0) != 0x80) {  // broken sequence: take the lead byte alone
      ++pos;
      return b0;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  pos += n;
  return cp;
}

namespace {
// Length of the complete sequence at s[pos], 0 when none starts there.
size_t sequence_len(std::string_view s, size_t pos) {
  const auto b0 = uint8_t(s[pos]);
  if (b0 < 0x80) return 1;
  const size_t n = (b0 & 0xE0) == 0xC0 ? 2 : (b0 & 0xF0) == 0xE0 ? 3 : (b0 & 0xF8) == 0xF0 ? 4 : 0;
  if (n == 0 || n > s.size() - pos) return 0;
  for (size_t i = 1; i < n; ++i)
    if ((uint8_t(s[pos + i]) & 0xC0) != 0x80) return 0;
  return n;
}
}  // namespace

std::string_view with_invalid_replaced(std::string_view s, std::string& storage) {
  size_t pos = 0;
  for (size_t n; pos < s.size() && (n = sequence_len(s, pos)) != 0;) pos += n;
  if (pos == s.size()) return s;
  storage.assign(s.substr(0, pos));
  while (pos < s.size()) {
    const size_t n = sequence_len(s, pos);
    if (n == 0) {
      storage += "\xEF\xBF\xBD";  // U+FFFD for this one byte
      ++pos;
    } else {
      storage.append(s.substr(pos, n));
      pos += n;
    }
  }
  return storage;
}

std::vector<uint32_t> decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) out.push_back(decode_one(s, pos));
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

std::string encode(const std::vector<uint32_t>& cps) {
  std::string s;
  for (uint32_t c : cps) append_utf8(s, c);
  return s;
}

size_t incomplete_utf8_tail(std::string_view s) {
  // Walk back over at most 3 continuation bytes to the lead byte.
  size_t n = s.size();
  for (size_t k = 1; k <= 4 && k <= n; ++k) {
    const auto b = uint8_t(s[n - k]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte
    size_t need = utf8_len(b);
    if (need > 1 && need > k) return k;  // lead byte whose sequence has not finished yet
    return 0;
  }
  return 0;
}

}  // namespace baton::unicode
