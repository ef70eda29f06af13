// The unit of work the backends see. A user read/write (an IoRequest) is split by the engine into
// BlockOps of at most one block each; a backend runs each BlockOp to completion (resubmitting
// short transfers and -EAGAIN) and reports its final status to the owning request.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/io/io_error.h"

namespace tierlift::io {

class IoRequest {
 public:
  IoRequest(bool is_write, int64_t num_ops) : is_write_(is_write), pending_(num_ops) {}
  bool is_write() const { return is_write_; }
  bool done() const { return finished_.load(std::memory_order_acquire); }
  // Blocks until every block is finished; returns the first failure (or ok).
  IoStatus wait();
  // Called by backends once per BlockOp; the last call runs the completion hook and wakes
  // waiters. Only the first error is kept.
  void complete_one(const IoStatus& status);
  // Runs after all blocks are done and before waiters wake (bounce copy-out, buffer release).
  void set_on_done(std::function<void(IoStatus&)> fn) { on_done_ = std::move(fn); }

 private:
  const bool is_write_;
  std::atomic<int64_t> pending_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> finished_{false};
  IoStatus status_;
  std::function<void(IoStatus&)> on_done_;
};

struct BlockOp {
  int fd = -1;
  bool direct = false;   // fd is the O_DIRECT descriptor (buf/len/offset all 4 KiB aligned)
  int buffered_fd = -1;  // same file without O_DIRECT, for an unaligned remainder
  int fixed_index = -1;  // registered buffer index, -1 if none
  bool is_write = false;
  char* buf = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;                // file offset
  uint64_t done = 0;                  // bytes already transferred (short I/O resubmits the rest)
  const std::string* path = nullptr;  // owned by the engine's file table
  std::shared_ptr<IoRequest> req;

  IoStatus error(int err) const { return IoStatus{err, *path, offset + done}; }
};

}  // namespace tierlift::io
