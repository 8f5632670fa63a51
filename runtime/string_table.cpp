#include "runtime/string_table.h"

#include <functional>
#include <limits>
#include <stdexcept>

namespace baton {

namespace {
size_t hash_of(std::string_view s) { return std::hash<std::string_view>{}(s); }
}  // namespace

StringTable::StringTable(gguf::StringList items) : items_(std::move(items)) {
  if (items_.size() >= size_t(std::numeric_limits<int32_t>::max()))
    throw std::length_error("StringTable: more than 2^31 strings");
  // At most half full: probes stay short whatever the hash spreads.
  size_t cap = 16;
  while (cap < 2 * items_.size()) cap *= 2;
  slots_.assign(cap, -1);
  const size_t mask = cap - 1;
  for (size_t i = 0; i < items_.size(); ++i) {
    const std::string_view s = items_[i];
    for (size_t k = hash_of(s) & mask;; k = (k + 1) & mask) {
      if (slots_[k] < 0) {
        slots_[k] = int32_t(i);
        break;
      }
      if ((*this)[size_t(slots_[k])] == s) break;  // a repeat: the first place keeps the slot
    }
  }
}

std::optional<int32_t> StringTable::find(std::string_view s) const {
  if (slots_.empty()) return std::nullopt;
  const size_t mask = slots_.size() - 1;
  for (size_t k = hash_of(s) & mask; slots_[k] >= 0; k = (k + 1) & mask)
    if ((*this)[size_t(slots_[k])] == s) return slots_[k];
  return std::nullopt;
}

}  // namespace baton
