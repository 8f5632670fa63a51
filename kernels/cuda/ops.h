// The CUDA backend's op set, callable from plain C++ (no CUDA headers, no CUDA types): the runtime
// builds a GPU stage from these. Every pointer argument is device memory unless it says "host".
// Activations are F32, row-major, one token per row. Every op runs asynchronously on the
// Context's stream, allocates nothing once the Context's scratch is reserved, and never waits for
// the device, so a decode step made of these calls can be captured in a CUDA graph.
// Every op has a CPU twin (quant/quant.h, kernels/cpu/matmul.h, kernels/cpu/ops.h) and a test
// comparing the two (tests/test_cuda_ops.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

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

// One stage's handle on a GPU: device, stream, cuBLAS handle and one scratch buffer that the ops
// share (they run in stream order, so one buffer suffices).
class Context {
 public:
  // stream: a cudaStream_t to run on (not owned); nullptr creates a non-blocking stream.
  explicit Context(int device, void* stream = nullptr);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  void* stream() const { return stream_; }  // cudaStream_t
  void* cublas() const { return cublas_; }  // cublasHandle_t
  int sm_count() const { return sm_count_; }
  void synchronize() const;

  // Make the scratch at least `bytes` long now (before a graph capture). Ops that need more
  // scratch than reserved grow it, which synchronizes the stream and fails during a capture.
  void reserve(size_t bytes);
  void* scratch(size_t bytes);
  size_t scratch_size() const { return scratch_bytes_; }

  // Tuning, to be measured on the target GPU (scripts/gpu-check.sh): matmuls with at most
  // gemv_max_cols columns take the fused GEMV path, wider ones dequantize to FP16 + cuBLAS.
  int gemv_max_cols = 8;
  // The FP16 copy of a weight is made in row slabs of at most this many bytes (L2-sized slabs
  // keep the scratch small; the whole matrix is never expanded at once unless it fits).
  size_t gemm_slab_bytes = size_t(64) << 20;

 private:
  int device_ = 0;
  void* stream_ = nullptr;
  bool own_stream_ = false;
  void* cublas_ = nullptr;
  int sm_count_ = 1;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

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

// The activation format of the integer paths: per column, `cols` int8 quants (16-byte aligned
// runs) and per 32 values a (d, d * sum of quants) float pair, d = max|x| / 127.
size_t q8_act_bytes(int64_t cols, int n);
void quantize_act(Context& c, const float* x, int64_t cols, int n, int8_t* qs, float* ds);

// Y = W·X for n columns: X holds n vectors of W.cols floats, Y gets n vectors of W.rows floats.
// Chooses GEMV (n <= c.gemv_max_cols) or GEMM.
void matmul(Context& c, const Weight& W, const float* X, int n, float* Y);
// Fused dequantize + dot, the activation quantized once to 8-bit blocks (dp4a); float weights use
// F32 activations. Any n (launched 8 columns at a time).
void gemv(Context& c, const Weight& W, const float* X, int n, float* Y);
// Dequantize to FP16 (row slabs) and cublasGemmEx with FP32 accumulation and output.
void gemm(Context& c, const Weight& W, const float* X, int n, float* Y);
// Scratch the two paths need for n columns (the larger of the two when unsure).
size_t matmul_scratch_bytes(const Context& c, const Weight& W, int n);
// Rows [row0, row0 + nrows) of W as FP16 (nrows × cols), used by gemm; exposed for tests.
void dequantize_f16(Context& c, const Weight& W, int64_t row0, int64_t nrows, uint16_t* dst);

// ---------------------------------------------------------------------------------------------
// Norms, positions, activations

// y = x / sqrt(mean(x²) + eps) * w, per row of `dim` values; n rows. y may alias x.
void rmsnorm(Context& c, const float* x, const float* w, float* y, int dim, int n, float eps);

enum class RopeMode { Adjacent, NeoX };  // pairs (2i, 2i+1) (llama) or (i, i + n_rot/2) (NeoX)
// Rotates the first n_rot dims of every head in place. x: n_tok × n_head × head_dim; pos: n_tok
// positions (device); angle of pair i = pos * freq_scale * theta_base^(-2i / n_rot).
void rope(Context& c, float* x, int n_tok, int n_head, int head_dim, int n_rot, const int32_t* pos,
          float theta_base, float freq_scale, RopeMode mode);

void swiglu(Context& c, const float* gate, const float* up, float* out, int64_t n);  // silu(g)·u
void geglu(Context& c, const float* gate, const float* up, float* out, int64_t n);   // gelu(g)·u
void add(Context& c, const float* a, const float* b, float* out, int64_t n);          // out may alias a or b
// out (n × table.cols) = rows tokens[0..n) of the table, dequantized.
void embedding(Context& c, const Weight& table, const int32_t* tokens, int n, float* out);

// ---------------------------------------------------------------------------------------------
// Attention over an F16 KV cache

// The cache of one layer: element (seq, pos, kv_head, d) of K is at
// k[seq * seq_stride + pos * pos_stride + kv_head * head_dim + d]; V likewise. Strides in elements.
struct KvCache {
  uint16_t* k = nullptr;  // fp16 bits
  uint16_t* v = nullptr;
  int64_t seq_stride = 0, pos_stride = 0;
};

struct AttnShape {
  int n_head = 0, n_kv_head = 0, head_dim = 0;  // head_dim: 64, 96, 128 or 256
  float scale = 0;    // usually 1/sqrt(head_dim)
  float softcap = 0;  // > 0: scores become softcap·tanh(score/softcap)
  int window = 0;     // > 0: a query at position p sees keys p-window+1 .. p (sliding window)
};

// Write n tokens' K and V (n × n_kv_head × head_dim F32) into the cache at (seq[i], pos[i]).
void kv_store(Context& c, const AttnShape& s, const KvCache& kv, const float* k, const float* v,
              const int32_t* seq, const int32_t* pos, int n);

// One query token per row (decode): token i attends to keys 0..pos[i] of sequence seq[i].
// q, out: n × n_head × head_dim. max_len (host): an upper bound of pos[i] + 1 over the batch;
// it sizes the split over the KV cache (pass n_ctx when capturing a graph).
void attention_decode(Context& c, const AttnShape& s, const KvCache& kv, const float* q,
                      const int32_t* seq, const int32_t* pos, int n, int max_len, float* out);
// A run of n tokens of one sequence at positions pos0 .. pos0+n-1 (prefill), causal, tiled;
// their K/V must already be in the cache.
void attention_prefill(Context& c, const AttnShape& s, const KvCache& kv, const float* q, int seq,
                       int pos0, int n, float* out);
size_t attention_scratch_bytes(const AttnShape& s, int n, int max_len);

// ---------------------------------------------------------------------------------------------
// Sampling on the device

// Index of the largest logit of each of n rows (ties: the lowest index, as the CPU sampler).
void argmax(Context& c, const float* logits, int n_vocab, int n, int32_t* out);
// The k (1..1024) largest logits of each row, sorted by value descending then index ascending:
// idx and val are n × k.
void top_k(Context& c, const float* logits, int n_vocab, int n, int k, int32_t* idx, float* val);

}  // namespace baton::cuda
