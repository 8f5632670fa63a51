// A persistent pool of worker threads (no thread creation per call). run(n, fn) calls
// fn(task, thread) for task in [0, n) spread over exactly `size()` threads, the caller being one of
// them, and returns when all are done.
#pragma once
#include <functional>

namespace baton::cpu {

class ThreadPool {
 public:
  // n_threads >= 1 (the calling thread counts as one). Throws a usage error, having stopped the
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

}  // namespace baton::cpu
