// A list of strings kept in one block of bytes: the texts back to back and where each one ends.
//
// GGUF metadata holds vocabularies of up to 262,144 tokens and BPE merge lists of ~150,000; as
// std::vector<std::string> each string cost 32 bytes plus a heap block when longer than 15, for
// texts of ~7 bytes. Here one costs its bytes and a 4-byte end offset.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace baton::gguf {

class StringList {
 public:
  static constexpr size_t kMaxBytes = std::numeric_limits<uint32_t>::max();  // all texts together

  StringList() = default;
  StringList(std::initializer_list<std::string_view> items) {
    for (std::string_view s : items) push_back(s);
  }
  explicit StringList(const std::vector<std::string>& items);

  size_t size() const { return ends_.size(); }
  bool empty() const { return ends_.empty(); }
  size_t bytes() const { return blob_.size(); }  // of all texts together
  std::string_view operator[](size_t i) const {
    const uint32_t begin = i ? ends_[i - 1] : 0;
    return std::string_view(blob_).substr(begin, ends_[i] - begin);
  }
  // Throws std::length_error when the texts would pass kMaxBytes (a GGUF reader checks first).
  void push_back(std::string_view s);
  void reserve(size_t n_items) { ends_.reserve(n_items); }
  void shrink_to_fit() { blob_.shrink_to_fit(); ends_.shrink_to_fit(); }
  std::vector<std::string> to_vector() const;
  bool operator==(const StringList& o) const { return ends_ == o.ends_ && blob_ == o.blob_; }

  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = std::string_view;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = std::string_view;
    const_iterator(const StringList* list, size_t i) : list_(list), i_(i) {}
    std::string_view operator*() const { return (*list_)[i_]; }
    const_iterator& operator++() { ++i_; return *this; }
    const_iterator operator++(int) { const_iterator r = *this; ++i_; return r; }
    bool operator==(const const_iterator& o) const { return i_ == o.i_; }
    bool operator!=(const const_iterator& o) const { return i_ != o.i_; }

   private:
    const StringList* list_;
    size_t i_;
  };
  const_iterator begin() const { return {this, 0}; }
  const_iterator end() const { return {this, size()}; }

 private:
  std::string blob_;
  std::vector<uint32_t> ends_;  // item i is blob_[i ? ends_[i - 1] : 0, ends_[i])
};

}  // namespace baton::gguf
