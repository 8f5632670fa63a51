// GPT-2's byte-to-printable-character mapping, used by byte-level BPE vocabularies.
#pragma once
#include <string>
#include <string_view>

namespace baton {

// Each byte becomes the code point GPT-2's alphabet assigns it (space -> "Ġ", newline -> "Ċ").
std::string byte_level_encode(std::string_view bytes);
// The inverse; code points outside the alphabet are copied through unchanged.
std::string byte_level_decode(std::string_view text);

}  // namespace baton
