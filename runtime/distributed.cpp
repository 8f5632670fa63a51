// The distributed pipeline (runtime/distributed.h): setup messages, the worker's service loop and
// the rank-0 Pipeline. Stage k runs on rank k; a micro-batch travels as one kWork message per
// boundary (its tokens, positions, sequences, logits flags and hidden-state rows) and comes back
// to rank 0 as one kLogits message. Every token's math depends only on its own row and its own
// sequence's cache, so where the layers run changes no bit of the logits.
#include "runtime/distributed.h"

#include "gguf/error.h"

#if BATON_HAVE_MPI

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "gguf/gguf.h"
#include "runtime/config.h"
#include "runtime/devices.h"
#include "runtime/gpu_stage.h"
#include "runtime/kv_cache.h"
#include "runtime/link.h"
#include "runtime/model_files.h"
#include "runtime/mpi_comm.h"
#include "runtime/pipeline_base.h"
#include "runtime/shape.h"
#include "runtime/stage.h"
#include "runtime/tokenizer.h"

#include "kernels/cuda/nccl.h"  // no CUDA types: the id is used by the emulation's pairs too

namespace baton {

using mpi::Comm;
using mpi::Message;
using mpi::Reader;
using mpi::Writer;

namespace {

constexpr uint32_t kProtocol = 4;  // bump when a message layout changes

// ---- setup: what each rank tells rank 0 ----

struct RankInfo {
  int rank = 0;
  std::string host;
  int pid = 0;
  std::string path;            // the model as resolved on that rank ("" when planning a shape)
  uint64_t file_size = 0;
  uint64_t header_hash = 0;    // FNV-1a of bytes [0, data offset): metadata and tensor infos
  std::vector<DeviceSpec> devices;
  bool channel = false;        // a GPU rank that can join a device channel (runtime/link.h)
  std::string error;           // the rank could not open its file or parse its devices
};

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

void put_device(Writer& w, const DeviceSpec& d) {
  w.put(int32_t(d.kind)).put(int32_t(d.index)).put(uint8_t(d.present)).put_str(d.label).put(d.budget)
      .put(d.runtime_reserve).put(uint8_t(d.budget_given)).put(d.total_bytes).put(d.free_bytes);
}

DeviceSpec get_device(Reader& r) {
  DeviceSpec d;
  d.kind = DeviceKind(r.get<int32_t>());
  d.index = r.get<int32_t>();
  d.present = r.get<uint8_t>() != 0;
  d.label = r.get_str();
  d.budget = r.get<uint64_t>();
  d.runtime_reserve = r.get<uint64_t>();
  d.budget_given = r.get<uint8_t>() != 0;
  d.total_bytes = r.get<uint64_t>();
  d.free_bytes = r.get<uint64_t>();
  return d;
}

// Device channels between GPU ranks (runtime/link.h): NCCL where this build has it, the host
// emulation's over MPI where GPUs are emulated. BATON_NCCL=0 turns them off; GPU ranks then hand
// over through host memory, as CPU ranks do.
bool device_channels_possible() {
  if (const char* e = std::getenv("BATON_NCCL"); e && std::string(e) == "0") return false;
#if BATON_HAVE_CUDA
  return cuda::nccl_available();
#else
  return cuda_emulated();
#endif
}

// `--devices auto` on a rank: one device, as each rank serves one stage. The GPU of the rank's
// local rank (ranks on one host take its GPUs in turn), or the CPU where there is none.
std::string rank_auto_devices(const std::vector<ProbedDevice>& probed) {
  std::vector<int> gpus;
  for (const auto& p : probed)
    if (p.kind == DeviceKind::Cuda) gpus.push_back(p.index);
  if (gpus.empty()) return "cpu";
  int local = 0;
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* s = std::getenv(v)) {
      local = std::max(0, std::atoi(s));
      break;
    }
  return fmt::format("cuda:{}", gpus[size_t(local) % gpus.size()]);
}

// This rank's facts; errors are kept in the record so rank 0 can report them by rank.
RankInfo local_info(const std::string& model, const std::string& devices, bool allow_hypothetical) {
  Comm& c = *Comm::get();
  RankInfo info;
  info.rank = c.rank();
  info.host = c.host();
  info.pid = int(getpid());
  try {
    const auto probed = probe_devices();
    const std::string spec = devices.empty() ? "cpu" : devices == "auto" ? rank_auto_devices(probed) : devices;
    info.devices = parse_devices(spec, probed, allow_hypothetical);
    info.channel = info.devices.size() == 1 && info.devices[0].is_gpu() && device_channels_possible();
    if (!model.empty()) {
      info.path = resolve_model(model);
      auto f = gguf::File::open(info.path);
      info.file_size = f->file_size();
      info.header_hash = fnv1a(f->base(), size_t(f->data_offset()));
    }
  } catch (const std::exception& e) {
    info.error = e.what();
  }
  return info;
}

std::vector<uint8_t> hello_bytes(const RankInfo& i) {
  Writer w;
  w.put(kProtocol).put(int32_t(i.pid)).put_str(i.host).put_str(i.path).put(i.file_size).put(i.header_hash)
      .put_str(i.error).put(uint8_t(i.channel)).put(uint32_t(i.devices.size()));
  for (const auto& d : i.devices) put_device(w, d);
  return std::move(w.bytes);
}

RankInfo parse_hello(const Message& m) {
  Reader r(m.bytes, m.source);
  if (r.get<uint32_t>() != kProtocol)
    fail(ErrorKind::Usage, "rank {} runs a baton with a different distributed protocol: use the same build on every rank",
         m.source);
  RankInfo i;
  i.rank = m.source;
  i.pid = r.get<int32_t>();
  i.host = r.get_str();
  i.path = r.get_str();
  i.file_size = r.get<uint64_t>();
  i.header_hash = r.get<uint64_t>();
  i.error = r.get_str();
  i.channel = r.get<uint8_t>() != 0;
  const uint32_t n = r.get<uint32_t>();
  for (uint32_t k = 0; k < n; ++k) i.devices.push_back(get_device(r));
  return i;
}

std::string where(const RankInfo& i) { return fmt::format("rank {} ({}, pid {})", i.rank, i.host, i.pid); }

// Text of a kError message.
[[noreturn]] void throw_remote(const Message& m) {
  Reader r(m.bytes, m.source);
  const int kind = r.get<int32_t>();
  const std::string text = r.get_str();
  throw Error(ErrorKind(kind), fmt::format("rank {}: {}", m.source, text));
}

std::vector<uint8_t> error_bytes(ErrorKind kind, const std::string& text) {
  Writer w;
  w.put(int32_t(kind)).put_str(text);
  return std::move(w.bytes);
}

// Rank 0: everyone's facts, rank order. The workers send theirs first thing; anything else before
// that is a protocol error.
std::vector<RankInfo> gather(const RankInfo& mine) {
  Comm& c = *Comm::get();
  std::vector<RankInfo> all(size_t(c.size()));
  all[0] = mine;
  for (int got = 1; got < c.size();) {
    Message m = c.recv();
    if (m.tag == mpi::kError) throw_remote(m);
    if (m.tag != mpi::kHello) fail(ErrorKind::Model, "rank {} sent message {} before its hello", m.source, m.tag);
    all[size_t(m.source)] = parse_hello(m);
    ++got;
  }
  for (const auto& i : all)
    if (!i.error.empty()) fail(ErrorKind::Usage, "{}: {}", where(i), i.error);
  return all;
}

// Same file on every rank: size and header hash (metadata and tensor table) must agree.
void check_files(const std::vector<RankInfo>& all) {
  const RankInfo& a = all[0];
  for (const auto& b : all) {
    if (b.file_size == a.file_size && b.header_hash == a.header_hash) continue;
    fail(ErrorKind::Model, "{} has a different model file than rank 0: {} ({} bytes, header hash {:016x}) vs {} "
         "({} bytes, header hash {:016x}); every rank needs its own copy of the same file",
         where(b), b.path, b.file_size, b.header_hash, a.path, a.file_size, a.header_hash);
  }
}

// Every rank's devices in rank order, labelled with the rank; stage k must land on rank k.
Plan plan_ranks(const ModelShape& shape, const std::vector<RankInfo>& all, PlanOptions po) {
  std::vector<DeviceSpec> devices;
  for (const auto& i : all) {
    if (i.devices.size() != 1)
      fail(ErrorKind::Usage, "{} lists {} devices; with --distributed each rank serves one stage: give one device "
           "per rank (e.g. --devices cpu or --devices cuda:0) and launch one rank per device", where(i),
           i.devices.size());
    DeviceSpec d = i.devices[0];
    d.label = fmt::format("rank{}:{}", i.rank, d.label);
    devices.push_back(d);
  }
  // The user asked for a pipeline over all ranks: the layers are cut for equal work per rank (the
  // output head counts), not packed onto the first rank that could hold them all (the same rule
  // as repeated CPU entries in one process; filled in order when a rank cannot hold its share).
  // Every rank shares the work, GPU ranks and CPU ranks alike: each rank serves one stage.
  return plan_pipeline(shape, devices, po, /*every_entry_shares=*/true);
}

// ---- device channels: the hidden state between two GPU ranks, device to device ----

// NCCL's unique id, made by the sending rank (the emulation's pairs need none).
cuda::NcclId new_channel_id() {
#if BATON_HAVE_CUDA
  return cuda::nccl_unique_id();
#else
  return {};
#endif
}

std::vector<uint8_t> id_bytes(const cuda::NcclId& id) { return {std::begin(id.bytes), std::end(id.bytes)}; }

std::string channel_name(int from, int to) {
#if BATON_HAVE_CUDA
  const int v = cuda::nccl_version();
  return fmt::format("rank {} -> rank {}: NCCL {}.{}.{}, device to device", from, to, v / 10000, v / 100 % 100, v % 100);
#else
  return fmt::format("rank {} -> rank {}: NCCL emulated on the host (MPI bulk lane)", from, to);
#endif
}

// A device channel as this rank holds it: joining starts when it is made (so a rank starts both
// of its pairs before waiting for either) and ends in join().
class RankChannel : public DeviceChannel {
 public:
  // Waits for the other end; poll() runs meanwhile and throws to give up. warm_bytes: the
  // largest piece the channel will carry.
  virtual void join(const std::function<void()>& poll, size_t warm_bytes) = 0;
  // Receives a piece and drops it (a rank that failed still takes what its predecessor sends).
  virtual void discard(size_t bytes) = 0;
  uint64_t pieces_in = 0;  // pieces received or discarded so far
};

#if BATON_HAVE_CUDA
class NcclChannel final : public RankChannel {
 public:
  NcclChannel(GpuStage& s, const cuda::NcclId& id, bool sender)
      : pair_(s.context(), id, sender ? 0 : 1, [] { Comm::get()->check_alive(); }) {}
  void join(const std::function<void()>& poll, size_t warm_bytes) override {
    pair_.join(poll, std::max(60.0, Comm::get()->timeout_s()), warm_bytes);
  }
  void send(const void* src, size_t bytes) override { pair_.send(src, bytes); }
  void recv(void* dst, size_t bytes) override {
    pair_.recv(dst, bytes);
    ++pieces_in;
  }
  void discard(size_t bytes) override {
    pair_.discard(bytes);
    ++pieces_in;
  }

