// Pipeline::load places the model with the planner and builds one stage per planned block of
// layers: a CpuStage (runtime/stage.h) or a GpuStage (runtime/gpu_stage.h). Each stage has a driver
// thread, created at load and kept until the pipeline is destroyed, that takes pieces of work from
// its input queue, runs the stage on them (driving the stage's own thread pool, or its GPU stream)
// and hands them to the next stage's queue. A piece carries its own hidden-state buffer in host
// memory, so passing it on is the link between stages: no copy between CPU stages, and a stage
// never waits for the next one to free a buffer; a GPU stage copies the state in and out at its
// ends (the host-staged link).
// submit() checks a batch, cuts it into pieces of at most n_batch tokens and queues them at stage
// 0; several submitted batches flow through the stages together (stage 0 on batch B while stage 1
// finishes A). Every stage takes pieces in submission order, so the KV cache of each stage sees
// each sequence's tokens in order. Every token's math depends only on its own row and its own
// sequence's cache (attention is per sequence, activations are quantized per token row), so how
// a batch is cut or grouped changes no bit of the logits.
#include "runtime/pipeline.h"
#include "runtime/pipeline_base.h"
#include "runtime/gpu_stage.h"
#include "runtime/link.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fmt/ranges.h>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "gguf/gguf.h"
#include "kernels/cpu/threadpool.h"
#include "runtime/buffers.h"
#include "runtime/config.h"
#include "runtime/devices.h"
#include "runtime/planner.h"
#include "runtime/shape.h"
#include "runtime/stage.h"
#include "runtime/tokenizer.h"

namespace baton {

namespace {

// A run of at most n_batch tokens of one submitted batch, on its way through the stages.
struct Piece {
  uint64_t ticket = 0;
  Batch batch;
  float* logits = nullptr;  // where this piece's logits rows go (the caller's buffer)
  std::vector<float> x;     // hidden states, batch.size() × n_embd: what the host links move
  int slot = -1;            // between two GPU stages: the device link's slot holding the hidden states
};

struct TicketState {
  int pieces_left = 0;
  std::exception_ptr error;  // the first error raised by one of its pieces
};

class CpuPipeline final : public ModelPipeline {
 public:
  CpuPipeline(const std::string& path, const LoadOptions& opt);
  ~CpuPipeline() override;


  void decode(const Batch& batch, float* logits) override;
  uint64_t submit(const Batch& batch, float* logits) override;
  void wait(uint64_t ticket) override;
  int max_in_flight() const override { return int(stages_.size()); }
  void truncate_seq(int seq, int from) override;
  int max_rewind() const override {
    int rewind = std::numeric_limits<int>::max();
    for (const auto& s : stages_) rewind = std::min(rewind, s->max_rewind());
    return rewind;
  }
  int seq_len(int seq) const override { check_seq(seq); return len_[size_t(seq)]; }
  int copy_limit() const override {
    int limit = std::numeric_limits<int>::max();
    for (const auto& s : stages_) limit = std::min(limit, s->copy_limit());
    return limit;
  }
  std::vector<StageInfo> stages() const override {
    std::vector<StageInfo> out;
    for (const auto& s : stages_) {
      const size_t k = out.size();
      // A peer-to-peer link's slots live on the receiving stage's GPU: counted there, as planned.
      const uint64_t link_in = k > 0 && links_[k - 1] ? links_[k - 1]->device_bytes() : 0;
      out.push_back({s->plan().label, s->layer_begin(), s->layer_end(), s->n_threads(),
                     s->plan().total_bytes() - s->plan().reserve_bytes, s->measured_bytes() + link_in,
                     double(busy_ns_[k].load(std::memory_order_relaxed)) * 1e-9,
                     k + 1 == stages_.size() ? "" : links_[k] ? links_[k]->describe() : "host memory", s->notes()});
    }
    return out;
  }

