// The op set of kernels/cuda/ops.h emulated on the host, for builds without CUDA: "device memory"
// is host memory, the stream is the calling thread (every op has finished when it returns), and
// the ops compute with their CPU twins or with a scalar version of what the kernel computes. It
// lets runtime/gpu_stage.cpp run, and be tested, on machines without a GPU
// (tests/test_gpu_stage_host.cpp). device_count() is 0 unless BATON_CUDA_EMULATE=N, so nothing
// but a test that asks for it ever sees a GPU; with it, the pipeline builds GPU stages and links on
// the emulation (runtime/devices.h, cuda_emulated()).
//
// The emulation keeps the kernels' contract, not just their arithmetic: the same input checks
// (weight types and strides, head sizes, KV types), new allocations filled with 0xFF bytes (NaN
// as floats, F16 and Q8_0 scales) so that reading memory nothing wrote shows up in the results,
// and errors where the real kernels would silently go wrong (a commit writing one cache cell
// twice, whose order the GPU does not define; keys past max_len; ring cells already overwritten).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "gguf/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/errors.h"
#include "kernels/cuda/ops.h"
#include "quant/quant.h"

namespace baton::cuda {

namespace {

constexpr size_t kAlign = 256;  // cudaMalloc's alignment
constexpr uint8_t kPoison = 0xFF;

size_t align_up(size_t b, size_t a) { return (b + a - 1) / a * a; }

void* poisoned_alloc(size_t bytes) {
  void* p = std::aligned_alloc(kAlign, align_up(bytes, kAlign));
  if (p) std::memset(p, kPoison, bytes);
  return p;
}

void check_weight(const Weight& W, const char* op) {
  if (!cuda_supports(W.type))
    input_error(fmt::format("CUDA {}: weight type {} is not supported", op, type_name(W.type)));
  if (W.rows <= 0 || W.cols <= 0 || W.rows > INT32_MAX || W.row_stride != packed_row_bytes(W.type, W.cols))
    input_error(fmt::format("CUDA {}: bad weight shape {} x {} (row stride {})", op, W.rows, W.cols, W.row_stride));
}

const uint8_t* packed_row(const Weight& W, int64_t r) { return static_cast<const uint8_t*>(W.data) + size_t(r) * W.row_stride; }

// Row r of W back in its GGUF layout (gguf_row: row_bytes(W.type, W.cols) bytes).
cpu::QMatrix unpacked_row(const Weight& W, int64_t r, uint8_t* gguf_row) {
  unpack_rows(W.type, packed_row(W, r), gguf_row, 1, W.cols);
  return cpu::QMatrix{W.type, gguf_row, 1, W.cols, row_bytes(W.type, W.cols)};
}

// Row r of W as floats.
void dequantize_weight_row(const Weight& W, int64_t r, uint8_t* gguf_row, float* out) {
  dequantize_row(W.type, unpacked_row(W, r, gguf_row).data, out, W.cols);
}

// Scratch of the two matmul paths: the activations (GEMV: 8-bit blocks for quantized weights;
// GEMM: FP16-rounded floats), then one dequantized weight row and its GGUF bytes.
size_t row_scratch_bytes(const Weight& W) {
  return align_up(size_t(W.cols) * sizeof(float), kAlign) + row_bytes(W.type, W.cols);
}
size_t gemv_scratch_bytes(const Weight& W, int n) {
  return (q8_activations(W.type) ? align_up(q8_act_bytes(W.cols, n), kAlign) : 0) + row_scratch_bytes(W);
}
size_t gemm_scratch_bytes(const Weight& W, int n) {
  return align_up(size_t(n) * size_t(W.cols) * sizeof(float), kAlign) + row_scratch_bytes(W);
}

float round_f16(float x) { return fp16_to_f32(f32_to_fp16(x)); }

// Calls f(offset, count) over [0, n) in pieces that fit the CPU twins' int counts.
template <class F>
void in_pieces(int64_t n, F&& f) {
  constexpr int64_t kPiece = int64_t(1) << 30;
  for (int64_t i = 0; i < n; i += kPiece) f(i, int(std::min(kPiece, n - i)));
}

void check_attention(const AttentionArgs& a) {
  const KvLayer& kv = a.kv;
  if (kv.type != GgmlType::F16 && kv.type != GgmlType::Q8_0)
    input_error(fmt::format("CUDA attention: KV type {} is not F16 or Q8_0", type_name(kv.type)));
  if (kv.n_head_kv <= 0 || a.n_head % kv.n_head_kv != 0)
    input_error(fmt::format("CUDA attention: {} query heads do not group over {} KV heads", a.n_head, kv.n_head_kv));
  const int d = kv.head_dim;
  if (d != 32 && d != 64 && d != 96 && d != 128 && d != 256)
    input_error(fmt::format("CUDA attention: head dim {} is not supported (32, 64, 96, 128, 256)", d));
}

// One query token of attention(): the staged-batch rule of cpu::AttentionArgs over the
// position-major cache. buf: max_len + 1 + 2 * head_dim floats (the scores, a head's sink as one
// more of them, K and V).
void attend(const AttentionArgs& a, int t, int pos, int seq, int first, int row0, int max_len, float* buf) {
  const KvLayer& kv = a.kv;
  const int D = kv.head_dim, n_rep = a.n_head / kv.n_head_kv;
  const size_t kh = kv.k_row / size_t(kv.n_head_kv), vh = kv.v_row / size_t(kv.n_head_kv);
  const int lo = a.window > 0 ? std::max(0, pos - a.window + 1) : 0, n = pos - lo + 1;
  if (pos >= max_len)
    input_error(fmt::format("CUDA attention: token {} at position {} is past max_len {}", t, pos, max_len));
  if (first > pos)
    input_error(fmt::format("CUDA attention: token {} at position {} precedes its first staged position {}", t, pos, first));
  if (lo < first - kv.n_cells)  // the cells of older positions hold newer ones by now
    input_error(fmt::format("CUDA attention: position {} of sequence {} is no longer in its {} cells", lo, seq,
                            kv.n_cells));
  auto cell = [&](const uint8_t* cache, const uint8_t* staged, size_t row, int j) {
    return j >= first ? staged + size_t(row0 + j - first) * row : cache + (size_t(seq) * size_t(kv.n_cells) + size_t(j % kv.n_cells)) * row;
  };
  float* sc = buf;
  float* kf = buf + max_len + 1;
  float* vf = kf + D;
  for (int h = 0; h < a.n_head; ++h) {
    const int g = h / n_rep;
    const float* q = a.q + size_t(t) * a.q_stride + size_t(h) * size_t(D);
    for (int j = 0; j < n; ++j) {
      dequantize_row(kv.type, cell(kv.k, a.k_new, kv.k_row, lo + j) + size_t(g) * kh, kf, D);
      float s = 0;
      for (int i = 0; i < D; ++i) s += q[i] * kf[i];
      sc[j] = s * a.scale;
      if (a.softcap > 0) sc[j] = a.softcap * std::tanh(sc[j] / a.softcap);
    }
    if (a.sinks) sc[n] = a.sinks[h];  // the sink: a logit whose probability weighs no value
    cpu::softmax(sc, n + (a.sinks != nullptr));
    float* out = a.out + size_t(t) * a.out_stride + size_t(h) * size_t(D);
    std::fill(out, out + D, 0.0f);
    for (int j = 0; j < n; ++j) {
      dequantize_row(kv.type, cell(kv.v, a.v_new, kv.v_row, lo + j) + size_t(g) * vh, vf, D);
      for (int i = 0; i < D; ++i) out[i] += sc[j] * vf[i];
    }
  }
}

}  // namespace

// BATON_CUDA_EMULATE=N (1..8) shows N emulated devices. Distinct devices can access each other's
// memory unless BATON_CUDA_EMULATE_PEER=0 (a machine whose GPUs cannot peer: the host-staged link).
int device_count() {
  const char* e = std::getenv("BATON_CUDA_EMULATE");
  return e && e[0] >= '1' && e[0] <= '8' && e[1] == 0 ? e[0] - '0' : 0;
}

// ---- DeviceBuffer ----

DeviceBuffer::DeviceBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  p_ = poisoned_alloc(bytes);
  if (!p_) oom_error(fmt::format("CUDA device (host emulation): cannot allocate {} bytes", bytes));
}

