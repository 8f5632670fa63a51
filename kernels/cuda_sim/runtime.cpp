// The CUDA simulator's runtime: devices, memory, streams, events, graphs, peer access and the
// cuBLAS GEMM, on the host (BATON_CUDA=SIM builds; docs/GPU.md, "The CUDA simulator").
//
// Ordering model. Each stream is a queue. Work runs lazily, when something waits for it: a
// stream or event synchronize, a copy into pageable host memory, cudaFree, or a wait of another
// stream's work on an event. Waits between streams are explicit ops in the queues, and the legacy
// stream is ordered with blocking streams as CUDA orders it; non-blocking streams are ordered with
// nothing. So a consumer that forgets an event reads what the producer has not written yet, and a
// host that reads pinned memory before synchronizing reads stale bytes, as they can on a GPU.
// BATON_CUDASIM_ORDER=eager runs every op at once instead (the opposite schedule).
//
// Checks that abort or fail the call (a GPU would fault, corrupt or fail later):
//  - copies out of an allocation's bounds, or of the wrong kind (device pointer as host, ...);
//  - kernels launched with a bad configuration, on another device's stream, or with a pointer
//    argument into memory the device cannot reach (another device without peer access, or
//    pageable host memory);
//  - graph capture: synchronizing, allocating or freeing from the capturing thread, waiting on
//    an event from outside the capture, copies from pageable memory inside the capture;
//  - use of destroyed streams, events and graphs.
// Fresh device memory is filled with 0xFF bytes (NaN as F32 and F16) so that reads of memory
// nobody wrote show up in results (and so is each block's shared memory, fibers.cpp).
//
// Environment: BATON_CUDASIM_DEVICES (default 2), BATON_CUDASIM_MEMORY_MIB per device (8192),
// BATON_CUDASIM_P2P (1: devices may map each other's memory), BATON_CUDASIM_SMS (132),
// BATON_CUDASIM_ORDER (lazy | eager).
#include <array>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cublas_v2.h>
#include <cuda_fp16.h>

#include "kernels/cuda_sim/sim.h"

struct CUstream_st;
struct CUevent_st;

