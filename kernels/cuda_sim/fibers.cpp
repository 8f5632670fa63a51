// The CUDA simulator's kernel execution: every GPU thread of a block is a fiber with its own
// stack; the scheduler runs each ready fiber until it reaches __syncthreads, a warp exchange or
// its end, then releases whole barriers and whole warps. Blocks run one after another, so shared
// memory (a function-local static under the simulator) belongs to the running block.
//
// Checked, aborting with the kernel, block and thread named:
//  - a warp exchange whose mask names a lane that has exited or is waiting elsewhere (divergence),
//  - lanes of one warp at different exchanges, or reading from a lane outside the mask,
//  - a block that can make no progress (threads at __syncthreads while others wait in a warp op),
//  - threads of a block released from different __syncthreads (a barrier in divergent code).
// Threads that exit count as arrived at later __syncthreads, as on current GPUs. Each block's
// __shared__ variables start as 0xFF bytes (shared_declared), not as the previous block left them.
//
// Schedule (BATON_CUDASIM_THREADS=forward | reverse | random[:SEED], default forward). The
// scheduler works in rounds: each ready thread runs to its next synchronization point, then the
// warp exchanges whose lanes all arrived are released, and the barrier once every live thread
// is at it. `forward` and `reverse` run the ready threads of a round, and the blocks of a grid,
// in that order. `random` shuffles both, and also holds back each warp from a round with
// probability 1/2, so that warps drift apart by several warp exchanges between two
// __syncthreads, as they do on a GPU. A kernel that reads shared memory another thread writes
// without a barrier between them (or writes what another warp may still read), or a block that
// counts on another block having run, then reads stale or too-new bytes, and the test comparing
// the kernel with its CPU twin fails; under one fixed order such a race can give the right
// answer every time.
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
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

// ThreadSanitizer (cmake -DBATON_TSAN=ON -DBATON_CUDA=SIM) as a race check of the kernels' memory
// accesses, the stand-in for compute-sanitizer's racecheck. Every GPU thread runs on a TSan fiber
// of its own, switched to without synchronization, so TSan sees two accesses of two GPU threads
// as concurrent unless something orders them, and it is told what does (this file is built
// without TSan's instrumentation: the simulator's bookkeeping is not a kernel access):
//  - __syncthreads: the accesses of every thread of the block before it happen before every
//    thread's accesses after it (and those of threads that exited before it);
//  - a block's start and end: the launching host thread happens before every thread of a block,
//    and all of a block happens before the next block and before whatever the host does after
//    the launch. Blocks run one after another and reuse the same `__shared__` statics, so
//    concurrently running blocks are not modeled: a race between two blocks on global memory
//    is not reported.
//  - Nothing else: a warp shuffle or ballot exchanges registers but orders no memory (CUDA's
//    documentation: the intrinsics "do not imply a memory barrier"), so lanes of one warp that
//    hand data to each other through shared memory without a __syncthreads race here.
// Atomics are TSan atomics in that build (cudasim/device.h). This file itself is compiled without
// -fsanitize=thread there, so the build says so with BATON_CUDASIM_TSAN.
#if defined(BATON_CUDASIM_TSAN)
#define CUDASIM_TSAN 1
#endif
#if CUDASIM_TSAN
#include <sanitizer/tsan_interface.h>
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
  const char* barrier_file = nullptr;  // the __syncthreads it waits at
  int barrier_line = 0;
#if CUDASIM_ASAN
  void* fake = nullptr;
#endif
#if CUDASIM_TSAN
  void* tsan = nullptr;  // its TSan fiber
  enum class Job : uint8_t { None, Publish, Acquire } job = Job::None;  // at a barrier
#endif
};

#if CUDASIM_ASAN
constexpr size_t kStackBytes = 512 << 10;
#else
constexpr size_t kStackBytes = 128 << 10;
#endif
constexpr size_t kGuardBytes = 4096;

enum class Order { Forward, Reverse, Random };

struct Schedule {
  Order order = Order::Forward;
  uint64_t state = 0x9E3779B97F4A7C15ull;  // random: splitmix64 state, seeded by the knob

  Schedule() {
    const char* v = std::getenv("BATON_CUDASIM_THREADS");
    if (!v || !*v || std::strcmp(v, "forward") == 0) return;
    if (std::strcmp(v, "reverse") == 0) { order = Order::Reverse; return; }
    if (std::strncmp(v, "random", 6) == 0 && (v[6] == 0 || v[6] == ':')) {
      order = Order::Random;
      if (v[6] == ':') state += std::strtoull(v + 7, nullptr, 10);
      return;
    }
    fatal(std::string("BATON_CUDASIM_THREADS=") + v + ": expected forward, reverse or random[:SEED]");
  }

  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  bool random() const { return order == Order::Random; }
  bool coin() { return next() & 1; }

