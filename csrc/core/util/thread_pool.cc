#include "core/util/thread_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace tierlift {

namespace {
thread_local bool tls_in_pool = false;
thread_local int tls_limit = 0;
}  // namespace

void ThreadPool::set_thread_limit(int limit) { tls_limit = std::max(0, limit); }

int ThreadPool::thread_limit() { return tls_limit; }

ThreadPool::ThreadPool(int num_threads) : owner_pid_(getpid()) {
  const int extra = std::max(0, num_threads - 1);
  for (int i = 0; i < extra; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  if (getpid() != owner_pid_) {
    // Forked child: the workers were never copied here; joining them would be undefined.
    for (auto& t : workers_) t.detach();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  tls_in_pool = true;
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    std::pair<int64_t, int64_t> range;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      range = ranges_[index + 1];
    }
    std::exception_ptr err;
    if (range.first < range.second) {
      try {
        (*job)(range.first, range.second);
      } catch (...) {
        err = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_parts = (n + grain - 1) / grain;
  const int threads = tls_limit > 0 ? std::min(tls_limit, num_threads()) : num_threads();
  const int parts = static_cast<int>(std::min<int64_t>(threads, max_parts));
  if (parts <= 1 || tls_in_pool || getpid() != owner_pid_) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> submit(submit_mu_);
  // Even split rounded up to the grain, so ranges stay aligned for SIMD loops.
  int64_t per = (n + parts - 1) / parts;
  per = (per + grain - 1) / grain * grain;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.assign(workers_.size() + 1, {0, 0});
    for (int i = 0; i < parts; ++i) {
      ranges_[i] = {std::min(n, i * per), std::min(n, (i + 1) * per)};
    }
    job_ = &fn;
    error_ = nullptr;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  std::exception_ptr err;
  try {
    tls_in_pool = true;
    fn(ranges_[0].first, ranges_[0].second);
  } catch (...) {
    err = std::current_exception();
  }
  tls_in_pool = false;
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (!err) err = error_;
  if (err) std::rethrow_exception(err);
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool([] {
    const char* env = std::getenv("TIERLIFT_NUM_THREADS");
    int n = env ? std::atoi(env) : 0;
    if (n <= 0) n = usable_cpus();
    return n;
  }());
  return pool;
}

int ThreadPool::usable_cpus() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace tierlift