 private:
  cuda::NcclPair pair_;
};
#else
// The host emulation, whose device memory is host memory: the bytes go over MPI's bulk lane,
// apart from the work messages, as NCCL's own connections carry them. Joining sends a byte to the
// other end and waits for its byte, as ncclCommInitRank waits for both members.
class EmulatedChannel final : public RankChannel {
 public:
  EmulatedChannel(Comm& c, int from, bool sender) : c_(c), peer_(sender ? from + 1 : from) {
    c_.send_bulk(peer_, {uint8_t(1)});
  }
  void join(const std::function<void()>& poll, size_t) override {
    uint8_t b = 0;
    c_.recv_bulk_into(peer_, &b, 1, [&] {
      poll();
      return false;
    });
  }
  void send(const void* src, size_t bytes) override {
    const auto* p = static_cast<const uint8_t*>(src);
    c_.send_bulk(peer_, std::vector<uint8_t>(p, p + bytes));
  }
  void recv(void* dst, size_t bytes) override {
    c_.recv_bulk_into(peer_, dst, bytes);
    ++pieces_in;
  }
  void discard(size_t bytes) override {
    std::vector<uint8_t> sink(bytes);
    recv(sink.data(), bytes);
  }

 private:
  Comm& c_;
  int peer_;
};
#endif

// Starts joining the channel between ranks `from` and `from + 1` on this rank's GPU stage (the
// sender is `from`).
std::unique_ptr<RankChannel> start_channel(ModelStage& s, const cuda::NcclId& id, int from, bool sender) {
  auto* g = dynamic_cast<GpuStage*>(&s);
  BATON_CHECK(g != nullptr);
#if BATON_HAVE_CUDA
  (void)from;
  return std::make_unique<NcclChannel>(*g, id, sender);
#else
  (void)id;
  return std::make_unique<EmulatedChannel>(*Comm::get(), from, sender);
#endif
}

// ---- one stage, as a rank holds it ----

// The stage (runtime/stage.h) and the hidden states of the micro-batch in hand. The last rank's
// logits rows go straight into the outgoing message.
struct LocalStage {
  std::unique_ptr<ModelStage> s;  // a CpuStage, or a GpuStage
  // A GPU stage's device channels to its neighbour ranks (nullptr: the hidden state crosses host
  // memory in the work messages). Declared after s: they go first.
  std::unique_ptr<RankChannel> in, out;
  std::vector<float> x;
  std::atomic<uint64_t> busy_ns{0};  // time in forward since load

