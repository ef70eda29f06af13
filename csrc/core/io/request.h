// The unit of work the backends see. A user read/write (an IoRequest) is split by the engine into
// BlockOps of at most one block each; a backend runs each BlockOp to completion (resubmitting
// short transfers and -EAGAIN) and reports its final status to the owning request.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
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
  // Blocks until every block is finished; returns the failure at the lowest file offset (or ok).
  IoStatus wait();
  // Called by backends once per BlockOp; the last call wakes waiters.
  void complete_one(const IoStatus& status);

 private:
  const bool is_write_;
  std::atomic<int64_t> pending_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> finished_{false};
  IoStatus status_;
};

class AlignedPool;
struct PathBytes;

struct BlockOp {
  int fd = -1;
  bool direct = false;     // fd is the O_DIRECT descriptor (buf, len and offset aligned)
  uint32_t dio_align = 0;  // the file's O_DIRECT offset and length granularity
  int buffered_fd = -1;    // same file without O_DIRECT, for an unaligned remainder
  int fixed_index = -1;    // registered buffer index, -1 if none
  bool is_write = false;
  char* buf = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;                // file offset
  uint64_t done = 0;                  // bytes already transferred (short I/O resubmits the rest)
  const std::string* path = nullptr;  // owned by the engine's file table
  std::shared_ptr<IoRequest> req;
  // Staged op (core/io/staging.h): `user` is the caller's memory, too loosely aligned for
  // O_DIRECT; buf is a pool buffer borrowed while the op is in flight.
  char* user = nullptr;
  AlignedPool* stage_pool = nullptr;
  PathBytes* path_bytes = nullptr;  // the engine's counters, for a staged op that falls back

  bool staged() const { return user != nullptr; }
  // Whether the rest of the op can go to the O_DIRECT descriptor.
  bool direct_now() const {
    return direct && (len - done) % dio_align == 0 && (offset + done) % dio_align == 0;
  }

  IoStatus error(int err) const { return IoStatus{err, *path, offset + done}; }
};

}  // namespace tierlift::io
