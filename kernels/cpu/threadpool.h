// A persistent pool of worker threads (no thread creation per call). run(n, fn) calls
// fn(task, thread) for task in [0, n) spread over exactly `size()` threads, the caller being one of
// them, and returns when all are done.
#pragma once
#include <functional>
#include <string>

#include "gguf/error.h"

namespace baton::cpu {

// Threads the system cannot start: a usage error, "cannot start N CPU threads: REASON (ADVICE)",
// whose parts a caller can word again for what the user asked (a pipeline: all its stages' threads).
struct ThreadStartError : Error {
  ThreadStartError(int n, const std::string& reason, const char* advice);
  std::string reason;  // the system's, e.g. "Resource temporarily unavailable"
};

class ThreadPool {
 public:
  // n_threads >= 1 (the calling thread counts as one). Throws ThreadStartError, having stopped the
  // workers it started, when the system cannot give that many threads.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  void run(int n_tasks, const std::function<void(int task, int thread)>& fn);
  // No job is coming soon (the pipeline moved on to another stage's pool): workers stop spinning
  // and sleep now instead of after their spin, leaving the cores to the threads that have work.
  // The next run() wakes them as usual.
  void rest();

 private:
  struct Impl;
  Impl* impl_;
  int n_threads_;
};

// Runs fn(0), ..., fn(n - 1) at once, fn(0) on the calling thread and each other on a thread of
// its own, and returns when all have: for work cut in parts that each return by themselves (no
// pool needed). When the system cannot start that many threads, the ones started are joined (no
// joinable thread is left to end the program) and ThreadStartError says so (no advice when null).
void run_on_threads(int n, const std::function<void(int part)>& fn, const char* advice = "use fewer --threads");

}  // namespace baton::cpu