  uint64_t measured_bytes() const { return s->measured_bytes() + x.capacity() * sizeof(float); }
};

// Waits for the stage's channels (both were started) and connects them to its GPU stage.
void join_channels(LocalStage& s, const std::function<void()>& poll) {
  const size_t piece = s.x.size() * sizeof(float);  // n_batch hidden states
  if (s.in) s.in->join(poll, piece);
  if (s.out) s.out->join(poll, piece);
  if (auto* g = dynamic_cast<GpuStage*>(s.s.get())) g->connect_channels(s.in.get(), s.out.get());
}

struct StageSetup {
  int n_ctx = 0, n_seq = 1, n_batch = 1, n_outputs = 1;
  GgmlType kv_type = GgmlType::F16;
  Stage stage;
  bool chan_in = false, chan_out = false;  // device channels from the previous / to the next rank
};


// Reads one byte per page of the stage's tensors, and only those: the rest of the file is never
// paged in on this rank. The mapping of a tensor the stage copies is given back once read, as the
// in-process pipeline does (CpuPipeline::touch_pages): its packed or uploaded copy is what stays.
void touch_stage(const gguf::File& f, const Stage& s, bool on_gpu,
                 const std::function<void(uint64_t, uint64_t)>& progress) {
  const bool tied = f.tensor("output.weight") == nullptr;
  uint64_t total = 0, done = 0;
  for (const auto& t : f.tensors())
    if (stage_holds(s, t.name, tied)) total += t.nbytes;
  volatile uint8_t sink = 0;
  for (const auto& t : f.tensors()) {
    if (!stage_holds(s, t.name, tied) || !t.data) continue;
    for (uint64_t off = 0; off < t.nbytes; off += 4096) sink = sink + t.data[off];
    if (copied_at_load(t, on_gpu, tied)) f.release(t.data, t.nbytes);
    done += t.nbytes;
    if (progress) progress(done, total);
  }
}

std::unique_ptr<LocalStage> load_stage(const gguf::File& f, const ModelConfig& cfg, const StageSetup& su,
                                       const DeviceSpec& device, int threads,
                                       const std::function<void(uint64_t, uint64_t)>& progress) {
  touch_stage(f, su.stage, device.is_gpu(), progress);
  StageOptions so;
  so.n_seq = su.n_seq;
  so.n_ctx = su.n_ctx;
  so.n_batch = su.n_batch;
  so.n_outputs = su.n_outputs;
  so.kv_type = su.kv_type;
  so.n_threads = threads;
  auto s = std::make_unique<LocalStage>();
  if (device.is_gpu()) s->s = std::make_unique<GpuStage>(f, cfg, su.stage, so, device.index);
  else s->s = std::make_unique<CpuStage>(f, cfg, su.stage, so);
  s->x.resize(size_t(su.n_batch) * size_t(cfg.n_embd));
  return s;
}

// The stage's work on the hidden states in s.x (the embedding first when it holds it); the last
// stage writes batch.n_logits() rows to `logits`.
// Returns the nanoseconds it took.
uint64_t run_stage(LocalStage& s, const Batch& b, float* logits) {
  const auto t0 = std::chrono::steady_clock::now();
  s.s->forward(b, s.x.data(), logits);
  const auto ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  s.busy_ns += ns;
  return ns;
}

int stage_threads(int n_threads, int threads_per_stage) {
  if (threads_per_stage > 0) return threads_per_stage;
  if (n_threads > 0) return n_threads;
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

void put_stage(Writer& w, const StageSetup& su) {
  const Stage& s = su.stage;
  w.put(int32_t(su.n_ctx)).put(int32_t(su.n_seq)).put(int32_t(su.n_batch)).put(int32_t(su.n_outputs)).put(int32_t(su.kv_type))
      .put(s.layer_begin).put(s.layer_end).put(uint8_t(s.has_embedding)).put(uint8_t(s.has_output))
      .put_str(s.label).put(s.total_bytes() - s.reserve_bytes).put(uint8_t(su.chan_in)).put(uint8_t(su.chan_out));
}

StageSetup get_stage(Reader& r, uint64_t* planned) {
  StageSetup su;
  su.n_ctx = r.get<int32_t>();
  su.n_seq = r.get<int32_t>();
  su.n_batch = r.get<int32_t>();
  su.n_outputs = r.get<int32_t>();
  su.kv_type = GgmlType(r.get<int32_t>());
  su.stage.layer_begin = r.get<uint32_t>();
  su.stage.layer_end = r.get<uint32_t>();
  su.stage.has_embedding = r.get<uint8_t>() != 0;
  su.stage.has_output = r.get<uint8_t>() != 0;
  su.stage.label = r.get_str();
  *planned = r.get<uint64_t>();
  su.chan_in = r.get<uint8_t>() != 0;
  su.chan_out = r.get<uint8_t>() != 0;
  return su;
}

// A micro-batch on the wire: id, batch arrays, its hidden-state rows (none when they travel over
// a device channel), then per rank it went through: its busy time so far (cumulative ns, for
// `baton bench`'s balance line) and its compute of this micro-batch (ns; rank 0's entry is 0, for
// link_stats()).
void put_work(Writer& w, uint64_t id, const Batch& b, const LocalStage& s, size_t n_embd,
              const std::vector<uint64_t>& busy, const std::vector<uint64_t>& step) {
  const size_t rows = s.out ? 0 : size_t(b.size());
  w.put(id).put_vec(b.token).put_vec(b.pos).put_vec(b.seq).put_vec(b.logits).put_raw(s.x.data(), rows * n_embd)
      .put_vec(busy).put_vec(step);
}

// The 4-byte words of a micro-batch's output: output_words(mode) per token (runtime/batch.h).
size_t output_words(const Batch& b, size_t n_vocab, size_t n_embd) {
  size_t words = 0;
  for (uint8_t mode : b.logits) words += baton::output_words(mode, n_vocab, n_embd);
  return words;
}

// ---- the worker ----

// Tests: BATON_TEST_FAIL_WORK=RANK:N makes worker RANK fail on its N-th work message, as a stage
// error mid-run would (0: never).
int fault_injection(int rank) {
  const char* e = std::getenv("BATON_TEST_FAIL_WORK");
  int r = -1, n = 0;
  if (!e || std::sscanf(e, "%d:%d", &r, &n) != 2 || r != rank) return 0;
  return n;
}

struct Worker {
  Comm& c;
  WorkerArgs args;
  std::unique_ptr<gguf::File> file;
  ModelConfig cfg;
  std::unique_ptr<LocalStage> stage;
  std::vector<float> out;  // the last stage's rows when some are sent as argmax ids only
  bool broken = false;  // an error was reported; only a shutdown is expected now
  std::vector<DeviceSpec> devices;  // this rank's, as probed for its hello
  StageSetup setup;                 // this rank's stage, from rank 0's plan
  bool link_asked = false;          // kLink came: every stage is loaded
  bool linked = false;              // kLinked sent
  int work_done = 0;                // kWork messages taken
  int fail_at_work = fault_injection(c.rank());

  void report(const std::exception& e) {
    const auto* be = dynamic_cast<const Error*>(&e);
    c.send(0, mpi::kError, error_bytes(be ? be->kind() : ErrorKind::Model, e.what()));
    broken = true;
  }

  void on_plan(const Message& m) {
    Reader r(m.bytes, m.source);
    uint64_t planned = 0;
    const StageSetup su = setup = get_stage(r, &planned);
    file = gguf::File::open(resolve_model(args.model));
    cfg = ModelConfig::from_gguf(*file);
    cfg.use_context(su.n_ctx);
    // This rank's own device, as its hello reported it (probed once).
    if (devices.size() != 1) fail(ErrorKind::Usage, "this rank lists {} devices; give one per rank", devices.size());
    stage = load_stage(*file, cfg, su, devices[0], stage_threads(args.n_threads, args.threads_per_stage), {});
    Writer w;
    w.put(stage->measured_bytes()).put(int32_t(stage->s->max_rewind())).put(int32_t(stage->s->n_threads()));
    c.send(0, mpi::kReady, std::move(w.bytes));
  }

  // Device channels: once told every stage is loaded (kLink), the sender of a pair makes its id,
  // sends it over and starts joining; the receiver starts when the id comes (kLinkId). With all of
  // its channels started a rank waits for them (its pairs come up together) and reports kLinked.
  void on_link() {
    link_asked = true;
    if (setup.chan_out) {
      const cuda::NcclId id = new_channel_id();
      c.send(c.rank() + 1, mpi::kLinkId, id_bytes(id));
      stage->out = start_channel(*stage->s, id, c.rank(), /*sender=*/true);
    }
    maybe_linked();
  }
  void on_link_id(const Message& m) {
    cuda::NcclId id;
    if (!setup.chan_in || stage->in || m.source != c.rank() - 1 || m.bytes.size() != sizeof(id.bytes))
      fail(ErrorKind::Model, "unexpected channel id from rank {}", m.source);
    std::memcpy(id.bytes, m.bytes.data(), sizeof(id.bytes));
    stage->in = start_channel(*stage->s, id, m.source, /*sender=*/false);
    maybe_linked();
  }
  void maybe_linked() {
    if (linked || !link_asked || (setup.chan_in && !stage->in) || (setup.chan_out && !stage->out)) return;
    join_channels(*stage, [this] {
      c.check_alive();
      if (c.pending(0, mpi::kShutdown) >= 0) fail(ErrorKind::Model, "the job ended while this rank joined its device channels");
    });
    linked = true;
    c.send(0, mpi::kLinked, {});
  }
  // A rank that failed still takes the rows its predecessor sends over a device channel, so that
  // the sender is not left waiting for them: those of every later work message, and those of the
  // one it failed on unless its stage had received them (pieces_in before that message).
  void drain(const Message& m, uint64_t pieces_before = ~uint64_t(0)) {
    if (m.tag != mpi::kWork || !stage || !stage->in || !linked) return;
    if (pieces_before != ~uint64_t(0) && stage->in->pieces_in != pieces_before) return;
    try {
      Reader r(m.bytes, m.source);
      r.get<uint64_t>();
      const size_t n = r.get_vec<int32_t>().size();
      stage->in->discard(n * size_t(cfg.n_embd) * sizeof(float));
    } catch (const std::exception&) {
    }
  }

  void on_work(const Message& m) {
    if (!stage) fail(ErrorKind::Model, "work arrived before this rank was given a stage");
    if ((setup.chan_in || setup.chan_out) && !linked) fail(ErrorKind::Model, "work arrived before the device channels were joined");
    if (++work_done == fail_at_work) fail(ErrorKind::Model, "fault injected at work message {} (BATON_TEST_FAIL_WORK)", work_done);
    Reader r(m.bytes, m.source);
    const uint64_t id = r.get<uint64_t>();
    Batch b;
    b.token = r.get_vec<int32_t>();
    b.pos = r.get_vec<int32_t>();
    b.seq = r.get_vec<int32_t>();
    b.logits = r.get_vec<uint8_t>();
    const size_t n = size_t(b.size()), E = size_t(cfg.n_embd);
    BATON_CHECK(b.pos.size() == n && b.seq.size() == n && b.logits.size() == n);
    BATON_CHECK(n <= stage->x.size() / E);
    const size_t rows = stage->in ? 0 : n;  // over a device channel the rows come separately
    const float* x = r.get_view<float>(rows * E);
    if (rows) std::memcpy(stage->x.data(), x, rows * E * sizeof(float));
    std::vector<uint64_t> busy = r.get_vec<uint64_t>(), step = r.get_vec<uint64_t>();
    Writer w;
    if (stage->s->last()) {
      // kLogits: id, the word count, busy, step; then kLogitsRows: the output rows in batch order,
      // n_vocab floats for a kLogitsRow token, one 4-byte word (the token id) for a kArgmaxOnly
      // one, 2K for a kTopK one, n_embd for a kHidden one. Rank 0 receives the rows straight into
      // its logits buffer.
      const size_t V = size_t(cfg.n_vocab), rows = size_t(b.n_logits());
      const size_t words = output_words(b, V, E);
      std::vector<uint8_t> bytes(words * sizeof(float));
      float* dst = reinterpret_cast<float*>(bytes.data());
      uint64_t ns = 0;
      if (words == rows * V) {
        ns = run_stage(*stage, b, dst);  // full rows only: straight into the message
      } else {
        out.resize(rows * V);
        ns = run_stage(*stage, b, out.data());
        size_t r = 0;
        for (uint8_t mode : b.logits) {
          if (mode == kNoLogits) continue;
          const size_t len = baton::output_words(mode, V, E);
          std::memcpy(dst, out.data() + r++ * V, len * sizeof(float));
          dst += len;
        }
      }
      busy.push_back(stage->busy_ns.load());
      step.push_back(ns);
      w.put(id).put(uint64_t(words)).put_vec(busy).put_vec(step);
      c.send(0, mpi::kLogits, std::move(w.bytes));
      if (words) c.send(0, mpi::kLogitsRows, std::move(bytes));
    } else {
      step.push_back(run_stage(*stage, b, nullptr));
      busy.push_back(stage->busy_ns.load());
      put_work(w, id, b, *stage, E, busy, step);
      c.send(c.rank() + 1, mpi::kWork, std::move(w.bytes));
    }
  }

  int serve() {
    const RankInfo me = local_info(args.model, args.devices, /*allow_hypothetical=*/true);
    devices = me.devices;
    c.send(0, mpi::kHello, hello_bytes(me));
    for (;;) {
      Message m = c.recv();
      if (m.tag == mpi::kShutdown) {
        // After a failure rank 0 no longer receives: results still in flight stay undelivered
        // (finalize frees them) instead of being waited for.
        if (m.bytes.empty() || m.bytes[0] == 0) c.flush();
        c.finalize();
        return 0;
      }
      if (broken) {
        drain(m);
        continue;
      }
      const uint64_t pieces_before = stage && stage->in ? stage->in->pieces_in : 0;
      try {
        if (m.tag == mpi::kPlan) on_plan(m);
        else if (m.tag == mpi::kWork) on_work(m);
        else if (m.tag == mpi::kLink) on_link();
        else if (m.tag == mpi::kLinkId) on_link_id(m);
        else fail(ErrorKind::Model, "unexpected message {} from rank {}", m.tag, m.source);
      } catch (const std::exception& e) {
        report(e);
        drain(m, pieces_before);
      }
    }
  }
};

// ---- rank 0 ----

struct MicroBatch {
  Batch batch;
  std::vector<int> index;  // each token's place in the submitted batch
};

// Whole sequences in order of first appearance, cut into up to `groups` micro-batches of at most
// n_batch tokens and n_outputs output rows (a sequence with more is cut into runs).
std::vector<MicroBatch> split(const Batch& b, size_t groups, int n_batch, int n_outputs, int n_seq) {
  std::vector<int> order;
  std::vector<std::vector<int>> tokens(static_cast<size_t>(n_seq));
  for (int i = 0; i < b.size(); ++i) {
    const int s = b.seq[size_t(i)];
    if (tokens[size_t(s)].empty()) order.push_back(s);
    tokens[size_t(s)].push_back(i);
  }
  const size_t n_groups = std::max<size_t>(1, std::min(order.size(), groups));
  const size_t per_group = (order.size() + n_groups - 1) / n_groups;
  std::vector<MicroBatch> out;
  MicroBatch* cur = nullptr;
  int rows = 0;  // of the current micro-batch
  auto fresh = [&] { out.emplace_back(); rows = 0; return &out.back(); };
  for (size_t g = 0; g < order.size(); ++g) {
    if (g % per_group == 0 && (cur == nullptr || cur->batch.size() > 0)) cur = fresh();
    for (int i : tokens[size_t(order[g])]) {
      const uint8_t mode = b.logits[size_t(i)];
      if (cur->batch.size() == n_batch || (mode != kNoLogits && rows == n_outputs)) cur = fresh();
      cur->batch.add(b.token[size_t(i)], b.pos[size_t(i)], b.seq[size_t(i)], mode);
      cur->index.push_back(i);
      rows += mode != kNoLogits;
    }
  }
  return out;
}

bool g_shutdown_sent = false;

class DistributedPipeline final : public ModelPipeline {
 public:
  DistributedPipeline(const std::string& path, const LoadOptions& opt);
  ~DistributedPipeline() override;


  void decode(const Batch& b, float* logits) override { wait(start(b, logits, 2 * size_t(c_.size()))); }
  uint64_t submit(const Batch& b, float* logits) override { return start(b, logits, 1); }
  void wait(uint64_t ticket) override;
  int max_in_flight() const override { return c_.size(); }
  void truncate_seq(int seq, int from) override;
  int max_rewind() const override { return max_rewind_; }
  int seq_len(int seq) const override { check_seq(seq); return len_[size_t(seq)]; }
  LinkStats link_stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return links_;
  }
  std::vector<StageInfo> stages() const override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<StageInfo> v = infos_;
    if (stage_ && !v.empty()) v[0].busy_s = double(stage_->busy_ns.load()) * 1e-9;
    return v;
  }

