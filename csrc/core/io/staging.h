// Staging for memory that O_DIRECT cannot address: a caller's buffer aligned below the file's
// direct-I/O memory alignment (torch's allocator gives 64 bytes; many block devices want 512).
// Each block borrows an aligned pool buffer only while it is in flight, so a request of any size
// streams through a bounded budget and the drive still sees O_DIRECT.
#pragma once

#include <atomic>
#include <cstdint>

#include "core/io/request.h"

namespace tierlift::io {

// Bytes the engine sent each way since it was opened.
struct PathBytes {
  std::atomic<uint64_t> direct{0};    // O_DIRECT straight to or from the caller's memory
  std::atomic<uint64_t> staged{0};    // O_DIRECT through a pool buffer
  std::atomic<uint64_t> buffered{0};  // through the page cache
};

enum class Stage { kReady, kWait };

// Gives a staged op its pool buffer, copying the caller's bytes in for a write. When the pool
// is short: kWait if `can_wait` (the caller has staged ops in flight that will release theirs),
// else the op goes through the page cache straight on the caller's memory, and kReady.
// Unstaged ops are kReady at once.
Stage stage_begin(BlockOp& op, bool can_wait);

// Copies what a read brought in out to the caller (also after a failure: the bytes that did
// arrive) and returns the buffer. No-op for unstaged ops.
void stage_end(BlockOp& op);

}  // namespace tierlift::io
