// NcclPair (kernels/cuda/nccl.h): a two-member non-blocking NCCL communicator on one stage's
// stream. Every NCCL call is checked; a call that NCCL is still completing (ncclInProgress) is
// waited for with the caller's poll, so a join whose peer is gone ends in an error, not a hang.
#include "kernels/cuda/nccl.h"

#include "gguf/error.h"

#if BATON_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "kernels/cuda/ops.h"

namespace baton::cuda {

namespace {
using Clock = std::chrono::steady_clock;

[[noreturn]] void nccl_fail(const char* call, ncclResult_t rc, ncclComm_t comm) {
  int device = -1;
  cudaGetDevice(&device);
  const char* last = ncclGetLastError(comm);
  fail(ErrorKind::Model, "{} failed on cuda:{}: {}{}{} (NCCL_DEBUG=INFO tells more; BATON_NCCL=0 hands the hidden "
       "state over through host memory instead)", call, device, ncclGetErrorString(rc), last && *last ? ": " : "",
       last ? last : "");
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

struct NcclPair::Impl {
  Context& ctx;
  ncclComm_t comm = nullptr;
  int member = 0;
  std::function<void()> alive;
  bool ok = false;         // joined, and no call has failed since
  DeviceBuffer scratch;    // discard()'s destination

  // After a call: wait while NCCL completes it (a non-blocking communicator), polling the caller.
  void settle(const char* call, ncclResult_t rc, const std::function<void()>& poll, double timeout_s) {
    if (rc != ncclSuccess && rc != ncclInProgress) nccl_fail(call, rc, comm);
    const auto t0 = Clock::now();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
      if (q != ncclSuccess) nccl_fail("ncclCommGetAsyncError", q, comm);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) nccl_fail(call, state, comm);
      if (poll) poll();
      if (seconds_since(t0) > timeout_s)
        fail(ErrorKind::Model, "{} did not complete within {:.0f} s on cuda:{} (is the other rank's GPU stage up?)",
             call, timeout_s, ctx.device());
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  // A send or receive: enqueued; a failure leaves the pair unusable.
  template <class F>
  void op(const char* call, F&& f) {
    try {
      settle(call, f(), alive, 1e9);
    } catch (...) {
      ok = false;
      throw;
    }
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(ctx.stream()); }
  // Waits until the stream has drained, polling the caller; false once timeout_s have passed since t0.
  bool drained(const std::function<void()>& poll, Clock::time_point t0, double timeout_s) {
    while (cudaStreamQuery(stream()) == cudaErrorNotReady) {
      if (poll) poll();
      if (seconds_since(t0) > timeout_s) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return true;
  }
};

bool nccl_available() { return true; }

int nccl_version() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

NcclId nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t rc = ncclGetUniqueId(&id);
  if (rc != ncclSuccess) nccl_fail("ncclGetUniqueId", rc, nullptr);
  NcclId out;
  static_assert(sizeof(out.bytes) == sizeof(id.internal));
  std::memcpy(out.bytes, id.internal, sizeof(out.bytes));
  return out;
}

NcclPair::NcclPair(Context& c, const NcclId& id, int member, std::function<void()> alive)
    : impl_(new Impl{c, nullptr, member, std::move(alive), false, {}}) {
  c.make_current();
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.bytes, sizeof(id.bytes));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t rc = ncclCommInitRankConfig(&impl_->comm, 2, uid, member, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    if (impl_->comm) ncclCommAbort(impl_->comm);
    impl_->comm = nullptr;
    nccl_fail("ncclCommInitRankConfig", rc, nullptr);
  }
}

void NcclPair::join(const std::function<void()>& poll, double timeout_s, size_t warm_bytes) {
  Impl& g = *impl_;
  g.ctx.make_current();
  const auto t0 = Clock::now();
  g.settle("ncclCommInitRankConfig", ncclSuccess, poll, timeout_s);
  DeviceBuffer warm(std::max<size_t>(warm_bytes, 1));
  const double left = std::max(1.0, timeout_s - seconds_since(t0));
  if (g.member == 0)
    g.settle("ncclSend (warm-up)", ncclSend(warm.get(), warm.size(), ncclUint8, 1, g.comm, g.stream()), poll, left);
  else
    g.settle("ncclRecv (warm-up)", ncclRecv(warm.get(), warm.size(), ncclUint8, 0, g.comm, g.stream()), poll, left);
  // The transfer itself, bounded the same way (a stream that never finishes means a lost peer).
  if (!g.drained(poll, t0, timeout_s))
    fail(ErrorKind::Model, "the NCCL warm-up transfer did not complete within {:.0f} s on cuda:{}", timeout_s,
         g.ctx.device());
  g.ctx.synchronize();  // reports a failed transfer
  g.ok = true;
}

NcclPair::~NcclPair() {
  if (!impl_->comm) return;
  Impl& g = *impl_;
  try {
    g.ctx.make_current();
    // A normal end: every piece sent was received and the stream drains at once. After a failure
    // a transfer may wait for a peer that is gone: after a few seconds the communicator is aborted,
    // which ends its kernels.
    if (g.ok && g.drained({}, Clock::now(), 5) && cudaStreamQuery(g.stream()) == cudaSuccess &&
        ncclCommDestroy(g.comm) == ncclSuccess)
      return;
  } catch (...) {
  }
  ncclCommAbort(g.comm);
}

void NcclPair::send(const void* src, size_t bytes) {
  Impl& g = *impl_;
  g.op("ncclSend", [&] { return ncclSend(src, bytes, ncclUint8, 1, g.comm, g.stream()); });
}

void NcclPair::recv(void* dst, size_t bytes) {
  Impl& g = *impl_;
  g.op("ncclRecv", [&] { return ncclRecv(dst, bytes, ncclUint8, 0, g.comm, g.stream()); });
}

void NcclPair::discard(size_t bytes) {
  Impl& g = *impl_;
  g.ctx.make_current();
  if (g.scratch.size() < bytes) g.scratch = DeviceBuffer(bytes);
  recv(g.scratch.get(), bytes);
}

}  // namespace baton::cuda

#else  // a CUDA build without NCCL: GPU ranks hand over through host memory

namespace baton::cuda {

struct NcclPair::Impl {};

bool nccl_available() { return false; }
int nccl_version() { return 0; }
NcclId nccl_unique_id() { fail(ErrorKind::Usage, "this baton was built without NCCL"); }
NcclPair::NcclPair(Context&, const NcclId&, int, std::function<void()>) {
  fail(ErrorKind::Usage, "this baton was built without NCCL");
}
NcclPair::~NcclPair() = default;
void NcclPair::join(const std::function<void()>&, double, size_t) {}
void NcclPair::send(const void*, size_t) {}
void NcclPair::recv(void*, size_t) {}
void NcclPair::discard(size_t) {}

}  // namespace baton::cuda

#endif