 private:
  void stop_drivers();  // wakes the stage drivers to return, and joins them
  void touch_pages(const LoadOptions& opt, const Plan& p, uint64_t bar_total) const;  // reports bytes read of bar_total
  void drive(size_t k);  // stage k's driver thread
  void connect_gpu_stages(const Plan& p, P2pMode mode);
  void run_stage(size_t k, Piece& piece);  // forward, timed
  void drop(size_t k, Piece& piece);       // a piece that goes no further gives back its link slot
  std::vector<std::unique_ptr<Piece>> prepare(const Batch& b, float* logits);

  int n_batch_ = 0, n_outputs_ = 0;
  std::vector<std::unique_ptr<ModelStage>> stages_;
  std::vector<std::unique_ptr<GpuLink>> links_;  // links_[k]: stage k -> k + 1 (nullptr: host memory)
  std::unique_ptr<std::atomic<uint64_t>[]> busy_ns_;  // per stage: nanoseconds in forward
  std::function<void(int, const Batch&)> on_stage_;

  // Between the caller and the drivers: one lock for the queues and the ticket table (a few
  // operations per piece; the work in between is a whole stage's forward).
  std::mutex mu_;
  std::condition_variable work_;  // a queue got a piece, or stop
  std::condition_variable done_;  // a ticket finished
  std::vector<std::deque<std::unique_ptr<Piece>>> queue_;  // queue_[k]: input of stage k
  std::unordered_map<uint64_t, TicketState> tickets_;
  uint64_t next_ticket_ = 0;
  bool stop_ = false;
  std::vector<std::thread> drivers_;
};

CpuPipeline::CpuPipeline(const std::string& path, const LoadOptions& opt) {
  check_options(opt);
  const P2pMode p2p = p2p_from_env(parse_p2p(opt.p2p));
  if (opt.n_threads < 0) fail(ErrorKind::Usage, "thread count {} must be >= 0", opt.n_threads);
  if (opt.threads_per_stage < 0) fail(ErrorKind::Usage, "threads per stage {} must be >= 0", opt.threads_per_stage);

  // Devices first: a bad list is a usage error before anything is mapped.
  const auto devices = parse_devices(opt.devices.empty() ? "cpu" : opt.devices, probe_devices(),
                                     /*allow_hypothetical=*/false);
  for (const auto& d : devices)
    if (d.is_gpu() && !have_cuda_backend() && !cuda_emulated())
      fail(ErrorKind::Usage, "device '{}': this build of baton has no CUDA backend (rebuild with -DBATON_CUDA=ON, "
           "or use CPU devices, e.g. --devices cpu)", d.label);

  open_model(path, opt);
  n_batch_ = opt.n_batch;

  // Plan before allocating anything: a plan that does not fit is refused here.
  ModelShape shape = shape_from_gguf(*file_);
  if (lora_) lora_->add_to(shape);  // the adapters' bytes where the tensors they adapt go
  // Several CPU entries are virtual stages of one memory: the user asked for a pipeline, so the
  // layers are cut for equal work per stage (the output head counts) rather than filling the
  // first entry; the slowest stage sets the pace of a pipeline.
  // When an entry cannot hold its share (a GPU with a small budget), the entries fill in order.
  const Plan p = plan_pipeline(shape, devices, plan_options(opt));
  if (!p.fits) fail(ErrorKind::OutOfMemory, "{}: the model does not fit: {}", path, shortfall_message(p));
  BATON_CHECK(!p.stages.empty());
  // The planner may clamp n_batch (to n_ctx × n_seq); buffers follow the plan.
  n_batch_ = int(p.options.n_batch);
  n_outputs_ = int(p.options.n_outputs);

  int n_cpu_stages = 0;  // the CPU threads are shared by the CPU stages; a GPU stage drives its stream
  for (const Stage& st : p.stages) n_cpu_stages += !p.devices[st.device].is_gpu();
  const int total = opt.n_threads > 0 ? opt.n_threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const int per_stage = opt.threads_per_stage > 0 ? opt.threads_per_stage : std::max(1, total / std::max(1, n_cpu_stages));

  // Progress in one bar: the file's pages read, then the GPU stages' weights uploaded.
  uint64_t gpu_bytes = 0;
  for (const Stage& st : p.stages) gpu_bytes += p.devices[st.device].is_gpu() ? st.weight_bytes() : 0;
  const uint64_t file_bytes = file_->file_size() - file_->data_offset(), all_bytes = file_bytes + gpu_bytes;
  touch_pages(opt, p, all_bytes);
  uint64_t uploaded = 0;  // by the GPU stages before this one
  StageOptions so;
  so.n_seq = opt.n_seq;
  so.n_ctx = n_ctx_;
  so.n_batch = n_batch_;
  so.n_outputs = n_outputs_;
  so.kv_type = opt.kv_type;
  so.n_threads = per_stage;
  so.cuda_graphs = opt.cuda_graphs;
  so.cpu_moe = p.options.cpu_moe;  // (the planner keeps it for mixtures only)
  so.lora = lora_.get();
  so.control = control_.get();
  try {
    for (const Stage& st : p.stages) {
      const DeviceSpec& d = p.devices[st.device];
      if (d.is_gpu()) {
        std::function<void(uint64_t)> progress;
        if (opt.progress)
          progress = [&](uint64_t done) { opt.progress(std::min(all_bytes, file_bytes + uploaded + done), all_bytes); };
        stages_.push_back(std::make_unique<GpuStage>(*file_, cfg_, st, so, d.index, progress));
        uploaded += st.weight_bytes();
      } else {
        stages_.push_back(std::make_unique<CpuStage>(*file_, cfg_, st, so));
      }
    }
  } catch (const cpu::ThreadStartError& e) {
    // A stage's pool counts its own threads: say what the user asked for (--threads is shared).
    if (opt.threads_per_stage > 0)
      fail(ErrorKind::Usage, "cannot start {} CPU threads per stage: {} (use fewer --threads-per-stage)", per_stage,
           e.reason);
    if (n_cpu_stages > 1)
      fail(ErrorKind::Usage, "cannot start {} CPU threads ({} per stage): {} (use fewer --threads)", total, per_stage,
           e.reason);
    throw;
  }
  connect_gpu_stages(p, p2p);
  if (opt.progress && gpu_bytes) opt.progress(all_bytes, all_bytes);
  on_stage_ = opt.on_stage;
  busy_ns_ = std::make_unique<std::atomic<uint64_t>[]>(stages_.size());

  if (!opt.verbose) {
    for (const auto& w : p.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
    // Several sequences at once (batch, bench --parallel) is where idle GPUs would add throughput.
    if (opt.n_seq > 1 && !p.idle_gpus.empty())
      fmt::print(stderr, "note: {} left idle (the GPUs before hold the model): --spread or --devices cuda:0,cuda:1,... "
                 "pipelines the batch over every GPU\n", fmt::join(p.idle_gpus, ", "));
  }
  if (opt.verbose) {
    std::fprintf(stderr, "%s", format_plan(p, shape).c_str());
    std::fprintf(stderr, "config: %s\n", cfg_.summary().c_str());  // what the file's keys were read as
    std::fprintf(stderr, "threads per stage: %d\n", per_stage);
    const auto info = stages();
    for (size_t k = 0; k < info.size(); ++k) {
      const StageInfo& s = info[k];
      std::fprintf(stderr, "stage %zu (%s, layers [%d, %d)): planned %s (%llu B), measured %s (%llu B)\n", k,
                   s.device.c_str(), s.layer_begin, s.layer_end, format_bytes(s.planned_bytes).c_str(),
                   (unsigned long long)s.planned_bytes, format_bytes(s.measured_bytes).c_str(),
                   (unsigned long long)s.measured_bytes);
      for (const std::string& note : s.notes) fmt::print(stderr, "stage {}: {}\n", k, note);
      if (links_[k]) std::fprintf(stderr, "link %zu -> %zu: %s (self-test passed)\n", k, k + 1, s.link.c_str());
    }
  }

  queue_.resize(stages_.size());
  try {
    for (size_t k = 0; k < stages_.size(); ++k) drivers_.emplace_back([this, k] { drive(k); });
  } catch (const std::system_error& e) {
    // A constructor that throws runs no destructor: the drivers already started are stopped here,
    // or destroying their joinable threads would end the program.
    stop_drivers();
    fail(ErrorKind::Usage, "cannot start the pipeline's {} stage threads: {} (use fewer --threads)", stages_.size(),
         e.code().message());
  }
}

void CpuPipeline::stop_drivers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (auto& t : drivers_) t.join();
}

CpuPipeline::~CpuPipeline() { stop_drivers(); }

// Reads one byte per page of tensor data so the first forward does not pay the page faults,
// reporting progress in bytes (of bar_total: the file, plus what GPU stages upload afterwards).
void CpuPipeline::touch_pages(const LoadOptions& opt, const Plan& p, uint64_t bar_total) const {
  // Read into the page cache tensor by tensor; the mapping of each tensor a stage copies (packed or
  // uploaded) is given back once read, so the file is not resident beside the copies while the
  // stages are built. What a stage reads later from the mapping maps again from the cache.
  const bool tied = file_->tensor("output.weight") == nullptr;
  const uint64_t total = file_->file_size() - file_->data_offset(), report_every = uint64_t(32) << 20;
  volatile uint8_t sink = 0;
  uint64_t done = 0, next_report = 0;
  for (const auto& t : file_->tensors()) {
    if (!t.data) continue;
    for (uint64_t off = 0; off < t.nbytes; off += 4096) sink = sink + t.data[off];
    bool on_gpu = false;
    for (const Stage& st : p.stages) on_gpu |= p.devices[st.device].is_gpu() && stage_holds(st, t.name, tied);
    if (copied_at_load(t, on_gpu, tied)) file_->release(t.data, t.nbytes);
    done += t.nbytes;
    if (opt.progress && done >= next_report) {
      opt.progress(std::min(done, total), bar_total);
      next_report = done + report_every;
    }
  }
  if (opt.progress) opt.progress(total, bar_total);
}

// Consecutive GPU stages hand over on the device (peer-to-peer) or through pinned host memory
// (runtime/link.h); each link checks itself before anything flows. Everything else (CPU stages,
// GPU <-> CPU spill) goes through the pieces' host buffers.
void CpuPipeline::connect_gpu_stages(const Plan& p, P2pMode mode) {
  links_.resize(stages_.size());
  const size_t slot_bytes = size_t(n_batch_) * size_t(cfg_.n_embd) * sizeof(float);
  for (size_t k = 0; k + 1 < stages_.size(); ++k) {
    const DeviceSpec& a = p.devices[p.stages[k].device];
    const DeviceSpec& b = p.devices[p.stages[k + 1].device];
    if (!a.is_gpu() || !b.is_gpu()) continue;
    auto& from = static_cast<GpuStage&>(*stages_[k]);
    auto& to = static_cast<GpuStage&>(*stages_[k + 1]);
    links_[k] = std::make_unique<GpuLink>(choose_link(mode, a.index, b.index), from.context(), to.context(), slot_bytes,
                                          kGpuLinkSlots);
    links_[k]->self_test();
  }
  for (size_t k = 0; k < stages_.size(); ++k) {
    GpuLink* in = k > 0 ? links_[k - 1].get() : nullptr;
    GpuLink* out = links_[k].get();
    if (in || out) static_cast<GpuStage&>(*stages_[k]).connect(in, out);
  }
}

void CpuPipeline::run_stage(size_t k, Piece& piece) {
  const auto t0 = std::chrono::steady_clock::now();
  Handoff h;
  h.in_slot = piece.slot;
  piece.slot = -1;  // forward gives it back, whatever happens
  stages_[k]->forward(piece.batch, piece.x.data(), piece.logits, h);
  piece.slot = h.out_slot;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  busy_ns_[k].fetch_add(uint64_t(ns), std::memory_order_relaxed);
}

// piece is at stage k's door (its slot, if any, belongs to link k - 1) or just came out of stage k
// (link k): whichever link holds its slot gets it back.
void CpuPipeline::drop(size_t k, Piece& piece) {
  if (piece.slot < 0) return;
  links_[k]->release(piece.slot);
  piece.slot = -1;
}

// Stage k's driver: take the oldest piece, run the stage on it, pass it on. A piece of a ticket
// that already failed is passed on without work, so the ticket still completes.
void CpuPipeline::drive(size_t k) {
  const bool last = k + 1 == stages_.size();
  for (;;) {
    std::unique_ptr<Piece> piece;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return stop_ || !queue_[k].empty(); });
      if (stop_) return;
      piece = std::move(queue_[k].front());
      queue_[k].pop_front();
      skip = tickets_.at(piece->ticket).error != nullptr;
    }
    std::exception_ptr error;
    if (skip) {
      if (piece->slot >= 0) drop(k - 1, *piece);
    } else {
      try {
        if (on_stage_) on_stage_(int(k), piece->batch);
        run_stage(k, *piece);
      } catch (...) {
        error = std::current_exception();
        if (piece->slot >= 0) drop(k - 1, *piece);  // on_stage threw before the stage took it
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_[k].empty() && stages_.size() > 1) stages_[k]->rest();  // idle until the next piece
    TicketState& t = tickets_.at(piece->ticket);
    if (error && !t.error) t.error = error;
    if (!last && !t.error) {
      queue_[k + 1].push_back(std::move(piece));
      work_.notify_all();
    } else {
      if (piece->slot >= 0) drop(k, *piece);  // its ticket failed meanwhile: the output goes nowhere
      if (--t.pieces_left == 0) done_.notify_all();
    }
  }
}

