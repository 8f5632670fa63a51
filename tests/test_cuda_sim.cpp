// The CUDA simulator's own checks (kernels/cuda_sim/fibers.cpp): what it must catch in a kernel
// that a GPU would turn into garbage. Each case runs in a child process, because the schedule
// knob is read once per process and a caught bug aborts. A `gpu` test of simulator builds only:
// these kernels are written against the simulator's headers.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#if !defined(__CUDA_SIM__)
#error "test_cuda_sim is built only with -DBATON_CUDA=SIM (tests/CMakeLists.txt)"
#endif

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace {

constexpr int kWarps = 8, kThreads = kWarps * 32;

// Two rounds of "each warp publishes a count, every thread sums them" (the shape of block_rank in
// kernels/cuda/sample.cu). `guard` = false leaves out the barrier before the second round's
// writes, so a warp that runs ahead overwrites a count another warp has not read yet.
__global__ void two_rounds(int* out, int guard) {
  __shared__ int counts[kWarps];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  int sums[2];
  for (int round = 0; round < 2; round++) {
    if (round == 0 || guard) __syncthreads();
    if (lane == 0) counts[warp] = (round + 1) * (warp + 1);
    __syncthreads();
    int s = 0;
    for (int w = 0; w < kWarps; w++) s += counts[w];
    sums[round] = __shfl_xor_sync(0xffffffffu, s, 1);  // a warp exchange: warps may drift here
  }
  out[blockIdx.x * kThreads + threadIdx.x] = sums[0] * 1000 + sums[1];
}

// Odd warps wait at one barrier, even warps at another.
__global__ void divergent_barrier(int* out) {
  if (threadIdx.x / 32 % 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Block 0 writes the shared variable, the others only read it. Declared as the simulator's build
// rewrites a kernel's `__shared__` declarations (cmake/cudasim_rewrite.cmake).
__global__ void read_unwritten_shared(int* out) {
  __shared__ int s; ::cudasim::shared_declared(&s, sizeof(s));
  if (blockIdx.x == 0 && threadIdx.x == 0) s = 5;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

struct Child {
  int status = 0;       // as waitpid reports it
  std::string stderr_text;
  std::vector<int> out;  // what the kernel wrote, when it finished
};

// Runs fn (which returns the kernel's output) in a child with BATON_CUDASIM_THREADS=order.
Child run_child(const char* order, const std::function<std::vector<int>()>& fn) {
  int out_pipe[2], err_pipe[2];
  REQUIRE(pipe(out_pipe) == 0);
  REQUIRE(pipe(err_pipe) == 0);
  std::fflush(nullptr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    dup2(err_pipe[1], 1);  // nothing of the child reaches the test's output
    dup2(err_pipe[1], 2);
    signal(SIGABRT, SIG_DFL);  // an abort ends the child, not Catch2's handler
    setenv("BATON_CUDASIM_THREADS", order, 1);
    const std::vector<int> v = fn();
    const ssize_t n = ssize_t(v.size() * sizeof(int));
    _exit(write(out_pipe[1], v.data(), size_t(n)) == n ? 0 : 3);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  Child c;
  std::vector<char> bytes;
  char buf[4096];
  for (ssize_t n; (n = read(out_pipe[0], buf, sizeof buf)) > 0;) bytes.insert(bytes.end(), buf, buf + n);
  for (ssize_t n; (n = read(err_pipe[0], buf, sizeof buf)) > 0;) c.stderr_text.append(buf, size_t(n));
  close(out_pipe[0]);
  close(err_pipe[0]);
  REQUIRE(waitpid(pid, &c.status, 0) == pid);
  c.out.resize(bytes.size() / sizeof(int));
  if (!c.out.empty()) std::memcpy(c.out.data(), bytes.data(), c.out.size() * sizeof(int));
  return c;
}

bool exited_ok(const Child& c) { return WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0; }

std::vector<int> launch_two_rounds(int guard, int blocks) {
  int* d = nullptr;
  const size_t n = size_t(blocks) * kThreads;
  if (cudaMalloc(&d, n * sizeof(int)) != cudaSuccess) std::abort();
  cudasim::launch(two_rounds, "two_rounds", dim3(unsigned(blocks)), dim3(kThreads))(d, guard);
  std::vector<int> h(n);
  if (cudaMemcpy(h.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) std::abort();
  cudaFree(d);
  return h;
}

// Every thread's two sums, as a GPU must produce them.
int expected_two_rounds() {
  int s0 = 0, s1 = 0;
  for (int w = 0; w < kWarps; w++) s0 += w + 1, s1 += 2 * (w + 1);
  return s0 * 1000 + s1;
}

int wrong_threads(const std::vector<int>& out) {
  int bad = 0;
  for (const int v : out) bad += v != expected_two_rounds();
  return bad;
}

}  // namespace

TEST_CASE("a correctly synchronized kernel gives the same answer under every schedule") {
  for (const char* order : {"forward", "reverse", "random:1", "random:2", "random:3"}) {
    INFO("BATON_CUDASIM_THREADS=" << order);
    const Child c = run_child(order, [] { return launch_two_rounds(1, 4); });
    REQUIRE(exited_ok(c));
    REQUIRE(c.out.size() == size_t(4 * kThreads));
    CHECK(wrong_threads(c.out) == 0);
  }
}

#if !defined(__SANITIZE_THREAD__)  // there the race check reports it under any order (below), exit code 66
TEST_CASE("a missing barrier that a fixed order hides shows under the random schedule") {
  // In rounds, in order, every warp reads the counts before any warp passes the exchange, so
  // the race gives the right answer: the reason the random schedule exists.
  for (const char* order : {"forward", "reverse"}) {
    INFO("BATON_CUDASIM_THREADS=" << order);
    const Child c = run_child(order, [] { return launch_two_rounds(0, 4); });
    REQUIRE(exited_ok(c));
    CHECK(wrong_threads(c.out) == 0);
  }
  int seeds_that_see_it = 0;
  for (const char* order : {"random:1", "random:2", "random:3", "random:4"}) {
    const Child c = run_child(order, [] { return launch_two_rounds(0, 4); });
    REQUIRE(exited_ok(c));
    seeds_that_see_it += wrong_threads(c.out) > 0;
  }
  CHECK(seeds_that_see_it >= 3);
}
#endif

TEST_CASE("threads at different __syncthreads abort with both places named") {
  const Child c = run_child("forward", [] {
    int* d = nullptr;
    if (cudaMalloc(&d, 64 * sizeof(int)) != cudaSuccess) std::abort();
    cudasim::launch(divergent_barrier, "divergent_barrier", dim3(1), dim3(64))(d);
    cudaDeviceSynchronize();
    return std::vector<int>{};
  });
  CHECK_FALSE(exited_ok(c));
  CHECK(c.stderr_text.find("divergent_barrier") != std::string::npos);
  CHECK(c.stderr_text.find("a barrier in divergent code") != std::string::npos);
  CHECK(c.stderr_text.find("test_cuda_sim.cpp:") != std::string::npos);
}

TEST_CASE("each block's shared memory starts as 0xFF bytes, not as the previous block left it") {
  for (const char* order : {"forward", "reverse"}) {
    INFO("BATON_CUDASIM_THREADS=" << order);
    const Child c = run_child(order, [] {
      int* d = nullptr;
      if (cudaMalloc(&d, 3 * sizeof(int)) != cudaSuccess) std::abort();
      cudasim::launch(read_unwritten_shared, "read_unwritten_shared", dim3(3), dim3(32))(d);
      std::vector<int> h(3);
      if (cudaMemcpy(h.data(), d, 3 * sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) std::abort();
      return h;
    });
    REQUIRE(exited_ok(c));
    REQUIRE(c.out.size() == 3);
    CHECK(std::count(c.out.begin(), c.out.end(), 5) == 1);   // block 0, wherever it ran
    CHECK(std::count(c.out.begin(), c.out.end(), -1) == 2);  // the others read the fill
  }
}

TEST_CASE("a bad schedule name is an error naming the knob") {
  const Child c = run_child("backwards", [] { return launch_two_rounds(1, 1); });
  CHECK_FALSE(exited_ok(c));
  CHECK(c.stderr_text.find("BATON_CUDASIM_THREADS=backwards") != std::string::npos);
}

#if defined(__SANITIZE_THREAD__)
// The race check of a ThreadSanitizer build (cmake -DBATON_TSAN=ON -DBATON_CUDA=SIM; fibers.cpp):
// what it must report, and what it must not.
namespace {

// Lane 0 of each warp hands a value to lane 1 through shared memory with only a shuffle between
// them: a shuffle orders no memory, so this is a race on a GPU.
__global__ void handoff_by_shuffle(int* out) {
  __shared__ int box[kWarps]; ::cudasim::shared_declared(box, sizeof(box));
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) box[warp] = warp + 7;
  const int token = __shfl_sync(0xffffffffu, lane, 0);
  if (lane == 1) out[warp] = box[warp] + token;
}

// Correct: atomics on one shared counter, threads that exit before the barrier after writing
// (an exited thread counts as arrived), a barrier, then everyone reads.
__global__ void atomics_and_early_exit(int* out) {
  __shared__ int count; ::cudasim::shared_declared(&count, sizeof(count));
  __shared__ int early[kThreads]; ::cudasim::shared_declared(early, sizeof(early));
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  atomicAdd(&count, 1);
  early[threadIdx.x] = int(threadIdx.x);
  if (threadIdx.x >= kThreads - 32) return;  // the last warp leaves
  __syncthreads();
  out[blockIdx.x * kThreads + threadIdx.x] = count + early[(threadIdx.x + 64) % kThreads];
}

std::vector<int> launch_simple(void (*kernel)(int*), const char* name, int blocks) {
  int* d = nullptr;
  const size_t n = size_t(blocks) * kThreads;
  if (cudaMalloc(&d, n * sizeof(int)) != cudaSuccess) std::abort();
  cudasim::launch(kernel, name, dim3(unsigned(blocks)), dim3(kThreads))(d);
  std::vector<int> h(n);
  if (cudaMemcpy(h.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) std::abort();
  cudaFree(d);
  return h;
}

bool tsan_reported(const Child& c) { return c.stderr_text.find("ThreadSanitizer: data race") != std::string::npos; }

}  // namespace

TEST_CASE("tsan: a missing barrier is reported under a fixed order, at the kernel's lines") {
  const Child c = run_child("forward", [] { return launch_two_rounds(0, 2); });
  INFO(c.stderr_text.substr(0, 3000));
  CHECK(tsan_reported(c));
  CHECK(c.stderr_text.find("two_rounds") != std::string::npos);
  CHECK(c.stderr_text.find("test_cuda_sim.cpp:") != std::string::npos);
  const Child ok = run_child("forward", [] { return launch_two_rounds(1, 2); });
  INFO(ok.stderr_text.substr(0, 3000));
  CHECK_FALSE(tsan_reported(ok));
  CHECK(wrong_threads(ok.out) == 0);
}

TEST_CASE("tsan: lanes that hand data over through shared memory with only a shuffle race") {
  const Child c = run_child("forward", [] { return launch_simple(handoff_by_shuffle, "handoff_by_shuffle", 1); });
  INFO(c.stderr_text.substr(0, 3000));
  CHECK(tsan_reported(c));
  CHECK(c.stderr_text.find("handoff_by_shuffle") != std::string::npos);
}

TEST_CASE("tsan: atomics, threads that exit before a barrier and blocks in turn are not races") {
  const Child c = run_child("random:3", [] { return launch_simple(atomics_and_early_exit, "atomics_and_early_exit", 3); });
  INFO(c.stderr_text.substr(0, 3000));
  CHECK_FALSE(tsan_reported(c));
  REQUIRE(c.out.size() == size_t(3 * kThreads));
  for (int b = 0; b < 3; b++)
    for (int t = 0; t < kThreads - 32; t++) CHECK(c.out[size_t(b * kThreads + t)] == kThreads + (t + 64) % kThreads);
}
#endif
