// Pipeline::load for one CPU stage holding every layer: the file is mapped (and its pages touched
// while reporting progress), weights are views into the mapping, the KV cache has n_seq slots.
// decode() checks the whole batch first, then runs it in chunks of at most n_batch tokens.
#include "runtime/pipeline.h"

#include <algorithm>
#include <optional>
#include <thread>

#include "gguf/gguf.h"
#include "models/llama.h"
#include "runtime/config.h"
#include "runtime/kv_cache.h"
#include "runtime/tokenizer.h"

namespace baton {

namespace {

class CpuPipeline final : public Pipeline {
 public:
  CpuPipeline(const std::string& path, const LoadOptions& opt);

  const gguf::File& file() const override { return *file_; }
  const ModelConfig& config() const override { return cfg_; }
  const Tokenizer& tokenizer() const override {
    if (!tok_) fail(ErrorKind::Model, "{}: the file has no tokenizer (tokenizer.ggml.* keys)", file_->path());
    return *tok_;
  }
  int n_ctx() const override { return n_ctx_; }
  int n_seq() const override { return int(len_.size()); }
  int n_vocab() const override { return cfg_.n_vocab; }

  void decode(const Batch& batch, float* logits) override;
  void truncate_seq(int seq, int from) override;
  int seq_len(int seq) const override { check_seq(seq); return len_[size_t(seq)]; }

 private:
  void check_seq(int seq) const {
    if (seq < 0 || seq >= int(len_.size()))
      fail(ErrorKind::Usage, "sequence {} does not exist (n_seq = {})", seq, len_.size());
  }
  void touch_pages(const LoadOptions& opt) const;

