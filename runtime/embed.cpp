// Embeddings: pooling and normalization of the kHidden rows a pipeline returns (runtime/embed.h).
#include "runtime/embed.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include "gguf/error.h"
#include "gguf/gguf.h"
#include "runtime/batch.h"
#include "runtime/config.h"
#include "runtime/pipeline.h"

namespace baton {

const char* to_string(Pooling p) {
  switch (p) {
    case Pooling::None: return "none";
    case Pooling::Mean: return "mean";
    case Pooling::Cls: return "cls";
    case Pooling::Last: return "last";
    case Pooling::Rank: return "rank";
  }
  return "?";
}

Pooling parse_pooling(std::string_view name) {
  if (name == "none") return Pooling::None;
  if (name == "mean") return Pooling::Mean;
  if (name == "cls") return Pooling::Cls;
  if (name == "last") return Pooling::Last;
  if (name == "rank")
    fail(ErrorKind::Usage, "pooling 'rank' (a reranker's classifier head) is not supported; use none, mean, cls or last");
  fail(ErrorKind::Usage, "unknown pooling '{}': use none, mean, cls or last", name);
}

std::optional<Pooling> file_pooling(const gguf::File& f) {
  const std::string key = f.arch_key("pooling_type");
  if (!f.has(key)) return std::nullopt;
  const int64_t v = f.get<int64_t>(key);
  if (v < 0 || v > int64_t(Pooling::Rank))
    fail(ErrorKind::Model, "{}: metadata '{}' = {} is not a pooling type (0 none, 1 mean, 2 cls, 3 last, 4 rank)",
         f.path(), key, v);
  return Pooling(v);
}

void check_normalize(int norm) {
  if (norm < -1)
    fail(ErrorKind::Usage, "normalization {}: use -1 (none), 0 (max absolute, int16 range), 1 (taxicab), "
         "2 (Euclidean) or p > 2 (p-norm)", norm);
}

void normalize_embedding(float* v, int n, int norm) {
  check_normalize(norm);
  double size = 0;  // the vector's size in the chosen norm
  if (norm == -1) return;
  // NaN or infinity in it: the vector has no size, and so no normalized form. Every component is
  // NaN then (written as null, with a warning), not the finite ones over an infinite or NaN size
  // (zeros) or over the size of the finite ones alone: neither may pass for a valid vector.
  if (!std::all_of(v, v + n, [](float x) { return std::isfinite(x); })) {
    std::fill(v, v + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  if (norm == 0) {
    for (int i = 0; i < n; ++i) size = std::max(size, std::fabs(double(v[i])));
    size /= 32760.0;  // the largest magnitude becomes 32760
  } else if (norm == 2) {
    for (int i = 0; i < n; ++i) size += double(v[i]) * double(v[i]);
    size = std::sqrt(size);
  } else {
    // ||v||_p = m · ||v / m||_p with m = max |v_i|: the powers stay in [0, 1] and cannot
    // overflow (|v_i|^500 of a component of 27 is past any double).
    double m = 0;
    for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(double(v[i])));
    if (m > 0) {
      for (int i = 0; i < n; ++i) size += std::pow(std::fabs(double(v[i])) / m, double(norm));
      size = m * std::pow(size, 1.0 / double(norm));
    }
  }
  const double scale = size > 0 ? 1.0 / size : 0.0;
  for (int i = 0; i < n; ++i) v[i] = float(double(v[i]) * scale);
}

namespace {

// An input in a slot: how far it has gone and what its pooling has gathered so far.
struct Slot {
  long input = -1;          // -1: free
  int next = 0;             // next position to evaluate
  std::vector<double> sum;  // Mean: the sum of its rows
  std::vector<float> rows;  // None: every row; Cls, Last: the one row
};

}  // namespace

void embed_sequences(Pipeline& p, const std::vector<std::vector<int32_t>>& inputs, const EmbedOptions& opt,
                     const std::function<void(Embedding&&)>& done, const std::atomic<bool>* cancel) {
  if (opt.pooling == Pooling::Rank) parse_pooling("rank");
  check_normalize(opt.normalize);
  const size_t E = size_t(p.config().n_embd), V = size_t(p.n_vocab());
  if (E > V)
    fail(ErrorKind::Usage, "this model's n_embd ({}) is larger than its n_vocab ({}): its hidden states do not fit "
         "an output row", E, V);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].empty()) fail(ErrorKind::Usage, "input {} has no tokens", i);
    if (int(inputs[i].size()) > p.n_ctx())
      fail(ErrorKind::Usage, "input {} has {} tokens but the context is {} (--ctx)", i, inputs[i].size(), p.n_ctx());
  }
  // Rows of output per forward: every token's for mean and none (bounded so the row slots, n_vocab
  // floats each, stay within 1 GiB of address space; only the first n_embd of each are written).
  const bool every_row = opt.pooling == Pooling::Mean || opt.pooling == Pooling::None;
  const int row_cap = int(std::max<size_t>(1, (size_t(1) << 30) / (V * sizeof(float))));
  const int budget = std::max(1, every_row ? std::min(opt.batch_tokens, row_cap) : opt.batch_tokens);

  std::vector<Slot> slots(size_t(p.n_seq()));
  std::map<size_t, Embedding> finished;  // waiting for an earlier input
  size_t next_input = 0, next_done = 0, start = 0;
  std::unique_ptr<float[]> out;  // uninitialized: untouched pages of unused row tails cost nothing
  size_t out_rows = 0;
  struct Row { int slot, pos; };
  std::vector<Row> rows;
  for (;;) {
    if (cancel && cancel->load()) return;
    for (size_t s = 0; s < slots.size() && next_input < inputs.size(); ++s) {
      Slot& sl = slots[s];
      if (sl.input >= 0) continue;
      p.truncate_seq(int(s), 0);
      sl = Slot{};
      sl.input = long(next_input++);
      if (opt.pooling == Pooling::Mean) sl.sum.assign(E, 0.0);
    }
    // This forward: the active inputs' next tokens, slot after slot from a rotating start, until
    // the budget is spent.
    Batch b;
    rows.clear();
    int left = budget;
    for (size_t k = 0; k < slots.size() && left > 0; ++k) {
      const size_t s = (start + k) % slots.size();
      const Slot& sl = slots[s];
      if (sl.input < 0) continue;
      const std::vector<int32_t>& in = inputs[size_t(sl.input)];
      const int n = int(in.size()), take = std::min(left, n - sl.next);
      for (int pos = sl.next; pos < sl.next + take; ++pos) {
        const bool want = every_row || (opt.pooling == Pooling::Cls && pos == 0) ||
                          (opt.pooling == Pooling::Last && pos == n - 1);
        b.add(in[size_t(pos)], pos, int(s), uint8_t(want ? kHidden : kNoLogits));
        if (want) rows.push_back({int(s), pos});
      }
      left -= take;
    }
    start = (start + 1) % slots.size();
    if (b.size() == 0) break;
    if (rows.size() > out_rows) {
      out_rows = std::max(rows.size(), size_t(every_row ? budget : slots.size()));
      out.reset(new float[out_rows * V]);
    }
    p.decode(b, out.get());
    for (size_t r = 0; r < rows.size(); ++r) {
      Slot& sl = slots[size_t(rows[r].slot)];
      const float* h = out.get() + r * V;
      if (opt.pooling == Pooling::Mean) {
        for (size_t i = 0; i < E; ++i) sl.sum[i] += double(h[i]);
      } else {
        sl.rows.insert(sl.rows.end(), h, h + E);
      }
    }
    // Advance each slot by what it evaluated, and finish the inputs that are through.
    for (int t = 0; t < b.size(); ++t) slots[size_t(b.seq[size_t(t)])].next = b.pos[size_t(t)] + 1;
    for (Slot& sl : slots) {
      if (sl.input < 0 || sl.next < int(inputs[size_t(sl.input)].size())) continue;
      Embedding e;
      e.index = size_t(sl.input);
      e.n_tokens = sl.next;
      if (opt.pooling == Pooling::Mean) {
        e.values.resize(E);
        for (size_t i = 0; i < E; ++i) e.values[i] = float(sl.sum[i] / double(sl.next));
      } else {
        e.values = std::move(sl.rows);
      }
      for (size_t at = 0; at < e.values.size(); at += E) normalize_embedding(e.values.data() + at, int(E), opt.normalize);
      finished.emplace(e.index, std::move(e));
      sl = Slot{};
    }
    for (auto it = finished.find(next_done); it != finished.end(); it = finished.find(++next_done)) {
      done(std::move(it->second));
      finished.erase(it);
    }
  }
}

}  // namespace baton
