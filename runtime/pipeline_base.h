// Internal to runtime/: what every Pipeline implementation holds about its model, the steps that
// open it and the checks on its batches, shared by the in-process pipeline (pipeline.cpp) and the
// MPI one (distributed.cpp); defined in pipeline_base.cpp.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "runtime/batch.h"
#include "runtime/config.h"
#include "runtime/lora.h"
#include "runtime/pipeline.h"
#include "runtime/planner.h"
#include "runtime/tokenizer.h"

namespace baton {

// Whether tensor `name` belongs to stage s (its blocks, the embedding / head it holds, and the few
// tensors outside any block that every stage keeps).
bool stage_holds(const Stage& s, const std::string& name, bool tied_head);

// Whether loading copies tensor t to where it is used (on_gpu: a GPU stage holds it), so that its
// mapped pages can be given back once read (gguf::File::release): a GPU stage uploads what it
// holds; a CPU stage packs the matrices of the types this CPU packs and reads only the rows it
// looks up of an untied embedding. The rest (norms, matrices of unpacked types) is read from the
// mapping at every step.
bool copied_at_load(const gguf::TensorInfo& t, bool on_gpu, bool tied_head);

class ModelPipeline : public Pipeline {
 public:
  const gguf::File& file() const override { return *file_; }
  const ModelConfig& config() const override { return cfg_; }
  const Tokenizer& tokenizer() const override;
  int n_ctx() const override { return n_ctx_; }
  int n_seq() const override { return int(len_.size()); }
  int n_vocab() const override { return cfg_.n_vocab; }

 protected:
  // The options every pipeline takes: context, sequences, batch (Error(Usage) when out of range).
  static void check_options(const LoadOptions& opt);
  // Maps the file, reads its config and tokenizer (checked against each other), checks the KV
  // type, opens the LoRA adapters (checked against the model, their warnings printed), and sets
  // n_ctx_ (the model's context capped at 4096 unless given) and len_ (all empty).
  void open_model(const std::string& path, const LoadOptions& opt);
  // The planner's options for this model as opened (n_ctx_) and the load options.
  PlanOptions plan_options(const LoadOptions& opt) const;
  // Error(Usage) unless seq names one of the n_seq sequences.
  void check_seq(int seq) const;
  // Checks a whole batch before any state is touched: its copies (existing, distinct sequences,
  // no more positions than the source holds, a source within copy_limit()), then equal array
  // lengths, token ids inside the vocabulary, existing sequences, positions that continue each
  // sequence's cache (as submitted so far and copied) and stay inside the context. Returns the sequence lengths after the batch; the
  // caller stores them in len_ once it accepts the batch. Error(Usage) names the first problem.
  std::vector<int> check_batch(const Batch& b) const;

  std::unique_ptr<gguf::File> file_;
  ModelConfig cfg_;
  std::unique_ptr<LoraAdapters> lora_;  // opt.lora, checked against the model (null: none)
  std::unique_ptr<ControlVectors> control_;  // opt.control_vectors (null: none)
  std::optional<Tokenizer> tok_;
  int n_ctx_ = 0;
  std::vector<int> len_;  // positions per sequence, as submitted
};

}  // namespace baton