 private:
  struct Job {
    std::vector<MicroBatch> mbs;
    float* logits = nullptr;
    std::vector<int> out_row;
    size_t left = 0;  // micro-batches whose logits have not come back
    std::exception_ptr error;
    std::vector<std::chrono::steady_clock::time_point> sent;  // when rank 0 handed each one on
  };

  void check_alive() const {
    if (broken_) fail(ErrorKind::Model, "the distributed pipeline stopped after an earlier error: {}", broken_what_);
  }
  uint64_t start(const Batch& b, float* logits, size_t groups);
  void link_channels(const std::vector<bool>& chan);
  void stage_loop();
  void take(const Message& m);  // a kLogits (then its kLogitsRows) or kError message

  Comm& c_;
  int n_batch_ = 0, n_outputs_ = 0, max_rewind_ = 0;
  std::unique_ptr<LocalStage> stage_;
  std::vector<StageInfo> infos_;
  LinkStats links_;
  std::vector<float> rows_;  // output words that cannot go straight to their rows

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, size_t>> queue_;  // (ticket, micro-batch) for stage 0
  std::map<uint64_t, Job> jobs_;
  uint64_t next_ticket_ = 0;
  bool stopping_ = false;
  bool stage_busy_ = false;  // rank 0's stage is computing a micro-batch
  bool broken_ = false;
  std::string broken_what_;
  std::thread stage_thread_;
};

