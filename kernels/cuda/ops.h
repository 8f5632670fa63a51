// The CUDA backend's op set, callable from plain C++ (no CUDA headers, no CUDA types): the runtime
// builds a GPU stage from these. Every pointer argument is device memory unless it says "host".
// Activations are F32, row-major, one token per row. Every op runs asynchronously on the
// Context's stream, allocates nothing once the Context's scratch is reserved, and never waits for
// the device, so a decode step made of these calls can be captured in a CUDA graph.
// Every op has a CPU twin (quant/quant.h, kernels/cpu/matmul.h, kernels/cpu/ops.h) and a test
// comparing the two (tests/test_cuda_ops.cpp; rope, KV and attention in tests/cuda_ops_attention.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "kernels/cuda/layout.h"
#include "quant/types.h"

namespace baton::cuda {

// Visible CUDA devices; 0 when the build has no driver or no GPU (never throws).
int device_count();

// A device allocation (RAII). Copies are synchronous; they are for set-up and tests, not per token.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);  // on the current device
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }
  void upload(const void* host, size_t bytes, size_t offset = 0);
  void download(void* host, size_t bytes, size_t offset = 0) const;

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// The workspace a cuBLAS handle is given (cublasSetWorkspace) on a device of compute capability
// `cc_major`: NVIDIA's recommended size, 32 MiB on Hopper and later, 4 MiB before. An explicit
// workspace, allocated once, is memory the reserve measurement sees; without one, cuBLAS takes
// its own from the stream-ordered pool (CUDA 12.2+), also inside a graph capture, where no plan
// counts it.
size_t cublas_workspace_bytes(int cc_major);

// The GEMV's forms (docs/GPU.md, "Kernels"); which is fastest depends on the shape and the GPU.
//   Split:  a warp per row, or 2-4 warps per row for matrices with fewer rows than 32 per SM
//   Whole:  a warp per row
//   Pairs:  two rows per warp (launches of 1 or 2 columns)
//   Stream: a grid of one wave, each warp a run of rows with the next batch of weights in flight
//           (matrices with fewer rows than the grid holds warps take Split)
// Whole, Pairs and Stream sum each row in one warp in the same order: the same bits
// (tests/test_cuda_ops.cpp). Split's rows of 2-4 warps add the warps' partial sums: other last bits.
enum class GemvForm : uint8_t { Split, Whole, Pairs, Stream };
constexpr int kGemvForms = 4;
inline const char* gemv_form_name(GemvForm f) {
  constexpr const char* kNames[kGemvForms] = {"split", "whole", "pairs", "stream"};
  return kNames[int(f)];
}
// A measured choice: GEMV launches of `n` columns over `rows` rows (all the launch's matrices) of
// this type and width take `form`.
struct GemvChoice {
  GgmlType type;
  int rows;
  int64_t cols;
  int n;
  GemvForm form;
};

// One stage's handle on a GPU: device, stream, cuBLAS handle with its workspace and one scratch
// buffer that the ops share (they run in stream order, so one buffer suffices).
class Context {
 public:
  // stream: a cudaStream_t to run on (not owned); nullptr creates a non-blocking stream.
  explicit Context(int device, void* stream = nullptr);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  // Makes the context's device current for the calling thread (the CUDA current device is per
  // thread: a pipeline's driver threads call this before their stage's ops).
  void make_current() const;
  void* stream() const { return stream_; }  // cudaStream_t
  void* cublas() const { return cublas_; }  // cublasHandle_t
  int sm_count() const { return sm_count_; }
  void synchronize() const;

  // Make the scratch at least `bytes` long now (before a graph capture). Ops that need more
  // scratch than reserved grow it, which synchronizes the stream and fails during a capture.
  void reserve(size_t bytes);
  void* scratch(size_t bytes);
  size_t scratch_size() const { return scratch_bytes_; }
  // kCounters zeroed device counters for kernels whose last block finishes a grid-wide reduction
  // (it resets its counter to 0 for the next launch): allocated with the context.
  static constexpr int kCounters = 64;  // also the most rows argmax/top_k split (runtime/buffers.cpp)
  // Then kAttnCounters for attention(): one per (token, head) and one for the grid (so a batch of
  // up to 8191 query heads takes the fused form).
  static constexpr int kAttnCounters = 8192;
  uint32_t* counters() const { return counters_; }
  // Counts the scratch's reallocations: a graph captured before one holds the old address.
  uint64_t scratch_generation() const { return scratch_generation_; }