namespace cudasim {
namespace {

constexpr size_t kContextBytes = 320u << 20;  // what creating a context takes on each device
constexpr size_t kCublasBytes = 1u << 20;     // a cuBLAS handle (its workspace is the caller's)

struct Stream;

struct Op {
  std::string what;                 // for error messages
  std::function<void()> run;        // empty: a wait
  Stream* wait_stream = nullptr;    // wait until that stream has run `wait_seq` ops
  uint64_t wait_seq = 0;
};

struct Graph;

struct Stream {
  int device = 0;
  bool blocking = true, legacy = false, destroyed = false;
  std::deque<Op> queue;
  uint64_t enqueued = 0, done = 0;
  Graph* capture = nullptr;  // the graph being captured into, if any
  std::thread::id capture_thread;
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
  bool capture_broken = false;
};

struct Event {
  bool timing = true, destroyed = false, in_capture = false;
  Stream* stream = nullptr;  // the last record: this stream's first `seq` ops
  uint64_t seq = 0;
  uint64_t generation = 0;
  double ms = -1;  // host time the last record ran at
};

struct Graph {
  int device = 0;
  std::vector<Op> ops;
  bool destroyed = false;
};

struct Alloc {
  size_t size;
  int device;  // -1: pinned host memory
};

struct Device {
  size_t capacity = 0, used = 0;
  bool context = false;
  std::vector<bool> peer;  // peer[d]: this device may access d's memory
  Stream* legacy = nullptr;
};

struct Handle {
  int device;
  Stream* stream;  // nullptr: the legacy stream
  const void* workspace = nullptr;  // cublasSetWorkspace's; nullptr: cuBLAS's own pool
  bool destroyed = false;
};

struct State {
  std::recursive_mutex mu;
  std::vector<Device> devices;
  std::deque<std::unique_ptr<Stream>> streams;  // kept after destruction, to catch their use
  std::deque<std::unique_ptr<Event>> events;
  std::deque<std::unique_ptr<Graph>> graphs;
  std::deque<std::unique_ptr<Handle>> handles;
  std::map<uintptr_t, Alloc> allocs;
  bool p2p = true, eager = false;
  int sms = 132;
  bool fill = true;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

State& S() {
  static State* s = [] {
    auto* st = new State;  // never destroyed: handles may be released during static destruction
    const int n = std::max(0, env_int("BATON_CUDASIM_DEVICES", 2));
    const size_t mib = size_t(std::max(1, env_int("BATON_CUDASIM_MEMORY_MIB", 8192)));
    st->devices.resize(size_t(n));
    for (int d = 0; d < n; d++) {
      Device& dev = st->devices[size_t(d)];
      dev.capacity = mib << 20;
      dev.peer.assign(size_t(n), false);
      auto ls = std::make_unique<Stream>();
      ls->device = d;
      ls->legacy = true;
      dev.legacy = ls.get();
      st->streams.push_back(std::move(ls));
    }
    st->p2p = env_int("BATON_CUDASIM_P2P", 1) != 0;
    st->sms = std::max(1, env_int("BATON_CUDASIM_SMS", 132));
    const char* order = std::getenv("BATON_CUDASIM_ORDER");
    st->eager = order && std::string(order) == "eager";
    st->fill = env_int("BATON_CUDASIM_FILL", 1) != 0;
    return st;
  }();
  return *s;
}

thread_local int t_device = 0;
thread_local cudaError_t t_error = cudaSuccess;

cudaError_t fail(cudaError_t e, const std::string& why = {}) {
  if (!why.empty()) std::fprintf(stderr, "cudasim: %s\n", why.c_str());
  t_error = e;
  return e;
}

using Lock = std::lock_guard<std::recursive_mutex>;

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - S().t0).count();
}

void use_context(int d) {
  Device& dev = S().devices[size_t(d)];
  if (!dev.context) {
    dev.context = true;
    dev.used += kContextBytes;
  }
}

bool valid_device(int d) { return d >= 0 && d < int(S().devices.size()); }

// The allocation holding [p, p + n), or nullptr.
const Alloc* find(const void* p, size_t n = 1) {
  auto& a = S().allocs;
  const auto u = reinterpret_cast<uintptr_t>(p);
  auto it = a.upper_bound(u);
  if (it == a.begin()) return nullptr;
  --it;
  if (u < it->first || u + n > it->first + std::max<size_t>(it->second.size, 1)) return nullptr;
  return &it->second;
}

// The allocation p points into, ignoring the extent (for messages).
std::string describe(const void* p) {
  auto& a = S().allocs;
  const auto u = reinterpret_cast<uintptr_t>(p);
  auto it = a.upper_bound(u);
  if (it != a.begin()) {
    --it;
    const uintptr_t end = it->first + it->second.size;
    if (u <= end + 4096) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%p (offset %zu of a %zu-byte %s allocation)", p, size_t(u - it->first),
                    it->second.size, it->second.device < 0 ? "pinned host" : ("device " + std::to_string(it->second.device)).c_str());
      return buf;
    }
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%p (not allocated by CUDA)", p);
  return buf;
}

// ---- streams ----

Stream* stream_of(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return S().devices[size_t(t_device)].legacy;
  auto* st = reinterpret_cast<Stream*>(s);
  if (st->destroyed) fatal("use of a destroyed stream");
  return st;
}

void run_until(Stream* s, uint64_t seq) {
  while (s->done < seq) {
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    if (op.run) op.run();
    else run_until(op.wait_stream, op.wait_seq);
    s->done++;
  }
}

void drain(Stream* s) { run_until(s, s->enqueued); }

void drain_device(int d) {
  for (auto& s : S().streams)
    if (s->device == d && !s->destroyed) drain(s.get());
}

bool capturing_here(const Stream* s) {
  return s->capture && s->capture_mode != cudaStreamCaptureModeRelaxed && s->capture_thread == std::this_thread::get_id();
}

// A call a capture forbids (synchronizing, allocating): fails and breaks the capture.
cudaError_t forbidden_in_capture(const char* call) {
  for (auto& s : S().streams)
    if (!s->destroyed && capturing_here(s.get())) {
      s->capture_broken = true;
      return fail(cudaErrorStreamCaptureUnsupported, std::string(call) + " while this thread captures a graph");
    }
  return cudaSuccess;
}

void push(Stream* s, Op op) {
  s->queue.push_back(std::move(op));
  s->enqueued++;
}

void wait_op(Stream* s, Stream* on, uint64_t seq, const char* what) {
  if (on->done >= seq) return;
  Op w;
  w.what = what;
  w.wait_stream = on;
  w.wait_seq = seq;
  push(s, std::move(w));
}

