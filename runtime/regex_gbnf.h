// A JSON Schema `pattern` (ECMA-262 regular expression syntax, the common part) as a GBNF
// expression for the *inside* of a JSON string: characters written as JSON writes them ("\"",
// "\\", "\n", "\u00XX" for other controls), so that the string's decoded value matches the
// pattern. Not anchored with ^ / $, the pattern may match anywhere in the value, as JSON Schema
// says. The grammar may generate a subset of the matching strings (a negated class never produces
// a control character) but never a string that does not match.
//
// Supported: literals, escapes (\n \t \r \f \v \0 \xHH \uHHHH, escaped punctuation), ., classes
// [a-z], [^...], \d \w \s and their negations (\D \W \S outside classes), groups ( ) and (?: ),
// |, * + ? {m} {m,} {m,n} (lazy forms read as greedy: the set of strings is the same), ^ at the
// start and $ at the end. Anything else (backreferences, lookaround, \b, anchors elsewhere,
// named groups, Unicode property escapes) throws Error(Usage) naming it.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace baton {

std::string regex_to_gbnf(std::string_view pattern);

// GBNF building: alternatives in parentheses ("( a | b )"), a single one as it is.
std::string alternation(const std::vector<std::string>& alts);

}  // namespace baton