DeviceBuffer::~DeviceBuffer() { std::free(p_); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
  o.p_ = nullptr;
  o.n_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {  // o frees what this held
  std::swap(p_, o.p_);
  std::swap(n_, o.n_);
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  BATON_CHECK(offset + bytes <= n_);
  if (bytes) std::memcpy(static_cast<uint8_t*>(p_) + offset, host, bytes);
}

void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  BATON_CHECK(offset + bytes <= n_);
  if (bytes) std::memcpy(host, static_cast<const uint8_t*>(p_) + offset, bytes);
}

DeviceBuffer upload_weight(GgmlType t, const void* host_rows, int64_t rows, int64_t cols, Weight& out) {
  const size_t stride = packed_row_bytes(t, cols);
  DeviceBuffer buf(stride * size_t(rows));
  pack_rows(t, host_rows, buf.get(), rows, cols);
  out = Weight{t, buf.get(), rows, cols, stride};
  return buf;
}

void copy_to_device(Context&, void* dst, const void* host, size_t bytes) { std::memcpy(dst, host, bytes); }
void copy_to_host(Context&, void* host, const void* src, size_t bytes) { std::memcpy(host, src, bytes); }
void copy_on_device(Context&, void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void zero(Context&, void* p, size_t bytes) { std::memset(p, 0, bytes); }

// ---- graphs: the recording function is the graph (ops run at launch, never at capture) ----

Graph::~Graph() = default;
Graph::Graph(Graph&& o) noexcept : exec_(o.exec_), replay_(std::move(o.replay_)) { o.exec_ = nullptr; }
Graph& Graph::operator=(Graph&& o) noexcept {
  std::swap(exec_, o.exec_);
  std::swap(replay_, o.replay_);
  return *this;
}
Graph capture(Context&, const std::function<void()>& record) {
  Graph g;
  g.replay_ = record;
  return g;
}
void launch(Context&, const Graph& g) {
  BATON_CHECK(g.replay_);
  g.replay_();
}

// ---- weights through staging buffers (here: packed straight into the new buffer) ----

struct WeightUploader::Impl {
  size_t staging = 0;
};
WeightUploader::WeightUploader(Context&, size_t staging_bytes) : impl_(new Impl{staging_bytes}) {}
WeightUploader::~WeightUploader() { delete impl_; }
DeviceBuffer WeightUploader::upload(GgmlType t, const void* host_rows, int64_t rows, int64_t cols, Weight& out) {
  if (packed_row_bytes(t, cols) > impl_->staging)
    input_error(fmt::format("CUDA upload: a row of {} bytes does not fit the {}-byte staging buffer",
                            packed_row_bytes(t, cols), impl_->staging));
  return upload_weight(t, host_rows, rows, cols, out);
}
void WeightUploader::finish() {}

// ---- between devices ----

PinnedBuffer::PinnedBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  p_ = poisoned_alloc(bytes);
  if (!p_) oom_error(fmt::format("cannot pin {} bytes of host memory (host emulation)", bytes));
}
PinnedBuffer::~PinnedBuffer() { std::free(p_); }
PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
  o.p_ = nullptr;
  o.n_ = 0;
}
PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  std::swap(p_, o.p_);
  std::swap(n_, o.n_);
  return *this;
}