DistributedPipeline::DistributedPipeline(const std::string& path, const LoadOptions& opt) : c_(*Comm::get()) {
  check_options(opt);
  if (opt.cpu_moe) fail(ErrorKind::Usage, "--cpu-moe is not supported with --distributed yet");
  if (!opt.lora.empty()) fail(ErrorKind::Usage, "LoRA adapters are not supported with --distributed yet");
  if (!opt.control_vectors.empty()) fail(ErrorKind::Usage, "control vectors are not supported with --distributed yet");

  const std::vector<RankInfo> all = gather(local_info(path, opt.devices, /*allow_hypothetical=*/false));
  check_files(all);
  for (const auto& i : all)
    if (i.devices[0].is_gpu() && !have_cuda_backend() && !cuda_emulated())
      fail(ErrorKind::Usage, "{}: device '{}': this build of baton has no CUDA backend (use --devices cpu)", where(i),
           i.devices[0].label);

  open_model(path, opt);

  const ModelShape shape = shape_from_gguf(*file_);
  const Plan p = plan_ranks(shape, all, plan_options(opt));
  if (opt.verbose) std::fprintf(stderr, "%s", format_plan(p, shape).c_str());
  else
    for (const auto& w : p.warnings) std::fprintf(stderr, "warning: %s\n", w.c_str());
  if (!p.fits) fail(ErrorKind::OutOfMemory, "{}: the model does not fit: {}", path, shortfall_message(p));
  if (p.stages.size() != all.size())
    fail(ErrorKind::Usage, "{} ranks but the model's {} layers make only {} stages: launch at most {} ranks",
         all.size(), cfg_.n_layer, p.stages.size(), p.stages.size());
  for (size_t k = 0; k < p.stages.size(); ++k) BATON_CHECK(p.stages[k].device == k);
  n_batch_ = int(p.options.n_batch);
  n_outputs_ = int(p.options.n_outputs);

  // A device channel across each boundary between two GPU ranks that can join one (NCCL).
  const size_t R = all.size();
  std::vector<bool> chan(R, false);  // chan[k]: rank k -> k + 1
  for (size_t k = 0; k + 1 < R; ++k) chan[k] = all[k].channel && all[k + 1].channel;
  auto setup_of = [&](size_t r) {
    return StageSetup{n_ctx_, opt.n_seq, n_batch_, n_outputs_, opt.kv_type, p.stages[r], r > 0 && chan[r - 1], chan[r]};
  };

  // Workers load while rank 0 loads its own stage.
  for (int r = 1; r < c_.size(); ++r) {
    Writer w;
    put_stage(w, setup_of(size_t(r)));
    c_.send(r, mpi::kPlan, std::move(w.bytes));
  }
  StageSetup mine = setup_of(0);
  stage_ = load_stage(*file_, cfg_, mine, all[0].devices[0], stage_threads(opt.n_threads, opt.threads_per_stage),
                      opt.progress);
  max_rewind_ = stage_->s->max_rewind();
  infos_.resize(all.size());
  infos_[0] = {p.stages[0].label, stage_->s->layer_begin(), stage_->s->layer_end(), stage_->s->n_threads(),
               p.stages[0].total_bytes() - p.stages[0].reserve_bytes, stage_->measured_bytes()};
  for (int got = 1; got < c_.size();) {
    Message m = c_.recv();
    if (m.tag == mpi::kError) throw_remote(m);
    if (m.tag != mpi::kReady) fail(ErrorKind::Model, "rank {} sent message {} while loading", m.source, m.tag);
    Reader r(m.bytes, m.source);
    const Stage& s = p.stages[size_t(m.source)];
    StageInfo& info = infos_[size_t(m.source)];
    info.device = s.label;
    info.layer_begin = int(s.layer_begin);
    info.layer_end = int(s.layer_end);
    info.planned_bytes = s.total_bytes() - s.reserve_bytes;
    info.measured_bytes = r.get<uint64_t>();
    max_rewind_ = std::min(max_rewind_, int(r.get<int32_t>()));
    info.n_threads = r.get<int32_t>();
    ++got;
  }
  link_channels(chan);
  if (opt.verbose)
    for (size_t k = 0; k + 1 < R; ++k)
      std::fprintf(stderr, "%s\n", chan[k] ? channel_name(int(k), int(k) + 1).c_str()
                                           : fmt::format("rank {} -> rank {}: host memory over MPI", k, k + 1).c_str());
  if (opt.verbose)
    for (size_t k = 0; k < infos_.size(); ++k) {
      const StageInfo& s = infos_[k];
      std::fprintf(stderr, "stage %zu (%s, layers [%d, %d), %d threads): planned %s (%llu B), measured %s (%llu B)\n", k,
                   s.device.c_str(), s.layer_begin, s.layer_end, s.n_threads, format_bytes(s.planned_bytes).c_str(),
                   (unsigned long long)s.planned_bytes, format_bytes(s.measured_bytes).c_str(),
                   (unsigned long long)s.measured_bytes);
    }
  stage_thread_ = std::thread([this] { stage_loop(); });
}

