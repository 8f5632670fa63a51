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
  // Starts joining the pair (both members do, with the same id) and returns at once: the
  // communicator is non-blocking, so a rank can start both of its pairs before waiting for either.
  // `alive` is called while a later send or receive waits for NCCL, and throws when a peer is lost.
  NcclPair(Context& c, const NcclId& id, int member, std::function<void()> alive);
  ~NcclPair();  // waits at most a few seconds for the stream, then aborts the communicator
  NcclPair(const NcclPair&) = delete;
  NcclPair& operator=(const NcclPair&) = delete;

  // Waits until the pair is up, then moves `warm_bytes` once from member 0 to member 1: NCCL
  // connects a pair at its first transfer, which needs both ends at once (later sends do not wait
  // for the receiver's host). While waiting, poll() is called every 100 µs and may throw (a lost
  // rank, a shutdown): the communicator is then aborted. After timeout_s seconds: an error.
  void join(const std::function<void()>& poll, double timeout_s, size_t warm_bytes);

  // Enqueued on the context's stream (the data moves when the stream gets there).
  void send(const void* src, size_t bytes);
  void recv(void* dst, size_t bytes);
  // Receives `bytes` into a scratch buffer of the pair's and drops them (a rank that failed still
  // takes what its predecessor sends, so the sender's stream is not left waiting).
  void discard(size_t bytes);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::cuda