  // Tuning, measured on the target GPU (scripts/gpu-check.sh): matmuls with at most
  // gemv_max_cols columns take the fused GEMV path, wider ones dequantize to FP16 + cuBLAS. On an
  // H200 the GEMV (in launches of 8 columns) is faster up to 23 columns for Q4_0, Q4_K and Q8_0
  // and up to 15 for Q6_K; a 16-sequence decode step of the 8B shape ran 1.36x faster at 16 than
  // at 8 (docs/BENCHMARKS.md, "H200").
  int gemv_max_cols = 16;
  // The GEMV's shape, both to be measured on a GPU (scripts/gpu-check.sh runs the decode bench each
  // way): gemv_split_rows: matrices with fewer rows than 32 per SM give each row 2 or 4 warps
  // (BATON_GEMV_SPLIT=0: always one); gemv_rows_per_warp 2 (BATON_GEMV_ROWS=2): each warp of a
  // launch of 1 or 2 columns takes two rows, loading both rows' weights before using any and
  // reading each activation block once for both (no split rows then). `baton bench-kernels`
  // prints one and two rows per warp.
  bool gemv_split_rows = true;
  int gemv_rows_per_warp = 1;
  // gemv_stream (BATON_GEMV_STREAM=1), also to be measured: matrices with at least one row per warp
  // the GPU holds at once take a grid of one wave, each warp a run of rows whose next batch of
  // weights it loads before summing the current one (rows whole in one warp, as without split rows).
  bool gemv_stream = false;
  int gemv_stream_warps = 0;  // the streamed grid's warps; 0: as many as the GPU holds at once (tests set it)
  // The streamed GEMV asks the L2 for up to this many bytes of its weights before it waits for the
  // op before it (BATON_GEMV_PREFETCH_MIB; 0: none): an 8B step's q/k/v whole, a quarter of gate/up.
  size_t gemv_prefetch_bytes = size_t(16) << 20;
  // Forms measured at a stage's load (tune_gemv): a launch that matches an entry takes its form,
  // any other the form the flags above give. gemv_force >= 0: every launch takes that GemvForm.
  std::vector<GemvChoice> gemv_forms;
  int gemv_force = -1;
  // Whether a stage measures the forms at load and takes the fastest per launch (BATON_GEMV_TUNE):
  // 0 no (the default until a GPU run says it pays), 1 among the forms that give the switches'
  // form's bits (the logits stay the same), 2 among all (Split against a one-warp form changes a
  // product's last bits, so the logits may differ from one load to the next).
  int gemv_tune = 0;
  // A sequence's run of at least this many tokens in one step (a prompt chunk) takes
  // attention_prefill (query tiles sharing key tiles in shared memory); shorter runs and decode
  // tokens take the split attention. To be measured like gemv_max_cols.
  int prefill_min_tokens = 32;
  // The FP16 copy of a weight is made in row slabs of at most this many bytes (L2-sized slabs
  // keep the scratch small; the whole matrix is never expanded at once unless it fits).
  size_t gemm_slab_bytes = size_t(64) << 20;
  // The ops of a decode step are launched as programmatic dependent launches (Hopper and later;
  // BATON_PDL=0 turns it off): each kernel lets the next one launch as soon as all its blocks run,
  // so the launch latency hides behind the kernel before. Every kernel waits for its predecessor
  // (griddepcontrol.wait) before it touches data; GEMVs first load their weights, which no op writes.
  bool early_launch = false;
  // attention() in one launch (BATON_ATTN_FUSED=0: two): the split that finishes a head last
  // merges the splits' sums (a head whose keys fit one split writes its output at once), and the
  // commit goes in the same launch; otherwise a second kernel merges and commits.
  bool fused_attention = true;
  // A decode step's rope and KV staging done by its attention (attention()'s RopeStage) instead of
  // rope_stage before it (BATON_ATTN_ROPE=0: rope_stage). For the stages; the ops take what they are given.
  bool rope_in_attention = true;
  // attention_prefill runs on the tensor cores (mma.sync, sm_80+) for head sizes up to 128;
  // BATON_MMA_ATTN=0 takes the F32 kernel instead (for measuring one against the other).
  bool mma_prefill = true;

