#include "runtime/pretokenizer.h"

#include <algorithm>
#include <functional>
#include <string>

#include "gguf/error.h"
#include "runtime/unicode.h"

namespace baton {
namespace {

using unicode::Cat;

// The text as code points with their byte offsets; splitters work on [begin, end) index ranges and
// never look outside the range they were given (a regex applied to one piece sees only that piece).
struct Text {
  std::vector<uint32_t> cp;
  std::vector<Cat> cat;
  std::vector<bool> ws;
  std::vector<size_t> off;  // off[i] = byte offset of cp[i]; off[n] = text size

  explicit Text(std::string_view s) {
    for (size_t pos = 0; pos < s.size();) {
      off.push_back(pos);
      uint32_t c = unicode::decode_one(s, pos);
      cp.push_back(c);
      cat.push_back(unicode::category(c));
      ws.push_back(unicode::is_whitespace(c));
    }
    off.push_back(s.size());
  }
  bool letter(size_t i) const { return cat[i] == Cat::Letter; }
  bool number(size_t i) const { return cat[i] == Cat::Number; }
  // [^\s\p{L}\p{N}]
  bool other(size_t i) const { return !ws[i] && !letter(i) && !number(i); }
};

struct Range {
  size_t begin, end;
};

// Length of the run starting at i (< end) whose code points satisfy pred.
template <class Pred>
size_t run(size_t i, size_t end, Pred pred) {
  size_t j = i;
  while (j < end && pred(j)) ++j;
  return j - i;
}

// A splitter returns the length (>= 0) of the match starting exactly at `pos` within [pos, end).
using Matcher = std::function<size_t(const Text&, size_t pos, size_t end)>;

// Applies one "regex" to every range: matches become pieces, and so does the text between them.
std::vector<Range> split(const Text& t, const std::vector<Range>& in, const Matcher& m) {
  std::vector<Range> out;
  for (Range r : in) {
    size_t gap = r.begin;
    for (size_t pos = r.begin; pos < r.end;) {
      size_t n = m(t, pos, r.end);
      if (n == 0) {
        ++pos;
        continue;
      }
      if (gap < pos) out.push_back({gap, pos});
      out.push_back({pos, pos + n});
      pos += n;
      gap = pos;
    }
    if (gap < r.end) out.push_back({gap, r.end});
  }
  return out;
}

bool is_ascii_lower(const Text& t, size_t i, char c, bool any_case) {
  uint32_t x = t.cp[i];
  if (any_case && x >= 'A' && x <= 'Z') x += 'a' - 'A';
  if (any_case && x == 0x17F) x = 's';  // LATIN SMALL LETTER LONG S folds to s, as Oniguruma's (?i) has it
  return x == uint32_t(c);
}

// 's 't 're 've 'm 'll 'd at pos (which holds an apostrophe); 0 if none.
size_t contraction(const Text& t, size_t pos, size_t end, bool any_case) {
  if (t.cp[pos] != '\'' || pos + 1 >= end) return 0;
  for (char c : {'s', 't', 'm', 'd'})
    if (is_ascii_lower(t, pos + 1, c, any_case)) return 2;
  if (pos + 2 >= end) return 0;
  for (const char* two : {"re", "ve", "ll"})
    if (is_ascii_lower(t, pos + 1, two[0], any_case) && is_ascii_lower(t, pos + 2, two[1], any_case)) return 3;
  return 0;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t match_gpt2(const Text& t, size_t pos, size_t end) {
  if (size_t n = contraction(t, pos, end, false)) return n;
  size_t start = pos;
  if (t.cp[pos] == ' ' && pos + 1 < end && !t.ws[pos + 1]) start = pos + 1;  // the optional leading space
  auto letter = [&](size_t i) { return t.letter(i); };
  auto number = [&](size_t i) { return t.number(i); };
  auto other = [&](size_t i) { return t.other(i); };
  if (t.letter(start)) return start - pos + run(start, end, letter);
  if (t.number(start)) return start - pos + run(start, end, number);
  if (t.other(start)) return start - pos + run(start, end, other);
  // Whitespace: a run followed by a non-space leaves its last character to the next word.
  size_t k = run(pos, end, [&](size_t i) { return bool(t.ws[i]); });
  if (pos + k < end && k > 1) return k - 1;
  return k;
}

// The alternatives after the words, the same in the Llama 3 and GPT-4o regexes:
// \p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+  (GPT-4o: [\r\n/]* after the punctuation)
size_t match_numbers_punct_space(const Text& t, size_t pos, size_t end, size_t max_digits, bool slash) {
  auto newline = [&](size_t i) { return t.cp[i] == '\r' || t.cp[i] == '\n'; };
  if (t.number(pos)) return std::min(max_digits, run(pos, end, [&](size_t i) { return t.number(i); }));
  size_t start = pos;
  if (t.cp[pos] == ' ' && pos + 1 < end && t.other(pos + 1)) start = pos + 1;
  if (t.other(start)) {
    size_t j = start + run(start, end, [&](size_t i) { return t.other(i); });
    j += run(j, end, [&](size_t i) { return newline(i) || (slash && t.cp[i] == '/'); });
    return j - pos;
  }
  size_t k = run(pos, end, [&](size_t i) { return bool(t.ws[i]); });
  for (size_t j = pos + k; j > pos; --j)  // \s*[\r\n]+ ends at the run's last newline
    if (newline(j - 1)) return j - pos;
  if (pos + k < end && k > 1) return k - 1;
  return k;
}

// (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}|
//  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
size_t match_llama3(const Text& t, size_t pos, size_t end, size_t max_digits) {
  if (size_t n = contraction(t, pos, end, true)) return n;
  auto letter = [&](size_t i) { return t.letter(i); };
  const uint32_t c = t.cp[pos];
  const bool c_nl = c == '\r' || c == '\n';
  if (!c_nl && !t.letter(pos) && !t.number(pos) && pos + 1 < end && t.letter(pos + 1))
    return 1 + run(pos + 1, end, letter);
  if (t.letter(pos)) return run(pos, end, letter);
  return match_numbers_punct_space(t, pos, end, max_digits, false);
}

// [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
// [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
// \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// The two word alternatives as a backtracking regex tries them: each first with its optional
// leading character, then without; the "upper" run (Lm, Lo and marks are in both sets) gives back
// characters until a "lower" one can start the second run.
size_t match_gpt4o(const Text& t, size_t pos, size_t end) {
  using unicode::LetterCase;
  auto upper = [&](size_t i) {
    const LetterCase c = unicode::letter_case(t.cp[i]);
    return c == LetterCase::Upper || c == LetterCase::Other || t.cat[i] == Cat::Mark;
  };
  auto lower = [&](size_t i) {
    const LetterCase c = unicode::letter_case(t.cp[i]);
    return c == LetterCase::Lower || c == LetterCase::Other || t.cat[i] == Cat::Mark;
  };
  auto newline = [&](size_t i) { return t.cp[i] == '\r' || t.cp[i] == '\n'; };
  auto with_contraction = [&](size_t e) { return (e < end ? e + contraction(t, e, end, true) : e) - pos; };
  const bool lead = !newline(pos) && !t.letter(pos) && !t.number(pos);  // [^\r\n\p{L}\p{N}] (marks too)
  for (int alt = 1; alt <= 2; ++alt)
    for (size_t s : {pos + (lead ? 1 : 0), pos}) {
      const size_t j = s + run(s, end, upper);
      if (alt == 1) {
        for (size_t k = j + 1; k-- > s;)  // the upper run gives back until a lower one starts at k
          if (k < end && lower(k)) return with_contraction(k + run(k, end, lower));
      } else if (j > s) {
        return with_contraction(j + run(j, end, lower));
      }
      if (!lead) break;  // without a leading character both starts are the same
    }
  return match_numbers_punct_space(t, pos, end, 3, true);
}

// [\p{P}<extra ASCII>]+
Matcher punct_run(std::string extra) {
  return [extra](const Text& t, size_t pos, size_t end) {
    return run(pos, end, [&](size_t i) {
      return t.cat[i] == Cat::Punct || (t.cp[i] < 128 && extra.find(char(t.cp[i])) != std::string::npos);
    });
  };
}

size_t match_one_number(const Text& t, size_t pos, size_t) { return t.number(pos) ? 1 : 0; }
size_t match_number_run(const Text& t, size_t pos, size_t end) {
  return run(pos, end, [&](size_t i) { return t.number(i); });
}
// [0-9][0-9][0-9]
size_t match_ascii_digits3(const Text& t, size_t pos, size_t end) {
  if (pos + 3 > end) return 0;
  for (size_t i = pos; i < pos + 3; ++i)
    if (t.cp[i] < '0' || t.cp[i] > '9') return 0;
  return 3;
}

}  // namespace

PreTokenizer pretokenizer_from_name(std::string_view name) {
  struct Alias {
    const char* name;
    PreTokenizer p;
  };
  static const Alias aliases[] = {
      {"default", PreTokenizer::Default},   {"gpt-2", PreTokenizer::Gpt2},         {"gpt2", PreTokenizer::Gpt2},
      {"mpt", PreTokenizer::Gpt2},          {"olmo", PreTokenizer::Gpt2},          {"jais", PreTokenizer::Gpt2},
      {"falcon", PreTokenizer::Falcon},     {"starcoder", PreTokenizer::Starcoder}, {"smollm", PreTokenizer::Starcoder},
      {"refact", PreTokenizer::Starcoder},  {"command-r", PreTokenizer::Starcoder}, {"codeshell", PreTokenizer::Starcoder},
      {"llama-bpe", PreTokenizer::Llama3},  {"llama3", PreTokenizer::Llama3},      {"dbrx", PreTokenizer::Llama3},
      {"smaug-bpe", PreTokenizer::Llama3},  {"qwen2", PreTokenizer::Qwen2},        {"deepseek-r1-qwen", PreTokenizer::Qwen2},
      {"stablelm2", PreTokenizer::Qwen2},   {"phi-2", PreTokenizer::Gpt2},         {"gpt-4o", PreTokenizer::Gpt4o},
  };
  for (const Alias& a : aliases)
    if (name == a.name) return a.p;
  std::string known;
  for (const Alias& a : aliases) known += std::string(known.empty() ? "" : ", ") + a.name;
  fail(ErrorKind::Model, "unsupported tokenizer.ggml.pre '{}' (supported: {})", name, known);
}

const char* pretokenizer_name(PreTokenizer p) {
  switch (p) {
    case PreTokenizer::Default: return "default";
    case PreTokenizer::Gpt2: return "gpt-2";
    case PreTokenizer::Falcon: return "falcon";
    case PreTokenizer::Starcoder: return "starcoder";
    case PreTokenizer::Llama3: return "llama3";
    case PreTokenizer::Qwen2: return "qwen2";
    case PreTokenizer::Gpt4o: return "gpt-4o";
  }
  return "?";
}

std::vector<std::string_view> pretokenize(PreTokenizer p, std::string_view text) {
  if (text.empty()) return {};
  const Text t(text);
  std::vector<Range> r{{0, t.cp.size()}};
  switch (p) {
    case PreTokenizer::Default:
      r = split(t, r, punct_run("$+<=>^~|"));
      r = split(t, r, match_gpt2);
      r = split(t, r, match_number_run);
      r = split(t, r, match_ascii_digits3);
      break;
    case PreTokenizer::Gpt2:
      r = split(t, r, match_gpt2);
      break;
    case PreTokenizer::Falcon:
      r = split(t, r, punct_run("$+<=>^~|`"));
      r = split(t, r, match_gpt2);
      r = split(t, r, match_ascii_digits3);
      break;
    case PreTokenizer::Starcoder:
      r = split(t, r, match_one_number);
      r = split(t, r, match_gpt2);
      break;
    case PreTokenizer::Llama3:
      r = split(t, r, [](const Text& x, size_t pos, size_t end) { return match_llama3(x, pos, end, 3); });
      break;
    case PreTokenizer::Qwen2:
      r = split(t, r, [](const Text& x, size_t pos, size_t end) { return match_llama3(x, pos, end, 1); });
      break;
    case PreTokenizer::Gpt4o:
      r = split(t, r, match_gpt4o);
      break;
  }
  std::vector<std::string_view> out;
  out.reserve(r.size());
  for (Range x : r) out.push_back(text.substr(t.off[x.begin], t.off[x.end] - t.off[x.begin]));
  return out;
}

}  // namespace baton
