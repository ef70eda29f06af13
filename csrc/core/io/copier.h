// Copier: a few threads that do the staging copies of the io_uring backend (core/io/staging.h),
// so the ring's one thread only submits and reaps. A memory copy of a block is cut into pieces
// that any idle copier thread takes, so even one large block is copied by several threads; the
// thread that finishes the last piece runs the block's continuation (queue the write for
// submission, or complete the read).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tierlift::io {

class Copier {
 public:
  // `piece`: the largest share of one copy a thread takes at a time.
  explicit Copier(int num_threads, size_t piece = size_t{256} << 10);
  // Finishes every copy already queued (and runs its continuation), then joins the threads.
  ~Copier();
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;

  // Copies n bytes (n may be 0) from src to dst on the copier threads, then calls done() once,
  // on the thread that copied the last piece. Never blocks; done() must not throw.
  void copy(void* dst, const void* src, size_t n, std::function<void()> done);

  int num_threads() const { return static_cast<int>(threads_.size()); }
  // Copier threads for an engine: TIERLIFT_IO_COPY_THREADS, else one per hardware thread,
  // at least 2 and at most 4 (a memory copy saturates a socket's bandwidth with a few cores).
  static int default_threads();

 private:
  struct Job;
  struct Piece {
    std::shared_ptr<Job> job;
    size_t begin = 0, end = 0;
  };
  void loop();

  const size_t piece_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  bool stop_ = false;
};

}  // namespace tierlift::io
