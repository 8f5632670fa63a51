#include "runtime/draft_model.h"

#include <algorithm>
#include <cstdlib>

#include "gguf/error.h"
#include "runtime/batch.h"
#include "runtime/pipeline.h"
#include "runtime/tokenizer.h"

namespace baton {

void check_draft_vocab(const Tokenizer& target, const Tokenizer& draft) {
  const int32_t nt = target.n_vocab(), nd = draft.n_vocab();
  if (std::abs(nt - nd) > 128)
    fail(ErrorKind::Usage, "the draft model's vocabulary has {} tokens, the model's {}: a draft model must share the "
         "model's tokenizer", nd, nt);
  if (target.bos() != draft.bos() || target.eos() != draft.eos())
    fail(ErrorKind::Usage, "the draft model's BOS/EOS ({}/{}) are not the model's ({}/{}): a draft model must share the "
         "model's tokenizer", draft.bos(), draft.eos(), target.bos(), target.eos());
  for (int32_t id = 0; id < std::min(nt, nd); ++id)
    if (target.token_text(id) != draft.token_text(id))
      fail(ErrorKind::Usage, "token {} is '{}' for the draft model but '{}' for the model: a draft model must share the "
           "model's tokenizer", id, draft.token_text(id), target.token_text(id));
}

ModelDrafter::ModelDrafter(std::unique_ptr<Pipeline> draft, int target_vocab)
    : p_(std::move(draft)), target_vocab_(target_vocab), cached_(size_t(p_->n_seq())), out_(size_t(p_->n_vocab())) {}

ModelDrafter::~ModelDrafter() = default;

void ModelDrafter::draft(int slot, const std::vector<int32_t>& history, size_t max_len, std::vector<int32_t>& out) {
  draft_many({{slot, &history, max_len, &out}});
}

void ModelDrafter::draft_many(const std::vector<Job>& jobs) {
  // Each job's slot: keep the longest start its cache shares with the history (but evaluate the
  // history's last token again, for its logits), then what is missing — all jobs in one batch.
  const size_t n_ctx = size_t(p_->n_ctx());
  std::vector<Job> live;
  Batch b;
  for (Job j : jobs) {
    const std::vector<int32_t>& h = *j.history;
    if (j.slot < 0 || j.slot >= int(cached_.size()) || h.empty() || j.max_len == 0 || h.size() >= n_ctx) continue;
    // Positions h.size() .. + max_len − 2 are evaluated (the last guess is not): all in the context.
    j.max_len = std::min(j.max_len, n_ctx - h.size() + 1);
    auto& c = cached_[size_t(j.slot)];
    size_t keep = size_t(std::mismatch(c.begin(), c.end(), h.begin(), h.end()).first - c.begin());
    keep = std::min(keep, h.size() - 1);
    if (keep < c.size()) {
      // Sliding-window rings rewind only so far; past that the slot starts over.
      if (c.size() - keep > size_t(std::max(0, p_->max_rewind()))) keep = 0;
      p_->truncate_seq(j.slot, int(keep));
    }
    for (size_t at = keep; at < h.size(); ++at) b.add(h[at], int32_t(at), j.slot, at + 1 == h.size() ? kArgmaxOnly : kNoLogits);
    c = h;
    live.push_back(j);
  }
  if (live.empty()) return;
  const Tokenizer& tok = p_->tokenizer();
  const size_t V = size_t(p_->n_vocab());
  // Then one guess per job and forward, greedy, until each has max_len or guessed an end.
  for (;;) {
    out_.resize(live.size() * V);
    p_->decode(b, out_.data());
    evaluated_ += uint64_t(b.size());
    b.clear();
    size_t n = 0;
    for (size_t i = 0; i < live.size(); ++i) {
      const Job& j = live[i];
      const int32_t t = argmax_token(out_.data() + i * V);
      if (t < 0 || t >= target_vocab_) continue;
      j.out->push_back(t);
      if (j.out->size() == j.max_len || tok.is_eog(t)) continue;
      auto& c = cached_[size_t(j.slot)];
      b.add(t, int32_t(c.size()), j.slot, kArgmaxOnly);
      c.push_back(t);
      live[n++] = j;
    }
    live.resize(n);
    if (live.empty()) return;
  }
}

}  // namespace baton
