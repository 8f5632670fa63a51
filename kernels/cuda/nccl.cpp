// NcclPair (kernels/cuda/nccl.h): a two-member non-blocking NCCL communicator on one stage's
// stream. Every NCCL call is checked; a call that NCCL is still completing (ncclInProgress) is
// waited for with the caller's poll, so a join whose peer is gone ends in an error, not a hang.
#include "kernels/cuda/nccl.h"

#include "gguf/error.h"

#if BATON_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "kernels/cuda/ops.h"

namespace baton::cuda {

namespace {
[[noreturn]] void nccl_fail(const char* call, ncclResult_t rc, ncclComm_t comm) {
  int device = -1;
  cudaGetDevice(&device);
  const char* last = ncclGetLastError(comm);
  fail(ErrorKind::Model, "{} failed on cuda:{}: {}{}{} (NCCL_DEBUG=INFO tells more; BATON_NCCL=0 hands the hidden "
       "state over through host memory instead)", call, device, ncclGetErrorString(rc), last && *last ? ": " : "",
       last ? last : "");
}
}  // namespace

struct NcclPair::Impl {
  Context& ctx;
  ncclComm_t comm = nullptr;
  int peer = 0;
  std::function<void()> poll;
  double timeout_s = 60;
  bool ok = false;  // joined, and no call has failed since

  // After a call: wait while NCCL completes it (a non-blocking communicator), polling the caller.
  void settle(const char* call, ncclResult_t rc) {
    if (rc != ncclSuccess && rc != ncclInProgress) nccl_fail(call, rc, comm);
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
      if (q != ncclSuccess) nccl_fail("ncclCommGetAsyncError", q, comm);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) nccl_fail(call, state, comm);
      if (poll) poll();
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s)
        fail(ErrorKind::Model, "{} did not complete within {:.0f} s on cuda:{} (is the other rank's GPU stage up?)",
             call, timeout_s, ctx.device());
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
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

NcclPair::NcclPair(Context& c, const NcclId& id, int member, const std::function<void()>& poll, double timeout_s)
    : impl_(std::make_unique<Impl>(Impl{c, nullptr, 1 - member, poll, timeout_s, false})) {
  c.make_current();
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.bytes, sizeof(id.bytes));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t rc = ncclCommInitRankConfig(&impl_->comm, 2, uid, member, &config);
  try {
    impl_->settle("ncclCommInitRankConfig", rc);
  } catch (...) {
    if (impl_->comm) ncclCommAbort(impl_->comm);
    impl_->comm = nullptr;
    throw;
  }
  impl_->ok = true;
}

NcclPair::~NcclPair() {
  if (!impl_->comm) return;
  impl_->ctx.make_current();
  if (impl_->ok) {
    // Finish what the stream still holds (every piece sent was received: the job ended normally),
    // then free the communicator; after a failure it is aborted instead, which waits for no one.
    try {
      impl_->ctx.synchronize();
      ncclCommDestroy(impl_->comm);
      return;
    } catch (...) {
    }
  }
  ncclCommAbort(impl_->comm);
}

void NcclPair::send(const void* src, size_t bytes) {
  Impl& g = *impl_;
  try {
    g.settle("ncclSend", ncclSend(src, bytes, ncclUint8, g.peer, g.comm, static_cast<cudaStream_t>(g.ctx.stream())));
  } catch (...) {
    g.ok = false;
    throw;
  }
}

void NcclPair::recv(void* dst, size_t bytes) {
  Impl& g = *impl_;
  try {
    g.settle("ncclRecv", ncclRecv(dst, bytes, ncclUint8, g.peer, g.comm, static_cast<cudaStream_t>(g.ctx.stream())));
  } catch (...) {
    g.ok = false;
    throw;
  }
}

}  // namespace baton::cuda

#else  // a CUDA build without NCCL: GPU ranks hand over through host memory

namespace baton::cuda {

struct NcclPair::Impl {};

bool nccl_available() { return false; }
int nccl_version() { return 0; }
NcclId nccl_unique_id() { fail(ErrorKind::Usage, "this baton was built without NCCL"); }
NcclPair::NcclPair(Context&, const NcclId&, int, const std::function<void()>&, double) {
  fail(ErrorKind::Usage, "this baton was built without NCCL");
}
NcclPair::~NcclPair() = default;
void NcclPair::send(const void*, size_t) {}
void NcclPair::recv(void*, size_t) {}

}  // namespace baton::cuda

#endif
