// Pairwise merging of adjacent symbols: the loop both BPE flavours share. SentencePiece
// (tokenizer.cpp) ranks a pair by the score of the merged piece, GPT-2 byte-level BPE
// (tokenizer_bpe.cpp) by the rank of the merge rule; both merge the best pair first, the leftmost
// of equally good ones, until no adjacent pair merges.
#pragma once
#include <cstddef>
#include <optional>
#include <queue>
#include <vector>

namespace baton {

struct SymbolSpan {
  size_t off, len;  // bytes [off, off + len) of the text being tokenized
};

// `spans`: the initial symbols, contiguous and in text order; on return, the merged symbols.
// `priority(left, right)` gives a pair's priority (higher merges first) as a double, or nullopt
// when the pair does not merge. A double holds every float score and int rank exactly, so the
// order (and with it the result) is the same as comparing the scores or ranks themselves.
template <class Priority>
void merge_symbols(std::vector<SymbolSpan>& spans, Priority&& priority) {
  if (spans.size() < 2) return;
  struct Sym {
    int prev, next;
    SymbolSpan s;  // len 0: merged into its left neighbour
  };
  struct Pair {
    double priority;
    int left, right;
    size_t len;  // the pair's length when queued: a later merge of either side makes it stale
    bool operator<(const Pair& o) const {  // the queue pops the largest: best, then leftmost
      return priority != o.priority ? priority < o.priority : left > o.left;
    }
  };
  std::vector<Sym> sym;
  sym.reserve(spans.size());
  for (const SymbolSpan& s : spans) sym.push_back({int(sym.size()) - 1, int(sym.size()) + 1, s});
  sym.back().next = -1;

  std::priority_queue<Pair> queue;
  auto try_pair = [&](int l, int r) {
    if (l < 0 || r < 0) return;
    if (const std::optional<double> p = priority(sym[size_t(l)].s, sym[size_t(r)].s))
      queue.push({*p, l, r, sym[size_t(l)].s.len + sym[size_t(r)].s.len});
  };
  for (int i = 0; i + 1 < int(sym.size()); ++i) try_pair(i, i + 1);
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Sym& l = sym[size_t(p.left)];
    Sym& r = sym[size_t(p.right)];
    if (l.s.len == 0 || r.s.len == 0 || l.next != p.right || l.s.len + r.s.len != p.len) continue;  // stale
    l.s.len += r.s.len;
    r.s.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[size_t(r.next)].prev = p.left;
    try_pair(l.prev, p.left);
    try_pair(p.left, l.next);
  }
  spans.clear();
  for (int i = 0; i >= 0; i = sym[size_t(i)].next) spans.push_back(sym[size_t(i)].s);
}

}  // namespace baton
