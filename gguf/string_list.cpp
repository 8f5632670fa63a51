#include "gguf/string_list.h"

#include <stdexcept>

namespace baton::gguf {

StringList::StringList(const std::vector<std::string>& items) {
  size_t bytes = 0;
  for (const auto& s : items) bytes += s.size();
  if (bytes > kMaxBytes) throw std::length_error("StringList: more than 4 GiB of text");
  blob_.reserve(bytes);
  ends_.reserve(items.size());
  for (const auto& s : items) push_back(s);
}

void StringList::push_back(std::string_view s) {
  if (s.size() > kMaxBytes - blob_.size()) throw std::length_error("StringList: more than 4 GiB of text");
  blob_ += s;
  ends_.push_back(uint32_t(blob_.size()));
}

std::vector<std::string> StringList::to_vector() const {
  std::vector<std::string> out;
  out.reserve(size());
  for (std::string_view s : *this) out.emplace_back(s);
  return out;
}

}  // namespace baton::gguf
