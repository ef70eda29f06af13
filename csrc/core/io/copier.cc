#include "core/io/copier.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/util/thread_pool.h"

namespace tierlift::io {

struct Copier::Job {
  char* dst;
  const char* src;
  std::atomic<size_t> pieces_left;
  std::function<void()> done;
};

Copier::Copier(int num_threads, size_t piece) : piece_(piece) {
  if (num_threads < 1 || num_threads > 256) {
    throw std::invalid_argument("copy threads must be in [1, 256], got " +
                                std::to_string(num_threads));
  }
  if (piece == 0) throw std::invalid_argument("copier piece size must be > 0");
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { loop(); });
}

Copier::~Copier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

int Copier::default_threads() {
  const char* env = std::getenv("TIERLIFT_IO_COPY_THREADS");
  if (env != nullptr && *env != '\0') {
    const int n = std::atoi(env);
    if (n >= 1 && n <= 256) return n;
  }
  return std::clamp(ThreadPool::usable_cpus(), 2, 4);
}

void Copier::copy(void* dst, const void* src, size_t n, std::function<void()> done) {
  const size_t pieces = std::max<size_t>(1, (n + piece_ - 1) / piece_);
  auto job = std::make_shared<Job>();
  job->dst = static_cast<char*>(dst);
  job->src = static_cast<const char*>(src);
  job->pieces_left.store(pieces, std::memory_order_relaxed);
  job->done = std::move(done);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < pieces; ++i) {
      queue_.push_back(Piece{job, i * piece_, std::min(n, (i + 1) * piece_)});
    }
  }
  if (pieces == 1) {
    cv_.notify_one();
  } else {
    cv_.notify_all();
  }
}

void Copier::loop() {
  for (;;) {
    Piece p;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained: queued copies finish first
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    if (p.end > p.begin) std::memcpy(p.job->dst + p.begin, p.job->src + p.begin, p.end - p.begin);
    // acq_rel: the thread that runs done() sees every other piece's bytes.
    if (p.job->pieces_left.fetch_sub(1, std::memory_order_acq_rel) == 1) p.job->done();
  }
}

}  // namespace tierlift::io
