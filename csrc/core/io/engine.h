// The I/O engine: asynchronous reads and writes of memory ranges to files, torch-free.
//
// A request is split into blocks of `block_size` bytes; with several paths the blocks are
// striped round-robin across them (RAID-0 style: block k goes to path k % N at offset
// (k / N) * block_size), so N drives give N drives' bandwidth. Files are opened with O_DIRECT.
// Memory aligned to what the file's O_DIRECT needs (statx; often 4 bytes on NVMe, 512 on
// virtio) is read and written in place; other memory is staged block by block through the
// budgeted aligned pool (core/io/staging.h); tails below the file's direct-I/O granularity go
// through a second, buffered descriptor of the same file. A file system without O_DIRECT (tmpfs:
// EINVAL at open) falls back to buffered I/O with one warning; any other failure of the O_DIRECT
// open (EMFILE: out of descriptors) is an IoError, and the failed open leaves no file behind.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/io/aligned_pool.h"
#include "core/io/backend.h"
#include "core/io/staging.h"

namespace tierlift::io {

struct EngineOptions {
  std::string backend = "auto";  // auto | uring | threads; TIERLIFT_IO_BACKEND overrides auto
  int queue_depth = 32;
  size_t block_size = 1 << 20;   // bytes per request sent to the kernel; multiple of 4 KiB
  size_t pool_bytes = 64 << 20;  // aligned (bounce/staging) buffer budget
  bool direct = true;            // try O_DIRECT
  bool sqpoll = false;
  // Threads that copy staged blocks in and out of the pool (io_uring backend; the thread
  // backend's workers copy their own). 0: TIERLIFT_IO_COPY_THREADS, else 2-4 by core count.
  int copy_threads = 0;
};

class Engine {
 public:
  explicit Engine(const EngineOptions& opts);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Non-blocking. Throws IoError when a file cannot be opened (the request is not started),
  // std::invalid_argument for bad arguments and std::logic_error after close().
  std::shared_ptr<IoRequest> read(void* buf, size_t len, const std::vector<std::string>& paths,
                                  uint64_t offset);
  std::shared_ptr<IoRequest> write(const void* buf, size_t len,
                                   const std::vector<std::string>& paths, uint64_t offset);
  // Waits for every request in flight and fsyncs every file written; returns the first error.
  IoStatus sync();
  // Waits for in-flight requests, then closes the cached descriptors of `path`.
  void forget(const std::string& path);
  // sync() then releases the ring, the threads and the files. Idempotent.
  void close();
  bool closed() const { return backend_ == nullptr; }

  const char* backend_name() const { return name_.c_str(); }
  bool fixed_buffers() const { return fixed_; }
  bool fixed_files() const { return backend_ != nullptr && backend_->fixed_files(); }
  AlignedPool& pool() { return *pool_; }
  const EngineOptions& options() const { return opts_; }
  // Bytes sent each way so far (direct, staged, buffered).
  const PathBytes& path_bytes() const { return path_bytes_; }
  // Warnings produced so far (backend fallback, no O_DIRECT); each is returned once.
  std::vector<std::string> take_warnings();

 private:
  struct File {
    int fd = -1;           // O_DIRECT when direct
    int buffered_fd = -1;  // always buffered
    bool direct = false;
    uint32_t dio_mem_align = kAlign;  // what O_DIRECT needs of the memory address
    uint32_t dio_align = kAlign;      // ... and of the file offset and length
    bool writable = false;
    bool written = false;
    std::unique_ptr<std::string> path;  // stable address for BlockOp::path
  };
  File& open_file(const std::string& path, bool write);
  void close_file(File& f);  // its descriptors, released from the backend first
  // Closes the newest descriptors of `path` (opened by a request that then failed), and
  // removes the file when that request created it.
  void drop_newest(const std::string& path, bool created);
  std::shared_ptr<IoRequest> submit(char* buf, size_t len, const std::vector<std::string>& paths,
                                    uint64_t offset, bool write);
  BlockOp plan_op(File& f, char* mem, uint64_t len, uint64_t file_offset, bool write);
  void check_open(const char* op) const;
  void wait_all(IoStatus* first_error);

  EngineOptions opts_;
  std::string name_;
  std::unique_ptr<AlignedPool> pool_;
  std::unique_ptr<IoBackend> backend_;
  bool fixed_ = false;
  std::mutex mu_;
  std::unordered_map<std::string, std::vector<File>> files_;
  std::vector<std::shared_ptr<IoRequest>> inflight_;
  std::vector<std::string> warnings_;
  bool warned_no_direct_ = false;
  PathBytes path_bytes_;
};

}  // namespace tierlift::io
