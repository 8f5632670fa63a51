// Speculative decoding with a draft model (`--draft-model`): a smaller model of the same vocabulary
// guesses, greedily, the tokens that follow a decoder's history; the engine evaluates them behind
// the target's sampled token in one step and keeps those the target confirms
// (EngineOptions::drafter), so the reply is what the target alone would give, sooner when the
// draft model guesses well (it reads far fewer weight bytes per token).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/engine.h"

namespace baton {

class Pipeline;
class Tokenizer;

// Error(Usage) unless the two vocabularies agree: sizes within 128 of each other (files pad their
// embeddings differently), the same text for every id both have, the same BOS and EOS. Names the
// first id that differs.
void check_draft_vocab(const Tokenizer& target, const Tokenizer& draft);

class ModelDrafter : public Drafter {
 public:
  // `draft` holds a slot per target slot and at least the target's context; drafted ids at or
  // above target_vocab (the target's logits width) end a draft.
  ModelDrafter(std::unique_ptr<Pipeline> draft, int target_vocab);
  ~ModelDrafter() override;
  // Evaluates what the slot's draft cache lacks of `history` (the longest common start is kept;
  // the rest truncated), then up to max_len tokens one greedy step at a time; stops after an
  // end-of-generation token.
  void draft(int slot, const std::vector<int32_t>& history, size_t max_len, std::vector<int32_t>& out) override;
  // The same for several slots, their forwards shared: the catch-up of every history in one batch,
  // then one batch per guess with a token of each job still guessing.
  void draft_many(const std::vector<Job>& jobs) override;
  uint64_t evaluated() const { return evaluated_; }  // tokens the draft model has evaluated
  const Pipeline& pipeline() const { return *p_; }

 private:
  std::unique_ptr<Pipeline> p_;
  int target_vocab_;
  std::vector<std::vector<int32_t>> cached_;  // per slot: the tokens in the draft model's cache
  std::vector<float> out_;                    // the output rows (n_vocab floats a slot; argmax rows use 1)
  uint64_t evaluated_ = 0;
};

}  // namespace baton