// Every op has finished when it returns: an event has nothing to order.
Event::Event() = default;
Event::~Event() = default;
Event::Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
Event& Event::operator=(Event&& o) noexcept {
  std::swap(e_, o.e_);
  return *this;
}
void Event::record(Context&) {}
void Event::wait(Context&) const {}

namespace {
void check_device(int d) {
  if (d < 0 || d >= device_count()) usage_error(fmt::format("CUDA device {} does not exist ({} visible)", d, device_count()));
}
}  // namespace

bool peer_possible(int a, int b) {
  if (a == b) return true;
  if (a < 0 || b < 0 || a >= device_count() || b >= device_count()) return false;
  const char* e = std::getenv("BATON_CUDA_EMULATE_PEER");
  return !(e && std::string(e) == "0");
}

void enable_peer(int a, int b) {
  check_device(a);
  check_device(b);
  if (!peer_possible(a, b))
    usage_error(fmt::format("CUDA devices {} and {}: peer access refused (host emulation without peer access); "
                            "use --p2p off to copy through host memory", a, b));
}

void copy_peer(Context& src, void* dst, int dst_device, const void* src_ptr, size_t bytes) {
  check_device(dst_device);
  if (!peer_possible(src.device(), dst_device))
    input_error(fmt::format("CUDA copy from device {} to {}: peer access is not possible", src.device(), dst_device));
  std::memcpy(dst, src_ptr, bytes);
}

// ---- Context ----

Context::Context(int device, void* stream) : device_(device), stream_(stream) {
  const int n = device_count();
  if (device < 0 || device >= n)
    usage_error(fmt::format("CUDA device {} does not exist ({} visible)", device, n));
}