 private:
  void release();  // frees what the constructor got so far (it may throw half-way)

  int device_ = 0;
  void* stream_ = nullptr;
  bool own_stream_ = false;
  void* cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;
  int sm_count_ = 1;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  uint32_t* counters_ = nullptr;
  uint64_t scratch_generation_ = 0;
};

// Stream-ordered copies on the Context's stream (cudaMemcpyAsync): they return at once, and the
// bytes move when the stream gets there. Host memory must stay valid until the stream is
// synchronized, and overlaps with compute only when pinned.
void copy_to_device(Context& c, void* dst, const void* host, size_t bytes);
void copy_to_host(Context& c, void* host, const void* src, size_t bytes);
void copy_on_device(Context& c, void* dst, const void* src, size_t bytes);

// ---------------------------------------------------------------------------------------------
// CUDA graphs: what a step enqueues, recorded once and replayed with one launch.

// A captured sequence of ops (RAII). The ops it holds keep the arguments they had when captured:
// every value that changes from step to step must reach them through device memory, and copies
// from pageable host memory or anything that waits for the device cannot be captured.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(Graph&& o) noexcept;
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  bool empty() const { return exec_ == nullptr && !replay_; }

 private:
  friend Graph capture(Context& c, const std::function<void()>& record);
  friend void launch(Context& c, const Graph& g);
  void* exec_ = nullptr;          // cudaGraphExec_t
  std::function<void()> replay_;  // the host emulation replays the recording function itself
};
// Captures the ops `record` enqueues on c's stream (thread-local capture mode: other threads'
// streams are unaffected). Nothing runs until launch(). Throws, ending the capture, when record or
// an op in it does.
Graph capture(Context& c, const std::function<void()>& record);
void launch(Context& c, const Graph& g);

// ---------------------------------------------------------------------------------------------
// Between devices (the links of a pipeline, runtime/link.h)

// Page-locked host memory (cudaMallocHost, RAII): copies to and from it are truly asynchronous
// and run at the bus's full speed. Pinning is slow and limited: allocate once, at load.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// A CUDA event (RAII, no timing), created on the current device: record() marks the point a
// context's stream has reached (the context must be on the event's device); wait() makes another
// context's stream, on any device, wait for that point without the host waiting. Waiting for an
// event never recorded does not wait.
class Event {
 public:
  Event();
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(Context& c);
  void wait(Context& c) const;

 private:
  void* e_ = nullptr;  // cudaEvent_t
};

// Whether device a can read and write device b's memory directly and b a's (cudaDeviceCanAccessPeer
// both ways). A device and itself: true.
bool peer_possible(int a, int b);
// Enables peer access a -> b and b -> a; already enabled is fine. Throws (naming both devices) when
// the driver refuses.
void enable_peer(int a, int b);
// Stream-ordered copy on src's stream from src's device to `dst` on device dst_device
// (cudaMemcpyPeerAsync; within one device a plain device-to-device copy). Peer access between the
// two devices must be enabled.
void copy_peer(Context& src, void* dst, int dst_device, const void* src_ptr, size_t bytes);

// ---------------------------------------------------------------------------------------------
// Weights and matrix products

// A weight matrix on the device in the packed layout (layout.h): rows × cols, row_stride bytes
// apart (packed_row_bytes). The type must satisfy cuda_supports().
struct Weight {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  size_t row_stride = 0;
};

// Pack `rows` GGUF rows on the host and copy them into a new device buffer (synchronous: for
// tests and simple loaders; the stage loader streams rows through pinned memory instead).
DeviceBuffer upload_weight(GgmlType t, const void* host_rows, int64_t rows, int64_t cols, Weight& out);

// Streams weights to the device through two pinned staging buffers on c's stream: the rows of
// one matrix are packed (layout.h) into one buffer while the other buffer's copy runs, so the host
// packing overlaps the bus. A matrix larger than a buffer goes in row slabs. Each upload returns
// the new device buffer at once; finish() waits for every copy (the staging buffers are reused
// only after their last copy is done, by event).
class WeightUploader {
 public:
  explicit WeightUploader(Context& c, size_t staging_bytes = size_t(32) << 20);
  ~WeightUploader();
  WeightUploader(const WeightUploader&) = delete;
  WeightUploader& operator=(const WeightUploader&) = delete;
  DeviceBuffer upload(GgmlType t, const void* host_rows, int64_t rows, int64_t cols, Weight& out);
  void finish();

