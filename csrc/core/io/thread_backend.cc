// The fallback backend: a fixed pool of threads doing pread/pwrite, one BlockOp at a time each.
// Used where io_uring is unavailable (seccomp in containers, io_uring_disabled) or forced with
// TIERLIFT_IO_BACKEND=threads. Its thread count is the queue depth, so both backends keep the
// same number of requests in flight.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "core/io/backend.h"
#include "core/io/staging.h"

namespace tierlift::io {

IoStatus run_blocking(BlockOp& op) {
  while (op.done < op.len) {
    const uint64_t left = op.len - op.done;
    // O_DIRECT needs aligned length and offset: an unaligned rest goes through the page cache.
    const bool direct_ok = op.direct_now();
    const int fd = direct_ok || op.buffered_fd < 0 ? op.fd : op.buffered_fd;
    ssize_t n = op.is_write ? ::pwrite(fd, op.buf + op.done, left, op.offset + op.done)
                            : ::pread(fd, op.buf + op.done, left, op.offset + op.done);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == EINVAL && direct_ok && op.buffered_fd >= 0) {
        op.direct = false;  // the drive refused this alignment after all: the page cache can't
        continue;
      }
      return op.error(errno);
    }
    if (n == 0) return op.error(op.is_write ? ENOSPC : kErrEof);
    op.done += static_cast<uint64_t>(n);
  }
  return IoStatus{};
}

namespace {

class ThreadBackend final : public IoBackend {
 public:
  explicit ThreadBackend(const BackendOptions& opts) {
    const int n = std::max(1, opts.queue_depth);
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~ThreadBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  const char* name() const override { return "threads"; }

  void submit(std::vector<BlockOp> ops) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& op : ops) queue_.push_back(std::move(op));
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    for (;;) {
      BlockOp op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained: pending work is finished first
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      stage_begin(op, /*can_wait=*/false);
      IoStatus st = run_blocking(op);
      stage_end(op);
      op.req->complete_one(st);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<BlockOp> queue_;
  bool stop_ = false;
};

}  // namespace

std::unique_ptr<IoBackend> make_thread_backend(const BackendOptions& opts) {
  return std::make_unique<ThreadBackend>(opts);
}

}  // namespace tierlift::io