Context::~Context() { std::free(scratch_); }

void Context::make_current() const {}
void Context::synchronize() const {}

void Context::reserve(size_t bytes) {
  if (bytes <= scratch_bytes_) return;
  std::free(scratch_);
  scratch_ = nullptr;
  scratch_bytes_ = 0;
  bytes = (bytes + 0xFFFFF) & ~size_t(0xFFFFF);  // whole MiB, as the device's
  scratch_ = poisoned_alloc(bytes);
  if (!scratch_) oom_error(fmt::format("CUDA device {} (host emulation): cannot allocate {} bytes of scratch", device_, bytes));
  scratch_bytes_ = bytes;
  ++scratch_generation_;
}

void* Context::scratch(size_t bytes) {
  reserve(bytes);
  return scratch_;
}

// ---- Weights and matrix products ----

size_t q8_act_bytes(int64_t cols, int n) {
  const size_t q = (size_t(cols) * size_t(n) + 255) / 256 * 256;  // keep ds 16-byte aligned
  return q + size_t(cols / 32) * size_t(n) * 2 * sizeof(float);
}

void quantize_act(Context&, const float* x, int64_t cols, int n, int8_t* qs, float* ds) {
  if (cols % 32 != 0) input_error(fmt::format("CUDA quantize_act: {} values per row is not a multiple of 32", cols));
  const int64_t blocks = cols / 32 * n;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * 32;
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = amax > 0.0f ? int(std::nearbyint(v[i] / d)) : 0;  // round half to even, as __float2int_rn
      qs[b * 32 + i] = int8_t(q);
      sum += q;
    }
    ds[2 * b] = d;
    ds[2 * b + 1] = d * float(sum);
  }
}

Q8Act q8_scratch(Context& c, int64_t cols, int n) {
  if (cols % 32 != 0) input_error(fmt::format("CUDA q8_scratch: {} values per row is not a multiple of 32", cols));
  auto* base = static_cast<uint8_t*>(c.scratch(q8_act_bytes(cols, n)));
  return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + (size_t(cols) * size_t(n) + 255) / 256 * 256)};
}

// x_q8 changes nothing here: the emulated GEMV quantizes X itself, to the same bytes the
// producing op wrote.
void matmul(Context& c, const Weight& W, const float* X, int n, float* Y, bool) {
  if (n <= c.gemv_max_cols) gemv(c, W, X, n, Y);
  else gemm(c, W, X, n, Y);
}

void gemm_n(Context& c, const Weight* const* W, float* const* Y, int count, const float* X, int n) {
  for (int i = 0; i < count; ++i) gemm(c, *W[i], X, n, Y[i]);
}

void matmul_n(Context& c, const MatmulOut* outs, int count, const float* X, int n, bool) {
  for (int i = 0; i < count; ++i) matmul(c, *outs[i].W, X, n, outs[i].Y);
}
void matmul_n(Context& c, std::initializer_list<MatmulOut> outs, const float* X, int n, bool x_q8) {
  matmul_n(c, outs.begin(), int(outs.size()), X, n, x_q8);
}

void gemv_stream_prepare() {}  // no kernels to ask about
GemvTiming tune_gemv(Context&, const std::vector<std::vector<MatmulOut>>&, const float*, int, bool, int) {
  return {};  // one form: nothing to choose
}

// What the dp4a kernel computes: the activations quantized once to 8-bit blocks of 32
// (quantize_act), each block's dot with the weights scaled by its d (the (d, d * sum) pair covers
// the weights' minimums); float weights take the F32 activations.
void gemv(Context& c, const Weight& W, const float* X, int n, float* Y) {
  check_weight(W, "gemv");
  if (n <= 0) return;
  const size_t cols = size_t(W.cols), nb = cols / 32;
  const bool q8 = q8_activations(W.type);
  const size_t act = q8 ? align_up(q8_act_bytes(W.cols, n), kAlign) : 0;
  auto* base = static_cast<uint8_t*>(c.scratch(gemv_scratch_bytes(W, n)));
  auto* qs = reinterpret_cast<int8_t*>(base);
  auto* ds = reinterpret_cast<float*>(base + (cols * size_t(n) + 255) / 256 * 256);
  auto* w = reinterpret_cast<float*>(base + act);
  uint8_t* gguf_row = base + act + align_up(cols * sizeof(float), kAlign);
  if (q8) quantize_act(c, X, W.cols, n, qs, ds);
  for (int64_t r = 0; r < W.rows; ++r) {
    dequantize_weight_row(W, r, gguf_row, w);
    for (int j = 0; j < n; ++j) {
      float acc = 0;
      if (q8) {
        for (size_t b = 0; b < nb; ++b) {
          const int8_t* q = qs + size_t(j) * cols + b * 32;
          float dot = 0;
          for (int i = 0; i < 32; ++i) dot += w[b * 32 + size_t(i)] * float(q[i]);
          acc += dot * ds[2 * (size_t(j) * nb + b)];
        }
      } else {
        const float* x = X + size_t(j) * cols;
        for (size_t i = 0; i < cols; ++i) acc += w[i] * x[i];
      }
      Y[size_t(j) * size_t(W.rows) + size_t(r)] = acc;
    }
  }
}

