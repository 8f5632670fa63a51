// Pipeline::load places the model with the planner and builds one stage per planned block of
// layers. A stage owns its weights view, KV cache, scratch, hidden-state buffer and thread pool;
// consecutive stages are joined by a Link that moves hidden-state rows (a memcpy between CPU
// stages). decode() checks the whole batch, cuts it into micro-batches (whole sequences, at most
// n_batch tokens each) and, with several stages and micro-batches, runs them through the stages
// concurrently: a driver thread per stage, stage k on micro-batch m while stage k+1 is on m-1.
// Every token's math depends only on its own row and its own sequence's cache (attention is per
// sequence, activations are quantized per token row), so the split changes no bit of the logits.
#include "runtime/pipeline.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "gguf/gguf.h"
#include "models/llama.h"
#include "runtime/config.h"
#include "runtime/devices.h"
#include "runtime/kv_cache.h"
#include "runtime/planner.h"
#include "runtime/shape.h"
#include "runtime/tokenizer.h"

namespace baton {

namespace {

// Moves `rows` hidden-state rows from one stage's buffer to the next stage's. A CUDA link
// (peer-to-peer or host-staged) implements the same interface.
class Link {
 public:
  virtual ~Link() = default;
  virtual void send(const float* src, float* dst, size_t rows, size_t n_embd) = 0;
};

class CpuLink final : public Link {
 public:
  void send(const float* src, float* dst, size_t rows, size_t n_embd) override {
    std::memcpy(dst, src, rows * n_embd * sizeof(float));
  }
};

struct CpuStage {
  Stage plan;  // the planner's view: layer range, flags, planned bytes
  int begin = 0, end = 0;
  ModelWeights weights;
  std::unique_ptr<KvCache> kv;
  std::unique_ptr<Scratch> scratch;
  std::unique_ptr<cpu::ThreadPool> pool;
  std::vector<float> x;       // hidden states of the micro-batch in hand, n_batch × n_embd
  std::vector<float> logits;  // last stage: n_batch × n_vocab rows of the micro-batch in hand
  uint64_t weight_bytes = 0;  // bytes of the tensors this stage bound (measured, see below)
  uint64_t scratch_bytes = 0; // what Scratch allocated (its own sizing function)

  uint64_t measured_bytes() const {
    return weight_bytes + kv->bytes() + scratch_bytes +
           x.capacity() * sizeof(float) + logits.capacity() * sizeof(float);
  }
};

// A piece of the batch: whole sequences (or a run of one sequence's tokens when it is longer
// than n_batch), with the original index of each token.
struct MicroBatch {
  Batch batch;
  std::vector<int> index;
};

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
  std::vector<StageInfo> stages() const override {
    std::vector<StageInfo> out;
    for (const auto& s : stages_)
      out.push_back({s.plan.label, s.begin, s.end, s.pool->size(), s.plan.total_bytes() - s.plan.reserve_bytes,
                     s.measured_bytes()});
    return out;
  }

 private:
  void check_seq(int seq) const {
    if (seq < 0 || seq >= int(len_.size()))
      fail(ErrorKind::Usage, "sequence {} does not exist (n_seq = {})", seq, len_.size());
  }
  void touch_pages(const LoadOptions& opt) const;
  uint64_t bound_bytes(const ModelWeights& w, int begin, int end, bool with_embed, bool with_head) const;
  std::vector<MicroBatch> split(const Batch& b) const;
  // Stage k's work on one micro-batch, in its own buffer; the last stage also writes the
  // micro-batch's logits rows to their batch places.
  void run_stage(size_t k, const MicroBatch& mb, float* logits, const std::vector<int>& out_row);
  // Stage k hands the micro-batch's hidden states to stage k+1 through the link.
  void send(size_t k, const MicroBatch& mb) {
    links_[k]->send(stages_[k].x.data(), stages_[k + 1].x.data(), size_t(mb.batch.size()), size_t(cfg_.n_embd));
  }