  // 0..n-1 in this schedule's order.
  void permutation(std::vector<int>& out, int n) {
    out.resize(size_t(n));
    std::iota(out.begin(), out.end(), 0);
    if (order == Order::Reverse) std::reverse(out.begin(), out.end());
    if (order == Order::Random)
      for (int i = n - 1; i > 0; i--) std::swap(out[size_t(i)], out[size_t(next() % uint64_t(i + 1))]);
  }
};

struct Runner {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;  // kStackBytes each, a guard page below
  void* sched_sp = nullptr;
  int current = -1;    // the fiber that runs
  int n_threads = 0;   // of the block
  std::vector<int> order;  // this round's order of the block's threads
  std::vector<char> held;  // per warp: held back from this round (random schedule)
  int pos = -1;            // current's place in it
  std::vector<int> blocks; // the grid's blocks (linear index) in run order
  std::vector<const void*> shared_filled;  // the block's __shared__ variables filled so far
  const Launch* launch = nullptr;
#if CUDASIM_ASAN
  void* sched_fake = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
#if CUDASIM_TSAN
  void* sched_tsan = nullptr;  // the host thread's TSan context that runs the launch
  void* block_start = nullptr;  // the host's clock at the block's start
  void* block_exit = nullptr;   // the clocks of the block's threads that exited
  void* barrier_sync = nullptr;  // the barrier being released
#endif
};
Runner R;

#if CUDASIM_TSAN
// TSan synchronizes through addresses. A barrier needs a clock that holds only its arrivals, so
// every barrier and block takes a fresh address from one of two pools, in turn; freeing a pool
// drops TSan's clocks for it. The other pool keeps the running block's addresses alive.
void* fresh_sync() {
  constexpr size_t kPool = 1 << 16;
  static char* pools[2] = {nullptr, nullptr};
  static int cur = 1;
  static size_t used = kPool;
  if (used == kPool) {
    cur ^= 1;
    std::free(pools[cur]);
    pools[cur] = static_cast<char*>(std::malloc(kPool));
    if (!pools[cur]) fatal("out of memory for the race check's clocks");
    used = 0;
  }
  return pools[cur] + used++;
}
void tsan_switch(void* to) { __tsan_switch_to_fiber(to, __tsan_switch_to_fiber_no_sync); }
#endif
Schedule* schedule() {
  static Schedule s;  // first launch: a bad knob fails there, with its value named
  return &s;
}

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
#if CUDASIM_TSAN
  for (Fiber& f : R.fibers)
    if (!f.tsan) f.tsan = __tsan_create_fiber(0);
#endif
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
#if CUDASIM_TSAN
  tsan_switch(f.tsan);
#endif
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
  for (int p = R.pos + 1; p < R.n_threads; p++) {
    const int t = R.order[size_t(p)];
    Fiber& next = R.fibers[size_t(t)];
    if (next.state != State::Ready || R.held[size_t(t / 32)]) continue;
    R.pos = p;
    R.current = t;
    threadIdx = next.idx;
    switches++;
#if CUDASIM_TSAN
    tsan_switch(next.tsan);
#endif
    cudasim_switch(&f.sp, next.sp);
    return;
  }
#if CUDASIM_TSAN
  tsan_switch(R.sched_tsan);
#endif
  cudasim_switch(&f.sp, R.sched_sp);
#endif
}

