// A vocabulary's strings in one block of bytes, with a hash index from text to position.
//
// Gemma 3's 262,144 tokens as std::string plus an unordered_map from text to id took ~26 MiB
// (a 32-byte string and a 64-byte map node each); here they take the bytes themselves, 4 bytes
// of offset and 8 to 16 of index per string (~5 MiB for Gemma 3), and a lookup needs no
// std::string built from the key.
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "gguf/string_list.h"

namespace baton {

class StringTable {
 public:
  StringTable() = default;
  explicit StringTable(gguf::StringList items);  // throws std::length_error past 2^31 strings

  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  std::string_view operator[](size_t i) const { return items_[i]; }
  // The lowest position holding `s` (a text that occurs twice is found at its first place).
  std::optional<int32_t> find(std::string_view s) const;

 private:
  gguf::StringList items_;
  std::vector<int32_t> slots_;  // open addressing (linear probing), a power of two; -1 free
};

}  // namespace baton