 private:
  struct Impl;
  Impl* impl_;
};

// The activation format of the integer paths: per column, `cols` int8 quants (16-byte aligned
// runs) and per 32 values a (d, d * sum of quants) float pair, d = max|x| / 127.
size_t q8_act_bytes(int64_t cols, int n);
// Whether products with weights of type t take the activations on that 8-bit grid (every
// quantized type; float weights take them as they are), in the GEMV and, rounded, in the GEMM.
inline bool q8_activations(GgmlType t) { return t != GgmlType::F16 && t != GgmlType::BF16 && t != GgmlType::F32; }
void quantize_act(Context& c, const float* x, int64_t cols, int n, int8_t* qs, float* ds);
// The same activations written by the op that produces a matmul's input (rms_norm, add_rms_norm,
// the gates: their `q8` argument), so that the GEMV after it does not launch quantize_act
// (matmul's `x_q8`). They go to the start of the scratch, where the GEMV would put them, and hold
// until the next op that uses the scratch. Bit-identical to quantize_act of the op's output.
// Needs cols (the op's row width) a multiple of 32.
struct Q8Act {
  int8_t* qs = nullptr;
  float* ds = nullptr;  // (d, d * sum of quants) per 32 values
};
Q8Act q8_scratch(Context& c, int64_t cols, int n);

// Y = W·X for n columns: X holds n vectors of W.cols floats, Y gets n vectors of W.rows floats.
// Chooses GEMV (n <= c.gemv_max_cols) or GEMM. x_q8: the op that wrote X also left its 8-bit
// activations at q8_scratch(c, W.cols, n); the GEMV path takes them instead of quantizing X.
void matmul(Context& c, const Weight& W, const float* X, int n, float* Y, bool x_q8 = false);
// Several products of one input X (q, k and v; gate and up): Y_i = W_i·X, as matmul does each.
// On the GEMV path X is quantized once, and consecutive matrices of one type share a launch
// (bit-identical to separate calls); the GEMM path runs them one by one.
struct MatmulOut {
  const Weight* W;
  float* Y;
};
void matmul_n(Context& c, std::initializer_list<MatmulOut> outs, const float* X, int n, bool x_q8 = false);
void matmul_n(Context& c, const MatmulOut* outs, int count, const float* X, int n, bool x_q8 = false);  // 1..8
// Fused dequantize + dot, the activation quantized once to 8-bit blocks (dp4a); float weights use
// F32 activations (read 16 bytes at a time: X must be 16-byte aligned, as every buffer of the
// stage and the scratch are). Any n (launched 8 columns at a time).
void gemv(Context& c, const Weight& W, const float* X, int n, float* Y);
// The form a GEMV launch of n columns over `rows` rows (its matrices together) of type and width
// `cols` takes: gemv_force, else a gemv_forms entry, else the flags' (Pairs only up to 2 columns).
GemvForm gemv_form(const Context& c, GgmlType type, int rows, int64_t cols, int n);
// Times the forms on `calls` (one op's matrices in every layer of a stage: {q, k, v}, {gate, up},
// {down}, ...; each call one gemv_n on X with n columns, run in order as a decode step reads them,
// so that the weights come from HBM, not the L2), best of `rounds`, and records the fastest in
// c.gemv_forms for the launches those calls make. A form is timed when it runs other kernels than
// the forms before it for some launch (Pairs beyond 2 columns is Split or Whole; Whole is Split
// where no matrix splits its rows; Stream is where no matrix has a row per warp of the grid) and,
// with same_bits, sums every launch's rows in the partials the switches' form does (Split with
// rows over 2-4 warps and the one-warp forms differ): then the products stay the same bits.
// us[f]: the form's time per call in microseconds, -1 when not timed. Synchronizes the stream;
// not during a capture.
struct GemvTiming {
  GemvForm best = GemvForm::Split;
  float us[kGemvForms] = {};
};
GemvTiming tune_gemv(Context& c, const std::vector<std::vector<MatmulOut>>& calls, const float* X, int n,
                     bool same_bits, int rounds = 3);