// Queues `op` on s (or appends it to the graph s captures into).
void enqueue(Stream* s, Op op) {
  if (s->capture) {
    s->capture->ops.push_back(std::move(op));
    return;
  }
  // Implicit ordering of the legacy stream with the blocking streams of its device.
  if (s->legacy) {
    for (auto& b : S().streams)
      if (b->device == s->device && b->blocking && !b->legacy && !b->destroyed)
        wait_op(s, b.get(), b->enqueued, "legacy stream after blocking stream");
  } else if (s->blocking) {
    Stream* l = S().devices[size_t(s->device)].legacy;
    wait_op(s, l, l->enqueued, "blocking stream after legacy stream");
  }
  push(s, std::move(op));
  if (S().eager) drain(s);
}

// A live object behind a handle; a null or destroyed one aborts, naming the call.
template <class T, class H>
T* live(H h, const char* call, const char* what) {
  auto* x = reinterpret_cast<T*>(h);
  if (!x || x->destroyed) fatal(std::string(call) + " of a destroyed or null " + what);
  return x;
}

// ---- copies ----

bool pinned(const void* p, size_t n) {
  const Alloc* a = find(p, n);
  return a && a->device < 0;
}

// Checks one side of a copy. `device`: the side must be device memory (of that device, when >= 0);
// else it must not be device memory.
bool check_side(const char* call, const char* side, const void* p, size_t n, bool device, int want_dev) {
  if (n == 0) return true;
  const Alloc* a = find(p, n);
  if (device) {
    if (!a || a->device < 0) {
      fail(cudaErrorInvalidValue, std::string(call) + ": " + side + " " + describe(p) + " + " + std::to_string(n) +
                                      " bytes is not inside one device allocation");
      return false;
    }
    if (want_dev >= 0 && a->device != want_dev) {
      fail(cudaErrorInvalidValue, std::string(call) + ": " + side + " " + describe(p) + " is not on device " + std::to_string(want_dev));
      return false;
    }
    return true;
  }
  if (find(p) && find(p)->device >= 0) {
    fail(cudaErrorInvalidValue, std::string(call) + ": " + side + " " + describe(p) + " is device memory, the kind says host");
    return false;
  }
  if (a == nullptr && find(p) != nullptr) {
    fail(cudaErrorInvalidValue, std::string(call) + ": " + side + " " + describe(p) + " + " + std::to_string(n) +
                                    " bytes runs past its pinned allocation");
    return false;
  }
  return true;
}

cudaError_t copy(const char* call, void* dst, const void* src, size_t n, cudaMemcpyKind k, Stream* s, bool sync_call) {
  if (k == cudaMemcpyDefault) {
    const Alloc* d = find(dst);
    const Alloc* f = find(src);
    const bool dd = d && d->device >= 0, sd = f && f->device >= 0;
    k = dd ? (sd ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice) : (sd ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
  }
  const bool dst_dev = k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice;
  const bool src_dev = k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice;
  if (!check_side(call, "destination", dst, n, dst_dev, -1) || !check_side(call, "source", src, n, src_dev, -1))
    return t_error;
  if (n == 0) return cudaSuccess;
  const bool src_pageable = !src_dev && !pinned(src, n), dst_pageable = !dst_dev && !pinned(dst, n);
  if (s->capture && (src_pageable || dst_pageable)) {
    s->capture_broken = true;
    return fail(cudaErrorStreamCaptureUnsupported, std::string(call) + ": a copy with pageable host memory inside a graph capture");
  }
  Op op;
  op.what = call;
  if (src_pageable) {
    // The bytes are staged before the call returns; the copy into place may land later.
    auto staged = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(src), static_cast<const uint8_t*>(src) + n);
    op.run = [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); };
  } else {
    op.run = [dst, src, n] { std::memmove(dst, src, n); };
  }
  enqueue(s, std::move(op));
  // The call returns once the bytes are in place when they go to pageable memory, and for a
  // synchronous copy, unless it is device to device or from pageable memory (then staged).
  const bool wait = dst_pageable || (sync_call && !(dst_dev && src_dev) && !(dst_dev && src_pageable));
  if (!s->capture && wait) drain(s);
  return cudaSuccess;
}

// ---- kernel pointers ----

bool reachable(int from, const void* p) {
  const Alloc* a = find(p);
  if (!a) return false;
  if (a->device < 0) return true;  // pinned host memory is mapped into every device
  return a->device == from || S().devices[size_t(from)].peer[size_t(a->device)];
}

// ---- cuBLAS ----

