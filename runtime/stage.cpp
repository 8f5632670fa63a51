// A CPU stage: bind the planned block, allocate what the planner sized, run embed / layers / head.
#include "runtime/stage.h"

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "gguf/gguf.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/ops.h"

namespace baton {

CpuStage::CpuStage(const gguf::File& f, const ModelConfig& cfg, const Stage& plan, const StageOptions& opt)
    : cfg_(cfg), plan_(plan), begin_(int(plan.layer_begin)), end_(int(plan.layer_end)), n_batch_(opt.n_batch),
      n_outputs_(opt.outputs()) {
  BATON_CHECK(opt.n_batch > 0 && opt.n_threads > 0);
  pool_ = std::make_unique<cpu::ThreadPool>(opt.n_threads);
  weights_ = bind_weights(f, cfg_, begin_, end_, plan_.has_embedding, plan_.has_output, pool_.get(), opt.lora, opt.control);
  weight_bytes_ = bound_bytes(f, !opt.cpu_moe);
  KvCacheShape ks;
  ks.layer_begin = begin_;
  ks.layer_end = end_;
  ks.n_seq = opt.n_seq;
  ks.n_ctx = opt.n_ctx;
  ks.type = opt.kv_type;
  kv_ = std::make_unique<KvCache>(cfg_, ks);
  scratch_ = std::make_unique<Scratch>(cfg_, n_batch_, opt.kv_type);
  scratch_bytes_ = Scratch::bytes(cfg_, n_batch_, opt.kv_type);
  if (plan_.has_output) {
    logits_size_ = size_t(n_outputs_) * size_t(cfg_.n_vocab);
    logits_.reset(new float[logits_size_]);
  }
}

void CpuStage::borrow_pool(cpu::ThreadPool* p) {
  BATON_CHECK(!p || p->size() == pool_->size());
  borrowed_ = p;
}

void CpuStage::forward(const Batch& batch, float* x, float* logits) {
  BATON_CHECK(batch.size() > 0 && batch.size() <= n_batch_);
  cpu::ThreadPool& pool = borrowed_ ? *borrowed_ : *pool_;
  for (const SeqCopy& c : batch.copies) kv_->copy_prefix(c.src, c.dst, c.n);
  if (plan_.has_embedding) embed(cfg_, weights_, batch, x, pool);
  forward_layers(cfg_, weights_, *kv_, batch, begin_, end_, x, *scratch_, pool);
  if (!plan_.has_output) return;
  const size_t rows = size_t(batch.n_logits());
  if (rows == 0) return;
  BATON_CHECK(rows <= size_t(n_outputs_));  // (the pipeline cuts batches that ask more)
  // Straight into the caller's rows (every caller in the project gives an aligned buffer); an
  // unaligned one gets them through our own.
  const bool direct = logits && reinterpret_cast<uintptr_t>(logits) % alignof(float) == 0;
  float* out = direct ? logits : logits_.get();
  head(cfg_, weights_, batch, x, out, *scratch_, pool);
  const size_t V = size_t(cfg_.n_vocab);
  reduced_rows_.clear();
  for (size_t t = 0, r = 0; t < size_t(batch.size()); ++t) {
    const uint8_t mode = batch.logits[t];
    if (mode == kNoLogits) continue;
    if (mode == kArgmaxOnly || mode == kTopK) reduced_rows_.emplace_back(r, mode);
    ++r;
  }
  const cpu::RowFn reduce = [&](int i) {
    const auto [r, mode] = reduced_rows_[size_t(i)];
    reduce_output_row(mode, out + r * V, int(V));
  };
  cpu::run_rows(reduce, int(reduced_rows_.size()), pool);
  if (!direct && logits) std::memcpy(logits, logits_.get(), rows * V * sizeof(float));
}

uint64_t CpuStage::measured_bytes() const {
  return weight_bytes_ + kv_->bytes() + scratch_bytes_ + logits_size_ * sizeof(float);
}

// Bytes of what the stage bound: each distinct mapped tensor its views point into (unless it reads
// a packed copy instead), plus the norm weights and packed matrices it holds as its own copies.
// with_experts false: without a mixture's experts (--cpu-moe charges them apart from the stages).
uint64_t CpuStage::bound_bytes(const gguf::File& f, bool with_experts) const {
  std::unordered_map<const void*, uint64_t> size_of;
  for (const auto& t : f.tensors()) size_of[t.data] = t.nbytes;
  std::unordered_map<const void*, uint64_t> seen;
  auto add = [&](const void* ptr) {
    if (!ptr) return;
    auto it = size_of.find(ptr);
    if (it != size_of.end()) seen[ptr] = it->second;
  };
  const ModelWeights& w = weights_;
  auto add_matrix = [&](const cpu::QMatrix& m) {
    if (!m.packed) add(m.data);
  };
  if (plan_.has_embedding) add_matrix(w.tok_embd);
  if (plan_.has_output) { add_matrix(w.output); add(w.output_norm); }
  uint64_t packed_experts = 0;
  for (int l = begin_; l < end_; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    for (const cpu::QMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate, &L.up, &L.down, &L.router, &L.gate_sh, &L.up_sh,
                                  &L.down_sh, &L.gate_inp_sh})
      add_matrix(*m);
    for (const float* n : {L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm, L.post_attn_norm, L.post_ffn_norm,
                           L.bq, L.bk, L.bv}) add(n);
    // An expert's view points into its stacked tensor: the first one's is the tensor's start.
    for (const std::vector<cpu::QMatrix>* experts : {&L.gate_exp, &L.up_exp, &L.down_exp})
      for (const cpu::QMatrix& m : *experts) {
        if (with_experts) add_matrix(m);
        if (m.packed) packed_experts += cpu::packed_bytes(m.type, m.rows, m.cols);
      }
  }
  uint64_t total = 0;
  for (const auto& [ptr, n] : seen) total += n;
  for (const auto& v : w.owned) total += v.capacity() * sizeof(float);
  return total + w.packed_bytes + w.lora_bytes - (with_experts ? 0 : packed_experts);
}

}  // namespace baton