void fiber_main() {
#if CUDASIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &R.sched_bottom, &R.sched_size);
#endif
#if CUDASIM_TSAN
  __tsan_acquire(R.block_start);
#endif
  R.launch->thread_body();
#if CUDASIM_TSAN
  __tsan_release(R.block_exit);  // for the barriers still to come, and for the block's end
#endif
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
  R.shared_filled.clear();
  for (int t = 0; t < n_threads; t++) {
    Fiber& f = R.fibers[size_t(t)];
    f.sp = init_stack(R.stacks[size_t(t)], t);
    f.state = State::Ready;
    f.idx = uint3{unsigned(t) % b.x, unsigned(t) / b.x % b.y, unsigned(t) / (b.x * b.y)};
  }
  const int n_warps = (n_threads + 31) / 32;
  Schedule& sched = *schedule();
  for (;;) {
    sched.permutation(R.order, n_threads);
    R.held.assign(size_t(n_warps), 0);
    if (sched.random() && n_warps > 1) {
      bool any_runs = false;  // hold back a random half of the warps that could run
      for (int w = 0; w < n_warps; w++) {
        bool ready = false;
        for (int t = w * 32; t < std::min(n_threads, w * 32 + 32); t++) ready |= R.fibers[size_t(t)].state == State::Ready;
        if (!ready) continue;
        R.held[size_t(w)] = sched.coin();
        any_runs |= !R.held[size_t(w)];
      }
      if (!any_runs) R.held.assign(size_t(n_warps), 0);
    }
    for (int p = 0; p < n_threads; p++) {
      const int t = R.order[size_t(p)];
      if (R.fibers[size_t(t)].state != State::Ready || R.held[size_t(t / 32)]) continue;
      R.pos = p;
      enter(t);
    }
    bool progress = false;
    int live = 0, at_barrier = 0, ready = 0;
    for (int t = 0; t < n_threads; t++) {
      const State s = R.fibers[size_t(t)].state;
      if (s == State::Warp && resolve_warp(t, n_threads)) progress = true;
      if (s != State::Done) live++;
      if (s == State::Barrier) at_barrier++;
      if (s == State::Ready) ready++;
    }
    if (progress || ready > 0) continue;  // ready: threads held back from this round
    if (live == 0) return;
    if (at_barrier == live) {
      int first = -1;
      for (int t = 0; t < n_threads; t++) {
        Fiber& f = R.fibers[size_t(t)];
        if (f.state != State::Barrier) continue;
        if (first < 0) first = t;
        const Fiber& f0 = R.fibers[size_t(first)];
        if (f.barrier_line != f0.barrier_line || std::strcmp(f.barrier_file, f0.barrier_file) != 0)
          fail_in_block(thread_name(first) + " waits at the __syncthreads of " + f0.barrier_file + ":" +
                        std::to_string(f0.barrier_line) + ", " + thread_name(t) + " at " + f.barrier_file + ":" +
                        std::to_string(f.barrier_line) + " (a barrier in divergent code)");
      }
#if CUDASIM_TSAN
      // Every waiting thread publishes its clock, then every one takes them all (and the exited
      // threads'), before any runs on: the barrier's clock holds nothing from after it.
      R.barrier_sync = fresh_sync();
      for (const Fiber::Job job : {Fiber::Job::Publish, Fiber::Job::Acquire})
        for (int t = 0; t < n_threads; t++)
          if (R.fibers[size_t(t)].state == State::Barrier) {
            R.fibers[size_t(t)].job = job;
            enter(t);
          }
#endif
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

void syncthreads(const char* file, int line) {
  if (R.current < 0) fatal("__syncthreads called outside a kernel");
  Fiber& f = R.fibers[size_t(R.current)];
  f.state = State::Barrier;
  f.barrier_file = file;
  f.barrier_line = line;
  leave();
#if CUDASIM_TSAN
  // Entered by the scheduler for a job while the barrier is released (run_block): do it, go back.
  for (;;) {
    Fiber& g = R.fibers[size_t(R.current)];
    if (g.job == Fiber::Job::None) break;
    if (g.job == Fiber::Job::Publish) __tsan_release(R.barrier_sync);
    else {
      __tsan_acquire(R.barrier_sync);
      __tsan_acquire(R.block_exit);  // the threads that exited
    }
    g.job = Fiber::Job::None;
    tsan_switch(R.sched_tsan);
    cudasim_switch(&g.sp, R.sched_sp);
  }
#endif
}

void shared_declared(void* p, size_t bytes) {
  if (R.current < 0) fatal("a __shared__ variable declared outside a kernel");
  for (const void* q : R.shared_filled)
    if (q == p) return;
  R.shared_filled.push_back(p);
  if (!fill_memory()) return;
#if CUDASIM_TSAN
  // Not memset, which TSan intercepts: the fill is the hardware's garbage, not a thread's write.
  volatile unsigned char* q = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < bytes; i++) q[i] = 0xFF;
#else
  std::memset(p, 0xFF, bytes);
#endif
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
  const uint64_t n_blocks = uint64_t(l.grid.x) * l.grid.y * l.grid.z;
  if (n_blocks > uint64_t(INT32_MAX)) fatal(std::string("kernel ") + l.name + ": grid of over 2^31 blocks");
  schedule()->permutation(R.blocks, int(n_blocks));
#if CUDASIM_TSAN
  R.sched_tsan = __tsan_get_current_fiber();
#endif
  for (const int b : R.blocks) {
    const unsigned ub = unsigned(b);
    blockIdx = uint3{ub % l.grid.x, ub / l.grid.x % l.grid.y, ub / (l.grid.x * l.grid.y)};
#if CUDASIM_TSAN
    R.block_start = fresh_sync();
    R.block_exit = fresh_sync();
    __tsan_release(R.block_start);
#endif
    run_block(n_threads);
#if CUDASIM_TSAN
    __tsan_acquire(R.block_exit);
#endif
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