float load(const void* base, cudaDataType_t t, size_t i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(base)[i];
  if (t == CUDA_R_16F) return __half2float(static_cast<const __half*>(base)[i]);
  uint32_t u = uint32_t(static_cast<const uint16_t*>(base)[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// op(M) of a column-major matrix as floats, row-major: out[r * cols + c] = op(M)[r, c].
std::vector<float> load_op(const void* M, cudaDataType_t t, cublasOperation_t op, int rows, int cols, int ld) {
  std::vector<float> out(size_t(rows) * size_t(cols));
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++)
      out[size_t(r) * size_t(cols) + size_t(c)] =
          load(M, t, op == CUBLAS_OP_N ? size_t(r) + size_t(c) * size_t(ld) : size_t(c) + size_t(r) * size_t(ld));
  return out;
}

void store(void* base, cudaDataType_t t, size_t i, float v) {
  if (t == CUDA_R_32F) static_cast<float*>(base)[i] = v;
  else if (t == CUDA_R_16F) static_cast<__half*>(base)[i] = __float2half_rn(v);
  else {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    static_cast<uint16_t*>(base)[i] = uint16_t(u >> 16);  // truncation; BF16 output is not used
  }
}

size_t type_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

}  // namespace

bool fill_memory() { return S().fill; }

void fatal(const std::string& msg) {
  std::fprintf(stderr, "cudasim: error: %s\n", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

void enqueue(Launch&& l) {
  Lock lk(S().mu);
  if (!valid_device(t_device)) { fail(cudaErrorInvalidDevice); return; }
  const dim3 g = l.grid, b = l.block;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || threads == 0 || threads > 1024 || b.z > 64 || g.y > 65535 || g.z > 65535 ||
      g.x > 0x7FFFFFFFu) {
    fail(cudaErrorInvalidConfiguration, std::string("launch of ") + l.name + ": grid (" + std::to_string(g.x) + "," +
                                           std::to_string(g.y) + "," + std::to_string(g.z) + ") block (" + std::to_string(b.x) +
                                           "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")");
    return;
  }
  Stream* s = stream_of(l.stream);
  if (s->device != t_device) {
    fail(cudaErrorInvalidResourceHandle, std::string("launch of ") + l.name + " on a stream of device " +
                                             std::to_string(s->device) + " while device " + std::to_string(t_device) + " is current");
    return;
  }
  use_context(t_device);
  for (size_t i = 0; i < l.pointers.size(); i++) {
    const void* p = l.pointers[i];
    if (p && !reachable(t_device, p))
      fatal(std::string("launch of ") + l.name + " on device " + std::to_string(t_device) + ": pointer argument " + describe(p) +
            " is not memory this device can reach");
  }
  auto launch = std::make_shared<Launch>(std::move(l));
  Op op;
  op.what = launch->name;
  op.run = [launch] { run_kernel(*launch); };
  enqueue(s, std::move(op));
}

}  // namespace cudasim

using namespace cudasim;

// ---- devices and errors ----

cudaError_t cudaGetDeviceCount(int* n) {
  Lock lk(S().mu);
  *n = int(S().devices.size());
  return *n > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int* dev) {
  *dev = t_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev) {
  Lock lk(S().mu);
  if (!valid_device(dev)) return fail(cudaErrorInvalidDevice);
  t_device = dev;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int dev) {
  Lock lk(S().mu);
  if (!valid_device(dev)) return fail(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "Baton CUDA simulator");
  for (int i = 0; i < 16; ++i) p->uuid.bytes[i] = char(i == 15 ? dev : 0x5a);  // GPU-5a5a5a5a-...-5a5a5a5a5a0N
  p->totalGlobalMem = S().devices[size_t(dev)].capacity;
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = S().sms;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int dev) {
  Lock lk(S().mu);
  if (!valid_device(dev)) return fail(cudaErrorInvalidDevice);
  switch (a) {
    case cudaDevAttrMultiProcessorCount: *v = S().sms; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *v = 9; return cudaSuccess;  // as cudaGetDeviceProperties
    case cudaDevAttrComputeCapabilityMinor: *v = 0; return cudaSuccess;
  }
  return fail(cudaErrorInvalidValue, "unsimulated device attribute");
}

cudaError_t cudaDeviceSynchronize() {
  Lock lk(S().mu);
  if (cudaError_t e = forbidden_in_capture("cudaDeviceSynchronize")) return e;
  drain_device(t_device);
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = t_error;
  t_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return t_error; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessUnsupported: return "cudaErrorPeerAccessUnsupported";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    default: return "cudaError (simulated)";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "simulated CUDA error";
  }
}

cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b) {
  Lock lk(S().mu);
  if (!valid_device(t_device)) return fail(cudaErrorInvalidDevice);
  use_context(t_device);
  const Device& d = S().devices[size_t(t_device)];
  *total_b = d.capacity;
  *free_b = d.capacity > d.used ? d.capacity - d.used : 0;
  return cudaSuccess;
}

// ---- memory ----

cudaError_t cudaMalloc(void** p, size_t bytes) {
  Lock lk(S().mu);
  *p = nullptr;
  if (!valid_device(t_device)) return fail(cudaErrorInvalidDevice);
  if (cudaError_t e = forbidden_in_capture("cudaMalloc")) return e;
  use_context(t_device);
  Device& d = S().devices[size_t(t_device)];
  if (bytes > d.capacity || d.used + bytes > d.capacity) return fail(cudaErrorMemoryAllocation);
  void* m = nullptr;
  if (posix_memalign(&m, 256, std::max<size_t>(bytes, 1)) != 0) return fail(cudaErrorMemoryAllocation);
  if (S().fill) std::memset(m, 0xFF, bytes);
  S().allocs[reinterpret_cast<uintptr_t>(m)] = Alloc{bytes, t_device};
  d.used += bytes;
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  Lock lk(S().mu);
  if (!valid_device(t_device)) return fail(cudaErrorInvalidDevice);
  if (cudaError_t e = forbidden_in_capture("cudaFree")) return e;
  use_context(t_device);
  if (!p) return cudaSuccess;
  auto it = S().allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.device < 0)
    return fail(cudaErrorInvalidValue, "cudaFree of " + describe(p) + ", not the start of a device allocation");
  const int dev = it->second.device;
  drain_device(dev);  // cudaFree waits for the device
  S().devices[size_t(dev)].used -= it->second.size;
  S().allocs.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  Lock lk(S().mu);
  *p = nullptr;
  if (cudaError_t e = forbidden_in_capture("cudaMallocHost")) return e;
  void* m = nullptr;
  if (posix_memalign(&m, 4096, std::max<size_t>(bytes, 1)) != 0) return fail(cudaErrorMemoryAllocation);
  S().allocs[reinterpret_cast<uintptr_t>(m)] = Alloc{bytes, -1};
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  Lock lk(S().mu);
  if (!p) return cudaSuccess;
  auto it = S().allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.device >= 0)
    return fail(cudaErrorInvalidValue, "cudaFreeHost of " + describe(p) + ", not pinned memory");
  for (int d = 0; d < int(S().devices.size()); d++) drain_device(d);  // as cudaFreeHost synchronizes
  S().allocs.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  Lock lk(S().mu);
  if (cudaError_t e = forbidden_in_capture("cudaMemcpy")) return e;
  return copy("cudaMemcpy", dst, src, n, k, stream_of(nullptr), true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind k, cudaStream_t s) {
  Lock lk(S().mu);
  return copy("cudaMemcpyAsync", dst, src, n, k, stream_of(s), false);
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_dev, const void* src, int src_dev, size_t n, cudaStream_t s) {
  Lock lk(S().mu);
  if (!valid_device(dst_dev) || !valid_device(src_dev)) return fail(cudaErrorInvalidDevice);
  if (!check_side("cudaMemcpyPeerAsync", "destination", dst, n, true, dst_dev) ||
      !check_side("cudaMemcpyPeerAsync", "source", src, n, true, src_dev))
    return t_error;
  return copy("cudaMemcpyPeerAsync", dst, src, n, cudaMemcpyDeviceToDevice, stream_of(s), false);
}

cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  Lock lk(S().mu);
  if (!check_side("cudaMemsetAsync", "destination", p, n, true, -1)) return t_error;
  Op op;
  op.what = "cudaMemset";
  op.run = [p, v, n] { std::memset(p, v, n); };
  enqueue(stream_of(s), std::move(op));
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int v, size_t n) {
  Lock lk(S().mu);
  if (cudaError_t e = forbidden_in_capture("cudaMemset")) return e;
  return cudaMemsetAsync(p, v, n, nullptr);
}

