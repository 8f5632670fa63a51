// The MPI transport under the distributed pipeline (runtime/distributed.h). One Comm per process:
// it starts MPI (thread-multiple: the stage thread sends while the engine's thread receives),
// carries byte messages between ranks, and watches every peer with heartbeats so that a rank that
// dies or stops answering turns into an Error naming that rank instead of a hang.
//
// Nothing here blocks inside MPI without a bound: receives poll (MPI_Iprobe) and check the
// heartbeats between polls; sends are non-blocking and completed by polling too. Builds without
// MPI compile this header but not its implementation (runtime/distributed.cpp says why).
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "gguf/error.h"

namespace baton::mpi {

// Message kinds: the MPI tag of each message on the data channel.
enum Tag : int {
  kHello = 1,   // worker -> 0: protocol version, host, file facts, local devices
  kPlan,        // 0 -> worker: load options and the worker's stage
  kReady,       // worker -> 0: stage loaded (measured bytes, rewind limit)
  kWork,        // rank k -> k+1: a micro-batch's metadata and hidden-state rows
  kLogits,      // last rank -> 0: a micro-batch's id, output size and stage timings; kLogitsRows follows
  kError,       // worker -> 0: text of an error on that rank
  kShutdown,    // 0 -> worker: end the job (payload: 1 byte, 1 when rank 0 failed)
  kLogitsRows,  // last rank -> 0: right after its kLogits, the output words alone (received in place)
  kLink,        // 0 -> worker: every stage is loaded, join the device channels of your plan
  kLinkId,      // rank k -> k+1: the NCCL id of the device channel between them
  kLinked,      // worker -> 0: its device channels are up
};

struct Message {
  int source = -1;
  int tag = 0;
  std::vector<uint8_t> bytes;
};

class Comm {
 public:
  // Starts MPI once per process and the heartbeat thread; later calls return the same Comm.
  // Error(Usage) when MPI cannot give thread-multiple support.
  static Comm& init();
  static Comm* get();  // nullptr before init()

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string host() const { return host_; }

  // Queues `bytes` to `dest` (non-blocking; the buffer is kept until MPI is done with it).
  void send(int dest, int tag, std::vector<uint8_t> bytes);
  // The next message from `source` (-1: any rank), any tag. Waits while every peer is alive:
  // throws Error naming the rank once one stops answering.
  Message recv(int source = -1);
  // The same, but gives up (nullopt) as soon as `done` returns true (checked between polls);
  // tag >= 0 takes only a message with that tag.
  std::optional<Message> recv_until(const std::function<bool()>& done, int source = -1, int tag = -1);
  // The next message from `source` with `tag`, received straight into dst, which must be exactly
  // `bytes` long (a malformed message otherwise). Same liveness rule as recv.
  void recv_into(int source, int tag, void* dst, size_t bytes);
  // The rank a message with `tag` is waiting from (source -1: any rank), or -1; nothing is received.
  int pending(int source, int tag);

  // The bulk lane: bytes on a communicator of their own, outside the order of the messages above,
  // so that the next recv() never meets them (the host emulation of the device channel between GPU
  // ranks uses it, as NCCL has its own connections). Same liveness rule as recv; recv_bulk_into
  // also gives up when `stop` returns true (it then returns false).
  void send_bulk(int dest, std::vector<uint8_t> bytes);
  bool recv_bulk_into(int source, void* dst, size_t bytes, const std::function<bool()>& stop = {});

  // Waits until every queued send has completed (same liveness rule as recv).
  void flush();
  // Progress on queued sends without waiting (frees completed ones).
  void poll_sends();

  // Non-empty once a peer was found dead or silent: "rank 2 (host, pid 1234) stopped answering ...".
  std::string failure() const;
  // Throws that failure as an Error, if there is one.
  void check_alive() const { throw_if_failed(); }
  // Ends the heartbeats and MPI cleanly (every peer must be alive and doing the same).
  void finalize();
  // Kills the whole job (MPI_Abort): the way out once a peer is lost, since a clean finalize would
  // wait for it.
  [[noreturn]] void abort(int code);
  bool finalized() const { return finalized_; }

  // Seconds of silence after which a peer counts as lost: BATON_MPI_TIMEOUT, default 10.
  double timeout_s() const { return timeout_s_; }

  struct Impl;

 private:
  Comm() = default;
  void throw_if_failed() const;
  void send_on(void* comm, int dest, int tag, std::vector<uint8_t> bytes);
  bool recv_into_on(void* comm, int source, int tag, void* dst, size_t bytes, const std::function<bool()>& stop);
  Impl* impl_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::string host_;
  double timeout_s_ = 10;
  bool finalized_ = false;
};

// Little byte (de)serializers for the messages: plain values, strings and vectors, in host byte
// order (every rank runs the same build; the hello message carries a protocol version).
class Writer {
 public:
  template <class T>
  Writer& put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
    return *this;
  }
  Writer& put_str(const std::string& s) {
    put(uint64_t(s.size()));
    bytes.insert(bytes.end(), s.begin(), s.end());
    return *this;
  }
  template <class T>
  Writer& put_vec(const std::vector<T>& v) {
    return put_raw(v.data(), v.size());
  }
  template <class T>
  Writer& put_raw(const T* data, size_t n) {
    static_assert(std::is_trivially_copyable_v<T>);
    put(uint64_t(n));
    const auto* p = reinterpret_cast<const uint8_t*>(data);
    bytes.insert(bytes.end(), p, p + n * sizeof(T));
    return *this;
  }
  std::vector<uint8_t> bytes;
};

class Reader {
 public:
  Reader(const std::vector<uint8_t>& b, int source) : b_(b), source_(source) {}
  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }
  std::string get_str() {
    const uint64_t n = get<uint64_t>();
    const auto* p = take(n);
    return std::string(reinterpret_cast<const char*>(p), n);
  }
  template <class T>
  std::vector<T> get_vec() {
    const uint64_t n = get<uint64_t>();
    std::vector<T> v(n);
    if (n) std::memcpy(v.data(), take(n * sizeof(T)), n * sizeof(T));
    return v;
  }
  // A view of the next n elements (no copy); the message must outlive it.
  template <class T>
  const T* get_view(uint64_t expect) {
    const uint64_t n = get<uint64_t>();
    if (n != expect) bad();
    return reinterpret_cast<const T*>(take(n * sizeof(T)));
  }

 private:
  const uint8_t* take(uint64_t n) {
    if (n > b_.size() - pos_) bad();
    const uint8_t* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  [[noreturn]] void bad() const {
    fail(ErrorKind::Model, "rank {} sent a malformed message (different baton versions on the ranks?)", source_);
  }
  const std::vector<uint8_t>& b_;
  int source_;
  size_t pos_ = 0;
};

}  // namespace baton::mpi
