// A vocabulary's strings in one block of bytes, with a hash index from text to position.
//
// Gemma 3's 262,144 tokens as std::string plus an unordered_map from text to id took ~26 MiB
// (a 32-byte string and a 64-byte map node each); here they take the bytes themselves, 4 bytes
// of offset and 8 to 16 of index per string (~5 MiB for Gemma 3), and a lookup needs no
// std::string built from the key.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace baton {

class StringTable {
 public:
  StringTable() = default;
  explicit StringTable(const std::vector<std::string>& items);

  size_t size() const { return offsets_.empty() ? 0 : offsets_.size() - 1; }
  bool empty() const { return size() == 0; }
  std::string_view operator[](size_t i) const {
    return std::string_view(blob_).substr(offsets_[i], offsets_[i + 1] - offsets_[i]);
  }
  // The lowest position holding `s` (a text that occurs twice is found at its first place).
  std::optional<int32_t> find(std::string_view s) const;

 private:
  std::string blob_;
  std::vector<uint32_t> offsets_;  // size() + 1: item i is blob_[offsets_[i], offsets_[i + 1])
  std::vector<int32_t> slots_;     // open addressing (linear probing), a power of two; -1 free
};

}  // namespace baton