// ---- streams ----

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned flags) {
  Lock lk(S().mu);
  if (!valid_device(t_device)) return fail(cudaErrorInvalidDevice);
  use_context(t_device);
  auto s = std::make_unique<Stream>();
  s->device = t_device;
  s->blocking = !(flags & cudaStreamNonBlocking);
  *out = reinterpret_cast<cudaStream_t>(s.get());
  S().streams.push_back(std::move(s));
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t h) {
  Lock lk(S().mu);
  Stream* s = stream_of(h);
  if (s->legacy) return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of the legacy stream");
  if (s->capture) return fail(cudaErrorIllegalState, "cudaStreamDestroy of a stream that is capturing");
  drain(s);  // its work still runs; the simulator runs it now
  s->destroyed = true;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  Lock lk(S().mu);
  if (cudaError_t e = forbidden_in_capture("cudaStreamSynchronize")) return e;
  drain(stream_of(h));
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t eh, unsigned) {
  Lock lk(S().mu);
  Stream* s = stream_of(h);
  auto* e = live<Event>(eh, "cudaStreamWaitEvent", "event");
  if (e->in_capture && !s->capture) fatal("cudaStreamWaitEvent on an event recorded inside a capture (cross-stream capture is not simulated)");
  if (!e->stream) return cudaSuccess;  // never recorded: nothing to wait for
  if (s->capture) {
    if (e->stream == s && e->in_capture) return cudaSuccess;  // ordered by the capture itself
    s->capture_broken = true;
    return fail(cudaErrorStreamCaptureIsolation, "cudaStreamWaitEvent inside a capture on an event recorded outside it");
  }
  if (e->stream != s) wait_op(s, e->stream, e->seq, "event wait");
  if (S().eager) drain(s);
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t h, cudaStreamCaptureMode mode) {
  Lock lk(S().mu);
  Stream* s = stream_of(h);
  if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported, "capture of the legacy stream");
  if (s->capture) return fail(cudaErrorIllegalState, "cudaStreamBeginCapture on a stream that is capturing");
  auto g = std::make_unique<Graph>();
  g->device = s->device;
  s->capture = g.get();
  s->capture_thread = std::this_thread::get_id();
  s->capture_mode = mode;
  s->capture_broken = false;
  S().graphs.push_back(std::move(g));
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t h, cudaGraph_t* out) {
  Lock lk(S().mu);
  Stream* s = stream_of(h);
  *out = nullptr;
  if (!s->capture) return fail(cudaErrorIllegalState, "cudaStreamEndCapture on a stream that is not capturing");
  if (s->capture_thread != std::this_thread::get_id() && s->capture_mode != cudaStreamCaptureModeRelaxed)
    return fail(cudaErrorStreamCaptureWrongThread);
  Graph* g = s->capture;
  s->capture = nullptr;
  if (s->capture_broken) {
    g->destroyed = true;
    return fail(cudaErrorStreamCaptureInvalidated);
  }
  *out = reinterpret_cast<cudaGraph_t>(g);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t h, cudaStreamCaptureStatus* st) {
  Lock lk(S().mu);
  Stream* s = stream_of(h);
  *st = !s->capture ? cudaStreamCaptureStatusNone
                    : s->capture_broken ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

// ---- events ----

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* out, unsigned flags) {
  Lock lk(S().mu);
  auto e = std::make_unique<Event>();
  e->timing = !(flags & cudaEventDisableTiming);
  *out = reinterpret_cast<cudaEvent_t>(e.get());
  S().events.push_back(std::move(e));
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t h) {
  Lock lk(S().mu);
  auto* e = live<Event>(h, "cudaEventDestroy", "event");
  e->destroyed = true;  // a pending record still runs and stamps it; nobody reads it
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t sh) {
  Lock lk(S().mu);
  auto* e = live<Event>(h, "cudaEventRecord", "event");
  Stream* s = stream_of(sh);
  const uint64_t gen = ++e->generation;
  e->ms = -1;
  Op op;
  op.what = "cudaEventRecord";
  op.run = [e, gen] { if (e->generation == gen) e->ms = now_ms(); };
  const bool cap = s->capture != nullptr;
  enqueue(s, std::move(op));
  e->stream = s;
  e->seq = s->enqueued;
  e->in_capture = cap;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t h) {
  Lock lk(S().mu);
  auto* e = live<Event>(h, "cudaEventSynchronize", "event");
  if (cudaError_t err = forbidden_in_capture("cudaEventSynchronize")) return err;
  if (e->in_capture) fatal("cudaEventSynchronize on an event recorded inside a capture");
  if (e->stream) run_until(e->stream, e->seq);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t h) {
  Lock lk(S().mu);
  auto* e = live<Event>(h, "cudaEventQuery", "event");
  // Nothing runs by itself here: a query is an opportunity to run, as time passing is on a GPU.
  if (e->stream) run_until(e->stream, e->seq);
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t ha, cudaEvent_t hb) {
  Lock lk(S().mu);
  auto* a = live<Event>(ha, "cudaEventElapsedTime", "event");
  auto* b = live<Event>(hb, "cudaEventElapsedTime", "event");
  if (!a->timing || !b->timing) return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime of an event without timing");
  if (a->ms < 0 || b->ms < 0) return fail(cudaErrorNotReady);
  *ms = float(b->ms - a->ms);
  return cudaSuccess;
}

