// NCCL between two GPU stages in different processes (runtime/distributed.cpp): a communicator of
// two members per pipeline boundary, member 0 the sending rank and member 1 the receiving one,
// whose sends and receives go on the stages' streams. No CUDA or NCCL types here. Built when CMake
// finds NCCL next to the CUDA Toolkit (BATON_HAVE_NCCL); otherwise nccl_available() is false and
// GPU ranks hand their hidden state over through host memory.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>

namespace baton::cuda {

class Context;

// ncclUniqueId's bytes: made by the sending member, carried to the receiving one over MPI.
struct NcclId {
  unsigned char bytes[128];
};

bool nccl_available();
int nccl_version();  // NCCL_VERSION_CODE of the library in use (0 without NCCL)
NcclId nccl_unique_id();

class NcclPair {
 public:
  // Joins the pair (both members call this with the same id). The communicator is non-blocking:
  // while NCCL sets it up, `poll` is called every 100 µs and may throw (a lost rank, a shutdown),
  // which aborts the communicator; after timeout_s seconds the join fails with an error.
  NcclPair(Context& c, const NcclId& id, int member, const std::function<void()>& poll, double timeout_s);
  ~NcclPair();
  NcclPair(const NcclPair&) = delete;
  NcclPair& operator=(const NcclPair&) = delete;

  // Enqueued on the context's stream (the data moves when the stream gets there).
  void send(const void* src, size_t bytes);
  void recv(void* dst, size_t bytes);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::cuda