DistributedPipeline::~DistributedPipeline() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (stage_thread_.joinable()) stage_thread_.join();
  try {
    distributed_shutdown(broken_);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
}

// Once every stage is loaded: the workers with device channels join them (runtime/link.h), rank 0
// its own if it has one, and each worker reports when its channels are up.
void DistributedPipeline::link_channels(const std::vector<bool>& chan) {
  std::vector<int> waiting;
  for (int r = 1; r < c_.size(); ++r)
    if (chan[size_t(r) - 1] || chan[size_t(r)]) {
      c_.send(r, mpi::kLink, {});
      waiting.push_back(r);
    }
  if (chan[0]) {
    const cuda::NcclId id = new_channel_id();
    c_.send(1, mpi::kLinkId, id_bytes(id));
    stage_->out = start_channel(*stage_->s, id, 0, /*sender=*/true);
    // While rank 1 is awaited, a worker that failed to join reports here.
    join_channels(*stage_, [this] {
      c_.check_alive();
      const int src = c_.pending(-1, mpi::kError);
      if (src >= 0) throw_remote(*c_.recv_until({}, src, mpi::kError));
    });
  }
  for (size_t got = 0; got < waiting.size(); ++got) {
    Message m = c_.recv();
    if (m.tag == mpi::kError) throw_remote(m);
    if (m.tag != mpi::kLinked)
      fail(ErrorKind::Model, "rank {} sent message {} while joining its device channels", m.source, m.tag);
  }
}

