// The CUDA simulator's kernel execution: every GPU thread of a block is a fiber with its own
// stack; the scheduler runs each ready fiber until it reaches __syncthreads, a warp exchange or
// its end, then releases whole barriers and whole warps. Blocks run one after another, so shared
// memory (a function-local static under the simulator) belongs to the running block.
//
// Checked, aborting with the kernel, block and thread named:
//  - a warp exchange whose mask names a lane that has exited or is waiting elsewhere (divergence),
//  - lanes of one warp at different exchanges, or reading from a lane outside the mask,
//  - a block that can make no progress (threads at __syncthreads while others wait in a warp op).
// Threads that exit count as arrived at later __syncthreads, as on current GPUs.
#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "kernels/cuda_sim/sim.h"

#if defined(__SANITIZE_ADDRESS__)
#define CUDASIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDASIM_ASAN 1
#endif
#endif
#if CUDASIM_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

#if !defined(__x86_64__)
#error "the CUDA simulator's fiber switch is written for x86-64"
#endif

// Saves the callee-saved registers on the current stack, stores the stack pointer in *save, and
// continues on the stack `to` (prepared by init_stack, or saved by an earlier switch). Kernels do
// not change the FP control words, so those are not switched.
extern "C" void cudasim_switch(void** save, void* to);
asm(R"(
  .text
  .globl cudasim_switch
  .type cudasim_switch, @function
cudasim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cudasim_switch, .-cudasim_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace cudasim {
namespace {

enum class State : uint8_t { Ready, Barrier, Warp, Done };

struct Fiber {
  void* sp = nullptr;
  State state = State::Done;
  WarpOp op = WarpOp::Xor;
  unsigned mask = 0;
  uint64_t value = 0;  // the lane's contribution, then its result
  int param = 0, width = 32;
  uint3 idx{};
#if CUDASIM_ASAN
  void* fake = nullptr;
#endif
};

#if CUDASIM_ASAN
constexpr size_t kStackBytes = 512 << 10;
#else
constexpr size_t kStackBytes = 128 << 10;
#endif
constexpr size_t kGuardBytes = 4096;

struct Runner {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;  // kStackBytes each, a guard page below
  void* sched_sp = nullptr;
  int current = -1;    // the fiber that runs
  int n_threads = 0;   // of the block
  const Launch* launch = nullptr;
#if CUDASIM_ASAN
  void* sched_fake = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
};
Runner R;

// BATON_CUDASIM_STATS=1: per kernel, launches, GPU threads and fiber switches, printed at exit.
struct Stats {
  uint64_t launches = 0, threads = 0, switches = 0;
};
struct StatsTable {
  bool on = [] { const char* v = std::getenv("BATON_CUDASIM_STATS"); return v && *v == '1'; }();
  std::map<std::string, Stats> by_kernel;
  ~StatsTable() {
    if (!on) return;
    std::fprintf(stderr, "cudasim: %-60s %10s %14s %14s\n", "kernel", "launches", "threads", "switches");
    for (const auto& [name, st] : by_kernel)
      std::fprintf(stderr, "cudasim: %-60s %10llu %14llu %14llu\n", name.c_str(), (unsigned long long)st.launches,
                   (unsigned long long)st.threads, (unsigned long long)st.switches);
  }
};
StatsTable stats;
uint64_t switches = 0;

[[noreturn]] void fail_in_block(const std::string& what) {
  const Launch& l = *R.launch;
  fatal("kernel " + std::string(l.name) + " <<<(" + std::to_string(l.grid.x) + "," + std::to_string(l.grid.y) + "," +
        std::to_string(l.grid.z) + "), (" + std::to_string(l.block.x) + "," + std::to_string(l.block.y) + "," +
        std::to_string(l.block.z) + ")>>> block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) +
        "," + std::to_string(blockIdx.z) + "): " + what);
}

std::string thread_name(int t) {
  const uint3 i = R.fibers[size_t(t)].idx;
  return "thread (" + std::to_string(i.x) + "," + std::to_string(i.y) + "," + std::to_string(i.z) + ")";
}

void ensure_stacks(size_t n) {
  while (R.stacks.size() < n) {
    void* m = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) fatal("cannot map a fiber stack");
    mprotect(m, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of writing over the next stack
    R.stacks.push_back(static_cast<char*>(m) + kGuardBytes);
  }
  if (R.fibers.size() < n) R.fibers.resize(n);
}

[[noreturn]] void fiber_main();

// The top of fiber t's stack. Tops are staggered by t (within the top page) so that the fibers'
// hot stack lines do not all fall into the same cache sets.
void* init_stack(char* base, int t) {
  const uintptr_t top = (uintptr_t(base) + kStackBytes - uintptr_t(t % 21) * 192) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                   // fiber_main's return address: it never returns
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);  // where cudasim_switch's `ret` goes
  for (int i = 0; i < 6; i++) *--sp = 0;       // rbp rbx r12 r13 r14 r15
  return sp;
}

// Scheduler -> fiber t.
void enter(int t) {
  Fiber& f = R.fibers[size_t(t)];
  R.current = t;
  threadIdx = f.idx;
#if CUDASIM_ASAN
  __sanitizer_start_switch_fiber(&R.sched_fake, R.stacks[size_t(t)], kStackBytes);
#endif
  switches++;
  cudasim_switch(&R.sched_sp, f.sp);
#if CUDASIM_ASAN
  __sanitizer_finish_switch_fiber(R.sched_fake, nullptr, nullptr);
#endif
}

// Fiber -> the next ready fiber of the block, else the scheduler (the fiber's state says why it
// stopped). Going straight to the next lane halves the switches of a warp op. Under ASan every
// switch goes through the scheduler, whose stack the annotations need to know.
void leave() {
  Fiber& f = R.fibers[size_t(R.current)];
#if CUDASIM_ASAN
  __sanitizer_start_switch_fiber(f.state == State::Done ? nullptr : &f.fake, R.sched_bottom, R.sched_size);
  cudasim_switch(&f.sp, R.sched_sp);
  __sanitizer_finish_switch_fiber(f.fake, &R.sched_bottom, &R.sched_size);
#else
  for (int t = R.current + 1; t < R.n_threads; t++) {
    Fiber& next = R.fibers[size_t(t)];
    if (next.state != State::Ready) continue;
    R.current = t;
    threadIdx = next.idx;
    switches++;
    cudasim_switch(&f.sp, next.sp);
    return;
  }
  cudasim_switch(&f.sp, R.sched_sp);
#endif
}

void fiber_main() {
#if CUDASIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &R.sched_bottom, &R.sched_size);
#endif
  R.launch->thread_body();
  R.fibers[size_t(R.current)].state = State::Done;
  leave();
  __builtin_trap();  // a finished fiber is never resumed
}

// Releases the warp exchange that lane `t0` waits in, if every lane of its mask is there.
bool resolve_warp(int t0, int n_threads) {
  const Fiber& f0 = R.fibers[size_t(t0)];
  const int base = t0 / 32 * 32;
  for (int lane = 0; lane < 32; lane++) {
    if (!(f0.mask >> lane & 1)) continue;
    const int t = base + lane;
    if (t >= n_threads) fail_in_block(thread_name(t0) + ": warp op mask names lane " + std::to_string(lane) + ", which does not exist in a block of " + std::to_string(n_threads) + " threads");
    const Fiber& f = R.fibers[size_t(t)];
    if (f.state == State::Done)
      fail_in_block(thread_name(t0) + ": warp op mask names lane " + std::to_string(lane) + ", which has exited");
    if (f.state != State::Warp) return false;  // still at __syncthreads: the block may deadlock
    if (f.op != f0.op || f.mask != f0.mask || f.width != f0.width)
      fail_in_block(thread_name(t0) + " and " + thread_name(t) + " are in different warp ops (divergent shuffle)");
  }
  uint64_t ballot = 0;
  if (f0.op == WarpOp::Ballot)
    for (int lane = 0; lane < 32; lane++)
      if ((f0.mask >> lane & 1) && R.fibers[size_t(base + lane)].value) ballot |= uint64_t(1) << lane;
  uint64_t result[32] = {};
  for (int lane = 0; lane < 32; lane++) {
    if (!(f0.mask >> lane & 1)) continue;
    const Fiber& f = R.fibers[size_t(base + lane)];
    if (f.op == WarpOp::Ballot) { result[size_t(lane)] = ballot; continue; }
    const int w = f.width, seg = lane / w * w;
    int src = lane;
    switch (f.op) {
      case WarpOp::Xor: src = lane ^ f.param; if (src / w * w != seg) src = lane; break;
      case WarpOp::Idx: src = seg + (f.param % w + w) % w; break;
      case WarpOp::Down: src = lane + f.param; if (src >= seg + w) src = lane; break;
      case WarpOp::Up: src = lane - f.param; if (src < seg) src = lane; break;
      case WarpOp::Ballot: break;
    }
    if (src < 0 || src > 31 || !(f0.mask >> src & 1))
      fail_in_block(thread_name(base + lane) + " reads lane " + std::to_string(src) + ", outside the shuffle's mask");
    result[size_t(lane)] = R.fibers[size_t(base + src)].value;
  }
  for (int lane = 0; lane < 32; lane++) {
    if (!(f0.mask >> lane & 1)) continue;
    Fiber& f = R.fibers[size_t(base + lane)];
    f.value = result[size_t(lane)];
    f.state = State::Ready;
  }
  return true;
}

void run_block(int n_threads) {
  const dim3 b = R.launch->block;
  for (int t = 0; t < n_threads; t++) {
    Fiber& f = R.fibers[size_t(t)];
    f.sp = init_stack(R.stacks[size_t(t)], t);
    f.state = State::Ready;
    f.idx = uint3{unsigned(t) % b.x, unsigned(t) / b.x % b.y, unsigned(t) / (b.x * b.y)};
  }
  for (;;) {
    for (int t = 0; t < n_threads; t++)
      if (R.fibers[size_t(t)].state == State::Ready) enter(t);
    bool progress = false;
    int live = 0, at_barrier = 0;
    for (int t = 0; t < n_threads; t++) {
      const State s = R.fibers[size_t(t)].state;
      if (s == State::Warp && resolve_warp(t, n_threads)) progress = true;
      if (s != State::Done) live++;
      if (s == State::Barrier) at_barrier++;
    }
    if (progress) continue;
    if (live == 0) return;
    if (at_barrier == live) {
      for (int t = 0; t < n_threads; t++)
        if (R.fibers[size_t(t)].state == State::Barrier) R.fibers[size_t(t)].state = State::Ready;
      continue;
    }
    std::string who;
    for (int t = 0; t < n_threads && who.size() < 400; t++) {
      const State s = R.fibers[size_t(t)].state;
      if (s == State::Warp) who += " " + thread_name(t) + " in a warp op;";
    }
    fail_in_block("deadlock: " + std::to_string(at_barrier) + " of " + std::to_string(live) +
                  " live threads at __syncthreads, the others in warp ops whose lanes never arrive:" + who);
  }
}

}  // namespace

void syncthreads() {
  if (R.current < 0) fatal("__syncthreads called outside a kernel");
  R.fibers[size_t(R.current)].state = State::Barrier;
  leave();
}

uint64_t warp_exchange(WarpOp op, unsigned mask, uint64_t value, int param, int width) {
  if (R.current < 0) fatal("a warp op called outside a kernel");
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail_in_block(thread_name(R.current) + ": shuffle width " + std::to_string(width) + " is not a power of two up to 32");
  const int lane = R.current % 32;
  if (!(mask >> lane & 1)) fail_in_block(thread_name(R.current) + " is in a warp op whose mask does not name it");
  Fiber& f = R.fibers[size_t(R.current)];
  f.state = State::Warp;
  f.op = op;
  f.mask = mask;
  f.value = value;
  f.param = param;
  f.width = width;
  leave();
  return R.fibers[size_t(R.current)].value;
}

void run_kernel(const Launch& l) {
  const int n_threads = int(l.block.x * l.block.y * l.block.z);
  ensure_stacks(size_t(n_threads));
  R.launch = &l;
  R.n_threads = n_threads;
  gridDim = l.grid;
  blockDim = l.block;
  const uint64_t switches0 = switches;
  for (unsigned z = 0; z < l.grid.z; z++)
    for (unsigned y = 0; y < l.grid.y; y++)
      for (unsigned x = 0; x < l.grid.x; x++) {
        blockIdx = uint3{x, y, z};
        run_block(n_threads);
      }
  R.current = -1;
  R.launch = nullptr;
  if (stats.on) {
    Stats& st = stats.by_kernel[l.name];
    st.launches++;
    st.threads += uint64_t(n_threads) * l.grid.x * l.grid.y * l.grid.z;
    st.switches += switches - switches0;
  }
}

}  // namespace cudasim