  std::unique_ptr<gguf::File> file_;
  ModelConfig cfg_;
  std::optional<Tokenizer> tok_;
  int n_ctx_ = 0, n_batch_ = 0;
  std::vector<CpuStage> stages_;
  std::vector<std::unique_ptr<Link>> links_;  // links_[k]: stage k -> k+1
  std::vector<int> len_;                      // cached positions per sequence
};

CpuPipeline::CpuPipeline(const std::string& path, const LoadOptions& opt) {
  if (opt.n_ctx < 0) fail(ErrorKind::Usage, "context length {} must be >= 0", opt.n_ctx);
  if (opt.n_seq < 1) fail(ErrorKind::Usage, "number of sequences {} must be >= 1", opt.n_seq);
  if (opt.n_batch < 1) fail(ErrorKind::Usage, "batch size {} must be >= 1", opt.n_batch);
  if (opt.n_threads < 0) fail(ErrorKind::Usage, "thread count {} must be >= 0", opt.n_threads);
  if (opt.threads_per_stage < 0) fail(ErrorKind::Usage, "threads per stage {} must be >= 0", opt.threads_per_stage);

  // Devices first: a bad list is a usage error before anything is mapped.
  const auto devices = parse_devices(opt.devices.empty() ? "cpu" : opt.devices, probe_devices(),
                                     /*allow_hypothetical=*/false);
  for (const auto& d : devices)
    if (d.is_gpu())
      fail(ErrorKind::Usage, "device '{}': CUDA stages are not available in the pipeline of this version "
           "(use CPU devices, e.g. --devices cpu or cpu,cpu)", d.label);

  file_ = gguf::File::open(path);
  cfg_ = ModelConfig::from_gguf(*file_);
  check_kv_type(cfg_, opt.kv_type);
  if (file_->has("tokenizer.ggml.tokens")) tok_.emplace(Tokenizer::from_gguf(*file_));
  if (tok_ && tok_->n_vocab() != cfg_.n_vocab)
    fail(ErrorKind::Model, "{}: tokenizer has {} tokens but the model {}", path, tok_->n_vocab(), cfg_.n_vocab);

  n_ctx_ = opt.n_ctx > 0 ? opt.n_ctx : std::min(cfg_.n_ctx_train, 4096);
  n_batch_ = opt.n_batch;

  // Plan before allocating anything: a plan that does not fit is refused here.
  const ModelShape shape = shape_from_gguf(*file_);
  PlanOptions po;
  po.n_ctx = uint32_t(n_ctx_);
  po.n_parallel = uint32_t(opt.n_seq);
  po.n_batch = uint32_t(n_batch_);
  po.kv_type = opt.kv_type;
  // Several CPU entries are virtual stages of one memory: the user asked for a pipeline, so the
  // layers are cut evenly rather than filling the first entry.
  if (devices.size() > 1) po.tensor_split.assign(devices.size(), 1.0);
  const Plan p = plan(shape, devices, po);
  if (!p.fits) fail(ErrorKind::OutOfMemory, "{}: the model does not fit: {}", path, shortfall_message(p));
  BATON_CHECK(!p.stages.empty());
  // The planner may clamp n_batch (to n_ctx × n_seq); buffers follow the plan.
  n_batch_ = int(p.options.n_batch);

  const int n_stages = int(p.stages.size());
  const int total = opt.n_threads > 0 ? opt.n_threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const int per_stage = opt.threads_per_stage > 0 ? opt.threads_per_stage : std::max(1, total / n_stages);

  touch_pages(opt);
  stages_.resize(size_t(n_stages));
  for (size_t k = 0; k < stages_.size(); ++k) {
    CpuStage& s = stages_[k];
    s.plan = p.stages[k];
    s.begin = int(s.plan.layer_begin);
    s.end = int(s.plan.layer_end);
    s.weights = bind_weights(*file_, cfg_, s.begin, s.end, s.plan.has_embedding, s.plan.has_output);
    s.weight_bytes = bound_bytes(s.weights, s.begin, s.end, s.plan.has_embedding, s.plan.has_output);
    KvCacheShape ks;
    ks.layer_begin = s.begin;
    ks.layer_end = s.end;
    ks.n_seq = opt.n_seq;
    ks.n_ctx = n_ctx_;
    ks.type = opt.kv_type;
    s.kv = std::make_unique<KvCache>(cfg_, ks);
    s.scratch = std::make_unique<Scratch>(cfg_, n_batch_, opt.kv_type);
    s.scratch_bytes = Scratch::bytes(cfg_, n_batch_, opt.kv_type);
    s.pool = std::make_unique<cpu::ThreadPool>(per_stage);
    s.x.resize(size_t(n_batch_) * size_t(cfg_.n_embd));
    if (s.plan.has_output) s.logits.resize(size_t(n_batch_) * size_t(cfg_.n_vocab));
  }
  for (int k = 0; k + 1 < n_stages; ++k) links_.push_back(std::make_unique<CpuLink>());
  len_.assign(size_t(opt.n_seq), 0);

  if (opt.verbose) {
    std::fprintf(stderr, "%s", format_plan(p, shape).c_str());
    std::fprintf(stderr, "threads per stage: %d\n", per_stage);
    const auto info = stages();
    for (size_t k = 0; k < info.size(); ++k) {
      const StageInfo& s = info[k];
      std::fprintf(stderr, "stage %zu (%s, layers [%d, %d)): planned %s (%llu B), measured %s (%llu B)\n", k,
                   s.device.c_str(), s.layer_begin, s.layer_end, format_bytes(s.planned_bytes).c_str(),
                   (unsigned long long)s.planned_bytes, format_bytes(s.measured_bytes).c_str(),
                   (unsigned long long)s.measured_bytes);
    }
  }
}

// Bytes of what the stage bound: each distinct mapped tensor its views point into, plus the norm
// weights it holds as its own copies.
uint64_t CpuPipeline::bound_bytes(const ModelWeights& w, int begin, int end, bool with_embed, bool with_head) const {
  std::unordered_map<const void*, uint64_t> size_of;
  for (const auto& t : file_->tensors()) size_of[t.data] = t.nbytes;
  std::unordered_map<const void*, uint64_t> seen;
  auto add = [&](const void* ptr) {
    if (!ptr) return;
    auto it = size_of.find(ptr);
    if (it != size_of.end()) seen[ptr] = it->second;
  };
  if (with_embed) add(w.tok_embd.data);
  if (with_head) { add(w.output.data); add(w.output_norm); }
  for (int l = begin; l < end; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    for (const cpu::QMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate, &L.up, &L.down}) add(m->data);
    for (const float* n : {L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm, L.post_attn_norm, L.post_ffn_norm,
                           L.bq, L.bk, L.bv}) add(n);
  }
  uint64_t total = 0;
  for (const auto& [ptr, n] : seen) total += n;
  for (const auto& v : w.owned) total += v.capacity() * sizeof(float);
  return total;
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

// Groups whole sequences (in order of first appearance) into micro-batches. With one stage there
// is nothing to overlap, so micro-batches are only cut at n_batch tokens; with several stages the
// sequences are spread over up to 4 micro-batches per stage so every stage has work in flight.
std::vector<MicroBatch> CpuPipeline::split(const Batch& b) const {
  std::vector<int> order;                     // sequences by first appearance
  std::vector<std::vector<int>> tokens(len_.size());
  for (int i = 0; i < b.size(); ++i) {
    const int s = b.seq[size_t(i)];
    if (tokens[size_t(s)].empty()) order.push_back(s);
    tokens[size_t(s)].push_back(i);
  }
  const size_t n_groups = stages_.size() == 1 ? 1 : std::min(order.size(), stages_.size() * 4);
  const size_t per_group = (order.size() + n_groups - 1) / n_groups;

  std::vector<MicroBatch> out;
  auto fresh = [&] { out.emplace_back(); return &out.back(); };
  MicroBatch* cur = nullptr;
  for (size_t g = 0; g < order.size(); ++g) {
    if (g % per_group == 0 && (cur == nullptr || cur->batch.size() > 0)) cur = fresh();
    for (int i : tokens[size_t(order[g])]) {
      if (cur->batch.size() == n_batch_) cur = fresh();
      cur->batch.add(b.token[size_t(i)], b.pos[size_t(i)], b.seq[size_t(i)], b.logits[size_t(i)] != 0);
      cur->index.push_back(i);
    }
  }
  return out;
}

void CpuPipeline::run_stage(size_t k, const MicroBatch& mb, float* logits, const std::vector<int>& out_row) {
  CpuStage& s = stages_[k];
  const size_t rows = size_t(mb.batch.size()), V = size_t(cfg_.n_vocab);
  if (s.plan.has_embedding) embed(cfg_, s.weights, mb.batch, s.x.data());
  forward_layers(cfg_, s.weights, *s.kv, mb.batch, s.begin, s.end, s.x.data(), *s.scratch, *s.pool);
  if (k + 1 < stages_.size()) return;
  head(cfg_, s.weights, mb.batch, s.x.data(), s.logits.data(), *s.scratch, *s.pool);
  size_t r = 0;
  for (size_t j = 0; j < rows; ++j) {
    if (!mb.batch.logits[j]) continue;
    std::memcpy(logits + size_t(out_row[size_t(mb.index[j])]) * V, s.logits.data() + r * V, V * sizeof(float));
    ++r;
  }
}

void CpuPipeline::decode(const Batch& b, float* logits) {
  const int n = b.size();
  if (b.pos.size() != size_t(n) || b.seq.size() != size_t(n) || b.logits.size() != size_t(n))
    fail(ErrorKind::Usage, "batch arrays differ in length");
  // Check everything before touching any state: ids, sequences, and positions that continue each
  // sequence's cache and stay inside the context.
  std::vector<int> next(len_);
  std::vector<int> out_row(size_t(n), -1);
  int n_out = 0;
  for (int i = 0; i < n; ++i) {
    const int t = b.token[size_t(i)], s = b.seq[size_t(i)], p = b.pos[size_t(i)];
    if (t < 0 || t >= cfg_.n_vocab) fail(ErrorKind::Usage, "token id {} is outside the vocabulary (0..{})", t, cfg_.n_vocab - 1);
    check_seq(s);
    if (p != next[size_t(s)])
      fail(ErrorKind::Usage, "sequence {}: token at position {} does not continue the cache (expected position {})", s, p, next[size_t(s)]);
    if (p >= n_ctx_)
      fail(ErrorKind::Usage, "sequence {}: position {} is past the context length {}", s, p, n_ctx_);
    next[size_t(s)] = p + 1;
    if (b.logits[size_t(i)]) out_row[size_t(i)] = n_out++;
  }
  if (n == 0) return;

  const std::vector<MicroBatch> mbs = split(b);
  const size_t S = stages_.size(), M = mbs.size();
  if (S == 1 || M == 1) {
    for (const auto& mb : mbs)
      for (size_t k = 0; k < S; ++k) {
        run_stage(k, mb, logits, out_row);
        if (k + 1 < S) send(k, mb);
      }
  } else {
    // One driver thread per stage, each driving its own pool. Stage k starts micro-batch m once
    // stage k-1 has handed it over (done[k-1] > m); it computes in its own buffer, and sends to
    // stage k+1 only once that stage has finished m-1 (done[k+1] >= m), whose input it overwrites.
    std::mutex mu;
    std::condition_variable cv;
    std::vector<size_t> done(S, 0);
    bool failed = false;
    std::exception_ptr error;
    auto wait_for = [&](auto ready) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return failed || ready(); });
      return !failed;
    };
    auto drive = [&](size_t k) {
      for (size_t m = 0; m < M; ++m) {
        if (!wait_for([&] { return k == 0 || done[k - 1] > m; })) return;
        try {
          run_stage(k, mbs[m], logits, out_row);
          if (k + 1 < S) {
            if (!wait_for([&] { return done[k + 1] >= m; })) return;
            send(k, mbs[m]);
          }
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu);
          if (!failed) error = std::current_exception();
          failed = true;
          cv.notify_all();
          return;
        }
        std::lock_guard<std::mutex> lock(mu);
        done[k] = m + 1;
        cv.notify_all();
      }
    };
    std::vector<std::thread> drivers;
    for (size_t k = 1; k < S; ++k) drivers.emplace_back(drive, k);
    drive(0);
    for (auto& t : drivers) t.join();
    if (error) std::rethrow_exception(error);
  }
  for (int i = 0; i < n; ++i) len_[size_t(b.seq[size_t(i)])] = b.pos[size_t(i)] + 1;
}

void CpuPipeline::truncate_seq(int seq, int from) {
  check_seq(seq);
  const int len = len_[size_t(seq)];
  if (from < 0 || from > len)
    fail(ErrorKind::Usage, "sequence {}: cannot truncate at {} (it holds {} positions)", seq, from, len);
  const int max_rewind = stages_.front().kv->max_rewind();
  int rewind = max_rewind;
  for (const auto& s : stages_) rewind = std::min(rewind, s.kv->max_rewind());
  if (from > 0 && len - from > rewind)
    fail(ErrorKind::Usage, "sequence {}: sliding-window layers keep only their window; rewinding by {} "
         "positions is not possible (at most {}, or truncate to 0)", seq, len - from, rewind);
  len_[size_t(seq)] = from;
}

}  // namespace

std::unique_ptr<Pipeline> Pipeline::load(const std::string& path, const LoadOptions& opt) {
  return std::make_unique<CpuPipeline>(path, opt);
}

}  // namespace baton