// Checks a batch and cuts it into pieces; only then are the sequences' positions advanced.
std::vector<std::unique_ptr<Piece>> CpuPipeline::prepare(const Batch& b, float* logits) {
  const int n = b.size();
  len_ = check_batch(b);

  // Pieces of at most n_batch tokens and n_outputs output rows in batch order; each sequence's
  // tokens stay in order.
  std::vector<std::unique_ptr<Piece>> pieces;
  size_t out_rows = 0;
  int rows = 0;  // of the piece being filled
  for (int i = 0; i < n; ++i) {
    const uint8_t mode = b.logits[size_t(i)];
    if (pieces.empty() || pieces.back()->batch.size() == n_batch_ || (mode != kNoLogits && rows == n_outputs_)) {
      auto piece = std::make_unique<Piece>();
      if (pieces.empty()) piece->batch.copies = b.copies;  // before any token, at every stage
      piece->logits = logits + out_rows * size_t(cfg_.n_vocab);
      pieces.push_back(std::move(piece));
      rows = 0;
    }
    pieces.back()->batch.add(b.token[size_t(i)], b.pos[size_t(i)], b.seq[size_t(i)], mode);
    rows += mode != kNoLogits;
    out_rows += mode != kNoLogits;
  }
  for (auto& piece : pieces) piece->x.resize(size_t(piece->batch.size()) * size_t(cfg_.n_embd));
  return pieces;
}