// What the FP16 cuBLAS path rounds: weights and activations to FP16 (activations of quantized
// weights first to quantize_act's 8-bit grid), products summed in F32.
void gemm(Context& c, const Weight& W, const float* X, int n, float* Y) {
  check_weight(W, "gemm");
  if (n <= 0) return;
  const size_t cols = size_t(W.cols), xbytes = align_up(size_t(n) * cols * sizeof(float), kAlign);
  auto* base = static_cast<uint8_t*>(c.scratch(gemm_scratch_bytes(W, n)));
  float* xh = reinterpret_cast<float*>(base);
  float* w = reinterpret_cast<float*>(base + xbytes);
  uint8_t* gguf_row = base + xbytes + align_up(cols * sizeof(float), kAlign);
  const size_t nx = size_t(n) * cols;
  std::vector<int8_t> q;
  std::vector<float> ds;
  if (q8_activations(W.type)) {  // the 8-bit grid first, as quantize_act makes it
    q.resize(nx);
    ds.resize(nx / 32 * 2);
    quantize_act(c, X, W.cols, n, q.data(), ds.data());
  }
  for (size_t i = 0; i < nx; ++i) {
    const float v = q.empty() ? X[i] : float(q[i]) * ds[i / 32 * 2];
    xh[i] = round_f16(std::clamp(v, -65504.0f, 65504.0f));
  }
  for (int64_t r = 0; r < W.rows; ++r) {
    dequantize_weight_row(W, r, gguf_row, w);
    for (size_t i = 0; i < cols; ++i) w[i] = round_f16(w[i]);
    for (int j = 0; j < n; ++j) {
      const float* x = xh + size_t(j) * cols;
      float acc = 0;
      for (size_t i = 0; i < cols; ++i) acc += w[i] * x[i];
      Y[size_t(j) * size_t(W.rows) + size_t(r)] = acc;
    }
  }
}

size_t matmul_scratch_bytes(const Context& c, const Weight& W, int n) {
  return n <= c.gemv_max_cols ? gemv_scratch_bytes(W, n) : gemm_scratch_bytes(W, n);
}

void dequantize_f16(Context&, const Weight& W, int64_t row0, int64_t nrows, uint16_t* dst) {
  BATON_CHECK(row0 >= 0 && nrows >= 0 && row0 + nrows <= W.rows);
  std::vector<uint8_t> gguf_row(row_bytes(W.type, W.cols));
  std::vector<float> f(size_t(W.cols));
  for (int64_t r = 0; r < nrows; ++r) {
    dequantize_weight_row(W, row0 + r, gguf_row.data(), f.data());
    for (int64_t i = 0; i < W.cols; ++i) dst[size_t(r * W.cols + i)] = f32_to_fp16(f[size_t(i)]);
  }
}

// ---- Norms, positions, activations ----

void rms_norm(Context& c, const float* x, const float* w, float* y, int rows, int n, float eps, Q8Act q8) {
  cpu::rms_norm(x, w, y, rows, n, eps);
  if (q8.qs) quantize_act(c, y, n, rows, q8.qs, q8.ds);
}

void add_rms_norm(Context& c, float* x, const float* d, const float* w, float* y, int rows, int n, float eps,
                  Q8Act q8, float ds) {
  add(c, x, d, int64_t(rows) * n, ds);
  rms_norm(c, x, w, y, rows, n, eps, q8);
}

