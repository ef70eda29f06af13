// Staging for memory that O_DIRECT cannot address: a caller's buffer aligned below the file's
// direct-I/O memory alignment (torch's allocator gives 64 bytes; many block devices want 512).
// Each block borrows an aligned pool buffer only while it is in flight, so a request of any size
// streams through a bounded budget and the drive still sees O_DIRECT.
//
// A staged block's life: stage_acquire (a pool buffer), copy the caller's bytes in (write), the
// I/O, copy the bytes out (read), stage_release. The thread backend does all of it on the worker
// that runs the block (stage_begin/stage_end); the io_uring backend does the copies on its
// copier threads (core/io/copier.h), so its ring thread never copies.
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

// Gives a staged op its pool buffer (op.buf), without copying. When the pool is short: kWait if
// `can_wait` (the caller has staged ops in flight that will release theirs), else the op goes
// through the page cache straight on the caller's memory (no longer staged), and kReady.
// Unstaged ops, and staged ops that already hold a buffer, are kReady at once.
Stage stage_acquire(BlockOp& op, bool can_wait);

// Whether the op holds a pool buffer that stage_release must return.
inline bool stage_holds_buffer(const BlockOp& op) { return op.staged() && op.buf != nullptr; }

// Returns the op's pool buffer without copying. No-op for unstaged ops.
void stage_release(BlockOp& op);

// stage_acquire, then the caller's bytes copied in for a write, on the calling thread.
Stage stage_begin(BlockOp& op, bool can_wait);

// Copies what a read brought in out to the caller (also after a failure: the bytes that did
// arrive), on the calling thread, then stage_release. No-op for unstaged ops.
void stage_end(BlockOp& op);

}  // namespace tierlift::io
