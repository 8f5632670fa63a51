// One pipeline stage on the CPU: a contiguous block of layers (and the embedding / head when the
// plan gives it them) with its own weights view, KV cache, scratch and worker threads. A
// pipeline joins stages with links; another backend (an MPI rank, a GPU) runs the same stage
// over its own block. forward() is the whole of the stage's work on one batch.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gguf/error.h"
#include "kernels/cpu/threadpool.h"
#include "models/llama.h"
#include "runtime/buffers.h"
#include "runtime/config.h"
#include "runtime/kv_cache.h"
#include "runtime/planner.h"

namespace baton {

namespace gguf { class File; }

struct StageOptions {
  int n_seq = 1;     // KV cache slots
  int n_ctx = 0;     // context per sequence
  int n_batch = 0;   // most tokens in one forward (sizes scratch)
  int n_outputs = 0; // most output rows in one forward (sizes the last stage's logits buffers; 0: n_batch)
  GgmlType kv_type = GgmlType::F16;
  int n_threads = 1; // worker threads of the stage's pool (the driving thread counts as one)
  bool cuda_graphs = true;  // GPU stages: capture decode steps in CUDA graphs and replay them
  bool cpu_moe = false;     // a mixture's experts stay in host memory (GPU stages run them on n_threads);
                            // the plan charges them apart from every stage, so no stage counts them
  const LoraAdapters* lora = nullptr;  // adapters (runtime/lora.h) of the model
  const ControlVectors* control = nullptr;  // control vectors (runtime/control_vector.h)
  int outputs() const { return int(output_rows(uint32_t(std::max(n_outputs, 0)), uint32_t(n_batch))); }
};

// Where a piece's hidden state is when it does not travel in host memory: a slot of the device link
// into or out of a GPU stage (runtime/link.h); -1 for host memory.
struct Handoff {
  int in_slot = -1;   // the slot of the link into this stage that holds the input
  int out_slot = -1;  // set by forward: the slot of the link out of this stage that holds the output
};

// What a pipeline drives: one stage on whatever device, host memory on both sides of forward().
class ModelStage {
 public:
  virtual ~ModelStage() = default;
  // The stage's work on `batch` (at most n_batch tokens). x (host) holds batch.size() × n_embd
  // hidden states: written from the token ids when the stage holds the embedding, otherwise read
  // from the previous stage; updated in place by the stage's layers. When the stage holds the
  // head, batch.n_logits() rows of n_vocab floats go to `logits` (host) in batch order.
  virtual void forward(const Batch& batch, float* x, float* logits) = 0;
  // The same, for a stage joined to its neighbours by device links (only GPU stages have them).
  virtual void forward(const Batch& batch, float* x, float* logits, Handoff& h) {
    BATON_CHECK(h.in_slot < 0);
    forward(batch, x, logits);
  }
  virtual const Stage& plan() const = 0;
  int layer_begin() const { return int(plan().layer_begin); }
  int layer_end() const { return int(plan().layer_end); }
  bool first() const { return plan().has_embedding; }
  bool last() const { return plan().has_output; }
  virtual int n_threads() const = 0;
  // Nothing for this stage right now (the work moved on to the next stage): its worker threads
  // stop spinning for the next job and sleep, leaving the cores to the stage that has work.
  virtual void rest() {}
  // CPU stages: the worker pool the stage computes with, and a way to run it on another pool of
  // the same size for a while (`nullptr` gives it its own back). The pipeline runs consecutive
  // stages one after another on one thread's pool when a single stream goes through them, so
  // the same warm workers carry on instead of waking another stage's.
  virtual cpu::ThreadPool* pool() { return nullptr; }
  virtual void borrow_pool(cpu::ThreadPool*) {}
  virtual int max_rewind() const = 0;
  // Batch::copies: the longest sequence its KV cache can copy the start of (KvCache::copy_limit).
  // forward() makes a batch's copies before its tokens.
  virtual int copy_limit() const = 0;
  // Weights + KV cache + scratch + buffers as allocated: what the planner sized.
  virtual uint64_t measured_bytes() const = 0;
  // What the stage measured at load and chose by it, one line each (--verbose prints them).
  virtual std::vector<std::string> notes() const { return {}; }
};

class CpuStage : public ModelStage {
 public:
  // Binds the planned block of `f` (which must outlive the stage) and allocates its KV cache,
  // scratch and pool.
  CpuStage(const gguf::File& f, const ModelConfig& cfg, const Stage& plan, const StageOptions& opt);

  using ModelStage::forward;
  void forward(const Batch& batch, float* x, float* logits) override;
  const Stage& plan() const override { return plan_; }
  int n_threads() const override { return pool_->size(); }
  void rest() override { pool_->rest(); }
  cpu::ThreadPool* pool() override { return pool_.get(); }
  void borrow_pool(cpu::ThreadPool* p) override;
  int max_rewind() const override { return kv_->max_rewind(); }
  int copy_limit() const override { return KvCache::copy_limit(cfg_, kv_->shape()); }
  // Weights bound + KV cache + scratch + the head's logits buffer: what the planner sized.
  uint64_t measured_bytes() const override;

 private:
  uint64_t bound_bytes(const gguf::File& f, bool with_experts) const;

  const ModelConfig& cfg_;
  Stage plan_;
  int begin_ = 0, end_ = 0, n_batch_ = 0, n_outputs_ = 0;
  ModelWeights weights_;
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<Scratch> scratch_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  cpu::ThreadPool* borrowed_ = nullptr;  // borrow_pool(): forward computes on this one
  std::vector<std::pair<size_t, uint8_t>> reduced_rows_;  // forward(): output rows (and modes) that want less than the row
  // Last stage: n_batch × n_vocab rows for a caller whose buffer is not float-aligned. Not zeroed:
  // the head writes before anything reads, and pages never used are never touched.
  std::unique_ptr<float[]> logits_;
  size_t logits_size_ = 0;
  uint64_t weight_bytes_ = 0;
  uint64_t scratch_bytes_ = 0;
};

}  // namespace baton