// Asks the driver once for the streamed GEMV's blocks per SM (Context::gemv_stream), for every
// weight type and column count, on the current device: done before a decode graph is captured, so
// that the capture itself only launches.
void gemv_stream_prepare();
// Dequantize to FP16 (row slabs) and cublasGemmEx with FP32 accumulation and output. X goes to
// FP16 too, saturated at ±65504.
void gemm(Context& c, const Weight& W, const float* X, int n, float* Y);
// gemm of `count` matrices of one width on the same X (Y[i] = W[i] X): X goes to FP16 once.
void gemm_n(Context& c, const Weight* const* W, float* const* Y, int count, const float* X, int n);
// Scratch matmul needs for n columns (that of the path it takes).
size_t matmul_scratch_bytes(const Context& c, const Weight& W, int n);
// Rows [row0, row0 + nrows) of W as FP16 (nrows × cols), used by gemm; exposed for tests.
void dequantize_f16(Context& c, const Weight& W, int64_t row0, int64_t nrows, uint16_t* dst);

// ---------------------------------------------------------------------------------------------
// Norms, positions, activations: the semantics of kernels/cpu/ops.h, op for op.

// y[r] = x[r] / rms(x[r]) * w for `rows` rows of n (y may alias x); w == nullptr: no weight.
// q8 (from q8_scratch(c, n, rows)): also write y's 8-bit activations there.
void rms_norm(Context& c, const float* x, const float* w, float* y, int rows, int n, float eps, Q8Act q8 = {});
// The residual add and the next norm in one launch: x += ds·d, then y = rms_norm(x) * w, as add
// followed by rms_norm (y may alias d). ds: granite's residual scale (1: the plain add, bit for bit).
void add_rms_norm(Context& c, float* x, const float* d, const float* w, float* y, int rows, int n, float eps,
                  Q8Act q8 = {}, float ds = 1.f);

// RoPE for n_tok tokens: token t (n_head heads, head_dim apart, `stride` floats from token to
// token) at position pos[t] (device). freqs (device, rope_dim/2): angle per position of pair i.
// neox=false: pairs (2i, 2i+1); true: (i, i + rope_dim/2). Angles in double, as on the CPU.
// mscale multiplies cos and sin (LongRoPE's attention factor; 1 for every other model). rope_dim 0
// rotates nothing (a NoPE layer), here and in rope_qk, rope_stage and attention's RopeStage.
void rope(Context& c, float* x, int n_tok, size_t stride, int n_head, int head_dim, int rope_dim,
          const int32_t* pos, const float* freqs, bool neox, float mscale = 1.f);
// The same for q and k of the same tokens in one launch (as rope on q, then on k).
struct RopeRows {
  float* x;
  size_t stride;
  int n_head;
};
void rope_qk(Context& c, const RopeRows& q, const RopeRows& k, int n_tok, int head_dim, int rope_dim,
             const int32_t* pos, const float* freqs, bool neox, float mscale = 1.f);

// silu(g)·u, gelu_tanh(g)·u and gpt-oss's clamped SwiGLU (as cpu::swiglu_oai_gate); q8 as for
// rms_norm (q8_scratch(c, row width, rows), n a multiple of 32).
void silu_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8 = {});
void gelu_tanh_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8 = {});
void swiglu_oai_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8 = {});
void add(Context& c, float* y, const float* x, int64_t n, float s = 1.f);  // y += s·x
// y[r·width + i] += bias[i] for r < rows: a bias row added to every token's row, one launch.
void add_rows(Context& c, float* y, const float* bias, int rows, int64_t width);
void scale(Context& c, float* y, float s, int64_t n);            // y *= s
void softcap(Context& c, float* y, float cap, int64_t n);        // y = cap·tanh(y / cap)
// out[i] = row ids[i] of the table, dequantized, times s. ids must be in range (caller's job).
void embed_rows(Context& c, const Weight& table, const int32_t* ids, int n, float* out, float s);
// A mixture of experts' data movement (as cpu::gather_rows / cpu::scatter_add_rows; rows and w
// are device arrays): y[j] = x[rows[j]], and acc[rows[j]] += f(w[j]) · y[j] (f: identity or
// sigmoid; rows null: row j). A launch's rows must be distinct (one token once per expert).
void gather_rows(Context& c, const float* x, const int32_t* rows, int m, int width, float* y);
void scatter_add_rows(Context& c, float* acc, const float* y, const int32_t* rows, const float* w, bool sigmoid_w,
                      int m, int width);