void rope(Context&, float* x, int n_tok, size_t stride, int n_head, int head_dim, int rope_dim, const int32_t* pos,
          const float* freqs, bool neox, float mscale) {
  if (rope_dim < 0 || rope_dim % 2 != 0 || rope_dim > head_dim)
    input_error(fmt::format("CUDA rope: rope_dim {} must be even and at most head_dim {}", rope_dim, head_dim));
  if (rope_dim == 0) return;  // (a NoPE layer, nothing rotates)
  const int half = rope_dim / 2;
  std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
  for (int t = 0; t < n_tok; ++t) {
    cpu::rope_angles(pos[t], freqs, half, cs.data(), sn.data(), mscale);
    cpu::rope_rotate(x + size_t(t) * stride, n_head, head_dim, rope_dim, cs.data(), sn.data(), neox);
  }
}

void rope_qk(Context& c, const RopeRows& q, const RopeRows& k, int n_tok, int head_dim, int rope_dim,
             const int32_t* pos, const float* freqs, bool neox, float mscale) {
  rope(c, q.x, n_tok, q.stride, q.n_head, head_dim, rope_dim, pos, freqs, neox, mscale);
  rope(c, k.x, n_tok, k.stride, k.n_head, head_dim, rope_dim, pos, freqs, neox, mscale);
}

void silu_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8) {
  in_pieces(n, [&](int64_t i, int m) { cpu::silu_gate(g + i, u + i, y + i, m); });
  if (q8.qs) quantize_act(c, y, n, 1, q8.qs, q8.ds);
}
void gelu_tanh_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8) {
  in_pieces(n, [&](int64_t i, int m) { cpu::gelu_tanh_gate(g + i, u + i, y + i, m); });
  if (q8.qs) quantize_act(c, y, n, 1, q8.qs, q8.ds);
}
void swiglu_oai_gate(Context& c, const float* g, const float* u, float* y, int64_t n, Q8Act q8) {
  in_pieces(n, [&](int64_t i, int m) { cpu::swiglu_oai_gate(g + i, u + i, y + i, m); });
  if (q8.qs) quantize_act(c, y, n, 1, q8.qs, q8.ds);
}
void add(Context&, float* y, const float* x, int64_t n, float s) {
  in_pieces(n, [&](int64_t i, int m) { cpu::add(y + i, x + i, m, s); });
}
void add_rows(Context&, float* y, const float* bias, int rows, int64_t width) {
  for (int r = 0; r < rows; ++r) cpu::add(y + size_t(r) * size_t(width), bias, int(width));
}
void scale(Context&, float* y, float s, int64_t n) {
  in_pieces(n, [&](int64_t i, int m) { cpu::scale(y + i, s, m); });
}
void softcap(Context&, float* y, float cap, int64_t n) {
  in_pieces(n, [&](int64_t i, int m) { cpu::softcap(y + i, cap, m); });
}

void gather_rows(Context&, const float* x, const int32_t* rows, int m, int width, float* y) {
  if (m > 0) cpu::gather_rows(x, rows, m, width, y);
}
void scatter_add_rows(Context&, float* acc, const float* y, const int32_t* rows, const float* w, bool sigmoid_w,
                      int m, int width) {
  if (m > 0) cpu::scatter_add_rows(acc, y, rows, w, sigmoid_w, m, width);
}

void moe_route(Context&, const float* logits, int n, int n_expert, int k, bool renorm, int32_t* ids, float* w) {
  if (n_expert < 1 || n_expert > kMoeRouteMaxExperts || k < 1)
    input_error(fmt::format("CUDA moe_route: {} experts, {} used", n_expert, k));
  std::vector<float> row(static_cast<size_t>(n_expert));
  for (int t = 0; t < n; ++t) {  // (cpu::moe_route changes its row)
    std::copy(logits + size_t(t) * size_t(n_expert), logits + size_t(t + 1) * size_t(n_expert), row.begin());
    cpu::moe_route(row.data(), n_expert, k, renorm, ids + size_t(t) * size_t(k), w + size_t(t) * size_t(k));
  }
}
void gemv_experts(Context& c, const ExpertOut* outs, int count, const float* X, int x_div, const int32_t* ids,
                  int pairs, bool) {
  for (int i = 0; i < count; ++i) {
    const ExpertWeights& W = *outs[i].W;
    for (int p = 0; p < pairs; ++p) {
      if (ids[p] < 0) continue;
      Weight e = W.first;
      e.data = static_cast<const uint8_t*>(W.first.data) + size_t(ids[p]) * W.expert_bytes;
      gemv(c, e, X + size_t(p / x_div) * size_t(e.cols), 1, outs[i].Y + size_t(p) * size_t(e.rows));
    }
  }
}
void add_rows_id(Context&, float* y, const float* bias, const int32_t* ids, int pairs, int width) {
  for (int p = 0; p < pairs; ++p)
    if (ids[p] >= 0) cpu::add(y + size_t(p) * size_t(width), bias + size_t(ids[p]) * size_t(width), width);
}
void moe_combine(Context&, float* acc, const float* ye, const int32_t* ids, const float* w, int n, int k, int width) {
  for (int t = 0; t < n; ++t) {
    float* a = acc + size_t(t) * size_t(width);
    std::fill(a, a + width, 0.f);
    std::vector<int> order(static_cast<size_t>(k));  // the token's experts in ascending id, as the kernel
    for (int j = 0; j < k; ++j) order[size_t(j)] = j;
    const int32_t* tid = ids + size_t(t) * size_t(k);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return tid[a] < tid[b]; });
    for (int j : order) {
      const size_t p = size_t(t) * size_t(k) + size_t(j);
      const int32_t row0 = 0;
      if (ids[p] >= 0) cpu::scatter_add_rows(a, ye + p * size_t(width), &row0, w + p, false, 1, width);
    }
  }
}

