// A small fixed-size thread pool for the CPU kernels (optimizer step, gathers, I/O fallback).
//
// parallel_for splits [0, n) into contiguous ranges, one per worker, and runs them with the
// calling thread taking a share, so a 2-core machine uses both cores without oversubscribing.
// Nested parallel_for calls from inside a worker run serially instead of deadlocking, and so
// does every call in a process forked after the pool started (its workers do not exist there:
// DataLoader workers, multiprocessing with fork).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tierlift {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n), each at least `grain` long
  // (except the last). Blocks until all ranges are done. Exceptions from fn are rethrown here.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // The process-wide pool: TIERLIFT_NUM_THREADS threads, else one per CPU this process may
  // run on (usable_cpus()).
  static ThreadPool& global();

  // The CPUs the calling thread may run on (its affinity mask: taskset, a container's cpuset,
  // numactl), else the hardware threads where the mask cannot be read. hardware_concurrency()
  // counts every CPU of the machine: a process allowed 16 of 64 would run 64 threads on 16.
  static int usable_cpus();

  // The calling thread's cap on how many threads its parallel_for calls use (0: no cap).
  // A thread that steps optimizer chunks while a GPU's backward runs leaves cores to the
  // thread that launches the GPU's kernels, as DeepSpeed's SuperOffload does by affinity.
  static void set_thread_limit(int limit);
  static int thread_limit();

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  int owner_pid_;  // the process whose threads workers_ are
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex submit_mu_;  // one parallel_for at a time
};

}  // namespace tierlift