uint64_t DistributedPipeline::start(const Batch& b, float* logits, size_t groups) {
  check_alive();
  const int n = b.size();
  len_ = check_batch(b);
  Job job;
  job.out_row.assign(size_t(n), -1);
  int n_out = 0;
  for (int i = 0; i < n; ++i)
    if (b.logits[size_t(i)]) job.out_row[size_t(i)] = n_out++;
  job.logits = logits;
  job.mbs = split(b, groups, n_batch_, n_outputs_, int(len_.size()));
  if (n == 0) job.mbs.clear();
  job.left = job.mbs.size();
  job.sent.resize(job.mbs.size());
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t ticket = ++next_ticket_;
  const size_t count = job.mbs.size();
  jobs_.emplace(ticket, std::move(job));
  for (size_t m = 0; m < count; ++m) queue_.push_back({ticket, m});
  cv_.notify_all();
  return ticket;
}

// Stage 0 on rank 0: micro-batches in submission order, each handed to rank 1 once computed.
void DistributedPipeline::stage_loop() {
  const size_t E = size_t(cfg_.n_embd);
  for (;;) {
    std::pair<uint64_t, size_t> item;
    const MicroBatch* mb = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      item = queue_.front();
      queue_.pop_front();
      mb = &jobs_.at(item.first).mbs[item.second];  // std::map nodes do not move
      stage_busy_ = true;
    }
    const uint64_t id = (item.first << 20) | item.second;
    try {
      run_stage(*stage_, mb->batch, nullptr);  // rank 0 is never the last stage
      Writer w;
      put_work(w, id, mb->batch, *stage_, E, {stage_->busy_ns.load()}, {0});
      c_.send(1, mpi::kWork, std::move(w.bytes));
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.at(item.first).sent[item.second] = std::chrono::steady_clock::now();
      stage_busy_ = false;
      cv_.notify_all();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      stage_busy_ = false;
      Job& j = jobs_.at(item.first);
      if (!j.error) j.error = std::current_exception();
      j.left = 0;  // its other micro-batches may never come back; the pipeline is broken now
      broken_ = true;
      broken_what_ = "rank 0's stage failed";
      cv_.notify_all();
    }
  }
}

void DistributedPipeline::take(const Message& m) {
  if (m.tag == mpi::kError) {
    try {
      throw_remote(m);
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(mu_);
      broken_ = true;
      broken_what_ = e.what();
      throw;
    }
  }
  if (m.tag != mpi::kLogits) fail(ErrorKind::Model, "unexpected message {} from rank {}", m.tag, m.source);
  Reader r(m.bytes, m.source);
  const uint64_t id = r.get<uint64_t>();
  const uint64_t ticket = id >> 20;
  const size_t index = size_t(id & ((1u << 20) - 1));
  const uint64_t words = r.get<uint64_t>();
  const std::vector<uint64_t> busy = r.get_vec<uint64_t>();  // stage k = rank k; rank 0's is ours
  const std::vector<uint64_t> step = r.get_vec<uint64_t>();
  const size_t V = size_t(cfg_.n_vocab);
  Job* job = nullptr;
  float* direct = nullptr;  // the rows' place in the caller's buffer when they are consecutive full rows
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(ticket);
    BATON_CHECK(it != jobs_.end() && index < it->second.mbs.size());
    job = &it->second;  // std::map nodes do not move, and only this thread finishes a job
    const MicroBatch& mb = job->mbs[index];
    if (words != output_words(mb.batch, V, size_t(cfg_.n_embd)))
      fail(ErrorKind::Model, "rank {} sent {} output words for a micro-batch of {} (different baton versions?)",
           m.source, words, output_words(mb.batch, V, size_t(cfg_.n_embd)));
    int first = -1, next = -1;
    bool consecutive = true;
    for (size_t t = 0; t < size_t(mb.batch.size()) && consecutive; ++t) {
      const uint8_t mode = mb.batch.logits[t];
      if (mode == kNoLogits) continue;
      const int row = job->out_row[size_t(mb.index[t])];
      consecutive = mode == kLogitsRow && (first < 0 || row == next);
      if (first < 0) first = row;
      next = row + 1;
    }
    if (consecutive && first >= 0) direct = job->logits + size_t(first) * V;
  }
  if (words > 0) {
    if (direct) {
      c_.recv_into(m.source, mpi::kLogitsRows, direct, words * sizeof(float));
    } else {  // argmax ids or candidates among them, or rows out of order: through our buffer
      rows_.resize(words);
      c_.recv_into(m.source, mpi::kLogitsRows, rows_.data(), words * sizeof(float));
      const MicroBatch& mb = job->mbs[index];
      const float* src = rows_.data();
      for (size_t t = 0; t < size_t(mb.batch.size()); ++t) {
        const uint8_t mode = mb.batch.logits[t];
        if (mode == kNoLogits) continue;
        float* dst = job->logits + size_t(job->out_row[size_t(mb.index[t])]) * V;
        const size_t len = baton::output_words(mode, V, size_t(cfg_.n_embd));  // ids, candidates, hidden states: their words, as they came
        std::memcpy(dst, src, len * sizeof(float));
        src += len;
      }
    }
  }
  const auto got = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t k = 1; k < busy.size() && k < infos_.size(); ++k) infos_[k].busy_s = double(busy[k]) * 1e-9;
  double remote_s = 0;
  for (size_t k = 1; k < step.size(); ++k) remote_s += double(step[k]) * 1e-9;
  links_.seconds += std::chrono::duration<double>(got - job->sent[index]).count() - remote_s;
  links_.micro_batches++;
  --job->left;
}