// A mixture of experts routed on the device (steps of up to kMoeDeviceTokens tokens: no wait for
// the host, so a decode step is captured in a graph). Each (token t, rank j) is a pair p = t·k + j.
// moe_route: per token, cpu::moe_route over its row of n_expert logits (read, not changed): ids[p]
// the experts in order of probability (then lower id), w[p] their probabilities (renormalized to
// sum 1 when renorm); -1 and 0 for a token without a finite logit.
constexpr int kMoeRouteMaxExperts = 512;
void moe_route(Context& c, const float* logits, int n, int n_expert, int k, bool renorm, int32_t* ids, float* w);
// A stacked expert tensor on the device: expert e's matrix is `first` with data advanced by
// e·expert_bytes.
struct ExpertWeights {
  Weight first;
  size_t expert_bytes = 0;
};
struct ExpertOut {
  const ExpertWeights* W;
  float* Y;
};
// For each pair p < pairs: Y[p] (W.rows floats) = matrix ids[p] of W · X[p / x_div] (X: pairs /
// x_div vectors of W.cols floats), as cuda::gemv of that expert computes it; pairs with ids[p] < 0
// are not written. One or two stacked tensors of one type and width (gate and up) in one launch.
// x_q8: X's 8-bit activations are already at q8_scratch(c, W.cols, pairs / x_div).
void gemv_experts(Context& c, const ExpertOut* outs, int count, const float* X, int x_div, const int32_t* ids,
                  int pairs, bool x_q8 = false);
// y[p·width + i] += bias[ids[p]·width + i] for pairs with ids[p] >= 0 (stacked per-expert biases).
void add_rows_id(Context& c, float* y, const float* bias, const int32_t* ids, int pairs, int width);
// acc[t·width + i] = Σ_j w[t·k + j]·ye[(t·k + j)·width + i] over the ranks j with an expert, in
// ascending expert id from zero (cpu::scatter_add_rows of each into zeroed rows, the CPU stage's
// order); t < n.
void moe_combine(Context& c, float* acc, const float* ye, const int32_t* ids, const float* w, int n, int k, int width);
// bytes zero bytes at p (cudaMemsetAsync).
void zero(Context& c, void* p, size_t bytes);

// ---------------------------------------------------------------------------------------------
// Attention over an F16 or Q8_0 KV cache: the staged-batch rule of cpu::AttentionArgs
// (kernels/cpu/ops.h), with device pointers. The device cache is position-major: per sequence,
// cell rows holding all KV heads of one position (a warp reads a head's slice coalesced either
// way); the CPU cache is head-major, which its prefetchers need. KV never moves between the two.

struct KvLayer {
  GgmlType type = GgmlType::F16;  // F16 or Q8_0
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  size_t k_row = 0, v_row = 0;  // bytes per cell (all KV heads of one position)
  int n_cells = 0;              // per sequence; position p lives in cell p % n_cells
  int n_head_kv = 0, head_dim = 0;  // head_dim of K and V: 32, 64, 96, 128 or 256
};

// Converts n rows of `width` floats (src rows `src_stride` floats apart) into KV rows of `type`
// (rows dst_row bytes apart). As cpu::kv_convert per row.
void kv_convert(Context& c, GgmlType type, const float* src, size_t src_stride, uint8_t* dst,
                size_t dst_row, int width, int n);
// k and v rows of the same tokens in one launch (as kv_convert on each).
struct KvRows {
  const float* src;
  size_t src_stride;
  uint8_t* dst;
  size_t dst_row;
  int width;
};
void kv_convert_kv(Context& c, GgmlType type, const KvRows& k, const KvRows& v, int n);
// The decode step's rope and staging in one launch: q rotated in place (as rope_qk), k's rows
// rotated and stored as `type` (the F32 rows k.src stay as they were), v's rows stored; the same
// bytes as rope_qk on q and k, then kv_convert_kv. k.width: whole heads of head_dim.
void rope_stage(Context& c, GgmlType type, const RopeRows& q, const KvRows& k, const KvRows& v, int n_tok, int head_dim,
                int rope_dim, const int32_t* pos, const float* freqs, bool neox, float mscale = 1.f);
