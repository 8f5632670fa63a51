// How the hidden state crosses from one GPU stage to the next without going through the pipeline's
// host buffers. Two kinds:
//
//   peer     the sending stage copies straight into a slot in the receiving device's memory
//            (cudaMemcpyPeerAsync; two stages on one GPU: a device-to-device copy)
//   staged   device -> pinned host slot -> device: for GPUs that cannot peer, or when P2P is
//            switched off (--p2p off, BATON_P2P=0) because it hangs or corrupts on a board
//
// A link owns a few slots (each holds one piece of n_batch hidden states), so consecutive pieces
// overlap: the sender fills slot i + 1 while the receiver still reads slot i. No host thread waits
// for a copy: the receiving stream waits for the event recorded after the copy into the slot, and
// the sending stream, before it refills a slot, for the event recorded after the copy out of it.
// Links between a GPU and a CPU stage (spill) are the pipeline's host buffers, as between CPU stages.
// Every link checks itself when the pipeline is built (self_test): a known pattern through a slot and
// back, so a broken P2P path is an error at load, not garbage in the logits.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace baton {

namespace cuda { class Context; }

enum class P2pMode { Auto, On, Off };
// "auto", "on", "off"; anything else is a usage error. BATON_P2P=0 in the environment turns Auto
// into Off (the switch users reach for, like NCCL_P2P_DISABLE=1).
P2pMode parse_p2p(const std::string& s);
P2pMode p2p_from_env(P2pMode m);

enum class LinkKind { Peer, Staged };
const char* link_kind_name(LinkKind k);  // "peer-to-peer", "host-staged"
// The link between CUDA devices src and dst under mode m: Peer when possible (Auto) or asked (On),
// else Staged. On where peer access is impossible is a usage error naming both devices.
LinkKind choose_link(P2pMode m, int src, int dst);

class GpuLink {
 public:
  // Slots of slot_bytes each on dst's device (Peer) or in pinned host memory (Staged). For Peer
  // between two devices, peer access is enabled here.
  GpuLink(LinkKind kind, cuda::Context& src, cuda::Context& dst, size_t slot_bytes, int n_slots = 4);
  ~GpuLink();
  GpuLink(const GpuLink&) = delete;
  GpuLink& operator=(const GpuLink&) = delete;

  LinkKind kind() const { return kind_; }
  // Bytes of the slots on the receiving GPU (peer-to-peer; a host-staged link pins host memory).
  uint64_t device_bytes() const;
  std::string describe() const;  // "cuda:0 -> cuda:1, peer-to-peer"

  // Sender (src's device current): takes a free slot (waiting for one if all are taken) and
  // enqueues on src's stream the copy of `bytes` from src_ptr (src's device memory) into it. Returns
  // the slot at once.
  int send(const void* src_ptr, size_t bytes);
  // Receiver (dst's device current): enqueues on dst's stream, after the sender's copy, the copy of
  // the slot's bytes to dst_ptr (dst's device memory). The slot may be released as soon as this
  // returns: the sender's next copy into it waits for this one on the device.
  void receive(int slot, void* dst_ptr, size_t bytes);
  void release(int slot);

  // Copies a known pattern of slot_bytes through slot 0 and back to the host and compares; throws
  // an Error naming the link and the first wrong word. Call before any piece flows.
  void self_test();

  // Tests only: called with a slot's host-visible address after send() fills it (Staged links), to
  // show that self_test() catches a path that corrupts.
  std::function<void(void* slot, size_t bytes)> tamper;

 private:
  struct Slots;
  LinkKind kind_;
  cuda::Context& src_;
  cuda::Context& dst_;
  size_t slot_bytes_;
  std::unique_ptr<Slots> slots_;
  std::mutex mu_;
  std::condition_variable freed_;
  std::vector<int> free_;
};

// The hidden state between GPU stages in different processes (runtime/distributed.cpp): NCCL
// send/receive between the two ranks' device buffers, or its host emulation. Both calls are
// enqueued on the stage's stream and return at once; pieces are received in the order they were
// sent.
class DeviceChannel {
 public:
  virtual ~DeviceChannel() = default;
  virtual void send(const void* src_ptr, size_t bytes) = 0;  // src_ptr: the sending stage's device memory
  virtual void recv(void* dst_ptr, size_t bytes) = 0;        // dst_ptr: the receiving stage's device memory
};

}  // namespace baton