// ---- graphs ----

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t h, unsigned long long) {
  Lock lk(S().mu);
  auto* g = live<Graph>(h, "cudaGraphInstantiate", "graph");
  auto x = std::make_unique<Graph>(*g);  // an executable graph is a copy: later edits do not reach it
  *exec = reinterpret_cast<cudaGraphExec_t>(x.get());
  S().graphs.push_back(std::move(x));
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t h) {
  Lock lk(S().mu);
  auto* g = live<Graph>(h, "cudaGraphDestroy", "graph");
  g->destroyed = true;
  g->ops.clear();
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t h) {
  Lock lk(S().mu);
  auto* g = live<Graph>(h, "cudaGraphExecDestroy", "graph");
  g->destroyed = true;  // queued replays keep their own copies of the ops
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t h, cudaStream_t sh) {
  Lock lk(S().mu);
  auto* g = live<Graph>(h, "cudaGraphLaunch", "graph");
  Stream* s = stream_of(sh);
  if (s->device != g->device) return fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch on another device's stream");
  auto ops = std::make_shared<std::vector<Op>>(g->ops);
  Op op;
  op.what = "cudaGraphLaunch";
  op.run = [ops] {
    for (Op& o : *ops)
      if (o.run) o.run();
  };
  enqueue(s, std::move(op));
  return cudaSuccess;
}

// ---- peers ----

cudaError_t cudaDeviceCanAccessPeer(int* can, int dev, int peer) {
  Lock lk(S().mu);
  if (!valid_device(dev) || !valid_device(peer)) return fail(cudaErrorInvalidDevice);
  *can = dev != peer && S().p2p;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  Lock lk(S().mu);
  if (!valid_device(peer) || peer == t_device) return fail(cudaErrorInvalidDevice);
  if (!S().p2p) return fail(cudaErrorPeerAccessUnsupported);
  auto&& flag = S().devices[size_t(t_device)].peer[size_t(peer)];
  if (flag) return fail(cudaErrorPeerAccessAlreadyEnabled);
  flag = true;
  return cudaSuccess;
}

// ---- cuBLAS ----

struct cublasContext {};