// The commit after attention: staged row row[t] of k_new/v_new into cache cell (seq[t], pos[t])
// for t < n (device arrays).
struct KvCommit {
  const uint8_t* k_new = nullptr;
  const uint8_t* v_new = nullptr;
  const int32_t *row = nullptr, *seq = nullptr, *pos = nullptr;
  int n = 0;
};
void kv_commit(Context& c, const KvLayer& kv, const KvCommit& m);

struct AttentionArgs {  // as cpu::AttentionArgs; the int arrays are device arrays of n_tokens
  int n_tokens = 0;
  const float* q = nullptr;
  size_t q_stride = 0;
  float* out = nullptr;
  size_t out_stride = 0;
  const int32_t* pos = nullptr;
  const int32_t* seq = nullptr;
  const int32_t* first = nullptr;
  const int32_t* row0 = nullptr;
  const uint8_t* k_new = nullptr;
  const uint8_t* v_new = nullptr;
  int n_head = 0;
  float scale = 1.f;
  float softcap = 0.f;  // > 0: every score s (scale included) becomes softcap·tanh(s / softcap) (Gemma 2)
  const float* sinks = nullptr;  // n_head floats (device) or null: attention sinks, as cpu::AttentionArgs
  int window = 0;
  KvLayer kv;
};

// Any batch (decode steps of many sequences, mixed with prefill runs): one query per (token, head),
// the keys split over several blocks so that long contexts fill the GPU (flash-decoding), then
// merged (Context::fused_attention). max_len (host): an upper bound of pos[t] + 1 over the batch
// (pass n_ctx when capturing a graph); it fixes the number of splits, and when it is at most the
// cache's cells no committed cell is one the batch reads (the commit need not wait for the reads).
// q8_out: the output's 8-bit activations too, where q8_scratch(c, n_head * head_dim, n_tokens) puts
// them (the GEMV of the output projection then takes them: x_q8); out rows must be contiguous.
// commit: the layer's commit (kv_commit on a.kv) done by the same launches, after the keys are read.
// rope (a decode step's, instead of rope_stage before it): a.q is rotated as it is read (and left
// as it is), and the blocks that read a token's own key compute that key's and value's head from
// the F32 rows into the staged rows (a.k_new, a.v_new: row row0[t], as rope_stage writes them) and,
// when the commit need not wait, into its cell. Only for batches of one token per sequence
// (first[t] == pos[t]), whose commit is every token's row.
struct RopeStage {
  const float* k = nullptr;  // rows of n_head_kv * head_dim, k_stride floats apart
  size_t k_stride = 0;
  const float* v = nullptr;
  size_t v_stride = 0;
  int rope_dim = 0;
  const float* freqs = nullptr;
  bool neox = false;
  float mscale = 1.f;  // as rope()'s
};
void attention(Context& c, const AttentionArgs& a, int max_len, bool q8_out = false, const KvCommit& commit = {},
               const RopeStage& rope = {});
// Scratch attention() takes for n_tokens queries of n_head heads over at most max_len keys (the
// split partials), so that a stage can reserve it before its first step.
size_t attention_scratch_bytes(const Context& c, int n_tokens, int n_head, int head_dim, int max_len);

// A prefill run: the n_tokens tokens are one sequence `seq` at positions pos0, pos0+1, ..., staged
// in rows row0, row0+1, ... (host values; the device arrays of `a` are not read). Query tiles
// share key/value tiles in shared memory; causal, with no n² buffer anywhere.
void attention_prefill(Context& c, const AttentionArgs& a, int seq, int pos0, int row0);

// ---------------------------------------------------------------------------------------------
// Sampling on the device

// Index of the largest logit of each of n rows (ties: the lowest index, as the CPU sampler).
void argmax(Context& c, const float* logits, int n_vocab, int n, int32_t* out);
// The k (1..256) largest logits of each row, sorted by value descending then index ascending:
// idx and val are n × k. NaNs come last: a row with fewer than k other values ends with NaN
// entries (where the CPU's top_k returns fewer than k).
void top_k(Context& c, const float* logits, int n_vocab, int n, int k, int32_t* idx, float* val);
// Scratch argmax and top_k (k candidates) take for n rows of n_vocab (slices of long rows).
size_t sampling_scratch_bytes(int n_vocab, int n, int k);

}  // namespace baton::cuda