void embed_rows(Context&, const Weight& table, const int32_t* ids, int n, float* out, float s) {
  if (n <= 0) return;
  check_weight(table, "embed_rows");
  std::vector<uint8_t> gguf_row(row_bytes(table.type, table.cols));
  const int32_t zero = 0;
  for (int i = 0; i < n; ++i) {
    BATON_CHECK(ids[i] >= 0 && ids[i] < table.rows);
    cpu::embed_rows(unpacked_row(table, ids[i], gguf_row.data()), &zero, 1, out + size_t(i) * size_t(table.cols), s);
  }
}

// ---- Attention ----

void kv_convert(Context&, GgmlType type, const float* src, size_t src_stride, uint8_t* dst, size_t dst_row, int width,
                int n) {
  if (n <= 0) return;
  if (type == GgmlType::Q8_0 && width % 32)
    input_error(fmt::format("CUDA kv_convert: Q8_0 rows need a multiple of 32 values, got {}", width));
  if (type != GgmlType::F16 && type != GgmlType::Q8_0)
    input_error(fmt::format("CUDA kv_convert: KV type {} is not F16 or Q8_0", type_name(type)));
  for (int r = 0; r < n; ++r) cpu::kv_convert(type, src + size_t(r) * src_stride, dst + size_t(r) * dst_row, width);
}

void kv_convert_kv(Context& c, GgmlType type, const KvRows& k, const KvRows& v, int n) {
  kv_convert(c, type, k.src, k.src_stride, k.dst, k.dst_row, k.width, n);
  kv_convert(c, type, v.src, v.src_stride, v.dst, v.dst_row, v.width, n);
}

void rope_stage(Context& c, GgmlType type, const RopeRows& q, const KvRows& k, const KvRows& v, int n_tok, int head_dim,
                int rope_dim, const int32_t* pos, const float* freqs, bool neox, float mscale) {
  std::vector<float> kr(size_t(n_tok) * size_t(k.width));  // k rotated; its F32 rows stay as they were
  for (int t = 0; t < n_tok; ++t)
    std::copy_n(k.src + size_t(t) * k.src_stride, k.width, kr.data() + size_t(t) * size_t(k.width));
  rope_qk(c, q, {kr.data(), size_t(k.width), k.width / head_dim}, n_tok, head_dim, rope_dim, pos, freqs, neox, mscale);
  kv_convert_kv(c, type, {kr.data(), size_t(k.width), k.dst, k.dst_row, k.width}, v, n_tok);
}

void kv_commit(Context&, const KvLayer& kv, const KvCommit& m) {
  const int n = m.n;
  if (n <= 0) return;
  const int32_t *row = m.row, *seq = m.seq, *pos = m.pos;
  const uint8_t *k_new = m.k_new, *v_new = m.v_new;
  // The kernel copies the tokens' rows in parallel: two tokens writing one cell leave either.
  std::vector<size_t> cells(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) cells[size_t(t)] = size_t(seq[t]) * size_t(kv.n_cells) + size_t(pos[t] % kv.n_cells);
  std::vector<size_t> sorted = cells;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    input_error(fmt::format("CUDA kv_commit: two of the {} tokens write the same cache cell (of {} per sequence); "
                            "the order of the device's writes is undefined", n, kv.n_cells));
  for (int t = 0; t < n; ++t) {
    std::memcpy(kv.k + cells[size_t(t)] * kv.k_row, k_new + size_t(row[t]) * kv.k_row, kv.k_row);
    std::memcpy(kv.v + cells[size_t(t)] * kv.v_row, v_new + size_t(row[t]) * kv.v_row, kv.v_row);
  }
}

