// Context (device, stream, cuBLAS handle, scratch), device buffers and the error path.
#include <algorithm>
#include <utility>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace baton::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// ---- DeviceBuffer ----

DeviceBuffer::DeviceBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMalloc(&p_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    int dev = -1;
    cudaGetDevice(&dev);
    oom_error(cat("CUDA device ", dev, ": cannot allocate ", bytes, " bytes (", cudaGetErrorString(e), ")"));
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (p_) cudaFree(p_);  // errors on teardown cannot be acted on
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
  o.p_ = nullptr;
  o.n_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFree(p_);
    p_ = o.p_;
    n_ = o.n_;
    o.p_ = nullptr;
    o.n_ = 0;
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  CUDA_ASSERT(offset + bytes <= n_);
  CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(p_) + offset, host, bytes, cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return once the bytes are staged, before they land, and
  // the contexts' streams are non-blocking (not ordered after the legacy stream): wait for it, so
  // that an op enqueued next on any stream sees the data.
  CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  CUDA_ASSERT(offset + bytes <= n_);
  CUDA_CHECK(cudaMemcpy(host, static_cast<const uint8_t*>(p_) + offset, bytes, cudaMemcpyDeviceToHost));
}

DeviceBuffer upload_weight(GgmlType t, const void* host_rows, int64_t rows, int64_t cols, Weight& out) {
  const size_t stride = packed_row_bytes(t, cols);
  std::vector<uint8_t> packed(stride * size_t(rows));
  pack_rows(t, host_rows, packed.data(), rows, cols);
  DeviceBuffer buf(packed.size());
  buf.upload(packed.data(), packed.size());
  out = Weight{t, buf.get(), rows, cols, stride};
  return buf;
}

struct WeightUploader::Impl {
  Context& c;
  PinnedBuffer buf[2];
  cudaEvent_t done[2] = {nullptr, nullptr};  // recorded after the last copy out of buf[i]
  int next = 0;
  Impl(Context& ctx, size_t bytes) : c(ctx) {
    for (int i = 0; i < 2; ++i) {
      buf[i] = PinnedBuffer(bytes);
      CUDA_CHECK(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming));
    }
  }
  ~Impl() {
    for (cudaEvent_t e : done)
      if (e) cudaEventDestroy(e);
  }
};

WeightUploader::WeightUploader(Context& c, size_t staging_bytes) : impl_(new Impl(c, staging_bytes)) {}
WeightUploader::~WeightUploader() {
  cudaStreamSynchronize(static_cast<cudaStream_t>(impl_->c.stream()));  // no copy may outlive its buffer
  delete impl_;
}

DeviceBuffer WeightUploader::upload(GgmlType t, const void* host_rows, int64_t rows, int64_t cols, Weight& out) {
  Impl& u = *impl_;
  const size_t stride = packed_row_bytes(t, cols), in_stride = row_bytes(t, cols);
  const int64_t slab = std::max<int64_t>(1, int64_t(u.buf[0].size() / stride));
  CUDA_ASSERT(stride <= u.buf[0].size());
  DeviceBuffer dev(stride * size_t(rows));
  cudaStream_t s = static_cast<cudaStream_t>(u.c.stream());
  for (int64_t r0 = 0; r0 < rows; r0 += slab) {
    const int64_t n = std::min(slab, rows - r0);
    const int i = u.next;
    u.next ^= 1;
    CUDA_CHECK(cudaEventSynchronize(u.done[i]));  // buf[i]'s previous copy has left
    pack_rows(t, static_cast<const uint8_t*>(host_rows) + size_t(r0) * in_stride, u.buf[i].get(), n, cols);
    CUDA_CHECK(cudaMemcpyAsync(dev.as<uint8_t>() + size_t(r0) * stride, u.buf[i].get(), stride * size_t(n),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaEventRecord(u.done[i], s));
  }
  out = Weight{t, dev.get(), rows, cols, stride};
  return dev;
}

void WeightUploader::finish() { impl_->c.synchronize(); }

void copy_to_device(Context& c, void* dst, const void* host, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(c.stream())));
}
void copy_to_host(Context& c, void* host, const void* src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(c.stream())));
}
void copy_on_device(Context& c, void* dst, const void* src, size_t bytes) {
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(c.stream())));
}

void zero(Context& c, void* p, size_t bytes) {
  if (bytes > 0) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(c.stream())));
}

// ---- graphs ----

Graph::~Graph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}
Graph::Graph(Graph&& o) noexcept : exec_(o.exec_), replay_(std::move(o.replay_)) { o.exec_ = nullptr; }
Graph& Graph::operator=(Graph&& o) noexcept {
  std::swap(exec_, o.exec_);
  std::swap(replay_, o.replay_);
  return *this;
}

Graph capture(Context& c, const std::function<void()>& record) {
  cudaStream_t s = static_cast<cudaStream_t>(c.stream());
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    record();
  } catch (...) {
    if (cudaStreamEndCapture(s, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  CUDA_CHECK(e);
  Graph g;
  g.exec_ = exec;
  return g;
}

void launch(Context& c, const Graph& g) {
  CUDA_ASSERT(g.exec_ != nullptr);
  CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g.exec_), static_cast<cudaStream_t>(c.stream())));
}

// ---- between devices ----

PinnedBuffer::PinnedBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMallocHost(&p_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    p_ = nullptr;
    oom_error(cat("cannot pin ", bytes, " bytes of host memory (", cudaGetErrorString(e), ")"));
  }
}

PinnedBuffer::~PinnedBuffer() {
  if (p_) cudaFreeHost(p_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
  o.p_ = nullptr;
  o.n_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFreeHost(p_);
    p_ = o.p_;
    n_ = o.n_;
    o.p_ = nullptr;
    o.n_ = 0;
  }
  return *this;
}