uint64_t CpuPipeline::submit(const Batch& b, float* logits) {
  auto pieces = prepare(b, logits);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t ticket = ++next_ticket_;
  tickets_[ticket].pieces_left = int(pieces.size());
  for (auto& piece : pieces) {
    piece->ticket = ticket;
    queue_[0].push_back(std::move(piece));
  }
  if (!pieces.empty()) work_.notify_all();
  return ticket;
}

void CpuPipeline::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) fail(ErrorKind::Usage, "ticket {} is not in flight (never submitted or already waited)", ticket);
  done_.wait(lock, [&] { return it->second.pieces_left == 0; });
  const std::exception_ptr error = it->second.error;
  tickets_.erase(it);
  if (error) std::rethrow_exception(error);
}

// One batch, waited for. With several stages the batch's sequences are spread over one group per
// stage (in order of first appearance), submitted together so the stages overlap; their logits
// rows are then put back in batch order.
void CpuPipeline::decode(const Batch& b, float* logits) {
  const size_t S = stages_.size();
  std::vector<int> order;  // sequences by first appearance
  std::vector<int> group_of(len_.size(), -1);
  for (int i = 0; i < b.size(); ++i) {
    const int s = b.seq[size_t(i)];
    if (s >= 0 && s < int(len_.size()) && group_of[size_t(s)] < 0) {
      group_of[size_t(s)] = 0;
      order.push_back(s);
    }
  }
  const size_t n_groups = std::min(S, order.size());
  if (n_groups <= 1) {
    bool idle = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle = tickets_.empty();
    }
    if (!idle) return wait(submit(b, logits));
    // Nothing in flight, so every driver is waiting on an empty queue: run the stages on this
    // thread and spare the hand-offs (one stream decoding token by token pays them per token).
    // CPU stages of the same width run on the first one's pool: its workers are spinning for the
    // next job, where another stage's would have to be woken (and share the cores meanwhile).
    cpu::ThreadPool* shared = nullptr;
    for (const auto& st : stages_) {
      cpu::ThreadPool* p = st->pool();
      if (!p) continue;
      if (!shared) shared = p;
      else if (p->size() == shared->size()) st->borrow_pool(shared);
    }
    struct GiveBack {
      const std::vector<std::unique_ptr<ModelStage>>& stages;
      ~GiveBack() {
        for (const auto& st : stages) st->borrow_pool(nullptr);
      }
    } give_back{stages_};
    for (const auto& piece : prepare(b, logits)) {
      size_t k = 0;
      try {
        for (; k < S; ++k) {
          if (on_stage_) on_stage_(int(k), piece->batch);
          run_stage(k, *piece);
        }
      } catch (...) {
        // run_stage leaves no slot taken when it throws; the hook may throw with the piece's
        // input in link k - 1.
        if (piece->slot >= 0) drop(k - 1, *piece);
        throw;
      }
    }
    return;
  }

  // Check the whole batch first (submit of the groups would leave earlier groups submitted).
  check_batch(b);
  const size_t per_group = (order.size() + n_groups - 1) / n_groups;
  for (size_t g = 0; g < order.size(); ++g) group_of[size_t(order[g])] = int(g / per_group);
  const size_t V = size_t(cfg_.n_vocab);
  std::vector<Batch> groups(n_groups);
  groups[0].copies = b.copies;  // submitted first: every stage copies before any group's tokens
  std::vector<std::vector<size_t>> rows_of(n_groups);  // each group's logits rows in batch order
  size_t row = 0;
  for (int i = 0; i < b.size(); ++i) {
    const size_t g = size_t(group_of[size_t(b.seq[size_t(i)])]);
    groups[g].add(b.token[size_t(i)], b.pos[size_t(i)], b.seq[size_t(i)], b.logits[size_t(i)]);
    if (b.logits[size_t(i)]) rows_of[g].push_back(row++);
  }
  std::vector<std::vector<float>> out(n_groups);
  std::vector<uint64_t> tickets;
  for (size_t g = 0; g < n_groups; ++g) {
    out[g].resize(rows_of[g].size() * V);
    tickets.push_back(submit(groups[g], out[g].data()));
  }
  std::exception_ptr error;
  for (uint64_t t : tickets) {
    try {
      wait(t);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  for (size_t g = 0; g < n_groups; ++g)
    for (size_t r = 0, t = 0; r < rows_of[g].size(); ++t) {
      const uint8_t mode = groups[g].logits[t];
      if (mode == kNoLogits) continue;
      // What the row holds (a hidden state: n_embd floats of the n_vocab the slot spans).
      const size_t words = mode == kHidden ? size_t(cfg_.n_embd) : V;
      std::memcpy(logits + rows_of[g][r] * V, out[g].data() + r * V, words * sizeof(float));
      ++r;
    }
}

void CpuPipeline::truncate_seq(int seq, int from) {
  check_seq(seq);
  const int len = len_[size_t(seq)];
  if (from < 0 || from > len)
    fail(ErrorKind::Usage, "sequence {}: cannot truncate at {} (it holds {} positions)", seq, from, len);
  const int rewind = max_rewind();
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
