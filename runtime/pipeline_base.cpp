// ModelPipeline: opening the model and checking options and batches, the same for the in-process
// pipeline (pipeline.cpp) and the MPI one (distributed.cpp), so both report the same errors.
#include "runtime/pipeline_base.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "gguf/error.h"
#include "kernels/cpu/packed.h"
#include "runtime/kv_cache.h"

namespace baton {

bool stage_holds(const Stage& s, const std::string& name, bool tied_head) {
  if (name.rfind("blk.", 0) == 0) {
    const int64_t layer = block_index(name);  // -1 (malformed): no stage holds it
    return layer >= s.layer_begin && layer < s.layer_end;
  }
  if (name.rfind("token_embd.", 0) == 0) return s.has_embedding || (tied_head && s.has_output);
  if (name.rfind("output", 0) == 0) return s.has_output;
  return true;
}

bool copied_at_load(const gguf::TensorInfo& t, bool on_gpu, bool tied_head) {
  if (on_gpu) return true;
  if (t.n_dims < 2) return false;
  if (t.name == "token_embd.weight" && !tied_head) return true;
  return cpu::packing_enabled(t.type, t.ne[0]);
}

const Tokenizer& ModelPipeline::tokenizer() const {
  if (!tok_) fail(ErrorKind::Model, "{}: the file has no tokenizer (tokenizer.ggml.* keys)", file_->path());
  return *tok_;
}

void ModelPipeline::check_options(const LoadOptions& opt) {
  if (opt.n_ctx < 0) fail(ErrorKind::Usage, "context length {} must be >= 0", opt.n_ctx);
  if (opt.n_seq < 1) fail(ErrorKind::Usage, "number of sequences {} must be >= 1", opt.n_seq);
  if (opt.n_batch < 1) fail(ErrorKind::Usage, "batch size {} must be >= 1", opt.n_batch);
  if (opt.n_outputs < 0) fail(ErrorKind::Usage, "output rows per step {} must be >= 0", opt.n_outputs);
}

void ModelPipeline::open_model(const std::string& path, const LoadOptions& opt) {
  file_ = gguf::File::open(path);
  cfg_ = ModelConfig::from_gguf(*file_);
  check_kv_type(cfg_, opt.kv_type);
  if (file_->has("tokenizer.ggml.tokens")) tok_.emplace(Tokenizer::from_gguf(*file_));
  if (tok_ && tok_->n_vocab() != cfg_.n_vocab)
    fail(ErrorKind::Model, "{}: tokenizer has {} tokens but the model {}", path, tok_->n_vocab(), cfg_.n_vocab);
  if (!opt.lora.empty()) {
    lora_ = std::make_unique<LoraAdapters>(opt.lora, *file_, cfg_);
    for (const std::string& w : lora_->warnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
  }
  if (!opt.control_vectors.empty()) {
    control_ = std::make_unique<ControlVectors>(opt.control_vectors, cfg_, opt.control_first, opt.control_last);
    for (const std::string& w : control_->warnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
  } else if (opt.control_first >= 0 || opt.control_last >= 0) {
    fail(ErrorKind::Usage, "--control-vector-layer-range needs --control-vector");
  }
  n_ctx_ = opt.n_ctx > 0 ? opt.n_ctx : std::min(cfg_.n_ctx_train, 4096);
  cfg_.use_context(n_ctx_);
  len_.assign(size_t(opt.n_seq), 0);
}

PlanOptions ModelPipeline::plan_options(const LoadOptions& opt) const {
  PlanOptions po;
  po.n_ctx = uint32_t(n_ctx_);
  po.n_parallel = uint32_t(opt.n_seq);
  po.n_batch = uint32_t(opt.n_batch);
  po.n_outputs = uint32_t(opt.n_outputs);
  po.kv_type = opt.kv_type;
  // A CPU stage has at most all the threads (or --threads-per-stage): its attention buffers are per thread.
  const int total = opt.n_threads > 0 ? opt.n_threads : int(std::max(1u, std::thread::hardware_concurrency()));
  po.n_threads = uint32_t(std::max(total, opt.threads_per_stage));
  po.tensor_split = opt.tensor_split;
  po.reserve = opt.reserve;
  po.n_gpu_layers = opt.n_gpu_layers;
  po.no_cpu_spill = opt.no_cpu_spill;
  po.spread = opt.spread;
  po.cpu_moe = opt.cpu_moe;
  po.auto_devices = opt.devices == "auto";
  return po;
}

void ModelPipeline::check_seq(int seq) const {
  if (seq < 0 || seq >= int(len_.size()))
    fail(ErrorKind::Usage, "sequence {} does not exist (n_seq = {})", seq, len_.size());
}

std::vector<int> ModelPipeline::check_batch(const Batch& b) const {
  const int n = b.size();
  if (b.pos.size() != size_t(n) || b.seq.size() != size_t(n) || b.logits.size() != size_t(n))
    fail(ErrorKind::Usage, "batch arrays differ in length");
  std::vector<int> next(len_);
  if (!b.copies.empty() && copy_limit() == 0) fail(ErrorKind::Usage, "this pipeline does not copy sequences");
  for (const SeqCopy& c : b.copies) {
    check_seq(c.src);
    check_seq(c.dst);
    if (c.src == c.dst || c.n < 0 || c.n > next[size_t(c.src)])
      fail(ErrorKind::Usage, "copy of {} positions from sequence {} (holding {}) to sequence {} is not possible", c.n,
           c.src, next[size_t(c.src)], c.dst);
    if (next[size_t(c.src)] > copy_limit())
      fail(ErrorKind::Usage, "sequence {} holds {} positions, more than its sliding-window rings keep ({}): its start "
           "cannot be copied", c.src, next[size_t(c.src)], copy_limit());
    next[size_t(c.dst)] = c.n;
  }
  bool hidden = false, other = false;  // kHidden rows and rows of other output modes
  for (uint8_t mode : b.logits) hidden |= mode == kHidden, other |= mode != kHidden && mode != kNoLogits;
  if (hidden && other) fail(ErrorKind::Usage, "a batch's output rows are all hidden states (kHidden) or none of them");
  for (int i = 0; i < n; ++i) {
    const int t = b.token[size_t(i)], s = b.seq[size_t(i)], p = b.pos[size_t(i)];
    if (t < 0 || t >= cfg_.n_vocab) fail(ErrorKind::Usage, "token id {} is outside the vocabulary (0..{})", t, cfg_.n_vocab - 1);
    if (b.logits[size_t(i)] > kHidden) fail(ErrorKind::Usage, "output mode {} is not a LogitsMode", int(b.logits[size_t(i)]));
    if (b.logits[size_t(i)] == kHidden && cfg_.n_embd > cfg_.n_vocab)
      fail(ErrorKind::Usage, "hidden-state rows need n_embd ({}) <= n_vocab ({}): an output row holds n_vocab floats",
           cfg_.n_embd, cfg_.n_vocab);
    check_seq(s);
    if (p != next[size_t(s)])
      fail(ErrorKind::Usage, "sequence {}: token at position {} does not continue the cache (expected position {})", s, p, next[size_t(s)]);
    if (p >= n_ctx_)
      fail(ErrorKind::Usage, "sequence {}: position {} is past the context length {}", s, p, n_ctx_);
    next[size_t(s)] = p + 1;
  }
  return next;
}

}  // namespace baton
