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
  int queue_depth = 32;        // io_uring entries in flight / threads of the fallback pool
  bool sqpoll = false;         // io_uring kernel submission-queue polling thread
  void* fixed_base = nullptr;  // memory to register as io_uring fixed buffer 0, if any
  size_t fixed_len = 0;
  int copy_threads = 0;  // io_uring: threads for staging copies; 0: Copier::default_threads()
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* name() const = 0;
  // Queues ops; each finishes with exactly one op.req->complete_one(). Never blocks on I/O.
  virtual void submit(std::vector<BlockOp> ops) = 0;
  // Whether BackendOptions::fixed_base was registered (io_uring only, and only where the
  // kernel and RLIMIT_MEMLOCK allow); BlockOps with fixed_index 0 then use it.
  virtual bool fixed_buffers() const { return false; }
  // Whether descriptors are registered as io_uring fixed files (saves an fget per request).
  virtual bool fixed_files() const { return false; }
  // Called before the engine closes `fd`, with no request using it in flight.
  virtual void release_fd(int fd) { (void)fd; }
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