void DistributedPipeline::wait(uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.find(ticket) == jobs_.end()) fail(ErrorKind::Usage, "ticket {} is not in flight", ticket);
  }
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Job& j = jobs_.at(ticket);
      if (j.left == 0) {
        std::exception_ptr e = j.error;
        jobs_.erase(ticket);
        if (e) std::rethrow_exception(e);
        return;
      }
      if (broken_) {
        jobs_.erase(ticket);
        check_alive();
      }
    }
    // While rank 0's stage computes, sleep instead of polling MPI: a polling thread takes CPU time
    // from the stages when the ranks have a core each, and the logits waited for belong to a
    // micro-batch that left before the one being computed.
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return broken_ || stopping_ || (!stage_busy_ && queue_.empty()); });
    }
    // Also stop waiting when rank 0's own stage fails this job (no logits will come for it).
    auto m = c_.recv_until([&] {
      std::lock_guard<std::mutex> lock(mu_);
      return jobs_.at(ticket).left == 0 || broken_;
    });
    if (m) take(*m);
  }
}

void DistributedPipeline::truncate_seq(int seq, int from) {
  check_seq(seq);
  const int len = len_[size_t(seq)];
  if (from < 0 || from > len)
    fail(ErrorKind::Usage, "sequence {}: cannot truncate at {} (it holds {} positions)", seq, from, len);
  if (from > 0 && len - from > max_rewind_)
    fail(ErrorKind::Usage, "sequence {}: sliding-window layers keep only their window; rewinding by {} "
         "positions is not possible (at most {}, or truncate to 0)", seq, len - from, max_rewind_);
  len_[size_t(seq)] = from;
}

// At exit: rank 0 that never told the workers tells them now (the job failed); a rank that lost a
// peer cannot finalize (finalize waits for everyone) and ends the whole job instead.
void at_exit() {
  Comm* c = Comm::get();
  if (!c || c->finalized()) return;
  if (!c->failure().empty()) c->abort(1);
  try {
    if (c->rank() == 0) distributed_shutdown(true);
    else c->abort(1);  // a worker leaves only through a shutdown from rank 0
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    c->abort(1);
  }
}

}  // namespace

bool distributed_available() { return true; }

int distributed_init() {
  const bool first = Comm::get() == nullptr;
  Comm& c = Comm::init();
  if (first) std::atexit(at_exit);
  if (c.size() < 2) {
    // Nothing to talk to: leave MPI cleanly before reporting.
    c.finalize();
    fail(ErrorKind::Usage, "--distributed needs at least 2 ranks, this job has 1: launch with "
         "`mpirun -np N baton ... --distributed` (N >= 2), or drop --distributed");
  }
  return c.rank();
}

int distributed_serve(const WorkerArgs& args) {
  Comm& c = *Comm::get();
  BATON_CHECK(c.rank() > 0);
  Worker w{c, args, nullptr, {}, nullptr};
  try {
    return w.serve();
  } catch (const Error& e) {  // lost contact with a peer: nobody left to report to
    throw Error(e.kind(), fmt::format("rank {} ({}): {}", c.rank(), c.host(), e.what()));
  }
}

std::unique_ptr<Pipeline> load_distributed(const std::string& path, const LoadOptions& opt) {
  if (!Comm::get()) distributed_init();
  BATON_CHECK(Comm::get()->rank() == 0);
  return std::make_unique<DistributedPipeline>(path, opt);
}

Plan plan_distributed(const ModelShape& shape, const std::string& path, const std::string& devices,
                      const PlanOptions& options) {
  if (!Comm::get()) distributed_init();
  const std::vector<RankInfo> all = gather(local_info(path, devices, /*allow_hypothetical=*/true));
  if (!path.empty()) check_files(all);
  return plan_ranks(shape, all, options);
}

void distributed_shutdown(bool failed) {
  Comm* c = Comm::get();
  if (!c || c->finalized() || c->rank() != 0) return;
  if (!c->failure().empty()) return;  // at_exit aborts the job
  if (!g_shutdown_sent) {
    g_shutdown_sent = true;
    for (int r = 1; r < c->size(); ++r) c->send(r, mpi::kShutdown, {uint8_t(failed ? 1 : 0)});
  }
  c->flush();
  c->finalize();
}

}  // namespace baton

#else  // built without MPI: the flags exist, and say what is missing

namespace baton {

bool distributed_available() { return false; }

[[noreturn]] static void no_mpi() {
  fail(ErrorKind::Usage, "--distributed: this baton was built without MPI; install Open MPI (libopenmpi-dev, "
       "openmpi-bin: scripts/setup.sh does) and rebuild with -DBATON_MPI=AUTO or ON");
}

int distributed_init() { no_mpi(); }
int distributed_serve(const WorkerArgs&) { no_mpi(); }
std::unique_ptr<Pipeline> load_distributed(const std::string&, const LoadOptions&) { no_mpi(); }
Plan plan_distributed(const ModelShape&, const std::string&, const std::string&, const PlanOptions&) { no_mpi(); }
void distributed_shutdown(bool) {}

}  // namespace baton

#endif