size_t attention_scratch_bytes(const Context&, int n_tokens, int, int head_dim, int max_len) {
  if (n_tokens <= 0 || max_len <= 0) return 0;
  return (size_t(max_len) + 1 + 2 * size_t(head_dim)) * sizeof(float);
}

// q8_out changes nothing here: the emulated GEMV quantizes its input itself. The commit follows
// the attention, as in the combine kernel. With rope: rope_stage first, on a copy of q (the
// kernels leave q as it is), for batches of one token per sequence only (as the kernels).
void attention(Context& c, const AttentionArgs& a, int max_len, bool, const KvCommit& commit, const RopeStage& rope) {
  check_attention(a);
  if (a.n_tokens <= 0) return;
  if (max_len <= 0) input_error(fmt::format("CUDA attention: max_len {} must be positive", max_len));
  AttentionArgs b = a;
  std::vector<float> q;
  if (rope.k) {
    for (int t = 0; t < a.n_tokens; ++t)
      if (a.first[t] != a.pos[t] || a.row0[t] != t)
        input_error(fmt::format("CUDA attention with rope: token {} is not its sequence's only one in the step", t));
    const int d = a.kv.head_dim, kw = a.kv.n_head_kv * d;
    q.assign(a.q, a.q + size_t(a.n_tokens - 1) * a.q_stride + size_t(a.n_head) * size_t(d));
    b.q = q.data();
    rope_stage(c, a.kv.type, {q.data(), a.q_stride, a.n_head},
               {rope.k, rope.k_stride, const_cast<uint8_t*>(a.k_new), a.kv.k_row, kw},
               {rope.v, rope.v_stride, const_cast<uint8_t*>(a.v_new), a.kv.v_row, kw}, a.n_tokens, d, rope.rope_dim,
               a.pos, rope.freqs, rope.neox, rope.mscale);
  }
  auto* buf = static_cast<float*>(c.scratch(attention_scratch_bytes(c, a.n_tokens, a.n_head, a.kv.head_dim, max_len)));
  for (int t = 0; t < a.n_tokens; ++t) attend(b, t, a.pos[t], a.seq[t], a.first[t], a.row0[t], max_len, buf);
  kv_commit(c, a.kv, commit);
}

void attention_prefill(Context& c, const AttentionArgs& a, int seq, int pos0, int row0) {
  check_attention(a);
  if (a.n_tokens <= 0) return;
  const int max_len = pos0 + a.n_tokens;
  auto* buf = static_cast<float*>(c.scratch(attention_scratch_bytes(c, a.n_tokens, a.n_head, a.kv.head_dim, max_len)));
  for (int t = 0; t < a.n_tokens; ++t) attend(a, t, pos0 + t, seq, pos0, row0, max_len, buf);
}

// ---- Sampling ----

size_t sampling_scratch_bytes(int, int, int) { return 0; }  // the emulation samples in place

void argmax(Context&, const float* logits, int n_vocab, int n, int32_t* out) {
  if (n <= 0) return;
  if (n_vocab <= 0) input_error(fmt::format("CUDA argmax: empty rows (n_vocab {})", n_vocab));
  for (int r = 0; r < n; ++r) out[r] = cpu::argmax(logits + size_t(r) * size_t(n_vocab), n_vocab);
}

void top_k(Context&, const float* logits, int n_vocab, int n, int k, int32_t* idx, float* val) {
  constexpr int kMaxTopK = 256;
  if (k < 1 || k > std::min(kMaxTopK, n_vocab))
    input_error(fmt::format("CUDA top_k: k = {} must be within 1..{}", k, std::min(kMaxTopK, n_vocab)));
  std::vector<int32_t> order(static_cast<size_t>(n_vocab));
  for (int r = 0; r < n; ++r) {
    const float* x = logits + size_t(r) * size_t(n_vocab);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    for (int i = 0; i < k; ++i) {
      idx[size_t(r) * size_t(k) + size_t(i)] = order[size_t(i)];
      val[size_t(r) * size_t(k) + size_t(i)] = x[order[size_t(i)]];
    }
  }
}

}  // namespace baton::cuda