Event::Event() {
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  e_ = e;
}
Event::~Event() {
  if (e_) cudaEventDestroy(static_cast<cudaEvent_t>(e_));
}
Event::Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
Event& Event::operator=(Event&& o) noexcept {
  std::swap(e_, o.e_);
  return *this;
}
void Event::record(Context& c) {
  CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e_), static_cast<cudaStream_t>(c.stream())));
}
void Event::wait(Context& c) const {
  CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(c.stream()), static_cast<cudaEvent_t>(e_), 0));
}

bool peer_possible(int a, int b) {
  if (a == b) return true;
  int ab = 0, ba = 0;
  if (cudaDeviceCanAccessPeer(&ab, a, b) != cudaSuccess || cudaDeviceCanAccessPeer(&ba, b, a) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return ab && ba;
}

void enable_peer(int a, int b) {
  if (a == b) return;
  int current = 0;
  CUDA_CHECK(cudaGetDevice(&current));
  for (const auto& [from, to] : {std::pair<int, int>{a, b}, std::pair<int, int>{b, a}}) {
    CUDA_CHECK(cudaSetDevice(from));
    const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else if (e != cudaSuccess) {
      cudaGetLastError();
      cudaSetDevice(current);
      usage_error(cat("CUDA devices ", from, " and ", to, ": peer access refused (", cudaGetErrorString(e),
                      "); use --p2p off to copy through host memory"));
    }
  }
  CUDA_CHECK(cudaSetDevice(current));
}

void copy_peer(Context& src, void* dst, int dst_device, const void* src_ptr, size_t bytes) {
  cudaStream_t s = static_cast<cudaStream_t>(src.stream());
  if (dst_device == src.device()) CUDA_CHECK(cudaMemcpyAsync(dst, src_ptr, bytes, cudaMemcpyDeviceToDevice, s));
  else CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src_ptr, src.device(), bytes, s));
}

// ---- Context ----

size_t cublas_workspace_bytes(int cc_major) { return size_t(cc_major >= 9 ? 32 : 4) << 20; }

Context::Context(int device, void* stream) : device_(device) {
  const int n = device_count();
  if (device < 0 || device >= n)
    usage_error(cat("CUDA device ", device, " does not exist (", n, " visible)"));
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
  int cc_major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device));
  early_launch = cc_major >= 9;
  mma_prefill = cc_major >= 8;
  try {
    if (stream) {
      stream_ = stream;
    } else {
      cudaStream_t s = nullptr;
      CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      stream_ = s;
      own_stream_ = true;
    }
    cublasHandle_t h = nullptr;
    CUBLAS_CHECK(cublasCreate(&h));
    cublas_ = h;
    CUBLAS_CHECK(cublasSetStream(h, static_cast<cudaStream_t>(stream_)));
    // After cublasSetStream, which resets the handle to cuBLAS's own workspace pool.
    const size_t ws = cublas_workspace_bytes(cc_major);
    if (cudaMalloc(&cublas_workspace_, ws) != cudaSuccess) {
      cudaGetLastError();
      cublas_workspace_ = nullptr;
      oom_error(cat("CUDA device ", device, ": cannot allocate the cuBLAS workspace (", ws >> 20, " MiB)"));
    }
    CUBLAS_CHECK(cublasSetWorkspace(h, cublas_workspace_, ws));
    const size_t cb = size_t(kCounters + kAttnCounters) * sizeof(uint32_t);
    if (cudaMalloc(&counters_, cb) != cudaSuccess) {
      cudaGetLastError();
      counters_ = nullptr;
      oom_error(cat("CUDA device ", device, ": cannot allocate ", cb, " bytes of counters"));
    }
    // On the context's stream: a plain cudaMemset goes to the legacy default stream, which a
    // non-blocking stream does not wait for (the simulator's lazy streams ran a kernel first).
    CUDA_CHECK(cudaMemsetAsync(counters_, 0, cb, static_cast<cudaStream_t>(stream_)));
    CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  } catch (...) {
    release();
    throw;
  }
}

Context::~Context() { release(); }

void Context::release() {
  cudaSetDevice(device_);
  if (scratch_) cudaFree(scratch_);
  if (cublas_) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  if (cublas_workspace_) cudaFree(cublas_workspace_);
  if (counters_) cudaFree(counters_);
  if (own_stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  scratch_ = cublas_ = cublas_workspace_ = stream_ = nullptr;
  counters_ = nullptr;
  own_stream_ = false;
}

void Context::make_current() const { CUDA_CHECK(cudaSetDevice(device_)); }

void Context::synchronize() const {
  CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
}

void Context::reserve(size_t bytes) {
  if (bytes <= scratch_bytes_) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
  if (cap != cudaStreamCaptureStatusNone)
    oom_error(cat("CUDA device ", device_, ": scratch of ", bytes, " bytes needed during graph capture but only ",
                  scratch_bytes_, " reserved (reserve before capturing)"));
  CUDA_CHECK(cudaStreamSynchronize(s));  // earlier ops may still use the old buffer
  if (scratch_) CUDA_CHECK(cudaFree(scratch_));
  scratch_ = nullptr;
  scratch_bytes_ = 0;
  bytes = (bytes + 0xFFFFF) & ~size_t(0xFFFFF);  // whole MiB: fewer regrowths
  if (cudaMalloc(&scratch_, bytes) != cudaSuccess) {
    cudaGetLastError();
    scratch_ = nullptr;
    oom_error(cat("CUDA device ", device_, ": cannot allocate ", bytes, " bytes of scratch"));
  }
  scratch_bytes_ = bytes;
  ++scratch_generation_;
}

void* Context::scratch(size_t bytes) {
  reserve(bytes);
  return scratch_;
}

}  // namespace baton::cuda