cublasStatus_t cublasCreate(cublasHandle_t* h) {
  Lock lk(S().mu);
  if (!valid_device(t_device)) return CUBLAS_STATUS_NOT_INITIALIZED;
  use_context(t_device);
  Device& d = S().devices[size_t(t_device)];
  if (d.used + kCublasBytes > d.capacity) return CUBLAS_STATUS_ALLOC_FAILED;
  d.used += kCublasBytes;
  auto x = std::make_unique<Handle>(Handle{t_device, nullptr});
  *h = reinterpret_cast<cublasHandle_t>(x.get());
  S().handles.push_back(std::move(x));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t hh) {
  Lock lk(S().mu);
  auto* h = live<Handle>(hh, "cublasDestroy", "handle");
  h->destroyed = true;
  S().devices[size_t(h->device)].used -= kCublasBytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t hh, cudaStream_t s) {
  Lock lk(S().mu);
  auto* h = live<Handle>(hh, "cublasSetStream", "handle");
  Stream* st = s ? stream_of(s) : nullptr;
  if (st && !st->legacy && st->device != h->device) return CUBLAS_STATUS_INVALID_VALUE;
  h->stream = st && !st->legacy ? st : nullptr;
  h->workspace = nullptr;  // as cuBLAS does: setting the stream resets the workspace
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t hh, void* workspace, size_t bytes) {
  Lock lk(S().mu);
  auto* h = live<Handle>(hh, "cublasSetWorkspace", "handle");
  if (workspace == nullptr || bytes == 0) {
    h->workspace = nullptr;
    return CUBLAS_STATUS_SUCCESS;
  }
  const Alloc* a = find(workspace, bytes);
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0 || !a || a->device != h->device) {
    std::fprintf(stderr, "cudasim: cublasSetWorkspace: %s, %zu bytes, is not 256-byte aligned inside one allocation of device %d\n",
                 describe(workspace).c_str(), bytes, h->device);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  h->workspace = workspace;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t hh, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType_t at, int lda, const void* B, cudaDataType_t bt,
                            int ldb, const void* beta, void* C, cudaDataType_t ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
  Lock lk(S().mu);
  auto* h = live<Handle>(hh, "cublasGemmEx", "handle");
  if (h->device != t_device) {
    std::fprintf(stderr, "cudasim: cublasGemmEx with a handle of device %d while device %d is current\n", h->device, t_device);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  const int ra = ta == CUBLAS_OP_N ? m : k, ca = ta == CUBLAS_OP_N ? k : m;
  const int rb = tb == CUBLAS_OP_N ? k : n, cb = tb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || lda < std::max(1, ra) || ldb < std::max(1, rb) || ldc < std::max(1, m)) {
    std::fprintf(stderr, "cudasim: cublasGemmEx: bad sizes m=%d n=%d k=%d lda=%d ldb=%d ldc=%d\n", m, n, k, lda, ldb, ldc);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_16F) return CUBLAS_STATUS_NOT_SUPPORTED;
  Stream* s = h->stream ? h->stream : S().devices[size_t(h->device)].legacy;
  // Baton's rule, not the driver's: a GEMM captured into a graph uses the workspace the stage
  // allocated (CUDA 12.2+ cuBLAS would otherwise take one from the stream-ordered pool inside
  // the capture, memory that no plan and no reserve measurement counts).
  if (s->capture && !h->workspace) {
    std::fprintf(stderr, "cudasim: cublasGemmEx captured into a graph on a handle without cublasSetWorkspace\n");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  // Each matrix must lie inside one allocation of this device.
  auto inside = [&](const void* p, cudaDataType_t t, int rows, int cols, int ld, const char* name) {
    if (rows == 0 || cols == 0) return true;
    const size_t extent = (size_t(cols - 1) * size_t(ld) + size_t(rows)) * type_bytes(t);
    const Alloc* a = find(p, extent);
    if (a && a->device == h->device) return true;
    std::fprintf(stderr, "cudasim: cublasGemmEx: %s = %s, %zu bytes (%d x %d, ld %d), is not inside one allocation of device %d\n",
                 name, describe(p).c_str(), extent, rows, cols, ld, h->device);
    return false;
  };
  if (!inside(A, at, ra, ca, lda, "A") || !inside(B, bt, rb, cb, ldb, "B") || !inside(C, ct, m, n, ldc, "C"))
    return CUBLAS_STATUS_EXECUTION_FAILED;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);  // host pointer mode
  Op op;
  op.what = "cublasGemmEx";
  op.run = [=] {
    const std::vector<float> a = load_op(A, at, ta, m, k, lda);  // m x k
    const cublasOperation_t bt_op = tb == CUBLAS_OP_N ? CUBLAS_OP_T : CUBLAS_OP_N;
    const std::vector<float> b = load_op(B, bt, bt_op, n, k, ldb);  // op(B) transposed: n x k
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++) {
        const float* x = a.data() + size_t(i) * size_t(k);
        const float* y = b.data() + size_t(j) * size_t(k);
        float acc = 0.0f;
        for (int l = 0; l < k; l++) acc += x[l] * y[l];
        const size_t ic = size_t(i) + size_t(j) * ldc;
        store(C, ct, ic, al * acc + (be != 0.0f ? be * load(C, ct, ic) : 0.0f));
      }
  };
  enqueue(s, std::move(op));
  return CUBLAS_STATUS_SUCCESS;
}

// ---- FP16 ----

namespace {
constexpr float half_value(uint16_t h) {
  const bool neg = h >> 15;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) {  // zero and subnormals: man * 2^-24, exact in F32
    const float v = float(man) * (1.0f / 16777216.0f);
    return neg ? -v : v;
  }
  const uint32_t bits = (uint32_t(neg) << 31) | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  return std::bit_cast<float>(bits);
}
constexpr std::array<float, 65536> half_table() {
  std::array<float, 65536> t{};
  for (uint32_t u = 0; u < 65536; u++) t[u] = half_value(uint16_t(u));
  return t;
}
}  // namespace

// Initialized at compile time (constinit): right even for conversions in other static initializers.
constinit const std::array<float, 65536> cudasim_half_to_float = half_table();
