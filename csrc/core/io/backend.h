// IoBackend: runs BlockOps asynchronously. Two implementations share this interface and the
// same tests: io_uring (liburing; one ring driven by one thread) and a pread/pwrite thread pool
// for kernels or containers where io_uring is unavailable.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/io/request.h"

namespace tierlift::io {

struct BackendOptions {
  int queue_depth = 32;      // io_uring entries in flight / threads of the fallback pool
  bool sqpoll = false;       // io_uring kernel submission-queue polling thread
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* name() const = 0;
  // Queues ops; each finishes with exactly one op.req->complete_one(). Never blocks on I/O.
  virtual void submit(std::vector<BlockOp> ops) = 0;
  // Registers one memory region as a fixed buffer (index 0). Returns false where not possible.
  virtual bool register_buffer(void* base, size_t len) {
    (void)base;
    (void)len;
    return false;
  }
};

std::unique_ptr<IoBackend> make_thread_backend(const BackendOptions& opts);
// Throws IoError (with the errno of io_uring_queue_init) when io_uring cannot be used, and
// std::runtime_error when tierlift was built without liburing.
std::unique_ptr<IoBackend> make_uring_backend(const BackendOptions& opts);
// Why io_uring cannot be used here, or "" when it can (probes io_uring_queue_init and reads
// /proc/sys/kernel/io_uring_disabled).
std::string uring_unavailable_reason();

// Runs one BlockOp synchronously with pread/pwrite (retrying EINTR/EAGAIN and short transfers);
// shared by the thread backend and the io_uring backend's unaligned-remainder path.
IoStatus run_blocking(BlockOp& op);

}  // namespace tierlift::io
