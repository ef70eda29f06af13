#include "core/io/staging.h"

#include <cstring>

#include "core/io/aligned_pool.h"

namespace tierlift::io {

Stage stage_acquire(BlockOp& op, bool can_wait) {
  if (!op.staged() || op.buf != nullptr) return Stage::kReady;
  char* buf = static_cast<char*>(op.stage_pool->try_acquire(op.len));
  if (buf == nullptr) {
    if (can_wait) return Stage::kWait;
    // Nothing of ours will free pool memory soon: do not wait on the caller's other pool users.
    op.buf = op.user;
    op.user = nullptr;
    op.direct = false;
    op.fixed_index = -1;
    op.path_bytes->staged -= op.len;
    op.path_bytes->buffered += op.len;
    return Stage::kReady;
  }
  op.buf = buf;
  return Stage::kReady;
}

void stage_release(BlockOp& op) {
  if (!stage_holds_buffer(op)) return;
  op.stage_pool->release(op.buf);
  op.buf = nullptr;
}

Stage stage_begin(BlockOp& op, bool can_wait) {
  const bool had_buffer = op.buf != nullptr;
  const Stage s = stage_acquire(op, can_wait);
  if (s == Stage::kReady && !had_buffer && op.staged() && op.is_write) {
    std::memcpy(op.buf, op.user, op.len);
  }
  return s;
}

void stage_end(BlockOp& op) {
  if (!stage_holds_buffer(op)) return;
  if (!op.is_write) std::memcpy(op.user, op.buf, op.done);
  stage_release(op);
}

}  // namespace tierlift::io
