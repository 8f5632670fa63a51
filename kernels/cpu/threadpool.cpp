// Persistent worker pool. Each thread owns a contiguous range of the tasks and takes them in
// order from its own atomic cursor; a thread that runs out helps the others through theirs. So a
// thread's tasks are consecutive (a matmul's row chunks: one long stream per thread, which the
// hardware prefetchers follow, instead of every other chunk) and uneven tasks still balance.
// Workers spin briefly after a job (decode issues many small jobs back to back) and then sleep on
// a condition variable, so an idle pool costs no CPU on a shared machine.
#include "kernels/cpu/threadpool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "gguf/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BATON_PAUSE() _mm_pause()
#else
#define BATON_PAUSE() std::this_thread::yield()
#endif

namespace baton::cpu {

struct ThreadPool::Impl {
  std::mutex mu;
  std::condition_variable wake;  // workers wait here for a new generation
  std::condition_variable done;  // the caller waits here for the last worker
  std::atomic<uint64_t> generation{0};
  struct alignas(64) Cursor {
    std::atomic<int> next{0};  // next task of this thread's range to hand out
    int end = 0;
  };
  std::vector<Cursor> cursors;   // one per thread
  std::atomic<int> running{0};   // workers still inside the current job
  const std::function<void(int, int)>* fn = nullptr;
  bool stop = false;
  bool busy = false;  // a run() is in progress (nested or concurrent runs are a bug)
  std::atomic<bool> resting{false};  // rest() was called: skip the spin
  std::vector<std::thread> threads;

  void drain(int thread) {
    const int n = int(cursors.size());
    for (int k = 0; k < n; ++k) {  // its own range first, then the others'
      Cursor& c = cursors[size_t((thread + k) % n)];
      for (;;) {
        const int t = c.next.fetch_add(1, std::memory_order_relaxed);
        if (t >= c.end) break;
        (*fn)(t, thread);
      }
    }
  }

  void worker(int thread) {
    uint64_t seen = 0;
    for (;;) {
      // Spin for a short while: the next job usually follows within microseconds.
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      int spins = 0;
      while (generation.load(std::memory_order_acquire) == seen && !resting.load(std::memory_order_relaxed)) {
        BATON_PAUSE();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() > spin_until) break;
      }
      if (generation.load(std::memory_order_acquire) == seen) {
        std::unique_lock lk(mu);
        wake.wait(lk, [&] { return stop || generation.load(std::memory_order_acquire) != seen; });
      }
      if (stop) return;
      seen = generation.load(std::memory_order_acquire);
      drain(thread);
      if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lk(mu);
        done.notify_one();
      }
    }
  }

  // Wakes every worker to return, and waits for them.
  void stop_workers() {
    {
      std::lock_guard lk(mu);
      stop = true;
      generation.fetch_add(1, std::memory_order_release);
    }
    wake.notify_all();
    for (auto& t : threads) t.join();
  }
};

ThreadStartError::ThreadStartError(int n, const std::string& why, const char* advice)
    : Error(ErrorKind::Usage, fmt::format("cannot start {} CPU threads: {}{}", n, why,
                                          advice ? fmt::format(" ({})", advice) : std::string())),
      reason(why) {}

ThreadPool::ThreadPool(int n_threads) : impl_(nullptr), n_threads_(n_threads) {
  if (n_threads < 1) fail(ErrorKind::Usage, "thread count must be at least 1 (got {})", n_threads);
  impl_ = new Impl;
  impl_->cursors = std::vector<Impl::Cursor>(size_t(n_threads));
  impl_->threads.reserve(size_t(n_threads - 1));
  // A constructor that throws runs no destructor: the workers already started are stopped and
  // joined here, or they would go on using a pool that is gone. They hold the Impl, not this
  // object, whose memory may be freed before a worker first runs.
  try {
    for (int i = 1; i < n_threads; i++) impl_->threads.emplace_back([p = impl_, i] { p->worker(i); });
  } catch (const std::system_error& e) {
    impl_->stop_workers();
    delete impl_;
    throw ThreadStartError(n_threads, e.code().message(), "use fewer --threads");
  } catch (...) {
    impl_->stop_workers();
    delete impl_;
    throw;
  }
}

void run_on_threads(int n, const std::function<void(int part)>& fn, const char* advice) {
  std::vector<std::thread> threads;
  threads.reserve(size_t(std::max(0, n - 1)));
  auto join = [&] {
    for (auto& t : threads) t.join();
  };
  try {
    for (int k = 1; k < n; ++k) threads.emplace_back([&fn, k] { fn(k); });
  } catch (const std::system_error& e) {
    join();
    throw ThreadStartError(n, e.code().message(), advice);
  }
  try {
    if (n > 0) fn(0);
  } catch (...) {
    join();
    throw;
  }
  join();
}

ThreadPool::~ThreadPool() {
  impl_->stop_workers();
  delete impl_;
}

void ThreadPool::run(int n_tasks, const std::function<void(int task, int thread)>& fn) {
  if (n_tasks <= 0) return;
  Impl& p = *impl_;
  BATON_CHECK(!p.busy);
  if (n_threads_ == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; t++) fn(t, 0);
    return;
  }
  p.busy = true;
  p.fn = &fn;
  for (int t = 0; t < n_threads_; ++t) {
    Impl::Cursor& c = p.cursors[size_t(t)];
    c.next.store(int(int64_t(n_tasks) * t / n_threads_), std::memory_order_relaxed);
    c.end = int(int64_t(n_tasks) * (t + 1) / n_threads_);
  }
  p.running.store(n_threads_ - 1, std::memory_order_relaxed);
  p.resting.store(false, std::memory_order_relaxed);
  {
    std::lock_guard lk(p.mu);
    p.generation.fetch_add(1, std::memory_order_release);
  }
  p.wake.notify_all();
  p.drain(0);
  // Wait for the workers: spin briefly, then sleep.
  int spins = 0;
  while (p.running.load(std::memory_order_acquire) != 0 && ++spins < 20000) BATON_PAUSE();
  if (p.running.load(std::memory_order_acquire) != 0) {
    std::unique_lock lk(p.mu);
    p.done.wait(lk, [&] { return p.running.load(std::memory_order_acquire) == 0; });
  }
  p.fn = nullptr;
  p.busy = false;
}

void ThreadPool::rest() { impl_->resting.store(true, std::memory_order_relaxed); }

}  // namespace baton::cpu