  std::unique_ptr<gguf::File> file_;
  ModelConfig cfg_;
  std::optional<Tokenizer> tok_;
  int n_ctx_ = 0, n_batch_ = 0;
  ModelWeights weights_;
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<Scratch> scratch_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  std::vector<float> x_;      // hidden states of one chunk, n_batch × n_embd
  std::vector<int> len_;      // cached positions per sequence
  Batch chunk_;
};

CpuPipeline::CpuPipeline(const std::string& path, const LoadOptions& opt) {
  if (opt.n_ctx < 0) fail(ErrorKind::Usage, "context length {} must be >= 0", opt.n_ctx);
  if (opt.n_seq < 1) fail(ErrorKind::Usage, "number of sequences {} must be >= 1", opt.n_seq);
  if (opt.n_batch < 1) fail(ErrorKind::Usage, "batch size {} must be >= 1", opt.n_batch);
  if (opt.n_threads < 0) fail(ErrorKind::Usage, "thread count {} must be >= 0", opt.n_threads);
  if (!opt.devices.empty() && opt.devices != "cpu")
    fail(ErrorKind::Usage, "devices '{}': this build runs a single CPU stage (--devices cpu)", opt.devices);

  file_ = gguf::File::open(path);
  cfg_ = ModelConfig::from_gguf(*file_);
  check_kv_type(cfg_, opt.kv_type);
  if (file_->has("tokenizer.ggml.tokens")) tok_.emplace(Tokenizer::from_gguf(*file_));
  if (tok_ && tok_->n_vocab() != cfg_.n_vocab)
    fail(ErrorKind::Model, "{}: tokenizer has {} tokens but the model {}", path, tok_->n_vocab(), cfg_.n_vocab);

  n_ctx_ = opt.n_ctx > 0 ? opt.n_ctx : std::min(cfg_.n_ctx_train, 4096);
  n_batch_ = opt.n_batch;
  const int threads = opt.n_threads > 0 ? opt.n_threads : int(std::max(1u, std::thread::hardware_concurrency()));

  touch_pages(opt);
  weights_ = bind_weights(*file_, cfg_, 0, cfg_.n_layer, true, true);
  KvCacheShape ks;
  ks.layer_begin = 0;
  ks.layer_end = cfg_.n_layer;
  ks.n_seq = opt.n_seq;
  ks.n_ctx = n_ctx_;
  ks.type = opt.kv_type;
  kv_ = std::make_unique<KvCache>(cfg_, ks);
  scratch_ = std::make_unique<Scratch>(cfg_, n_batch_, opt.kv_type);
  pool_ = std::make_unique<cpu::ThreadPool>(threads);
  x_.resize(size_t(n_batch_) * size_t(cfg_.n_embd));
  len_.assign(size_t(opt.n_seq), 0);
}

// Reads one byte per page of tensor data so the first forward does not pay the page faults,
// reporting progress in bytes.
void CpuPipeline::touch_pages(const LoadOptions& opt) const {
  const uint64_t begin = file_->data_offset(), total = file_->file_size() - begin;
  const uint8_t* base = file_->base() + begin;
  const uint64_t step = 4096, report_every = uint64_t(32) << 20;
  volatile uint8_t sink = 0;
  uint64_t next_report = 0;
  for (uint64_t off = 0; off < total; off += step) {
    sink = sink + base[off];
    if (opt.progress && off >= next_report) {
      opt.progress(off, total);
      next_report = off + report_every;
    }
  }
  if (opt.progress) opt.progress(total, total);
}

void CpuPipeline::decode(const Batch& b, float* logits) {
  const int n = b.size();
  if (b.pos.size() != size_t(n) || b.seq.size() != size_t(n) || b.logits.size() != size_t(n))
    fail(ErrorKind::Usage, "batch arrays differ in length");
  // Check everything before touching any state: ids, sequences, and positions that continue each
  // sequence's cache and stay inside the context.
  std::vector<int> next(len_);
  for (int i = 0; i < n; ++i) {
    const int t = b.token[size_t(i)], s = b.seq[size_t(i)], p = b.pos[size_t(i)];
    if (t < 0 || t >= cfg_.n_vocab) fail(ErrorKind::Usage, "token id {} is outside the vocabulary (0..{})", t, cfg_.n_vocab - 1);
    check_seq(s);
    if (p != next[size_t(s)])
      fail(ErrorKind::Usage, "sequence {}: token at position {} does not continue the cache (expected position {})", s, p, next[size_t(s)]);
    if (p >= n_ctx_)
      fail(ErrorKind::Usage, "sequence {}: position {} is past the context length {}", s, p, n_ctx_);
    next[size_t(s)] = p + 1;
  }

  const size_t V = size_t(cfg_.n_vocab);
  for (int start = 0; start < n; start += n_batch_) {
    const int m = std::min(n_batch_, n - start);
    chunk_.clear();
    for (int i = start; i < start + m; ++i)
      chunk_.add(b.token[size_t(i)], b.pos[size_t(i)], b.seq[size_t(i)], b.logits[size_t(i)] != 0);
    embed(cfg_, weights_, chunk_, x_.data());
    forward_layers(cfg_, weights_, *kv_, chunk_, 0, cfg_.n_layer, x_.data(), *scratch_, *pool_);
    head(cfg_, weights_, chunk_, x_.data(), logits, *scratch_, *pool_);
    logits += size_t(chunk_.n_logits()) * V;
    for (int i = 0; i < m; ++i) len_[size_t(chunk_.seq[size_t(i)])] = chunk_.pos[size_t(i)] + 1;
  }
}

void CpuPipeline::truncate_seq(int seq, int from) {
  check_seq(seq);
  const int len = len_[size_t(seq)];
  if (from < 0 || from > len)
    fail(ErrorKind::Usage, "sequence {}: cannot truncate at {} (it holds {} positions)", seq, from, len);
  if (from > 0 && len - from > kv_->max_rewind())
    fail(ErrorKind::Usage, "sequence {}: sliding-window layers keep only their window; rewinding by {} "
         "positions is not possible (at most {}, or truncate to 0)", seq, len - from, kv_->max_rewind());
  len_[size_t(seq)] = from;
}

}  // namespace

std::unique_ptr<Pipeline> Pipeline::load(const std::string& path, const LoadOptions& opt) {
  return std::make_unique<CpuPipeline>(path, opt);
}

}  // namespace baton
