#include "runtime/link.h"

#include <cstdlib>
#include <cstring>

#include "gguf/error.h"
#include "kernels/cuda/ops.h"

namespace baton {

P2pMode parse_p2p(const std::string& s) {
  if (s == "auto") return P2pMode::Auto;
  if (s == "on") return P2pMode::On;
  if (s == "off") return P2pMode::Off;
  fail(ErrorKind::Usage, "--p2p '{}': expected auto, on or off", s);
}

P2pMode p2p_from_env(P2pMode m) {
  const char* e = std::getenv("BATON_P2P");
  if (m == P2pMode::Auto && e && std::strcmp(e, "0") == 0) return P2pMode::Off;
  return m;
}

const char* link_kind_name(LinkKind k) { return k == LinkKind::Peer ? "peer-to-peer" : "host-staged"; }

LinkKind choose_link(P2pMode m, int src, int dst) {
  if (m == P2pMode::Off) return LinkKind::Staged;
  const bool peer = cuda::peer_possible(src, dst);
  if (m == P2pMode::On && !peer)
    fail(ErrorKind::Usage, "--p2p on: cuda:{} and cuda:{} cannot access each other's memory (no P2P path); "
         "use --p2p auto or off to copy through host memory", src, dst);
  return peer ? LinkKind::Peer : LinkKind::Staged;
}

struct GpuLink::Slots {
  std::vector<cuda::DeviceBuffer> device;  // Peer: on dst's device
  std::vector<cuda::PinnedBuffer> host;    // Staged
  std::vector<cuda::Event> filled;         // per slot, on src's device: the copy into it is done
  std::vector<cuda::Event> drained;        // per slot, on dst's device: the copy out of it is done
  void* at(size_t i) const { return device.empty() ? host[i].get() : device[i].get(); }
};

GpuLink::GpuLink(LinkKind kind, cuda::Context& src, cuda::Context& dst, size_t slot_bytes, int n_slots)
    : kind_(kind), src_(src), dst_(dst), slot_bytes_(slot_bytes), slots_(std::make_unique<Slots>()) {
  BATON_CHECK(n_slots >= 1 && slot_bytes > 0);
  if (kind == LinkKind::Peer) cuda::enable_peer(src.device(), dst.device());
  dst.make_current();
  for (int i = 0; i < n_slots; ++i) {
    if (kind == LinkKind::Peer) slots_->device.emplace_back(slot_bytes);
    else slots_->host.emplace_back(slot_bytes);
    slots_->drained.emplace_back();
  }
  src.make_current();
  for (int i = 0; i < n_slots; ++i) slots_->filled.emplace_back();
  for (int i = n_slots - 1; i >= 0; --i) free_.push_back(i);
}

GpuLink::~GpuLink() = default;

uint64_t GpuLink::device_bytes() const {
  uint64_t n = 0;
  for (const auto& b : slots_->device) n += b.size();
  return n;
}

std::string GpuLink::describe() const {
  return fmt::format("cuda:{} -> cuda:{}, {}", src_.device(), dst_.device(), link_kind_name(kind_));
}

int GpuLink::send(const void* src_ptr, size_t bytes) {
  BATON_CHECK(bytes <= slot_bytes_);
  int slot = -1;
  {
    std::unique_lock<std::mutex> lock(mu_);
    freed_.wait(lock, [&] { return !free_.empty(); });
    slot = free_.back();
    free_.pop_back();
  }
  try {
    void* to = slots_->at(size_t(slot));
    slots_->drained[size_t(slot)].wait(src_);  // the receiver's stream has read what was there
    if (kind_ == LinkKind::Peer) cuda::copy_peer(src_, to, dst_.device(), src_ptr, bytes);
    else cuda::copy_to_host(src_, to, src_ptr, bytes);
    slots_->filled[size_t(slot)].record(src_);
    if (tamper && kind_ == LinkKind::Staged) {
      src_.synchronize();
      tamper(to, bytes);
    }
  } catch (...) {
    release(slot);
    throw;
  }
  return slot;
}

void GpuLink::receive(int slot, void* dst_ptr, size_t bytes) {
  BATON_CHECK(slot >= 0 && size_t(slot) < slots_->device.size() + slots_->host.size() && bytes <= slot_bytes_);
  const void* from = slots_->at(size_t(slot));
  slots_->filled[size_t(slot)].wait(dst_);  // the sender's copy into the slot is done
  if (kind_ == LinkKind::Peer) cuda::copy_on_device(dst_, dst_ptr, from, bytes);
  else cuda::copy_to_device(dst_, dst_ptr, from, bytes);
  slots_->drained[size_t(slot)].record(dst_);
}

void GpuLink::release(int slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(slot);
  }
  freed_.notify_one();
}

void GpuLink::self_test() {
  const size_t n = slot_bytes_ / sizeof(uint32_t);
  std::vector<uint32_t> pattern(n), back(n, 0);
  for (size_t i = 0; i < n; ++i) pattern[i] = uint32_t(i * 2654435761u) ^ 0xA5A5A5A5u;  // no two words alike nearby
  src_.make_current();
  cuda::DeviceBuffer from(n * sizeof(uint32_t));
  from.upload(pattern.data(), n * sizeof(uint32_t));
  const int slot = send(from.get(), n * sizeof(uint32_t));
  dst_.make_current();
  {
    cuda::DeviceBuffer to(n * sizeof(uint32_t));
    receive(slot, to.get(), n * sizeof(uint32_t));
    dst_.synchronize();
    release(slot);
    to.download(back.data(), n * sizeof(uint32_t));
  }
  src_.make_current();
  for (size_t i = 0; i < n; ++i)
    if (back[i] != pattern[i])
      fail(ErrorKind::Usage, "link {} failed its self-test: word {} of {} came through as {:#010x} instead of {:#010x}{}",
           describe(), i, n, back[i], pattern[i],
           kind_ == LinkKind::Peer ? " (P2P may be broken on this machine: try --p2p off)" : "");
}

}  // namespace baton
